"""What an engine call decided, in words: :func:`explain` runs a call and returns its decisions.

The planner (:func:`~.planner.decide`) and the plan of a problem (:func:`~.problem_plan.plan`) log each decision
here while :func:`explain` runs; an executor that hands a call on names the one that ran it
(:func:`name_executor`). Off the hot path: outside :func:`explain` each hook is one test of a module global.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .planner import Decision
    from .plans import AnyPlan

__all__ = ["amend", "explain", "name_executor", "quiet", "record", "record_plan"]

# Set only while explain() runs (a module global: torch.compile guards on it being None).
LOG: list[Decision] | None = None


def record(decision: Decision) -> None:
    """Log a decision while :func:`explain` runs (:func:`~.planner.decide` calls it for each one it makes)."""
    if LOG is not None:
        LOG.append(decision)


def record_plan(found: AnyPlan) -> None:
    """A kept plan's decision, with its executor (read only while :func:`explain` runs: off the hot path)."""
    if LOG is not None:
        LOG.append(replace(found.decision, executor=found.executor))


def amend(decision: Decision) -> None:
    """While :func:`explain` runs, put ``decision`` in place of the one just recorded (a plan that shapes its own
    tiles after the decision: the prefix engine's strips)."""
    if LOG:
        LOG[-1] = decision


def name_executor(executor: str) -> None:
    """While :func:`explain` runs, name the executor in the decision just recorded: the plan chose it, and an
    executor that hands a call on (:mod:`.one_tile`'s per-call checks) names the one that ran it."""
    if LOG:
        LOG[-1] = replace(LOG[-1], executor=executor)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Plan without logging: a loss that asks the plan a question before its call (the label sort's tile) is
    not a second engine call in :func:`explain`'s answer."""
    global LOG
    previous, LOG = LOG, None
    try:
        yield
    finally:
        LOG = previous


def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Decision]:
    """The engine decisions a call makes: ``explain(tc.clip_loss, img, txt, 0.07)``.

    Runs ``fn(*args, **kwargs)`` once without autograd and returns one :class:`Decision`
    per engine call (``str(decision)`` says it in words). For a decision without running
    anything, call :func:`decide` itself.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a callable (a loss function or module), got {type(fn).__name__}")
    global LOG
    previous, LOG = LOG, []
    try:
        with torch.no_grad():
            fn(*args, **kwargs)
        return list(LOG)
    finally:
        LOG = previous
