"""The engine's entry: :func:`solve` a :class:`~.problem.Problem` -- plan it, then run the
executor registered for its statistic and the plan's backend."""

from __future__ import annotations

from typing import Any, overload

from torch import Tensor

from .._tensors import refuse_transforms
from . import epilogue, one_tile, pairwise, sigmoid, softmax, triton_executors
from .problem import PairTerms, Problem, SigmoidPairs, Softmax
from .problem_plan import plan

__all__ = ["EXECUTORS", "solve"]


@overload
def solve(problem: Problem[Softmax]) -> tuple[Tensor, Tensor | None]: ...
@overload
def solve(problem: Problem[PairTerms]) -> tuple[Tensor, ...]: ...
@overload
def solve(problem: Problem[SigmoidPairs]) -> Tensor: ...


def solve(problem: Problem[Any]) -> Any:
    """The statistic ``problem`` asks for, computed as :func:`~.problem_plan.plan` decides.

    Returns what the statistic's executor returns: :class:`~.problem.Softmax` ``(row_out,
    col_out or None)`` (the scalar first with ``total``), :class:`~.problem.PairTerms` the
    kernel's per-row outputs (one scalar with ``combine``), :class:`~.problem.SigmoidPairs` the
    (R,) row sums.
    """
    refuse_transforms()
    chosen = plan(problem)
    return EXECUTORS[type(problem.statistic), chosen.executor].run(problem, chosen)


#: The executor of each (statistic, plan's executor: the backend, or ``"one_tile"`` for the lean one-tile
#: soft-max plan): an object with ``run(problem, plan)`` (and, under the one driver, its ``forward`` /
#: ``backward``). A new statistic is a description in ``problem.py``, its
#: plan in ``plans.py`` (built by the planner), its executors, and an entry per backend here.
EXECUTORS: dict[tuple[type, str], Any] = {
    (Softmax, "torch"): softmax.TORCH,
    (Softmax, "one_tile"): one_tile.ONE_TILE,
    (Softmax, "triton"): triton_executors.SOFTMAX,
    (Softmax, "epilogue"): epilogue.SOFTMAX,
    (PairTerms, "torch"): pairwise.TORCH,
    (PairTerms, "one_tile"): one_tile.ONE_TILE_PAIRS,
    (PairTerms, "triton"): triton_executors.PAIRS,
    (PairTerms, "epilogue"): epilogue.PAIRS,
    (SigmoidPairs, "torch"): sigmoid.TORCH,
    (SigmoidPairs, "triton"): triton_executors.SIGMOID,
    (SigmoidPairs, "epilogue"): epilogue.SIGMOID,
}
