"""Count host synchronisations of a piece of PyTorch code (on any device).

Two sources are counted: operators whose output depends on device values on the host
(``aten._local_scalar_dense`` behind ``.item()``/``float(t)``/``bool(t)``, ``nonzero``,
``unique``, ``masked_select``, ...), seen through a ``TorchDispatchMode``, and the tensor
methods that copy values to Python without dispatching an operator on CPU (``tolist``,
``item``, ``__bool__``, ``__float__``, ``__int__``), seen by wrapping them. On a GPU
each of these is a full device stall.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Operators that read device values on the host or produce data-dependent shapes.
SYNC_OPERATORS = frozenset({
    "_local_scalar_dense", "nonzero", "nonzero_static", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
    "masked_select", "equal", "is_nonzero", "repeat_interleave", "bincount", "histc",
})
_METHODS = ("tolist", "item", "__bool__", "__float__", "__int__", "__index__")


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []
        self.depth = 0  # > 0 inside a wrapped tensor method, which is counted once itself

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if self.depth == 0:
            if name in SYNC_OPERATORS:
                self.events.append(name)
            elif name in ("index", "index_put", "index_put_") and _has_bool_index(args):
                self.events.append(f"{name}(bool mask)")  # a data-dependent shape: nonzero inside
        return func(*args, **(kwargs or {}))


def _has_bool_index(args: Any) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ()))


def host_sync_events(fn: Callable[[], Any]) -> list[str]:
    """Run ``fn()`` and return the names of the host synchronisations it made, in order."""
    counter = _Counter()
    originals = {name: getattr(torch.Tensor, name) for name in _METHODS}

    def wrap(name: str, original: Any) -> Any:
        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if counter.depth == 0:  # a method calling another (item -> __float__) counts once
                counter.events.append(name)
            counter.depth += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                counter.depth -= 1
        return method

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        with counter:
            fn()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return counter.events


def count_host_syncs(fn: Callable[[], Any]) -> int:
    """Number of host synchronisations ``fn()`` makes (see :func:`host_sync_events`)."""
    return len(host_sync_events(fn))
