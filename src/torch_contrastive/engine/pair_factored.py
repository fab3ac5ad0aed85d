"""The pair terms' one tile on a GPU plan: the backward products factored through tiles kept from forward.

PML's NT-Xent and NT-BXent on one bounded tile (:class:`~.one_tile._OneTilePairs`,
:class:`~.one_tile_half.HalfOneTilePairs`) need, in backward, ``H @ X`` for ``H = G + G^T`` (one set: both
roles of every pair), where each entry of ``G`` is a kept tile times a per-row coefficient. The CPU form builds
``G`` from its kept tiles and coefficients, adds ``G^T`` and multiplies once: about eight passes over the tile,
cheap where the tile sits in cache. On a GPU each pass is a read or a write of device memory, so here the
coefficients leave the tile and go to the GEMMs' other operand: for a kept tile ``K`` symmetric,

    (diag(u) K + K diag(u)) X = u * (K X) + K (u * X)     -- one GEMM of K against [u X | X]

and for one that is not, ``diag(u) K + K^T diag(u)`` reads ``K`` twice (``K X`` and ``K^T (u X)``). Backward then
moves only the kept tiles through the GEMMs -- no gradient tile is formed -- for twice (or three times) the GEMM
FLOPs of one product, which a one-tile size (a few thousand rows) has to spare. Forward uses the bool label mask
(a quarter of an fp32 pass per read) and keeps the tiles backward reads, in bf16 on tensor cores.

* **NT-BXent** (``binary``): ``G_ij = sigmoid(z_ij S_ij) (b_i - P_ij (a + b)_i)`` (``z = -1`` on positives, the
  self pair 0); kept ``sig = sigmoid(z S)`` and ``Q = sig * P`` (from the kept, rounded ``sig``: exact), both
  symmetric, so ``H X = b * (sig X) + sig (b X) - c * (Q X) - Q (c X)`` with ``c = a + b``. The positives'
  ``-a_i sig`` is ``b_i sig - c_i sig`` across two fp32-accumulated products: a rounding of the larger
  ``c_i / a_i`` times 2^-24 -- far below the kept tile's own bf16 rounding unless negatives weigh 10^4 times more.
* **PML NT-Xent** (``pair_softplus``): ``G_ij = r_i e^{S_ij}`` on negatives (``r_i = w_i g_i / N_i``) and
  ``-g_i sigmoid(log N_i - S_ij)`` on positives; kept ``E`` (the negatives' exponentials: symmetric) and ``T``
  (the positives' sigmoids: not symmetric), so ``H X = r * (E X) + E (r X) - g * (T X) - T^T (g X)`` -- the two
  parts never overlap, so nothing cancels. The positives' terms come from ``d = log N_i - S`` set to ``-inf``
  off the positives (``softplus(-inf) = sigmoid(-inf) = 0``: no mask multiplies).

That form is the tensor-core one tile's (the model's pick where the device is the longer: fewest bytes, 7
GEMM-equivalents). Where the model widens the products instead (a host-bound call, where launches cost more than
passes: :data:`ONE_KEPT`), forward folds everything but the incoming gradient into **one** kept tile -- PML's
``K = T - rho E`` (``rho_i = w_i / N_i``), NT-BXent's ``K = sigmoid(z S) W`` (``W`` its two means' weights laid
over the relation, ``-alpha_i`` on positives) -- and backward is ``K X + K^T X`` and one scaling: three launches
where the gradient tile took seven. On CPUs neither form runs: a tile in cache pays for passes less than for GEMMs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .pairwise import UNIT, _unit
from .precision import zero
from .products import scaled_blocks

#: ``mm(tile, operand)``: the backward product (fp32 ``torch.mm``, or tensor cores with an fp32 result).
Product = Callable[[Tensor, Tensor], Tensor]


def _operands(x: Tensor, operand: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """``[left * x | x | right * x]`` (N, 3D) in ``operand``'s dtype (``operand``: ``x`` rounded to it, the middle
    block's bits): a GEMM reads ``[:, :2D]`` and ``[:, D:]`` as they lie."""
    return scaled_blocks(x, (left, None, right), operand.dtype)


def binary_forward(s: Tensor, pos: Tensor, kept: torch.dtype) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """NT-BXent's positive and negative sums per row of one set's tile ``s`` (fp32, overwritten) on the bool
    relation ``pos`` (the self pair in neither); the tiles backward reads, in ``kept`` (the product dtype)."""
    zs = s.addcmul_(s, pos, value=-2)  # z S: -S on positives
    sig = torch.sigmoid(zs) if kept == s.dtype else torch.sigmoid(zs, out=torch.empty(s.shape, dtype=kept, device=s.device))
    loss = torch.nn.functional.softplus(zs)  # keeps a confident pair's small term (log1p form inside)
    sig.diagonal().zero_()  # the self pair: no term, no gradient
    loss.diagonal().zero_()
    pos_sum = torch.mul(loss, pos).sum(1)
    # the negatives' sum is the row's less the positives' (an absolute error of a rounding of the row's whole sum)
    neg_sum = loss.sum(1).sub_(pos_sum)
    return (pos_sum, neg_sum), (sig, torch.mul(sig, pos))


def binary_rows(tiles: tuple[Tensor, ...], grads: tuple[Tensor, ...], x: Tensor, operand: Tensor, mm: Product) -> Tensor:
    """``H @ x`` (fp32) for NT-BXent's ``H = G + G^T`` from the kept ``(sig, Q)`` and the per-row coefficients
    ``grads = (a, b)`` of the positive and negative sums; ``operand``: ``x`` as the products read it."""
    sig, q = tiles
    a, b = grads
    c = a + b
    dim = operand.shape[1]
    ops = _operands(x, operand, b, c)  # [b x | x | c x]
    first = mm(sig, ops[:, : 2 * dim])  # [sig (b x) | sig x]
    second = mm(q, ops[:, dim:])  # [Q x | Q (c x)]
    out = torch.addcmul(first[:, :dim], b[:, None], first[:, dim:])
    return out.sub_(second[:, dim:]).addcmul_(c[:, None], second[:, :dim], value=-1)


def _negatives_and_arguments(s: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """PML's ``E`` (the negatives' exponentials, the self pair and the positives 0), ``N_i`` (their row sums) and
    ``d = log N_i - S`` on the positives, ``-inf`` elsewhere (``s`` overwritten)."""
    e = torch.exp(s).masked_fill_(pos, 0.0)
    e.diagonal().zero_()
    neg_sum = e.sum(1)
    return e, neg_sum, torch.where(pos, torch.sub(neg_sum.log()[:, None], s, out=s), float("-inf"))


def softplus_forward(s: Tensor, pos: Tensor, summed: bool, kept: torch.dtype) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """PML NT-Xent's per-row sums of ``softplus(log N_i - S_ip)`` over the positives (``summed``: their total, a
    0-dim output) on one set's tile ``s`` (fp32, overwritten) and the bool relation ``pos`` (the self pair in
    neither; every other pair a negative); ``|S| <= 40``, so ``e^S`` needs no shift. A row without negatives has
    ``log N_i = -inf``: each of its terms and sigmoids is 0."""
    e, neg_sum, d = _negatives_and_arguments(s, pos)
    terms = torch.nn.functional.softplus(d)
    out = terms.sum() if summed else terms.sum(1)
    sig = torch.sigmoid_(d) if kept == d.dtype else torch.sigmoid(d, out=torch.empty(d.shape, dtype=kept, device=d.device))
    weight = sig.sum(1, dtype=neg_sum.dtype)
    return (out,), (e if kept == e.dtype else e.to(kept), sig, weight, neg_sum)


def softplus_rows(tiles: tuple[Tensor, ...], grads: tuple[Tensor, ...], x: Tensor, operand: Tensor, mm: Product) -> Tensor:
    """``H @ x`` (fp32) for PML NT-Xent's ``H = G + G^T`` from the kept ``(E, T, w, N)`` and the per-row
    coefficient ``grads = (g,)``."""
    e, sig, weight, neg_sum = tiles
    g = grads[0]
    r = weight * g / neg_sum.clamp_min(torch.finfo(neg_sum.dtype).tiny)  # 0 on a row without negatives (w = 0)
    dim = operand.shape[1]
    ops = _operands(x, operand, r, g)  # [r x | x | g x]
    first = mm(e, ops[:, : 2 * dim])  # [E (r x) | E x]
    out = torch.addcmul(first[:, :dim], r[:, None], first[:, dim:])
    out.sub_(mm(sig.t(), ops[:, 2 * dim :]))  # T^T (g x)
    return out.addcmul_(g[:, None], mm(sig, ops[:, dim : 2 * dim]), value=-1)


# ----------------------------------------------------------------------- widened: one kept tile, fewest launches
def softplus_one_kept(s: Tensor, pos: Tensor, combine: Any) -> tuple[Tensor, Tensor]:
    """PML NT-Xent's total (``combine = (UNIT, total)``: the mean over pairs) and the one tile backward reads,
    ``K = T - rho E`` (``rho_i = w_i / N_i``; the two parts never overlap), so that ``G = -g K`` for the incoming
    ``g`` times the total: backward is two GEMMs and a scaling."""
    e, neg_sum, d = _negatives_and_arguments(s, pos)
    value = torch.nn.functional.softplus(d).sum()
    sig = torch.sigmoid_(d)
    rho = sig.sum(1).div_(neg_sum.clamp_min(torch.finfo(neg_sum.dtype).tiny))  # 0 on a row without negatives
    total = combine[1]
    return (value if _unit(total) else value * total), sig.addcmul_(e, rho[:, None], value=-1)


def binary_one_kept(s: Tensor, pos: Tensor, combine: Any) -> tuple[Tensor, Tensor]:
    """NT-BXent's value ``total * sum_i (alpha_i P_i + beta_i N_i)`` (``combine = (weights, total)``, the weights
    stacked as one (2, N) tensor) as one dot product of the loss tile with ``W' = alpha_i`` on positives, ``beta_i``
    on negatives; the one tile backward reads, ``K = sigmoid(z S) W`` with ``W = -alpha_i`` on positives, so that
    ``G = g K`` for the incoming ``g`` times the total."""
    weights, total = combine
    alpha, beta = weights[0][:, None], weights[1][:, None]
    zs = s.addcmul_(s, pos, value=-2)
    loss = torch.nn.functional.softplus(zs)
    loss.diagonal().zero_()  # the self pair: no term
    value = torch.dot(loss.view(-1), torch.where(pos, alpha, beta).view(-1))
    sig = torch.sigmoid_(zs)
    sig.diagonal().zero_()  # ... and no gradient
    kept = sig.mul_(torch.where(pos, alpha.neg(), beta))
    return (value if _unit(total) else value * total), kept


def one_kept_rows(kept: Tensor, g: Tensor, total: Any, sign: float, x: Tensor) -> Tensor:
    """``H @ x = sign * g * total * (K + K^T) @ x`` for a kernel's one kept tile ``K`` (``G = sign g total K``)."""
    alpha = sign * total if isinstance(total, float) else sign
    out = torch.addmm(zero(x), kept, x, beta=0, alpha=alpha).addmm_(kept.t(), x, alpha=alpha)
    return out.mul_(g if isinstance(total, float) else g * total)


#: The widened one tile's forms (a GPU plan's fp32 products: a host-bound call, fewest launches): ``kernel ->
#: (forward(s, pos, combine) -> (value, K), the sign of G = sign g total K, whether it serves a combine)``.
ONE_KEPT: dict[str, tuple[Callable[..., tuple[Tensor, Tensor]], float, Callable[[Any], bool]]] = {
    "pair_softplus": (softplus_one_kept, -1.0, lambda combine: combine[0] is UNIT),
    "binary": (binary_one_kept, 1.0, lambda combine: isinstance(combine[0], Tensor)),
}


#: Each pair kernel's device form: ``(forward(s, pos, summed, kept), rows(tiles, grads, x, operand, mm))``.
FORMS: dict[str, tuple[Callable[..., Any], Callable[..., Tensor]]] = {
    "binary": (lambda s, pos, summed, kept: binary_forward(s, pos, kept), binary_rows),
    "pair_softplus": (softplus_forward, softplus_rows),
}
