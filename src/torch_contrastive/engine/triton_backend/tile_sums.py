"""Bounded-regime sums: one program per tile forms ``exp(S)`` once and adds its row sums and
column sums into O(N) accumulators with atomics -- rows and columns in one pass. For a single
set only the upper-triangle tiles work; a triangle tile's column sums are its mirror rows'."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._configs import autotune, bucket, square_sums, tile_grid
from ._host import DERIVED_EXCLUSION, acc_dtypes, exclusion, launch, launch_operands, packed, tl, triton
from ._tile import logits, tile_of, valid_mask, with_factors

#: Row blocks that sweep the column blocks together (grouped order, L2 reuse).
GROUP = 8


@triton.jit
def _tile_sums(bi, bj, x_ptr, y_ptr, row_sum_ptr, col_sum_ptr, fx_ptr, fy_ptr, n_rows, n_cols, d, self_offset, excl, EXCLUDE: tl.constexpr,
               GACC: tl.constexpr, COLUMNS: tl.constexpr, SYMMETRIC: tl.constexpr, ACC: tl.constexpr,
               PRECISION: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = bi * BLOCK + tl.arange(0, BLOCK)
    cols = bj * BLOCK + tl.arange(0, BLOCK)
    s = logits(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d, BLOCK, BLOCK, BLOCK_D, ACC, PRECISION)
    s = with_factors(s, rows, cols, n_rows, n_cols, fx_ptr, fy_ptr)
    valid = valid_mask(rows, cols, n_rows, n_cols, self_offset, excl, EXCLUDE, False, GACC, BLOCK, BLOCK, PRECISION)
    e = tl.where(valid, tl.exp(s), 0.0)
    tl.atomic_add(row_sum_ptr + rows, tl.sum(e, axis=1), mask=rows < n_rows, sem="relaxed")
    if COLUMNS:
        tl.atomic_add(col_sum_ptr + cols, tl.sum(e, axis=0), mask=cols < n_cols, sem="relaxed")
    if SYMMETRIC:  # the mirror tile's rows are this tile's columns
        mirror = (cols < n_cols) & (cols // BLOCK != bi)  # not from the diagonal tile
        tl.atomic_add(row_sum_ptr + cols, tl.sum(e, axis=0), mask=mirror, sem="relaxed")


@autotune(square_sums(), reset_to_zero=["sums_ptr"])
@triton.heuristics(DERIVED_EXCLUSION)
@triton.jit
def _tile_sums_kernel(x_ptr, y_ptr, sums_ptr, fx_ptr, fy_ptr, n_rows, n_cols, d, bucket, self_offset,
                      COLUMNS: tl.constexpr, SYMMETRIC: tl.constexpr, EXCLUDE: tl.constexpr, GACC: tl.constexpr,
                      ACC: tl.constexpr, PRECISION: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                      BLOCK_D: tl.constexpr, excl):
    """One tile: ``exp(S)`` once, its row sums and column sums added with atomics; for a
    single set the programs below the diagonal do nothing."""
    bi, bj = tile_of(n_rows, n_cols, BLOCK, GROUP)
    if not SYMMETRIC or bj >= bi:  # one accumulator: the row sums, then the column sums
        _tile_sums(bi, bj, x_ptr, y_ptr, sums_ptr, sums_ptr + n_rows, fx_ptr, fy_ptr, n_rows, n_cols, d, self_offset, excl, EXCLUDE, GACC, COLUMNS,
                   SYMMETRIC, ACC, PRECISION, BLOCK, BLOCK_D)


def tile_sums(x_scaled: Tensor, y: Tensor, self_offset: int | None, exclude: Any, columns: bool,
              symmetric: bool, factors: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
    """Bounded regime: ``(sum_j exp(S_ij), sum_i exp(S_ij))`` over the candidates that
    count, rows and columns from one pass over the tiles (atomics; the column sums are None
    unless ``columns``). ``symmetric``: ``y`` is ``x``'s own set, the upper-triangle tiles only.
    ``factors``: ``(fx, fy)``, ``S_ij = fx_i fy_j <x_i, y_j>`` (see :func:`~.row_lse.row_lse`)."""
    x, yy = launch_operands(x_scaled, y)
    r, c, d = x.shape[0], yy.shape[0], x.shape[1]
    dtype = acc_dtypes(x)[0]
    # one zeroed accumulator, so the autotuner's reset between timed runs covers both directions
    sums = torch.zeros(r + (c if columns else 0), dtype=dtype, device=x.device)
    fx, fy = factors if factors is not None else (None, None)
    launch(_tile_sums_kernel, tile_grid(r, c), x, yy, sums, fx, fy, r, c, d, bucket(r, c), self_offset, COLUMNS=columns,
                                       SYMMETRIC=symmetric, GROUP=GROUP, excl=packed(exclusion(exclude)))
    return sums[:r], (sums[r:] if columns else None)
