"""SigLIP's pairwise sigmoid terms (Zhai et al. 2023) as fused tile kernels.

``S = x_scaled @ y.T + bias``, labels ``z_ij = +1`` on positives and -1 elsewhere. Forward: one
program per tile adds ``sum_j softplus(-z_ij S_ij)`` of its rows with atomics. Backward: one
program per tile forms ``dS_ij = -z_ij sigmoid(-z_ij S_ij) g_i`` once in registers and adds
``dS @ y`` into its rows, ``dS.T @ z`` into its columns and ``sum dS`` into the bias gradient.
Deterministic mode (``torch.use_deterministic_algorithms(True)``): blocks of rows (columns) own
their outputs and sweep the other side in order -- no atomics, bitwise reproducible.
Positives: a strided diagonal (text ``i + offset`` of image ``i``), equal ids (one or two key
tensors), or none (open_clip's negative-only term).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._configs import autotune, bucket, owned_grid, owned_outputs, square_grads, square_sums, tile_grid
from ._host import DERIVED, acc_dtypes, fused, gradient_factors, keys, launch, launch_operands, tl, triton
from ._tile import logits, owned_product, related, scatter_products, softplus, tile_of, with_factors
from .tile_sums import GROUP


@triton.jit
def _signed_tile(bi, bj, x_ptr, y_ptr, bias_ptr, fx_ptr, fy_ptr, rk0, ck0, rk1, ck1, n_rows, n_cols, d, diagonal,
                 ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """``-z * S`` of the tile, the positive mask and the in-bounds mask."""
    rows = bi * BLOCK + tl.arange(0, BLOCK)
    cols = bj * BLOCK + tl.arange(0, BLOCK)
    s = logits(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d, BLOCK, BLOCK, BLOCK_D, ACC, PRECISION)
    s = with_factors(s, rows, cols, n_rows, n_cols, fx_ptr, fy_ptr) + tl.load(bias_ptr)
    r_ok = rows < n_rows
    c_ok = cols < n_cols
    pos = related(rows, cols, r_ok, c_ok, rk0, ck0, rk1, ck1, None)
    if diagonal is not None:
        pos = pos | (cols[None, :] == rows[:, None] + diagonal)
    return tl.where(pos, -s, s), pos, r_ok[:, None] & c_ok[None, :], rows, cols


@triton.heuristics(DERIVED)
@triton.jit
def _sigmoid_sums(x_ptr, y_ptr, out_ptr, bias_ptr, fx_ptr, fy_ptr, n_rows, n_cols, d, bucket, diagonal, OWNED: tl.constexpr,
                  ACC: tl.constexpr, PRECISION: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_D: tl.constexpr, rk0=None, ck0=None, rk1=None, ck1=None):
    """Fused: one tile per program, row sums added with atomics. ``OWNED``: one row block per
    program sweeps the column blocks in order and stores its sums (deterministic)."""
    if OWNED:
        bi = tl.program_id(0)
        total = tl.zeros((BLOCK,), dtype=ACC)
        for bj in range(0, tl.cdiv(n_cols, BLOCK)):
            signed, _pos, inside, _rows, _cols = _signed_tile(bi, bj, x_ptr, y_ptr, bias_ptr, fx_ptr, fy_ptr, rk0, ck0, rk1, ck1,
                                                              n_rows, n_cols, d, diagonal, ACC, PRECISION, BLOCK, BLOCK_D)
            total += tl.sum(tl.where(inside, softplus(signed), 0.0), axis=1)
        rows = bi * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + rows, total, mask=rows < n_rows)
    else:
        bi, bj = tile_of(n_rows, n_cols, BLOCK, GROUP)
        signed, _pos, inside, rows, _cols = _signed_tile(bi, bj, x_ptr, y_ptr, bias_ptr, fx_ptr, fy_ptr, rk0, ck0, rk1, ck1,
                                                         n_rows, n_cols, d, diagonal, ACC, PRECISION, BLOCK, BLOCK_D)
        terms = tl.where(inside, softplus(signed), 0.0)
        tl.atomic_add(out_ptr + rows, tl.sum(terms, axis=1), mask=rows < n_rows, sem="relaxed")


# One jitted body, two autotuners: each scheme times and caches its own best config.
_sigmoid_sums_kernel = autotune(square_sums(), reset_to_zero=["out_ptr"])(_sigmoid_sums)
_sigmoid_sums_owned_kernel = autotune(square_sums())(_sigmoid_sums)


@triton.jit
def _grad_tile(bi, bj, x_ptr, y_ptr, g_ptr, bias_ptr, fx_ptr, fy_ptr, rk0, ck0, rk1, ck1, n_rows, n_cols, d, diagonal,
               ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tile ``(bi, bj)``'s ``dS = -z sigmoid(-z S) g_i`` (0 out of bounds), with its rows and columns."""
    signed, pos, inside, rows, cols = _signed_tile(bi, bj, x_ptr, y_ptr, bias_ptr, fx_ptr, fy_ptr, rk0, ck0, rk1, ck1, n_rows,
                                                   n_cols, d, diagonal, ACC, PRECISION, BLOCK, BLOCK_D)
    g_row = tl.load(g_ptr + rows, mask=rows < n_rows, other=0.0)
    grad = tl.sigmoid(signed) * tl.where(pos, -g_row[:, None], g_row[:, None])
    return rows, cols, tl.where(inside, grad, 0.0)


@autotune(square_grads(), reset_to_zero=["ga_ptr", "gb_ptr", "gbias_ptr"])
@triton.heuristics(DERIVED)
@triton.jit
def _sigmoid_grad_kernel(x_ptr, y_ptr, z_ptr, ga_ptr, gb_ptr, gbias_ptr, g_ptr, bias_ptr, fx_ptr, fy_ptr, fz_ptr, n_rows, n_cols,
                         d, bucket, diagonal, FACTORS: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
                         GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, rk0=None, ck0=None, rk1=None,
                         ck1=None):
    """Fused: each tile's ``dS`` formed once; both products and the bias sum added with atomics."""
    bi, bj = tile_of(n_rows, n_cols, BLOCK, GROUP)
    rows, cols, grad = _grad_tile(bi, bj, x_ptr, y_ptr, g_ptr, bias_ptr, fx_ptr, fy_ptr, rk0, ck0, rk1, ck1, n_rows, n_cols, d,
                                  diagonal, ACC, PRECISION, BLOCK, BLOCK_D)
    tl.atomic_add(gbias_ptr, tl.sum(tl.sum(grad, axis=1), axis=0), sem="relaxed")
    scatter_products(grad, rows, cols, d, y_ptr, z_ptr, ga_ptr, gb_ptr, rows < n_rows, cols < n_cols, cols < n_cols, n_rows,
                     n_cols, fy_ptr, fz_ptr, FACTORS, True, ACC, PRECISION, BLOCK_D)


@triton.heuristics(DERIVED)
@triton.jit
def _sigmoid_grad_owned(x_ptr, y_ptr, z_ptr, out_ptr, gbias_ptr, g_ptr, bias_ptr, fx_ptr, fy_ptr, fz_ptr, n_rows, n_cols, d,
                        bucket, diagonal, COLUMNS: tl.constexpr, FACTORS: tl.constexpr, ACC: tl.constexpr,
                        PRECISION: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_O: tl.constexpr, rk0=None,
                        ck0=None, rk1=None, ck1=None):
    """Deterministic: the program owns a block of output rows and features and sweeps the other
    side's blocks in order (``dS diag(fy) @ y``, or with ``COLUMNS`` ``(diag(fz) dS).T @ z``); a
    row block's first feature block also stores its rows' ``sum_j dS_ij`` (the bias gradient's parts)."""
    own = tl.program_id(0)
    ds = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    acc = tl.zeros((BLOCK, BLOCK_O), dtype=ACC)
    row_sum = tl.zeros((BLOCK,), dtype=ACC)
    n_other = tl.cdiv(n_rows, BLOCK) if COLUMNS else tl.cdiv(n_cols, BLOCK)
    for other in range(0, n_other):
        bi = other if COLUMNS else own
        bj = own if COLUMNS else other
        rows, cols, grad = _grad_tile(bi, bj, x_ptr, y_ptr, g_ptr, bias_ptr, fx_ptr, fy_ptr, rk0, ck0, rk1, ck1, n_rows, n_cols,
                                      d, diagonal, ACC, PRECISION, BLOCK, BLOCK_D)
        if not COLUMNS:
            row_sum += tl.sum(grad, axis=1)
        acc = owned_product(acc, grad, rows, cols, ds, n_rows, n_cols, d, y_ptr, z_ptr, fy_ptr, fz_ptr, FACTORS, COLUMNS, ACC,
                            PRECISION)
    mine = own * BLOCK + tl.arange(0, BLOCK)
    n_mine = n_cols if COLUMNS else n_rows
    tl.store(out_ptr + mine[:, None] * d + ds[None, :], acc, mask=(mine[:, None] < n_mine) & (ds[None, :] < d))
    if not COLUMNS:
        if tl.program_id(1) == 0:
            tl.store(gbias_ptr + mine, row_sum, mask=mine < n_rows)


_sigmoid_grad_rows_kernel = autotune(owned_outputs())(_sigmoid_grad_owned)
_sigmoid_grad_cols_kernel = autotune(owned_outputs())(_sigmoid_grad_owned)


def bias_vector(bias: Tensor | float, like: Tensor, dtype: torch.dtype) -> Tensor:
    """The logit bias as the kernels read it: a (1,) tensor of ``dtype`` on ``like``'s device."""
    if isinstance(bias, Tensor):
        return bias.detach().to(device=like.device, dtype=dtype).reshape(1).contiguous()
    return torch.full((1,), float(bias), dtype=dtype, device=like.device)


def sigmoid_sums(x_scaled: Tensor, y: Tensor, bias: Tensor | float, diagonal: int | None,
                 keys_: tuple[tuple[Tensor, ...], tuple[Tensor, ...]] | None,
                 factors: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """(R,) ``sum_j softplus(-z_ij S_ij)`` with ``S = x_scaled @ y.T + bias`` (fp32; fp64 for
    fp64); ``z_ij = +1`` where ``j == i + diagonal`` or the ids are equal (``keys_`` =
    (row keys, column keys)), -1 elsewhere. Neither given: every pair is a negative.
    ``factors``: ``(fx, fy)``, ``S_ij = fx_i fy_j <x_i, y_j> + bias`` (raw half rows).
    Under ``torch.use_deterministic_algorithms(True)`` row blocks own their sums (no atomics)."""
    x, yy = launch_operands(x_scaled, y)
    r, c, d = x.shape[0], yy.shape[0], x.shape[1]
    dtype = acc_dtypes(x)[0]
    out = torch.zeros(r, dtype=dtype, device=x.device)
    fx, fy = factors if factors is not None else (None, None)
    owned = not fused()
    kernel = _sigmoid_sums_owned_kernel if owned else _sigmoid_sums_kernel
    launch(kernel, tile_grid(r, c, owned), x, yy, out, bias_vector(bias, x, dtype), fx, fy, r, c, d, bucket(r, c), diagonal, OWNED=owned,
                                   GROUP=GROUP, **({} if keys_ is None else keys(*keys_)))
    return out


def sigmoid_grad(x_scaled: Tensor, y: Tensor, z: Tensor, g_row: Tensor, bias: Tensor | float, diagonal: int | None,
                 keys_: tuple[tuple[Tensor, ...], tuple[Tensor, ...]] | None,
                 factors: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dS diag(fy) @ y, (diag(fz) dS).T @ z, sum dS)`` for the upstream per-row gradient
    ``g_row``, each gradient tile formed once (atomics) -- or, under
    ``torch.use_deterministic_algorithms(True)``, row and column blocks owning their outputs and
    the bias gradient summed from per-row parts; see :func:`sigmoid_sums` for ``S``, ``z_ij`` and
    ``factors`` (here ``(fx, fy, fz)``; without them no diagonal scaling)."""
    x, yy, zz = launch_operands(x_scaled, y, z)
    r, c, d = x.shape[0], yy.shape[0], x.shape[1]
    dtype = acc_dtypes(x)[0]
    g = g_row.to(dtype).expand(r).contiguous()
    fx, fy, fz = factors if factors is not None else (None, None, None)
    bias_t = bias_vector(bias, x, dtype)
    common = dict(FACTORS=gradient_factors(factors, x_scaled), **({} if keys_ is None else keys(*keys_)))
    if fused():
        ga = torch.zeros(r, d, dtype=dtype, device=x.device)
        gb = torch.zeros(c, d, dtype=dtype, device=x.device)
        gbias = torch.zeros(1, dtype=dtype, device=x.device)
        launch(_sigmoid_grad_kernel, tile_grid(r, c), x, yy, zz, ga, gb, gbias, g, bias_t, fx, fy, fz, r, c, d, bucket(r, c), diagonal,
                                              GROUP=GROUP, **common)
        return ga, gb, gbias.reshape(())
    ga = torch.empty(r, d, dtype=dtype, device=x.device)
    gb = torch.empty(c, d, dtype=dtype, device=x.device)
    bias_rows = torch.empty(r, dtype=dtype, device=x.device)
    for kernel, out, blocks_of, columns in ((_sigmoid_grad_rows_kernel, ga, r, False), (_sigmoid_grad_cols_kernel, gb, c, True)):
        launch(kernel, owned_grid(blocks_of, d), x, yy, zz, out, bias_rows, g, bias_t, fx, fy, fz, r, c, d, bucket(r, c), diagonal,
                                          COLUMNS=columns, **common)
    return ga, gb, bias_rows.sum()
