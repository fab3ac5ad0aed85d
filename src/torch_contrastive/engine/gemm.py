"""A matmul with the statistic in its epilogue, as a strategy: :data:`GEMM` (``backend="gemm"``), opt-in.

The forward is one launch over the whole problem: each program multiplies one 128 x 128 tile of half rows on tensor
cores (64 for fp32 and fp64), a GEMM's pipelined K loop, and folds it in registers into the statistic -- the
soft-max terms' row and column exp-sums (:mod:`.triton_backend.gemm_sums`), SigLIP's softplus row sums
(:mod:`.triton_backend.gemm_sigmoid_sums`) -- so no logit reaches memory, where the epilogue strategy's forward
writes each fp32 strip and reads it back. The backward is the epilogue strategy's (:mod:`.epilogue`: each gradient
tile written once in the operand dtype, multiplied by cuBLAS), so a call does the dense formula's products.

It covers the soft-max terms without exclusions (false negatives) or positives kept apart -- CLIP in both
directions, NT-Xent, SupCon, InfoNCE, on one process or gathered -- and SigLIP; the pair terms (PML NT-Xent and
NT-BXent with labels) stay with the epilogue. No device's policy holds it: it enters the CUDA policy only with a
measured row on a GPU that puts it ahead of what the policy runs at that size (:mod:`.policy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .driver import Operands
from .epilogue import EPILOGUE, PAIRS, EpilogueSigmoid, EpilogueSoftmax, sigmoid_kernel_keys
from .left_out import log_total
from .problem import PairTerms, SigmoidPairs, Softmax
from .products import KernelOperands, Products
from .softmax import Statistics
from .softmax_tiles import complete_columns, fixed_lse
from .strategy import Strategy
from .triton_executors import kernels

if TYPE_CHECKING:
    from .planner import Target
    from .plans import SigmoidPlan, SoftmaxPlan
    from .problem import Problem

__all__ = ["GEMM", "GemmKernels", "GemmSigmoid", "GemmSoftmax"]


class GemmSoftmax(EpilogueSoftmax):
    """The soft-max log-sum-exps from the fused matmul; the tile gradients, positive part, weights, reduction and
    coefficients are the epilogue executor's and its base class's."""

    def statistics(self, plan: SoftmaxPlan, ops: Operands, raw: tuple[Tensor | None, ...]) -> Statistics:
        kops = KernelOperands(plan, raw, ops.a_c, ops.b_c, ops.scale, ops.norms)
        factors = None if kops.factors is None else kops.factors[:2]
        (row_max, row_sum), col = kernels().gemm_sums(kops.x, kops.y, plan.self_offset, plan.columns, plan.symmetric,
                                                      plan.fixed, factors)
        n_cols = ops.b_c.shape[0]
        if plan.fixed:
            row_lse, col_lse = fixed_lse(row_sum, None if col is None else col[1], plan, n_cols)
        else:
            row_lse = log_total(row_sum, row_max, plan, n_cols)
            col_lse = None if col is None or col[0] is None else complete_columns(col[1], col[0], plan)
        # the positive part reads scale * A: the kernel's operand when it takes the compute-dtype rows
        prod = Products(kops.x if kops.factors is None else None, ops.a_c, ops.b_c, ops.scale)
        return Statistics(prod, row_lse, col_lse)


#: The fused-matmul soft-max executor.
SOFTMAX = GemmSoftmax()


class GemmSigmoid(EpilogueSigmoid):
    """SigLIP's row sums from the fused matmul (:mod:`.triton_backend.gemm_sigmoid_sums`); the gradients and the
    bias's are the epilogue executor's (every tile recomputed: no logit tile is kept)."""

    def row_sums(self, plan: SigmoidPlan, ops: Operands, a_s: Tensor, bias: Tensor | float) -> tuple[Tensor, tuple[Tensor, ...]]:
        triton_backend = kernels()  # imports triton: on the first call

        kops = KernelOperands(plan, (ops.a, ops.b), ops.a_c, ops.b_c, ops.scale, ops.norms, a_s)
        factors = None if kops.factors is None else kops.factors[:2]
        bias_t = triton_backend.bias_vector(bias, ops.a_c, ops.a_c.dtype)
        out = triton_backend.gemm_sigmoid_sums(kops.x, kops.y, bias_t, factors, plan.diagonal_offset,
                                               sigmoid_kernel_keys(plan))
        raw = (ops.a, ops.b) if plan.operand_dtype is not None and ops.b is not None else ()
        return out, raw


#: The fused-matmul sigmoid executor.
SIGMOID = GemmSigmoid()


class GemmKernels(Strategy):
    """The matmul with the statistic in its epilogue (``backend="gemm"``): the epilogue strategy's soft-max terms
    without exclusions, and its sigmoid terms."""

    name = "gemm"

    def serves(self, problem: Problem, on: Target) -> str | None:
        """None when the fused matmul can run ``problem`` (soft-max terms the epilogue strategy serves with nothing
        excluded, or its sigmoid terms), else why not."""
        if isinstance(problem.statistic, PairTerms):
            return "backend='gemm' computes soft-max and sigmoid terms, not pair terms; use backend='epilogue'"
        why = EPILOGUE.serves(problem, on)
        if why is not None:
            return why.replace("backend='epilogue'", "backend='gemm'")
        if isinstance(problem.statistic, Softmax) and problem.statistic.exclude is not None:
            return "backend='gemm' leaves out no false negatives (exclusions); use backend='epilogue' or 'torch'"
        return None


#: The fused-matmul strategy (the registry: :data:`~.strategies.STRATEGIES`). The pair terms' form is the epilogue's,
#: which ``serves`` refuses here: every strategy holds a form of every statistic.
GEMM = GemmKernels({(Softmax, "gemm"): SOFTMAX, (PairTerms, "gemm"): PAIRS, (SigmoidPairs, "gemm"): SIGMOID})
