"""The soft-max terms' forward as a matmul with the statistic in its epilogue: no logit reaches memory.

One program owns one ``BLOCK x BLOCK`` tile of ``S = X @ Y.T``. It runs the tile's product as a GEMM does -- a
K loop over D in ``BLOCK_D`` slices, pipelined by ``num_stages``, on tensor cores for half rows, with no mask in
the loop when ``BLOCK_D`` divides D (rows past the end are read as row 0 and left out after the product) -- and
then, in registers, applies the factors (the scale and the norms of half rows), leaves out the self pair and
reduces the tile to its rows' and its columns' exp-sums (bounded regime: plain ``exp(S)``, one per logit for
both directions; otherwise each line's maximum and its shifted sum).

Each tile's partial statistics go to their own slot -- row partials ``[column block, row]``, column partials
``[row block, column]`` -- and :func:`gemm_sums` adds the slots up in order: no atomics, the same result on every
run. For a single set only the upper-triangle tiles run; a tile above the diagonal gives its mirror's rows
(its own columns) their slot ``[row block, column]`` of the row partials, so every slot is written once.
The slots hold ``cdiv(N, BLOCK)`` partials per line: 512 MiB of fp32 at 65,536 rows with 128-wide tiles,
both directions, bounded regime (twice that with the maximum).

The backward is the epilogue strategy's (:mod:`..epilogue`: each gradient tile written once in the operand
dtype, multiplied by cuBLAS), so a call does the four products of the dense formula and no more.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._configs import INTERPRETER_BLOCK, autotune, bucket, gemm_tiles, tile_grid
from ._host import DERIVED, acc_dtypes, interpreting, launch, launch_operands, tl, triton
from ._tile import block_stats, gemm_tile, tile_of, with_factors

__all__ = ["counted_flops", "gemm_block", "gemm_sums"]

#: Row blocks that sweep the column blocks together (grouped order, L2 reuse).
GROUP = 8


@triton.jit
def _store_stats(s, valid, at, inside, slot_stride, AXIS: tl.constexpr, FIXED: tl.constexpr):
    """One direction's partials of the tile at ``at``: the exp-sums (bounded regime), or the maxima then, one slot
    array further, the shifted sums."""
    if FIXED:
        tl.store(at, tl.sum(tl.where(valid, tl.exp(s), 0.0), axis=AXIS), mask=inside)
    else:
        m, total = block_stats(tl.where(valid, s, float("-inf")), AXIS)
        tl.store(at, m, mask=inside)
        tl.store(at + slot_stride, total, mask=inside)


@autotune(gemm_tiles())
@triton.heuristics({**DERIVED, "EVEN_D": lambda args: args["d"] % args["BLOCK_D"] == 0})
@triton.jit
def _gemm_sums_kernel(x_ptr, y_ptr, row_part_ptr, col_part_ptr, fx_ptr, fy_ptr, n_rows, n_cols, d, bucket, self_offset,
                      COLUMNS: tl.constexpr, SYMMETRIC: tl.constexpr, FIXED: tl.constexpr, EVEN_D: tl.constexpr,
                      ACC: tl.constexpr, PRECISION: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    """One tile: its product, then its rows' (and columns') partial statistics to their slots."""
    bi, bj = tile_of(n_rows, n_cols, BLOCK, GROUP)
    if not SYMMETRIC or bj >= bi:
        rows = bi * BLOCK + tl.arange(0, BLOCK)
        cols = bj * BLOCK + tl.arange(0, BLOCK)
        s = gemm_tile(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d, EVEN_D, ACC, PRECISION, BLOCK, BLOCK_D)
        s = with_factors(s, rows, cols, n_rows, n_cols, fx_ptr, fy_ptr)
        r_in, c_in = rows < n_rows, cols < n_cols
        valid = r_in[:, None] & c_in[None, :]
        if self_offset is not None:
            valid = valid & (cols[None, :] != rows[:, None] + self_offset)
        row_slots = tl.cdiv(n_cols, BLOCK) * n_rows  # the row partials' slot array (maxima, then sums)
        _store_stats(s, valid, row_part_ptr + bj * n_rows + rows, r_in, row_slots, 1, FIXED)
        if COLUMNS:
            _store_stats(s, valid, col_part_ptr + bi * n_cols + cols, c_in, tl.cdiv(n_rows, BLOCK) * n_cols, 0, FIXED)
        if SYMMETRIC and bj > bi:  # the mirror tile's rows are this tile's columns
            _store_stats(s, valid, row_part_ptr + bi * n_rows + cols, c_in, row_slots, 0, FIXED)


def gemm_block(dtype: torch.dtype) -> int:
    """The tile side the kernel runs for operands of ``dtype``: one per dtype, so the slots are sized before the
    autotuner picks a config (the configs of a dtype differ in warps, stages and ``BLOCK_D`` only)."""
    if interpreting():
        return INTERPRETER_BLOCK
    (side,) = {c.kwargs["BLOCK"] for c in gemm_tiles() if dtype in c.dtypes}
    return int(side)


def _fold(parts: Tensor, fixed: bool) -> tuple[Tensor | None, Tensor]:
    """``(maximum or None, sum)`` per line from its slots, added up in slot order."""
    if fixed:
        return None, parts[0].sum(0)
    top = parts[0].amax(0)
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # a line with nothing counted: -inf, 0
    return top, (parts[1] * torch.exp(parts[0] - safe)).sum(0)


def gemm_sums(x_scaled: Tensor, y: Tensor, self_offset: int | None, columns: bool, symmetric: bool, fixed: bool,
              factors: tuple[Tensor, Tensor] | None = None) -> tuple[tuple[Tensor | None, Tensor], tuple[Tensor | None, Tensor] | None]:
    """``((row maximum or None, row exp-sum), (column maximum, column exp-sum) or None)`` of ``S = X @ Y.T``
    over the pairs that count (not the self pair ``j = i + self_offset``). Bounded regime (``fixed``): plain
    ``sum exp(S)`` and no maximum; otherwise each line's maximum and ``sum exp(S - maximum)``.

    Args:
        x_scaled: ``scale * X̂`` (R, D), or the caller's half rows when ``factors`` are given.
        y: ``Ŷ`` (C, D): ``x_scaled``'s own set when ``symmetric``.
        self_offset: the self pair's column offset, or None.
        columns: the columns' statistics too.
        symmetric: a single set: the upper-triangle tiles only, each feeding its mirror's rows.
        factors: ``(fx, fy)``: ``S_ij = fx_i fy_j <x_i, y_j>`` (half rows: the scale and the norms in fp32).
    """
    if symmetric and (columns or self_offset not in (None, 0)):
        raise ValueError("a single set's triangle has no separate columns and its self pair on the diagonal")
    x, yy = launch_operands(x_scaled, y)
    r, c, d = x.shape[0], yy.shape[0], x.shape[1]
    dtype = acc_dtypes(x)[0]
    block, depth = gemm_block(x_scaled.dtype), 1 if fixed else 2
    row_parts = torch.empty(depth, triton.cdiv(c, block), r, dtype=dtype, device=x.device)
    col_parts = torch.empty(depth, triton.cdiv(r, block), c, dtype=dtype, device=x.device) if columns else None
    fx, fy = factors if factors is not None else (None, None)
    launch(_gemm_sums_kernel, tile_grid(r, c), x, yy, row_parts, col_parts, fx, fy, r, c, d, bucket(r, c), self_offset,
           COLUMNS=columns, SYMMETRIC=symmetric, FIXED=fixed, GROUP=GROUP)
    return _fold(row_parts, fixed), (None if col_parts is None else _fold(col_parts, fixed))


def counted_flops(rows: int, cols: int, d: int, block: int, symmetric: bool) -> tuple[int, int]:
    """``(FLOPs the grid multiplies, the product's own)`` for a forward at tile side ``block``: each program's
    K loop runs over D in full, its tile padded to ``block`` rows and columns; a single set runs the tiles on and
    above the diagonal, its floor the upper triangle with the diagonal (``N (N + 1) / 2`` logits)."""
    n_i, n_j = triton.cdiv(rows, block), triton.cdiv(cols, block)
    tiles = n_i * (n_i + 1) // 2 if symmetric else n_i * n_j
    floor = rows * (rows + 1) // 2 if symmetric else rows * cols
    return 2 * tiles * block * block * d, 2 * floor * d

