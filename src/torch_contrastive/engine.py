"""The tiled autograd engine: contrastive statistics in O(N * tile) extra memory.

Every loss of the package reduces to per-anchor statistics of the logit matrix
``S = scale * A @ B.T`` (R anchors, C candidates), which this module computes
block by block without ever holding S (SPEC section 5):

:func:`logsumexp_rows`
    ``LSE_i = log sum_{j != self(i)} exp(S_ij)`` for every anchor, and optionally the
    column statistic ``log sum_i exp(S_ij)`` (the second direction of the image-text
    loss). This serves NT-Xent (pairing rules), SupCon and the image-text loss: their
    positive part ``sum_p S_ip`` is linear and is computed in O(N * D) by
    :meth:`~torch_contrastive.positives.Positives.aggregate`, outside the engine.
:func:`pairwise_rows`
    Statistics that need the positive mask inside the tile: the per-positive-pair
    NT-Xent of pytorch-metric-learning (``kernel="pair_softplus"``) and NT-BXent's
    element-wise binary cross-entropy (``kernel="binary"``). Positive tiles come from
    :meth:`~torch_contrastive.positives.Positives.tile`.

Both are ``torch.autograd.Function`` s: forward keeps only O(R + C) statistics, backward
recomputes each logit tile, forms the gradient tile G and accumulates
``dA += scale * G @ B``, ``dB += scale * G.T @ A`` and ``dscale += sum(G * A @ B.T)``.
Inputs in fp16/bf16 are computed and accumulated in fp32; gradients are returned in
the input dtype.

Speed: when the inputs are L2-normalised every logit lies in ``[-scale, scale]``, so
for ``scale <= 40`` in fp32 (tau >= 0.025) ``exp(S)`` itself can neither overflow nor
underflow and no running maximum (not even a fixed shift) is needed. Then one ``exp``
per element serves the row and the column soft-max, and in backward the gradient tile
is that same ``exp`` scaled by ``u_i + v_j`` with ``u_i = g_i exp(-LSE_i)``. Single-set losses (A is B) visit only the
upper-triangle tiles: ``S`` is symmetric, so one tile feeds the statistics of both
its row block and its column block, and ``H = G + G.T`` feeds both ``dZ_I`` and
``dZ_J``. Otherwise an online maximum keeps every ``exp`` finite; both are exact.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = [
    "DEFAULT_TILE",
    "DENSE_BUDGET_BYTES",
    "logsumexp_rows",
    "pairwise_rows",
    "resolve_tile",
]

#: Rows (and columns) per tile when ``chunk_size=None`` and the batch is too big for
#: one tile. 1024 x 1024 fp32 logit tiles (4 MiB) stay in a CPU's L3 cache and were
#: fastest on the 2-core benchmark machine (512 and 256 were 5-30 % slower).
DEFAULT_TILE = int(os.environ.get("TORCH_CONTRASTIVE_TILE", "1024"))

#: ``chunk_size=None`` computes the whole R x C logit matrix as one tile while it
#: needs at most this many bytes (two fp32 buffers); larger batches are tiled.
DENSE_BUDGET_BYTES = int(os.environ.get("TORCH_CONTRASTIVE_DENSE_BUDGET", str(8 * 2**20)))

# Largest 1/tau for which exp(+-scale) and a sum of 2**40 such terms stay normal numbers
# (fp32: exp(40) * 2**40 ~ 2.6e29 < 3.4e38 and exp(-40) ~ 4e-18 > 1.2e-38).
_MAX_FIXED_SCALE = {torch.float32: 40.0, torch.float64: 340.0}


def resolve_tile(chunk_size: int | None, rows: int, cols: int) -> int:
    """Tile edge for a problem of ``rows`` x ``cols`` logits.

    ``chunk_size=None``: one tile when two fp32 ``rows x cols`` buffers fit in
    :data:`DENSE_BUDGET_BYTES`, else :data:`DEFAULT_TILE`. An int forces that tile.
    """
    if chunk_size is not None:
        return max(1, int(chunk_size))
    if 2 * 4 * rows * cols <= DENSE_BUDGET_BYTES:
        return max(rows, cols, 1)
    return DEFAULT_TILE


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _to_compute(a: Tensor, b: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Inputs in the compute dtype (fp32 for fp16/bf16; no copy when already there)."""
    cdtype = _compute_dtype(a.dtype)
    return a.to(cdtype), b.to(cdtype), scale.detach().to(cdtype)


def _blocks(n: int, tile: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, tile):
        yield start, min(start + tile, n)


class _Buffers:
    """Preallocated tile buffers, one per distinct (rows, cols) shape."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self._store: dict[tuple[int, int, int], Tensor] = {}

    def get(self, rows: int, cols: int, slot: int = 0) -> Tensor:
        key = (rows, cols, slot)
        if key not in self._store:
            self._store[key] = torch.empty(rows, cols, dtype=self.dtype, device=self.device)
        return self._store[key]


def _self_positions(
    r0: int, r1: int, c0: int, c1: int, self_offset: int | None, device: torch.device | None = None
) -> tuple[Tensor, Tensor] | None:
    """Local (row, col) indices of self pairs inside tile [r0:r1, c0:c1], or None."""
    if self_offset is None:
        return None
    lo = max(r0, c0 - self_offset)
    hi = min(r1, c1 - self_offset)
    if lo >= hi:
        return None
    rows = torch.arange(lo, hi, device=device)
    return rows - r0, rows + self_offset - c0


def _logits_tile(out: Tensor, a: Tensor, b: Tensor, scale: float) -> Tensor:
    """``out = scale * a @ b.T`` into a preallocated buffer (beta=0: the buffer is not read)."""
    return torch.addmm(out, a, b.t(), beta=0, alpha=scale, out=out)


# ---------------------------------------------------------------------------------
# Row / column log-sum-exp
# ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class _LSEPlan:
    self_offset: int | None
    columns: bool
    symmetric: bool
    tile: int
    # True: |S| <= scale is small enough that exp(S) neither overflows nor underflows,
    # so no shift at all is needed; False: an online maximum keeps every exp finite.
    fixed: bool
    # Distributed column statistics: an object with in-place ``all_sum(t)`` and
    # ``all_max(t)`` over ranks (a distributed.Scope). Each rank then holds only some
    # anchor rows, and the column log-sum-exp is completed across ranks.
    column_comm: Any = None


class _LogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, scale: Tensor, plan: _LSEPlan):  # type: ignore[override]
        a_c, b_c, scale_c = _to_compute(a, b, scale)
        row_lse, col_lse = _lse_forward(a_c, b_c, float(scale_c), plan)
        ctx.plan = plan
        ctx.in_dtypes = (a.dtype, b.dtype)
        ctx.save_for_backward(a_c, b_c, scale_c, row_lse, col_lse if col_lse is not None else row_lse)
        return row_lse, (col_lse if col_lse is not None else row_lse.new_zeros(0))

    @staticmethod
    @once_differentiable
    def backward(ctx, g_row: Tensor, g_col: Tensor):  # type: ignore[override]
        plan: _LSEPlan = ctx.plan
        a_c, b_c, scale_c, row_lse, col_lse = ctx.saved_tensors
        g_row = g_row.to(a_c.dtype)
        g_col_c = g_col.to(a_c.dtype) if plan.columns else None
        if g_col_c is not None and plan.column_comm is not None:
            # Every rank's tiles touch every column: they all need the full column gradient.
            g_col_c = g_col_c.clone()
            plan.column_comm.all_sum(g_col_c)
        ga, gb, gscale = _lse_backward(a_c, b_c, scale_c, row_lse, col_lse if plan.columns else None, g_row, g_col_c, plan)
        ga = ga.to(ctx.in_dtypes[0])
        if plan.symmetric:
            return ga, None, gscale.to(scale_c.dtype), None
        return ga, gb.to(ctx.in_dtypes[1]), gscale, None


def _empty_rows_to_zero(lse: Tensor, total: Tensor) -> Tensor:
    # A row with no candidate at all (a batch of one) has LSE = -inf; report 0 so that
    # it can never turn into NaN downstream (every loss leaves such rows out).
    return torch.where(total > 0, lse, torch.zeros_like(lse))


def _lse_forward(a: Tensor, b: Tensor, scale: float, plan: _LSEPlan) -> tuple[Tensor, Tensor | None]:
    R, C = a.shape[0], b.shape[0]
    dtype, device = a.dtype, a.device
    bufs = _Buffers(dtype, device)
    row_sum = torch.zeros(R, dtype=dtype, device=device)
    col_sum = torch.zeros(C, dtype=dtype, device=device) if plan.columns else None
    T = plan.tile
    if plan.fixed:
        for r0, r1 in _blocks(R, T):
            c_start = r0 if plan.symmetric else 0
            for c0, c1 in _blocks(C, T):
                if c1 <= c_start:
                    continue
                e = _logits_tile(bufs.get(r1 - r0, c1 - c0), a[r0:r1], b[c0:c1], scale).exp_()
                diag = _self_positions(r0, r1, c0, c1, plan.self_offset, device)
                if diag is not None:
                    e[diag] = 0
                row_sum[r0:r1] += e.sum(1)
                if plan.symmetric and c0 != r0:
                    row_sum[c0:c1] += e.sum(0)
                if col_sum is not None:
                    col_sum[c0:c1] += e.sum(0)
        row_lse = _empty_rows_to_zero(row_sum.log(), row_sum)
        if col_sum is not None and plan.column_comm is not None:
            plan.column_comm.all_sum(col_sum)  # no per-rank shift: the sums just add
        col_lse = None if col_sum is None else _empty_rows_to_zero(col_sum.log(), col_sum)
        return row_lse, col_lse

    # Online maximum: exact for any logit range. A masked (self) entry is set to the
    # lowest finite value for the max and zeroed after the exp, so no inf - inf.
    low = torch.finfo(dtype).min
    row_max = torch.full((R,), low, dtype=dtype, device=device)
    col_max = torch.full((C,), low, dtype=dtype, device=device) if col_sum is not None else None
    for r0, r1 in _blocks(R, T):
        c_start = r0 if plan.symmetric else 0
        for c0, c1 in _blocks(C, T):
            if c1 <= c_start:
                continue
            s = _logits_tile(bufs.get(r1 - r0, c1 - c0), a[r0:r1], b[c0:c1], scale)
            diag = _self_positions(r0, r1, c0, c1, plan.self_offset, device)
            if diag is not None:
                s[diag] = low
            _online_update(s, row_max, row_sum, r0, r1, diag, dim=1, work=bufs.get(r1 - r0, c1 - c0, 1))
            if plan.symmetric and c0 != r0:
                _online_update(s, row_max, row_sum, c0, c1, None, dim=0, work=bufs.get(r1 - r0, c1 - c0, 1))
            if col_sum is not None and col_max is not None:
                _online_update(s, col_max, col_sum, c0, c1, None, dim=0, work=bufs.get(r1 - r0, c1 - c0, 1))
    row_lse = _empty_rows_to_zero(row_sum.log() + row_max, row_sum)
    col_lse = None
    if col_sum is not None and col_max is not None:
        if plan.column_comm is not None:
            # Bring every rank's partial sums to the global maximum, then add them.
            global_max = col_max.clone()
            plan.column_comm.all_max(global_max)
            col_sum *= torch.exp(col_max - global_max)
            plan.column_comm.all_sum(col_sum)
            col_max = global_max
        col_lse = _empty_rows_to_zero(col_sum.log() + col_max, col_sum)
    return row_lse, col_lse


def _online_update(
    s: Tensor, run_max: Tensor, run_sum: Tensor, i0: int, i1: int,
    diag: tuple[Tensor, Tensor] | None, dim: int, work: Tensor,
) -> None:
    """Fold one tile into running (max, sum-exp) statistics along ``dim``."""
    tile_max = s.amax(dim)
    new_max = torch.maximum(run_max[i0:i1], tile_max)
    run_sum[i0:i1] *= torch.exp(run_max[i0:i1] - new_max)
    shifted = torch.sub(s, new_max[:, None] if dim == 1 else new_max[None, :], out=work).exp_()
    if diag is not None:
        shifted[diag] = 0
    run_sum[i0:i1] += shifted.sum(dim)
    run_max[i0:i1] = new_max


def _lse_backward(
    a: Tensor, b: Tensor, scale: Tensor, row_lse: Tensor, col_lse: Tensor | None,
    g_row: Tensor, g_col: Tensor | None, plan: _LSEPlan,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``sum_i g_row_i LSE_i (+ sum_j g_col_j colLSE_j)``.

    G_ij = g_row_i softmax_row_ij + g_col_j softmax_col_ij (self pairs zero);
    dA = scale * G @ B, dB = scale * G.T @ A, dscale = sum_i a_i . (G @ B)_i.
    """
    R, C = a.shape[0], b.shape[0]
    dtype, device = a.dtype, a.device
    bufs = _Buffers(dtype, device)
    scale_f = float(scale)
    gb_acc = torch.zeros_like(a)  # G @ B (or H @ Z when symmetric)
    ga_acc = None if plan.symmetric else torch.zeros_like(b)  # G.T @ A
    T = plan.tile
    if plan.fixed:
        # exp(S_ij - LSE_i) = exp(S_ij) * exp(-LSE_i): one exp per element serves rows and columns.
        u = g_row * torch.exp(-row_lse)
        v = u if plan.symmetric else (g_col * torch.exp(-col_lse) if g_col is not None and col_lse is not None else None)
    for r0, r1 in _blocks(R, T):
        c_start = r0 if plan.symmetric else 0
        for c0, c1 in _blocks(C, T):
            if c1 <= c_start:
                continue
            diag = _self_positions(r0, r1, c0, c1, plan.self_offset, device)
            g = bufs.get(r1 - r0, c1 - c0)
            if plan.fixed:
                _logits_tile(g, a[r0:r1], b[c0:c1], scale_f).exp_()
                weight = bufs.get(r1 - r0, c1 - c0, 1)
                if v is not None:
                    torch.add(u[r0:r1, None], v[None, c0:c1], out=weight)
                    g.mul_(weight)
                else:
                    g.mul_(u[r0:r1, None])
            else:
                s = _logits_tile(bufs.get(r1 - r0, c1 - c0, 1), a[r0:r1], b[c0:c1], scale_f)
                torch.sub(s, row_lse[r0:r1, None], out=g).exp_().mul_(g_row[r0:r1, None])
                other = None
                if plan.symmetric:
                    other = (g_row, row_lse)
                elif g_col is not None and col_lse is not None:
                    other = (g_col, col_lse)
                if other is not None:
                    s.sub_(other[1][None, c0:c1]).exp_().mul_(other[0][None, c0:c1])
                    g.add_(s)
            if diag is not None:
                g[diag] = 0
            gb_acc[r0:r1].addmm_(g, b[c0:c1])
            if plan.symmetric:
                if c0 != r0:
                    gb_acc[c0:c1].addmm_(g.t(), a[r0:r1])
            elif ga_acc is not None:
                ga_acc[c0:c1].addmm_(g.t(), a[r0:r1])
    if plan.symmetric:
        # H = G + G.T, so sum_ij G_ij z_i.z_j is half of sum_i z_i.(H Z)_i.
        gscale = torch.linalg.vecdot(gb_acc, a).sum() / 2
        return gb_acc.mul_(scale), gb_acc, gscale
    gscale = torch.linalg.vecdot(gb_acc, a).sum()
    return gb_acc.mul_(scale), ga_acc.mul_(scale), gscale  # type: ignore[union-attr]


def logsumexp_rows(
    anchors: Tensor,
    candidates: Tensor,
    scale: Tensor,
    *,
    self_offset: int | None,
    columns: bool = False,
    bounded: bool = False,
    chunk_size: int | None = None,
    column_comm: Any = None,
) -> tuple[Tensor, Tensor | None]:
    """Row (and column) log-sum-exp of ``S = scale * anchors @ candidates.T``.

    Args:
        anchors: (R, D) tensor, any float dtype.
        candidates: (C, D) tensor. Pass the *same tensor object* as ``anchors`` with
            ``self_offset=0`` for a single-set loss: the symmetric path then visits
            only the upper-triangle tiles.
        scale: 0-dim tensor, ``1 / temperature`` (gradients flow to it).
        self_offset: anchor ``i`` is candidate ``i + self_offset``; that entry is
            left out of row ``i``. ``None``: nothing is left out.
        columns: also return ``log sum_i exp(S_ij)`` for every candidate (requires
            ``self_offset=None``).
        bounded: rows of both inputs have norm <= 1, so ``|S| <= scale`` and, for small
            enough ``scale``, plain ``exp(S)`` replaces the online maximum.
        chunk_size: tile edge (see :func:`resolve_tile`).
        column_comm: for ``columns=True`` in distributed training, an object with in-place
            ``all_sum``/``all_max`` over ranks: each rank passes its own anchor rows and
            all candidates, and gets the *global* column statistic (an O(C) all-reduce
            forward, one more for the column gradient backward).

    Returns:
        ``(row_lse, col_lse)``: (R,) and (C,) or None, fp32 for fp16/bf16 inputs
        (fp64 for fp64). A row with no candidate at all gets 0.

    Memory: O((R + C) * D) for the fp32 copies plus two tile buffers; never R x C
    (unless one tile covers everything).
    """
    if columns and self_offset is not None:
        raise ValueError("columns=True needs self_offset=None (two-set losses only)")
    R, C = anchors.shape[0], candidates.shape[0]
    symmetric = anchors is candidates and self_offset == 0 and not columns
    cdtype = _compute_dtype(anchors.dtype)
    scale_value = float(scale.detach())
    fixed = bounded and scale_value <= _MAX_FIXED_SCALE[cdtype]
    plan = _LSEPlan(self_offset, columns, symmetric, resolve_tile(chunk_size, R, C), fixed, column_comm if columns else None)
    row_lse, col_lse = _LogSumExp.apply(anchors, candidates, scale, plan)
    return row_lse, (col_lse if columns else None)


# ---------------------------------------------------------------------------------
# Kernels that need the positive mask inside each tile
# ---------------------------------------------------------------------------------
class _PairKernel:
    """Per-positive-pair NT-Xent (pytorch-metric-learning convention, seed 004).

    Pass 1: ``L_i = log sum_{n in N(i)} exp(S_in)`` over the negatives of row i.
    Pass 2: ``out_i = sum_{p in P(i)} softplus(L_i - S_ip)`` (= ``-log(e^S_ip /
    (e^S_ip + sum_n e^S_in))``) and ``w_i = sum_p sigmoid(L_i - S_ip)`` for backward.
    Rows without negatives contribute exactly 0.
    """

    passes = 2
    n_outputs = 1

    def __init__(self, rows: int, dtype: torch.dtype, device: torch.device) -> None:
        low = torch.finfo(dtype).min
        self.low = low
        self.neg_max = torch.full((rows,), low, dtype=dtype, device=device)
        self.neg_sum = torch.zeros(rows, dtype=dtype, device=device)
        self.out = torch.zeros(rows, dtype=dtype, device=device)
        self.weight = torch.zeros(rows, dtype=dtype, device=device)

    def visit(self, p: int, s: Tensor, pos: Tensor, neg: Tensor, r0: int, r1: int) -> None:
        if p == 0:
            masked = s.masked_fill(~neg, self.low)
            new_max = torch.maximum(self.neg_max[r0:r1], masked.amax(1))
            self.neg_sum[r0:r1] *= torch.exp(self.neg_max[r0:r1] - new_max)
            self.neg_sum[r0:r1] += torch.where(neg, torch.exp(masked - new_max[:, None]), 0.0).sum(1)
            self.neg_max[r0:r1] = new_max
            return
        has_neg = self.neg_sum[r0:r1] > 0
        lse = self.neg_lse_rows(r0, r1)
        diff = lse[:, None] - s
        term = torch.where(pos, torch.nn.functional.softplus(diff), 0.0).sum(1)
        weight = torch.where(pos, torch.sigmoid(diff), 0.0).sum(1)
        self.out[r0:r1] += torch.where(has_neg, term, 0.0)
        self.weight[r0:r1] += torch.where(has_neg, weight, 0.0)

    def neg_lse_rows(self, r0: int, r1: int) -> Tensor:
        s = self.neg_sum[r0:r1]
        return torch.where(s > 0, s.log() + self.neg_max[r0:r1], torch.zeros_like(s))

    def outputs(self) -> tuple[Tensor, ...]:
        return (self.out,)

    def saved(self) -> tuple[Tensor, ...]:
        return (self.neg_lse_rows(0, self.neg_sum.shape[0]), self.weight, (self.neg_sum > 0))

    @staticmethod
    def grad_tile(s: Tensor, pos: Tensor, neg: Tensor, r0: int, r1: int, saved: tuple[Tensor, ...], grads: tuple[Tensor, ...]) -> Tensor:
        neg_lse, weight, has_neg = (t[r0:r1] for t in saved)
        g = grads[0][r0:r1] * has_neg
        # where(), not products with masks: exp() of a positive entry may overflow (inf * 0 is NaN),
        # and bool-to-float mask products cost a copy each.
        d_neg = torch.where(neg, torch.exp(s - neg_lse[:, None]) * weight[:, None], 0.0)
        return torch.where(pos, -torch.sigmoid(neg_lse[:, None] - s), d_neg).mul_(g[:, None])


class _BinaryKernel:
    """NT-BXent (seed 000): ``out = (sum_pos softplus(-S), sum_neg softplus(S))`` per row.

    Computed with softplus (= -log-sigmoid), never ``log(sigmoid(.))``, so it stays
    exact at tau = 0.01 where the seed's float32 code saturates.
    """

    passes = 1
    n_outputs = 2

    def __init__(self, rows: int, dtype: torch.dtype, device: torch.device) -> None:
        self.pos = torch.zeros(rows, dtype=dtype, device=device)
        self.neg = torch.zeros(rows, dtype=dtype, device=device)

    def visit(self, p: int, s: Tensor, pos: Tensor, neg: Tensor, r0: int, r1: int) -> None:
        # Two softplus calls on purpose: softplus(-s) = softplus(s) - s cancels catastrophically
        # for large s (the very regime where the seed's sigmoid-then-log code fails).
        self.pos[r0:r1] += torch.where(pos, torch.nn.functional.softplus(-s), 0.0).sum(1)
        self.neg[r0:r1] += torch.where(neg, torch.nn.functional.softplus(s), 0.0).sum(1)

    def outputs(self) -> tuple[Tensor, ...]:
        return (self.pos, self.neg)

    def saved(self) -> tuple[Tensor, ...]:
        return ()

    @staticmethod
    def grad_tile(s: Tensor, pos: Tensor, neg: Tensor, r0: int, r1: int, saved: tuple[Tensor, ...], grads: tuple[Tensor, ...]) -> Tensor:
        g_pos, g_neg = grads[0][r0:r1, None], grads[1][r0:r1, None]
        # sigmoid(-s), not 1 - sigmoid(s), which rounds tiny gradients to 0 for large s.
        return torch.where(pos, -torch.sigmoid(-s) * g_pos, torch.where(neg, torch.sigmoid(s) * g_neg, 0.0))


_KERNELS: dict[str, Any] = {"pair_softplus": _PairKernel, "binary": _BinaryKernel}


@dataclass(frozen=True)
class _PairwisePlan:
    kernel: str
    positives: object  # Positives (kept untyped here to avoid an import cycle)
    tile: int


def _masks(positives, r0: int, r1: int, c0: int, c1: int) -> tuple[Tensor, Tensor]:  # type: ignore[no-untyped-def]
    """(positive, negative) float masks of a tile; the self pair is in neither."""
    pos = positives.tile(r0, r1, c0, c1)
    neg = ~pos
    diag = _self_positions(r0, r1, c0, c1, positives.self_offset, pos.device)
    if diag is not None:
        neg[diag] = False
    return pos, neg


class _Pairwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, scale: Tensor, plan: _PairwisePlan):  # type: ignore[override]
        a_c, b_c, scale_c = _to_compute(a, b, scale)
        cdtype = a_c.dtype
        kernel = _KERNELS[plan.kernel](a.shape[0], cdtype, a.device)
        bufs = _Buffers(cdtype, a.device)
        for p in range(kernel.passes):
            for r0, r1 in _blocks(a.shape[0], plan.tile):
                for c0, c1 in _blocks(b.shape[0], plan.tile):
                    s = _logits_tile(bufs.get(r1 - r0, c1 - c0), a_c[r0:r1], b_c[c0:c1], float(scale_c))
                    pos, neg = _masks(plan.positives, r0, r1, c0, c1)
                    kernel.visit(p, s, pos, neg, r0, r1)
        ctx.plan = plan
        ctx.in_dtypes = (a.dtype, b.dtype)
        ctx.save_for_backward(a_c, b_c, scale_c, *kernel.saved())
        return kernel.outputs()

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: Tensor):  # type: ignore[override]
        plan: _PairwisePlan = ctx.plan
        a, b, scale, *saved = ctx.saved_tensors
        grads = tuple(g.to(a.dtype) for g in grads)
        kernel = _KERNELS[plan.kernel]
        gb = torch.zeros_like(a)
        ga = torch.zeros_like(b)
        bufs = _Buffers(a.dtype, a.device)
        for r0, r1 in _blocks(a.shape[0], plan.tile):
            for c0, c1 in _blocks(b.shape[0], plan.tile):
                s = _logits_tile(bufs.get(r1 - r0, c1 - c0), a[r0:r1], b[c0:c1], float(scale))
                pos, neg = _masks(plan.positives, r0, r1, c0, c1)
                g = kernel.grad_tile(s, pos, neg, r0, r1, tuple(saved), grads)
                gb[r0:r1].addmm_(g, b[c0:c1])
                ga[c0:c1].addmm_(g.t(), a[r0:r1])
        gscale = torch.linalg.vecdot(gb, a).sum()
        return gb.mul_(scale).to(ctx.in_dtypes[0]), ga.mul_(scale).to(ctx.in_dtypes[1]), gscale, None


def pairwise_rows(
    anchors: Tensor,
    candidates: Tensor,
    scale: Tensor,
    positives: object,
    *,
    kernel: str,
    chunk_size: int | None = None,
) -> tuple[Tensor, ...]:
    """Per-row statistics that need the positive mask in every tile.

    Args:
        anchors: (R, D); candidates: (C, D); scale: 0-dim ``1 / temperature``.
        positives: a :class:`~torch_contrastive.positives.Positives` for R x C.
        kernel: ``"pair_softplus"`` (returns ``(sum_p softplus(L_i - S_ip),)``, the
            pytorch-metric-learning NT-Xent numerators) or ``"binary"`` (returns
            ``(sum_pos softplus(-S_ij), sum_neg softplus(S_ij))``, NT-BXent).
        chunk_size: tile edge (see :func:`resolve_tile`).

    Memory: O((R + C) * D) plus a few tile-sized temporaries.
    """
    plan = _PairwisePlan(kernel, positives, resolve_tile(chunk_size, anchors.shape[0], candidates.shape[0]))
    return tuple(_Pairwise.apply(anchors, candidates, scale, plan))
