"""The label conventions that score positive pairs one by one, over every prefix of the features in one
pass (Matryoshka representations): pytorch-metric-learning's NT-Xent and NT-BXent with labels, on the
prefix engine's band products, strips and shared backward (:mod:`.prefixes`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._tensors import save_for_backward
from .prefixes import LearnedScale, PerStrip, PrefixPlan, compute_dtype_of, operands, prefix_backward, prefix_products, scaled, weight_of

__all__ = ["PrefixPairs"]


class PrefixPairs(torch.autograd.Function):
    """The label conventions that score positive pairs one by one, over every prefix in one pass, on a single
    set (``candidates`` is ``anchors``; row ``i`` is column ``i``, never its own pair), positives by equal
    ``labels`` (M,) -- or, for NT-BXent, the directional (row, column) pairs ``labels`` lists as a (P, 2)
    tensor, the diagonal a positive too (counted in ``n_pos_i``, unscored):

    * ``"pair_softplus"`` (pytorch-metric-learning's NT-Xent): ``softplus(L_i - S_ip)`` per positive pair,
      ``L_i`` the log-sum-exp over row ``i``'s other-label columns (none: the pair scores 0); the mean over
      the positive pairs;
    * ``"binary"`` (NT-BXent): per row ``sum_pos softplus(-S_ip) / n_pos_i + sum_neg softplus(S_in) / n_neg_i``
      (``n_pos_i`` counts the row itself, unscored; no negative: 0); the mean over rows.

    ``col_labels`` (M,): the candidates carry labels of their own (a memory after the batch, whose column ``i``
    is still anchor ``i``, or the gathered batch of ``gather=True``, whose column ``own + i`` is anchor ``i``; with
    ``own`` None, a reference set: no self pair). ``plan.mean`` False sums instead.
    Forward keeps each prefix's ``L_i`` (pair_softplus); backward
    recomputes the tiles through :func:`prefix_backward`. A learnable (0-dim tensor) ``scale`` multiplies the
    cosines (then ``plan.scale`` is 1) and gets its gradient from the same tiles."""

    @staticmethod
    def forward(ctx: Any, anchors: Tensor, candidates: Tensor, plan: PrefixPlan, labels: Tensor,  # type: ignore[override]
                kernel: str, scale: Tensor | None = None, col_labels: Tensor | None = None, own: int | None = 0) -> Tensor:
        if scale is not None and plan.scale != 1.0:
            raise ValueError("a tensor scale needs plan.scale 1 (the cosines are the engine's logits)")
        a, c, inv_a, inv_c = operands(anchors, candidates, plan)
        s = None if scale is None else scale.detach().to(a.dtype)
        n, cuts = a.shape[0], plan.cuts
        lse = a.new_empty(n, len(cuts))
        per_anchor = a.new_zeros(n)
        counted = a.new_zeros(())  # positive pairs (pair_softplus) or rows (binary)
        for start in range(0, n, plan.strip):
            stop = min(start + plan.strip, n)
            pos, neg, n_pos, n_neg = _pair_masks(labels, start, stop, c.shape[0], col_labels, own)
            counted = counted + (pos.sum() if kernel == "pair_softplus" else stop - start)
            signs = _BinarySigns.of(pos, neg, n_pos, n_neg, a.dtype) if kernel == "binary" else None
            for k, raw in enumerate(prefix_products(a[start:stop], c, cuts)):
                logits = scaled(raw, plan, inv_a, inv_c, k, start, stop)
                if s is not None:  # a learnable scale: the plan's logits are the cosines
                    logits.mul_(s)
                if kernel == "pair_softplus":
                    lse[start:stop, k] = torch.logsumexp(logits.masked_fill(~neg, -torch.inf), 1)
                    terms = torch.where(pos, torch.nn.functional.softplus(lse[start:stop, k, None] - logits), 0.0).sum(1)
                elif signs is not None:
                    terms = signs.terms(logits)
                per_anchor[start:stop] += weight_of(plan, k) * terms
        save_for_backward(ctx, anchors, candidates, labels, lse, counted, labels if col_labels is None else col_labels,
                              *(() if scale is None else (scale,)))
        ctx.plan, ctx.kernel, ctx.own = plan, kernel, own
        total = per_anchor.sum()
        value = per_anchor if plan.rows else total / counted.clamp_min(1) if plan.mean else total
        return value.to(torch.promote_types(anchors.dtype, torch.float32))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        anchors, candidates, labels, lse, counted, col_labels, *given = ctx.saved_tensors
        plan: PrefixPlan = ctx.plan
        kernel: str = ctx.kernel
        dtype = compute_dtype_of(anchors)
        learned = LearnedScale(given, dtype, grad.device)
        masks = PerStrip(lambda start, stop: _pair_masks(labels, start, stop, candidates.shape[0], col_labels, ctx.own))
        def signs_of(start: int, stop: int) -> _BinarySigns | None:
            if kernel != "binary":
                return None
            pos, neg, n_pos, n_neg = masks(start, stop)
            return _BinarySigns.of(pos, neg, n_pos, n_neg, dtype)

        binary = PerStrip(signs_of)

        def pair_tile(logits: Tensor, k: int, start: int, stop: int) -> Tensor:
            """d (row terms) / d logits of one strip and prefix."""
            signs = binary(start, stop)
            if signs is not None:
                return signs.tile(logits)
            pos, neg = masks(start, stop)[:2]
            row_lse = lse[start:stop, k, None]
            sig = torch.where(pos, torch.sigmoid(row_lse - logits), 0.0)  # -d term / d S_ip
            # a negative's share of its row's positives' terms: sum_p sigmoid(L_i - S_ip) * softmax_neg(S_in)
            share = torch.where(neg, torch.exp(logits - row_lse) * sig.sum(1, keepdim=True), 0.0)
            return share.sub_(sig)

        def grad_tile(cos: Tensor, k: int, start: int, stop: int, weight: Tensor) -> Tensor:
            tile = pair_tile(learned.logits(cos), k, start, stop)
            if g_rows is not None:  # per-row values: each row's own incoming gradient
                tile.mul_(g_rows[start:stop, None])
            return learned.back(tile, cos, weight)

        g_rows = grad.to(dtype) if plan.rows else None
        if plan.rows:
            g = torch.ones((), dtype=dtype, device=grad.device)
        else:
            g = grad.to(dtype) / counted.clamp_min(1).to(dtype) if plan.mean else grad.to(dtype)
        da, dc = prefix_backward(anchors, candidates, plan, g, grad_tile)
        return (da.to(anchors.dtype) if ctx.needs_input_grad[0] else None,
                dc.to(candidates.dtype) if ctx.needs_input_grad[1] else None, None, None, None,
                learned.grad.to(given[0]) if given and ctx.needs_input_grad[5] else None, None, None)


def _pair_masks(relation: Tensor, start: int, stop: int, m: int, col_labels: Tensor | None = None,
                own: int | None = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Rows ``start:stop`` against ``m`` candidates by label (the candidates' own ``col_labels``, or the rows'),
    or by listed pairs: (positives -- the row's relation, not the row itself --, negatives, the positives per row
    with the row itself, the negatives per row). Row ``i`` is candidate ``own + i``; ``own`` None: no candidate
    is the row itself (a reference set)."""
    local = torch.arange(stop - start, device=relation.device)
    if relation.ndim == 1:
        same = relation[start:stop, None] == (relation if col_labels is None else col_labels)[None, :]
        if own is None:
            return same, ~same, same.sum(1), m - same.sum(1)
    else:  # (P, 2) pairs of one set: the strip's rows marked without a host read (a pair listed twice counts once)
        inside = (relation[:, 0] >= start) & (relation[:, 0] < stop)
        hits = torch.zeros(stop - start, m, dtype=torch.int32, device=relation.device)
        hits.index_put_((torch.where(inside, relation[:, 0] - start, 0), relation[:, 1]), inside.to(torch.int32), accumulate=True)
        same = hits > 0
        own = 0 if own is None else own
        same[local, local + (start + own)] = True  # the row itself: always a positive
    n_pos = same.sum(1)
    pos = same.clone()
    pos[local, local + (start + own)] = False
    return pos, ~same, n_pos, m - n_pos


class _BinarySigns:
    """A strip's NT-BXent pairs as signs and weights, built once for every prefix: a positive's term is
    ``softplus(-S) / n_pos``, a negative's ``softplus(S) / n_neg``, i.e. ``w softplus(z S)`` with ``z = -1`` on the
    positives and ``+1`` elsewhere and ``w`` the pair's weight (0 off the pairs: the row itself); its gradient
    ``z w sigmoid(z S)``. One softplus (or sigmoid) of the signed logits keeps a confident pair's small term
    and gradient to their digits (no ``1 - sigmoid``), in four ops a tile where the masked forms took about ten."""

    def __init__(self, sign: Tensor, weight: Tensor) -> None:
        self.sign, self.weight, self.signed_weight = sign, weight, sign * weight

    @staticmethod
    def of(pos: Tensor, neg: Tensor, n_pos: Tensor, n_neg: Tensor, dtype: torch.dtype) -> _BinarySigns:
        p, q = pos.to(dtype), neg.to(dtype)
        weight = p / n_pos.to(dtype)[:, None] + q / n_neg.clamp_min(1).to(dtype)[:, None]
        return _BinarySigns(1.0 - 2.0 * p, weight)

    def terms(self, logits: Tensor) -> Tensor:
        """Each row's ``sum_pos softplus(-S) / n_pos + sum_neg softplus(S) / n_neg``."""
        return torch.nn.functional.softplus(logits * self.sign).mul_(self.weight).sum(1)

    def tile(self, logits: Tensor) -> Tensor:
        """d (row terms) / d logits."""
        return torch.sigmoid(logits * self.sign).mul_(self.signed_weight)
