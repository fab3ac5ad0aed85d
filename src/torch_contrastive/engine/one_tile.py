"""The commonest small call as one lean autograd function: the soft-max terms of one bounded tile
whose single positive per row lies on a strided layout.

CLIP's and InfoNCE's diagonal, NT-Xent's two pairing rules -- at the batch sizes where a call is
Python-bound (a GPU pays that Python as latency). :class:`~.softmax.TorchSoftmax` serves every soft-max
plan through the driver's general machinery (operands, named saved state, weights, coefficients); here
the plan is one of the narrow kind the planner marks ``one_tile``, so every choice was made when it was planned,
and forward and backward are the same ATen ops as the general executor's one-tile path, in the same
order -- the same bits -- with none of its Python around them.

Per row ``i`` with positive ``p(i)`` (the self pair left out on a single set), ``e = exp(S)`` of the one
tile (bounded regime: no running maximum), the positive kept apart (:mod:`.confident`)::

    excess_i = sum_{j != i, p(i)} e_ij        d_i = log1p(excess_i / e_{i p(i)}) = LSE_i - S_{i p(i)}

and the columns' ``d'_j`` of a two-set loss the same way down the tile. The loss is the engine's
``total`` (``c * sum_i d_i + c' * sum_j d'_j``). Backward forms the gradient tile once,

    ``G_ij = (w_i + w'_j) e_ij``, ``w_i = g c / (excess_i + e_{i p(i)})``, ``G_{i p(i)} += -w_i excess_i`` (and ``w'``),

(``w_i + w_j`` on a single set, whose ``H = G + G^T`` feeds one product), multiplies it by the rows and
finishes the normalisation's backward -- two sets as one stack of rows.

Two more narrow plans get the same treatment, each the general executor's one-tile ops in the same order:
a single set's dense label relation read off the tile with rows weighted (SupCon by labels or by sample,
:class:`_OneTileMask`), and a single set's label relation under the pair conventions (PML's NT-Xent and
NT-BXent, :class:`OneTilePairsFunction`, the pair kernel's one-tile functions on the 0/1 label masks).

The lean executors run in the compute dtype on every device: fp16/bf16 inputs on a GPU's tensor cores take the
general executor (:mod:`.products`' ``HalfProducts``), the form a GPU has measured (docs/gpu.md).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from .._tensors import as_dtype, refuse_transforms, save_for_backward
from ..positives import KeyPositives
from .driver import first_order_only, to_compute
from .left_out import log_total
from .normalization import l2_normalize, l2_normalize_backward
from .pair_kernels import KERNELS
from .pairwise import TORCH as TORCH_PAIRS
from .pairwise import combined, combined_grads, single_fixed
from .precision import autocast_enabled, zero
from .problem import PairTerms, Problem, Softmax
from .recorded import name_executor
from .softmax import TORCH, scalar_total, weighted_grad
from .softmax_tiles import kept_apart_terms, put_at, put_both

if TYPE_CHECKING:
    from ..positives import Positives
    from .planner import Decision
    from .plans import PairPlan, SoftmaxPlan
    from .softmax_tiles import FlatPlaces

__all__ = ["ONE_TILE", "ONE_TILE_PAIRS", "lean_pairs", "lean_softmax"]


def lean_softmax(plan: SoftmaxPlan, problem: Problem) -> bool:
    """Whether the lean form serves a torch-loops soft-max ``plan``: one bounded tile (:func:`_one_bounded_tile`);
    and either an unweighted strided relation kept apart -- a single set visited as its symmetric triangle (the self
    pair left out, no column terms), or two sets of one dtype on the identity layout (no self pair; the column terms
    with their positives, or none) whose candidates all take a gradient -- or a single set's dense label relation
    read off the tile, rows weighted, no column terms (SupCon). (Per call, :class:`OneTileSoftmax` also sends a
    reduction outside the engine, a tensor scale and an ambient autocast to the general executor.)"""
    places, n_cols = plan.places, problem.shape[1]
    if places is None:  # a dense label relation read off the tile (SupCon), rows weighted, no column terms
        stat = problem.statistic
        # (two rows or more: every row's sum of exp then holds a candidate, so backward divides by it)
        masked = problem.single and n_cols >= 2 and plan.symmetric and plan.self_offset == 0 and not plan.columns \
            and plan.tile_positives and isinstance(plan.positives, KeyPositives) and isinstance(stat, Softmax) \
            and stat.col_weights == (None, None)
        return bool(masked and _one_bounded_tile(plan, problem))
    if problem.single:
        shape = plan.symmetric and plan.self_offset == 0 and not plan.columns
    else:
        shape = (not plan.symmetric and plan.self_offset is None and problem.anchors.dtype == problem.candidates.dtype
                 and (plan.column_positives or not plan.columns) and getattr(plan.positives, "layout", None) == "identity")
    return bool(shape and plan.grad_columns == n_cols and plan.apart is not None and not plan.weighted
                and _one_bounded_tile(plan, problem))


def _one_bounded_tile(plan: SoftmaxPlan, problem: Problem) -> bool:
    """The torch loops' one bounded tile, rows normalised inside, nothing excluded, one process, in the compute
    dtype (tensor-core products take the general executor, the form a GPU has measured)."""
    return (plan.backend == "torch" and plan.single_tile and plan.fixed and plan.operand_dtype is None
            and not plan.half and plan.normalize and plan.exclude is None and plan.column_comm is None)


def lean_pairs(problem: Problem, decision: Decision) -> bool:
    """Whether the lean form serves a torch-loops pair plan: one set's label relation on one bounded tile, rows
    normalised inside, in the compute dtype (tensor-core products take the general executor)."""
    positives = problem.positives
    return (problem.single and isinstance(positives, KeyPositives) and positives.self_offset == 0
            and decision.backend == "torch" and decision.tile == 0 and decision.fixed and not decision.half
            and decision.operand_dtype is None and problem.options.normalize)

#: This thread's lean calls, noted while a loss call is being kept (:mod:`torch_contrastive.losses._kept`):
#: ``NOTED.calls`` a list of ``(function, plan, stat, scale, a, b, out)`` (the statistic whose parts the call
#: took: :func:`arguments`), and ``NOTED.rebuilds`` a list of ``(rebuild, positives, stat)`` that a label loss
#: notes (:func:`note_rebuild`); absent or None otherwise.
NOTED = threading.local()


def note_rebuild(positives: Positives, stat: Any, rebuild: Callable[..., tuple[Positives, Any]], *bound: Any) -> None:
    """While a call is being kept: a label loss says that ``rebuild(*bound, labels)`` returns ``(positives, stat)``
    -- the relation and statistic it just built from this call's labels -- for another call's labels, by the
    same functions (``bound``: the call's other inputs to them; values, never tensors, which a kept call would
    keep alive). Costs a call that is not being kept one attribute read."""
    noted = getattr(NOTED, "rebuilds", None)
    if noted is not None:
        noted.append((functools.partial(rebuild, *bound), positives, stat))


def arguments(function: Any, plan: Any, stat: Any, scale: float, a: Tensor, b: Tensor | None) -> tuple[Any, ...]:
    """A lean function's arguments from its plan, the problem's statistic, scale and features (the executors'
    and a kept call's one mapping)."""
    if function is OneTileFunction:
        return plan, stat.total, scale, a, b
    if function is _OneTileMask:
        return (plan, stat.total, scale, a, *stat.row_weights)
    return plan, stat.combine, scale, a  # the pair functions

# inputs of these dtypes are computed in their own; fp16/bf16 in fp32 (precision.compute_dtype)
_COMPUTE_DTYPES = (torch.float32, torch.float64)

# autograd.Function.apply's C part. Its Python wrapper binds default arguments (the lean functions take none),
# unwraps functorch's dead wrappers (done by the caller, in C: only the features can be one) and sends a call
# under a functorch transform to functorch (then the wrapper runs): about 110 bytecodes a call, counted.
C_APPLY = torch._C._FunctionBase.__dict__["apply"]
unwrap = torch._C._functorch.unwrap_if_dead
transforms_active = torch._C._are_functorch_transforms_active


def lean_apply(function: Any) -> Any:
    """``function.apply`` (a lean autograd function's), as its C part where that serves: no functorch transform
    active, not traced by ``torch.compile`` (Dynamo traces the Python ``apply``, never its C part), and ``apply``
    not replaced on the class (a test may count its calls)."""
    if transforms_active():
        refuse_transforms()
    if torch.compiler.is_compiling() or "apply" in function.__dict__:
        return function.apply
    return _APPLIES[function]


class OneTileSoftmax:
    """The executor of a plan marked ``one_tile`` (:func:`lean_softmax`): ``run(problem, plan)`` as :class:`~.softmax.TorchSoftmax`'s.

    What the plan key cannot see is checked per call, in a few attribute reads, and sends the call to
    the general executor: a reduction outside the engine (per-row values), a tensor scale (a learnable
    temperature's gradient, or a value to keep off the host), an ambient autocast."""

    def run(self, problem: Problem, plan: SoftmaxPlan) -> tuple[Tensor, Tensor | None]:
        stat = problem.statistic
        if not isinstance(stat, Softmax):
            raise TypeError(f"the soft-max executor runs Softmax problems, got {type(stat).__name__}")
        total, scale, a = stat.total, problem.scale, problem.anchors
        if total is None or not isinstance(scale, float) or autocast_enabled(a.device.type):
            name_executor(plan.backend)  # explain() says which executor ran
            return TORCH.run(problem, plan)
        if plan.places is None:  # a dense label relation (SupCon): the weighted form
            function: Any = _OneTileMask
            b = None
            out = lean_apply(function)(plan, total, scale, unwrap(a), *stat.row_weights)
        else:
            function = OneTileFunction
            b = None if problem.single else problem.candidates
            out = lean_apply(function)(plan, total, scale, unwrap(a), b if b is None else unwrap(b))
        noted = getattr(NOTED, "calls", None)
        if noted is not None:
            noted.append((function, plan, stat, scale, a, b, out))
        return out, None


#: The one-tile soft-max executor (a form of the torch loops: :mod:`.torch_loops`).
ONE_TILE = OneTileSoftmax()


class OneTileFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: SoftmaxPlan, total: tuple[Any, Any], scale: float, a: Tensor,  # type: ignore[override]
                b: Tensor | None) -> Tensor:
        places: FlatPlaces = plan.places  # type: ignore[assignment]  # (one_tile plans have them; no cast() call)
        # (a single set is its own candidates; two sets are normalised as one stack: each op once for both)
        x = a if b is None else torch.cat((a, b))
        rows, denom, norm = l2_normalize(x if x.dtype in _COMPUTE_DTYPES else x.float(), plan.eps)  # (driver.to_compute)
        za, zb = (rows, rows) if b is None else (rows[: a.shape[0]], rows[a.shape[0] :])
        base = zero(za)  # (backward's fused ops take it too)
        e = torch.addmm(base, za, zb.t(), beta=0, alpha=scale).exp_()
        d, d_col, row_total, excess, col_total, col_excess = kept_apart_terms(e, places, plan.columns)
        # one attribute for backward's constants (the planner gave two sets one dtype)
        ctx.constants = (plan, total, scale, a.dtype, b is None, base)
        save_for_backward(ctx, rows, denom, norm, e, row_total, excess, col_total, col_excess)
        return scalar_total(d, d_col, total)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        first_order_only()
        rows, denom, norm, e, row_total, excess, col_total, col_excess = ctx.saved_tensors
        plan, total, scale, dtype, single, base = ctx.constants
        places: FlatPlaces = plan.places  # type: ignore[assignment]
        uniform = g * total[0]  # d loss / d d_i, the same for every row (as_dtype inlined: the commonest small call)
        if uniform.dtype != rows.dtype:
            uniform = uniform.to(rows.dtype)
        w = uniform / row_total  # each row's soft-max weight u / sum exp
        c = torch.addcmul(base, w, excess, value=-1)  # the kept-apart positive's coefficient -w * excess
        if single:  # H = G + G^T = (w_i + w_j) e_ij, each positive in both roles; one product
            grad_tile = (w.unsqueeze(1) + w).mul_(e)
            put_both(grad_tile, places, c)
            ga = l2_normalize_backward(grad_tile @ rows, rows, denom, norm, plan.eps, scale)
            return None, None, None, ga if ga.dtype == dtype else ga.to(dtype), None
        n = e.shape[0]
        za, zb = rows[:n], rows[n:]
        if col_total is not None:
            uniform_col = uniform if total[1] is total[0] else as_dtype(g * total[1], rows.dtype)
            w_col = uniform_col / col_total
            grad_tile = (w[:, None] + w_col).mul_(e)
            grad_tile.diagonal().add_(c + torch.addcmul(base, w_col, col_excess, value=-1))
        else:
            grad_tile = e * w[:, None]
            put_at(grad_tile, places.positives, c, accumulate=True)
        need_a, need_b = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        if not need_b:
            ga = l2_normalize_backward(grad_tile @ zb, za, denom[:n], norm[:n], plan.eps, scale)
            return None, None, None, as_dtype(ga, dtype), None
        both = as_dtype(l2_normalize_backward(torch.cat([grad_tile @ zb, grad_tile.t() @ za]), rows, denom, norm, plan.eps, scale),
                        dtype)
        return None, None, None, both[:n] if need_a else None, both[n:]


class _OneTileMask(torch.autograd.Function):
    """A single set with a dense 0/1 relation of any number of positives per row (SupCon by labels), rows
    weighted: ``out_i = alpha_i LSE_i - beta_i sum_p P_ip S_ip`` (the self pair left out), reduced by ``total``.
    Backward: ``H = G + G^T`` with ``G_ij = u_i e_ij / sum_i + P_ij c_i``, ``u = g c alpha``, ``c_i = -g c beta_i``."""

    @staticmethod
    def forward(ctx: Any, plan: SoftmaxPlan, total: tuple[Any, Any], scale: float, a: Tensor,  # type: ignore[override]
                alpha: Tensor | None, beta: Tensor | None) -> Tensor:
        rows, denom, norm = l2_normalize(to_compute(a, None, 1.0)[0], plan.eps)
        s = torch.addmm(zero(rows), rows, rows.t(), beta=0, alpha=scale)
        n = s.shape[0]
        weight = cast("Positives", plan.positives).tile_values(0, n, 0, n, s.dtype)  # converted once per relation
        row_pos = torch.linalg.vecdot(s, weight)  # before the tile is exponentiated in place
        e = s.exp_()
        e.diagonal().zero_()  # the self pair
        row_sum = e.sum(1)
        row_out = weighted_grad(log_total(row_sum, None, plan, n), alpha) - weighted_grad(row_pos, beta)
        ctx.plan, ctx.total, ctx.scale, ctx.dtype = plan, total, scale, a.dtype
        save_for_backward(ctx, rows, denom, norm, e, row_sum, weight, alpha, beta)
        return scalar_total(row_out, None, total)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        first_order_only()
        rows, denom, norm, e, row_sum, weight, alpha, beta = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        uniform = as_dtype(g * ctx.total[0], rows.dtype)  # d loss / d out_i, the same for every row
        w = weighted_grad(uniform, alpha) / row_sum  # each row's soft-max weight u / sum exp
        c = (-uniform if beta is None else -weighted_grad(uniform, beta)).expand(rows.shape[0])  # the positives' coefficient
        grad_tile = (w.unsqueeze(1) + w).mul_(e)  # both roles of every pair (H = G + G^T)
        grad_tile.addcmul_(weight, c[:, None])
        # P^T read as P: one set's key relation is symmetric (the same keys both ways, the diagonal cleared),
        # so the values are P^T's, read without the transposed walk (about 4x slower on a CPU)
        grad_tile.addcmul_(weight, c[None, :])
        ga = l2_normalize_backward(grad_tile @ rows, rows, denom, norm, plan.eps, scale)
        return None, None, None, as_dtype(ga, ctx.dtype), None, None


class OneTilePairs:
    """The executor of a :class:`~.plans.PairPlan` marked ``one_tile`` (PML's NT-Xent and NT-BXent with labels on
    one bounded tile): ``run(problem, plan)`` as :class:`~.pairwise.TorchPairs`'s, through one lean autograd
    function; per-row values (no ``combine``), a tensor scale and an ambient autocast go to the general executor."""

    def run(self, problem: Problem, plan: PairPlan) -> tuple[Tensor, ...]:
        stat = problem.statistic
        if not isinstance(stat, PairTerms):
            raise TypeError(f"the pair executor runs PairTerms problems, got {type(stat).__name__}")
        combine, scale, a = stat.combine, problem.scale, problem.anchors
        if combine is None or not isinstance(scale, float) or autocast_enabled(a.device.type):
            name_executor(plan.backend)  # explain() says which executor ran
            return TORCH_PAIRS.run(problem, plan)
        pairs = OneTilePairsFunction
        out = lean_apply(pairs)(plan, combine, scale, unwrap(a))
        noted = getattr(NOTED, "calls", None)
        if noted is not None:
            noted.append((pairs, plan, stat, scale, a, None, out))
        return (out,)


#: The one-tile pair executor (a form of the torch loops: :mod:`.torch_loops`).
ONE_TILE_PAIRS = OneTilePairs()


class OneTilePairsFunction(torch.autograd.Function):
    """One set's pair terms on one bounded tile: the kernel's ``single_fixed`` on the 0/1 label masks (the self pair
    in neither), combined and reduced (``combine``); backward ``(G + G^T) @ Z`` from ``single_grad_fixed_both``."""

    @staticmethod
    def forward(ctx: Any, plan: PairPlan, combine: Any, scale: float, a: Tensor) -> Tensor:  # type: ignore[override]
        rows, denom, norm = l2_normalize(to_compute(a, None, 1.0)[0], plan.eps)
        s = torch.addmm(zero(rows), rows, rows.t(), beta=0, alpha=scale)
        n = s.shape[0]
        kernel = KERNELS[plan.kernel]
        ctx.plan, ctx.combine, ctx.scale, ctx.dtype, ctx.kernel = plan, combine, scale, a.dtype, kernel
        pos = plan.positives.tile_values(0, n, 0, n, rows.dtype)  # converted once per relation
        outputs, kept = single_fixed(kernel, s, pos, combine)  # the self pair on the diagonal; every other pair a negative
        save_for_backward(ctx, rows, denom, norm, *kept)
        return combined(outputs, combine)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        first_order_only()
        rows, denom, norm, *kept = ctx.saved_tensors
        grads = combined_grads(g, ctx.combine, rows.shape[0], rows.dtype)  # d loss / d out_k,i = total * w_k,i
        hx = ctx.kernel.single_grad_fixed_both(tuple(kept), grads) @ rows  # H = G + G^T: the relation is symmetric
        ga = l2_normalize_backward(hx, rows, denom, norm, ctx.plan.eps, ctx.scale)
        return None, None, None, as_dtype(ga, ctx.dtype)


#: Each lean function's ``apply`` C part, bound (:func:`lean_apply`).
_APPLIES = {f: C_APPLY.__get__(None, f) for f in (OneTileFunction, _OneTileMask, OneTilePairsFunction)}
