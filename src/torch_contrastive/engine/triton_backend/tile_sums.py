"""Bounded-regime sums: one program per tile forms ``exp(S)`` once and adds its row sums and
column sums into O(N) accumulators with atomics -- rows and columns in one pass. For a single
set only the upper-triangle tiles work; a triangle tile's column sums are its mirror rows'."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._configs import autotune, bucket, square_tiles
from ._host import acc_dtypes, check_device, exclusion_args, operand, precision, tl, triton
from ._tile import logits, tile_of, valid_mask, with_factors

#: Row blocks that sweep the column blocks together (grouped order, L2 reuse).
GROUP = 8


@triton.jit
def _tile_sums(bi, bj, x_ptr, y_ptr, row_sum_ptr, col_sum_ptr, fx_ptr, fy_ptr, n_rows, n_cols, d, stride_x, stride_y, self_offset,
               rk0, ck0, rk1, ck1, partner, g_rows, g_cols, threshold, dg, stride_gr, stride_gc, diagonal, keep_diagonal,
               HAS_SELF: tl.constexpr, EXCLUDE: tl.constexpr, N_KEYS: tl.constexpr, PARTNER: tl.constexpr,
               GUIDE: tl.constexpr, DIAGONAL: tl.constexpr, KEEP_DIAGONAL: tl.constexpr, GACC: tl.constexpr,
               COLUMNS: tl.constexpr, SYMMETRIC: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
               FACTORS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = bi * BLOCK + tl.arange(0, BLOCK)
    cols = bj * BLOCK + tl.arange(0, BLOCK)
    s = logits(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d, stride_x, stride_y, BLOCK, BLOCK, BLOCK_D, ACC, PRECISION)
    s = with_factors(s, rows, cols, n_rows, n_cols, fx_ptr, fy_ptr, FACTORS)
    valid = valid_mask(rows, cols, n_rows, n_cols, self_offset, rk0, ck0, rk1, ck1, partner, g_rows, g_cols, threshold, dg,
                       stride_gr, stride_gc, diagonal, keep_diagonal, HAS_SELF, EXCLUDE, False, N_KEYS, PARTNER, GUIDE,
                       DIAGONAL, KEEP_DIAGONAL, GACC, BLOCK, BLOCK, PRECISION)
    e = tl.where(valid, tl.exp(s), 0.0)
    tl.atomic_add(row_sum_ptr + rows, tl.sum(e, axis=1), mask=rows < n_rows, sem="relaxed")
    if COLUMNS:
        tl.atomic_add(col_sum_ptr + cols, tl.sum(e, axis=0), mask=cols < n_cols, sem="relaxed")
    if SYMMETRIC:  # the mirror tile's rows are this tile's columns
        mirror = (cols < n_cols) & (cols // BLOCK != bi)  # not from the diagonal tile
        tl.atomic_add(row_sum_ptr + cols, tl.sum(e, axis=0), mask=mirror, sem="relaxed")


@autotune(square_tiles(), reset_to_zero=["row_sum_ptr", "col_sum_ptr"])
@triton.jit
def _tile_sums_kernel(x_ptr, y_ptr, row_sum_ptr, col_sum_ptr, fx_ptr, fy_ptr, n_rows, n_cols, d, bucket, stride_x, stride_y, self_offset,
                      rk0, ck0, rk1, ck1, partner, g_rows, g_cols, threshold, dg, stride_gr, stride_gc, diagonal,
                      keep_diagonal, HAS_SELF: tl.constexpr, EXCLUDE: tl.constexpr, N_KEYS: tl.constexpr,
                      PARTNER: tl.constexpr, GUIDE: tl.constexpr, DIAGONAL: tl.constexpr, KEEP_DIAGONAL: tl.constexpr,
                      GACC: tl.constexpr, COLUMNS: tl.constexpr, SYMMETRIC: tl.constexpr, ACC: tl.constexpr,
                      PRECISION: tl.constexpr, FACTORS: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    """One tile: ``exp(S)`` once, its row sums and column sums added with atomics; for a
    single set the programs below the diagonal do nothing."""
    bi, bj = tile_of(n_rows, n_cols, BLOCK, GROUP)
    if not SYMMETRIC or bj >= bi:
        _tile_sums(bi, bj, x_ptr, y_ptr, row_sum_ptr, col_sum_ptr, fx_ptr, fy_ptr, n_rows, n_cols, d, stride_x, stride_y, self_offset,
                   rk0, ck0, rk1, ck1, partner, g_rows, g_cols, threshold, dg, stride_gr, stride_gc, diagonal, keep_diagonal,
                   HAS_SELF, EXCLUDE, N_KEYS, PARTNER, GUIDE, DIAGONAL, KEEP_DIAGONAL, GACC, COLUMNS, SYMMETRIC, ACC,
                   PRECISION, FACTORS, BLOCK, BLOCK_D)


def tile_sums(x_scaled: Tensor, y: Tensor, self_offset: int | None, exclude: Any, columns: bool,
              symmetric: bool, factors: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
    """Bounded regime: ``(sum_j exp(S_ij), sum_i exp(S_ij))`` over the candidates that
    count, rows and columns from one pass over the tiles (atomics; the column sums are None
    unless ``columns``). ``symmetric``: ``y`` is ``x``'s own set, the upper-triangle tiles only.
    ``factors``: ``(fx, fy)``, ``S_ij = fx_i fy_j <x_i, y_j>`` (see :func:`~.row_lse.row_lse`)."""
    check_device(x_scaled)
    x, yy = operand(x_scaled), operand(y)
    r, c, d = x.shape[0], yy.shape[0], x.shape[1]
    dtype, acc = acc_dtypes(x)
    row_sum = torch.zeros(r, dtype=dtype, device=x.device)
    col_sum = torch.zeros(c, dtype=dtype, device=x.device) if columns else row_sum
    excl_args, flags = exclusion_args(exclude, x)

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(r, meta["BLOCK"]) * triton.cdiv(c, meta["BLOCK"]),)

    fx, fy = factors if factors is not None else (row_sum, row_sum)
    _tile_sums_kernel[grid](
        x, yy, row_sum, col_sum, fx, fy, r, c, d, bucket(r, c), x.stride(0), yy.stride(0), 0 if self_offset is None else self_offset,
        *excl_args, HAS_SELF=self_offset is not None, COLUMNS=columns, SYMMETRIC=symmetric, ACC=acc, PRECISION=precision(x),
        FACTORS=factors is not None, GROUP=GROUP, **flags)
    return row_sum, col_sum if columns else None
