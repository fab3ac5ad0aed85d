"""The soft-max engine's tile passes: one tile kept from forward to backward (small
batches), and the tile loops of the bounded (``fixed``) and online-maximum regimes.

Forward keeps O(N) statistics per row and column; backward recomputes each tile and
accumulates ``G @ B`` and ``G.T @ A`` through :mod:`.products`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from .._tensors import self_diagonal
from ..positives import PartnerPositives
from .left_out import Direction, blank, drop, excluded, inverse_exp, log_total
from .products import AnyProducts
from .tiling import Buffers, gradient_sweep, raise_max, sweep

if TYPE_CHECKING:
    from ..positives import Positives
    from .plans import SoftmaxPlan

__all__ = ["backward_fixed", "backward_online", "complete_columns", "fixed_lse", "forward_fixed", "forward_online", "leave_out", "single_backward",
           "single_forward"]


# ----------------------------------------------------------------------- one tile
# A problem that fits in one tile (the common small batch) keeps that tile from forward
# to backward, and reads its positive part off the tile itself: no aggregate, no
# recomputed matrix product, a few large ops.
def _positive_layout(positives: Positives) -> tuple[str, Tensor | None]:
    """How the positives lie on the tile: a named strided layout ("identity", "adjacent",
    "halves") or "partner", with each row's positive column; or ("mask", None): read through
    ``Positives.tile_values``."""
    if isinstance(positives, PartnerPositives):
        return positives.layout or "partner", positives.partner
    return "mask", None


def _strided(positives: Positives | None) -> PartnerPositives | None:
    """The relation when its positives lie on a named strided layout (else None)."""
    return positives if isinstance(positives, PartnerPositives) and positives.layout is not None else None


class FlatPlaces(NamedTuple):
    """Row-major places in a square ``n x n`` tile under a strided layout (one tile = the whole problem).

    Each is read or written by one ``take`` / ``put_``, which index the tile as a flat vector: no
    view of it, no op per diagonal (a small call's cost is its op count)."""

    positives: Tensor  # (n,) row i's positive (i, p(i)), in row order
    both: Tensor  # (2n,) the positives, then the mirrored entries (p(i), i): a single set's two roles
    roles: Tensor  # ``both`` as (2, n): the two roles of row i's coefficient in column i (:func:`put_both`)
    left_out: Tensor  # the self pairs (if any) and the positives: what the kept-apart sums leave out
    zeros: Tensor  # zeros of the tile's dtype, one per left-out place (what clears them)


_FLAT: dict[tuple[str, int, int | None, torch.device, torch.dtype], FlatPlaces] = {}


def flat_places(positives: Positives | None, self_offset: int | None, dtype: torch.dtype) -> FlatPlaces:
    """:class:`FlatPlaces` of a square strided relation (``positives.layout`` set: its partner is
    row i's positive) on a tile of ``dtype``, built once per (layout, size, self offset, device,
    dtype) -- when the call is planned."""
    strided = _strided(positives)
    if strided is None:
        raise RuntimeError("internal: flat places of a relation without a strided layout")
    partner, n = strided.partner, strided.num_rows
    key = (str(strided.layout), n, self_offset, partner.device, dtype)
    places = _FLAT.get(key)
    if places is None:
        rows = torch.arange(n, device=partner.device)
        flat = rows * n + partner
        left_out = flat if self_offset is None else torch.cat([rows * n + rows + self_offset, flat])
        both = torch.cat([flat, partner * n + rows])
        places = FlatPlaces(flat, both, both.view(2, n), left_out,
                            torch.zeros(left_out.shape[0], dtype=dtype, device=partner.device))
        if len(_FLAT) > 64:  # many distinct shapes: keep the cache small
            _FLAT.clear()
        _FLAT[key] = places
    return places


def _places(plan: SoftmaxPlan) -> FlatPlaces:
    """The plan's flat places (built when planned: a strided relation on the one torch tile)."""
    if plan.places is None:
        raise RuntimeError("internal: a strided relation on one tile was planned without its flat places")
    return plan.places


def _tile_positive_sums(s: Tensor, plan: SoftmaxPlan) -> tuple[Tensor, Tensor | None]:
    """``sum_j P_ij S_ij`` per row and (for two-set losses) ``sum_i P_ij S_ij`` per column, off the tile."""
    positives = plan.positives
    if positives is None:
        raise RuntimeError("internal: no positive relation")
    R, C = s.shape
    how, partner = _positive_layout(positives)
    col_pos = None
    if partner is not None and how != "partner":
        # strided layout: one gather by the layout's cached places (a copy: the tile is exponentiated in place)
        row_pos = torch.take(s, _places(plan).positives)
        if plan.column_positives:  # identity: column j's positive is row j
            col_pos = row_pos if how == "identity" else s.new_zeros(C).index_add_(0, partner, row_pos)
    elif partner is not None:
        row_pos = s.gather(1, partner[:, None])[:, 0]
        if plan.column_positives:
            col_pos = s.new_zeros(C).index_add_(0, partner, row_pos)
    else:  # a 0/1 float mask: a multiply is several times cheaper than torch.where (s is finite here)
        weight = positives.tile_values(0, R, 0, C, s.dtype)
        row_pos = torch.linalg.vecdot(s, weight)
        col_pos = torch.linalg.vecdot(s.t(), weight.t()) if plan.column_positives else None
    return row_pos, col_pos


def single_forward(prod: AnyProducts, R: int, C: int, plan: SoftmaxPlan) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None,
                                                                             Tensor, tuple[Any, ...] | None]:
    """``(row_lse, col_lse, row_pos, col_pos, kept, sums)`` of a single tile.

    ``kept`` is ``exp(S)`` (fixed; self pairs zeroed) or ``S`` (online; self pairs at
    the lowest finite value), which backward reuses. ``sums``: in fixed mode, when no row
    can be empty, the row (and column) sums of ``exp(S)``, so that backward divides by
    them instead of computing ``exp(-LSE)``.
    """
    s = prod.logits(0, R, 0, C)
    if plan.fixed and plan.places is not None and plan.apart is not None and plan.exclude is None and not plan.weighted:
        return _single_strided(s.exp_(), plan.places, plan)
    row_pos, col_pos = _tile_positive_sums(s, plan) if plan.positives is not None and plan.tile_positives else (None, None)
    if plan.fixed:
        e = s.exp_()
        if plan.apart is not None and plan.exclude is None and plan.places is not None:
            _clear(e, plan.places)  # the self pairs and the positives kept apart
        else:
            diag = self_diagonal(e, 0, 0, plan.self_offset)
            if diag is not None:
                diag.zero_()
            drop(e, plan, 0, e.shape[0], 0, C)
        row_sum = e.sum(1)
        if plan.apart is not None and row_pos is not None and plan.exclude is None and (not plan.columns or col_pos is not None):
            exp_pos = row_pos.exp()
            col_exp = None if col_pos is None else exp_pos if col_pos is row_pos else col_pos.exp()
            return single_apart(e, row_sum, exp_pos, col_exp, row_pos, col_pos, plan)
        row_lse = log_total(row_sum, None, plan, C)
        col_lse = col_sum = None
        if plan.columns:
            col_sum = e.sum(0)
            if plan.column_comm is not None:
                plan.column_comm.all_sum(col_sum)
            col_lse = col_sum.log()
        # every sum > 0 (exp > 0 in fixed mode) unless exclusions or a lone row can empty one
        nonempty = plan.exclude is None and plan.apart is None and C - (plan.self_offset is not None) >= 1
        return row_lse, col_lse, row_pos, col_pos, e, ((row_sum, col_sum) if nonempty else None)
    diag = self_diagonal(s, 0, 0, plan.self_offset)
    if diag is not None:
        diag.fill_(torch.finfo(s.dtype).min)
    out = excluded(plan, 0, s.shape[0], 0, C)
    blank(s, plan, 0, 0, out, torch.finfo(s.dtype).min)
    row_max = s.amax(1)
    e = torch.exp(s - row_max[:, None])
    if diag is not None:
        e.diagonal(plan.self_offset or 0).zero_()
    blank(e, plan, 0, 0, out, 0.0)
    row_lse = log_total(e.sum(1), row_max, plan, C)
    if not plan.columns:
        return row_lse, None, row_pos, col_pos, s, None
    col_max = s.amax(0)
    col_e = torch.exp(s - col_max[None, :])
    blank(col_e, plan, 0, 0, out, 0.0)
    col_sum = col_e.sum(0)
    return row_lse, complete_columns(col_sum, col_max, plan), row_pos, col_pos, s, None


def put_at(tile: Tensor, at: Tensor, values: Tensor, accumulate: bool = False) -> None:
    """Write (or add) ``values`` at the flat places ``at`` of the one tile: one ``put_``, or -- ``put_``
    having no deterministic kernel -- an indexed copy (add) through a flat view in deterministic mode."""
    if torch.are_deterministic_algorithms_enabled():
        flat = tile.view(-1)
        (flat.index_add_ if accumulate else flat.index_copy_)(0, at, values)
    else:
        tile.put_(at, values, accumulate=accumulate)


def put_both(tile: Tensor, places: FlatPlaces, c: Tensor) -> None:
    """``G[i, p(i)] += c_i`` and ``G[p(i), i] += c_i`` (a single set's two roles) in one accumulating write:
    ``index_put_`` broadcasts ``c`` over the two roles, so no (2n,) copy of it is made (one op fewer than
    ``put_`` of ``cat([c, c])``, the same additions in the same order); in deterministic mode an indexed add
    of that copy (``put_``'s accumulation has no deterministic kernel)."""
    if torch.are_deterministic_algorithms_enabled():
        tile.view(-1).index_add_(0, places.both, torch.cat([c, c]))
    else:
        tile.view(-1).index_put_((places.roles,), c, accumulate=True)


def kept_apart_terms(e: Tensor, places: FlatPlaces, columns: bool) -> tuple[Any, ...]:
    """The one tile's soft-max terms of a strided relation kept apart (:mod:`.one_tile`, :mod:`.one_tile_half`),
    ``e = exp(S)`` cleared in place at the left-out places: ``(d, d_col, row_total, excess, col_total,
    col_excess)`` with ``d_i = log1p(excess_i / e_{i p(i)})`` and the columns' the same down the tile (the
    identity layout: column j's positive is row j's), None without column terms."""
    exp_pos = torch.take(e, places.positives)  # before the clearing
    _clear(e, places)  # the kept-apart sums leave out the self pairs and the positives
    excess = e.sum(1)
    row_total = excess + exp_pos
    d = torch.log1p(excess / exp_pos)
    if not columns:
        return d, None, row_total, excess, None, None
    col_excess = e.sum(0)
    return d, torch.log1p(col_excess / exp_pos), row_total, excess, col_excess + exp_pos, col_excess


def _clear(e: Tensor, places: FlatPlaces) -> None:
    """Zero the left-out places (the self pairs and the positives kept apart) of the one tile."""
    put_at(e, places.left_out, places.zeros)


def _single_strided(e: Tensor, places: FlatPlaces, plan: SoftmaxPlan) -> tuple[Any, ...]:
    """The one bounded tile ``e = exp(S)`` of a strided relation without weights, each row's
    positive kept apart: ``exp(S_ip)`` read off ``e`` itself (one ``take``, no ``exp`` of its
    own), then the self pairs and the positives cleared by one ``put_``. The positive logits are
    not needed: an unweighted loss is its margins. (Two-set losses have the identity layout, on which
    column j's positive is row j's.)"""
    exp_pos = torch.take(e, places.positives)  # before the clearing
    _clear(e, places)
    return single_apart(e, e.sum(1), exp_pos, exp_pos if plan.columns else None, None, None, plan)


def single_apart(e: Tensor, excess: Tensor, exp_pos: Tensor, col_exp: Tensor | None, row_pos: Tensor | None,
                 col_pos: Tensor | None, plan: SoftmaxPlan) -> tuple[Any, ...]:
    """The one bounded tile with each row's positive kept apart (confident.py), cheaply:
    ``d = log1p(excess / exp(S_p))`` and the totals ``excess + exp(S_p)`` that backward
    divides by (``exp(S_p)`` is finite in the bounded regime). ``sums`` then also carries
    the margins and the excesses: ``(total, total', d, d', excess, excess')``. ``row_pos`` /
    ``col_pos`` (the positive logits, for weighted outputs) pass through; None when unweighted."""
    sums: list[Tensor | None] = [excess + exp_pos, None, torch.log1p(excess / exp_pos), None, excess, None]
    if plan.columns and col_exp is not None:
        col_excess = e.sum(0)
        sums[1], sums[3], sums[5] = col_excess + col_exp, torch.log1p(col_excess / col_exp), col_excess
    return sums[2], sums[3], row_pos, col_pos, e, tuple(sums)


def single_backward(kept: Tensor, prod: AnyProducts, b: Tensor, row: Direction, col: Direction | None,
                     c_row: Tensor | None, c_col: Tensor | None, plan: SoftmaxPlan, by_sums: bool = False) -> tuple[Tensor, Tensor | None]:
    """``G @ B`` and ``G.T @ A`` of a single tile, positive part folded into G.

    Soft-max part ``G_ij = u_i p_ij + v_j q_ij`` (row and column soft-max), positive part
    ``G_ij += P_ij (c_i + c'_j)``. Symmetric: G already holds both roles of every row
    (``H = G + G.T``), so the positive part enters as ``P_ij c_i + P_ji c_j``.
    """
    if plan.fixed:  # exp(S_ij - LSE_i) = exp(S_ij) exp(-LSE_i): one exp per element for both directions
        # by_sums: the executor already divided by the sums of exp(S) (row[0] is u / sum = u exp(-LSE))
        u = row[0] if by_sums else row[0] * inverse_exp(row[1], plan)
        # (u_i + v_j) formed, then multiplied in place: one tile-sized buffer, not two
        if plan.symmetric:
            g = (u.unsqueeze(1) + u).mul_(kept)
        elif col is not None:
            v = col[0] if by_sums else col[0] * inverse_exp(col[1], plan)
            g = (u[:, None] + v).mul_(kept)
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
        blank(g, plan, 0, 0, excluded(plan, 0, g.shape[0], 0, g.shape[1]), 0.0)
    if plan.positives is not None and c_row is not None:
        _fold_positives(g, plan.positives, plan, c_row, c_col)
    if plan.symmetric or plan.grad_columns == 0:
        return prod.row_product(g), None
    if plan.grad_columns >= b.shape[0]:
        return prod.row_product(g), prod.column_product(g)
    ga_acc = torch.zeros_like(b)
    ga_acc[: plan.grad_columns] = prod.column_product(g[:, : plan.grad_columns])
    return prod.row_product(g), ga_acc


def _fold_positives(g: Tensor, positives: Positives, plan: SoftmaxPlan, c_row: Tensor, c_col: Tensor | None) -> None:
    """``G_ij += P_ij (c_i + c'_j)`` in place (symmetric: ``P_ij c_i + P_ji c_j``).

    ``c_row`` / ``c_col`` may be 0-dim (the same coefficient for every row / column).
    """
    how, partner = _positive_layout(positives)
    strided = partner is not None and how != "partner"
    if strided and c_col is not None:  # a two-set loss: row and column coefficients
        _add_two_set(g, how, c_row, c_col)
        return
    if strided:  # one set of coefficients (a single set's columns are its rows)
        places = _places(plan)
        # G[i, p(i)] += c_i, and when symmetric G[p(i), i] += c_i too: one accumulating write
        if plan.symmetric and c_row.ndim == 1:
            put_both(g, places, c_row)
            return
        at = places.both if plan.symmetric else places.positives
        put_at(g, at, c_row.expand(at.shape[0]) if c_row.ndim == 0 else c_row, accumulate=True)
        return
    c_row = c_row.expand(g.shape[0])
    c_col = None if c_col is None else c_col.expand(g.shape[1])
    if partner is not None:
        rows = torch.arange(g.shape[0], device=g.device)
        g.index_put_((rows, partner), c_row if c_col is None else c_row + c_col[partner], accumulate=True)
        if plan.symmetric:
            g.index_put_((partner, rows), c_row, accumulate=True)
    else:
        mask = positives.tile_values(0, g.shape[0], 0, g.shape[1], g.dtype)
        g.addcmul_(mask, c_row[:, None] if c_col is None else c_row[:, None] + c_col[None, :])
        if plan.symmetric:
            g.addcmul_(mask.t(), c_row[None, :])


def _add_two_set(g: Tensor, layout: str, c_row: Tensor, c_col: Tensor) -> None:
    """``G[i, i] += c_i + c'_i``: a two-set loss's positives on the identity layout (the only
    strided layout with column terms: the pairing rules' layouts are single sets)."""
    if layout != "identity":
        raise RuntimeError(f"internal: column coefficients on the {layout!r} layout")
    g.diagonal().add_(c_row + c_col)


# ----------------------------------------------------------------------- many tiles
def forward_fixed(prod: AnyProducts, a: Tensor, C: int, plan: SoftmaxPlan) -> tuple[Tensor, Tensor | None]:
    """Plain sums of ``exp(S)`` (no shift): exact when ``|S| <= 40`` (fp32)."""
    R = a.shape[0]
    row_sum = a.new_zeros(R)
    col_sum = a.new_zeros(C) if plan.columns else None

    def visit(s: Tensor, r0: int, r1: int, c0: int, c1: int, bufs: Buffers) -> None:
        e = s.exp_()
        diag = self_diagonal(e, r0, c0, plan.self_offset)
        if diag is not None:
            diag.zero_()
        drop(e, plan, r0, r1, c0, c1)
        row_sum[r0:r1] += e.sum(1)
        if plan.symmetric and c0 != r0:
            row_sum[c0:c1] += e.sum(0)
        if col_sum is not None:
            col_sum[c0:c1] += e.sum(0)

    sweep(prod, R, C, plan.tile, plan.symmetric, visit)
    return fixed_lse(row_sum, col_sum, plan, C)


def fixed_lse(row_sum: Tensor, col_sum: Tensor | None, plan: SoftmaxPlan, n_cols: int) -> tuple[Tensor, Tensor | None]:
    """Row (and column) log-sum-exp from plain sums of ``exp(S)``; across ranks the column
    sums are added first."""
    row_lse = log_total(row_sum, None, plan, n_cols)
    if col_sum is None:
        return row_lse, None
    if plan.column_comm is not None:
        plan.column_comm.all_sum(col_sum)  # no per-rank shift: the sums just add
    return row_lse, col_sum.log()


def complete_columns(col_sum: Tensor, col_max: Tensor, plan: SoftmaxPlan) -> Tensor:
    """Column LSE from (sum, max); across ranks: bring partial sums to the global maximum."""
    if plan.column_comm is not None:
        global_max = col_max.clone()
        plan.column_comm.all_max(global_max)
        col_sum = col_sum * torch.exp(col_max - global_max)
        plan.column_comm.all_sum(col_sum)
        col_max = global_max
    return col_sum.log() + col_max


def forward_online(prod: AnyProducts, a: Tensor, C: int, plan: SoftmaxPlan) -> tuple[Tensor, Tensor | None]:
    """Running (maximum, shifted sum) per row and column: exact for any logit range.

    A self entry is set to the lowest finite value before the maximum is taken and
    zeroed after the exp, so no ``inf - inf`` can arise.
    """
    R = a.shape[0]
    low = torch.finfo(a.dtype).min
    row_max, row_sum = a.new_full((R,), low), a.new_zeros(R)
    col_max, col_sum = a.new_full((C,), low), a.new_zeros(C)

    def visit(s: Tensor, r0: int, r1: int, c0: int, c1: int, bufs: Buffers) -> None:
        diag = self_diagonal(s, r0, c0, plan.self_offset)
        if diag is not None:
            diag.fill_(low)
        out = excluded(plan, r0, r1, c0, c1)
        blank(s, plan, r0, c0, out, low)
        work = bufs.get(r1 - r0, c1 - c0, 1)
        cleared = (plan, r0, c0, out)
        _online_update(s, row_max, row_sum, r0, r1, c0, plan.self_offset, dim=1, work=work, cleared=cleared)
        if plan.symmetric and c0 != r0:
            _online_update(s, row_max, row_sum, c0, c1, r0, None, dim=0, work=work, cleared=cleared)
        if plan.columns:
            _online_update(s, col_max, col_sum, c0, c1, r0, None, dim=0, work=work, cleared=cleared)

    sweep(prod, R, C, plan.tile, plan.symmetric, visit)
    row_lse = log_total(row_sum, row_max, plan, C)
    if not plan.columns:
        return row_lse, None
    return row_lse, complete_columns(col_sum, col_max, plan)


def _online_update(
    s: Tensor, run_max: Tensor, run_sum: Tensor, i0: int, i1: int, other0: int,
    self_offset: int | None, dim: int, work: Tensor, cleared: tuple[Any, int, int, Tensor | None] | None = None,
) -> None:
    """Fold one tile into running (max, sum-exp) statistics along ``dim``.

    ``i0:i1`` are the statistics' indices (rows for ``dim=1``, columns for ``dim=0``);
    ``other0`` is the first index of the other axis; ``self_offset`` (rows only) marks
    self entries whose exp must be zeroed.
    """
    new_max = raise_max(run_max, run_sum, i0, i1, s.amax(dim))
    shifted = torch.sub(s, new_max[:, None] if dim == 1 else new_max[None, :], out=work).exp_()
    diag = self_diagonal(shifted, i0, other0, self_offset)
    if diag is not None:
        diag.zero_()
    if cleared is not None:  # excluded entries sit at the lowest value: exp(0) = 1 while nothing else is seen
        blank(shifted, *cleared, 0.0)
    run_sum[i0:i1] += shifted.sum(dim)


def backward_fixed(prod: AnyProducts, a: Tensor, b: Tensor, row: Direction, col: Direction | None,
                   plan: SoftmaxPlan) -> tuple[Tensor, Tensor | None]:
    """``G @ B`` and ``G.T @ A`` with ``G_ij = u_i e^{S_ij} + v_j e^{S_ij}``.

    ``exp(S_ij - LSE_i) = exp(S_ij) * exp(-LSE_i)``: one exp per element serves both
    directions.
    """
    u = row[0] * inverse_exp(row[1], plan)
    v = None if col is None else col[0] * inverse_exp(col[1], plan)

    def grad_tile(s: Tensor, r0: int, r1: int, c0: int, c1: int, bufs: Buffers) -> Tensor:
        g = s.exp_()
        if v is not None:
            g.mul_(torch.add(u[r0:r1, None], v[None, c0:c1], out=bufs.get(r1 - r0, c1 - c0, 1)))
        else:
            g.mul_(u[r0:r1, None])
        leave_out(g, r0, r1, c0, c1, plan)
        return g

    return gradient_sweep(prod, a, b, plan.tile, plan.symmetric, grad_tile, plan.grad_columns)


def backward_online(prod: AnyProducts, a: Tensor, b: Tensor, row: Direction, col: Direction | None,
                    plan: SoftmaxPlan) -> tuple[Tensor, Tensor | None]:
    """``G @ B`` and ``G.T @ A`` with ``G_ij = g_i e^{S_ij - LSE_i} + h_j e^{S_ij - LSE'_j}``."""
    g_row, row_lse = row

    def grad_tile(s: Tensor, r0: int, r1: int, c0: int, c1: int, bufs: Buffers) -> Tensor:
        g = torch.sub(s, row_lse[r0:r1, None], out=bufs.get(r1 - r0, c1 - c0, 1)).exp_().mul_(g_row[r0:r1, None])
        if col is not None:
            g.add_(s.sub_(col[1][None, c0:c1]).exp_().mul_(col[0][None, c0:c1]))
        leave_out(g, r0, r1, c0, c1, plan)
        return g

    return gradient_sweep(prod, a, b, plan.tile, plan.symmetric, grad_tile, plan.grad_columns)


def leave_out(g: Tensor, r0: int, r1: int, c0: int, c1: int, plan: SoftmaxPlan) -> None:
    """Zero the self pairs and the excluded entries of a gradient tile."""
    diag = self_diagonal(g, r0, c0, plan.self_offset)
    if diag is not None:
        diag.zero_()
    if plan.fixed:  # finite tiles: multiply by the 0/1 factor
        drop(g, plan, r0, r1, c0, c1)
    else:  # an empty row's recomputed exp can be inf there: overwrite
        blank(g, plan, r0, c0, excluded(plan, r0, r1, c0, c1), 0.0)
