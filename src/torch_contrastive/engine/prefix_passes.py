"""Matryoshka's prefix passes as the torch loops' form of :class:`~.problem.Prefixes` (:mod:`.torch_loops`).

A prefix loss describes its call as a :class:`~.problem.Problem` whose statistic is :class:`~.problem.Prefixes`;
:func:`~.solve.solve` plans it like every other problem (the device's policy picks the strategy, the plan holds the
strips, :func:`~.recorded.explain` lists it) and the torch loops hand it here, to the one pass it names: each
prefix's soft-max cross-entropy (:class:`~.prefixes.PrefixSoftmax`), row log-sum-exps
(:class:`~.prefix_lse.PrefixRowLSE`), pair terms (:class:`~.prefix_pairs.PrefixPairs`) or sigmoid pairs
(:class:`~.prefix_sigmoid.PrefixSigmoid`). Their strip loop walks ``plan.prefix.strip`` anchor rows at a time, the
band products of every prefix from one pass over the features.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from .prefix_lse import PrefixRowLSE
from .prefix_pairs import PrefixPairs
from .prefix_sigmoid import PrefixSigmoid
from .prefixes import PrefixSoftmax

if TYPE_CHECKING:
    from .plans import PrefixesPlan
    from .problem import Problem

__all__ = ["PREFIX_PASSES", "PrefixPasses"]

#: Each form's autograd function, and whether it takes one set's rows as ``candidates=None``.
FUNCTIONS: dict[str, tuple[Any, bool]] = {"softmax": (PrefixSoftmax, True), "row_lse": (PrefixRowLSE, True),
                                          "pairs": (PrefixPairs, False), "sigmoid": (PrefixSigmoid, False)}


class PrefixPasses:
    """The executor of :class:`~.problem.Prefixes` problems: ``run(problem, plan)`` applies the form's function to the
    rows, the plan's :class:`~.prefixes.PrefixPlan` and the statistic's own arguments."""

    def run(self, problem: Problem, plan: PrefixesPlan) -> Tensor:
        stat = problem.statistic
        function, one_set = FUNCTIONS[stat.form]
        candidates = None if one_set and problem.single else problem.candidates
        return function.apply(problem.anchors, candidates, plan.prefix, *stat.arguments)  # type: ignore[no-any-return]


#: The prefix passes (a form of the torch loops: :mod:`.torch_loops`).
PREFIX_PASSES = PrefixPasses()
