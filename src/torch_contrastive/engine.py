"""The tiled autograd engine: contrastive statistics in O(N * tile) extra memory.

Every loss of the package reduces to per-anchor statistics of the logit matrix
``S = scale * A @ B.T`` (R anchors, C candidates), which this module computes
block by block without ever holding S (README, "Tiled engine"):

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
the input dtype. ``scale`` stays a tensor throughout (it multiplies the anchors once,
O(R * D)), so no value is ever read back to the host.

Two log-sum-exp algorithms, chosen by the caller from a host-side bound on ``scale``:

* **fixed** -- when the inputs are L2-normalised every logit lies in ``[-scale, scale]``,
  so for ``scale <= 40`` in fp32 (tau >= 0.025) ``exp(S)`` itself can neither overflow
  nor underflow and no running maximum (not even a fixed shift) is needed. Then one
  ``exp`` per element serves the row and the column soft-max, and in backward the
  gradient tile is that same ``exp`` scaled by ``u_i + v_j`` with
  ``u_i = g_i exp(-LSE_i)``.
* **online maximum** -- exact for any logit range (raw dot products, tau < 0.025, or a
  scale whose value is not known on the host).

Single-set losses (``symmetric=True``) visit only the upper-triangle tiles: ``S`` is
symmetric, so one tile feeds the statistics of both its row block and its column
block, and ``H = G + G.T`` feeds both ``dZ_I`` and ``dZ_J``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

if TYPE_CHECKING:
    from .positives import Positives

__all__ = [
    "DEFAULT_TILE",
    "DENSE_BUDGET_BYTES",
    "compute_dtype",
    "fixed_scale_applies",
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


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the engine computes in: fp64 stays fp64, everything else is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fixed_scale_applies(bounded: bool, scale_bound: float | None, dtype: torch.dtype) -> bool:
    """Whether the fixed (no-shift) algorithm is exact.

    Args:
        bounded: every input row has norm <= 1 (L2-normalised), so ``|S| <= scale``.
        scale_bound: a host-side upper bound of ``scale`` (``None``: unknown, e.g. a
            learnable temperature under ``validate=False``, which never reads it).
        dtype: the input dtype.
    """
    return bounded and scale_bound is not None and scale_bound <= _MAX_FIXED_SCALE[compute_dtype(dtype)]


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


Scale = Tensor | float


def _to_compute(a: Tensor, b: Tensor | None, scale: Scale) -> tuple[Tensor, Tensor, Scale]:
    """Inputs in the compute dtype (fp32 for fp16/bf16; no copy when already there).

    ``b=None`` (a single set) returns ``a`` itself as the candidates. A float scale stays
    a Python float: turning it into a device tensor would be a host-to-device copy on
    every call.
    """
    cdtype = compute_dtype(a.dtype)
    if isinstance(scale, Tensor):
        scale = scale.detach().to(device=a.device, dtype=cdtype)
    a_c = a.to(cdtype)
    return a_c, (a_c if b is None else b.to(cdtype)), scale


def _save(ctx: Any, scale: Scale, a: Tensor, b: Tensor, *tensors: Tensor) -> None:
    """Save tensors for backward: ``b`` only when it is not ``a`` (a single set), a float
    scale on ``ctx`` (it is not a tensor)."""
    ctx.float_scale = None if isinstance(scale, Tensor) else scale
    ctx.single = b is a
    ctx.save_for_backward(a, *(() if ctx.single else (b,)), *tensors, *((scale,) if isinstance(scale, Tensor) else ()))


def _saved(ctx: Any) -> tuple[Tensor, Tensor, list[Tensor], Scale]:
    """``(a, b, other saved tensors, scale)`` as given to :func:`_save`."""
    saved = list(ctx.saved_tensors)
    scale: Scale = ctx.float_scale if ctx.float_scale is not None else saved.pop()
    a = saved.pop(0)
    b = a if ctx.single else saved.pop(0)
    return a, b, saved, scale


def _tiles(rows: int, cols: int, tile: int, symmetric: bool) -> Iterator[tuple[int, int, int, int]]:
    """(r0, r1, c0, c1) of every tile to visit; only the upper triangle when symmetric."""
    for r0 in range(0, rows, tile):
        r1 = min(r0 + tile, rows)
        for c0 in range(r0 if symmetric else 0, cols, tile):
            yield r0, r1, c0, min(c0 + tile, cols)


class _Buffers:
    """Preallocated tile buffers, one per distinct (rows, cols, slot)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self._store: dict[tuple[int, int, int], Tensor] = {}

    def get(self, rows: int, cols: int, slot: int = 0) -> Tensor:
        key = (rows, cols, slot)
        if key not in self._store:
            self._store[key] = torch.empty(rows, cols, dtype=self.dtype, device=self.device)
        return self._store[key]


def _self_diagonal(tile: Tensor, r0: int, c0: int, self_offset: int | None) -> Tensor | None:
    """Strided view of the self pairs inside a tile (anchor i is candidate i + self_offset).

    A view, not index tensors: filling it is one strided write, and no index tensor is
    built per tile. ``None`` when the tile holds no self pair.
    """
    if self_offset is None:
        return None
    k = r0 + self_offset - c0
    if k >= tile.shape[1] or -k >= tile.shape[0]:
        return None
    return tile.diagonal(k)


def _logits_tile(out: Tensor, a_scaled: Tensor, b: Tensor) -> Tensor:
    """``out = a_scaled @ b.T`` into a preallocated buffer."""
    return torch.mm(a_scaled, b.t(), out=out)


def _log_or_zero(log_sum: Tensor, total: Tensor) -> Tensor:
    # A row with no candidate at all (a batch of one) has LSE = -inf; report 0 so that
    # it can never turn into NaN downstream (every loss leaves such rows out).
    return torch.where(total > 0, log_sum, torch.zeros_like(log_sum))


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
    def forward(ctx, a: Tensor, b: Tensor | None, scale: Scale, plan: _LSEPlan):  # type: ignore[override]
        # b is None for a single set (the candidates are the anchors): passing the same
        # tensor twice would be a duplicate input, which torch.compile cannot trace.
        a_c, b_c, scale_c = _to_compute(a, b, scale)
        forward = _lse_forward_fixed if plan.fixed else _lse_forward_online
        row_lse, col_lse = forward(a_c * scale_c, b_c, plan)
        ctx.plan = plan
        ctx.in_dtypes = (a.dtype, a.dtype if b is None else b.dtype)
        _save(ctx, scale_c, a_c, b_c, row_lse, col_lse if col_lse is not None else row_lse)
        return row_lse, (col_lse if col_lse is not None else row_lse.new_zeros(0))

    @staticmethod
    @once_differentiable
    def backward(ctx, g_row: Tensor, g_col: Tensor):  # type: ignore[override]
        plan: _LSEPlan = ctx.plan
        a_c, b_c, (row_lse, col_lse), scale_c = _saved(ctx)
        g_row = g_row.to(a_c.dtype)
        g_col_c = g_col.to(a_c.dtype) if plan.columns else None
        if g_col_c is not None and plan.column_comm is not None:
            # Every rank's tiles touch every column: they all need the full column gradient.
            g_col_c = g_col_c.clone()
            plan.column_comm.all_sum(g_col_c)
        # The two directions' weights: row i's soft-max enters with g_row_i, column j's
        # with g_col_j; a single set's columns are its rows.
        if plan.symmetric:
            col = (g_row, row_lse)
        elif g_col_c is not None:
            col = (g_col_c, col_lse)
        else:
            col = None
        backward = _lse_backward_fixed if plan.fixed else _lse_backward_online
        gb_acc, ga_acc = backward(a_c * scale_c, a_c, b_c, (g_row, row_lse), col, plan)
        return _finish_gradients(ctx, a_c, scale_c, gb_acc, ga_acc)


def _finish_gradients(ctx: Any, a: Tensor, scale: Scale, gb_acc: Tensor, ga_acc: Tensor | None):  # type: ignore[no-untyped-def]
    """From ``G @ B`` and ``G.T @ A`` to the gradients of (A, B, scale, plan).

    ``dscale = sum_ij G_ij a_i . b_j = sum_i a_i . (G @ B)_i``; in the symmetric case
    (``ga_acc`` is None) the accumulator holds ``H @ Z`` with ``H = G + G.T``, which
    counts every pair twice. For a single set (B is A) both accumulators are A's
    gradient. A float scale gets no gradient.
    """
    gscale = None
    if isinstance(scale, Tensor):
        gscale = torch.linalg.vecdot(gb_acc, a).sum()
        if ga_acc is None:
            gscale = gscale / 2
    if ctx.single and ga_acc is not None:
        gb_acc.add_(ga_acc)
        ga_acc = None
    ga = gb_acc.mul_(scale).to(ctx.in_dtypes[0])
    gb = None if ga_acc is None else ga_acc.mul_(scale).to(ctx.in_dtypes[1])
    return ga, gb, gscale, None


def _lse_forward_fixed(a_s: Tensor, b: Tensor, plan: _LSEPlan) -> tuple[Tensor, Tensor | None]:
    """Plain sums of ``exp(S)`` (no shift): exact when ``|S| <= 40`` (fp32)."""
    R, C = a_s.shape[0], b.shape[0]
    bufs = _Buffers(a_s.dtype, a_s.device)
    row_sum = a_s.new_zeros(R)
    col_sum = a_s.new_zeros(C) if plan.columns else None
    for r0, r1, c0, c1 in _tiles(R, C, plan.tile, plan.symmetric):
        e = _logits_tile(bufs.get(r1 - r0, c1 - c0), a_s[r0:r1], b[c0:c1]).exp_()
        diag = _self_diagonal(e, r0, c0, plan.self_offset)
        if diag is not None:
            diag.zero_()
        row_sum[r0:r1] += e.sum(1)
        if plan.symmetric and c0 != r0:
            row_sum[c0:c1] += e.sum(0)
        if col_sum is not None:
            col_sum[c0:c1] += e.sum(0)
    row_lse = _log_or_zero(row_sum.log(), row_sum)
    if col_sum is None:
        return row_lse, None
    if plan.column_comm is not None:
        plan.column_comm.all_sum(col_sum)  # no per-rank shift: the sums just add
    return row_lse, _log_or_zero(col_sum.log(), col_sum)


def _lse_forward_online(a_s: Tensor, b: Tensor, plan: _LSEPlan) -> tuple[Tensor, Tensor | None]:
    """Running (maximum, shifted sum) per row and column: exact for any logit range.

    A self entry is set to the lowest finite value before the maximum is taken and
    zeroed after the exp, so no ``inf - inf`` can arise.
    """
    R, C = a_s.shape[0], b.shape[0]
    dtype = a_s.dtype
    bufs = _Buffers(dtype, a_s.device)
    low = torch.finfo(dtype).min
    row_max, row_sum = a_s.new_full((R,), low), a_s.new_zeros(R)
    col_max, col_sum = (a_s.new_full((C,), low), a_s.new_zeros(C)) if plan.columns else (None, None)
    for r0, r1, c0, c1 in _tiles(R, C, plan.tile, plan.symmetric):
        s = _logits_tile(bufs.get(r1 - r0, c1 - c0), a_s[r0:r1], b[c0:c1])
        diag = _self_diagonal(s, r0, c0, plan.self_offset)
        if diag is not None:
            diag.fill_(low)
        work = bufs.get(r1 - r0, c1 - c0, 1)
        _online_update(s, row_max, row_sum, r0, r1, c0, plan.self_offset, dim=1, work=work)
        if plan.symmetric and c0 != r0:
            _online_update(s, row_max, row_sum, c0, c1, r0, None, dim=0, work=work)
        if col_max is not None and col_sum is not None:
            _online_update(s, col_max, col_sum, c0, c1, r0, None, dim=0, work=work)
    row_lse = _log_or_zero(row_sum.log() + row_max, row_sum)
    if col_max is None or col_sum is None:
        return row_lse, None
    if plan.column_comm is not None:
        # Bring every rank's partial sums to the global maximum, then add them.
        global_max = col_max.clone()
        plan.column_comm.all_max(global_max)
        col_sum *= torch.exp(col_max - global_max)
        plan.column_comm.all_sum(col_sum)
        col_max = global_max
    return row_lse, _log_or_zero(col_sum.log() + col_max, col_sum)


def _online_update(
    s: Tensor, run_max: Tensor, run_sum: Tensor, i0: int, i1: int, other0: int,
    self_offset: int | None, dim: int, work: Tensor,
) -> None:
    """Fold one tile into running (max, sum-exp) statistics along ``dim``.

    ``i0:i1`` are the statistics' indices (rows for ``dim=1``, columns for ``dim=0``);
    ``other0`` is the first index of the other axis; ``self_offset`` (rows only) marks
    self entries whose exp must be zeroed.
    """
    tile_max = s.amax(dim)
    new_max = torch.maximum(run_max[i0:i1], tile_max)
    run_sum[i0:i1] *= torch.exp(run_max[i0:i1] - new_max)
    shifted = torch.sub(s, new_max[:, None] if dim == 1 else new_max[None, :], out=work).exp_()
    diag = _self_diagonal(shifted, i0, other0, self_offset)
    if diag is not None:
        diag.zero_()
    run_sum[i0:i1] += shifted.sum(dim)
    run_max[i0:i1] = new_max


_Direction = tuple[Tensor, Tensor]  # (gradient weight per index, its log-sum-exp)


def _lse_backward_fixed(
    a_s: Tensor, a: Tensor, b: Tensor, row: _Direction, col: _Direction | None, plan: _LSEPlan,
) -> tuple[Tensor, Tensor | None]:
    """``G @ B`` and ``G.T @ A`` with ``G_ij = u_i e^{S_ij} + v_j e^{S_ij}``.

    ``exp(S_ij - LSE_i) = exp(S_ij) * exp(-LSE_i)``: one exp per element serves both
    directions.
    """
    R, C = a.shape[0], b.shape[0]
    bufs = _Buffers(a.dtype, a.device)
    gb_acc = torch.zeros_like(a)  # G @ B (or H @ Z when symmetric)
    ga_acc = None if plan.symmetric else torch.zeros_like(b)  # G.T @ A
    u = row[0] * torch.exp(-row[1])
    v = None if col is None else col[0] * torch.exp(-col[1])
    for r0, r1, c0, c1 in _tiles(R, C, plan.tile, plan.symmetric):
        g = _logits_tile(bufs.get(r1 - r0, c1 - c0), a_s[r0:r1], b[c0:c1]).exp_()
        if v is not None:
            g.mul_(torch.add(u[r0:r1, None], v[None, c0:c1], out=bufs.get(r1 - r0, c1 - c0, 1)))
        else:
            g.mul_(u[r0:r1, None])
        _accumulate(g, a, b, gb_acc, ga_acc, r0, r1, c0, c1, plan)
    return gb_acc, ga_acc


def _lse_backward_online(
    a_s: Tensor, a: Tensor, b: Tensor, row: _Direction, col: _Direction | None, plan: _LSEPlan,
) -> tuple[Tensor, Tensor | None]:
    """``G @ B`` and ``G.T @ A`` with ``G_ij = g_i e^{S_ij - LSE_i} + h_j e^{S_ij - LSE'_j}``."""
    R, C = a.shape[0], b.shape[0]
    bufs = _Buffers(a.dtype, a.device)
    gb_acc = torch.zeros_like(a)
    ga_acc = None if plan.symmetric else torch.zeros_like(b)
    g_row, row_lse = row
    for r0, r1, c0, c1 in _tiles(R, C, plan.tile, plan.symmetric):
        s = _logits_tile(bufs.get(r1 - r0, c1 - c0, 1), a_s[r0:r1], b[c0:c1])
        g = torch.sub(s, row_lse[r0:r1, None], out=bufs.get(r1 - r0, c1 - c0)).exp_().mul_(g_row[r0:r1, None])
        if col is not None:
            g.add_(s.sub_(col[1][None, c0:c1]).exp_().mul_(col[0][None, c0:c1]))
        _accumulate(g, a, b, gb_acc, ga_acc, r0, r1, c0, c1, plan)
    return gb_acc, ga_acc


def _accumulate(g: Tensor, a: Tensor, b: Tensor, gb_acc: Tensor, ga_acc: Tensor | None,
                r0: int, r1: int, c0: int, c1: int, plan: _LSEPlan) -> None:
    """Zero the self pairs of a gradient tile and add it into both accumulators."""
    diag = _self_diagonal(g, r0, c0, plan.self_offset)
    if diag is not None:
        diag.zero_()
    gb_acc[r0:r1].addmm_(g, b[c0:c1])
    if plan.symmetric:
        if c0 != r0:
            gb_acc[c0:c1].addmm_(g.t(), a[r0:r1])
    elif ga_acc is not None:
        ga_acc[c0:c1].addmm_(g.t(), a[r0:r1])


def logsumexp_rows(
    anchors: Tensor,
    candidates: Tensor,
    scale: Scale,
    *,
    self_offset: int | None,
    symmetric: bool = False,
    columns: bool = False,
    fixed: bool = False,
    chunk_size: int | None = None,
    column_comm: Any = None,
) -> tuple[Tensor, Tensor | None]:
    """Row (and column) log-sum-exp of ``S = scale * anchors @ candidates.T``.

    Args:
        anchors: (R, D) tensor, any float dtype.
        candidates: (C, D) tensor.
        scale: ``1 / temperature``: a float, or a 0-dim tensor (gradients flow to it;
            its value is never read on the host).
        self_offset: anchor ``i`` is candidate ``i + self_offset``; that entry is
            left out of row ``i``. ``None``: nothing is left out.
        symmetric: ``candidates`` are the anchors themselves (single-set losses on one
            process, ``self_offset=0``): only the upper-triangle tiles are visited and
            no gradient is returned for ``candidates`` (it is ``anchors``' gradient).
        columns: also return ``log sum_i exp(S_ij)`` for every candidate (requires
            ``self_offset=None``).
        fixed: use plain ``exp(S)`` without a shift; only exact when every row has
            norm <= 1 and the scale is small (see :func:`fixed_scale_applies`).
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
    if symmetric and (self_offset != 0 or columns or anchors.shape != candidates.shape):
        raise ValueError("symmetric=True needs candidates equal to anchors, self_offset=0 and columns=False")
    R, C = anchors.shape[0], candidates.shape[0]
    plan = _LSEPlan(self_offset, columns, symmetric, resolve_tile(chunk_size, R, C), fixed, column_comm if columns else None)
    # The same tensor twice becomes "no separate candidates" (see _LogSumExp.forward).
    row_lse, col_lse = _LogSumExp.apply(anchors, None if candidates is anchors else candidates, scale, plan)
    return row_lse, (col_lse if columns else None)


# ---------------------------------------------------------------------------------
# Kernels that need the positive mask inside each tile
# ---------------------------------------------------------------------------------
class _PairKernel:
    """Per-positive-pair NT-Xent (pytorch-metric-learning convention, seed 004).

    Pass 1: ``L_i = log sum_{n in N(i)} exp(S_in)`` over the negatives of row i.
    Pass 2: ``out_i = sum_{p in P(i)} softplus(L_i - S_ip)`` (= ``-log(e^S_ip /
    (e^S_ip + sum_n e^S_in))``) and ``w_i = sum_p sigmoid(L_i - S_ip)`` for backward.
    Rows without negatives contribute exactly 0 (and get no gradient).
    """

    passes = 2

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
    positives: Positives
    tile: int


def _masks(positives: Positives, r0: int, r1: int, c0: int, c1: int) -> tuple[Tensor, Tensor]:
    """(positive, negative) bool masks of a tile; the self pair is in neither."""
    pos = positives.tile(r0, r1, c0, c1)
    neg = ~pos
    diag = _self_diagonal(neg, r0, c0, positives.self_offset)
    if diag is not None:
        diag.fill_(False)
    return pos, neg


class _Pairwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor | None, scale: Scale, plan: _PairwisePlan):  # type: ignore[override]
        a_c, b_c, scale_c = _to_compute(a, b, scale)
        a_s = a_c * scale_c
        kernel = _KERNELS[plan.kernel](a.shape[0], a_c.dtype, a.device)
        bufs = _Buffers(a_c.dtype, a.device)
        for p in range(kernel.passes):
            for r0, r1, c0, c1 in _tiles(a.shape[0], b_c.shape[0], plan.tile, False):
                s = _logits_tile(bufs.get(r1 - r0, c1 - c0), a_s[r0:r1], b_c[c0:c1])
                pos, neg = _masks(plan.positives, r0, r1, c0, c1)
                kernel.visit(p, s, pos, neg, r0, r1)
        ctx.plan = plan
        ctx.in_dtypes = (a.dtype, a.dtype if b is None else b.dtype)
        _save(ctx, scale_c, a_c, b_c, *kernel.saved())
        return kernel.outputs()

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: Tensor):  # type: ignore[override]
        plan: _PairwisePlan = ctx.plan
        a, b, saved, scale = _saved(ctx)
        grads = tuple(g.to(a.dtype) for g in grads)
        kernel = _KERNELS[plan.kernel]
        a_s = a * scale
        gb = torch.zeros_like(a)
        ga = torch.zeros_like(b)
        bufs = _Buffers(a.dtype, a.device)
        for r0, r1, c0, c1 in _tiles(a.shape[0], b.shape[0], plan.tile, False):
            s = _logits_tile(bufs.get(r1 - r0, c1 - c0), a_s[r0:r1], b[c0:c1])
            pos, neg = _masks(plan.positives, r0, r1, c0, c1)
            g = kernel.grad_tile(s, pos, neg, r0, r1, tuple(saved), grads)
            gb[r0:r1].addmm_(g, b[c0:c1])
            ga[c0:c1].addmm_(g.t(), a[r0:r1])
        return _finish_gradients(ctx, a, scale, gb, ga)


def pairwise_rows(
    anchors: Tensor,
    candidates: Tensor,
    scale: Scale,
    positives: Positives,
    *,
    kernel: str,
    chunk_size: int | None = None,
) -> tuple[Tensor, ...]:
    """Per-row statistics that need the positive mask in every tile.

    Args:
        anchors: (R, D); candidates: (C, D); scale: ``1 / temperature``, float or 0-dim tensor.
        positives: a :class:`~torch_contrastive.positives.Positives` for R x C.
        kernel: ``"pair_softplus"`` (returns ``(sum_p softplus(L_i - S_ip),)``, the
            pytorch-metric-learning NT-Xent numerators) or ``"binary"`` (returns
            ``(sum_pos softplus(-S_ij), sum_neg softplus(S_ij))``, NT-BXent).
        chunk_size: tile edge (see :func:`resolve_tile`).

    Memory: O((R + C) * D) plus a few tile-sized temporaries.
    """
    plan = _PairwisePlan(kernel, positives, resolve_tile(chunk_size, anchors.shape[0], candidates.shape[0]))
    return tuple(_Pairwise.apply(anchors, None if candidates is anchors else candidates, scale, plan))
