"""Column statistics from the partials of :mod:`.epilogue_sums`: one program per block of
columns adds up the row blocks' partial sums in order (with their maxima in the online regime)
and folds them into the call's running column statistics -- one launch per tile, no atomics."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ._configs import autotune, bucket, column_blocks
from ._host import accumulates_as, announced, tl, triton
from ._tile import fold_running, merged


@autotune(column_blocks(), key=["bucket"], restore_value=["max_ptr", "sum_ptr"])
@triton.heuristics({"ACC": accumulates_as("part_sum_ptr")})
@triton.jit
def _fold_partials_kernel(part_max_ptr, part_sum_ptr, max_ptr, sum_ptr, parts, width, bucket, FIXED: tl.constexpr,
                          ACC: tl.constexpr, BLOCK_N: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_in = cols < width
    run_max = tl.full((BLOCK_N,), float("-inf"), dtype=ACC)
    run_sum = tl.zeros((BLOCK_N,), dtype=ACC)
    for p in range(0, parts):
        part = tl.load(part_sum_ptr + p * width + cols, mask=c_in, other=0.0)
        if FIXED:
            run_sum += part
        else:
            m = tl.load(part_max_ptr + p * width + cols, mask=c_in, other=float("-inf"))
            run_max, run_sum = merged(run_max, run_sum, m, part)
    fold_running(max_ptr, sum_ptr, cols, c_in, run_max, run_sum, FIXED)


def fold_partials(partials: tuple[Tensor | None, Tensor], parts: int, width: int, running: tuple[Tensor, Tensor], fixed: bool) -> None:
    """Add the first ``parts`` rows of ``partials`` (``(max, sum)``, row-major with ``width``
    columns; no maxima in the bounded regime) into ``running`` (``(max, sum)`` views of ``width``
    entries, the maximum untouched in the bounded regime), in row order."""
    part_max, part_sum = partials
    run_max, run_sum = running

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(width, meta["BLOCK_N"]),)

    with announced("fold_partials", reads=(), writes=()):
        _fold_partials_kernel[grid](part_max, part_sum, run_max, run_sum, parts, width, bucket(width), FIXED=fixed)
