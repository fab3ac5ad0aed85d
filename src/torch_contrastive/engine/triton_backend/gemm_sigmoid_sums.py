"""SigLIP's forward as a matmul with the statistic in its epilogue: each row's ``sum_j softplus(-z_ij S_ij)`` with no
logit in memory.

One program owns one ``BLOCK x BLOCK`` tile: the fused matmul's K loop (:func:`~._tile.gemm_tile`: pipelined, on
tensor cores for half rows), then in registers the scale and the norms as row and column factors, the bias, the
positives' signs (a strided diagonal, equal ids, or none) and the rows' softplus sums, stored to the tile's own
slot ``[column block, row]``; :func:`gemm_sigmoid_sums` adds the slots up in order -- no atomics. The backward is
the epilogue strategy's (:mod:`...epilogue`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._configs import autotune, bucket, gemm_tiles, tile_grid
from ._host import DERIVED, acc_dtypes, launch, launch_operands, tl, triton
from ._tile import gemm_tile, softplus, tile_of
from .epilogue_sigmoid_sums import signed_logits
from .gemm_sums import gemm_block

__all__ = ["gemm_sigmoid_sums"]

#: Row blocks that sweep the column blocks together (grouped order, L2 reuse).
GROUP = 8


@autotune(gemm_tiles())
@triton.heuristics({**DERIVED, "EVEN_D": lambda args: args["d"] % args["BLOCK_D"] == 0})
@triton.jit
def _gemm_sigmoid_sums_kernel(x_ptr, y_ptr, part_ptr, bias_ptr, fx_ptr, fy_ptr, n_rows, n_cols, d, bucket, diagonal,
                              EVEN_D: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, GROUP: tl.constexpr,
                              BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, rk0=None, ck0=None, rk1=None, ck1=None):
    """One tile: its product, then its rows' softplus sums to their slot."""
    bi, bj = tile_of(n_rows, n_cols, BLOCK, GROUP)
    rows = bi * BLOCK + tl.arange(0, BLOCK)
    cols = bj * BLOCK + tl.arange(0, BLOCK)
    s = gemm_tile(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d, EVEN_D, ACC, PRECISION, BLOCK, BLOCK_D)
    signed, _pos = signed_logits(s, rows, cols, n_rows, n_cols, rows, cols, n_rows, n_cols, fx_ptr, fy_ptr, bias_ptr,
                                 diagonal, rk0, ck0, rk1, ck1)
    r_in = rows < n_rows
    valid = r_in[:, None] & (cols[None, :] < n_cols)
    tl.store(part_ptr + bj * n_rows + rows, tl.sum(tl.where(valid, softplus(signed), 0.0), axis=1), mask=r_in)


def gemm_sigmoid_sums(x_scaled: Tensor, y: Tensor, bias: Tensor, factors: tuple[Tensor, Tensor] | None,
                      diagonal: int | None, keys: dict[str, Tensor]) -> Tensor:
    """The (R,) row sums ``sum_j softplus(-z_ij S_ij)`` of ``S = X @ Y.T + bias``.

    Args:
        x_scaled: ``scale * X̂`` (R, D), or the caller's half rows when ``factors`` are given.
        y: ``Ŷ`` (C, D).
        bias: the logit bias, a (1,) tensor.
        factors: ``(fx, fy)``: ``S_ij = fx_i fy_j <x_i, y_j> + bias`` (half rows: the scale and the norms in fp32).
        diagonal: row i's positive is column ``i + diagonal``; None: by ids (``keys``) or none.
        keys: the ids as :func:`~._host.keys` gives them (empty: none).
    """
    x, yy = launch_operands(x_scaled, y)
    r, c, d = x.shape[0], yy.shape[0], x.shape[1]
    parts = torch.empty(triton.cdiv(c, gemm_block(x_scaled.dtype)), r, dtype=acc_dtypes(x)[0], device=x.device)
    fx, fy = factors if factors is not None else (None, None)
    launch(_gemm_sigmoid_sums_kernel, tile_grid(r, c), x, yy, parts, bias, fx, fy, r, c, d, bucket(r, c), diagonal,
           GROUP=GROUP, **keys)
    return parts.sum(0)
