"""The mask-in-tile losses' epilogue, backward: the gradient tile formed in one read of a cuBLAS
logit tile and written once in the GEMM operand dtype (each product's factor folded in, as
:mod:`.epilogue_grad`) -- NT-BXent's ``-sigmoid(-S) g0_i`` on positives and ``sigmoid(S) g1_i`` on
negatives, PML NT-Xent's ``e^{S_in - L_i} w_i g_i`` on negatives and ``-sigmoid(L_i - S_ip) g_i`` on
positives. No atomics."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ._configs import autotune, bucket, epilogue_tiles
from ._host import DERIVED_EPILOGUE, announced, rounded_by_torch, tl, triton
from ._tile import store_gradient_tiles
from .epilogue_pair_sums import pair_block
from .pair_terms import pair_gradient


@autotune(epilogue_tiles(), key=["bucket"])
@triton.heuristics(DERIVED_EPILOGUE)
@triton.jit
def _epilogue_pair_grad_kernel(s_ptr, rows_ptr, low_ptr, cols_ptr, lse_ptr, w_ptr, g0_ptr, g1_ptr, fx_ptr, fy_ptr, fz_ptr,
                               tile_rows, tile_cols, r0, c0, n_rows, n_cols, bucket, self_offset, BINARY: tl.constexpr,
                               EXCLUDE: tl.constexpr, GACC: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, rel):
    local_r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    local_c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    s, rows, pos, neg = pair_block(s_ptr, local_r, local_c, tile_rows, tile_cols, r0, c0, n_rows, n_cols, fx_ptr, fy_ptr,
                                   self_offset, rel)
    grad = pair_gradient(s, rows, pos, neg, n_rows, lse_ptr, w_ptr, g0_ptr, g1_ptr, BINARY)
    store_gradient_tiles(grad, local_r, local_c, tile_rows, tile_cols, tile_cols, rows_ptr, low_ptr, cols_ptr, fy_ptr, fz_ptr, ACC)


def epilogue_pair_grad(s: Tensor, r0: int, c0: int, n_rows: int, n_cols: int, grads: tuple[Tensor, ...], stats: tuple[Tensor | None, Tensor | None],
                       out: tuple[Tensor, Tensor | None, Tensor | None], factors: tuple[Tensor | None, Tensor | None, Tensor | None],
                       self_offset: int | None, relation: dict[str, Any], binary: bool) -> None:
    """Write the gradient tile of the raw logit tile ``s = S[r0:r0+h, c0:c0+w]``.

    Args:
        s, r0, c0, n_rows, n_cols, self_offset, relation, binary: as :func:`~.epilogue_pair_sums.epilogue_pair_sums`.
        grads: the (R,) incoming gradients: ``(g0, g1)`` for NT-BXent, ``(g,)`` for PML NT-Xent.
        stats: PML NT-Xent's ``(L, w)`` from forward; ``(None, None)`` for NT-BXent.
        out: ``(rows, low, cols)`` as :func:`~.epilogue_grad.epilogue_grad`'s (``cols`` the full tile width).
        factors: ``(fx, fy, fz)`` sliced to the tile (all None without).
    """
    h, w = s.shape
    rows, low, cols = out
    fx, fy, fz = factors
    g0, g1 = grads[0], (grads[1] if binary else None)

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(h, meta["BLOCK_M"]), triton.cdiv(w, meta["BLOCK_N"]))

    with announced("epilogue_pair_grad", reads=(s,), writes=tuple(t for t in out if t is not None)):
        with rounded_by_torch(rows, low, cols) as (k_rows, k_low, k_cols):
            _epilogue_pair_grad_kernel[grid](s, k_rows, k_low, k_cols, *stats, g0, g1, fx, fy, fz, h, w, r0, c0, n_rows, n_cols,
                                             bucket(h, w), self_offset, BINARY=binary, **relation)
