"""The mask-in-tile losses as fused tile kernels: the positive mask is formed in registers.

* pytorch-metric-learning's NT-Xent with labels (``binary=False``): one term per positive pair,
  ``softplus(L_i - S_ip)`` with ``L_i`` the log-sum-exp of row i's negatives (the row-owned
  log-sum-exp kernel with the same-label pairs excluded); the forward adds the terms and
  ``w_i = sum_p sigmoid(L_i - S_ip)`` per row, the backward forms
  ``G = e^{S_in - L_i} w_i g_i`` on negatives and ``-sigmoid(L_i - S_ip) g_i`` on positives.
* NT-BXent (``binary=True``): ``(sum_pos softplus(-S), sum_neg softplus(S))`` per row, backward
  ``G = -sigmoid(-S) g0_i`` on positives and ``sigmoid(S) g1_i`` on negatives.

Positives by one or two id keys, a partner column per row, or a listed set of (row, column) pairs
(NT-BXent's ``pos_indices``: membership tested per tile, ``_tile.listed``); the self pair
(``j = i + offset``) is neither. Each gradient tile is formed once and its two products added with atomics.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...positives import KeyPositives, PairPositives, PartnerPositives
from ._configs import autotune, bucket, owned_grid, owned_outputs, square_grads, square_sums, tile_grid
from ._host import DERIVED, acc_dtypes, fused, gradient_factors, keys, launch, launch_operands, tl, triton
from ._tile import listed, logits, owned_product, related, scatter_products, softplus, tile_of, with_factors
from .tile_sums import GROUP


@triton.jit
def relation_masks(rows, cols, n_rows, n_cols, rel, self_offset):
    """(positive, negative) masks of the tile; the self pair and out-of-bounds entries are neither. ``rel`` is the
    relation as one tuple (:data:`RELATION_FIELDS`, None where absent): positives by listed pairs (``pair_ptr``
    given), else by keys or a partner."""
    r_ok = rows < n_rows
    c_ok = cols < n_cols
    if rel[5] is not None:  # pair_ptr, pair_col
        pos = listed(rows, cols, r_ok, rel[5], rel[6])
    else:
        pos = related(rows, cols, r_ok, c_ok, rel[0], rel[1], rel[2], rel[3], rel[4])
    counted = r_ok[:, None] & c_ok[None, :]
    if self_offset is not None:
        counted = counted & (cols[None, :] != rows[:, None] + self_offset)
    return pos & counted, counted & ~pos


@triton.jit
def _pair_tile(bi, bj, x_ptr, y_ptr, fx_ptr, fy_ptr, rel, n_rows, n_cols, d,
               self_offset, ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tile ``(bi, bj)``: its rows, columns, logits and positive / negative masks."""
    rows = bi * BLOCK + tl.arange(0, BLOCK)
    cols = bj * BLOCK + tl.arange(0, BLOCK)
    s = logits(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d, BLOCK, BLOCK, BLOCK_D, ACC, PRECISION)
    s = with_factors(s, rows, cols, n_rows, n_cols, fx_ptr, fy_ptr)
    pos, neg = relation_masks(rows, cols, n_rows, n_cols, rel, self_offset)
    return rows, cols, s, pos, neg


@triton.jit
def _row_terms(bi, bj, x_ptr, y_ptr, lse_ptr, fx_ptr, fy_ptr, rel, n_rows, n_cols,
               d, self_offset, BINARY: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """Tile ``(bi, bj)``'s share of the two per-row sums (see :func:`pair_sums`)."""
    rows, _cols, s, pos, neg = _pair_tile(bi, bj, x_ptr, y_ptr, fx_ptr, fy_ptr, rel,
                                          n_rows, n_cols, d, self_offset, ACC, PRECISION, BLOCK, BLOCK_D)
    if BINARY:
        first = tl.where(pos, softplus(-s), 0.0)
        second = tl.where(neg, softplus(s), 0.0)
    else:  # L_i = -inf (no negative): softplus and sigmoid of -inf are 0, the row adds nothing
        lse = tl.load(lse_ptr + rows, mask=rows < n_rows, other=0.0)
        diff = lse[:, None] - s
        first = tl.where(pos, softplus(diff), 0.0)
        second = tl.where(pos, tl.sigmoid(diff), 0.0)
    return rows, tl.sum(first, axis=1), tl.sum(second, axis=1)


@triton.heuristics(DERIVED)
@triton.jit
def _pair_sums(x_ptr, y_ptr, out_ptr, lse_ptr, fx_ptr, fy_ptr, n_rows, n_cols, d, bucket, self_offset, BINARY: tl.constexpr,
               OWNED: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
               BLOCK_D: tl.constexpr, rel):
    """Fused: one tile per program, row sums added with atomics. ``OWNED``: one row block per
    program sweeps the column blocks in order and stores its sums (deterministic). ``out`` holds
    the first sum per row, then the second."""
    if OWNED:
        bi = tl.program_id(0)
        rows = bi * BLOCK + tl.arange(0, BLOCK)
        acc0 = tl.zeros((BLOCK,), dtype=ACC)
        acc1 = tl.zeros((BLOCK,), dtype=ACC)
        for bj in range(0, tl.cdiv(n_cols, BLOCK)):
            _rows, t0, t1 = _row_terms(bi, bj, x_ptr, y_ptr, lse_ptr, fx_ptr, fy_ptr, rel, n_rows, n_cols, d, self_offset,
                                       BINARY, ACC, PRECISION, BLOCK, BLOCK_D)
            acc0 += t0
            acc1 += t1
        tl.store(out_ptr + rows, acc0, mask=rows < n_rows)
        tl.store(out_ptr + n_rows + rows, acc1, mask=rows < n_rows)
    else:
        bi, bj = tile_of(n_rows, n_cols, BLOCK, GROUP)
        rows, t0, t1 = _row_terms(bi, bj, x_ptr, y_ptr, lse_ptr, fx_ptr, fy_ptr, rel, n_rows, n_cols, d, self_offset,
                                  BINARY, ACC, PRECISION, BLOCK, BLOCK_D)
        tl.atomic_add(out_ptr + rows, t0, mask=rows < n_rows, sem="relaxed")
        tl.atomic_add(out_ptr + n_rows + rows, t1, mask=rows < n_rows, sem="relaxed")


# One jitted body, two autotuners: each scheme times and caches its own best config.
_pair_sums_kernel = autotune(square_sums(), reset_to_zero=["out_ptr"])(_pair_sums)
_pair_sums_owned_kernel = autotune(square_sums())(_pair_sums)


@triton.jit
def _grad_tile(bi, bj, x_ptr, y_ptr, lse_ptr, w_ptr, g0_ptr, g1_ptr, fx_ptr, fy_ptr, rel, n_rows, n_cols, d, self_offset,
               BINARY: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tile ``(bi, bj)``'s gradient ``G = d loss / d S`` (see :func:`pair_grad`), with its rows and columns."""
    rows, cols, s, pos, neg = _pair_tile(bi, bj, x_ptr, y_ptr, fx_ptr, fy_ptr, rel,
                                         n_rows, n_cols, d, self_offset, ACC, PRECISION, BLOCK, BLOCK_D)
    return rows, cols, pair_gradient(s, rows, pos, neg, n_rows, lse_ptr, w_ptr, g0_ptr, g1_ptr, BINARY)


@triton.jit
def pair_gradient(s, rows, pos, neg, n_rows, lse_ptr, w_ptr, g0_ptr, g1_ptr, BINARY: tl.constexpr):
    """``G = d loss / d S`` of a block with its positive and negative masks: NT-BXent's
    ``-sigmoid(-S) g0_i`` / ``sigmoid(S) g1_i``, or PML NT-Xent's ``e^{S_in - L_i} w_i g_i`` on negatives
    and ``-sigmoid(L_i - S_ip) g_i`` on positives (0 elsewhere)."""
    row_ok = rows < n_rows
    g0 = tl.load(g0_ptr + rows, mask=row_ok, other=0.0)
    if BINARY:
        g1 = tl.load(g1_ptr + rows, mask=row_ok, other=0.0)
        grad = tl.where(pos, -tl.sigmoid(-s) * g0[:, None], tl.where(neg, tl.sigmoid(s) * g1[:, None], 0.0))
    else:
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        has_neg = lse > float("-inf")
        w = tl.load(w_ptr + rows, mask=row_ok, other=0.0)
        factor = tl.where(has_neg, w * g0, 0.0)  # a row without negatives gets no gradient
        shift = tl.where(has_neg, lse, 0.0)
        grad = tl.where(neg, tl.exp(s - shift[:, None]) * factor[:, None],
                        tl.where(pos, -tl.sigmoid(lse[:, None] - s) * g0[:, None], 0.0))
    return grad


@autotune(square_grads(), reset_to_zero=["ga_ptr", "gb_ptr"])
@triton.heuristics(DERIVED)
@triton.jit
def _pair_grad_kernel(x_ptr, y_ptr, z_ptr, ga_ptr, gb_ptr, lse_ptr, w_ptr, g0_ptr, g1_ptr, fx_ptr, fy_ptr, fz_ptr, n_rows, n_cols,
                      d, bucket, self_offset, BINARY: tl.constexpr, FACTORS: tl.constexpr, ACC: tl.constexpr,
                      PRECISION: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, rel):
    """Fused: each tile's gradient formed once, both products added with atomics."""
    bi, bj = tile_of(n_rows, n_cols, BLOCK, GROUP)
    rows, cols, grad = _grad_tile(bi, bj, x_ptr, y_ptr, lse_ptr, w_ptr, g0_ptr, g1_ptr, fx_ptr, fy_ptr, rel, n_rows, n_cols, d,
                                  self_offset, BINARY, ACC, PRECISION, BLOCK,
                                  BLOCK_D)
    scatter_products(grad, rows, cols, d, y_ptr, z_ptr, ga_ptr, gb_ptr, rows < n_rows, cols < n_cols, cols < n_cols, n_rows,
                     n_cols, fy_ptr, fz_ptr, FACTORS, True, ACC, PRECISION, BLOCK_D)


@triton.heuristics(DERIVED)
@triton.jit
def _pair_grad_owned(x_ptr, y_ptr, z_ptr, out_ptr, lse_ptr, w_ptr, g0_ptr, g1_ptr, fx_ptr, fy_ptr, fz_ptr, n_rows, n_cols, d,
                     bucket, self_offset, BINARY: tl.constexpr, COLUMNS: tl.constexpr, FACTORS: tl.constexpr,
                     ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_O: tl.constexpr, rel):
    """Deterministic: the program owns a block of output rows and features and sweeps the other
    side's blocks in order -- ``G diag(fy) @ y`` for a row block, or (``COLUMNS``)
    ``(diag(fz) G).T @ z`` for a column block. Each tile is formed in its own orientation, so the
    relation is never read transposed; the logits are recomputed once per feature block."""
    own = tl.program_id(0)
    ds = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    acc = tl.zeros((BLOCK, BLOCK_O), dtype=ACC)
    n_other = tl.cdiv(n_rows, BLOCK) if COLUMNS else tl.cdiv(n_cols, BLOCK)
    for other in range(0, n_other):
        bi = other if COLUMNS else own
        bj = own if COLUMNS else other
        rows, cols, grad = _grad_tile(bi, bj, x_ptr, y_ptr, lse_ptr, w_ptr, g0_ptr, g1_ptr, fx_ptr, fy_ptr, rel, n_rows, n_cols, d,
                                      self_offset, BINARY, ACC, PRECISION,
                                      BLOCK, BLOCK_D)
        acc = owned_product(acc, grad, rows, cols, ds, n_rows, n_cols, d, y_ptr, z_ptr, fy_ptr, fz_ptr, FACTORS, COLUMNS, ACC,
                            PRECISION)
    mine = own * BLOCK + tl.arange(0, BLOCK)
    n_mine = n_cols if COLUMNS else n_rows
    tl.store(out_ptr + mine[:, None] * d + ds[None, :], acc, mask=(mine[:, None] < n_mine) & (ds[None, :] < d))


_pair_grad_rows_kernel = autotune(owned_outputs())(_pair_grad_owned)
_pair_grad_cols_kernel = autotune(owned_outputs())(_pair_grad_owned)


#: The order of a pair relation's parts in the kernels' one ``rel`` argument (:func:`relation_args`).
RELATION_FIELDS = ("rk0", "ck0", "rk1", "ck1", "partner", "pair_ptr", "pair_col")


def relation_args(positives: Any) -> dict[str, tuple[Any, ...]]:
    """The positive relation as the kernels read it: ``{"rel": (...)}``, keys, a partner or listed pairs in the
    order of :data:`RELATION_FIELDS`, None where absent (one kernel argument instead of seven)."""
    if isinstance(positives, KeyPositives):
        parts: dict[str, Any] = keys(positives.row_keys, positives.col_keys)
    elif isinstance(positives, PartnerPositives):
        parts = {"partner": positives.partner.contiguous()}
    elif isinstance(positives, PairPositives):
        pair_ptr, pair_col = positives.row_lists
        parts = {"pair_ptr": pair_ptr, "pair_col": pair_col}
    else:
        parts = {}
    if parts:
        return {"rel": tuple(parts.get(name) for name in RELATION_FIELDS)}
    # the planner refuses other relations before any work
    raise ValueError(f"the pair kernels take positives by ids, a partner or index pairs, not a {positives.kind!r} relation")


def pair_sums(x_scaled: Tensor, y: Tensor, positives: Any, binary: bool, lse: Tensor | None = None,
              factors: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Per row: NT-BXent's ``(sum_pos softplus(-S), sum_neg softplus(S))`` (``binary``), or
    PML NT-Xent's ``(sum_p softplus(L_i - S_ip), sum_p sigmoid(L_i - S_ip))`` given the negatives'
    log-sum-exps ``lse`` (``-inf`` for a row without negatives). ``S = x_scaled @ y.T`` (with
    ``factors``: ``fx_i fy_j <x_i, y_j>``); the self pair is ``positives.self_offset``'s.
    Under ``torch.use_deterministic_algorithms(True)`` row blocks own their sums (no atomics)."""
    x, yy = launch_operands(x_scaled, y)
    r, c, d = x.shape[0], yy.shape[0], x.shape[1]
    out = torch.zeros(2 * r, dtype=acc_dtypes(x)[0], device=x.device)  # both sums: one accumulator to reset
    fx, fy = factors if factors is not None else (None, None)
    owned = not fused()
    kernel = _pair_sums_owned_kernel if owned else _pair_sums_kernel
    launch(kernel, tile_grid(r, c, owned), x, yy, out, None if lse is None else lse.contiguous(), fx, fy, r, c, d, bucket(r, c),
                                   positives.self_offset, BINARY=binary, OWNED=owned, GROUP=GROUP, **relation_args(positives))
    return out[:r], out[r:]


def pair_grad(x_scaled: Tensor, y: Tensor, z: Tensor, positives: Any, binary: bool, grads: tuple[Tensor, ...],
              lse: Tensor | None = None, weight: Tensor | None = None,
              factors: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """``(G diag(fy) @ y, (diag(fz) G).T @ z)`` of :func:`pair_sums`'s terms for the upstream
    per-row gradients ``grads`` (two for ``binary``, one otherwise, with its ``lse`` and ``weight``):
    each gradient tile formed once and both products added with atomics, or -- under
    ``torch.use_deterministic_algorithms(True)`` -- row blocks and column blocks owning their
    outputs (the tile formed once per direction and feature block)."""
    x, yy, zz = launch_operands(x_scaled, y, z)
    r, c, d = x.shape[0], yy.shape[0], x.shape[1]
    dtype = acc_dtypes(x)[0]
    g0 = grads[0].to(dtype).expand(r).contiguous()
    g1 = grads[1].to(dtype).expand(r).contiguous() if binary else None
    fx, fy, fz = factors if factors is not None else (None, None, None)
    stats = (None if lse is None else lse.contiguous(), None if weight is None else weight.contiguous(), g0, g1, fx, fy, fz,
             r, c, d, bucket(r, c), positives.self_offset)
    common = dict(BINARY=binary, FACTORS=gradient_factors(factors, x_scaled), **relation_args(positives))
    if fused():
        ga = torch.zeros(r, d, dtype=dtype, device=x.device)
        gb = torch.zeros(c, d, dtype=dtype, device=x.device)
        launch(_pair_grad_kernel, tile_grid(r, c), x, yy, zz, ga, gb, *stats, GROUP=GROUP, **common)
        return ga, gb
    ga = torch.empty(r, d, dtype=dtype, device=x.device)
    gb = torch.empty(c, d, dtype=dtype, device=x.device)
    for kernel, out, blocks_of, columns in ((_pair_grad_rows_kernel, ga, r, False), (_pair_grad_cols_kernel, gb, c, True)):
        launch(kernel, owned_grid(blocks_of, d), x, yy, zz, out, *stats, COLUMNS=columns, **common)
    return ga, gb
