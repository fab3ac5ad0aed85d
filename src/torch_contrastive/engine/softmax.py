"""Soft-max terms per row (and per column): log-sum-exp plus the linear positive part.

For ``S = scale * A @ B.T`` (A, B optionally L2-normalised inside) this computes

    ``row_out_i = alpha_i * log sum_{j != self(i)} exp(S_ij) - beta_i * sum_j P_ij S_ij``

and, for two-set losses, the same per column (``log sum_i exp(S_ij)`` and
``sum_i P_ij S_ij``). NT-Xent (pairing rules), SupCon and the image-text loss are all
of this form; the positive part is linear in S, so it costs O(N * D) through
:meth:`~torch_contrastive.positives.Positives.aggregate`, not a tile pass.

Everything happens inside one ``torch.autograd.Function``: normalisation, logits, the
positive part and their backward, so a loss call adds only a handful of autograd nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .._tensors import as_dtype, mask_as, self_diagonal
from ._common import (
    Buffers,
    Scale,
    autocast_enabled,
    finish_gradients,
    prepare_inputs,
    save,
    saved,
    tiles,
)
from .confident import Apart, apart_rule, coefficient, coefficient_from_sums, margin
from .planner import decide
from .products import AnyProducts, make_products

if TYPE_CHECKING:
    from ..positives import Positives


@dataclass(frozen=True)
class _Plan:
    self_offset: int | None
    columns: bool
    symmetric: bool
    tile: int
    # True: |S| <= scale is small enough that exp(S) neither overflows nor underflows,
    # so no shift at all is needed; False: an online maximum keeps every exp finite.
    fixed: bool
    normalize: bool
    eps: float
    positives: Positives | None
    column_positives: bool
    # One tile, and the positive relation is cheap to lay over it (a partner per row, a
    # small dense or sample mask, index pairs): the positive part is read off the tile.
    # Otherwise (large key relations) it goes through Positives.aggregate in O(N * D).
    tile_positives: bool
    # The column weights alpha' are the row weights alpha (same tensor; passed once, as
    # torch.compile cannot trace a duplicate input).
    shared_alpha: bool
    # Distributed column statistics: an object with in-place ``all_sum(t)`` and
    # ``all_max(t)`` over ranks (a distributed.Scope). Each rank then holds only some
    # anchor rows, and the column log-sum-exp is completed across ranks.
    column_comm: Any = None
    # Only candidates [0, grad_columns) get a gradient; the rest are constants (a queue of
    # past keys, detached hard negatives), so their G.T @ A products are skipped.
    grad_columns: int = 0
    # Candidates left out of a row's denominator besides the self pair (false negatives:
    # equal ids, a guide model's verdict, DCL's positives): an object whose
    # ``tile(r0, r1, c0, c1)`` is the bool block to leave out (see positives.Exclusion).
    exclude: Any = None
    # "torch" (this module's tile loops) or "triton" (engine/triton_backend.py kernels)
    backend: str = "auto"
    # triton on a GPU: half-precision inputs reach tl.dot in this dtype (None: the compute dtype)
    operand_dtype: torch.dtype | None = None
    # torch backend: fp16/bf16 inputs multiplied as given on tensor cores (products.HalfProducts)
    half: bool = False
    # a row's single positive kept out of the soft-max sums and added back exactly (confident.py)
    apart: Apart | None = None

    @property
    def single_tile(self) -> bool:
        return self.tile == 0


def _log(total: Tensor, shift: Tensor | None, plan: _Plan, n_other: int) -> Tensor:
    """``log(total) (+ shift)``; 0 for a row without any candidate (a batch of one).

    With exclusions a row whose every candidate is left out gets ``-inf`` (an empty
    log-sum-exp), so callers combining several candidate groups can tell; the backward
    passes give such rows a zero gradient (:func:`_inverse_exp`).
    """
    out = total.log() if shift is None else total.log() + shift
    if plan.apart is not None:  # log of the excess over the positive: -inf when there is none
        return out
    if plan.exclude is not None:
        return torch.where(total > 0, out, float("-inf"))
    if plan.self_offset is not None and n_other <= 1:
        out = torch.where(total > 0, out, 0.0)
    return out


def _inverse_exp(lse: Tensor, plan: _Plan) -> Tensor:
    """``exp(-LSE)``, 0 for an empty row (``LSE = -inf``, possible only with exclusions)."""
    if plan.exclude is None:
        return torch.exp(-lse)
    return torch.where(torch.isneginf(lse), 0.0, torch.exp(-lse))


def _excluded(plan: _Plan, r0: int, r1: int, c0: int, c1: int) -> Tensor | None:
    """The tile's bool block of excluded candidates, or None (none, or only a diagonal)."""
    return None if plan.exclude is None else plan.exclude.tile(r0, r1, c0, c1)


def _drop(t: Tensor, plan: _Plan, r0: int, r1: int, c0: int, c1: int) -> None:
    """Zero the excluded entries of a tile of finite values (the fixed path's ``exp(S)``
    and gradient tiles): a strided diagonal and a multiplication by the 0/1 factor; the
    positives kept apart are zeroed too."""
    if plan.apart is not None:
        plan.apart.clear(t, r0, c0, 0.0)
    if plan.exclude is None:
        return
    diag = self_diagonal(t, r0, c0, plan.exclude.diagonal)
    if diag is not None:
        diag.zero_()
    plan.exclude.drop(t, r0, r1, c0, c1)


def _blank(t: Tensor, plan: _Plan, r0: int, c0: int, out: Tensor | None, value: float) -> None:
    """Set the excluded entries of a tile to ``value`` in place: an excluded strided
    diagonal (a view, as for the self pairs) and the masked block ``out``; the positives
    kept apart too."""
    if plan.apart is not None:
        plan.apart.clear(t, r0, c0, value)
    if plan.exclude is None:
        return
    diag = self_diagonal(t, r0, c0, plan.exclude.diagonal)
    if diag is not None:
        diag.fill_(value)
    if out is not None:
        t.masked_fill_(out, value)


_Direction = tuple[Tensor, Tensor]  # (gradient weight per index, its log-sum-exp)


# ----------------------------------------------------------------------- one tile
# A problem that fits in one tile (the common small batch) keeps that tile from forward
# to backward, and reads its positive part off the tile itself: no aggregate, no
# recomputed matrix product, a few large ops.
def _positive_layout(positives: Positives, plan: _Plan, rows: int, cols: int) -> tuple[str, Tensor | None]:
    """How the positives lie on the tile: a named strided layout ("identity", "adjacent",
    "halves"; no tensor), ("partner", column per row) or ("mask", R x C bool)."""
    if positives.layout is not None:
        return positives.layout, None
    if positives.kind == "partner" and positives.partner is not None:
        return "partner", positives.partner
    return "mask", positives.tile(0, rows, 0, cols)


def _strided_positives(t: Tensor, layout: str) -> list[Tensor]:
    """Views of the positive entries of a square tile under a strided layout.

    Returns views whose concatenation, in order, is row i's positive entry for every i:
    identity ``t[i, i]``; adjacent ``t[2k, 2k+1]`` and ``t[2k+1, 2k]`` (interleaved);
    halves ``t[i, i+N]`` then ``t[i+N, i]``.
    """
    if layout == "identity":
        return [t.diagonal()]
    if layout == "adjacent":
        return [t.diagonal(1)[::2], t.diagonal(-1)[::2]]
    half = t.shape[0] // 2
    return [t.diagonal(half), t.diagonal(-half)]


def _read_strided(t: Tensor, layout: str) -> Tensor:
    parts = _strided_positives(t, layout)
    if layout == "adjacent":
        return torch.stack(parts, 1).reshape(-1)
    # a copy, not a view: the tile is exponentiated in place afterwards
    return parts[0].clone() if len(parts) == 1 else torch.cat(parts)


def _tile_positive_sums(s: Tensor, plan: _Plan) -> tuple[Tensor, Tensor | None]:
    """``sum_j P_ij S_ij`` per row and (for two-set losses) ``sum_i P_ij S_ij`` per column, off the tile."""
    positives = plan.positives
    if positives is None:
        raise RuntimeError("internal: no positive relation")
    R, C = s.shape
    how, rel = _positive_layout(positives, plan, R, C)
    col_pos = None
    if rel is None:  # strided layout: a view, no index tensor
        row_pos = _read_strided(s, how)
        if plan.column_positives:  # identity: column j's positive is row j
            col_pos = row_pos if how == "identity" else s.new_zeros(C).index_add_(0, positives.require(positives.partner, "partner"), row_pos)
    elif how == "partner":
        row_pos = s.gather(1, rel[:, None])[:, 0]
        if plan.column_positives:
            col_pos = s.new_zeros(C).index_add_(0, rel, row_pos)
    else:  # a 0/1 float mask: a multiply is several times cheaper than torch.where (s is finite here)
        weight = mask_as(rel, s.dtype)
        row_pos = torch.linalg.vecdot(s, weight)
        col_pos = torch.linalg.vecdot(s.t(), weight.t()) if plan.column_positives else None
    return row_pos, col_pos


def _single_forward(prod: AnyProducts, R: int, C: int, plan: _Plan) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None,
                                                                             Tensor, tuple[Any, ...] | None]:
    """``(row_lse, col_lse, row_pos, col_pos, kept, sums)`` of a single tile.

    ``kept`` is ``exp(S)`` (fixed; self pairs zeroed) or ``S`` (online; self pairs at
    the lowest finite value), which backward reuses. ``sums``: in fixed mode, when no row
    can be empty, the row (and column) sums of ``exp(S)``, so that backward divides by
    them instead of computing ``exp(-LSE)``.
    """
    s = prod.logits(0, R, 0, C)
    row_pos, col_pos = _tile_positive_sums(s, plan) if plan.positives is not None and plan.tile_positives else (None, None)
    diag = self_diagonal(s, 0, 0, plan.self_offset)
    if plan.fixed:
        e = s.exp_()
        if diag is not None:
            diag.zero_()
        _drop(e, plan, 0, e.shape[0], 0, C)
        row_sum = e.sum(1)
        if plan.apart is not None and row_pos is not None and plan.exclude is None and (not plan.columns or col_pos is not None):
            return _single_apart(e, row_sum, row_pos, col_pos, plan)
        row_lse = _log(row_sum, None, plan, C)
        col_lse = col_sum = None
        if plan.columns:
            col_sum = e.sum(0)
            if plan.column_comm is not None:
                plan.column_comm.all_sum(col_sum)
            col_lse = col_sum.log()
        # every sum > 0 (exp > 0 in fixed mode) unless exclusions or a lone row can empty one
        nonempty = plan.exclude is None and plan.apart is None and C - (plan.self_offset is not None) >= 1
        return row_lse, col_lse, row_pos, col_pos, e, ((row_sum, col_sum) if nonempty else None)
    if diag is not None:
        diag.fill_(torch.finfo(s.dtype).min)
    out = _excluded(plan, 0, s.shape[0], 0, C)
    _blank(s, plan, 0, 0, out, torch.finfo(s.dtype).min)
    row_max = s.amax(1)
    e = torch.exp(s - row_max[:, None])
    if diag is not None:
        e.diagonal(plan.self_offset or 0).zero_()
    _blank(e, plan, 0, 0, out, 0.0)
    row_lse = _log(e.sum(1), row_max, plan, C)
    if not plan.columns:
        return row_lse, None, row_pos, col_pos, s, None
    col_max = s.amax(0)
    col_e = torch.exp(s - col_max[None, :])
    _blank(col_e, plan, 0, 0, out, 0.0)
    col_sum = col_e.sum(0)
    return row_lse, _complete_columns(col_sum, col_max, plan), row_pos, col_pos, s, None


def _single_apart(e: Tensor, excess: Tensor, row_pos: Tensor, col_pos: Tensor | None, plan: _Plan) -> tuple[Any, ...]:
    """The one bounded tile with each row's positive kept apart (confident.py), cheaply:
    ``d = log1p(excess / exp(S_p))`` and the totals ``excess + exp(S_p)`` that backward
    divides by (``exp(S_p)`` is finite in the bounded regime). ``sums`` then also carries
    the margins and the excesses: ``(total, total', d, d', excess, excess')``."""
    exp_pos = row_pos.exp()
    sums: list[Tensor | None] = [excess + exp_pos, None, torch.log1p(excess / exp_pos), None, excess, None]
    if plan.columns and col_pos is not None:
        col_excess = e.sum(0)
        col_exp = exp_pos if col_pos is row_pos else col_pos.exp()
        sums[1], sums[3], sums[5] = col_excess + col_exp, torch.log1p(col_excess / col_exp), col_excess
    return sums[2], sums[3], row_pos, col_pos, e, tuple(sums)


def _single_backward(kept: Tensor, prod: AnyProducts, b: Tensor, row: _Direction, col: _Direction | None,
                     c_row: Tensor | None, c_col: Tensor | None, plan: _Plan, by_sums: bool = False) -> tuple[Tensor, Tensor | None]:
    """``G @ B`` and ``G.T @ A`` of a single tile, positive part folded into G.

    Soft-max part ``G_ij = u_i p_ij + v_j q_ij`` (row and column soft-max), positive part
    ``G_ij += P_ij (c_i + c'_j)``. Symmetric: G already holds both roles of every row
    (``H = G + G.T``), so the positive part enters as ``P_ij c_i + P_ji c_j``.
    """
    if plan.fixed:  # exp(S_ij - LSE_i) = exp(S_ij) exp(-LSE_i): one exp per element for both directions
        # by_sums: row[1] / col[1] hold the sums of exp(S) themselves (exp(-LSE) = 1 / sum)
        u = row[0] / row[1] if by_sums else row[0] * _inverse_exp(row[1], plan)
        if plan.symmetric:
            g = kept * (u[:, None] + u[None, :])
        elif col is not None:
            v = col[0] / col[1] if by_sums else col[0] * _inverse_exp(col[1], plan)
            g = kept * (u[:, None] + v[None, :])
        else:
            g = kept * u[:, None]
    else:
        g = torch.exp(kept - row[1][:, None]).mul_(row[0][:, None])
        if plan.symmetric:
            g.add_(g.t().clone())
        elif col is not None:
            g.add_(torch.exp(kept - col[1][None, :]).mul_(col[0][None, :]))
        diag = self_diagonal(g, 0, 0, plan.self_offset)
        if diag is not None:
            diag.zero_()
        _blank(g, plan, 0, 0, _excluded(plan, 0, g.shape[0], 0, g.shape[1]), 0.0)
    if plan.positives is not None and c_row is not None:
        _fold_positives(g, plan.positives, plan, c_row, c_col)
    if plan.symmetric or plan.grad_columns == 0:
        return prod.row_product(g), None
    if plan.grad_columns >= b.shape[0]:
        return prod.row_product(g), prod.column_product(g)
    ga_acc = torch.zeros_like(b)
    ga_acc[: plan.grad_columns] = prod.column_product(g[:, : plan.grad_columns])
    return prod.row_product(g), ga_acc


def _fold_positives(g: Tensor, positives: Positives, plan: _Plan, c_row: Tensor, c_col: Tensor | None) -> None:
    """``G_ij += P_ij (c_i + c'_j)`` in place (symmetric: ``P_ij c_i + P_ji c_j``).

    ``c_row`` / ``c_col`` may be 0-dim (the same coefficient for every row / column).
    """
    how, rel = _positive_layout(positives, plan, g.shape[0], g.shape[1])
    if rel is None:
        _add_strided(g, how, c_row, c_col, plan.symmetric)
        return
    c_row = c_row.expand(g.shape[0])
    c_col = None if c_col is None else c_col.expand(g.shape[1])
    if how == "partner":
        rows = torch.arange(g.shape[0], device=g.device)
        g.index_put_((rows, rel), c_row if c_col is None else c_row + c_col[rel], accumulate=True)
        if plan.symmetric:
            g.index_put_((rel, rows), c_row, accumulate=True)
    else:
        mask = mask_as(rel, g.dtype)
        g.addcmul_(mask, c_row[:, None] if c_col is None else c_row[:, None] + c_col[None, :])
        if plan.symmetric:
            g.addcmul_(mask.t(), c_row[None, :])


def _add_strided(g: Tensor, layout: str, c_row: Tensor, c_col: Tensor | None, symmetric: bool) -> None:
    """``G[i, p(i)] += c_i (+ c'_p(i))`` on a strided layout; symmetric: also ``G[p(i), i] += c_i``."""
    if layout == "identity":
        g.diagonal().add_(c_row if c_col is None else c_row + c_col)
        return
    if c_row.ndim == 0:  # one coefficient for every row (a reduced loss)
        both = c_row * 2 if symmetric else c_row if c_col is None else c_row + c_col
        for view in _strided_positives(g, layout):
            view.add_(both)
        return
    # adjacent and halves are involutions: p(p(i)) = i, so the symmetric term adds c_p(i) at (i, p(i)).
    views = _strided_positives(g, layout)
    first, second = (c_row[0::2], c_row[1::2]) if layout == "adjacent" else (c_row[: g.shape[0] // 2], c_row[g.shape[0] // 2 :])
    if symmetric:
        both = first + second
        views[0].add_(both)
        views[1].add_(both)
    else:
        views[0].add_(first if c_col is None else first + (c_col[1::2] if layout == "adjacent" else c_col[g.shape[0] // 2 :]))
        views[1].add_(second if c_col is None else second + (c_col[0::2] if layout == "adjacent" else c_col[: g.shape[0] // 2]))


def _complete_columns(col_sum: Tensor, col_max: Tensor, plan: _Plan) -> Tensor:
    """Column LSE from (sum, max); across ranks: bring partial sums to the global maximum."""
    if plan.column_comm is not None:
        global_max = col_max.clone()
        plan.column_comm.all_max(global_max)
        col_sum = col_sum * torch.exp(col_max - global_max)
        plan.column_comm.all_sum(col_sum)
        col_max = global_max
    return col_sum.log() + col_max


# ----------------------------------------------------------------------- many tiles
def _forward_fixed(prod: AnyProducts, a: Tensor, C: int, plan: _Plan) -> tuple[Tensor, Tensor | None]:
    """Plain sums of ``exp(S)`` (no shift): exact when ``|S| <= 40`` (fp32)."""
    R = a.shape[0]
    bufs = Buffers(a.dtype, a.device)
    row_sum = a.new_zeros(R)
    col_sum = a.new_zeros(C) if plan.columns else None
    for r0, r1, c0, c1 in tiles(R, C, plan.tile, plan.symmetric):
        e = prod.logits(r0, r1, c0, c1, bufs.get(r1 - r0, c1 - c0)).exp_()
        diag = self_diagonal(e, r0, c0, plan.self_offset)
        if diag is not None:
            diag.zero_()
        _drop(e, plan, r0, r1, c0, c1)
        row_sum[r0:r1] += e.sum(1)
        if plan.symmetric and c0 != r0:
            row_sum[c0:c1] += e.sum(0)
        if col_sum is not None:
            col_sum[c0:c1] += e.sum(0)
    return _fixed_lse(row_sum, col_sum, plan, C)


def _fixed_lse(row_sum: Tensor, col_sum: Tensor | None, plan: _Plan, n_cols: int) -> tuple[Tensor, Tensor | None]:
    """Row (and column) log-sum-exp from plain sums of ``exp(S)``; across ranks the column
    sums are added first."""
    row_lse = _log(row_sum, None, plan, n_cols)
    if col_sum is None:
        return row_lse, None
    if plan.column_comm is not None:
        plan.column_comm.all_sum(col_sum)  # no per-rank shift: the sums just add
    return row_lse, col_sum.log()


def _forward_online(prod: AnyProducts, a: Tensor, C: int, plan: _Plan) -> tuple[Tensor, Tensor | None]:
    """Running (maximum, shifted sum) per row and column: exact for any logit range.

    A self entry is set to the lowest finite value before the maximum is taken and
    zeroed after the exp, so no ``inf - inf`` can arise.
    """
    R = a.shape[0]
    low = torch.finfo(a.dtype).min
    bufs = Buffers(a.dtype, a.device)
    row_max, row_sum = a.new_full((R,), low), a.new_zeros(R)
    col_max, col_sum = a.new_full((C,), low), a.new_zeros(C)
    for r0, r1, c0, c1 in tiles(R, C, plan.tile, plan.symmetric):
        s = prod.logits(r0, r1, c0, c1, bufs.get(r1 - r0, c1 - c0))
        diag = self_diagonal(s, r0, c0, plan.self_offset)
        if diag is not None:
            diag.fill_(low)
        out = _excluded(plan, r0, r1, c0, c1)
        _blank(s, plan, r0, c0, out, low)
        work = bufs.get(r1 - r0, c1 - c0, 1)
        blank = (plan, r0, c0, out)
        _online_update(s, row_max, row_sum, r0, r1, c0, plan.self_offset, dim=1, work=work, blank=blank)
        if plan.symmetric and c0 != r0:
            _online_update(s, row_max, row_sum, c0, c1, r0, None, dim=0, work=work, blank=blank)
        if plan.columns:
            _online_update(s, col_max, col_sum, c0, c1, r0, None, dim=0, work=work, blank=blank)
    row_lse = _log(row_sum, row_max, plan, C)
    if not plan.columns:
        return row_lse, None
    return row_lse, _complete_columns(col_sum, col_max, plan)


def _online_update(
    s: Tensor, run_max: Tensor, run_sum: Tensor, i0: int, i1: int, other0: int,
    self_offset: int | None, dim: int, work: Tensor, blank: tuple[Any, int, int, Tensor | None] | None = None,
) -> None:
    """Fold one tile into running (max, sum-exp) statistics along ``dim``.

    ``i0:i1`` are the statistics' indices (rows for ``dim=1``, columns for ``dim=0``);
    ``other0`` is the first index of the other axis; ``self_offset`` (rows only) marks
    self entries whose exp must be zeroed.
    """
    tile_max = s.amax(dim)
    new_max = torch.maximum(run_max[i0:i1], tile_max)
    run_sum[i0:i1] *= torch.exp(run_max[i0:i1] - new_max)
    shifted = torch.sub(s, new_max[:, None] if dim == 1 else new_max[None, :], out=work).exp_()
    diag = self_diagonal(shifted, i0, other0, self_offset)
    if diag is not None:
        diag.zero_()
    if blank is not None:  # excluded entries sit at the lowest value: exp(0) = 1 while nothing else is seen
        _blank(shifted, *blank, 0.0)
    run_sum[i0:i1] += shifted.sum(dim)
    run_max[i0:i1] = new_max


def _backward_fixed(prod: AnyProducts, a: Tensor, b: Tensor, row: _Direction, col: _Direction | None,
                    plan: _Plan) -> tuple[Tensor, Tensor | None]:
    """``G @ B`` and ``G.T @ A`` with ``G_ij = u_i e^{S_ij} + v_j e^{S_ij}``.

    ``exp(S_ij - LSE_i) = exp(S_ij) * exp(-LSE_i)``: one exp per element serves both
    directions.
    """
    u = row[0] * _inverse_exp(row[1], plan)
    v = None if col is None else col[0] * _inverse_exp(col[1], plan)
    R, C = a.shape[0], b.shape[0]
    bufs = Buffers(a.dtype, a.device)
    gb_acc = torch.zeros_like(a)  # G @ B (or H @ Z when symmetric)
    ga_acc = _column_accumulator(b, plan)  # G.T @ A
    for r0, r1, c0, c1 in tiles(R, C, plan.tile, plan.symmetric):
        g = prod.logits(r0, r1, c0, c1, bufs.get(r1 - r0, c1 - c0)).exp_()
        if v is not None:
            g.mul_(torch.add(u[r0:r1, None], v[None, c0:c1], out=bufs.get(r1 - r0, c1 - c0, 1)))
        else:
            g.mul_(u[r0:r1, None])
        _accumulate(g, prod, gb_acc, ga_acc, r0, r1, c0, c1, plan)
    return gb_acc, ga_acc


def _backward_online(prod: AnyProducts, a: Tensor, b: Tensor, row: _Direction, col: _Direction | None,
                     plan: _Plan) -> tuple[Tensor, Tensor | None]:
    """``G @ B`` and ``G.T @ A`` with ``G_ij = g_i e^{S_ij - LSE_i} + h_j e^{S_ij - LSE'_j}``."""
    g_row, row_lse = row
    R, C = a.shape[0], b.shape[0]
    bufs = Buffers(a.dtype, a.device)
    gb_acc = torch.zeros_like(a)
    ga_acc = _column_accumulator(b, plan)
    for r0, r1, c0, c1 in tiles(R, C, plan.tile, plan.symmetric):
        s = prod.logits(r0, r1, c0, c1, bufs.get(r1 - r0, c1 - c0, 1))
        g = torch.sub(s, row_lse[r0:r1, None], out=bufs.get(r1 - r0, c1 - c0)).exp_().mul_(g_row[r0:r1, None])
        if col is not None:
            g.add_(s.sub_(col[1][None, c0:c1]).exp_().mul_(col[0][None, c0:c1]))
        _accumulate(g, prod, gb_acc, ga_acc, r0, r1, c0, c1, plan)
    return gb_acc, ga_acc


def _column_accumulator(b: Tensor, plan: _Plan) -> Tensor | None:
    """``G.T @ A``'s accumulator: none for a symmetric set (its columns are its rows) or
    when no candidate needs a gradient; rows past ``grad_columns`` stay zero."""
    return None if plan.symmetric or plan.grad_columns == 0 else torch.zeros_like(b)


def _accumulate(g: Tensor, prod: AnyProducts, gb_acc: Tensor, ga_acc: Tensor | None,
                r0: int, r1: int, c0: int, c1: int, plan: _Plan) -> None:
    """Zero the self pairs (and excluded entries) of a gradient tile and add it into both accumulators."""
    diag = self_diagonal(g, r0, c0, plan.self_offset)
    if diag is not None:
        diag.zero_()
    if plan.fixed:  # finite tiles: multiply by the 0/1 factor
        _drop(g, plan, r0, r1, c0, c1)
    else:  # an empty row's recomputed exp can be inf there: overwrite
        _blank(g, plan, r0, c0, _excluded(plan, r0, r1, c0, c1), 0.0)
    prod.add_rows(gb_acc[r0:r1], g, c0, c1)
    if plan.symmetric:
        if c0 != r0:
            prod.add_columns(gb_acc[c0:c1], g, r0, r1)
    elif ga_acc is not None and c0 < plan.grad_columns:
        end = min(c1, plan.grad_columns)
        prod.add_columns(ga_acc[c0:end], g[:, : end - c0], r0, r1)


def _triton_operands(plan: _Plan, *tensors: Tensor) -> list[Tensor]:
    """On a GPU, half-precision inputs reach ``tl.dot`` in their own dtype (the engine
    normalised them in fp32); under the interpreter they stay fp32 (its bf16 dot is inexact)."""
    from . import triton_backend

    half = plan.operand_dtype
    if half is None or triton_backend.interpreting():
        return list(tensors)
    return [t.to(half) for t in tensors]


def _forward_triton(a_s: Tensor, b: Tensor, plan: _Plan) -> tuple[Tensor, Tensor | None]:
    """Row (and column) log-sum-exp by the Triton kernels: the bounded regime sums rows and
    columns in one pass over the tiles (the upper triangle for a single set); the online
    regime, or deterministic mode, runs the row-owned kernel once per direction."""
    from . import triton_backend

    x, y = _triton_operands(plan, a_s, b)
    if plan.fixed and triton_backend.fused():
        row_sum, col_sum = triton_backend.tile_sums(x, y, plan.self_offset, plan.exclude, plan.columns, plan.symmetric)
        return _fixed_lse(row_sum, col_sum, plan, b.shape[0])
    row_lse = triton_backend.row_lse(x, y, plan.self_offset, plan.exclude)
    if plan.exclude is None:  # a row without candidates (a batch of one) gets 0, as the torch backend's
        row_lse = torch.where(torch.isneginf(row_lse), 0.0, row_lse)
    if not plan.columns:
        return row_lse, None
    col_offset = None if plan.self_offset is None else -plan.self_offset
    col_lse = triton_backend.row_lse(y, x, col_offset, plan.exclude, transposed=True)
    if plan.column_comm is not None:  # every rank's partial log-sum-exp, brought to the global maximum
        col_lse = _complete_columns(torch.ones_like(col_lse), col_lse, plan)
    return row_lse, col_lse


def _backward_triton(a_s: Tensor, a: Tensor, b: Tensor, row: _Direction, col: _Direction | None,
                     plan: _Plan) -> tuple[Tensor, Tensor | None]:
    """``G @ B`` and ``G.T @ A`` by the Triton kernels: each gradient tile formed once
    (atomics), or -- in deterministic mode -- ``G.T @ A`` as ``G' @ A`` on ``S.T``."""
    from . import triton_backend

    x, y, z = _triton_operands(plan, a_s, b, a)
    offset = plan.self_offset
    if triton_backend.fused():
        return triton_backend.tile_grad(x, y, z, row, col, offset, plan.exclude, plan.grad_columns, plan.symmetric)
    gb_acc = triton_backend.grad_rows(x, y, y, row, col, offset, plan.exclude)
    if plan.grad_columns == 0 or plan.symmetric:  # a single set: G is symmetric, G @ Z holds both roles
        return gb_acc, None
    k = plan.grad_columns
    zero = torch.zeros(k, dtype=a.dtype, device=a.device)
    swapped_row = (zero, zero) if col is None else (col[0].expand(b.shape[0])[:k], col[1][:k])
    part = triton_backend.grad_rows(y[:k], x, z, swapped_row, row, None if offset is None else -offset, plan.exclude,
                                    transposed=True)
    if k >= b.shape[0]:
        return gb_acc, part
    ga_acc = torch.zeros_like(b, dtype=part.dtype)
    ga_acc[:k] = part
    return gb_acc, ga_acc


def _triton_refusal(anchors: Tensor, exclude: Any) -> str | None:
    """None when the Triton kernels can run this call, else why not (for the planner)."""
    from . import triton_backend

    try:
        triton_backend.check_device(anchors)
        triton_backend.check_exclusion(exclude)
    except ValueError as err:
        return str(err)
    return None


def _weighted(g: Tensor, weight: Tensor | None) -> Tensor:
    return g if weight is None else g * weight


class _SoftmaxTerms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor | None, scale: Scale, row_alpha: Tensor | None, row_beta: Tensor | None,  # type: ignore[override]
                col_alpha: Tensor | None, col_beta: Tensor | None, plan: _Plan, total: tuple[Scale, Scale] | None):
        # The engine chooses its own precision (fp32 or fp64): an ambient autocast region
        # must not turn its matrix products into half precision.
        if not autocast_enabled(a.device.type):
            return _SoftmaxTerms._forward(ctx, a, b, scale, row_alpha, row_beta, col_alpha, col_beta, plan, total)
        with torch.autocast(a.device.type, enabled=False):
            return _SoftmaxTerms._forward(ctx, a, b, scale, row_alpha, row_beta, col_alpha, col_beta, plan, total)

    @staticmethod
    def _forward(ctx: Any, a: Tensor, b: Tensor | None, scale: Scale, row_alpha: Tensor | None, row_beta: Tensor | None,
                 col_alpha: Tensor | None, col_beta: Tensor | None, plan: _Plan,
                 total: tuple[Scale, Scale] | None) -> tuple[Tensor, Tensor]:
        a_c, b_c, scale_c, norms = prepare_inputs(a, b, scale, plan.normalize, plan.eps)
        a_s = a_c * scale_c
        kept = None
        sums: Any = None  # (total, total') to divide by; six entries from _single_apart
        row_pos = col_pos = None
        raw = (a, b) if plan.half else ()
        if plan.backend == "triton":
            row_lse, col_lse = _forward_triton(a_s, b_c, plan)
        else:
            prod = make_products(plan.half, raw, a_s, a_c, b_c, scale_c, norms, plan.normalize)
            if plan.single_tile:
                row_lse, col_lse, row_pos, col_pos, kept, sums = _single_forward(prod, a_c.shape[0], b_c.shape[0], plan)
            else:
                row_lse, col_lse = (_forward_fixed if plan.fixed else _forward_online)(prod, a_c, b_c.shape[0], plan)
        if plan.positives is not None and not plan.tile_positives:
            row_pos = (a_s * plan.positives.aggregate(b_c)).sum(1)
            if plan.column_positives:
                col_pos = (b_c * plan.positives.aggregate_transposed(a_s)).sum(1)
        if plan.shared_alpha:
            col_alpha = row_alpha
        given = sums is not None and len(sums) == 6  # (total, total', d, d', excess, excess') of _single_apart
        row_out, col_out, row_lse, col_lse, margins = _outputs(plan, row_lse, col_lse, row_pos, col_pos, row_alpha, row_beta,
                                                               col_alpha, col_beta, total, given)
        if given and sums is not None:
            margins = tuple(t for t in sums[4:] if t is not None)  # backward's coefficient reads the excesses
            sums = (sums[0], sums[1])
        ctx.apart_sums = given
        ctx.total = total
        ctx.set_materialize_grads(False)  # an output the caller drops (the empty column slot) costs no zeros
        if total is not None:  # the caller's reduction, done here: no autograd nodes after the engine
            row_out = row_out.sum() * total[0]
            if col_lse is not None:
                row_out = row_out + col_out.sum() * total[1]
            col_out = row_out.new_zeros(0)
        ctx.plan = plan
        ctx.in_dtypes = (a.dtype, a.dtype if b is None else b.dtype)
        own_col_alpha = None if plan.shared_alpha else col_alpha
        ctx.weights = tuple(w is not None for w in (row_alpha, row_beta, own_col_alpha, col_beta))
        weights = [w for w in (row_alpha, row_beta, own_col_alpha, col_beta) if w is not None]
        ctx.kept = kept is not None
        ctx.by_sums = sums is not None
        row_stat, col_stat = (row_lse, col_lse) if sums is None else sums  # what backward divides by
        ctx.margins = len(margins)
        save(ctx, scale_c, a_c, b_c, row_stat, row_stat if col_stat is None else col_stat, *margins, *weights, *norms,
             *(() if kept is None else (kept,)), *(t for t in raw if t is not None))
        ctx.raw = len([t for t in raw if t is not None])
        return row_out, col_out

    @staticmethod
    @once_differentiable
    def backward(ctx, g_row: Tensor | None, g_col: Tensor | None):  # type: ignore[override]
        plan: _Plan = ctx.plan
        a, b, rest, scale = saved(ctx)
        raw: list[Tensor | None] = list(rest[len(rest) - ctx.raw:])
        del rest[len(rest) - ctx.raw:]
        raw += [None] * (2 - len(raw))  # a single set's candidates are its anchors
        kept = rest.pop() if ctx.kept else None
        row_lse, col_lse = rest[0], rest[1]
        margins = rest[2 : 2 + ctx.margins]
        given = iter(rest[2 + ctx.margins :])
        row_alpha, row_beta, col_alpha, col_beta = (next(given) if present else None for present in ctx.weights)
        if plan.shared_alpha:
            col_alpha = row_alpha
        norm_tensors = list(given)
        norm_a = (norm_tensors[0], norm_tensors[1]) if plan.normalize else None
        norm_b = None if not plan.normalize or ctx.single else (norm_tensors[2], norm_tensors[3])
        g_row, g_col, uniform_row, uniform_col = _incoming(ctx, g_row, g_col, a, b, plan)
        col: _Direction | None = None
        g_col_c = None
        if plan.columns and g_col is not None:
            g_col_c = as_dtype(g_col, a.dtype)
            if plan.column_comm is not None:
                # Every rank's tiles touch every column: they all need the full column gradient.
                g_col_c = g_col_c.clone()
                plan.column_comm.all_sum(g_col_c)
            col = (_weighted(g_col_c, col_alpha), col_lse)
        u = _weighted(g_row, row_alpha)
        has_pos = plan.positives is not None
        # without beta weights a reduced loss gives every row the same positive coefficient: a 0-dim one
        c_row = (-uniform_row if uniform_row is not None and row_beta is None else -_weighted(g_row, row_beta)) if has_pos else None
        c_col = None
        if has_pos and g_col_c is not None and plan.column_positives:
            c_col = -uniform_col if uniform_col is not None and col_beta is None else -_weighted(g_col_c, col_beta)
        if margins and c_row is not None:  # the positive entries were left out of the tiles: their exact coefficient
            how = coefficient_from_sums if ctx.apart_sums else coefficient
            c_row = how(u, c_row, margins[0], row_alpha is row_beta, row_lse)
            if len(margins) == 2 and c_col is not None and col is not None:
                c_col = how(col[0], c_col, margins[1], col_alpha is col_beta, col_lse)
        if not plan.symmetric and not ctx.needs_input_grad[1 if not ctx.single else 0]:
            plan = replace(plan, grad_columns=0)
        # (the Triton kernels take the operands themselves; the products serve the torch loops)
        prod = make_products(plan.half, tuple(raw) if plan.half else (), None, a, b, scale, norm_tensors, plan.normalize)
        if kept is not None:
            folded = (c_row, c_col) if plan.tile_positives else (None, None)
            gb_acc, ga_acc = _single_backward(kept, prod, b, (u, row_lse), col, *folded, plan, ctx.by_sums)
        else:
            if plan.symmetric:
                col = (u, row_lse)  # a single set's columns are its rows
            if plan.backend == "triton":
                gb_acc, ga_acc = _backward_triton(a * scale, a, b, (u, row_lse), col, plan)
            else:
                gb_acc, ga_acc = (_backward_fixed if plan.fixed else _backward_online)(prod, a, b, (u, row_lse), col, plan)
        if plan.positives is not None and c_row is not None and not plan.tile_positives:
            gb_acc, ga_acc = _positive_gradients(plan.positives, a, b, gb_acc, ga_acc, c_row.expand(a.shape[0]),
                                                 None if c_col is None else c_col.expand(b.shape[0]), plan.symmetric)
        ga, gb, gscale = finish_gradients(ctx, a, scale, gb_acc, ga_acc, plan.symmetric, norm_a, norm_b, b, plan.eps)
        return ga, gb, gscale, None, None, None, None, None, None


def _outputs(plan: _Plan, row_lse: Tensor, col_lse: Tensor | None, row_pos: Tensor | None, col_pos: Tensor | None,
             row_alpha: Tensor | None, row_beta: Tensor | None, col_alpha: Tensor | None, col_beta: Tensor | None,
             total: Any, given: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor | None, tuple[Tensor, ...]]:
    """``alpha * LSE - beta * pos`` per row (and column), the full log-sum-exps and, when the
    positives were kept apart, the margins ``LSE - pos`` that backward needs."""
    margins: tuple[Tensor, ...] = ()
    if given and row_pos is not None:  # the one bounded tile computed the margins itself (_single_apart): lse hold them
        row_out = _weighted(row_lse, row_alpha) if row_alpha is row_beta else \
            _weighted(row_pos + row_lse, row_alpha) - _weighted(row_pos, row_beta)
        col_out = row_lse.new_zeros(0) if total is None else row_lse
        if col_lse is not None and col_pos is not None:
            col_out = _weighted(col_lse, col_alpha) if col_alpha is col_beta else \
                _weighted(col_pos + col_lse, col_alpha) - _weighted(col_pos, col_beta)
        return row_out, col_out, row_lse, col_lse, ()
    if plan.apart is not None and row_pos is not None and (col_lse is None or col_pos is not None):
        # the tile passes summed the excess over the positive
        row_out, row_lse, d_row = _apart_terms(row_lse, row_pos, row_alpha, row_beta)
        margins = (d_row,)
        if col_lse is not None and col_pos is not None:
            col_out, col_lse, d_col = _apart_terms(col_lse, col_pos, col_alpha, col_beta)
            margins = (d_row, d_col)
    else:
        row_out = _weighted(row_lse, row_alpha)
        if row_pos is not None:
            row_out = row_out - _weighted(row_pos, row_beta)
        if col_lse is not None:
            col_out = _weighted(col_lse, col_alpha)
            if col_pos is not None:
                col_out = col_out - _weighted(col_pos, col_beta)
    if col_lse is None:
        col_out = row_lse.new_zeros(0) if total is None else row_lse
    return row_out, col_out, row_lse, col_lse, margins


def _apart_terms(log_excess: Tensor, pos: Tensor, alpha: Tensor | None, beta: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, LSE, d)`` with ``d = LSE - pos`` computed from the excess (confident.py):
    ``out = alpha * d`` when both weights are alike, so a near-zero loss keeps its digits."""
    d = margin(log_excess, pos)
    lse = pos + d
    out = _weighted(d, alpha) if alpha is beta else _weighted(lse, alpha) - _weighted(pos, beta)
    return out, lse, d


def _incoming(ctx: Any, g_row: Tensor | None, g_col: Tensor | None, a: Tensor, b: Tensor,
              plan: _Plan) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The upstream gradients per row and column in the compute dtype, and -- for a loss
    reduced inside (``total``) -- the 0-dim coefficients every row / column shares."""
    if g_row is None:  # only the column terms were used
        g_row = a.new_zeros(() if ctx.total is not None else a.shape[0])
    if g_col is None and plan.columns and ctx.total is None:
        g_col = b.new_zeros(b.shape[0])
    uniform_row = uniform_col = None
    if ctx.total is not None:  # d total / d row_out_i = total[0] (and total[1] per column)
        uniform_col = as_dtype(g_row * ctx.total[1], a.dtype) if plan.columns else None
        uniform_row = as_dtype(g_row * ctx.total[0], a.dtype)
        # 0-dim: the fixed single tile divides by its sums, which broadcasts; the rest index rows
        g_row = uniform_row if ctx.by_sums else uniform_row.expand(a.shape[0])
        if uniform_col is not None:
            g_col = uniform_col if ctx.by_sums else uniform_col.expand(b.shape[0])
    return as_dtype(g_row, a.dtype), g_col, uniform_row, uniform_col


def _positive_gradients(pos: Positives, a: Tensor, b: Tensor, gb_acc: Tensor, ga_acc: Tensor | None,
                        c_row: Tensor, c_col: Tensor | None, symmetric: bool) -> tuple[Tensor, Tensor | None]:
    """Add the positive part ``G_ij += P_ij (c_row_i + c_col_j)`` to ``G @ B`` and ``G.T @ A``."""
    gb_acc = gb_acc + c_row[:, None] * pos.aggregate(b)
    if c_col is not None:
        gb_acc = gb_acc + pos.aggregate(c_col[:, None] * b)
    if symmetric:  # the columns are the rows, so both roles land in one accumulator
        return gb_acc + pos.aggregate_transposed(c_row[:, None] * a), None
    if ga_acc is None:  # no candidate needs a gradient
        return gb_acc, None
    ga_acc = ga_acc + pos.aggregate_transposed(c_row[:, None] * a)
    if c_col is not None:
        ga_acc = ga_acc + c_col[:, None] * pos.aggregate_transposed(a)
    return gb_acc, ga_acc


def softmax_terms(
    anchors: Tensor,
    candidates: Tensor,
    scale: Scale,
    *,
    self_offset: int | None,
    positives: Positives | None = None,
    row_weights: tuple[Tensor | None, Tensor | None] = (None, None),
    col_weights: tuple[Tensor | None, Tensor | None] = (None, None),
    symmetric: bool = False,
    columns: bool = False,
    column_positives: bool = True,
    fixed: bool = False,
    normalize: bool = False,
    eps: float = 1e-12,
    chunk_size: int | None = None,
    column_comm: Any = None,
    grad_columns: int | None = None,
    exclude: Any = None,
    backend: str = "auto",
    total: tuple[Scale, Scale] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-row (and per-column) soft-max terms of ``S = scale * anchors @ candidates.T``.

    ``row_out_i = alpha_i * LSE_i - beta_i * sum_j P_ij S_ij`` with
    ``LSE_i = log sum_{j != self(i)} exp(S_ij)``, and with ``columns=True`` also
    ``col_out_j = alpha'_j * LSE'_j - beta'_j * sum_i P_ij S_ij`` with
    ``LSE'_j = log sum_i exp(S_ij)``.

    Args:
        anchors: (R, D) tensor, any float dtype.
        candidates: (C, D) tensor; pass ``anchors`` itself for a single set.
        scale: ``1 / temperature``: a float, or a 0-dim tensor (gradients flow to it;
            its value is never read on the host).
        self_offset: anchor ``i`` is candidate ``i + self_offset``; that entry is
            left out of row ``i``. ``None``: nothing is left out.
        positives: the relation P (R x C); ``None``: no positive part (plain LSE).
        row_weights, col_weights: ``(alpha, beta)`` (R,) / (C,) tensors without
            gradient; ``None`` means 1.
        symmetric: ``candidates`` are the anchors themselves (single-set losses on one
            process, ``self_offset=0``): only the upper-triangle tiles are visited.
        columns: also return the column terms (requires ``self_offset=None``).
        column_positives: include ``sum_i P_ij S_ij`` in the column terms (the caller
            computes it itself in distributed training, where this rank holds only
            some rows).
        fixed: use plain ``exp(S)`` without a shift; only exact when every row has
            norm <= 1 and the scale is small (see :func:`fixed_scale_applies`).
        normalize: L2-normalise anchors and candidates inside (``x / max(||x||, eps)``),
            so the whole loss is one autograd node.
        chunk_size: tile edge (see :func:`resolve_tile`).
        column_comm: for ``columns=True`` in distributed training, an object with in-place
            ``all_sum``/``all_max`` over ranks: each rank passes its own anchor rows and
            all candidates, and gets the *global* column statistic (an O(C) all-reduce
            forward, one more for the column gradient backward).
        grad_columns: only the first ``grad_columns`` candidates need a gradient (the
            rest are constants, e.g. a queue of past keys concatenated after the live
            keys): their ``G.T @ A`` products are skipped and their gradient rows are 0.
            ``None``: every candidate (when ``candidates`` requires grad at all).
        exclude: candidates left out of the log-sum-exp besides the self pair (and out of
            the column log-sum-exp): a :class:`~torch_contrastive.positives.Exclusion`.
            With ``symmetric=True`` it must be a symmetric relation. A row whose every
            candidate is left out gets ``LSE = -inf``.
        backend: ``"auto"`` (default; :func:`.planner.decide`), ``"torch"`` or ``"triton"``: the log-sum-exp passes as Triton kernels
            (CUDA tensors, or ``TRITON_INTERPRET=1`` on CPU; see :mod:`.triton_backend`): the
            same semantics -- both regimes, the single-set triangle, exclusions by ids, a
            partner relation, a guide or diagonals, distributed column statistics; positives
            go through ``Positives.aggregate``. Atomic (fused) kernels unless
            ``torch.use_deterministic_algorithms(True)`` asks for the row-owned ones.
        total: ``(c, c')``: return the scalar ``c * sum_i row_out_i + c' * sum_j col_out_j``
            instead (floats or 0-dim tensors without gradient; ``c'`` only with
            ``columns=True``) -- a loss's ``mean``/``sum`` reduction inside the autograd
            function, which saves the small batch a few autograd nodes.

    Returns:
        ``(row_out, col_out)``: (R,) and (C,) or None, fp32 for fp16/bf16 inputs
        (fp64 for fp64). A row with no candidate at all gets ``LSE = 0``. With ``total``:
        ``(scalar, None)``.

    Memory: O((R + C) * D) for the compute-dtype copies plus two tile buffers; never
    R x C (unless one tile covers everything).
    """
    if columns and self_offset is not None:
        raise ValueError("columns=True needs self_offset=None (two-set losses only)")
    if symmetric and (self_offset != 0 or columns or anchors.shape != candidates.shape):
        raise ValueError("symmetric=True needs candidates equal to anchors, self_offset=0 and columns=False")
    if symmetric and exclude is not None and not exclude.symmetric:
        # one mask serves a tile's row block and, transposed, its column block
        raise ValueError("symmetric=True needs a symmetric exclusion (Exclusion(symmetric=True))")
    R, C = anchors.shape[0], candidates.shape[0]
    decision = decide(kernel="softmax", rows=R, cols=C, device=anchors.device, dtype=anchors.dtype,
                      other_dtype=candidates.dtype, chunk_size=chunk_size, backend=backend, fixed=fixed,
                      triton_serves=lambda: _triton_refusal(anchors, exclude))
    operand_dtype = None
    if decision.backend == "triton" and anchors.dtype in (torch.float16, torch.bfloat16) and candidates.dtype == anchors.dtype:
        operand_dtype = anchors.dtype
    shared_alpha = col_weights[0] is not None and col_weights[0] is row_weights[0]
    single = decision.tile == 0
    tile_positives = single and positives is not None and (positives.kind != "keys" or positives.dense is not None)
    apart = apart_rule(positives, exclude, columns, column_positives, column_comm, symmetric, decision.backend)
    plan = _Plan(self_offset, columns, symmetric, decision.tile, fixed, normalize, float(eps), positives,
                 columns and column_positives, tile_positives, shared_alpha, column_comm if columns else None,
                 C if grad_columns is None else max(0, min(int(grad_columns), C)), exclude, decision.backend, operand_dtype,
                 decision.half, apart)
    row_out, col_out = _SoftmaxTerms.apply(anchors, None if candidates is anchors else candidates, scale, *row_weights,
                                           None if shared_alpha else col_weights[0], col_weights[1], plan, total)
    return row_out, (col_out if columns and total is None else None)
