"""The engine's entry: :func:`solve` a :class:`~.problem.Problem` -- plan it, then run the strategy the plan
chose (:data:`~.strategies.STRATEGIES`)."""

from __future__ import annotations

from typing import Any, overload

from torch import Tensor

from .._tensors import refuse_transforms
from .problem import PairTerms, Prefixes, Problem, SigmoidPairs, Softmax
from .problem_plan import plan
from .strategies import STRATEGIES

__all__ = ["solve"]


@overload
def solve(problem: Problem[Softmax]) -> tuple[Tensor, Tensor | None]: ...
@overload
def solve(problem: Problem[PairTerms]) -> tuple[Tensor, ...]: ...
@overload
def solve(problem: Problem[SigmoidPairs]) -> Tensor: ...
@overload
def solve(problem: Problem[Prefixes]) -> Tensor: ...


def solve(problem: Problem[Any]) -> Any:
    """The statistic ``problem`` asks for, computed as :func:`~.problem_plan.plan` decides.

    Returns what the statistic's executor returns: :class:`~.problem.Softmax` ``(row_out,
    col_out or None)`` (the scalar first with ``total``), :class:`~.problem.PairTerms` the
    kernel's per-row outputs (one scalar with ``combine``), :class:`~.problem.SigmoidPairs` the
    (R,) row sums, :class:`~.problem.Prefixes` what its pass returns (the loss, per-row values or log-sum-exps).
    """
    refuse_transforms()
    chosen = plan(problem)
    return STRATEGIES[chosen.backend].run(problem, chosen)
