"""PML NT-Xent's forward epilogue on a tile that holds every column of its rows, in one launch: each row's
log-sum-exp over its negatives, then ``(sum_p softplus(L_i - S_ip), sum_p sigmoid(L_i - S_ip))`` over its
positives -- :mod:`.epilogue_sums` (the positives left out) and :mod:`.epilogue_pair_sums` fused.

A row's negatives' log-sum-exp needs all of its columns before any of its positive terms can be formed, so
where a tile spans every column (one tile, or row strips across the columns) one program owns a block of rows
and reads its columns twice: the first sweep for ``L``, the second for the sums. The tile is read twice either
way; the fusion saves a launch, the host code around it, and (for strips) the second GEMM of each strip.
One program owns its rows' outputs: no atomics, the same result on every run.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ._configs import autotune, bucket, epilogue_rows
from ._host import DERIVED_EPILOGUE, announced, tl, triton
from ._tile import block_stats, merged, softplus
from .epilogue_pair_sums import pair_block


@autotune(epilogue_rows(), key=["bucket"])  # plain stores of every output: nothing to restore between timed runs
@triton.heuristics(DERIVED_EPILOGUE)
@triton.jit
def _epilogue_pml_sums_kernel(s_ptr, lse_ptr, out_ptr, fx_ptr, fy_ptr, tile_rows, n_rows, n_cols, r0, bucket, self_offset,
                              FIXED: tl.constexpr, EXCLUDE: tl.constexpr, GACC: tl.constexpr, ACC: tl.constexpr,
                              PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, rel):
    local_r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_in = local_r < tile_rows
    run_max = tl.full((BLOCK_M,), float("-inf"), dtype=ACC)
    run_sum = tl.zeros((BLOCK_M,), dtype=ACC)
    for j0 in range(0, n_cols, BLOCK_N):  # sweep 1: the negatives' log-sum-exp (the self pair is neither)
        local_c = j0 + tl.arange(0, BLOCK_N)
        s, _rows, _pos, neg = pair_block(s_ptr, local_r, local_c, tile_rows, n_cols, r0, 0, n_rows, n_cols, fx_ptr, fy_ptr,
                                         self_offset, rel)
        if FIXED:  # |S| is bounded: plain exp(S), as the torch backend's fixed path sums it
            run_sum += tl.sum(tl.where(neg, tl.exp(s), 0.0), axis=1)
        else:
            run_max, run_sum = merged(run_max, run_sum, *block_stats(tl.where(neg, s, float("-inf")), 1))
    some = run_sum > 0  # a row without a negative (or past the tile): L = -inf, its terms are 0
    total = tl.log(tl.where(some, run_sum, 1.0))
    if not FIXED:
        total += tl.where(some, run_max, 0.0)
    lse = tl.where(some, total, float("-inf"))
    tl.store(lse_ptr + local_r, lse, mask=r_in)
    first = tl.zeros((BLOCK_M,), dtype=ACC)
    second = tl.zeros((BLOCK_M,), dtype=ACC)
    for j0 in range(0, n_cols, BLOCK_N):  # sweep 2: the positives' terms given L
        local_c = j0 + tl.arange(0, BLOCK_N)
        s, _rows, pos, _neg = pair_block(s_ptr, local_r, local_c, tile_rows, n_cols, r0, 0, n_rows, n_cols, fx_ptr, fy_ptr,
                                         self_offset, rel)
        diff = lse[:, None] - s
        first += tl.sum(tl.where(pos, softplus(diff), 0.0), axis=1)
        second += tl.sum(tl.where(pos, tl.sigmoid(diff), 0.0), axis=1)
    # this program is its rows' only writer (each row is in one tile): plain stores
    tl.store(out_ptr + local_r, first, mask=r_in)
    tl.store(out_ptr + n_rows + local_r, second, mask=r_in)


def epilogue_pml_sums(s: Tensor, r0: int, n_rows: int, lse: Tensor, out: Tensor, factors: tuple[Tensor, Tensor] | None,
                      self_offset: int | None, relation: dict[str, Any], fixed: bool) -> None:
    """Write PML NT-Xent's statistics of the rows of the raw logit tile ``s = S[r0:r0+h, :]`` (every column).

    Args:
        s: the tile as ``torch.mm`` wrote it (fp32, contiguous; raw products when ``factors`` are given).
        r0, n_rows: the tile's first row and the problem's ``R`` (``C`` is the tile's width).
        lse: the (R,) negatives' log-sum-exps, written at ``r0:r0+h`` (``-inf`` for a row without negatives).
        out: the (2 R,) sums, written at ``r0 + i`` (softplus terms) and ``R + r0 + i`` (sigmoid terms).
        factors: ``(fx, fy)`` sliced to the tile; None: the scale is in the operands.
        self_offset: the self pair (neither positive nor negative).
        relation: the positive relation as the pair kernels read it (:func:`.pair_terms.relation_args`).
        fixed: the bounded regime (plain ``exp(S)``; else an online maximum).
    """
    h, w = s.shape
    fx, fy = factors if factors is not None else (None, None)

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(h, meta["BLOCK_M"]),)

    with announced("epilogue_pml_sums", reads=(s,), writes=()):
        _epilogue_pml_sums_kernel[grid](s, lse[r0:], out[r0:], fx, fy, h, n_rows, w, r0, bucket(h, w), self_offset,
                                        FIXED=fixed, **relation)
