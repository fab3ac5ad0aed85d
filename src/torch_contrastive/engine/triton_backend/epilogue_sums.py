"""The epilogue of a cuBLAS logit tile, forward: one read of the tile gives its rows' and its
columns' exp-sums.

``torch.mm`` has written a tile ``S[r0:r1, c0:c1]`` (fp32; the raw products of half rows, whose
factors are applied here in registers). One program owns a block of the tile's rows and reads
its columns block by block, once: the rows' sums (bounded regime: plain ``exp(S)``; otherwise
with an online maximum) are folded into the call's running row statistics -- which only this
program writes in this launch, so no atomics -- and each column block's partial sums over the
program's rows are stored per row block, for :mod:`.fold_partials` to add up in order. Nothing
is accumulated with atomics, so the result is the same on every run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._configs import autotune, bucket, epilogue_rows
from ._host import DERIVED_EPILOGUE, announced, packed, tl, triton
from ._tile import block_stats, fold_running, merged, valid_mask, with_factors


@autotune(epilogue_rows(), key=["bucket"], restore_value=["row_max_ptr", "row_sum_ptr"])
@triton.heuristics(DERIVED_EPILOGUE)
@triton.jit
def _epilogue_sums_kernel(s_ptr, row_max_ptr, row_sum_ptr, part_max_ptr, part_sum_ptr, fx_ptr, fy_ptr, tile_rows, tile_cols,
                          r0, c0, n_rows, n_cols, bucket, self_offset, FIXED: tl.constexpr, COLUMNS: tl.constexpr,
                          EXCLUDE: tl.constexpr, GACC: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, excl):
    pid = tl.program_id(0)
    local_r = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    r_in = local_r < tile_rows
    rows = r0 + local_r  # the problem's own indices: the exclusion rule and the self pair read them
    run_max = tl.full((BLOCK_M,), float("-inf"), dtype=ACC)
    run_sum = tl.zeros((BLOCK_M,), dtype=ACC)
    for j0 in range(0, tile_cols, BLOCK_N):
        local_c = j0 + tl.arange(0, BLOCK_N)
        c_in = local_c < tile_cols
        inside = r_in[:, None] & c_in[None, :]
        s = tl.load(s_ptr + local_r[:, None] * tile_cols + local_c[None, :], mask=inside, other=0.0)
        s = with_factors(s, local_r, local_c, tile_rows, tile_cols, fx_ptr, fy_ptr)
        valid = inside & valid_mask(rows, c0 + local_c, n_rows, n_cols, self_offset, excl, EXCLUDE, False, GACC, BLOCK_M, BLOCK_N,
                                    PRECISION)
        if FIXED:  # |S| is bounded: plain exp(S), one exp per entry for both directions
            e = tl.where(valid, tl.exp(s), 0.0)
            run_sum += tl.sum(e, axis=1)
            if COLUMNS:
                tl.store(part_sum_ptr + pid * tile_cols + local_c, tl.sum(e, axis=0), mask=c_in)
        else:
            s = tl.where(valid, s, float("-inf"))
            run_max, run_sum = merged(run_max, run_sum, *block_stats(s, 1))
            if COLUMNS:
                col_max, col_sum = block_stats(s, 0)
                tl.store(part_max_ptr + pid * tile_cols + local_c, col_max, mask=c_in)
                tl.store(part_sum_ptr + pid * tile_cols + local_c, col_sum, mask=c_in)
    # this program is the only writer of its rows in this launch: a plain read-modify-write
    fold_running(row_max_ptr, row_sum_ptr, local_r, r_in, run_max, run_sum, FIXED)


def partial_rows(tile_rows: int) -> int:
    """Row blocks of a tile whose column partials :func:`epilogue_sums` may store (the scratch's first side):
    the smallest row block of any config, so every config fits."""
    return triton.cdiv(tile_rows, 32)


def epilogue_sums(s: Tensor, r0: int, c0: int, n_rows: int, n_cols: int, running: tuple[Tensor, Tensor],
                  partials: tuple[Tensor | None, Tensor] | None, factors: tuple[Tensor, Tensor] | None,
                  self_offset: int | None, excluded: dict[str, Any], fixed: bool) -> int:
    """Fold the logit tile ``s = S[r0:r0+h, c0:c0+w]`` (fp32, contiguous) into its rows' running
    statistics and store its columns' partial statistics per row block.

    Args:
        s: the tile as ``torch.mm`` wrote it (raw products when ``factors`` are given).
        r0, c0: the tile's first row and column in the problem.
        n_rows, n_cols: the problem's ``R`` and ``C`` (the exclusion rule's bounds).
        running: ``(max, sum)`` of the tile's rows (views of the call's (R,) statistics; the maximum
            starts at the lowest finite float, and is neither read nor written in the bounded regime).
        partials: ``(max, sum)`` scratch of at least ``(partial_rows(h), w)`` entries for the columns'
            partial statistics (``max`` None in the bounded regime); None: no column statistics.
        factors: ``(fx, fy)`` of the tile's rows and columns, ``S_ij = fx_i fy_j s_ij``; None: none.
        self_offset, excluded: the self pair, and what else the sums leave out as the kernels take it
            (:func:`~._host.exclusion`'s keyword arguments).
        fixed: the bounded regime (plain ``exp(S)``).

    Returns:
        how many row blocks stored column partials (the scratch rows :func:`~.fold_partials.fold_partials` reads).
    """
    h, w = s.shape
    run_max, run_sum = running
    part_max, part_sum = partials if partials is not None else (None, None)
    fx, fy = factors if factors is not None else (None, None)
    used = [0]

    def grid(meta: dict[str, Any]) -> tuple[int]:
        used[0] = triton.cdiv(h, meta["BLOCK_M"])
        return (used[0],)

    with announced("epilogue_sums", reads=(s,), writes=()):
        _epilogue_sums_kernel[grid](s, run_max, run_sum, part_max, part_sum, fx, fy, h, w, r0, c0, n_rows, n_cols,
                                    bucket(h, w), self_offset, FIXED=fixed, COLUMNS=partials is not None,
                                    excl=packed(excluded))
    return used[0]


def lowest(like: Tensor) -> float:
    """The running maximum's start: the lowest finite float of the statistics' dtype."""
    return float(torch.finfo(like.dtype).min)
