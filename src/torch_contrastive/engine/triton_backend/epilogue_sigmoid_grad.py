"""SigLIP's epilogue, backward: the gradient tile ``dS_ij = -z_ij sigmoid(-z_ij S_ij) g_i`` formed in
one read of a cuBLAS logit tile and written once in the GEMM operand dtype (each product's factor
folded in, the rows' rounding remainder for a learnable scale: as :mod:`.epilogue_grad`), with each
program's ``sum dS`` stored for the bias gradient -- no atomics."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._configs import autotune, bucket, epilogue_tiles
from ._host import DERIVED_EPILOGUE, announced, rounded_by_torch, tl, triton
from ._tile import store_gradient_tiles
from .epilogue_sigmoid_sums import signed_logits


@autotune(epilogue_tiles(), key=["bucket"])
@triton.heuristics(DERIVED_EPILOGUE)
@triton.jit
def _epilogue_sigmoid_grad_kernel(s_ptr, rows_ptr, low_ptr, cols_ptr, part_ptr, g_ptr, bias_ptr, fx_ptr, fy_ptr, fz_ptr, tile_rows,
                                  tile_cols, r0, c0, n_rows, n_cols, bucket, diagonal, EXCLUDE: tl.constexpr, GACC: tl.constexpr,
                                  ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  rk0=None, ck0=None, rk1=None, ck1=None):
    local_r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    local_c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_in = local_r < tile_rows
    inside = r_in[:, None] & (local_c[None, :] < tile_cols)
    s = tl.load(s_ptr + local_r[:, None] * tile_cols + local_c[None, :], mask=inside, other=0.0)
    rows = r0 + local_r
    signed, pos = signed_logits(s, local_r, local_c, tile_rows, tile_cols, rows, c0 + local_c, n_rows, n_cols, fx_ptr, fy_ptr,
                                bias_ptr, diagonal, rk0, ck0, rk1, ck1)
    g_row = tl.load(g_ptr + rows, mask=rows < n_rows, other=0.0)
    grad = tl.where(inside, tl.sigmoid(signed) * tl.where(pos, -g_row[:, None], g_row[:, None]), 0.0)
    tl.store(part_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.sum(tl.sum(grad, axis=1), axis=0))
    store_gradient_tiles(grad, local_r, local_c, tile_rows, tile_cols, tile_cols, rows_ptr, low_ptr, cols_ptr, fy_ptr, fz_ptr, ACC)


def epilogue_sigmoid_grad(s: Tensor, r0: int, c0: int, n_rows: int, n_cols: int, g_row: Tensor, bias: Tensor,
                          out: tuple[Tensor, Tensor | None, Tensor | None], factors: tuple[Tensor | None, Tensor | None, Tensor | None],
                          diagonal: int | None, keys: dict[str, Tensor]) -> Tensor:
    """Write the gradient tile of the raw logit tile ``s = S[r0:r0+h, c0:c0+w]`` and return its
    ``sum_ij dS_ij`` (0-dim; the bias gradient's part).

    Args:
        s, r0, c0, n_rows, n_cols, bias, diagonal, keys: as :func:`~.epilogue_sigmoid_sums.epilogue_sigmoid_sums`.
        g_row: (R,) the incoming gradient of every row's sum.
        out: ``(rows, low, cols)``: the row product's tile ``dS diag(fy)`` (h, w) in the operand dtype, its
            rounding remainder or None, the column product's ``diag(fz) dS`` or None (the row tile serves both).
        factors: ``(fx, fy, fz)`` of the tile (all None without).
    """
    h, w = s.shape
    rows, low, cols = out
    fx, fy, fz = factors
    programs = [0]

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        shape = (triton.cdiv(h, meta["BLOCK_M"]), triton.cdiv(w, meta["BLOCK_N"]))
        programs[0] = shape[0] * shape[1]  # the launch that runs is the last one asked (after any timing)
        return shape

    with announced("epilogue_sigmoid_grad", reads=(s,), writes=tuple(t for t in out if t is not None)):
        # one partial sum per program: room for the smallest blocks of any config (32 x 32 under the interpreter)
        part = torch.empty(triton.cdiv(h, 32) * triton.cdiv(w, 32), dtype=s.dtype, device=s.device)
        with rounded_by_torch(rows, low, cols) as (k_rows, k_low, k_cols):
            _epilogue_sigmoid_grad_kernel[grid](s, k_rows, k_low, k_cols, part, g_row, bias, fx, fy, fz, h, w, r0, c0, n_rows, n_cols,
                                                bucket(h, w), diagonal, **keys)
    return part[: programs[0]].sum()
