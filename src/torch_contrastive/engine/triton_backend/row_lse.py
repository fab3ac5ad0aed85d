"""Row-owned log-sum-exp (online maximum): one program per block of rows sweeps the columns.

Serves the online-maximum regime and deterministic mode (no atomics); a column statistic is
the same kernel on ``S.T`` (``transposed``: the exclusion rule is read with rows and columns
swapped).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._configs import autotune, bucket, row_blocks, row_grid
from ._host import DERIVED_EXCLUSION, acc_dtypes, exclusion, launch, launch_operands, packed, tl, triton
from ._tile import block_stats, logits, merged, valid_mask, with_factors


@autotune(row_blocks())
@triton.heuristics(DERIVED_EXCLUSION)
@triton.jit
def _row_lse_kernel(x_ptr, y_ptr, out_ptr, fx_ptr, fy_ptr, n_rows, n_cols, d, bucket, self_offset, TRANSPOSED: tl.constexpr,
                    EXCLUDE: tl.constexpr, GACC: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, excl):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    run_max = tl.full((BLOCK_M,), float("-inf"), dtype=ACC)
    run_sum = tl.zeros((BLOCK_M,), dtype=ACC)
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        s = logits(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d, BLOCK_M, BLOCK_N, BLOCK_D, ACC, PRECISION)
        s = with_factors(s, rows, cols, n_rows, n_cols, fx_ptr, fy_ptr)
        valid = valid_mask(rows, cols, n_rows, n_cols, self_offset, excl, EXCLUDE, TRANSPOSED, GACC, BLOCK_M, BLOCK_N, PRECISION)
        run_max, run_sum = merged(run_max, run_sum, *block_stats(tl.where(valid, s, float("-inf")), 1))
    lse = tl.where(run_sum > 0, tl.log(run_sum) + run_max, float("-inf"))
    tl.store(out_ptr + rows, lse, mask=rows < n_rows)


def row_lse(x_scaled: Tensor, y: Tensor, self_offset: int | None, exclude: Any = None, transposed: bool = False,
            factors: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """(R,) ``log sum_j exp(S_ij)`` over the candidates that count (fp32; fp64 for fp64) of
    ``S = x_scaled @ y.T``; ``-inf`` for a row without any. Row-owned, online maximum.

    ``transposed``: ``x_scaled`` / ``y`` are the problem's candidates / anchors (a column
    log-sum-exp), so the exclusion rule is read with rows and columns swapped. ``factors``:
    ``(fx, fy)`` fp32 row and column factors, ``S_ij = fx_i fy_j <x_i, y_j>`` (raw half rows).
    """
    x, yy = launch_operands(x_scaled, y)
    r, c, d = x.shape[0], yy.shape[0], x.shape[1]
    out = torch.empty(r, dtype=acc_dtypes(x)[0], device=x.device)
    fx, fy = factors if factors is not None else (None, None)
    launch(_row_lse_kernel, row_grid(r), x, yy, out, fx, fy, r, c, d, bucket(r, c), self_offset, TRANSPOSED=transposed,
                                 excl=packed(exclusion(exclude)))
    return out
