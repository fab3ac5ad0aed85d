"""The mask-in-tile losses' epilogue, forward: one read of a cuBLAS logit tile gives its rows' two
sums -- NT-BXent's ``(sum_pos softplus(-S), sum_neg softplus(S))``, or PML NT-Xent's
``(sum_p softplus(L_i - S_ip), sum_p sigmoid(L_i - S_ip))`` given the negatives' log-sum-exps ``L``
(:mod:`.epilogue_sums` with the positives left out). The relation is formed in registers
(:func:`.pair_terms.relation_masks`); one program owns a block of the tile's rows: no atomics.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ._configs import autotune, bucket, epilogue_pair_rows
from ._host import DERIVED_EPILOGUE, announced, tl, triton
from ._tile import softplus, with_factors
from .pair_terms import relation_masks


@triton.jit
def pair_block(s_ptr, local_r, local_c, tile_rows, tile_cols, r0, c0, n_rows, n_cols, fx_ptr, fy_ptr, self_offset, rel):
    """A block of a raw logit tile with its factors applied, its problem rows, and its positive and
    negative masks (out-of-tile entries are neither)."""
    inside = (local_r[:, None] < tile_rows) & (local_c[None, :] < tile_cols)
    s = tl.load(s_ptr + local_r[:, None] * tile_cols + local_c[None, :], mask=inside, other=0.0)
    s = with_factors(s, local_r, local_c, tile_rows, tile_cols, fx_ptr, fy_ptr)
    rows = r0 + local_r
    pos, neg = relation_masks(rows, c0 + local_c, n_rows, n_cols, rel, self_offset)
    return s, rows, pos & inside, neg & inside


@autotune(epilogue_pair_rows(), key=["bucket"], restore_value=["out_ptr"])
@triton.heuristics(DERIVED_EPILOGUE)
@triton.jit
def _epilogue_pair_sums_kernel(s_ptr, out_ptr, lse_ptr, fx_ptr, fy_ptr, tile_rows, tile_cols, r0, c0, n_rows, n_cols, bucket,
                               self_offset, BINARY: tl.constexpr, EXCLUDE: tl.constexpr, GACC: tl.constexpr, ACC: tl.constexpr,
                               PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, rel):
    local_r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_in = local_r < tile_rows
    first = tl.zeros((BLOCK_M,), dtype=ACC)
    second = tl.zeros((BLOCK_M,), dtype=ACC)
    for j0 in range(0, tile_cols, BLOCK_N):
        local_c = j0 + tl.arange(0, BLOCK_N)
        s, rows, pos, neg = pair_block(s_ptr, local_r, local_c, tile_rows, tile_cols, r0, c0, n_rows, n_cols, fx_ptr, fy_ptr,
                                       self_offset, rel)
        if BINARY:
            first += tl.sum(tl.where(pos, softplus(-s), 0.0), axis=1)
            second += tl.sum(tl.where(neg, softplus(s), 0.0), axis=1)
        else:  # L_i = -inf (no negative): softplus and sigmoid of -inf are 0, the row adds nothing
            lse = tl.load(lse_ptr + rows, mask=rows < n_rows, other=0.0)
            diff = lse[:, None] - s
            first += tl.sum(tl.where(pos, softplus(diff), 0.0), axis=1)
            second += tl.sum(tl.where(pos, tl.sigmoid(diff), 0.0), axis=1)
    # this program is its rows' only writer in this launch
    tl.store(out_ptr + local_r, tl.load(out_ptr + local_r, mask=r_in, other=0.0) + first, mask=r_in)
    at = n_rows + local_r
    tl.store(out_ptr + at, tl.load(out_ptr + at, mask=r_in, other=0.0) + second, mask=r_in)


def epilogue_pair_sums(s: Tensor, r0: int, c0: int, n_rows: int, n_cols: int, out: Tensor, lse: Tensor | None,
                       factors: tuple[Tensor, Tensor] | None, self_offset: int | None, relation: dict[str, Any],
                       binary: bool) -> None:
    """Add the two per-row sums of the raw logit tile ``s = S[r0:r0+h, c0:c0+w]`` into ``out`` ((2 R,):
    the first sum of every row, then the second).

    Args:
        s, r0, c0, n_rows, n_cols: the tile and its place in the ``R x C`` problem.
        lse: PML NT-Xent's (R,) negatives' log-sum-exps; None for NT-BXent (``binary``).
        factors: ``(fx, fy)`` sliced to the tile; None: the scale is in the operands.
        self_offset: the self pair (neither positive nor negative).
        relation: the positive relation as the pair kernels read it (:func:`.pair_terms.relation_args`).
        binary: NT-BXent's sums (else PML NT-Xent's).
    """
    h, w = s.shape
    fx, fy = factors if factors is not None else (None, None)
    out_rows = out[r0:]  # the kernel adds its rows at r0 + i and n_rows + r0 + i

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(h, meta["BLOCK_M"]),)

    with announced("epilogue_pair_sums", reads=(s,), writes=()):
        _epilogue_pair_sums_kernel[grid](s, out_rows, lse, fx, fy, h, w, r0, c0, n_rows, n_cols, bucket(h, w), self_offset,
                                         BINARY=binary, **relation)
