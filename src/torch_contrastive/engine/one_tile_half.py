"""The lean one-tile executors for bf16 inputs on a GPU: fp32-accurate logits from one tensor-core GEMM, and
a gradient tile written once, in bf16, for the backward products.

:mod:`.one_tile` serves a small call in the compute dtype. On a GPU, bf16 inputs are multiplied on tensor
cores; the general executor's scheme (:class:`~.products.HalfProducts`) multiplies the caller's own rows and
applies normalisation and the scale to the fp32 tile as a row and a column factor -- two read-write passes
over the logits -- then rounds the gradient tile once per backward product. Here the logits cost one write:

* **Forward.** ``x = sqrt(scale) * z`` (``z`` the fp32 unit rows) splits into its fp16 rounding ``h`` and
  the rounded remainder ``l`` (``x = h + l`` to about 2^-22 of ``|x|``: fp16 keeps 11 bits, bf16 only 8,
  and ``|x| <= sqrt(scale)`` is well inside fp16's range). One GEMM over the features stacked three times,
  ``[h | l | h] @ [h | h | l]^T = h h^T + l h^T + h l^T``, gives ``scale * z_i . z_j`` to about 2^-21 of
  ``scale`` (the dropped ``l l^T`` is 2^-22 of it) with fp32 accumulation -- the split that emulates an
  fp32 product on half-precision units. It costs three GEMM-equivalents of FLOPs instead of one and saves
  the two factor passes: cheaper while ``D`` is below about ``4 * FLOP rate / bandwidth`` (about 1,100
  features on an H100), which covers embedding sizes the one-tile sizes meet.
* **Backward.** The gradient tile ``G`` is formed in fp32 and rounded once to bf16 as it is written
  (``torch.mul(..., out=bf16)``; bf16 has fp32's range, so no entry underflows); both products multiply it by
  ``x`` rounded to bf16 -- the same 2^-9 relative rounding as ``G``'s own (and as the dense formula's
  backward). A single set's ``H = G + G^T`` feeds one product, two sets' ``G`` two.

Per call, as in :mod:`.one_tile`, a reduction outside the engine, a tensor scale (a learnable temperature,
whose gradient needs the general scheme's split row product) and an ambient autocast go to the general
executor; so does a scale that is not positive (its square root). fp16 keeps the general scheme, which divides
each gradient tile by its largest magnitude before rounding (fp16's range is too narrow to round it unscaled).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .._tensors import as_dtype, save_for_backward
from .driver import first_order_only
from .normalization import l2_normalize, l2_normalize_backward
from .pair_factored import FORMS
from .pairwise import combined, combined_grads, total_only
from .precision import zero
from .products import SPLIT, _mm32, rounded_mul, split_rows
from .softmax import _total
from .softmax_tiles import _put, kept_apart_terms, put_both

if TYPE_CHECKING:
    from ..positives import KeyPositives
    from .plans import PairPlan, SoftmaxPlan
    from .softmax_tiles import FlatPlaces

__all__ = ["HalfOneTile", "HalfOneTileMask", "HalfOneTilePairs", "split_rows"]


class HalfOneTile(torch.autograd.Function):
    """:class:`~.one_tile._OneTile`'s soft-max terms (a strided relation kept apart: CLIP's and InfoNCE's
    diagonal, NT-Xent's pairings) from the split GEMM, the gradient tile rounded once."""

    @staticmethod
    def forward(ctx: Any, plan: SoftmaxPlan, total: tuple[Any, Any], scale: float, a: Tensor,  # type: ignore[override]
                b: Tensor | None) -> Tensor:
        places: FlatPlaces = plan.places  # type: ignore[assignment]
        n = a.shape[0]
        rows, denom, norm = l2_normalize((a if b is None else torch.cat((a, b))).float(), plan.eps)
        _, h, u, v = split_rows(rows, scale, a.dtype)
        e = _mm32(u, v.t()) if b is None else _mm32(u[:n], v[n:].t())
        e = e.exp_()
        d, d_col, row_total, excess, col_total, col_excess = kept_apart_terms(e, places, plan.columns)
        ctx.plan, ctx.total, ctx.scale, ctx.single, ctx.dtype = plan, total, scale, b is None, a.dtype
        save_for_backward(ctx, rows, denom, norm, h, e, row_total, excess, col_total, col_excess)
        return _total(d, d_col, total)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        first_order_only()
        rows, denom, norm, h, e, row_total, excess, col_total, col_excess = ctx.saved_tensors
        plan, total, dtype, root = ctx.plan, ctx.total, ctx.dtype, math.sqrt(ctx.scale)
        places: FlatPlaces = plan.places  # type: ignore[assignment]
        uniform = as_dtype(g * total[0], rows.dtype)  # d loss / d d_i, the same for every row
        w = uniform / row_total
        c = torch.addcmul(zero(w), w, excess, value=-1)  # the kept-apart positive's coefficient -w * excess
        if ctx.single:  # H = G + G^T = (w_i + w_j) e_ij, each positive in both roles; one product
            tile = rounded_mul(w.unsqueeze(1) + w, e, dtype)
            put_both(tile, places, c.to(dtype))
            ga = l2_normalize_backward(_mm32(tile, h), rows, denom, norm, plan.eps, root)
            return None, None, None, as_dtype(ga, dtype), None
        n = e.shape[0]
        if col_total is not None:
            uniform_col = uniform if total[1] is total[0] else as_dtype(g * total[1], rows.dtype)
            w_col = uniform_col / col_total
            tile = rounded_mul(w[:, None] + w_col, e, dtype)
            tile.diagonal().add_(c + torch.addcmul(zero(w_col), w_col, col_excess, value=-1))
        else:
            tile = rounded_mul(w[:, None], e, dtype)
            _put(tile, places.positives, c.to(dtype), accumulate=True)
        need_a, need_b = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        if not need_b:
            ga = l2_normalize_backward(_mm32(tile, h[n:]), rows[:n], denom[:n], norm[:n], plan.eps, root)
            return None, None, None, as_dtype(ga, dtype), None
        both = l2_normalize_backward(torch.cat([_mm32(tile, h[n:]), _mm32(tile.t(), h[:n])]), rows, denom, norm,
                                     plan.eps, root)
        both = as_dtype(both, dtype)
        return None, None, None, both[:n] if need_a else None, both[n:]


class HalfOneTileMask(torch.autograd.Function):
    """:class:`~.one_tile._OneTileMask`'s weighted rows over a label relation ``P`` (SupCon), from the split
    GEMM. ``P`` in fp16 (0/1 exact) is read by GEMMs, never as a tile pass: the positive sums are
    ``sum_j P_ij S_ij = x_i . (P x)_i`` with ``P x = P [h | l]`` summed, and backward's relation part
    ``(c_i + c_j) P_ij`` multiplies as ``c * (P x) + P (c x)``: ``c = -u beta`` with one scalar ``u``, so
    ``P (c x) = -u P (beta x)`` -- one more product with ``P`` when the rows are weighted (``beta``), none
    otherwise. A relation grouped by key (the planner's choice where the device is the longer,
    :func:`~.relation_form.reader_wants_mask`) has no ``P``: ``P x`` is then each key's sum of rows less the row's own
    (:meth:`~torch_contrastive.positives.KeyPositives.aggregate`: one index-add, fp32), O(N D) instead of a GEMM.
    The rows combine as ``sum_i alpha_i LSE_i - sum_i beta_i x_i . (P x)_i``: two dot products.

    A GPU plan whose half inputs the model widens (``plan.half`` False: a host-bound call, whose fewest launches
    are fp32 products, :data:`~.planner.WIDE`) runs the same scheme in fp32: no split, ``P`` in fp32, the
    gradient tile kept in fp32 -- still no tile pass for the relation."""

    @staticmethod
    def forward(ctx: Any, plan: SoftmaxPlan, total: tuple[Any, Any], scale: float, a: Tensor,  # type: ignore[override]
                alpha: Tensor | None, beta: Tensor | None) -> Tensor:
        rows, denom, norm = l2_normalize(a.float(), plan.eps)
        positives: KeyPositives = plan.positives  # type: ignore[assignment]  # (no cast() call: a small call pays it)
        relation = None  # the grouped form: P x as per-key sums (no mask, no relation GEMM)
        if plan.half:
            x, h, u, v = split_rows(rows, scale, a.dtype)
            s = _mm32(u, v.t())
            if positives.dense is None:
                px = positives.aggregate(x)
            else:
                dim = h.shape[1]
                relation = positives.dense_as(SPLIT)  # converted once per relation
                both = _mm32(relation, u[:, : 2 * dim])  # P [l | h]
                px = both[:, :dim] + both[:, dim:]  # P x, fp32
            factor, root = 1.0, math.sqrt(scale)  # x carries the scale's root
        else:  # the unit rows themselves: the scale applied by the GEMM and to the sums (no scaled copy: a launch)
            x = h = rows
            s = torch.addmm(zero(rows), rows, rows.t(), beta=0, alpha=scale)
            if positives.dense is None:
                px = positives.aggregate(x)
            else:
                relation = positives.dense_as(torch.float32)
                px = relation @ x
            factor = root = scale
        e = s.exp_()
        e.diagonal().zero_()  # the self pair
        row_sum = e.sum(1)
        # (left_out.log_total's plain case: the planner sends this executor nothing excluded, the self pair left
        # out and two rows or more, so every row holds a candidate)
        lse = row_sum.log()
        # sum_i alpha_i LSE_i - sum_i beta_i S_i.P_i as two dot products: the positive part over the flat (N, D)
        # rows, sum_i beta_i x_i . (P x)_i, beta x formed once (backward's relation product reads it) -- four ops
        # where per-row values weighted, subtracted and summed take seven, each a launch of a host-bound call
        weighted = x if beta is None else beta[:, None] * x
        out = torch.sub(lse.sum() if alpha is None else torch.dot(alpha, lse), torch.dot(weighted.view(-1), px.view(-1)),
                        alpha=factor)
        ctx.plan, ctx.total, ctx.root, ctx.dtype = plan, total, root, a.dtype
        save_for_backward(ctx, rows, denom, norm, h, e, row_sum, relation, px, weighted, alpha, beta)  # (h is x when widened)
        return out if isinstance(total[0], float) and total[0] == 1.0 else out * total[0]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        first_order_only()
        rows, denom, norm, h, e, row_sum, relation, px, weighted, alpha, beta = ctx.saved_tensors
        plan, dtype, half = ctx.plan, ctx.dtype, ctx.plan.half
        uniform = g * ctx.total[0]  # d loss / d out_i, the same for every row (fp32, as the output and the total)
        # each row's soft-max weight alpha / sum exp; the uniform factor multiplies the product after the GEMM
        w = row_sum.reciprocal() if alpha is None else alpha / row_sum
        # both roles of every pair (H = G + G^T), rounded once to bf16 for tensor cores (fp32 when widened)
        tile = rounded_mul(w.unsqueeze(1) + w, e, dtype) if half else torch.mul(w.unsqueeze(1) + w, e)
        # the relation's part, c_i P_ij + P_ij c_j with c = -beta (P symmetric: one set's key relation, the
        # diagonal cleared): -(beta * P x + P (beta x)); beta x is at most sqrt(scale) in magnitude, fp16's range
        if beta is None:
            relation_part = px * 2.0
        else:
            product = plan.positives.aggregate(weighted) if relation is None else _relation_product(relation, weighted, half)
            relation_part = torch.addcmul(product, beta[:, None], px)
        gx = (_mm32(tile, h) if half else tile @ h).sub_(relation_part).mul_(uniform)
        ga = l2_normalize_backward(gx, rows, denom, norm, plan.eps, ctx.root)
        return None, None, None, as_dtype(ga, dtype), None, None


def _relation_product(relation: Tensor, rows: Tensor, half: bool) -> Tensor:
    """``P @ rows`` in fp32 for the dense 0/1 relation ``P`` (fp16 on tensor cores, else fp32)."""
    return _mm32(relation, rows.to(SPLIT)) if half else relation @ rows


class HalfOneTilePairs(torch.autograd.Function):
    """:class:`~.one_tile._OneTilePairs`'s pair terms (PML's NT-Xent, NT-BXent with labels: one set's label relation)
    from the split GEMM, in the device form (:mod:`.pair_factored`): the fp32 tile's terms, the tiles backward reads
    kept in bf16, the products factored through them against ``x`` rounded to bf16 -- no gradient tile formed."""

    @staticmethod
    def forward(ctx: Any, plan: PairPlan, combine: Any, scale: float, a: Tensor) -> Tensor:  # type: ignore[override]
        rows, denom, norm = l2_normalize(a.float(), plan.eps)
        x, h, u, v = split_rows(rows, scale, a.dtype)
        s = _mm32(u, v.t())
        n = s.shape[0]
        # the products factored through the kept bf16 tiles (tensor-core products are a GPU's: its form)
        outputs, kept = FORMS[plan.kernel][0](s, plan.positives.tile(0, n, 0, n), total_only(combine), a.dtype)
        ctx.plan, ctx.combine, ctx.scale, ctx.dtype = plan, combine, scale, a.dtype
        save_for_backward(ctx, rows, denom, norm, x, h, *kept)
        return combined(outputs, combine)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        first_order_only()
        rows, denom, norm, x, h, *kept = ctx.saved_tensors
        grads = combined_grads(g, ctx.combine, rows.shape[0], rows.dtype)
        hx = FORMS[ctx.plan.kernel][1](tuple(kept), grads, x, h, _mm32)
        ga = l2_normalize_backward(hx, rows, denom, norm, ctx.plan.eps, math.sqrt(ctx.scale))
        return None, None, None, as_dtype(ga, ctx.dtype)
