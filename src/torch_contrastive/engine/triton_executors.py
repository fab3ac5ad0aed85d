"""The fused Triton kernels (:mod:`.triton_backend`) as a strategy: :data:`TRITON` (``backend="triton"``).

Each statistic's executor subclasses the general one, which owns weights, positive parts, reductions and
coefficients, and supplies only the kernel passes; the kernels tile themselves (one program per row block, a
GEMM loop over the features, every tile's mask formed in registers). Triton is imported on the first call, not
with the package. No GPU has measured a call where these beat the policy's strategies (docs/gpu.md), so the
CUDA policy does not hold them: they run when asked for by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..positives import Exclusion, KeyPositives, PairPositives, PartnerPositives
from .driver import Gradients, Operands, Saved
from .left_out import Direction
from .pairwise import PairExecutor
from .problem import PairTerms, Prefixes, SigmoidPairs, Softmax
from .products import KernelOperands, Products
from .sigmoid import SigmoidExecutor
from .softmax import SoftmaxExecutor, Statistics
from .softmax_tiles import complete_columns, fixed_lse
from .strategy import Strategy

if TYPE_CHECKING:
    from ..positives import Positives
    from .planner import Target
    from .plans import PairPlan, SigmoidPlan, SoftmaxPlan
    from .problem import Problem

__all__ = ["PAIRS", "SIGMOID", "SOFTMAX", "TRITON", "TritonKernels"]


# ----------------------------------------------------------------------------- soft-max
class TritonSoftmax(SoftmaxExecutor):
    """The soft-max log-sum-exps and tile gradients as Triton kernels; positives go through
    ``Positives.aggregate`` (the base class)."""

    def statistics(self, plan: SoftmaxPlan, ops: Operands, raw: tuple[Tensor | None, ...]) -> Statistics:
        scaled = Products(None, ops.a_c, ops.b_c, ops.scale)  # holds scale * A once: the kernels' operand and the positive part's
        kops = KernelOperands(plan, raw, ops.a_c, ops.b_c, ops.scale, ops.norms, scaled.a_s if plan.operand_dtype is None else None)
        return Statistics(scaled, *_forward_softmax(kops, plan, ops.b_c.shape[0]))

    def tile_gradients(self, plan: SoftmaxPlan, saved: Saved, raw: tuple[Tensor | None, ...], row: Direction,
                       col: Direction | None, folded: tuple[Tensor | None, Tensor | None],
                       by_sums: bool) -> tuple[Tensor, Tensor | None]:
        a, b = saved.a, saved.b
        return _backward_softmax(KernelOperands(plan, raw, a, b, saved.scale, saved.norms), a, b, row, col, plan)


# the Triton kernels' package (it imports triton): imported on first use, then kept -- an import statement in a
# function costs every call of a host-bound loss about 50 bytecodes
_TRITON: Any = None


def _triton() -> Any:
    global _TRITON
    from . import triton_backend

    if not torch.compiler.is_compiling():  # (a traced call may not write a module global: Dynamo refuses the side effect)
        _TRITON = triton_backend
    return triton_backend


def kernels() -> Any:
    """The Triton kernels' package, imported on the first call (it imports triton)."""
    return _TRITON or _triton()


def _forward_softmax(ops: KernelOperands, plan: SoftmaxPlan, n_cols: int) -> tuple[Tensor, Tensor | None]:
    """Row (and column) log-sum-exp by the Triton kernels: the bounded regime sums rows and
    columns in one pass over the tiles (the upper triangle for a single set); the online
    regime, or deterministic mode, runs the row-owned kernel once per direction."""
    triton_backend = _TRITON or _triton()  # imports triton: on the first call

    x, y = ops.x, ops.y
    if plan.fixed and triton_backend.fused():
        row_sum, col_sum = triton_backend.tile_sums(x, y, plan.self_offset, plan.exclude, plan.columns, plan.symmetric,
                                                    ops.pair())
        return fixed_lse(row_sum, col_sum, plan, n_cols)
    row_lse = triton_backend.row_lse(x, y, plan.self_offset, plan.exclude, factors=ops.pair())
    if plan.exclude is None:  # a row without candidates (a batch of one) gets 0, as the torch backend's
        row_lse = torch.where(torch.isneginf(row_lse), 0.0, row_lse)
    if not plan.columns:
        return row_lse, None
    col_offset = None if plan.self_offset is None else -plan.self_offset
    col_lse = triton_backend.row_lse(y, x, col_offset, plan.exclude, transposed=True, factors=ops.pair(swapped=True))
    if plan.column_comm is not None:  # every rank's partial log-sum-exp, brought to the global maximum
        col_lse = complete_columns(torch.ones_like(col_lse), col_lse, plan)
    return row_lse, col_lse


def _backward_softmax(ops: KernelOperands, a: Tensor, b: Tensor, row: Direction, col: Direction | None,
                     plan: SoftmaxPlan) -> tuple[Tensor, Tensor | None]:
    """``G @ B`` and ``G.T @ A`` by the Triton kernels: each gradient tile formed once
    (atomics), or -- in deterministic mode -- ``G.T @ A`` as ``G' @ A`` on ``S.T``."""
    triton_backend = _TRITON or _triton()  # imports triton: on the first call

    x, y, z = ops.x, ops.y, ops.z
    offset = plan.self_offset
    if triton_backend.fused():
        return triton_backend.tile_grad(x, y, z, row, col, offset, plan.exclude, plan.grad_columns, plan.symmetric, ops.factors)
    fxy = ops.pair()
    gb_acc = triton_backend.grad_rows(x, y, y, row, col, offset, plan.exclude,
                                      factors=None if fxy is None else (*fxy, fxy[1]))
    if plan.grad_columns == 0 or plan.symmetric:  # a single set: G is symmetric, G @ Z holds both roles
        return gb_acc, None
    k = plan.grad_columns
    zero = torch.zeros(k, dtype=a.dtype, device=a.device)
    swapped_row = (zero, zero) if col is None else (col[0].expand(b.shape[0])[:k], col[1][:k])
    swapped = ops.pair(swapped=True, rows=k)
    part = triton_backend.grad_rows(y[:k], x, z, swapped_row, row, None if offset is None else -offset, plan.exclude,
                                    transposed=True, factors=None if swapped is None or ops.factors is None
                                    else (*swapped, ops.factors[2]))
    if k >= b.shape[0]:
        return gb_acc, part
    ga_acc = torch.zeros_like(b, dtype=part.dtype)
    ga_acc[:k] = part
    return gb_acc, ga_acc


# ------------------------------------------------------------------------------- pairs
class TritonPairs(PairExecutor):
    """The pair terms as the fused pair kernels (:mod:`.triton_backend.pair_terms`); every tile's
    mask is formed in registers."""

    def terms(self, plan: PairPlan, ops: Operands, total_only: bool = False) -> tuple[tuple[Tensor, ...], dict[str, Any]]:
        outputs, kernel_saved = _forward_pairs(plan, KernelOperands(plan, (ops.a, ops.b), ops.a_c, ops.b_c, ops.scale, ops.norms))
        raw = tuple(t for t in (ops.a, ops.b) if t is not None) if plan.operand_dtype is not None else ()
        return outputs, {"kernel": kernel_saved, "raw": raw}

    def gradients(self, ctx: Any, plan: PairPlan, saved: Saved, grads: tuple[Tensor, ...]) -> Gradients:
        raw = saved.keep["raw"]
        kops = KernelOperands(plan, (*raw, None)[:2] if raw else (), saved.a, saved.b, saved.scale, saved.norms)
        return _backward_pairs(plan, kops, saved.keep["kernel"], grads)


def _forward_pairs(plan: PairPlan, ops: KernelOperands) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """The pair kernels' forward: NT-BXent's two sums in one pass; PML NT-Xent's negatives'
    log-sum-exp (the row-owned kernel, same-label pairs excluded), then its pair terms."""
    triton_backend = _TRITON or _triton()  # imports triton: on the first call

    if plan.kernel == "binary":
        return triton_backend.pair_sums(ops.x, ops.y, plan.positives, True, factors=ops.pair()), ()
    neg_lse = triton_backend.row_lse(ops.x, ops.y, plan.positives.self_offset, Exclusion(relation=plan.positives),
                                     factors=ops.pair())
    out, weight = triton_backend.pair_sums(ops.x, ops.y, plan.positives, False, lse=neg_lse, factors=ops.pair())
    return (out,), (neg_lse, weight)


def _backward_pairs(plan: PairPlan, ops: KernelOperands, kernel_saved: tuple[Tensor, ...], grads: tuple[Tensor, ...]) -> Gradients:
    """``G @ B`` and ``G.T @ A`` of the pair terms, each gradient tile formed once (atomics)."""
    triton_backend = _TRITON or _triton()  # imports triton: on the first call

    binary = plan.kernel == "binary"
    lse, weight = (None, None) if binary else kernel_saved
    rows, cols = triton_backend.pair_grad(ops.x, ops.y, ops.z, plan.positives, binary, grads, lse, weight, ops.factors)
    return Gradients(rows, cols)


# ----------------------------------------------------------------------------- sigmoid
class TritonSigmoid(SigmoidExecutor):
    """SigLIP's sigmoid pairs as the fused tile kernels (:mod:`.triton_backend.sigmoid_pairs`):
    positives on a diagonal, by ids or none."""

    def row_sums(self, plan: SigmoidPlan, ops: Operands, a_s: Tensor, bias: Tensor | float) -> tuple[Tensor, tuple[Tensor, ...]]:
        triton_backend = _TRITON or _triton()  # imports triton: on the first call

        kops = KernelOperands(plan, (ops.a, ops.b), ops.a_c, ops.b_c, ops.scale, ops.norms, a_s)
        keys = sigmoid_keys(plan.positives, plan.diagonal_offset)
        out = triton_backend.sigmoid_sums(kops.x, kops.y, bias, plan.diagonal_offset, keys, kops.pair())
        # half operands: backward multiplies the caller's rows again
        kept = tuple(t for t in (ops.a, ops.b) if t is not None) if plan.operand_dtype is not None else ()
        return out, kept

    def gradients(self, plan: SigmoidPlan, saved: Saved, g_row: Tensor, bias: Tensor | float) -> tuple[Tensor, Tensor | None, Tensor]:
        triton_backend = _TRITON or _triton()  # imports triton: on the first call

        kops = KernelOperands(plan, tuple(saved.keep["kept"]), saved.a, saved.b, saved.scale, saved.norms)
        keys = sigmoid_keys(plan.positives, plan.diagonal_offset)
        return triton_backend.sigmoid_grad(kops.x, kops.y, kops.z, g_row, bias, plan.diagonal_offset, keys, kops.factors)


def sigmoid_keys(positives: Positives, diagonal: int | None) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]] | None:
    """The id keys the Triton kernels compare (None: a strided diagonal or no positive at all)."""
    if isinstance(positives, KeyPositives) and diagonal is None:
        return positives.row_keys, positives.col_keys
    return None


#: The Triton executors of each statistic.
SOFTMAX, PAIRS, SIGMOID = TritonSoftmax(), TritonPairs(), TritonSigmoid()


class TritonKernels(Strategy):
    """The fused Triton kernels (``backend="triton"``): a CUDA device (or the interpreter), and the relations the
    kernels form in registers."""

    name = "triton"

    def serves(self, problem: Problem, on: Target) -> str | None:
        """None when the kernels can run ``problem`` on its tensors' device (the kernels are never simulated:
        ``on`` is not read), else why not."""
        if isinstance(problem.statistic, Prefixes):
            return "the Triton kernels have no prefix passes (Matryoshka); use backend='torch' or 'auto'"
        triton_backend = kernels()
        try:
            triton_backend.check_device(problem.anchors)
        except ValueError as err:
            return str(err)
        stat, positives = problem.statistic, problem.positives
        if isinstance(stat, Softmax):
            try:
                triton_backend.check_exclusion(stat.exclude)
            except ValueError as err:
                return str(err)
            return None
        if positives is None:  # Problem refuses pair and sigmoid terms without positives when built
            return f"{type(stat).__name__} needs positives"
        kind = positives.kind
        by_ids = isinstance(positives, KeyPositives)  # one or two keys: the kernels compare both
        if isinstance(stat, PairTerms):
            if isinstance(positives, (PartnerPositives, PairPositives)) or by_ids:
                return None
            return f"the pair kernels take positives by ids, a partner or index pairs, not a {kind!r} relation"
        covered = (isinstance(positives, PartnerPositives) and stat.diagonal_offset is not None) \
            or (by_ids and positives.self_offset is None) \
            or (isinstance(positives, PairPositives) and positives.pairs.shape[0] == 0)
        return None if covered else f"the SigLIP kernels take positives on a diagonal, by ids or none, not a {kind!r} relation"


#: The Triton strategy (the registry: :data:`~.strategies.STRATEGIES`).
TRITON = TritonKernels({(Softmax, "triton"): SOFTMAX, (PairTerms, "triton"): PAIRS, (SigmoidPairs, "triton"): SIGMOID})
