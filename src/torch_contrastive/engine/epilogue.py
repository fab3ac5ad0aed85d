"""cuBLAS GEMMs with Triton epilogues as a strategy: :data:`EPILOGUE` (``backend="epilogue"``), the CUDA policy's
measured default for bf16 soft-max terms from 8,192 rows (:mod:`.policy`).

The tile loops are the torch backend's (:func:`~.tiling.sweep`, :func:`~.tiling.gradient_sweep`);
what happens between the GEMMs is one kernel each way:

* forward: ``torch.mm`` writes a logit tile in fp32 (half rows multiplied as given on tensor
  cores, ``out_dtype=torch.float32``), and :mod:`.triton_backend.epilogue_sums` reads it once for
  its rows' and its columns' exp-sums (one ``exp`` per entry in the bounded regime), with
  :mod:`.triton_backend.fold_partials` adding the columns' partials up in order;
* backward: the tile is recomputed -- or, when the whole problem is one tile, kept from forward --
  and :mod:`.triton_backend.epilogue_grad` reads it once and writes the gradient tile once in the
  GEMM operand dtype, which ``torch.mm`` multiplies into ``G @ B`` and ``G.T @ A``.

Counted on the GPU plan (``bench --traffic``), a bf16 call moves about 6 fp32 passes over the
logits where the torch backend's elementwise ops move 13 to 47 (docs/gpu.md). The same
semantics as the other backends: both regimes, the single-set triangle, self pairs, exclusions
by ids, a partner, a guide or diagonals, distributed column statistics, a queue's constant
columns; positives through ``Positives.aggregate``. No atomics: the same result on every run.
fp16 inputs are left to the other backends (their gradient tiles need a tile-wide rescale).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from ..positives import Exclusion, PartnerPositives
from .driver import Gradients, Operands, Saved
from .left_out import Direction, log_total
from .pairwise import PairExecutor
from .problem import PairTerms, SigmoidPairs, Softmax
from .products import KernelOperands, Products, mm32
from .sigmoid import SigmoidExecutor
from .softmax import SoftmaxExecutor, Statistics
from .softmax_tiles import complete_columns, fixed_lse
from .strategy import Strategy
from .tiling import Buffers, gradient_sweep, sweep
from .triton_executors import TRITON, kernels, sigmoid_keys

if TYPE_CHECKING:
    from .planner import Target
    from .plans import PairPlan, SigmoidPlan, SoftmaxPlan
    from .problem import Problem

__all__ = ["EPILOGUE", "PAIRS", "SIGMOID", "SOFTMAX", "EpilogueKernels", "EpilogueProducts", "GradTiles", "sigmoid_kernel_keys"]


class GradTiles(NamedTuple):
    """One gradient tile as the GEMMs read it: the row product's (``G diag(fy)``), its rounding
    remainder (a learnable scale's half rows; else None) and the column product's (``diag(fz) G``;
    the row tile itself when no factor tells them apart)."""

    rows: Tensor
    low: Tensor | None
    cols: Tensor

    @staticmethod
    def of(written: tuple[Tensor, Tensor | None, Tensor | None]) -> GradTiles:
        """The tiles :meth:`EpilogueProducts.gradient_tiles` gave, once a kernel has written them."""
        rows, low, cols = written
        return GradTiles(rows, low, rows if cols is None else cols)


class EpilogueProducts:
    """The three products of the epilogue backend (the interface of :mod:`.products`): raw logit
    tiles for the epilogue kernels, and the two gradient products of :class:`GradTiles`.

    Args:
        ops: the kernel operands (``x``, ``y``, ``z`` and the factors; see
            :class:`~.products.KernelOperands`).
        a: ``Â`` in the compute dtype (the accumulators' shape and dtype).
        kept: the whole problem's one logit tile, kept from forward (None: recomputed).
    """

    def __init__(self, ops: KernelOperands, a: Tensor, kept: Tensor | None = None) -> None:
        self.ops, self.a, self.kept = ops, a, kept
        self.dtype = ops.y.dtype

    def gradient_tiles(self, h: int, w: int, k: int, learned_scale: bool, like: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Empty ``(rows, low, cols)`` tiles for an epilogue kernel to write, in the GEMM operand dtype:
        the row product's (h, w); its rounding remainder when half rows meet a learnable scale (whose
        gradient reads ``G @ B`` against ``A``); the column product's (h, k) when half rows' two products
        fold different factors (else None: the row tile serves both, or ``k`` is 0)."""
        half = self.dtype in (torch.float16, torch.bfloat16)
        rows = torch.empty(h, w, dtype=self.dtype, device=like.device)
        low = torch.empty(h, w, dtype=self.dtype, device=like.device) if half and learned_scale else None
        cols = torch.empty(h, k, dtype=self.dtype, device=like.device) if half and self.ops.factors is not None and k else None
        return rows, low, cols

    def logits(self, r0: int, r1: int, c0: int, c1: int, out: Tensor | None = None) -> Tensor:
        """The raw tile ``x[r0:r1] @ y[c0:c1].T`` in fp32 (fp64 for fp64), factors not applied."""
        x, y = self.ops.x, self.ops.y
        if self.kept is not None and (r0, c0, r1, c1) == (0, 0, x.shape[0], y.shape[0]):
            return self.kept
        rows = x if (r0, r1) == (0, x.shape[0]) else x[r0:r1]
        cols = y if (c0, c1) == (0, y.shape[0]) else y[c0:c1]
        if rows.dtype in (torch.float16, torch.bfloat16):
            return mm32(rows, cols.t(), out)
        return torch.mm(rows, cols.t(), out=out) if out is not None else torch.mm(rows, cols.t())

    def add_rows(self, acc: Tensor, g: GradTiles, c0: int, c1: int) -> None:
        """``acc += G diag(fy) @ y[c0:c1]`` (with the rounding remainder's product when kept)."""
        y = self.ops.y[c0:c1]
        for tile in (g.rows, g.low):
            if tile is not None:
                acc.add_(mm32(tile, y)) if tile.dtype in (torch.float16, torch.bfloat16) else acc.addmm_(tile, y)

    def add_columns(self, acc: Tensor, g: GradTiles, r0: int, r1: int) -> None:
        """``acc += (diag(fz) G).T @ z[r0:r1]`` over ``G``'s first ``len(acc)`` columns."""
        tile, z = g.cols, self.ops.z[r0:r1]
        tile = tile if tile.shape[1] == acc.shape[0] else tile[:, : acc.shape[0]]
        acc.add_(mm32(tile.t(), z)) if tile.dtype in (torch.float16, torch.bfloat16) else acc.addmm_(tile.t(), z)


def left_out(plan: SoftmaxPlan) -> dict[str, Any]:
    """The kernels' exclusion arguments (:func:`~.triton_backend.exclusion`), with the positives kept
    apart (:mod:`.confident`) left out too: a shifted diagonal, or a pairing rule's partner."""
    triton_backend = kernels()  # imports triton: on the first call

    out = triton_backend.exclusion(plan.exclude)
    if plan.apart is not None and isinstance(plan.positives, PartnerPositives):
        if plan.apart.kind == "shift":
            out["diagonal"] = plan.apart.k
        else:
            out["partner"] = plan.positives.partner.contiguous()
    return out


def _edge(plan: SoftmaxPlan | SigmoidPlan | PairPlan, rows: int, cols: int) -> tuple[int, int]:
    """``(tile, tile_cols)`` of the tile loops: the whole problem as one tile, square tiles (``tile_cols`` 0)
    or row strips across every column (the planner's choice where they are fewer)."""
    return (plan.tile, plan.tile_cols) if plan.tile else (max(rows, cols, 1), 0)


def _tile_factors(ops: KernelOperands, r0: int, r1: int, c0: int, c1: int) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(fx, fy, fz)`` sliced to a tile (all None without factors)."""
    if ops.factors is None:
        return None, None, None
    fx, fy, fz = ops.factors
    return fx[r0:r1], fy[c0:c1], fz[r0:r1]


def forward(prod: EpilogueProducts, rows: int, cols: int, plan: SoftmaxPlan) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(row_lse, col_lse or None, the one tile kept for backward or None)``."""
    triton_backend = kernels()  # imports triton: on the first call

    ops, dtype, device = prod.ops, prod.a.dtype, prod.a.device
    low = torch.finfo(dtype).min
    fixed = plan.fixed
    row_max = torch.empty(rows, dtype=dtype, device=device) if fixed else torch.full((rows,), low, dtype=dtype, device=device)
    row_sum = torch.zeros(rows, dtype=dtype, device=device)
    col_max = col_sum = None
    if plan.columns:
        col_max = torch.empty(cols, dtype=dtype, device=device) if fixed else torch.full((cols,), low, dtype=dtype, device=device)
        col_sum = torch.zeros(cols, dtype=dtype, device=device)
    edge, edge_cols = _edge(plan, rows, cols)
    scratch_width = min(edge_cols or edge, cols)
    excluded = left_out(plan)
    # the column partials' scratch, reused by every tile: O(C * tile / 32), never R x C
    wants_partials = plan.columns or (plan.symmetric and edge < rows)
    parts = triton_backend.partial_rows(min(edge, rows))
    scratch = (None if fixed else torch.empty(parts, scratch_width, dtype=dtype, device=device),
               torch.empty(parts, scratch_width, dtype=dtype, device=device)) if wants_partials else None
    kept: list[Tensor] = []

    def visit(s: Tensor, r0: int, r1: int, c0: int, c1: int, bufs: Buffers) -> None:
        if plan.single_tile:  # the epilogue only reads the tile: backward reads it again
            kept.append(s)
        width = c1 - c0
        mirror = plan.symmetric and c0 != r0  # a single set's mirror tile: its columns are rows c0:c1
        partials = None
        if scratch is not None and (plan.columns or mirror):
            partials = (None if scratch[0] is None else scratch[0][:, :width], scratch[1][:, :width])
        fx, fy, _ = _tile_factors(ops, r0, r1, c0, c1)
        used = triton_backend.epilogue_sums(s, r0, c0, rows, cols, (row_max[r0:r1], row_sum[r0:r1]),
                                            None if partials is None else (partials[0], partials[1]),
                                            None if fx is None or fy is None else (fx, fy), plan.self_offset,
                                            excluded, fixed)
        if partials is None:
            return
        if mirror:
            triton_backend.fold_partials(partials, used, width, (row_max[c0:c1], row_sum[c0:c1]), fixed)
        if col_max is not None and col_sum is not None:
            triton_backend.fold_partials(partials, used, width, (col_max[c0:c1], col_sum[c0:c1]), fixed)

    sweep(prod, rows, cols, edge, plan.symmetric, visit, tile_cols=edge_cols)
    if fixed:
        row_lse, col_lse = fixed_lse(row_sum, col_sum, plan, cols)
    else:
        row_lse = log_total(row_sum, row_max, plan, cols)
        col_lse = None if col_sum is None or col_max is None else complete_columns(col_sum, col_max, plan)
    return row_lse, col_lse, (kept[0] if kept else None)


def backward(prod: EpilogueProducts, a: Tensor, b: Tensor, row: Direction, col: Direction | None,
             plan: SoftmaxPlan, learned_scale: bool, folded: tuple[Tensor | None, Tensor | None] = (None, None)) -> tuple[Tensor, Tensor | None]:
    """``G @ B`` and ``G.T @ A`` (unscaled; in the factors' terms for half rows): each tile's
    gradient written once by :func:`~.triton_backend.epilogue_grad` and multiplied by ``torch.mm``.
    ``learned_scale``: the scale is a tensor whose gradient reads ``G @ B`` (half rows then keep
    the row tile's rounding remainder). ``folded``: the positive part's row and column coefficients,
    added to each tile in the kernel (a single set's columns take the rows' coefficients)."""
    triton_backend = kernels()  # imports triton: on the first call

    ops = prod.ops
    rows, cols = a.shape[0], b.shape[0]
    directions = triton_backend.directions(row, col, a.dtype)
    wanted = plan.grad_columns
    c_row, c_col = folded
    if plan.symmetric and c_row is not None:  # G holds both roles of a pair: P_ij (c_i + c_j)
        c_col = c_row
    positive = None if c_row is None else triton_backend.positive_terms(plan.positives, c_row, c_col, rows, cols, a.dtype)
    excluded = left_out(plan)

    def grad_tile(s: Tensor, r0: int, r1: int, c0: int, c1: int, bufs: Buffers) -> GradTiles:
        h, w = r1 - r0, c1 - c0
        if plan.symmetric:
            k = w if c0 != r0 else 0  # a diagonal tile's G holds both roles: no column product
        else:
            k = max(0, min(c1, wanted) - c0)
        tiles = prod.gradient_tiles(h, w, k, learned_scale, s)
        triton_backend.epilogue_grad(s, r0, c0, rows, cols, directions, tiles, _tile_factors(ops, r0, r1, c0, c1),
                                     plan.self_offset, excluded, positive)
        return GradTiles.of(tiles)

    edge, edge_cols = _edge(plan, rows, cols)
    return gradient_sweep(prod, a, b, edge, plan.symmetric, grad_tile, wanted, edge_cols)


class EpilogueSoftmax(SoftmaxExecutor):
    """The soft-max log-sum-exps and tile gradients as cuBLAS GEMMs with Triton epilogues; the
    positive part, weights, reduction and coefficients are the base class's."""

    def statistics(self, plan: SoftmaxPlan, ops: Operands, raw: tuple[Tensor | None, ...]) -> Statistics:
        kops = KernelOperands(plan, raw, ops.a_c, ops.b_c, ops.scale, ops.norms)
        row_lse, col_lse, kept = forward(EpilogueProducts(kops, ops.a_c), ops.a_c.shape[0], ops.b_c.shape[0], plan)
        # the positive part reads scale * A: the kernels' operand when they take the compute-dtype rows
        prod = Products(kops.x if kops.factors is None else None, ops.a_c, ops.b_c, ops.scale)
        return Statistics(prod, row_lse, col_lse, logits=kept)

    def tile_gradients(self, plan: SoftmaxPlan, saved: Saved, raw: tuple[Tensor | None, ...], row: Direction,
                       col: Direction | None, folded: tuple[Tensor | None, Tensor | None],
                       by_sums: bool) -> tuple[Tensor, Tensor | None]:
        a, b = saved.a, saved.b
        kops = KernelOperands(plan, raw, a, b, saved.scale, saved.norms)
        return backward(EpilogueProducts(kops, a, saved.keep["logits"]), a, b, row, col, plan, isinstance(saved.scale, Tensor),
                        folded)


#: The epilogue soft-max executor.
SOFTMAX = EpilogueSoftmax()


# ----------------------------------------------------------------------------- SigLIP
class EpilogueSigmoid(SigmoidExecutor):
    """SigLIP's sigmoid pairs as cuBLAS GEMMs with Triton epilogues (the tile loops above): forward
    reads each logit tile once for its rows' softplus sums, backward writes each gradient tile once
    in the operand dtype and sums it for the bias. Positives on a strided diagonal, by ids, or none."""

    def row_sums(self, plan: SigmoidPlan, ops: Operands, a_s: Tensor, bias: Tensor | float) -> tuple[Tensor, tuple[Tensor, ...]]:
        triton_backend = kernels()  # imports triton: on the first call

        kops = KernelOperands(plan, (ops.a, ops.b), ops.a_c, ops.b_c, ops.scale, ops.norms, a_s)
        prod = EpilogueProducts(kops, ops.a_c)
        rows, cols = ops.a_c.shape[0], ops.b_c.shape[0]
        out = ops.a_c.new_zeros(rows)
        bias_t, keys = triton_backend.bias_vector(bias, out, out.dtype), sigmoid_kernel_keys(plan)
        kept: list[Tensor] = []

        def visit(s: Tensor, r0: int, r1: int, c0: int, c1: int, bufs: Buffers) -> None:
            if plan.single_tile:  # the epilogue only reads the tile: backward reads it again
                kept.append(s)
            fx, fy, _ = _tile_factors(kops, r0, r1, c0, c1)
            triton_backend.epilogue_sigmoid_sums(s, r0, c0, rows, cols, out[r0:r1], bias_t,
                                                 None if fx is None or fy is None else (fx, fy), plan.diagonal_offset, keys)

        edge, edge_cols = _edge(plan, rows, cols)
        sweep(prod, rows, cols, edge, False, visit, tile_cols=edge_cols)
        raw = (ops.a, ops.b) if plan.operand_dtype is not None and ops.b is not None else ()
        return out, (*raw, *kept)

    def gradients(self, plan: SigmoidPlan, saved: Saved, g_row: Tensor, bias: Tensor | float) -> tuple[Tensor, Tensor | None, Tensor]:
        triton_backend = kernels()  # imports triton: on the first call

        a, b, kept = saved.a, saved.b, tuple(saved.keep["kept"])
        n_raw = 2 if plan.operand_dtype is not None else 0
        kops = KernelOperands(plan, kept[:n_raw], a, b, saved.scale, saved.norms)
        prod = EpilogueProducts(kops, a, kept[n_raw] if len(kept) > n_raw else None)
        rows, cols = a.shape[0], b.shape[0]
        bias_t, keys = triton_backend.bias_vector(bias, a, a.dtype), sigmoid_kernel_keys(plan)
        g_row = triton_backend.per_index(g_row, rows, a.dtype)  # a reduced loss's incoming gradient is expanded
        parts: list[Tensor] = []

        def grad_tile(s: Tensor, r0: int, r1: int, c0: int, c1: int, bufs: Buffers) -> GradTiles:
            tiles = prod.gradient_tiles(r1 - r0, c1 - c0, c1 - c0, isinstance(saved.scale, Tensor), s)
            parts.append(triton_backend.epilogue_sigmoid_grad(s, r0, c0, rows, cols, g_row, bias_t, tiles,
                                                              _tile_factors(kops, r0, r1, c0, c1), plan.diagonal_offset, keys))
            return GradTiles.of(tiles)

        edge, edge_cols = _edge(plan, rows, cols)
        gb, ga = gradient_sweep(prod, a, b, edge, False, grad_tile, tile_cols=edge_cols)
        return gb, ga, torch.stack(parts).sum() if len(parts) > 1 else parts[0]


def sigmoid_kernel_keys(plan: SigmoidPlan) -> dict[str, Tensor]:
    """The ids the kernels compare, by name (:func:`~.triton_executors.sigmoid_keys`; none for a strided
    diagonal or no positive at all)."""
    triton_backend = kernels()  # imports triton: on the first call

    given = sigmoid_keys(plan.positives, plan.diagonal_offset)
    return {} if given is None else triton_backend.keys(*given)


#: The epilogue sigmoid executor.
SIGMOID = EpilogueSigmoid()


# ------------------------------------------------------------------ the mask-in-tile losses
class EpiloguePairs(PairExecutor):
    """PML NT-Xent's per-pair terms and NT-BXent's binary terms as cuBLAS GEMMs with Triton epilogues:
    the relation formed in registers in every tile. Where every tile holds all of its rows' columns (one tile, or
    row strips across them) PML NT-Xent's forward is one launch per tile (:func:`~.triton_backend.epilogue_pml_sums`:
    the negatives' log-sum-exps, then the sums); otherwise those come from the soft-max epilogue first
    (:func:`~.triton_backend.epilogue_sums`, the positives left out)."""

    def terms(self, plan: PairPlan, ops: Operands, total_only: bool = False) -> tuple[tuple[Tensor, ...], dict[str, Any]]:
        triton_backend = kernels()  # imports triton: on the first call

        raw = (ops.a,) if ops.b is None else (ops.a, ops.b)
        kops = KernelOperands(plan, raw, ops.a_c, ops.b_c, ops.scale, ops.norms)
        prod = EpilogueProducts(kops, ops.a_c)
        rows, cols = ops.a_c.shape[0], ops.b_c.shape[0]
        (edge, edge_cols), binary = _edge(plan, rows, cols), plan.kernel == "binary"
        relation = triton_backend.relation_args(plan.positives)
        kept: list[Tensor] = []
        lse: Tensor | None
        if not binary and (edge_cols or edge) >= cols:  # every tile holds all its rows' columns: one pass, one launch
            lse, out = _pml_rows(prod, rows, cols, (edge, edge_cols), plan, relation, kept)
        else:
            lse, out = _pair_passes(prod, rows, cols, (edge, edge_cols), plan, relation, kept)
        keep = {"stats": () if lse is None else (lse, out[rows:]), "operands": raw if plan.operand_dtype is not None else (),
                "logits": kept[0] if kept else None}
        return ((out[:rows], out[rows:]) if binary else (out[:rows],)), keep

    def gradients(self, ctx: Any, plan: PairPlan, saved: Saved, grads: tuple[Tensor, ...]) -> Gradients:
        triton_backend = kernels()  # imports triton: on the first call

        a, b, keep = saved.a, saved.b, saved.keep
        kops = KernelOperands(plan, tuple(keep["operands"]), a, b, saved.scale, saved.norms)
        prod = EpilogueProducts(kops, a, keep["logits"])
        rows, cols = a.shape[0], b.shape[0]
        binary = plan.kernel == "binary"
        relation, offset = triton_backend.relation_args(plan.positives), plan.positives.self_offset
        incoming = tuple(triton_backend.per_index(g, rows, a.dtype) for g in grads[: 2 if binary else 1])
        stats = (None, None) if binary else tuple(keep["stats"])

        def grad_tile(s: Tensor, r0: int, r1: int, c0: int, c1: int, bufs: Buffers) -> GradTiles:
            tiles = prod.gradient_tiles(r1 - r0, c1 - c0, c1 - c0, isinstance(saved.scale, Tensor), s)
            triton_backend.epilogue_pair_grad(s, r0, c0, rows, cols, incoming, (stats[0], stats[1]), tiles,
                                              _tile_factors(kops, r0, r1, c0, c1), offset, relation, binary)
            return GradTiles.of(tiles)

        edge, edge_cols = _edge(plan, rows, cols)
        gb, ga = gradient_sweep(prod, a, b, edge, False, grad_tile, tile_cols=edge_cols)
        return Gradients(gb, ga)


def _pair_passes(prod: EpilogueProducts, rows: int, cols: int, edge: tuple[int, int], plan: PairPlan,
                 relation: dict[str, Any], kept: list[Tensor]) -> tuple[Tensor | None, Tensor]:
    """The pair terms' forward tile by tile: NT-BXent's sums in one sweep; PML NT-Xent's where a tile may miss
    some of its rows' columns in two (the negatives' log-sum-exps, then the sums given them). Returns
    ``(lse, out)``: the (R,) log-sum-exps (None for NT-BXent) and the (2 R,) sums; a single tile kept in
    ``kept``; ``relation`` as the kernels read it."""
    triton_backend = kernels()  # imports triton: on the first call

    binary, offset = plan.kernel == "binary", plan.positives.self_offset
    lse = None
    if not binary:  # pass 1: the negatives' log-sum-exp (the positives and the self pair left out)
        lse = _negatives_lse(prod, rows, cols, edge, plan, kept)
        prod.kept = kept[0] if kept else None
    out = prod.a.new_zeros(2 * rows)

    def visit(s: Tensor, r0: int, r1: int, c0: int, c1: int, bufs: Buffers) -> None:
        if plan.single_tile and not kept:
            kept.append(s)
        fx, fy, _ = _tile_factors(prod.ops, r0, r1, c0, c1)
        triton_backend.epilogue_pair_sums(s, r0, c0, rows, cols, out, lse, None if fx is None or fy is None else (fx, fy),
                                          offset, relation, binary)

    sweep(prod, rows, cols, edge[0], False, visit, tile_cols=edge[1])
    return lse, out


def _pml_rows(prod: EpilogueProducts, rows: int, cols: int, edge: tuple[int, int], plan: PairPlan,
              relation: dict[str, Any], kept: list[Tensor]) -> tuple[Tensor, Tensor]:
    """PML NT-Xent's forward where every tile spans its rows' columns (one tile, or row strips across them):
    each tile's negatives' log-sum-exps and pair sums in one launch (:func:`~.triton_backend.epilogue_pml_sums`),
    so each strip's logits are formed once. Returns ``(lse, out)``: (R,) and the (2 R,) sums; a single tile
    kept in ``kept``; ``relation`` as the kernels read it."""
    triton_backend = kernels()  # imports triton: on the first call

    lse = prod.a.new_empty(rows)
    out = prod.a.new_empty(2 * rows)  # every row is written by the one tile that holds it
    offset = plan.positives.self_offset

    def visit(s: Tensor, r0: int, r1: int, c0: int, c1: int, bufs: Buffers) -> None:
        if plan.single_tile:
            kept.append(s)
        fx, fy, _ = _tile_factors(prod.ops, r0, r1, c0, c1)
        triton_backend.epilogue_pml_sums(s, r0, rows, lse, out, None if fx is None or fy is None else (fx, fy), offset,
                                         relation, plan.fixed)

    sweep(prod, rows, cols, edge[0], False, visit, tile_cols=edge[1])
    return lse, out


def _negatives_lse(prod: EpilogueProducts, rows: int, cols: int, edge: tuple[int, int], plan: PairPlan,
                   kept: list[Tensor]) -> Tensor:
    """PML NT-Xent's pass 1: each row's log-sum-exp over its negatives (``-inf`` for a row without any),
    the positives and the self pair left out in the soft-max epilogue; a single tile kept in ``kept``."""
    triton_backend = kernels()  # imports triton: on the first call

    dtype, device = prod.a.dtype, prod.a.device
    run_max = torch.empty(rows, dtype=dtype, device=device) if plan.fixed else \
        torch.full((rows,), torch.finfo(dtype).min, dtype=dtype, device=device)
    run_sum = torch.zeros(rows, dtype=dtype, device=device)
    excluded = triton_backend.exclusion(Exclusion(relation=plan.positives))

    def visit(s: Tensor, r0: int, r1: int, c0: int, c1: int, bufs: Buffers) -> None:
        if plan.single_tile:
            kept.append(s)
        fx, fy, _ = _tile_factors(prod.ops, r0, r1, c0, c1)
        triton_backend.epilogue_sums(s, r0, c0, rows, cols, (run_max[r0:r1], run_sum[r0:r1]), None,
                                     None if fx is None or fy is None else (fx, fy), plan.positives.self_offset, excluded,
                                     plan.fixed)

    sweep(prod, rows, cols, edge[0], False, visit, tile_cols=edge[1])
    total = run_sum.log() if plan.fixed else run_sum.log() + run_max
    return torch.where(run_sum > 0, total, float("-inf"))


#: The epilogue pair executor.
PAIRS = EpiloguePairs()


class EpilogueKernels(Strategy):
    """cuBLAS GEMMs with Triton epilogues (``backend="epilogue"``): what the Triton kernels serve, without fp16."""

    name = "epilogue"

    def serves(self, problem: Problem, on: Target) -> str | None:
        """None when the epilogues can run ``problem`` (a problem the Triton kernels take, without fp16 inputs),
        else why not."""
        why = TRITON.serves(problem, on)
        if why is not None:
            return why.replace("backend='triton'", "backend='epilogue'")
        if torch.float16 in (problem.anchors.dtype, problem.candidates.dtype):
            return "fp16 gradient tiles need a tile-wide rescale; use backend='torch' or 'triton' (or bf16 inputs)"
        return None


#: The epilogue strategy (the registry: :data:`~.strategies.STRATEGIES`).
EPILOGUE = EpilogueKernels({(Softmax, "epilogue"): SOFTMAX, (PairTerms, "epilogue"): PAIRS,
                             (SigmoidPairs, "epilogue"): SIGMOID})
