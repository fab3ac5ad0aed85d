"""Triton kernels for the log-sum-exp engine (``backend="triton"``; optional extra ``gpu``).

Two kernels, each a 2-D problem reduced over one axis inside the program, so no atomics
and a deterministic result:

* :func:`_row_lse_kernel` -- one program per block of rows of ``S = X @ Y.T``: a GEMM loop
  over D per column block (``tl.dot``, fp32 accumulation) and an online (max, sum) over
  the column blocks; the self pair ``(i, i + self_offset)`` is left out. The column
  log-sum-exp of ``S`` is the row log-sum-exp of ``S.T = Y @ X.T``: the same kernel with
  the roles swapped.
* :func:`_grad_kernel` -- one program per block of rows: recomputes each logit tile,
  forms the gradient tile ``G_ij = u_i exp(S_ij - L_i) + v_j exp(S_ij - M_j)`` once in
  registers and accumulates ``G @ Z`` over the column blocks. ``dA = G @ B`` is one launch;
  ``dB = G.T @ A`` is the same kernel on ``S.T`` (rows and columns swapped), so every
  program owns its output rows.

Exponentials are always shifted by the row's (or column's) log-sum-exp, so both of the
torch backend's regimes (bounded and online maximum) are exact here. Half-precision
operands are fed to ``tl.dot`` as they are on a GPU; under ``TRITON_INTERPRET=1`` (CPU
tests) they are computed in fp32, because the interpreter's bf16 ``tl.dot`` is not exact.
Not covered (the torch backend serves them): the symmetric upper-triangle tiles, the
label-sorted mask-in-tile and sigmoid losses, exclusions and distributed column statistics.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

try:  # optional dependency
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised when triton is missing
    triton = None
    tl = None

__all__ = ["available", "grad_rows", "row_lse"]

BLOCK_M = 32
BLOCK_N = 32
BLOCK_D = 32


def available() -> bool:
    return triton is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(x: Tensor) -> None:
    """Triton needs CUDA tensors, or the interpreter on CPU."""
    if triton is None:
        raise ValueError("backend='triton' needs triton: pip install 'torch-contrastive[gpu]'")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"backend='triton' runs on CUDA tensors (got {x.device}); on CPU set TRITON_INTERPRET=1 (slow, for tests)")


if triton is not None:

    @triton.jit
    def _logits(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d, stride_x, stride_y,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
        """The (BLOCK_M, BLOCK_N) tile of X @ Y.T (accumulated in ACC) for the given rows and columns."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
        for k0 in range(0, d, BLOCK_D):
            ks = k0 + tl.arange(0, BLOCK_D)
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=(rows[:, None] < n_rows) & (ks[None, :] < d), other=0.0)
            y = tl.load(y_ptr + cols[:, None] * stride_y + ks[None, :], mask=(cols[:, None] < n_cols) & (ks[None, :] < d), other=0.0)
            acc += tl.dot(x, tl.trans(y), out_dtype=ACC)
        return acc

    @triton.jit
    def _row_lse_kernel(x_ptr, y_ptr, out_ptr, n_rows, n_cols, d, stride_x, stride_y, self_offset,
                        HAS_SELF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        ACC: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        run_max = tl.full((BLOCK_M,), float("-inf"), dtype=ACC)
        run_sum = tl.zeros((BLOCK_M,), dtype=ACC)
        for c0 in range(0, n_cols, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            s = _logits(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d, stride_x, stride_y, BLOCK_M, BLOCK_N, BLOCK_D, ACC)
            valid = cols[None, :] < n_cols
            if HAS_SELF:
                valid = valid & (cols[None, :] != rows[:, None] + self_offset)
            s = tl.where(valid, s, float("-inf"))
            new_max = tl.maximum(run_max, tl.max(s, axis=1))
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - safe) + tl.sum(tl.exp(s - safe[:, None]), axis=1)
            run_max = new_max
        lse = tl.where(run_sum > 0, tl.log(run_sum) + run_max, float("-inf"))
        tl.store(out_ptr + rows, lse, mask=rows < n_rows)

    @triton.jit
    def _grad_kernel(x_ptr, y_ptr, z_ptr, out_ptr, lse_r_ptr, u_ptr, lse_c_ptr, v_ptr, n_rows, n_cols, d, stride_x, stride_y,
                     stride_z, stride_o, self_offset, HAS_SELF: tl.constexpr, HAS_COL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_PAD: tl.constexpr,
                     ACC: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        lse_r = tl.load(lse_r_ptr + rows, mask=row_ok, other=0.0)
        u = tl.load(u_ptr + rows, mask=row_ok, other=0.0)
        u = tl.where(lse_r == float("-inf"), 0.0, u)  # a row without candidates has no gradient
        lse_r = tl.where(lse_r == float("-inf"), 0.0, lse_r)
        ds = tl.arange(0, D_PAD)
        acc = tl.zeros((BLOCK_M, D_PAD), dtype=ACC)
        for c0 in range(0, n_cols, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            col_ok = cols < n_cols
            s = _logits(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d, stride_x, stride_y, BLOCK_M, BLOCK_N, BLOCK_D, ACC)
            g = u[:, None] * tl.exp(s - lse_r[:, None])  # the gradient tile, formed once
            if HAS_COL:
                lse_c = tl.load(lse_c_ptr + cols, mask=col_ok, other=0.0)
                v = tl.load(v_ptr + cols, mask=col_ok, other=0.0)
                v = tl.where(lse_c == float("-inf"), 0.0, v)
                lse_c = tl.where(lse_c == float("-inf"), 0.0, lse_c)
                g += v[None, :] * tl.exp(s - lse_c[None, :])
            valid = row_ok[:, None] & col_ok[None, :]
            if HAS_SELF:
                valid = valid & (cols[None, :] != rows[:, None] + self_offset)
            g = tl.where(valid, g, 0.0)
            z = tl.load(z_ptr + cols[:, None] * stride_z + ds[None, :], mask=col_ok[:, None] & (ds[None, :] < d), other=0.0)
            acc += tl.dot(g.to(ACC), z.to(ACC), out_dtype=ACC)
        tl.store(out_ptr + rows[:, None] * stride_o + ds[None, :], acc, mask=row_ok[:, None] & (ds[None, :] < d))


def _operand(x: Tensor) -> Tensor:
    """Operands as the kernels read them: contiguous; fp32 under the interpreter."""
    x = x.contiguous()
    return x.float() if interpreting() and x.dtype in (torch.float16, torch.bfloat16) else x


def _acc(x: Tensor) -> tuple[torch.dtype, Any]:
    """Accumulation dtype: fp64 for fp64 operands, fp32 otherwise (as the torch backend)."""
    return (torch.float64, tl.float64) if x.dtype == torch.float64 else (torch.float32, tl.float32)


def row_lse(x_scaled: Tensor, y: Tensor, self_offset: int | None) -> Tensor:
    """(R,) ``log sum_{j != self(i)} exp(S_ij)`` (fp32; fp64 for fp64) of ``S = x_scaled @ y.T``; ``-inf`` for no candidate."""
    check_device(x_scaled)
    x, yy = _operand(x_scaled), _operand(y)
    r, c, d = x.shape[0], yy.shape[0], x.shape[1]
    dtype, acc = _acc(x)
    out = torch.empty(r, dtype=dtype, device=x.device)
    grid = (triton.cdiv(r, BLOCK_M),)
    _row_lse_kernel[grid](x, yy, out, r, c, d, x.stride(0), yy.stride(0), 0 if self_offset is None else self_offset,
                          HAS_SELF=self_offset is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, ACC=acc)
    return out


def grad_rows(x_scaled: Tensor, y: Tensor, z: Tensor, row: tuple[Tensor, Tensor], col: tuple[Tensor, Tensor] | None,
              self_offset: int | None) -> Tensor:
    """(R, D) ``G @ z`` (fp32; fp64 for fp64) with ``G_ij = u_i exp(S_ij - L_i) (+ v_j exp(S_ij - M_j))``, self pairs 0.

    ``row = (u, L)``, ``col = (v, M)``; ``S = x_scaled @ y.T``. For ``G.T @ A`` call it on
    ``S.T``: ``grad_rows(y, x_scaled, a, col, row, -self_offset)``.
    """
    check_device(x_scaled)
    x, yy, zz = _operand(x_scaled), _operand(y), _operand(z)
    r, c, d = x.shape[0], yy.shape[0], x.shape[1]
    dtype, acc = _acc(x)
    out = torch.empty(r, zz.shape[1], dtype=dtype, device=x.device)
    u, lse_r = (t.to(dtype).contiguous() for t in row)
    v, lse_c = (t.to(dtype).contiguous() for t in col) if col is not None else (u, lse_r)
    grid = (triton.cdiv(r, BLOCK_M),)
    kwargs: dict[str, Any] = dict(HAS_SELF=self_offset is not None, HAS_COL=col is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                  BLOCK_D=BLOCK_D, D_PAD=max(16, triton.next_power_of_2(zz.shape[1])), ACC=acc)
    _grad_kernel[grid](x, yy, zz, out, lse_r, u, lse_c, v, r, c, d, x.stride(0), yy.stride(0), zz.stride(0), out.stride(0),
                       0 if self_offset is None else self_offset, **kwargs)
    return out
