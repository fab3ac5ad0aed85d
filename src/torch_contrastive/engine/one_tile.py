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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from .._tensors import as_dtype
from .driver import first_order_only, to_compute
from .normalization import l2_normalize, l2_normalize_backward
from .precision import autocast_enabled, zero
from .problem import Problem, Softmax
from .softmax import TORCH, _total
from .softmax_tiles import _put

if TYPE_CHECKING:
    from .plans import SoftmaxPlan
    from .softmax_tiles import FlatPlaces

__all__ = ["ONE_TILE"]


class OneTileSoftmax:
    """The executor of a plan marked ``one_tile`` (:func:`~.planner.one_tile`): ``run(problem, plan)`` as :class:`~.softmax.TorchSoftmax`'s.

    What the plan key cannot see is checked per call, in a few attribute reads, and sends the call to
    the general executor: a reduction outside the engine (per-row values), a tensor scale (a learnable
    temperature's gradient, or a value to keep off the host), an ambient autocast."""

    def run(self, problem: Problem, plan: SoftmaxPlan) -> tuple[Tensor, Tensor | None]:
        stat = problem.statistic
        if not isinstance(stat, Softmax):
            raise TypeError(f"the soft-max executor runs Softmax problems, got {type(stat).__name__}")
        total, scale, a = stat.total, problem.scale, problem.anchors
        if total is None or not isinstance(scale, float) or autocast_enabled(a.device.type):
            return TORCH.run(problem, plan)
        return _OneTile.apply(plan, total, scale, a, None if problem.single else problem.candidates), None


#: The one-tile soft-max executor (the engine's registry, :data:`~.solve.EXECUTORS`).
ONE_TILE = OneTileSoftmax()


class _OneTile(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: SoftmaxPlan, total: tuple[Any, Any], scale: float, a: Tensor,  # type: ignore[override]
                b: Tensor | None) -> Tensor:
        places = cast("FlatPlaces", plan.places)  # one_tile plans have them
        ctx.dtype = a.dtype  # the planner gave two sets one dtype
        # (a single set is its own candidates; two sets are normalised as one stack: each op once for both)
        rows, denom, norm = l2_normalize(to_compute(a if b is None else torch.cat((a, b)), None, 1.0)[0], plan.eps)
        za, zb = (rows, rows) if b is None else (rows[: a.shape[0]], rows[a.shape[0] :])
        e = torch.addmm(zero(za), za, zb.t(), beta=0, alpha=scale).exp_()
        exp_pos = torch.take(e, places.positives)  # before the clearing
        _put(e, places.left_out, places.zeros)
        excess = e.sum(1)
        row_total = excess + exp_pos
        d = torch.log1p(excess / exp_pos)
        col_excess = col_total = d_col = None
        if plan.columns:  # the identity layout: column j's positive is row j's
            col_excess = e.sum(0)
            col_total = col_excess + exp_pos
            d_col = torch.log1p(col_excess / exp_pos)
        ctx.plan, ctx.total, ctx.scale, ctx.single = plan, total, scale, b is None
        ctx.save_for_backward(rows, denom, norm, e, row_total, excess, col_total, col_excess)
        return _total(d, d_col, total)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        first_order_only()
        rows, denom, norm, e, row_total, excess, col_total, col_excess = ctx.saved_tensors
        plan, total, scale, dtype = ctx.plan, ctx.total, ctx.scale, ctx.dtype
        places = cast("FlatPlaces", plan.places)
        uniform = as_dtype(g * total[0], rows.dtype)  # d loss / d d_i, the same for every row
        w = uniform / row_total  # each row's soft-max weight u / sum exp
        c = torch.addcmul(zero(w), w, excess, value=-1)  # the kept-apart positive's coefficient -w * excess
        if ctx.single:  # H = G + G^T = (w_i + w_j) e_ij, each positive in both roles; one product
            grad_tile = (w.unsqueeze(1) + w).mul_(e)
            _put(grad_tile, places.both, torch.cat([c, c]), accumulate=True)
            ga = l2_normalize_backward(grad_tile @ rows, rows, denom, norm, plan.eps, scale)
            return None, None, None, as_dtype(ga, dtype), None
        n = e.shape[0]
        za, zb = rows[:n], rows[n:]
        if col_total is not None:
            uniform_col = uniform if total[1] is total[0] else as_dtype(g * total[1], rows.dtype)
            w_col = uniform_col / col_total
            grad_tile = (w[:, None] + w_col).mul_(e)
            grad_tile.diagonal().add_(c + torch.addcmul(zero(w_col), w_col, col_excess, value=-1))
        else:
            grad_tile = e * w[:, None]
            _put(grad_tile, places.positives, c, accumulate=True)
        need_a, need_b = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        if not need_b:
            ga = l2_normalize_backward(grad_tile @ zb, za, denom[:n], norm[:n], plan.eps, scale)
            return None, None, None, as_dtype(ga, dtype), None
        both = as_dtype(l2_normalize_backward(torch.cat([grad_tile @ zb, grad_tile.t() @ za]), rows, denom, norm, plan.eps, scale),
                        dtype)
        return None, None, None, both[:n] if need_a else None, both[n:]
