"""SigLIP's epilogue, forward: one read of a cuBLAS logit tile gives its rows' sums of
``softplus(-z_ij S_ij)``.

``torch.mm`` has written a tile of raw products; one program owns a block of the tile's rows, reads
its columns block by block once (the scale and the normalisation applied as row and column factors,
the bias added, the positives' signs flipped in registers) and adds its rows' sums to the call's
(R,) sums, which only it writes in this launch -- no atomics.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ._configs import autotune, bucket, epilogue_rows
from ._host import DERIVED_EPILOGUE, announced, tl, triton
from ._tile import related, softplus, with_factors


@triton.jit
def signed_logits(s, local_r, local_c, tile_rows, tile_cols, rows, cols, n_rows, n_cols, fx_ptr, fy_ptr, bias_ptr, diagonal,
                  rk0, ck0, rk1, ck1):
    """``-z_ij S_ij`` of a block of a raw logit tile (``S = fx_i fy_j s_ij + bias``; ``z = +1`` on a
    strided diagonal or where ids are equal) and the positive mask."""
    s = with_factors(s, local_r, local_c, tile_rows, tile_cols, fx_ptr, fy_ptr) + tl.load(bias_ptr)
    pos = related(rows, cols, rows < n_rows, cols < n_cols, rk0, ck0, rk1, ck1, None)
    if diagonal is not None:
        pos = pos | (cols[None, :] == rows[:, None] + diagonal)
    return tl.where(pos, -s, s), pos


@autotune(epilogue_rows(), key=["bucket"], restore_value=["out_ptr"])
@triton.heuristics(DERIVED_EPILOGUE)
@triton.jit
def _epilogue_sigmoid_sums_kernel(s_ptr, out_ptr, bias_ptr, fx_ptr, fy_ptr, tile_rows, tile_cols, r0, c0, n_rows, n_cols, bucket,
                                  diagonal, EXCLUDE: tl.constexpr, GACC: tl.constexpr, ACC: tl.constexpr,
                                  PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, rk0=None, ck0=None,
                                  rk1=None, ck1=None):
    local_r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_in = local_r < tile_rows
    total = tl.zeros((BLOCK_M,), dtype=ACC)
    for j0 in range(0, tile_cols, BLOCK_N):
        local_c = j0 + tl.arange(0, BLOCK_N)
        inside = r_in[:, None] & (local_c[None, :] < tile_cols)
        s = tl.load(s_ptr + local_r[:, None] * tile_cols + local_c[None, :], mask=inside, other=0.0)
        signed, _pos = signed_logits(s, local_r, local_c, tile_rows, tile_cols, r0 + local_r, c0 + local_c, n_rows, n_cols,
                                     fx_ptr, fy_ptr, bias_ptr, diagonal, rk0, ck0, rk1, ck1)
        total += tl.sum(tl.where(inside, softplus(signed), 0.0), axis=1)
    old = tl.load(out_ptr + local_r, mask=r_in, other=0.0)  # this program is its rows' only writer here
    tl.store(out_ptr + local_r, old + total, mask=r_in)


def epilogue_sigmoid_sums(s: Tensor, r0: int, c0: int, n_rows: int, n_cols: int, out: Tensor, bias: Tensor,
                          factors: tuple[Tensor, Tensor] | None, diagonal: int | None, keys: dict[str, Tensor]) -> None:
    """Add the rows' ``sum_j softplus(-z_ij S_ij)`` of the raw logit tile ``s = S[r0:r0+h, c0:c0+w]``
    into ``out`` (a view of the tile's rows of the call's sums).

    Args:
        s: the tile as ``torch.mm`` wrote it (fp32).
        r0, c0, n_rows, n_cols: the tile's place and the problem's ``R`` and ``C``.
        out: (h,) running sums.
        bias: the logit bias, a (1,) tensor.
        factors: ``(fx, fy)`` of the tile's rows and columns (None: the scale is in the operands).
        diagonal: row i's positive is column ``i + diagonal``; None: by ids (``keys``) or none.
        keys: the ids as :func:`~._host.keys` gives them (empty: none).
    """
    h, w = s.shape
    fx, fy = factors if factors is not None else (None, None)

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(h, meta["BLOCK_M"]),)

    with announced("epilogue_sigmoid_sums", reads=(s,), writes=()):
        _epilogue_sigmoid_sums_kernel[grid](s, out, bias, fx, fy, h, w, r0, c0, n_rows, n_cols, bucket(h, w), diagonal, **keys)
