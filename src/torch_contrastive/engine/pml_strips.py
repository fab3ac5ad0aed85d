"""PML NT-Xent's strips on a GPU plan, bounded regime: two forward sweeps of few passes, and backward's products
factored through the negatives' exponentials and the positives' sigmoids, stacked into one buffer -- no gradient
tile is formed.

Per positive pair the loss is ``softplus(L_i - S_ip)``, ``L_i = log N_i`` and ``N_i = sum_n e^{S_in}`` over the
row's negatives (pytorch-metric-learning's NT-Xent; :class:`~.pair_kernels._PairKernel` is the general loop). With
``w_i = sum_p sigmoid(L_i - S_ip)`` and the incoming per-row ``g``, the gradient tile is

    G_ij = r_i E_ij - g_i T_ij,    r_i = w_i g_i / N_i,

``E = e^S`` on the negatives (0 on the positives and the self pair), ``T = sigmoid(L_i - S)`` on the positives
(0 elsewhere): the two parts never overlap, so nothing cancels. Both are written once per tile, stacked as ``[E ;
T]`` in the products' dtype (bf16 on tensor cores, rounded as written; ``|S| <= 40`` keeps ``e^S`` in bf16's
range), and

    G X_c   = r * (E X_c) - g * (T X_c)          -- one GEMM of [E ; T] against X_c
    G^T X_r = E^T (r X_r) - T^T (g X_r)          -- one GEMM of [E ; T]^T against [r X_r ; -g X_r]

-- the coefficient layout of NT-BXent's ``[sig ; Q]`` (:mod:`.pair_strips`), whose walk this module shares.

Forward: sweep 1 sums each row's negatives' ``e^S`` (the positives cleared on the bool relation: an exact zero,
not a subtraction, so a confident model's dominant positive costs no digits). One set's symmetric relation (labels)
walks the upper triangle there: an off-diagonal tile's sums down its columns are its column block's rows'. Sweep 2
needs every row's ``L_i``: ``d = L_i - S`` set to ``-inf`` off the positives (``softplus(-inf) = sigmoid(-inf) =
0``: no mask multiplies), and each row's softplus and sigmoid sums; a tile without a positive (label-sorted rows)
is skipped there. A row without negatives has ``L_i = -inf``: its terms, sigmoids and gradient are 0.

A reduced value (``combine``: the loss's mean over pairs) is linear in its one incoming number, so backward's
products are formed in forward for an incoming 1 (:func:`softplus_with_gradient`): sweep 2 writes ``T`` once and
takes its two products there, a sweep 3 writes ``E`` once (a label relation's triangle again) -- three sweeps in all
where per-row outputs take four (two forward, :func:`softplus_backward`'s recomputed tile). Sweep 2's ``L_i - S`` is
written by its GEMM (:func:`~.products.offset_logits`), in both forms.

The online regime (a small temperature, no bound on ``|S|``) keeps the general loop, which shifts by a running
maximum; so do fp16 products (``e^S`` overflows fp16 past ``S = 11``) and the CPU (in cache, passes cost less than
the factored form's wider products). :func:`~.cost.pair_factoring_pays` decides on a GPU plan.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._tensors import self_diagonal
from ..positives import KeyPositives
from .pair_strips import factored_walk
from .products import OffsetTile, offset_logits, scaled_blocks, tile_mm
from .tiling import Buffers, tiles

if TYPE_CHECKING:
    from .plans import PairPlan
    from .products import AnyProducts

__all__ = ["softplus_backward", "softplus_forward", "softplus_with_gradient"]


def _negatives(prod: AnyProducts, plan: PairPlan, at: tuple[int, int, int, int], scratch: Tensor, out: Tensor) -> Tensor:
    """One tile's ``E``: ``e^S`` on its negatives (``|S| <= 40``: no shift), 0 on its positives and self pair, written
    into ``out`` (``scratch`` itself, or the products' dtype) from the logits formed in ``scratch``."""
    r0, r1, c0, c1 = at
    e = torch.exp(prod.logits(r0, r1, c0, c1, scratch), out=out)
    if plan.is_mixed(r0, c0):  # the positives: an exact zero, not a subtraction
        e.masked_fill_(plan.positives.tile(r0, r1, c0, c1), 0.0)
    diag = self_diagonal(e, r0, c0, plan.positives.self_offset)
    if diag is not None:  # the self pair: neither positive nor negative
        diag.zero_()
    return e


def _negative_sums(prod: AnyProducts, rows: int, cols: int, plan: PairPlan, triangle: bool) -> Tensor:
    """Sweep 1: ``N_i``, each row's sum of ``e^S`` over its negatives (a symmetric relation's upper triangle)."""
    a = prod.a
    neg_sum = a.new_zeros(rows)
    bufs = Buffers(a.dtype, a.device)
    for r0, r1, c0, c1 in tiles(rows, cols, plan.tile, triangle):
        scratch = bufs.get(r1 - r0, c1 - c0)
        e = _negatives(prod, plan, (r0, r1, c0, c1), scratch, scratch)
        neg_sum[r0:r1] += e.sum(1)
        if triangle and c0 != r0:
            neg_sum[c0:c1] += e.sum(0)
    return neg_sum


def _arguments(prod: AnyProducts, rows: int, cols: int, plan: PairPlan,
               lse: Tensor) -> Iterator[tuple[int, int, int, int, Tensor]]:
    """Sweep 2's tiles: ``(r0, r1, c0, c1, d)`` with ``d = L_i - S`` (written by the GEMM, :func:`~.products.offset_logits`)
    on the positives and ``-inf`` elsewhere (``softplus(-inf) = sigmoid(-inf) = 0``: no mask multiplies), over every
    tile that holds a positive (fp32, overwritten by the next tile)."""
    a = prod.a
    bufs = Buffers(a.dtype, a.device)
    off = torch.full((), float("-inf"), dtype=a.dtype, device=a.device)  # d off the positives
    offset_tile: OffsetTile | None = None
    for r0, r1, c0, c1 in tiles(rows, cols, plan.tile, False):
        if not plan.is_mixed(r0, c0):  # no positive: no term, not even the logits
            continue
        n, m = r1 - r0, c1 - c0
        if offset_tile is None:  # its operands formed once
            offset_tile = offset_logits(prod, lse)
        yield r0, r1, c0, c1, torch.where(plan.positives.tile(r0, r1, c0, c1), offset_tile(r0, r1, c0, c1, bufs.get(n, m)),
                                          off, out=bufs.get(n, m, 1))


def _symmetric(plan: PairPlan, single: bool) -> bool:
    """One set's label relation is symmetric (the self pair on the main diagonal): its upper triangle serves every
    sweep over the negatives."""
    return single and isinstance(plan.positives, KeyPositives) and plan.positives.self_offset == 0


def softplus_forward(prod: AnyProducts, rows: int, cols: int, plan: PairPlan, single: bool) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """Each row's ``sum_p softplus(L_i - S_ip)``, and what backward keeps: ``(N, w)`` (the negatives' sums and the
    positives' sigmoid sums). ``single``: one set (its label relation walks the triangle in sweep 1)."""
    neg_sum = _negative_sums(prod, rows, cols, plan, _symmetric(plan, single))
    out, weight = prod.a.new_zeros(rows), prod.a.new_zeros(rows)
    for r0, r1, _, _, d in _arguments(prod, rows, cols, plan, neg_sum.log()):  # log: -inf on a row without negatives
        out[r0:r1] += torch.nn.functional.softplus(d).sum(1)  # keeps a confident pair's small term
        weight[r0:r1] += d.sigmoid_().sum(1)
    return out, (neg_sum, weight)


def softplus_backward(prod: AnyProducts, a: Tensor, b: Tensor, grad: Tensor, kept: tuple[Tensor, ...],
                      plan: PairPlan) -> tuple[Tensor, Tensor]:
    """``G @ B̂`` and ``G.T @ Â`` (unscaled) of every tile, factored (the module docstring).

    Args:
        prod: the call's products (the logits).
        a: ``Â`` (R, D) in the compute dtype.
        b: ``B̂`` (C, D).
        grad: the incoming gradient of each row's output (R,).
        kept: ``(N, w)`` from :func:`softplus_forward`.
        plan: the plan (tile, relation, mixed tiles).

    Memory: the logit tile and the stacked ``[E ; T]`` (twice a tile in bf16 on tensor cores).
    """
    neg_sum, weight = kept
    lse = neg_sum.log()
    coef = weight * grad / neg_sum.clamp_min(torch.finfo(neg_sum.dtype).tiny)  # 0 on a row without negatives (w = 0)
    offset = plan.positives.self_offset

    def stack(s: Tensor, out: Tensor, r0: int, r1: int, c0: int, c1: int) -> bool:
        n = r1 - r0
        e = torch.exp(s, out=out[:n])
        diag = self_diagonal(e, r0, c0, offset)
        if diag is not None:  # the self pair: no gradient
            diag.zero_()
        if not plan.is_mixed(r0, c0):
            return False
        pos = plan.positives.tile(r0, r1, c0, c1)
        e.masked_fill_(pos, 0.0)
        torch.sigmoid(torch.sub(lse[r0:r1, None], s, out=s), out=out[n:]).mul_(pos)
        return True

    return factored_walk(prod, a, b, (coef, grad), plan, stack)


def softplus_with_gradient(prod: AnyProducts, a: Tensor, b: Tensor, plan: PairPlan, single: bool,
                           unit: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Each row's ``sum_p softplus(L_i - S_ip)`` and backward's products for the incoming per-row gradient
    ``unit``, formed in forward: a reduced loss (``combine``) is linear in its one incoming number, so backward
    only scales these (as Liger-Kernel's fused linear cross-entropy forms its gradient in forward).

    Sweep 1 sums the negatives (:func:`softplus_forward`'s). Sweep 2, over the tiles holding a positive, takes the
    terms and writes ``T`` once, in the products' dtype: ``T`` feeds its two products there (``T X_c`` and ``T^T
    (-g X_r)``) and its rounded row sums give ``w`` -- the ``T`` the products read, so a row's gradient sums to
    zero as the exact one does. With ``w`` known, sweep 3 writes ``E`` once and takes its products: ``r * (E X_c)``
    and ``E^T (r X_r)``; one set's symmetric relation walks the upper triangle there too (``E`` is symmetric), one
    GEMM of ``E`` against ``[X | r X]`` per tile side. Backward's recomputed tile and its ``[E ; T]`` stack are
    gone: the ``T`` written in sweep 2 is read where it is written.

    Args:
        prod: the call's products (the logits).
        a: ``X_r`` (R, D) in the compute dtype.
        b: ``X_c`` (C, D) (``a`` for one set).
        plan: the plan (tile, relation, mixed tiles).
        single: one set (both roles of every row).
        unit: (R,) the per-row gradient of the outputs a unit incoming gradient gives.

    Returns:
        ``(per-row terms, products)``: ``products`` is ``((G + G^T) @ X,)`` for one set, else ``(G @ X_c, G^T @
        X_r)`` -- unscaled, for a unit incoming gradient.

    Memory: the logit tile, ``T`` or ``E`` (a tile in bf16 on tensor cores) and (R + C) x D fp32 accumulators.
    """
    rows, cols, dim = a.shape[0], b.shape[0], a.shape[1]
    symmetric = _symmetric(plan, single)
    neg_sum = _negative_sums(prod, rows, cols, plan, symmetric)
    dtype = torch.bfloat16 if prod.half else a.dtype
    x_cols = b.to(dtype)
    neg_g = (a * unit.neg()[:, None]).to(dtype)  # -g X_r
    out, weight = a.new_zeros(rows), a.new_zeros(rows)
    t_rows, cols_acc = a.new_zeros(rows, dim), a.new_zeros(cols, dim)
    bufs, factors = Buffers(a.dtype, a.device), Buffers(dtype, a.device)
    for r0, r1, c0, c1, d in _arguments(prod, rows, cols, plan, neg_sum.log()):  # sweep 2: the terms, T's products
        out[r0:r1] += torch.nn.functional.softplus(d).sum(1)  # keeps a confident pair's small term
        t = torch.sigmoid(d, out=factors.get(r1 - r0, c1 - c0))  # 0 off the positives (d = -inf there)
        weight[r0:r1] += t.sum(1, dtype=a.dtype)
        t_rows[r0:r1] += tile_mm(t, x_cols[c0:c1])
        cols_acc[c0:c1] += tile_mm(t.t(), neg_g[r0:r1])
    coef = weight * unit / neg_sum.clamp_min(torch.finfo(neg_sum.dtype).tiny)  # r: 0 on a row without negatives

    def negatives(r0: int, r1: int, c0: int, c1: int) -> Tensor:
        """Sweep 3's ``E`` of a tile, in the products' dtype."""
        return _negatives(prod, plan, (r0, r1, c0, c1), bufs.get(r1 - r0, c1 - c0), factors.get(r1 - r0, c1 - c0))

    if symmetric:  # rows and columns one set: (G + G^T) X = r (E X) + E (r X) - g (T X) + T^T (-g X)
        both = scaled_blocks(a, (None, coef), dtype)  # [X | r X]
        e_acc = a.new_zeros(rows, 2 * dim)
        for r0, r1, c0, c1 in tiles(rows, rows, plan.tile, True):
            e = negatives(r0, r1, c0, c1)
            e_acc[r0:r1] += tile_mm(e, both[c0:c1])
            if c0 != r0:  # E symmetric: the tile's transpose is its column block's
                e_acc[c0:c1] += tile_mm(e.t(), both[r0:r1])
        total = cols_acc.addcmul_(coef[:, None], e_acc[:, :dim]).add_(e_acc[:, dim:])
        return out, (total.addcmul_(unit[:, None], t_rows, value=-1),)
    coef_x = (a * coef[:, None]).to(dtype)  # r X_r
    e_rows = a.new_zeros(rows, dim)
    for r0, r1, c0, c1 in tiles(rows, cols, plan.tile, False):  # sweep 3: E's products
        e = negatives(r0, r1, c0, c1)
        e_rows[r0:r1] += tile_mm(e, x_cols[c0:c1])
        cols_acc[c0:c1] += tile_mm(e.t(), coef_x[r0:r1])
    return out, (e_rows.mul_(coef[:, None]).addcmul_(unit[:, None], t_rows, value=-1), cols_acc)
