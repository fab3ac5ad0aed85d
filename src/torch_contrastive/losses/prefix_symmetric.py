"""One set's soft-max losses over every prefix from the upper triangle (NT-Xent's pairings, SupCon by labels or
views): half the products and half the tile work of the square.

Row ``i``'s loss of prefix ``p`` is ``LSE_p(i) - positive_p(i)``: a log-sum-exp over every other row, and a
positive part linear in the logits -- the partner's logit (NT-Xent) or the mean logit over the same-key rows
(SupCon). One set's log-sum-exp is a symmetric statistic, so its tiles are visited once per pair
(:class:`~torch_contrastive.engine.prefix_lse.PrefixRowLSE` with ``upper``); the positive part needs no tile at all:
``sum_{j in P(i)} s cos_p(i, j) = s x_p(i) . (K_p(y_i) - x_p(i))`` with ``x_p`` the normalised prefix rows and
``K_p(y)`` the sum of key ``y``'s rows, O(N D) per prefix, differentiated by autograd. The keys are grouped by a
sort (no host read). Taken under a fixed shift (``1 / tau`` within the bounded regime), as the engine's one set.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..engine.keywords import prefix_pass
from ..engine.prefixes import COLUMN_SCALE_LIMIT, Targets, inverse_norms, prefix_dots

__all__ = ["upper_softmax"]


def covers(anchors: Tensor, candidates: Tensor, targets: Targets, scale: float, reverse: Tensor | None) -> bool:
    """Whether :func:`upper_softmax` computes this one-pass call: one set (every row an anchor), its self left out, a
    partner (DCL's too, a batch of more than two rows) or one key per row, nothing else changed, a fixed scale."""
    plain = (targets.sample_mask is None and not targets.columns and not targets.by_pairs and not targets.smoothing
             and targets.offset == 0 and targets.positive_weight is None and targets.population is None and not targets.leave_out)
    partner = targets.partner is not None and targets.row_keys is None and (not targets.exclude_positive or anchors.shape[0] > 2)
    keys = (targets.partner is None and isinstance(targets.row_keys, Tensor) and targets.col_keys is targets.row_keys
            and not targets.exclude_positive)
    dtype = anchors.dtype if anchors.dtype in (torch.float32, torch.float64) else torch.float32
    return (candidates is anchors and reverse is None and targets.exclude_self and plain and (partner or keys)
            and scale <= COLUMN_SCALE_LIMIT[dtype])


def upper_softmax(z: Tensor, targets: Targets, dims: list[int], weights: list[float], scale: float, eps: float,
                  chunk: int | None, mean: bool, per_row: bool) -> Tensor:
    """``sum_p w_p * loss_p`` of one set (see the module docstring): the mean over the counted rows (rows with a
    positive), their sum (``mean`` False), or per row (``per_row``: each row's weighted sum over the prefixes)."""
    n = z.shape[0]
    cuts = sorted(set(dims))
    which = tuple(cuts.index(d) for d in dims)
    dtype = z.dtype if z.dtype in (torch.float32, torch.float64) else torch.float32
    rows = torch.arange(n, device=z.device)
    leave = rows[:, None] if not targets.exclude_positive else torch.stack([rows, targets.partner], 1)  # type: ignore[list-item]
    lse = prefix_pass("row_lse", z, z, cuts, [1.0] * len(cuts), 1.0, which, leave, False,
                      torch.full((len(dims),), scale, dtype=dtype, device=z.device), (scale,) * len(dims), True, eps=eps,
                      chunk_size=chunk, upper=True)
    x = z.to(dtype)
    inv = inverse_norms(x, cuts, eps)
    if targets.partner is not None:
        partner = targets.partner
        positive = prefix_dots(x, x[partner], cuts) * inv * inv[partner] * scale  # (N, cuts): the partner's logit
        count = None
    else:
        positive, count = _key_positives(x, targets.row_keys, cuts, inv, scale)  # type: ignore[arg-type]
    terms = lse - positive[:, list(which)]
    if count is not None:  # an anchor without a positive is left out
        terms = torch.where(count[:, None] > 0, terms, 0.0)
    w = torch.tensor(weights, dtype=dtype, device=z.device)
    if per_row:
        value = terms @ w
    else:
        total = terms.sum(0) @ w
        counted = float(n) if count is None else (count > 0).sum().to(dtype)
        value = total / counted if mean else total
    return value.to(torch.promote_types(z.dtype, torch.float32))


def _key_positives(x: Tensor, keys: Tensor, cuts: list[int], inv: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``(mean positive logit per row and cut, positives per row)``: each key's rows summed per prefix (keys grouped
    by a sort: no host read), each row's dot with its key's sum less itself."""
    n = x.shape[0]
    order = keys.argsort()
    ordered = keys[order]
    group = torch.zeros(n, dtype=torch.long, device=x.device)
    group[1:] = (ordered[1:] != ordered[:-1]).cumsum(0)
    inverse = torch.empty_like(group).scatter_(0, order, group)  # row -> its key's group (at most n groups)
    count = torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, inverse, torch.ones_like(x[:, 0]))[inverse] - 1
    positive = []
    for k, cut in enumerate(cuts):
        unit = x[:, :cut] * inv[:, k, None]
        sums = torch.zeros(n, cut, dtype=x.dtype, device=x.device).index_add(0, inverse, unit)
        positive.append(((sums[inverse] - unit) * unit).sum(1) * scale / count.clamp_min(1))
    return torch.stack(positive, 1), count
