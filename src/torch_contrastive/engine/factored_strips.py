"""The soft-max terms' bounded tile loop, backward with its gradient tile factored: the products read
``E = exp(S)`` itself, and the row and column coefficients are applied to the O(N D) operands and
accumulators instead of to every logit.

In the bounded regime the gradient tile is ``G = diag(u) E + E diag(v)`` (``u_i = g_i exp(-LSE_i)``,
``v_j = h_j exp(-LSE'_j)``; the left-out entries of ``E`` zero). Its two products factor::

    G B   = u * (E B) + E (v * B)    = u * P1 + P2,   P = E [B | v B]
    G^T A = E^T (u * A) + v * (E^T A) = v * Q1 + Q2,   Q = E^T [A | u A]

so each tile costs its recomputed logits, one ``exp`` and the two GEMMs' reads -- no tile of
``u_i + v_j``, no multiply, and on tensor cores ``E`` is written in bf16 by the ``exp`` itself where
the formed tile was multiplied in fp32, then rounded by two more passes. The price is the GEMMs'
width: ``2 D`` where ``D`` (four GEMM-equivalents of ``2 R C D`` FLOPs where two), which the cost model
weighs against the passes saved (:data:`~.cost.FORMED_STRIPS`; the planner's ``factored``). A single
set's triangle keeps one accumulator with ``[A | u A]`` on both sides (its columns are its rows:
``u * P1 + P2``); without column terms (``v = 0``) the operands are not widened at all: ``G B = u * (E B)``,
``G^T A = E^T (u A)``.

On tensor cores the operands ``[B | v B]`` are rounded to bf16 once per call, as the split product's
``x`` is (:class:`~.products.SplitProducts`); ``E`` is rounded as it is written, where the formed
tile was rounded once: two roundings of 2^-9 per product term where one. fp16 keeps the formed tile:
``exp(S)`` past 65,504 (``S > 11``) overflows it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .left_out import Direction, inverse_exp
from .products import AnyProducts, _mm32, scaled_blocks
from .softmax_tiles import leave_out
from .tiling import Buffers, tiles

if TYPE_CHECKING:
    from .plans import SoftmaxPlan

__all__ = ["backward_factored"]


def _operand(m: Tensor, inner: Tensor | None, outer: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The products' other operand for one side, in ``dtype``: ``[M | inner * M]`` when both coefficients
    act (its product is finished by :func:`_finish`), ``inner * M`` without an outer one, ``M`` without an
    inner one."""
    if inner is None:
        return m.to(dtype)
    if outer is None:
        return torch.mul(m, inner[:, None], out=torch.empty(m.shape, dtype=dtype, device=m.device))
    return scaled_blocks(m, (None, inner), dtype)


def _finish(acc: Tensor, inner: Tensor | None, outer: Tensor | None) -> Tensor:
    """A side's gradient from its accumulated product: ``outer * P1 + P2`` (both coefficients), ``outer * P``
    (no inner one), ``P`` (no outer one)."""
    if outer is None:
        return acc
    if inner is None:
        return acc.mul_(outer[:, None])
    dim = acc.shape[1] // 2
    return torch.addcmul(acc[:, dim:], acc[:, :dim], outer[:, None])


def _add(acc: Tensor, e: Tensor, m: Tensor) -> None:
    """``acc += e @ m``: on tensor cores (bf16 ``e``) a product with fp32 accumulation added; else in the GEMM."""
    if e.dtype == torch.bfloat16:
        acc.add_(_mm32(e, m))
    else:
        acc.addmm_(e, m)


def backward_factored(prod: AnyProducts, a: Tensor, b: Tensor, row: Direction, col: Direction | None,
                      plan: SoftmaxPlan) -> tuple[Tensor, Tensor | None]:
    """``G @ B̂`` and ``G.T @ Â`` (unscaled, as :func:`~.softmax_tiles.backward_fixed` returns them) of the
    bounded tiles with ``G`` factored (see the module docstring).

    Args:
        prod: the call's products (their logits; on tensor cores bf16 ``E`` and operands).
        a: ``Â`` (R, D) in the compute dtype.
        b: ``B̂`` (C, D); ``a`` for a single set.
        row: ``(g, LSE)`` of the rows.
        col: ``(h, LSE')`` of the columns, or None (no column terms; a single set's are its rows).
        plan: the plan (its tile, triangle, left-out entries and the candidates that take a gradient).

    Memory: the logit tile, ``E`` (bf16 on tensor cores), and operands and accumulators of ``2 D`` columns.
    """
    u = row[0] * inverse_exp(row[1], plan)
    v = None if col is None else col[0] * inverse_exp(col[1], plan)
    dtype = torch.bfloat16 if prod.half else a.dtype
    rows, cols = a.shape[0], b.shape[0]
    # one set: [A | u A] on both sides of its triangle, one accumulator finished by u
    b_op = _operand(a, u, u, dtype) if plan.symmetric else _operand(b, v, u, dtype)
    a_op = None if plan.symmetric or not plan.grad_columns else _operand(a, u, v, dtype)
    acc_rows = a.new_zeros(rows, b_op.shape[1])
    acc_cols = None if plan.symmetric or a_op is None else a.new_zeros(cols, a_op.shape[1])
    bufs = Buffers(a.dtype, a.device)
    exps = Buffers(dtype, a.device) if dtype != a.dtype else None
    for r0, r1, c0, c1 in tiles(rows, cols, plan.tile, plan.symmetric):
        s = prod.logits(r0, r1, c0, c1, bufs.get(r1 - r0, c1 - c0))
        e = s.exp_() if exps is None else torch.exp(s, out=exps.get(r1 - r0, c1 - c0))
        leave_out(e, r0, r1, c0, c1, plan)
        _add(acc_rows[r0:r1], e, b_op[c0:c1])
        if plan.symmetric:
            if c0 != r0:  # a diagonal tile's E already holds both roles of its pairs
                _add(acc_rows[c0:c1], e.t(), b_op[r0:r1])
        elif acc_cols is not None and a_op is not None and c0 < plan.grad_columns:
            end = min(c1, plan.grad_columns)
            _add(acc_cols[c0:end], (e if end == c1 else e[:, : end - c0]).t(), a_op[r0:r1])
    if plan.symmetric:
        return _finish(acc_rows, u, u), None
    return _finish(acc_rows, v, u), None if acc_cols is None else _finish(acc_cols, u, v)
