"""Row-owned gradient ``G @ Z`` (deterministic mode): one program per (row block, output
feature block) sweeps the columns, recomputing each logit tile; it owns its output, so no
atomics and bitwise-reproducible results. ``G.T @ A`` is the same kernel on ``S.T``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._configs import autotune, bucket, output_grid, row_output_blocks
from ._host import DERIVED_EXCLUSION, acc_dtypes, directions, exclusion, gradient_factors, launch, launch_operands, packed, tl, triton
from ._tile import gradient_tile, logits, owned_product, valid_mask, with_factors


@autotune(row_output_blocks())
@triton.heuristics(DERIVED_EXCLUSION)
@triton.jit
def _grad_rows_kernel(x_ptr, y_ptr, z_ptr, out_ptr, fx_ptr, fy_ptr, fz_ptr, lse_r_ptr, u_ptr, lse_c_ptr, v_ptr, n_rows, n_cols, d,
                      bucket, d_out, self_offset, TRANSPOSED: tl.constexpr, FACTORS: tl.constexpr, EXCLUDE: tl.constexpr,
                      GACC: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_O: tl.constexpr, excl):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    ds = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=ACC)
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        s = logits(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d, BLOCK_M, BLOCK_N, BLOCK_D, ACC, PRECISION)
        s = with_factors(s, rows, cols, n_rows, n_cols, fx_ptr, fy_ptr)
        g = gradient_tile(s, rows, cols, n_rows, n_cols, lse_r_ptr, u_ptr, lse_c_ptr, v_ptr)
        valid = valid_mask(rows, cols, n_rows, n_cols, self_offset, excl, EXCLUDE, TRANSPOSED, GACC, BLOCK_M, BLOCK_N, PRECISION)
        # the row-owned product step shared with the pair / SigLIP kernels: Z's rows are this tile's columns
        acc = owned_product(acc, tl.where(valid, g, 0.0), rows, cols, ds, n_rows, n_cols, d_out, z_ptr, z_ptr, fz_ptr, fz_ptr,
                            FACTORS, False, ACC, PRECISION)
    tl.store(out_ptr + rows[:, None] * d_out + ds[None, :], acc, mask=(rows[:, None] < n_rows) & (ds[None, :] < d_out))


def grad_rows(x_scaled: Tensor, y: Tensor, z: Tensor, row: tuple[Tensor, Tensor], col: tuple[Tensor, Tensor] | None,
              self_offset: int | None, exclude: Any = None, transposed: bool = False,
              factors: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """(R, D) ``G @ z`` (fp32; fp64 for fp64), ``G_ij = u_i exp(S_ij - L_i) (+ v_j exp(S_ij - M_j))``
    on the candidates that count. Row-owned, deterministic (a grid of row blocks by output
    feature blocks: the logits are recomputed once per output block).

    ``row = (u, L)``, ``col = (v, M)``; ``S = x_scaled @ y.T``. For ``G.T @ A`` call it on
    ``S.T`` with ``transposed=True``: ``grad_rows(y, x_scaled, a, col, row, -self_offset, exclude, True)``.
    ``factors``: ``(fx, fy, fz)`` for raw half rows: ``S_ij = fx_i fy_j <x_i, y_j>`` and the output
    ``G @ diag(fz) z``.
    """
    x, yy, zz = launch_operands(x_scaled, y, z)
    r, c, d, d_out = x.shape[0], yy.shape[0], x.shape[1], zz.shape[1]
    out = torch.empty(r, d_out, dtype=acc_dtypes(x)[0], device=x.device)
    fx, fy, fz = factors if factors is not None else (None, None, None)
    launch(_grad_rows_kernel, output_grid(r, d_out), x, yy, zz, out, fx, fy, fz, *directions(row, col, out.dtype), r, c, d, bucket(r, c),
                                             d_out, self_offset, TRANSPOSED=transposed,
                                             FACTORS=gradient_factors(factors, x_scaled), excl=packed(exclusion(exclude)))
    return out
