"""NT-BXent's strips on a GPU plan: each tile's terms from one signed tile, and backward's products factored
through ``sigmoid(z S)`` and its positives' part, stacked into one buffer -- no gradient tile is formed.

Every pair's loss is ``softplus(z_ij S_ij)`` (``z = -1`` on positives, the self pair left out), and with the
per-row coefficients ``a`` of the positives' sum and ``b`` of the negatives' the gradient tile is

    G_ij = sigmoid(z_ij S_ij) (b_i - P_ij c_i),   c = a + b,

so with ``sig = sigmoid(z S)`` and ``Q = sig * P`` (both written once, stacked as ``[sig ; Q]`` in the products'
dtype -- bf16 on tensor cores, rounded as written)::

    G X_c   = b * (sig X_c) - c * (Q X_c)            -- one GEMM of [sig ; Q] against X_c
    G^T X_r = sig^T (b X_r) - Q^T (c X_r)            -- one GEMM of [sig ; Q]^T against [b X_r ; -c X_r]

A positive's ``-a_i sig`` is then ``b_i sig - c_i sig`` across two fp32-accumulated products: a rounding of ``c_i /
a_i`` times 2^-24, far below ``sig``'s own bf16 rounding (the one tile's argument, :mod:`.pair_factored`).

Forward writes ``z S`` over the logit tile (``S - 2 P S``: one op on the bool relation), then its softplus; a
row's negatives' sum is its whole sum less its positives' (an absolute error of a rounding of the row's sum, as
the one tile's, :mod:`.pair_factored`). A tile without a positive or self pair skips the relation. The CPU keeps
the formed tile (:mod:`.pairwise`): in cache, passes cost less than the wider products; so does a GPU plan whose
products run at the fp32 rate past about 280 features (:func:`~.cost.pair_factoring_pays`).

One set's symmetric relation (labels: ``plan.symmetric``, sorted or not) walks the upper triangle: with ``sig`` and
``Q`` symmetric, ``H = G + G^T`` is ``sig_ij (b_i + b_j) - Q_ij (c_i + c_j)``, so each tile's rows and, off the
diagonal, its columns take one GEMM each (:func:`_triangle`) -- half the tiles' elementwise work of the full walk.
Another relation (listed index pairs) visits every tile, on :func:`factored_walk` -- which PML's strips
(:mod:`.pml_strips`) share with their own two factors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .._tensors import self_diagonal
from .products import AnyProducts, scaled_blocks, tile_mm
from .tiling import Buffers, tiles

if TYPE_CHECKING:
    from .plans import PairPlan

__all__ = ["binary_backward", "binary_forward", "factored_walk", "serves"]


def serves(plan: PairPlan) -> bool:
    """Whether these strips run ``plan``: NT-BXent on a GPU plan's tile loop where the model prices them lower
    (``plan.factored``)."""
    return plan.factored and not plan.single_tile


def _signed(s: Tensor, pos: Tensor | None) -> Tensor:
    """``z S`` in place: ``-S`` on the positives (``pos`` None: a tile of negatives only)."""
    return s if pos is None else s.addcmul_(s, pos, value=-2)


def binary_forward(prod: AnyProducts, rows: int, cols: int, plan: PairPlan) -> tuple[Tensor, Tensor]:
    """``(sum over positives, sum over negatives)`` of ``softplus(z S)`` per row, over every tile (a symmetric
    relation's upper triangle: an off-diagonal tile's sums down its columns are its column block's rows')."""
    a = prod.a
    pos_sum, row_sum = a.new_zeros(rows), a.new_zeros(rows)
    bufs = Buffers(a.dtype, a.device)
    offset = plan.positives.self_offset
    for r0, r1, c0, c1 in tiles(rows, cols, plan.tile, plan.symmetric):
        s = prod.logits(r0, r1, c0, c1, bufs.get(r1 - r0, c1 - c0))
        pos = plan.positives.tile(r0, r1, c0, c1) if plan.is_mixed(r0, c0) else None
        loss = torch.nn.functional.softplus(_signed(s, pos))
        diag = self_diagonal(loss, r0, c0, offset)
        if diag is not None:  # the self pair: no term
            diag.zero_()
        both = plan.symmetric and c0 != r0
        row_sum[r0:r1] += loss.sum(1)
        if both:
            row_sum[c0:c1] += loss.sum(0)
        if pos is not None:
            part = torch.mul(loss, pos)
            pos_sum[r0:r1] += part.sum(1)
            if both:
                pos_sum[c0:c1] += part.sum(0)
    return pos_sum, row_sum.sub_(pos_sum)


def binary_backward(prod: AnyProducts, a: Tensor, b: Tensor, grads: tuple[Tensor, ...], plan: PairPlan) -> tuple[Tensor, Tensor | None]:
    """``G @ B̂`` and ``G.T @ Â`` (unscaled; one set's two roles, both needed) of every tile, factored (the module docstring); a symmetric
    relation's triangle: ``(G + G^T) @ Â`` alone (see :func:`_triangle`).

    Args:
        prod: the call's products (the logits).
        a: ``Â`` (R, D) in the compute dtype.
        b: ``B̂`` (C, D).
        grads: ``(a, b)``: the coefficients of each row's positives' and negatives' sums.
        plan: the plan (tile, relation, mixed tiles, the triangle walk).

    Memory: the logit tile and the stacked ``[sig ; Q]`` (twice a tile in bf16 on tensor cores).
    """
    coef_neg, both = grads[1], grads[0] + grads[1]
    if plan.symmetric:
        dtype = torch.bfloat16 if prod.half else a.dtype
        return _triangle(prod, a, coef_neg, both, plan, dtype), None
    offset = plan.positives.self_offset

    def stack(s: Tensor, out: Tensor, r0: int, r1: int, c0: int, c1: int) -> bool:
        return _signed_stack(s, out, plan, offset, (r0, r1, c0, c1))

    return factored_walk(prod, a, b, (coef_neg, both), plan, stack)


#: A tile's stack: ``stack(s, out, r0, r1, c0, c1)`` writes the tile's two factors into ``out`` (2n, m) from its
#: logits ``s`` (fp32, may be overwritten) -- the first into ``out[:n]``, the second, on a tile that holds a positive,
#: into ``out[n:]`` -- and says whether it did (a tile of negatives only has the first alone).
Stack = Callable[[Tensor, Tensor, int, int, int, int], bool]


def factored_walk(prod: AnyProducts, a: Tensor, b: Tensor, coefs: tuple[Tensor, Tensor], plan: PairPlan,
                  stack: Stack) -> tuple[Tensor, Tensor]:
    """``G @ X_c`` and ``G.T @ X_r`` over every tile for ``G = u * F - v * F'`` (per-row coefficients ``u, v``;
    ``F, F'`` the two factors ``stack`` writes; ``F'`` 0 on a tile of negatives only): one GEMM of ``[F ; F']``
    against the columns' rows, one of its transpose against ``[u X_r ; -v X_r]`` (formed once per row block).

    Args:
        prod: the call's products (the logits).
        a: ``X_r = Â`` (R, D) in the compute dtype.
        b: ``X_c = B̂`` (C, D).
        coefs: ``(u, v)``, each (R,).
        plan: the plan (tile).
        stack: writes a tile's factors (:data:`Stack`).

    Memory: the logit tile and the stacked factors (twice a tile in bf16 on tensor cores).
    """
    first, second = coefs
    dtype = torch.bfloat16 if prod.half else a.dtype
    rows, cols = a.shape[0], b.shape[0]
    x_cols = b.to(dtype)
    acc_rows = a.new_zeros(rows, a.shape[1])
    acc_cols = a.new_zeros(cols, a.shape[1])
    bufs, stacks = Buffers(a.dtype, a.device), Buffers(dtype, a.device)
    weighted: Any = None
    for r0, r1, c0, c1 in tiles(rows, cols, plan.tile, False):
        n, m = r1 - r0, c1 - c0
        out = stacks.get(2 * n, m)
        mixed = stack(prod.logits(r0, r1, c0, c1, bufs.get(n, m)), out, r0, r1, c0, c1)
        if c0 == 0:  # this row block's [u X ; -v X], formed once for its tiles
            weighted = _weighted(a[r0:r1], first[r0:r1], second[r0:r1], dtype)
        if not mixed:  # the first factor alone: G = u * F
            acc_rows[r0:r1].addcmul_(first[r0:r1, None], tile_mm(out[:n], x_cols[c0:c1]))
            acc_cols[c0:c1].add_(tile_mm(out[:n].t(), weighted[:n]))
            continue
        prod_rows = tile_mm(out, x_cols[c0:c1])  # [F X ; F' X]
        acc_rows[r0:r1].addcmul_(first[r0:r1, None], prod_rows[:n]).addcmul_(second[r0:r1, None], prod_rows[n:], value=-1)
        acc_cols[c0:c1].add_(tile_mm(out.t(), weighted))
    return acc_rows, acc_cols


def _signed_stack(s: Tensor, out: Tensor, plan: PairPlan, offset: int | None, at: tuple[int, int, int, int]) -> bool:
    """One tile's ``[sig ; Q]`` into ``out`` (2n, m) in the stacks' dtype, or ``sig`` alone (into ``out[:n]``) on a
    tile of negatives only, and whether the tile is mixed; ``sig`` 0 at the self pair, ``Q`` from the rounded ``sig``
    (exact)."""
    r0, r1, c0, c1 = at
    n = r1 - r0
    pos = plan.positives.tile(r0, r1, c0, c1) if plan.is_mixed(r0, c0) else None
    sig = torch.sigmoid(_signed(s, pos), out=out[:n])
    diag = self_diagonal(sig, r0, c0, offset)
    if diag is not None:  # the self pair: no gradient
        diag.zero_()
    if pos is not None:
        torch.mul(sig, pos, out=out[n:])
    return pos is not None


def _triangle(prod: AnyProducts, x: Tensor, coef_neg: Tensor, both: Tensor, plan: PairPlan, dtype: torch.dtype) -> Tensor:
    """``H @ X`` for one set's symmetric relation over the upper-triangle tiles, ``H = G + G^T``: with ``sig`` and
    ``Q`` symmetric, ``H_ij = sig_ij (b_i + b_j) - Q_ij (c_i + c_j)``, so a tile's rows take ``[sig ; Q] @ [X | b X |
    c X]`` (three blocks of which four of the six products are read) and, off the diagonal, its columns ``[sig ;
    Q]^T @ [[X | b X | 0] ; [0 | -c X | -X]]``."""
    rows, dim = x.shape
    z = scaled_blocks(x, (None, coef_neg, both), dtype)  # [X | b X | c X]
    acc = x.new_zeros(rows, dim)
    bufs, stacks = Buffers(x.dtype, x.device), Buffers(dtype, x.device)
    w: Any = None
    for r0, r1, c0, c1 in tiles(rows, rows, plan.tile, True):
        n = r1 - r0
        full = stacks.get(2 * n, c1 - c0)
        mixed = _signed_stack(prod.logits(r0, r1, c0, c1, bufs.get(n, c1 - c0)), full, plan, plan.positives.self_offset,
                              (r0, r1, c0, c1))
        stack = full if mixed else full[:n]
        if c0 == r0:  # this row block's column operand, formed once for its tiles
            w = _column_blocks(x[r0:r1], coef_neg[r0:r1], both[r0:r1], dtype)
        top = tile_mm(stack, z[c0:c1] if mixed else z[c0:c1, : 2 * dim])
        out = acc[r0:r1].addcmul_(coef_neg[r0:r1, None], top[:n, :dim]).add_(top[:n, dim : 2 * dim])
        if mixed:
            out.addcmul_(both[r0:r1, None], top[n:, :dim], value=-1).sub_(top[n:, 2 * dim :])
        if c0 == r0:  # a diagonal tile's H already holds both roles of its pairs
            continue
        side = tile_mm(stack.t(), w if mixed else w[:n, : 2 * dim])  # [sig^T X | sig^T b X - Q^T c X | -Q^T X]
        out = acc[c0:c1].addcmul_(coef_neg[c0:c1, None], side[:, :dim]).add_(side[:, dim : 2 * dim])
        if mixed:
            out.addcmul_(both[c0:c1, None], side[:, 2 * dim :])
    return acc


def _column_blocks(x: Tensor, coef_neg: Tensor, both: Tensor, dtype: torch.dtype) -> Tensor:
    """``[[X | b X | 0] ; [0 | -c X | -X]]`` (2n, 3D) in ``dtype``: an off-diagonal tile's column operand."""
    n, dim = x.shape
    out = torch.zeros(2 * n, 3 * dim, dtype=dtype, device=x.device)
    out[:n, : 2 * dim] = scaled_blocks(x, (None, coef_neg), dtype)
    out[n:, dim:] = scaled_blocks(x, (both.neg(), None), dtype)
    out[n:, 2 * dim :].neg_()
    return out


def _weighted(x: Tensor, first: Tensor, second: Tensor, dtype: torch.dtype) -> Tensor:
    """``[u x ; -v x]`` (2n, D) in ``dtype`` for the coefficients ``(u, v)`` of :func:`factored_walk` (NT-BXent's
    ``(b, c)``, PML's ``(r, g)``): the column product's other operand for one row block."""
    out = torch.empty(2 * x.shape[0], x.shape[1], dtype=dtype, device=x.device)
    torch.mul(x, first[:, None], out=out[: x.shape[0]])
    torch.mul(x, second.neg()[:, None], out=out[x.shape[0] :])
    return out

