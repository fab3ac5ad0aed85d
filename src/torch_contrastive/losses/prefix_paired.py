"""InfoNCE with paired negatives over every prefix in one pass (info-nce-pytorch's ``negative_mode="paired"``).

Query ``i``'s candidates are its key, the other keys (``in_batch_negatives=True``) and its own ``K`` negatives
``n_ik``: ``loss_p(i) = logaddexp(LSE over the keys, LSE over its negatives) - s cos_p(q_i, k_i)``. The keys' part is
a tile statistic, every prefix's from one pass over the bands
(:class:`~torch_contrastive.engine.prefix_lse.PrefixRowLSE`); the paired part and the positive are per row -- band dot
products summed into each prefix, ``O(N K D)`` -- and differentiated by autograd. With ``in_batch_negatives=False``
the keys' part is the positive alone and nothing is of size ``N^2``.

The false-negative rules (:mod:`._false_negatives`: duplicate ``key_ids`` / ``negative_ids``, a ``guide``'s verdict,
DCL's ``decoupled``) leave as the loss leaves them: the keys they mark leave the keys' log-sum-exp in its tiles
(an :class:`~torch_contrastive.positives.Exclusion`), the paired negatives they mark leave each query's own part, and
a query left without any candidate contributes 0 (the loss's convention). Label smoothing adds, per prefix,
``eps (s_ii - mean_c s_ic)`` over every candidate -- the keys' part from each prefix's sum of the normalised keys
(``O(M D)`` per prefix), the query's own negatives' from their cosines.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import _validation as v
from ..distributed import Scope
from ..engine.keywords import prefix_pass
from ..engine.prefixes import COLUMN_SCALE_LIMIT, inverse_norms, prefix_dots
from ._false_negatives import Rules, false_negative_rules, key_exclusion, paired_exclusion
from .prefix_forms import OnePass, name_non_finite

__all__ = ["paired_form"]


def paired_form(tensors: list[Tensor], kwargs: dict[str, Any], keys: set[str], tau: float | Tensor, chunk: int | None,
                reduction: str, scope: Scope) -> OnePass | None:
    """The one pass of ``info_nce_loss(query, key, negatives (N, K, D), negative_mode="paired")``, with
    ``in_batch_negatives`` either way; under ``gather=True`` among several ranks this rank's queries against every
    rank's keys (gathered with their gradients, key ``i`` at its global column), the paired negatives staying with
    their query, the loss over every rank's queries; the false-negative rules as the loss applies them (their ids and
    guide rows gathered with the keys); label smoothing over every candidate, as the loss smooths. None for anything
    else."""
    if not keys <= _PAIRED or kwargs.get("negative_mode") != "paired" or len(tensors) != 3:
        return None
    query, key, negatives = tensors
    in_batch = kwargs.get("in_batch_negatives", True)
    if (not isinstance(in_batch, bool) or query.ndim != 2 or key.shape != query.shape or negatives.ndim != 3
            or negatives.shape[0] != query.shape[0] or negatives.shape[2] != query.shape[1]):
        return None  # let the loss refuse it
    temperature = tau.reshape(()) if isinstance(tau, Tensor) else v.check_positive(tau, "temperature")
    checks = v.Checks(v.check_flag(kwargs.get("validate", True), "validate"))
    rules = false_negative_rules(query, negatives, True, kwargs.get("key_ids"), kwargs.get("negative_ids"), kwargs.get("guide"),
                                 kwargs.get("guide_margin", 0.0), kwargs.get("guide_margin_mode", "absolute"),
                                 kwargs.get("decoupled", False), float(kwargs.get("eps", 1e-12)), checks)
    checks.flush()
    smoothing = v.check_fraction(kwargs.get("label_smoothing", 0.0), "label_smoothing")
    if smoothing and rules.any:
        return None  # the loss refuses label smoothing with the false-negative rules (it then says why)

    def run(dims: list[int], weights: list[float], named: list[tuple[str, Tensor]] | None) -> Tensor:
        local = _paired(query, key.to(query.dtype), negatives.to(query.dtype), dims, weights, temperature, in_batch, chunk,
                        "none" if scope.distributed else reduction, scope, rules, smoothing)
        if not scope.distributed or reduction == "none":
            loss = local
        else:  # this rank's queries' terms; the mean over every rank's (a sum: the losses' gathered convention)
            loss = scope.finish(local.sum(), float(query.shape[0]) if reduction == "mean" else 1.0)
        if named is not None:
            name_non_finite(loss, named, temperature if isinstance(temperature, Tensor) else None)
        return loss

    return run


#: The arguments of ``info_nce_loss`` the paired one pass takes: the mode, the false-negative rules, label smoothing.
_PAIRED = {"negative_mode", "in_batch_negatives", "key_ids", "negative_ids", "guide", "guide_margin", "guide_margin_mode",
           "decoupled", "label_smoothing"}


def _paired(q: Tensor, k: Tensor, negs: Tensor, dims: list[int], weights: list[float], tau: float | Tensor, in_batch: bool,
            chunk: int | None, reduction: str, scope: Scope, rules: Rules, smoothing: float = 0.0) -> Tensor:
    n = q.shape[0]
    cuts = sorted(set(dims))
    which = list(cuts.index(d) for d in dims)
    dtype = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    x, y, z = q.to(dtype), k.to(dtype), negs.to(dtype)
    inv_q, inv_k, inv_n = (inverse_norms(t, cuts, 1e-12) for t in (x, y, z))  # as F.normalize floors each prefix
    positive = prefix_dots(x, y, cuts) * inv_q * inv_k  # (N, cuts)
    paired = prefix_dots(x[:, None, :], z, cuts)
    paired = paired * inv_q[:, None, :] * inv_n  # (N, K, cuts): each query's own negatives' cosines
    scale: float | Tensor = 1.0 / tau
    scale_t = scale.to(dtype) if isinstance(scale, Tensor) else scale
    pos, neg = positive[:, which] * scale_t, paired[:, :, which] * scale_t  # (N, P), (N, K, P)
    out = paired_exclusion(rules)  # (N, K): paired negatives the rules take out of their query's soft-max
    if out is not None:
        neg = neg.masked_fill(out[:, :, None], -torch.inf)
    keys_all = scope.rows(k) if in_batch else k  # every rank's keys under gather, gathered once
    if in_batch:  # the keys' log-sum-exp (every rank's under gather), positive included, every prefix from one pass over the bands
        s = scale if isinstance(scale, float) else None
        scales = torch.full((len(dims),), s, dtype=dtype, device=q.device) if s is not None else \
            scale_t.reshape(1).repeat(len(dims))  # type: ignore[union-attr]
        shifts = (s,) * len(dims) if s is not None and s <= COLUMN_SCALE_LIMIT[dtype] else None
        exclude = key_exclusion(rules, scope)  # the keys the rules mark (the positive kept, but under DCL)
        own = exclude is not None and exclude.diagonal is not None  # DCL without ids: the positive left out by place
        leave_out = (torch.arange(n, device=q.device) + scope.offset)[:, None] if own else \
            torch.empty(n, 0, dtype=torch.long, device=q.device)
        marks = exclude if exclude is not None and (exclude.relation is not None or exclude.guide is not None) else None
        keys_lse = prefix_pass("row_lse", q, keys_all, cuts, [1.0] * len(cuts), 1.0, tuple(which), leave_out, False, scales,
                               shifts, False, False, marks, chunk_size=chunk)
    else:  # the positive alone, or (DCL) nothing
        keys_lse = torch.full_like(pos, -torch.inf) if rules.decoupled else pos
    both = torch.stack([keys_lse, neg.logsumexp(1) if neg.shape[1] else torch.full_like(pos, -torch.inf)], -1)
    empty = torch.isneginf(both).all(-1)  # a query left without any candidate: 0, no gradient (the loss's convention)
    joined = torch.logsumexp(torch.where(empty[..., None], 0.0, both), -1)
    terms = torch.where(empty, 0.0, joined - pos)
    if smoothing:  # the loss's (1 - eps) CE + eps mean_c (LSE - s_ic) = CE + eps (s_ii - mean_c s_ic), per prefix
        uniform, count = neg.sum(1), negs.shape[1]  # each query's own negatives
        if in_batch:  # every key (every rank's under gather): s x_p(i) . sum_j y_p(j) / |y_p(j)|, per cut
            keys = keys_all.to(dtype)
            inv_all = inverse_norms(keys, cuts, 1e-12)
            summed = torch.stack([x[:, :cut] @ (keys[:, :cut] * inv_all[:, j, None]).sum(0) for j, cut in enumerate(cuts)], 1)
            uniform, count = uniform + (summed * inv_q)[:, which] * scale_t, count + keys.shape[0]
        else:  # the positive alone (smoothing refuses DCL: the rules)
            uniform, count = uniform + pos, count + 1
        terms = terms + smoothing * (pos - uniform / count)
    per_row = terms @ torch.tensor(weights, dtype=dtype, device=q.device)
    value = per_row if reduction == "none" else per_row.mean() if reduction == "mean" else per_row.sum()
    return value.to(torch.promote_types(q.dtype, torch.float32))
