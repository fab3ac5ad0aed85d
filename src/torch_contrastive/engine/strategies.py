"""The engine's strategies by name: :data:`STRATEGIES` -- the registry the plan asks (``serves``) and
:func:`~.solve.solve` runs (``run``). A new strategy is one file with a :class:`~.strategy.Strategy`, an entry
here, and a rule in a device's policy (:mod:`.policy`) once a measurement on that device puts it there."""

from __future__ import annotations

from .epilogue import EPILOGUE
from .gemm import GEMM
from .strategy import Strategy
from .torch_loops import TORCH_LOOPS
from .triton_executors import TRITON

__all__ = ["STRATEGIES"]

#: Every strategy by its ``backend=`` name.
STRATEGIES: dict[str, Strategy] = {s.name: s for s in (TORCH_LOOPS, TRITON, EPILOGUE, GEMM)}
