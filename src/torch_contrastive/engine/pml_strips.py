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

The online regime (a small temperature, no bound on ``|S|``) keeps the general loop, which shifts by a running
maximum; so do fp16 products (``e^S`` overflows fp16 past ``S = 11``) and the CPU (in cache, passes cost less than
the factored form's wider products). :func:`~.cost.pair_factoring_pays` decides on a GPU plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._tensors import self_diagonal
from ..positives import KeyPositives
from .pair_strips import factored_walk
from .tiling import Buffers, tiles

if TYPE_CHECKING:
    from .plans import PairPlan
    from .products import AnyProducts

__all__ = ["softplus_backward", "softplus_forward"]


def _negative_sums(prod: AnyProducts, rows: int, cols: int, plan: PairPlan, triangle: bool) -> Tensor:
    """Sweep 1: ``N_i``, each row's sum of ``e^S`` over its negatives (a symmetric relation's upper triangle)."""
    a = prod.a
    neg_sum = a.new_zeros(rows)
    bufs = Buffers(a.dtype, a.device)
    offset = plan.positives.self_offset
    for r0, r1, c0, c1 in tiles(rows, cols, plan.tile, triangle):
        e = prod.logits(r0, r1, c0, c1, bufs.get(r1 - r0, c1 - c0)).exp_()  # |S| <= 40: no shift
        if plan.is_mixed(r0, c0):
            e.masked_fill_(plan.positives.tile(r0, r1, c0, c1), 0.0)
        diag = self_diagonal(e, r0, c0, offset)
        if diag is not None:  # the self pair: neither positive nor negative
            diag.zero_()
        neg_sum[r0:r1] += e.sum(1)
        if triangle and c0 != r0:
            neg_sum[c0:c1] += e.sum(0)
    return neg_sum


def softplus_forward(prod: AnyProducts, rows: int, cols: int, plan: PairPlan, single: bool) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """Each row's ``sum_p softplus(L_i - S_ip)``, and what backward keeps: ``(N, w)`` (the negatives' sums and the
    positives' sigmoid sums). ``single``: one set (its label relation walks the triangle in sweep 1)."""
    # one set's label relation is symmetric (the self pair on the main diagonal): its triangle serves sweep 1
    symmetric = single and isinstance(plan.positives, KeyPositives) and plan.positives.self_offset == 0
    neg_sum = _negative_sums(prod, rows, cols, plan, symmetric)
    lse = neg_sum.log()  # -inf on a row without negatives
    a = prod.a
    out, weight = a.new_zeros(rows), a.new_zeros(rows)
    bufs = Buffers(a.dtype, a.device)
    off = torch.full((), float("-inf"), dtype=a.dtype, device=a.device)  # d off the positives
    for r0, r1, c0, c1 in tiles(rows, cols, plan.tile, False):
        if not plan.is_mixed(r0, c0):  # no positive: no term, not even the logits
            continue
        n, m = r1 - r0, c1 - c0
        s = prod.logits(r0, r1, c0, c1, bufs.get(n, m))
        d = torch.where(plan.positives.tile(r0, r1, c0, c1), torch.sub(lse[r0:r1, None], s, out=s), off,
                        out=bufs.get(n, m, 1))
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
