"""The engine's entry: :func:`solve` a :class:`~.problem.Problem` -- plan it, then run its executor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, overload

from torch import Tensor

from . import pairwise, sigmoid, softmax
from .planner import Decision, plan
from .problem import PairTerms, Problem, SigmoidPairs, Softmax

__all__ = ["solve"]


@overload
def solve(problem: Problem[Softmax]) -> tuple[Tensor, Tensor | None]: ...
@overload
def solve(problem: Problem[PairTerms]) -> tuple[Tensor, ...]: ...
@overload
def solve(problem: Problem[SigmoidPairs]) -> Tensor: ...


def solve(problem: Problem[Any]) -> Any:
    """The statistic ``problem`` asks for, computed as :func:`~.planner.plan` decides.

    Returns what the statistic's executor returns: :class:`~.problem.Softmax` ``(row_out,
    col_out or None)`` (the scalar first with ``total``), :class:`~.problem.PairTerms` the
    kernel's per-row outputs (one scalar with ``combine``), :class:`~.problem.SigmoidPairs` the
    (R,) row sums.
    """
    return EXECUTORS[type(problem.statistic)](problem, plan(problem))


#: The executor of each statistic: ``execute(problem, decision)``. A new statistic is a
#: description in ``problem.py``, its executor module, and one entry here.
EXECUTORS: dict[type, Callable[[Problem[Any], Decision], Any]] = {
    Softmax: softmax.execute,
    PairTerms: pairwise.execute,
    SigmoidPairs: sigmoid.execute,
}
