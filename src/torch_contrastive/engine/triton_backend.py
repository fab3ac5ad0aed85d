"""Triton kernels for the log-sum-exp engine (``backend="triton"``; optional extra ``gpu``).

Two schemes, chosen per call by :func:`fused`:

* **Fused** (the default on a GPU): a 2-D grid of (row block, column block) tiles read
  from a *schedule* in grouped order (``GROUP`` row blocks sweep the column blocks
  together, so their column operands are reused from L2), or -- for a single set -- the
  upper triangle only. Forward (:func:`tile_sums`, bounded regime): each program
  computes its logit tile once (GEMM loop over D, fp32 accumulation), takes ``exp`` and
  adds its row sums and its column sums into O(N) accumulators with atomics -- rows and
  columns in one pass; a triangle tile's column sums are the sums of its mirror rows.
  Backward (:func:`tile_grad`, both regimes): each program recomputes its tile, forms the
  gradient tile ``G`` once in registers and, over D in blocks, adds ``G @ B`` into its
  rows and ``G.T @ A`` into its columns (atomics). 4 GEMM-equivalents for a CLIP loss,
  2 for a single set, as the torch backend.
* **Row-owned** (``torch.use_deterministic_algorithms(True)``, and the forward of the
  online-maximum regime): one program per block of rows loops over the column blocks
  (online maximum, :func:`row_lse`; ``G @ Z`` in D blocks, :func:`grad_rows`); a column
  quantity is the same kernel on ``S.T``. No atomics, so bitwise reproducible; CLIP costs
  6 GEMM-equivalents (the logits are formed once per direction in each pass).

Both schemes apply the self pair and the engine's exclusions (false negatives) inside the
tile: equal ids (one or two key tensors), a partner relation (DCL's positives), a strided
diagonal, and a guide model's verdict ``<g_i, g_j> > t_i`` (a second small product per
tile, in registers). Exponentials in the gradient are shifted by the final log-sum-exps,
so both of the torch backend's regimes are exact here; the bounded forward sums plain
``exp(S)`` exactly as the torch backend's fixed path does.

Precision: fp32 operands are multiplied in IEEE fp32 (TF32 only when
``torch.backends.cuda.matmul.allow_tf32`` is set), fp64 in fp64; half-precision operands
are fed to ``tl.dot`` as they are on a GPU (the gradient tile is rounded to their dtype
for its two products, as flash attention does) with fp32 accumulation. Under
``TRITON_INTERPRET=1`` (the CPU tests) half operands are widened to fp32, because the
interpreter's bf16 ``tl.dot`` is inexact. Not covered (the torch backend serves them):
the label-sorted mask-in-tile losses (PML NT-Xent with labels, NT-BXent), SigLIP, and
exclusions by index pairs or sample masks.
"""

from __future__ import annotations

import functools
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

__all__ = ["fused", "grad_rows", "row_lse", "schedule", "tile_grad", "tile_sums"]

BLOCK_D = 32  # the GEMM loop's step over the feature dimension
GROUP = 8  # row blocks that sweep the column blocks together (grouped order)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(x: Tensor) -> None:
    """Triton needs CUDA tensors, or the interpreter on CPU."""
    if triton is None:
        raise ValueError("backend='triton' needs triton: pip install 'torch-contrastive[gpu]'")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"backend='triton' runs on CUDA tensors (got {x.device}); on CPU set TRITON_INTERPRET=1 (slow, for tests)")


def fused() -> bool:
    """Whether the atomic (fused) kernels may run: not under ``torch.use_deterministic_algorithms``."""
    return not torch.are_deterministic_algorithms_enabled()


def _block(x: Tensor) -> int:
    """Tile side: 64 on a GPU; 32 under the interpreter (small test problems still span tiles)."""
    return 64 if x.device.type == "cuda" else 32


@functools.lru_cache(maxsize=64)
def _schedule_cached(n_row_blocks: int, n_col_blocks: int, triangle: bool, group: int, device: str) -> Tensor:
    bi = torch.arange(n_row_blocks).repeat_interleave(n_col_blocks)
    bj = torch.arange(n_col_blocks).repeat(n_row_blocks)
    if triangle:
        keep = bj >= bi
        bi, bj = bi[keep], bj[keep]
    # grouped order: row-block groups one after another; inside a group, column block
    # by column block, the group's row blocks one after another
    order = torch.argsort((bi // group) * (n_col_blocks * group) + bj * group + bi % group)
    return torch.stack((bi[order], bj[order]), dim=1).to(torch.int32).contiguous().to(device)


def schedule(n_row_blocks: int, n_col_blocks: int, triangle: bool, device: torch.device, group: int = GROUP) -> Tensor:
    """(T, 2) int32 (row block, column block) of every tile, in grouped order; with
    ``triangle`` only the tiles on or above the diagonal. Built once per shape (cached)."""
    return _schedule_cached(n_row_blocks, n_col_blocks, triangle, group, str(device))


if triton is not None:

    @triton.jit
    def _logits(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d, stride_x, stride_y,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
                PRECISION: tl.constexpr):
        """The (BLOCK_M, BLOCK_N) tile of X @ Y.T (accumulated in ACC) for the given rows and columns."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
        for k0 in range(0, d, BLOCK_D):
            ks = k0 + tl.arange(0, BLOCK_D)
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=(rows[:, None] < n_rows) & (ks[None, :] < d), other=0.0)
            y = tl.load(y_ptr + cols[:, None] * stride_y + ks[None, :], mask=(cols[:, None] < n_cols) & (ks[None, :] < d), other=0.0)
            acc += tl.dot(x, tl.trans(y), out_dtype=ACC, input_precision=PRECISION)
        return acc

    @triton.jit
    def _excluded(orow, ocol, n_orows, n_ocols, rk0, ck0, rk1, ck1, partner, g_rows, g_cols, threshold, dg, stride_gr,
                  stride_gc, diagonal, keep_diagonal, N_KEYS: tl.constexpr, PARTNER: tl.constexpr, GUIDE: tl.constexpr,
                  DIAGONAL: tl.constexpr, KEEP_DIAGONAL: tl.constexpr, GACC: tl.constexpr, OM: tl.constexpr,
                  ON: tl.constexpr, PRECISION: tl.constexpr):
        """(OM, ON) bool, in the problem's own orientation: candidate ``ocol_j`` leaves anchor
        ``orow_i``'s log-sum-exp -- ``(keys | partner | guide) & ~kept diagonal | diagonal``,
        the same rule as :class:`~torch_contrastive.positives.Exclusion`."""
        r_ok = orow < n_orows
        c_ok = ocol < n_ocols
        out = (orow[:, None] < 0) & (ocol[None, :] < 0)  # all False
        if N_KEYS >= 1:
            a0 = tl.load(rk0 + orow, mask=r_ok, other=-1)
            b0 = tl.load(ck0 + ocol, mask=c_ok, other=-2)
            out = out | (a0[:, None] == b0[None, :])
        if N_KEYS >= 2:
            a1 = tl.load(rk1 + orow, mask=r_ok, other=-1)
            b1 = tl.load(ck1 + ocol, mask=c_ok, other=-2)
            out = out | (a1[:, None] == b1[None, :])
        if PARTNER:
            p = tl.load(partner + orow, mask=r_ok, other=-1)
            out = out | (ocol[None, :] == p[:, None])
        if GUIDE:
            g = tl.zeros((OM, ON), dtype=GACC)
            for k0 in range(0, dg, 16):
                ks = k0 + tl.arange(0, 16)
                u = tl.load(g_rows + orow[:, None] * stride_gr + ks[None, :], mask=r_ok[:, None] & (ks[None, :] < dg), other=0.0)
                v = tl.load(g_cols + ocol[:, None] * stride_gc + ks[None, :], mask=c_ok[:, None] & (ks[None, :] < dg), other=0.0)
                g += tl.dot(u, tl.trans(v), out_dtype=GACC, input_precision=PRECISION)
            t = tl.load(threshold + orow, mask=r_ok, other=0.0)
            out = out | (g > t[:, None])
        if KEEP_DIAGONAL:  # the positive itself never leaves
            out = out & (ocol[None, :] != orow[:, None] + keep_diagonal)
        if DIAGONAL:  # DCL's positive as a strided diagonal
            out = out | (ocol[None, :] == orow[:, None] + diagonal)
        return out

    @triton.jit
    def _valid(rows, cols, n_rows, n_cols, self_offset, rk0, ck0, rk1, ck1, partner, g_rows, g_cols, threshold, dg,
               stride_gr, stride_gc, diagonal, keep_diagonal, HAS_SELF: tl.constexpr, EXCLUDE: tl.constexpr,
               TRANSPOSED: tl.constexpr, N_KEYS: tl.constexpr, PARTNER: tl.constexpr, GUIDE: tl.constexpr,
               DIAGONAL: tl.constexpr, KEEP_DIAGONAL: tl.constexpr, GACC: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        """(BLOCK_M, BLOCK_N) bool: in bounds, not a self pair, not excluded. Kernel rows and
        columns are the problem's columns and rows when ``TRANSPOSED`` (a pass over ``S.T``)."""
        valid = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        if HAS_SELF:
            valid = valid & (cols[None, :] != rows[:, None] + self_offset)
        if EXCLUDE:
            if TRANSPOSED:
                out = tl.trans(_excluded(cols, rows, n_cols, n_rows, rk0, ck0, rk1, ck1, partner, g_rows, g_cols, threshold, dg,
                                         stride_gr, stride_gc, diagonal, keep_diagonal, N_KEYS, PARTNER, GUIDE, DIAGONAL,
                                         KEEP_DIAGONAL, GACC, BLOCK_N, BLOCK_M, PRECISION))
            else:
                out = _excluded(rows, cols, n_rows, n_cols, rk0, ck0, rk1, ck1, partner, g_rows, g_cols, threshold, dg,
                                stride_gr, stride_gc, diagonal, keep_diagonal, N_KEYS, PARTNER, GUIDE, DIAGONAL, KEEP_DIAGONAL,
                                GACC, BLOCK_M, BLOCK_N, PRECISION)
            valid = valid & ~out
        return valid

    @triton.jit
    def _row_lse_kernel(x_ptr, y_ptr, out_ptr, n_rows, n_cols, d, stride_x, stride_y, self_offset,
                        rk0, ck0, rk1, ck1, partner, g_rows, g_cols, threshold, dg, stride_gr, stride_gc, diagonal,
                        keep_diagonal, HAS_SELF: tl.constexpr, EXCLUDE: tl.constexpr, TRANSPOSED: tl.constexpr,
                        N_KEYS: tl.constexpr, PARTNER: tl.constexpr, GUIDE: tl.constexpr, DIAGONAL: tl.constexpr,
                        KEEP_DIAGONAL: tl.constexpr, GACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        run_max = tl.full((BLOCK_M,), float("-inf"), dtype=ACC)
        run_sum = tl.zeros((BLOCK_M,), dtype=ACC)
        for c0 in range(0, n_cols, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            s = _logits(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d, stride_x, stride_y, BLOCK_M, BLOCK_N, BLOCK_D, ACC, PRECISION)
            valid = _valid(rows, cols, n_rows, n_cols, self_offset, rk0, ck0, rk1, ck1, partner, g_rows, g_cols, threshold, dg,
                           stride_gr, stride_gc, diagonal, keep_diagonal, HAS_SELF, EXCLUDE, TRANSPOSED, N_KEYS, PARTNER,
                           GUIDE, DIAGONAL, KEEP_DIAGONAL, GACC, BLOCK_M, BLOCK_N, PRECISION)
            s = tl.where(valid, s, float("-inf"))
            new_max = tl.maximum(run_max, tl.max(s, axis=1))
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - safe) + tl.sum(tl.exp(s - safe[:, None]), axis=1)
            run_max = new_max
        lse = tl.where(run_sum > 0, tl.log(run_sum) + run_max, float("-inf"))
        tl.store(out_ptr + rows, lse, mask=rows < n_rows)

    @triton.jit
    def _scheduled(sched_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """This program's tile, read from the schedule: its row block, rows and columns."""
        pid = tl.program_id(0)
        bi = tl.load(sched_ptr + 2 * pid)
        bj = tl.load(sched_ptr + 2 * pid + 1)
        return bi, bi * BLOCK_M + tl.arange(0, BLOCK_M), bj * BLOCK_N + tl.arange(0, BLOCK_N)

    @triton.jit
    def _tile_sums_kernel(sched_ptr, x_ptr, y_ptr, row_sum_ptr, col_sum_ptr, n_rows, n_cols, d, stride_x, stride_y,
                          self_offset, rk0, ck0, rk1, ck1, partner, g_rows, g_cols, threshold, dg, stride_gr, stride_gc,
                          diagonal, keep_diagonal, HAS_SELF: tl.constexpr, EXCLUDE: tl.constexpr, N_KEYS: tl.constexpr,
                          PARTNER: tl.constexpr, GUIDE: tl.constexpr, DIAGONAL: tl.constexpr, KEEP_DIAGONAL: tl.constexpr,
                          GACC: tl.constexpr, COLUMNS: tl.constexpr, SYMMETRIC: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
        """One tile: ``exp(S)`` once, its row sums and column sums added with atomics."""
        bi, rows, cols = _scheduled(sched_ptr, BLOCK_M, BLOCK_N)
        s = _logits(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d, stride_x, stride_y, BLOCK_M, BLOCK_N, BLOCK_D, ACC, PRECISION)
        valid = _valid(rows, cols, n_rows, n_cols, self_offset, rk0, ck0, rk1, ck1, partner, g_rows, g_cols, threshold, dg,
                       stride_gr, stride_gc, diagonal, keep_diagonal, HAS_SELF, EXCLUDE, False, N_KEYS, PARTNER, GUIDE,
                       DIAGONAL, KEEP_DIAGONAL, GACC, BLOCK_M, BLOCK_N, PRECISION)
        e = tl.where(valid, tl.exp(s), 0.0)
        tl.atomic_add(row_sum_ptr + rows, tl.sum(e, axis=1), mask=rows < n_rows, sem="relaxed")
        if COLUMNS:
            tl.atomic_add(col_sum_ptr + cols, tl.sum(e, axis=0), mask=cols < n_cols, sem="relaxed")
        if SYMMETRIC:  # the mirror tile's rows are this tile's columns
            mirror = (cols < n_cols) & (cols // BLOCK_N != bi)  # not the diagonal tile
            tl.atomic_add(row_sum_ptr + cols, tl.sum(e, axis=0), mask=mirror, sem="relaxed")

    @triton.jit
    def _gradient_tile(s, rows, cols, n_rows, n_cols, lse_r_ptr, u_ptr, lse_c_ptr, v_ptr, HAS_COL: tl.constexpr):
        """``G_ij = u_i exp(S_ij - L_i) (+ v_j exp(S_ij - M_j))``; a row (column) whose
        log-sum-exp is ``-inf`` has no candidate and no gradient."""
        row_ok = rows < n_rows
        lse_r = tl.load(lse_r_ptr + rows, mask=row_ok, other=0.0)
        u = tl.load(u_ptr + rows, mask=row_ok, other=0.0)
        u = tl.where(lse_r == float("-inf"), 0.0, u)
        lse_r = tl.where(lse_r == float("-inf"), 0.0, lse_r)
        g = u[:, None] * tl.exp(s - lse_r[:, None])
        if HAS_COL:
            col_ok = cols < n_cols
            lse_c = tl.load(lse_c_ptr + cols, mask=col_ok, other=0.0)
            v = tl.load(v_ptr + cols, mask=col_ok, other=0.0)
            v = tl.where(lse_c == float("-inf"), 0.0, v)
            lse_c = tl.where(lse_c == float("-inf"), 0.0, lse_c)
            g += v[None, :] * tl.exp(s - lse_c[None, :])
        return g

    @triton.jit
    def _grad_rows_kernel(x_ptr, y_ptr, z_ptr, out_ptr, lse_r_ptr, u_ptr, lse_c_ptr, v_ptr, n_rows, n_cols, d, d_out,
                          stride_x, stride_y, stride_z, stride_o, self_offset, rk0, ck0, rk1, ck1, partner, g_rows, g_cols,
                          threshold, dg, stride_gr, stride_gc, diagonal, keep_diagonal, HAS_SELF: tl.constexpr,
                          HAS_COL: tl.constexpr, EXCLUDE: tl.constexpr, TRANSPOSED: tl.constexpr, N_KEYS: tl.constexpr,
                          PARTNER: tl.constexpr, GUIDE: tl.constexpr, DIAGONAL: tl.constexpr, KEEP_DIAGONAL: tl.constexpr,
                          GACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_O: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
        """Rows ``pid0`` and output features ``pid1`` of ``G @ Z``: the program owns its output."""
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        ds = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=ACC)
        for c0 in range(0, n_cols, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            s = _logits(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d, stride_x, stride_y, BLOCK_M, BLOCK_N, BLOCK_D, ACC, PRECISION)
            g = _gradient_tile(s, rows, cols, n_rows, n_cols, lse_r_ptr, u_ptr, lse_c_ptr, v_ptr, HAS_COL)
            valid = _valid(rows, cols, n_rows, n_cols, self_offset, rk0, ck0, rk1, ck1, partner, g_rows, g_cols, threshold, dg,
                           stride_gr, stride_gc, diagonal, keep_diagonal, HAS_SELF, EXCLUDE, TRANSPOSED, N_KEYS, PARTNER,
                           GUIDE, DIAGONAL, KEEP_DIAGONAL, GACC, BLOCK_M, BLOCK_N, PRECISION)
            g = tl.where(valid, g, 0.0)
            z = tl.load(z_ptr + cols[:, None] * stride_z + ds[None, :], mask=(cols[:, None] < n_cols) & (ds[None, :] < d_out),
                        other=0.0)
            acc += tl.dot(g.to(z.dtype), z, out_dtype=ACC, input_precision=PRECISION)
        tl.store(out_ptr + rows[:, None] * stride_o + ds[None, :], acc, mask=(rows[:, None] < n_rows) & (ds[None, :] < d_out))

    @triton.jit
    def _tile_grad_kernel(sched_ptr, x_ptr, y_ptr, z_ptr, ga_ptr, gb_ptr, lse_r_ptr, u_ptr, lse_c_ptr, v_ptr, n_rows, n_cols,
                          d, grad_cols, stride_x, stride_y, stride_z, stride_ga, stride_gb, self_offset, rk0, ck0, rk1, ck1,
                          partner, g_rows, g_cols, threshold, dg, stride_gr, stride_gc, diagonal, keep_diagonal,
                          HAS_SELF: tl.constexpr, HAS_COL: tl.constexpr, EXCLUDE: tl.constexpr, N_KEYS: tl.constexpr,
                          PARTNER: tl.constexpr, GUIDE: tl.constexpr, DIAGONAL: tl.constexpr, KEEP_DIAGONAL: tl.constexpr,
                          GACC: tl.constexpr, GRAD_COLS: tl.constexpr, SYMMETRIC: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
        """One tile: ``G`` formed once, then ``G @ Y`` into its rows and ``G.T @ Z`` into its
        columns (the mirror rows for a single set), D block by D block, with atomics."""
        bi, rows, cols = _scheduled(sched_ptr, BLOCK_M, BLOCK_N)
        s = _logits(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d, stride_x, stride_y, BLOCK_M, BLOCK_N, BLOCK_D, ACC, PRECISION)
        g = _gradient_tile(s, rows, cols, n_rows, n_cols, lse_r_ptr, u_ptr, lse_c_ptr, v_ptr, HAS_COL)
        valid = _valid(rows, cols, n_rows, n_cols, self_offset, rk0, ck0, rk1, ck1, partner, g_rows, g_cols, threshold, dg,
                       stride_gr, stride_gc, diagonal, keep_diagonal, HAS_SELF, EXCLUDE, False, N_KEYS, PARTNER, GUIDE,
                       DIAGONAL, KEEP_DIAGONAL, GACC, BLOCK_M, BLOCK_N, PRECISION)
        g = tl.where(valid, g, 0.0)
        row_ok = rows < n_rows
        col_ok = cols < n_cols
        for k0 in range(0, d, BLOCK_D):
            ks = k0 + tl.arange(0, BLOCK_D)
            k_ok = ks < d
            y = tl.load(y_ptr + cols[:, None] * stride_y + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            part = tl.dot(g.to(y.dtype), y, out_dtype=ACC, input_precision=PRECISION)
            tl.atomic_add(ga_ptr + rows[:, None] * stride_ga + ks[None, :], part, mask=row_ok[:, None] & k_ok[None, :], sem="relaxed")
            if GRAD_COLS or SYMMETRIC:
                z = tl.load(z_ptr + rows[:, None] * stride_z + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                part_t = tl.dot(tl.trans(g.to(z.dtype)), z, out_dtype=ACC, input_precision=PRECISION)
                if SYMMETRIC:  # G is symmetric: the mirror tile's rows get G.T @ Z (not from a diagonal tile)
                    tl.atomic_add(ga_ptr + cols[:, None] * stride_ga + ks[None, :], part_t,
                                  mask=col_ok[:, None] & k_ok[None, :] & (cols[:, None] // BLOCK_N != bi), sem="relaxed")
                else:
                    tl.atomic_add(gb_ptr + cols[:, None] * stride_gb + ks[None, :], part_t,
                                  mask=(cols[:, None] < grad_cols) & k_ok[None, :], sem="relaxed")


# ---------------------------------------------------------------------------- host side
def _operand(x: Tensor) -> Tensor:
    """Operands as the kernels read them: contiguous; fp32 under the interpreter."""
    x = x.contiguous()
    return x.float() if interpreting() and x.dtype in (torch.float16, torch.bfloat16) else x


def _acc(x: Tensor) -> tuple[torch.dtype, Any]:
    """Accumulation dtype: fp64 for fp64 operands, fp32 otherwise (as the torch backend)."""
    return (torch.float64, tl.float64) if x.dtype == torch.float64 else (torch.float32, tl.float32)


def _precision(x: Tensor) -> str:
    """``tl.dot``'s input precision: IEEE unless the user allowed TF32 for fp32 matmuls."""
    if x.dtype == torch.float32 and x.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _exclusion(exclude: Any, anchor: Tensor) -> tuple[list[Any], dict[str, Any]]:
    """The kernels' view of an :class:`~torch_contrastive.positives.Exclusion` (or None):
    positional tensors/ints after ``self_offset`` and the constexpr switches."""
    dummy = anchor
    keys: list[Tensor] = [dummy, dummy, dummy, dummy]
    partner: Tensor = dummy
    g_rows = g_cols = threshold = dummy
    dg = stride_gr = stride_gc = 0
    flags: dict[str, Any] = dict(EXCLUDE=exclude is not None, N_KEYS=0, PARTNER=False, GUIDE=False, DIAGONAL=False,
                                 KEEP_DIAGONAL=False, GACC=tl.float32)
    diagonal = keep_diagonal = 0
    if exclude is not None:
        if exclude.keep is not None:
            raise ValueError("backend='triton' does not cover an exclusion with a kept relation; use backend='torch'")
        relation = exclude.relation
        if relation is not None:
            if relation.kind == "keys":
                rk, ck = relation.row_keys, relation.col_keys
                keys = [rk[0].contiguous(), ck[0].contiguous()]
                keys += [rk[1].contiguous(), ck[1].contiguous()] if len(rk) > 1 else [dummy, dummy]
                flags["N_KEYS"] = len(rk)
            elif relation.kind == "partner":
                partner = relation.partner.contiguous()
                flags["PARTNER"] = True
            else:
                raise ValueError(f"backend='triton' does not cover exclusions by a {relation.kind!r} relation; use backend='torch'")
        if exclude.guide is not None:
            rows, cols, thr = exclude.guide
            g_rows, g_cols = _operand(rows), _operand(cols)
            threshold = thr.to(g_rows.dtype).contiguous()
            dg, stride_gr, stride_gc = g_rows.shape[1], g_rows.stride(0), g_cols.stride(0)
            flags.update(GUIDE=True, GACC=tl.float64 if g_rows.dtype == torch.float64 else tl.float32)
        if exclude.diagonal is not None:
            diagonal = exclude.diagonal
            flags["DIAGONAL"] = True
        if exclude.keep_diagonal is not None:
            keep_diagonal = exclude.keep_diagonal
            flags["KEEP_DIAGONAL"] = True
    args = [*keys, partner, g_rows, g_cols, threshold, dg, stride_gr, stride_gc, diagonal, keep_diagonal]
    return args, flags


def row_lse(x_scaled: Tensor, y: Tensor, self_offset: int | None, exclude: Any = None, transposed: bool = False) -> Tensor:
    """(R,) ``log sum_j exp(S_ij)`` over the candidates that count (fp32; fp64 for fp64) of
    ``S = x_scaled @ y.T``; ``-inf`` for a row without any. Row-owned, online maximum.

    ``transposed``: ``x_scaled`` / ``y`` are the problem's candidates / anchors (a column
    log-sum-exp), so the exclusion rule is read with rows and columns swapped.
    """
    check_device(x_scaled)
    x, yy = _operand(x_scaled), _operand(y)
    r, c, d = x.shape[0], yy.shape[0], x.shape[1]
    dtype, acc = _acc(x)
    out = torch.empty(r, dtype=dtype, device=x.device)
    block = _block(x)
    excl_args, flags = _exclusion(exclude, x)
    _row_lse_kernel[(triton.cdiv(r, block),)](
        x, yy, out, r, c, d, x.stride(0), yy.stride(0), 0 if self_offset is None else self_offset, *excl_args,
        HAS_SELF=self_offset is not None, TRANSPOSED=transposed, BLOCK_M=block, BLOCK_N=block, BLOCK_D=BLOCK_D, ACC=acc,
        PRECISION=_precision(x), **flags)
    return out


def tile_sums(x_scaled: Tensor, y: Tensor, self_offset: int | None, exclude: Any, columns: bool,
              symmetric: bool) -> tuple[Tensor, Tensor | None]:
    """Bounded regime: ``(sum_j exp(S_ij), sum_i exp(S_ij))`` over the candidates that
    count, rows and columns from one pass over the tiles (atomics; the column sums are None
    unless ``columns``). ``symmetric``: ``y`` is ``x``'s own set, the upper-triangle tiles only."""
    check_device(x_scaled)
    x, yy = _operand(x_scaled), _operand(y)
    r, c, d = x.shape[0], yy.shape[0], x.shape[1]
    dtype, acc = _acc(x)
    row_sum = torch.zeros(r, dtype=dtype, device=x.device)
    col_sum = torch.zeros(c, dtype=dtype, device=x.device) if columns else row_sum
    block = _block(x)
    sched = schedule(triton.cdiv(r, block), triton.cdiv(c, block), symmetric, x.device)
    excl_args, flags = _exclusion(exclude, x)
    _tile_sums_kernel[(sched.shape[0],)](
        sched, x, yy, row_sum, col_sum, r, c, d, x.stride(0), yy.stride(0), 0 if self_offset is None else self_offset,
        *excl_args, HAS_SELF=self_offset is not None, COLUMNS=columns, SYMMETRIC=symmetric, BLOCK_M=block, BLOCK_N=block,
        BLOCK_D=BLOCK_D, ACC=acc, PRECISION=_precision(x), **flags)
    return row_sum, col_sum if columns else None


def _per_index(t: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """A per-row (or per-column) vector, possibly a broadcast 0-dim coefficient, as the kernels read it."""
    return t.to(dtype).expand(n).contiguous()


def _directions(row: tuple[Tensor, Tensor], col: tuple[Tensor, Tensor] | None, dtype: torch.dtype) -> list[Tensor]:
    """``[L, u, M, v]`` for the gradient kernels (the row pair again when there is no column term)."""
    n = row[1].shape[0]
    lse_r, u = _per_index(row[1], n, dtype), _per_index(row[0], n, dtype)
    if col is None:
        return [lse_r, u, lse_r, u]
    m = col[1].shape[0]
    return [lse_r, u, _per_index(col[1], m, dtype), _per_index(col[0], m, dtype)]


def check_exclusion(exclude: Any) -> None:
    """A clear error, before any work, for an exclusion the kernels do not cover."""
    if exclude is not None:
        _exclusion(exclude, torch.empty(0))


def grad_rows(x_scaled: Tensor, y: Tensor, z: Tensor, row: tuple[Tensor, Tensor], col: tuple[Tensor, Tensor] | None,
              self_offset: int | None, exclude: Any = None, transposed: bool = False) -> Tensor:
    """(R, D) ``G @ z`` (fp32; fp64 for fp64), ``G_ij = u_i exp(S_ij - L_i) (+ v_j exp(S_ij - M_j))``
    on the candidates that count. Row-owned, deterministic (a grid of row blocks by output
    feature blocks: the logits are recomputed once per 128 output features).

    ``row = (u, L)``, ``col = (v, M)``; ``S = x_scaled @ y.T``. For ``G.T @ A`` call it on
    ``S.T`` with ``transposed=True``: ``grad_rows(y, x_scaled, a, col, row, -self_offset, exclude, True)``.
    """
    check_device(x_scaled)
    x, yy, zz = _operand(x_scaled), _operand(y), _operand(z)
    r, c, d, d_out = x.shape[0], yy.shape[0], x.shape[1], zz.shape[1]
    dtype, acc = _acc(x)
    out = torch.empty(r, d_out, dtype=dtype, device=x.device)
    block = _block(x)
    block_o = min(128, max(16, triton.next_power_of_2(d_out)))
    excl_args, flags = _exclusion(exclude, x)
    grid = (triton.cdiv(r, block), triton.cdiv(d_out, block_o))
    _grad_rows_kernel[grid](
        x, yy, zz, out, *_directions(row, col, dtype), r, c, d, d_out, x.stride(0), yy.stride(0), zz.stride(0), out.stride(0),
        0 if self_offset is None else self_offset, *excl_args, HAS_SELF=self_offset is not None, HAS_COL=col is not None,
        TRANSPOSED=transposed, BLOCK_M=block, BLOCK_N=block, BLOCK_D=BLOCK_D, BLOCK_O=block_o, ACC=acc,
        PRECISION=_precision(x), **flags)
    return out


def tile_grad(x_scaled: Tensor, y: Tensor, z: Tensor, row: tuple[Tensor, Tensor], col: tuple[Tensor, Tensor] | None,
              self_offset: int | None, exclude: Any, grad_columns: int, symmetric: bool) -> tuple[Tensor, Tensor | None]:
    """``(G @ y, G.T @ z)`` from one pass over the tiles, each gradient tile formed once
    (atomics). ``G.T @ z`` covers the first ``grad_columns`` candidates (None for 0);
    ``symmetric``: ``y`` is ``x``'s own set, upper-triangle tiles, ``G @ y`` holds both
    roles and the second result is None."""
    check_device(x_scaled)
    x, yy, zz = _operand(x_scaled), _operand(y), _operand(z)
    r, c, d = x.shape[0], yy.shape[0], x.shape[1]
    dtype, acc = _acc(x)
    ga = torch.zeros(r, d, dtype=dtype, device=x.device)
    grad_cols = 0 if symmetric else max(0, min(grad_columns, c))
    gb = torch.zeros(c, d, dtype=dtype, device=x.device) if grad_cols else ga
    block = _block(x)
    sched = schedule(triton.cdiv(r, block), triton.cdiv(c, block), symmetric, x.device)
    excl_args, flags = _exclusion(exclude, x)
    _tile_grad_kernel[(sched.shape[0],)](
        sched, x, yy, zz, ga, gb, *_directions(row, col, dtype), r, c, d, grad_cols, x.stride(0), yy.stride(0), zz.stride(0),
        ga.stride(0), gb.stride(0), 0 if self_offset is None else self_offset, *excl_args, HAS_SELF=self_offset is not None,
        HAS_COL=col is not None, GRAD_COLS=grad_cols > 0, SYMMETRIC=symmetric, BLOCK_M=block, BLOCK_N=block, BLOCK_D=BLOCK_D,
        ACC=acc, PRECISION=_precision(x), **flags)
    return ga, gb if grad_cols else None
