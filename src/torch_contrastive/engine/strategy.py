"""What a strategy of the engine is: one way of computing the statistics, in one file.

A strategy has a ``name`` (the ``backend=`` a caller may ask for), ``serves(problem, on)`` -- None when it can
run the :class:`~.problem.Problem` planned for the :class:`~.planner.Target` ``on``, else why not, in words -- and
``run(problem, plan)``, forward and backward, through the executor of the statistic and the plan's form it holds
in ``forms``. Each device's policy (:mod:`.policy`) is an ordered list of strategies by name; the plan
(:mod:`.problem_plan`) takes the first whose rule covers the call and that serves it, and :func:`~.solve.solve`
runs it. The strategies are :mod:`.torch_loops` (every device: ATen ops only), :mod:`.triton_executors` (the
fused Triton kernels) and :mod:`.epilogue` (cuBLAS GEMMs with Triton epilogues), registered in
:mod:`.strategies`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .planner import Target
    from .plans import AnyPlan
    from .problem import Problem

__all__ = ["Strategy"]


class Strategy:
    """The base of the engine's strategies: ``run`` hands the plan to the executor of its statistic and form.

    Attributes:
        name: the strategy's ``backend=`` name.
        forms: the executor of each (statistic class, plan's executor name: the strategy's name, or ``"one_tile"``
            for the torch loops' lean one-tile form) -- an object with ``run(problem, plan)``.
    """

    name: str = ""

    def __init__(self, forms: dict[tuple[type, str], Any]) -> None:
        self.forms = forms

    def serves(self, problem: Problem, on: Target) -> str | None:
        """None when this strategy can run ``problem`` planned for ``on``, else why not (in words)."""
        raise NotImplementedError

    def run(self, problem: Problem, plan: AnyPlan) -> Any:
        """The statistic of ``problem`` computed as ``plan`` says, forward and backward (one autograd node)."""
        form = self.forms.get((type(problem.statistic), plan.executor))
        if form is None:  # a plan is made for the strategy that serves it: a bug, never a user's input
            raise RuntimeError(f"the {self.name!r} strategy has no {plan.executor!r} form for "
                               f"{type(problem.statistic).__name__}")
        return form.run(problem, plan)
