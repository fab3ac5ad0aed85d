"""Fused backward: one program per tile recomputes its logits, forms the gradient tile ``G``
once in registers and, D block by D block, adds ``G @ Y`` into its rows and ``G.T @ Z`` into
its columns with atomics -- 4 GEMM-equivalents for a two-set loss, 2 for a single set (upper
triangle; ``G`` is symmetric, so the mirror rows get ``G.T @ Z``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._configs import autotune, bucket, square_grads, tile_grid
from ._host import DERIVED_EXCLUSION, acc_dtypes, directions, exclusion, gradient_factors, launch, launch_operands, packed, tl, triton
from ._tile import gradient_tile, logits, scatter_products, tile_of, valid_mask, with_factors
from .tile_sums import GROUP


@triton.jit
def _tile_grad(bi, bj, x_ptr, y_ptr, z_ptr, ga_ptr, gb_ptr, fx_ptr, fy_ptr, fz_ptr, lse_r_ptr, u_ptr, lse_c_ptr, v_ptr, n_rows,
               n_cols, d, grad_cols, self_offset, excl, EXCLUDE: tl.constexpr, GACC: tl.constexpr, GRAD_COLS: tl.constexpr, SYMMETRIC: tl.constexpr,
               ACC: tl.constexpr, PRECISION: tl.constexpr, FACTORS: tl.constexpr, BLOCK: tl.constexpr,
               BLOCK_D: tl.constexpr):
    rows = bi * BLOCK + tl.arange(0, BLOCK)
    cols = bj * BLOCK + tl.arange(0, BLOCK)
    s = logits(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d, BLOCK, BLOCK, BLOCK_D, ACC, PRECISION)
    s = with_factors(s, rows, cols, n_rows, n_cols, fx_ptr, fy_ptr)
    g = gradient_tile(s, rows, cols, n_rows, n_cols, lse_r_ptr, u_ptr, lse_c_ptr, v_ptr)
    valid = valid_mask(rows, cols, n_rows, n_cols, self_offset, excl, EXCLUDE, False, GACC, BLOCK, BLOCK, PRECISION)
    g = tl.where(valid, g, 0.0)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    if SYMMETRIC:  # G is symmetric: the mirror tile's rows get G.T @ Z (not from a diagonal tile)
        scatter_products(g, rows, cols, d, y_ptr, z_ptr, ga_ptr, ga_ptr, row_ok, col_ok, col_ok & (cols // BLOCK != bi), n_rows,
                         n_cols, fy_ptr, fz_ptr, FACTORS, True, ACC, PRECISION, BLOCK_D)
    else:
        scatter_products(g, rows, cols, d, y_ptr, z_ptr, ga_ptr, gb_ptr, row_ok, col_ok, cols < grad_cols, n_rows, n_cols,
                         fy_ptr, fz_ptr, FACTORS, GRAD_COLS, ACC, PRECISION, BLOCK_D)


@autotune(square_grads(), reset_to_zero=["out_ptr"])
@triton.heuristics(DERIVED_EXCLUSION)
@triton.jit
def _tile_grad_kernel(x_ptr, y_ptr, z_ptr, out_ptr, fx_ptr, fy_ptr, fz_ptr, lse_r_ptr, u_ptr, lse_c_ptr, v_ptr, n_rows, n_cols, d,
                      bucket, grad_cols, self_offset, GRAD_COLS: tl.constexpr, SYMMETRIC: tl.constexpr,
                      FACTORS: tl.constexpr, EXCLUDE: tl.constexpr, GACC: tl.constexpr, ACC: tl.constexpr,
                      PRECISION: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, excl):
    """One tile of the grouped grid; for a single set the programs below the diagonal do nothing.
    ``out`` holds ``G @ Y`` (R rows), then ``G.T @ Z`` (its first ``grad_cols`` rows used)."""
    bi, bj = tile_of(n_rows, n_cols, BLOCK, GROUP)
    if not SYMMETRIC or bj >= bi:
        _tile_grad(bi, bj, x_ptr, y_ptr, z_ptr, out_ptr, out_ptr + n_rows * d, fx_ptr, fy_ptr, fz_ptr, lse_r_ptr, u_ptr,
                   lse_c_ptr, v_ptr, n_rows, n_cols, d, grad_cols, self_offset, excl, EXCLUDE, GACC, GRAD_COLS, SYMMETRIC, ACC, PRECISION, FACTORS,
                   BLOCK, BLOCK_D)


def tile_grad(x_scaled: Tensor, y: Tensor, z: Tensor, row: tuple[Tensor, Tensor], col: tuple[Tensor, Tensor] | None,
              self_offset: int | None, exclude: Any, grad_columns: int, symmetric: bool,
              factors: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
    """``(G @ y, G.T @ z)`` from one pass over the tiles, each gradient tile formed once
    (atomics). ``G.T @ z`` covers the first ``grad_columns`` candidates (None for 0);
    ``symmetric``: ``y`` is ``x``'s own set, upper-triangle tiles, ``G @ y`` holds both
    roles and the second result is None. ``factors``: ``(fx, fy, fz)`` for raw half rows,
    ``S_ij = fx_i fy_j <x_i, y_j>``, results ``G diag(fy) @ y`` and ``(diag(fz) G).T @ z``."""
    x, yy, zz = launch_operands(x_scaled, y, z)
    r, c, d = x.shape[0], yy.shape[0], x.shape[1]
    grad_cols = 0 if symmetric else max(0, min(grad_columns, c))
    # one zeroed accumulator (rows, then the columns that get a gradient): the autotuner's reset
    # between timed runs covers both
    out = torch.zeros(r + (c if grad_cols else 0), d, dtype=acc_dtypes(x)[0], device=x.device)
    fx, fy, fz = factors if factors is not None else (None, None, None)
    launch(_tile_grad_kernel, tile_grid(r, c), x, yy, zz, out, fx, fy, fz, *directions(row, col, out.dtype), r, c, d, bucket(r, c),
                                       grad_cols, self_offset, GRAD_COLS=grad_cols > 0, SYMMETRIC=symmetric,
                                       FACTORS=gradient_factors(factors, x_scaled), GROUP=GROUP, excl=packed(exclusion(exclude)))
    return out[:r], (out[r:] if grad_cols else None)
