"""The epilogue of a cuBLAS logit tile, backward: the gradient tile formed in one read of the
logits and written once in the operand dtype, for ``torch.mm`` to multiply.

One program per (row block, column block) of the tile reads its logits (raw products of half
rows get their factors here), forms ``G_ij = u_i exp(S_ij - L_i) (+ v_j exp(S_ij - M_j))`` over
the candidates that count and stores it rounded to the GEMM operand dtype: once for both
products when they take the same tile, else with each product's other-side factor folded in
(``G diag(fy)`` for the rows, ``diag(fz) G`` for the columns -- the tensor-core scheme of
:mod:`...products`), and with a learnable scale also the rows' rounding remainder (the row
product then carries ``G`` to ~2^-17, as the torch backend's split product). No atomics.

Under the interpreter (the CPU tests), whose conversion to half does not round to nearest even
as a GPU does, the kernel stores fp32 and torch rounds after it (the remainder taken from the
rounded tile): the same numbers as the GPU's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...positives import PartnerPositives
from ._configs import autotune, bucket, epilogue_tiles
from ._host import DERIVED_EPILOGUE, announced, keys, packed, per_index, rounded_by_torch, tl, triton
from ._tile import gradient_tile, related, store_gradient_tiles, valid_mask, with_factors


@autotune(epilogue_tiles(), key=["bucket"])
@triton.heuristics(DERIVED_EPILOGUE)
@triton.jit
def _epilogue_grad_kernel(s_ptr, rows_ptr, low_ptr, cols_ptr, fx_ptr, fy_ptr, fz_ptr, lse_r_ptr, u_ptr, lse_c_ptr, v_ptr,
                          tile_rows, tile_cols, col_width, r0, c0, n_rows, n_cols, bucket, self_offset, EXCLUDE: tl.constexpr,
                          GACC: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, excl, pos):
    local_r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    local_c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_in = local_r < tile_rows
    c_in = local_c < tile_cols
    inside = r_in[:, None] & c_in[None, :]
    s = tl.load(s_ptr + local_r[:, None] * tile_cols + local_c[None, :], mask=inside, other=0.0)
    s = with_factors(s, local_r, local_c, tile_rows, tile_cols, fx_ptr, fy_ptr)
    rows = r0 + local_r
    cols = c0 + local_c
    g = gradient_tile(s, rows, cols, n_rows, n_cols, lse_r_ptr, u_ptr, lse_c_ptr, v_ptr)
    valid = inside & valid_mask(rows, cols, n_rows, n_cols, self_offset, excl, EXCLUDE, False, GACC, BLOCK_M, BLOCK_N, PRECISION)
    g = tl.where(valid, g, 0.0)
    if pos[6] is not None:  # the positive part's coefficients (c_row_ptr), added before the tile is rounded
        g = g + positive_part(rows, cols, n_rows, n_cols, inside, pos[0], pos[1], pos[2], pos[3], pos[4], pos[5], pos[6],
                              pos[7])
    store_gradient_tiles(g, local_r, local_c, tile_rows, tile_cols, col_width, rows_ptr, low_ptr, cols_ptr, fy_ptr, fz_ptr, ACC)


@triton.jit
def positive_part(rows, cols, n_rows, n_cols, inside, rk0, ck0, rk1, ck1, partner, self_offset, c_row_ptr, c_col_ptr):
    """``P_ij (c_i + c'_j)``: the relation P (equal keys or a partner, never the self pair) formed in
    registers, with the row coefficients and -- when given -- the column ones."""
    r_ok = rows < n_rows
    c_ok = cols < n_cols
    pos = inside & related(rows, cols, r_ok, c_ok, rk0, ck0, rk1, ck1, partner)
    if self_offset is not None:
        pos = pos & (cols[None, :] != rows[:, None] + self_offset)
    coef = tl.load(c_row_ptr + rows, mask=r_ok, other=0.0)[:, None]
    if c_col_ptr is not None:
        coef = coef + tl.load(c_col_ptr + cols, mask=c_ok, other=0.0)[None, :]
    return tl.where(pos, coef, 0.0)


#: The order of the positive part's pieces in the kernel's one ``pos`` argument (:func:`positive_terms`).
POSITIVE_FIELDS = ("rk0", "ck0", "rk1", "ck1", "partner", "offset", "c_row", "c_col")


def positive_terms(positives: Any, c_row: Tensor | None, c_col: Tensor | None, n_rows: int, n_cols: int,
                   dtype: torch.dtype) -> tuple[Any, ...]:
    """The kernel's view of the positive part folded into the gradient tile (:data:`POSITIVE_FIELDS`, all None
    without ``c_row``): the relation's keys or partner, its self offset, and the (R,) / (C,) coefficients."""
    if c_row is None:
        return NO_POSITIVE
    out: dict[str, Any] = {"offset": positives.self_offset, "c_row": per_index(c_row, n_rows, dtype)}
    if c_col is not None:
        out["c_col"] = per_index(c_col, n_cols, dtype)
    if isinstance(positives, PartnerPositives):
        out["partner"] = positives.partner.contiguous()
    else:
        out.update(keys(positives.row_keys, positives.col_keys))
    return tuple(out.get(name) for name in POSITIVE_FIELDS)


#: No positive part in the tile.
NO_POSITIVE: tuple[None, ...] = (None,) * len(POSITIVE_FIELDS)


def epilogue_grad(s: Tensor, r0: int, c0: int, n_rows: int, n_cols: int, row: list[Tensor | None],
                  out: tuple[Tensor, Tensor | None, Tensor | None], factors: tuple[Tensor | None, Tensor | None, Tensor | None],
                  self_offset: int | None, excluded: dict[str, Any], positive: tuple[Any, ...] | None = None) -> None:
    """Write the gradient tile of the logit tile ``s = S[r0:r0+h, c0:c0+w]``.

    Args:
        s: the tile as ``torch.mm`` wrote it (fp32; raw products when factors are given).
        r0, c0: the tile's place in the problem; ``n_rows``, ``n_cols`` its ``R`` and ``C``.
        row: ``[L, u, M, v]``, the problem's (R,) / (C,) log-sum-exps and coefficients (``M, v``
            None without column terms) -- :func:`~._host.directions`.
        out: ``(rows, low, cols)``: the row product's tile (h, w) in the operand dtype; its rounding
            remainder (h, w) or None; the column product's tile (h, k) -- its first ``k`` columns --
            or None when the row product's tile serves both (or no column product is wanted).
        factors: ``(fx, fy, fz)`` of the tile's rows / columns / rows: ``S_ij = fx_i fy_j s_ij``, the
            row tile is ``G diag(fy)``, the column tile ``diag(fz) G``; all None without.
        self_offset, excluded: the self pair, and what else the tile leaves out (the exclusion rule's
            keyword arguments, :func:`~._host.exclusion`).
        positive: the positive part folded into the tile (:func:`positive_terms`); None: none.
    """
    h, w = s.shape
    rows, low, cols = out
    fx, fy, fz = factors
    k = 0 if cols is None else cols.shape[1]

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(h, meta["BLOCK_M"]), triton.cdiv(w, meta["BLOCK_N"]))

    with announced("epilogue_grad", reads=(s,), writes=tuple(t for t in out if t is not None)):
        with rounded_by_torch(rows, low, cols) as (k_rows, k_low, k_cols):
            _epilogue_grad_kernel[grid](s, k_rows, k_low, k_cols, fx, fy, fz, *row, h, w, k, r0, c0, n_rows, n_cols, bucket(h, w),
                                        self_offset, excl=packed(excluded), pos=positive or NO_POSITIVE)
