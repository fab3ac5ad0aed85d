"""Kept calls: a training loop's repeated small call, replayed without its set-up.

A loss call checks its arguments, builds its :class:`~torch_contrastive.engine.Problem`, looks up its
plan and hands the inputs to an executor. At the sizes where a call is bound by the host (a GPU's latency
is the Python that issues its kernels), that set-up is most of the call's Python: about 1,500 of CLIP's
2,700 bytecodes per step at 1,024 rows, against 750 for the whole dense formula. A training loop asks the
same question every step -- the same shapes, dtypes, devices and options -- so the answer is kept.

A loss wrapped by :func:`kept` runs its full path the first time a signature is seen. When that call
ended in exactly one lean one-tile function (:class:`~torch_contrastive.engine.one_tile.OneTileSoftmax`
records it) whose inputs were the caller's own feature tensors and whose output was the loss returned,
nothing else ran between them that the inputs' values could change: the call is kept as that function and
its arguments. A later call with the same signature runs the function alone.

The signature is everything the full path decides from: each argument's type, each feature tensor's shape,
dtype, device, layout and ``requires_grad``, the other arguments' values and types (``False`` and ``0`` are
told apart: the full path would refuse the second), how they were passed, and what outside the call a plan
reads (a simulated device, the GPU scratch budget, the product scheme, TF32). A call is never kept with a
tensor or container among its other arguments (a learnable temperature, ids, labels: values the set-up reads;
only ``bool``, ``int``, ``float``, ``str`` and ``None``), and the
full path runs whenever a kept call could not stand for it: under ``torch.compile``, during
:func:`~torch_contrastive.engine.explain`, under an ambient autocast, under a process group of several
ranks (the full path's warning, gathering), under a functorch transform, or when the one-tile executor was replaced.
A kept call calls the lean function's ``apply`` without the Python of ``torch.autograd.Function.apply``
(default arguments bound, functorch's dead wrappers unwrapped -- done here -- and transforms dispatched):
about 110 bytecodes a call (counted).

``validate=True`` keeps its meaning: a kept call reads the loss value once, as the full path does for such
a call, and on a non-finite value runs the full path, which names the offending argument.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor

from .. import distributed
from ..engine import one_tile, planner
from ..engine.problem import Softmax
from ..engine.solve import EXECUTORS

F = TypeVar("F", bound=Callable[..., Tensor])

#: Kept calls by their signature (at most :data:`LIMIT`: many distinct signatures start it afresh).
_KEPT: dict[Any, _Replay] = {}
LIMIT = 256
_ONE_TILE_KEY = (Softmax, "one_tile")
#: The types a kept call's other arguments may have: values, never tensors or containers the set-up reads.
_SCALARS = frozenset({bool, int, float, str, type(None)})


class _Replay(NamedTuple):
    function: Any  # the lean autograd function
    apply: Any  # its ``apply`` without the Python around the C part
    plan: Any
    total: tuple[Any, Any]
    scale: float
    validate: bool


#: A signature whose full path is not one lean call (several tiles, per-row values, ...): run as it is.
_NOT_KEPT: Any = object()


def clear() -> None:
    """Forget every kept call (the next call of each signature runs its full path)."""
    _KEPT.clear()


# autograd.Function.apply without its Python wrapper, which binds default arguments (the lean functions take none),
# unwraps functorch's dead wrappers (done here, in C) and sends calls under a functorch transform to functorch (never kept)
_C_APPLY = torch._C._FunctionBase.__dict__["apply"]
_unwrap = torch._C._functorch.unwrap_if_dead
_transforms_active = torch._C._are_functorch_transforms_active
# bound once: a kept call's Python is a few dozen bytecodes, and each attribute path costs some
_compiling = torch.compiler.is_compiling
_autocast = torch.is_autocast_enabled
_dist_initialized = torch.distributed.is_initialized if torch.distributed.is_available() else (lambda: False)
# the TF32 switch of fp32 GEMMs, read without the Python of ``torch.backends.cuda.matmul.allow_tf32``
_tf32 = getattr(torch._C, "_get_cublas_allow_tf32", lambda: bool(torch.backends.cuda.matmul.allow_tf32))


def kept(features: int) -> Callable[[F], F]:
    """Wrap a loss whose first ``features`` positional arguments are its feature tensors (1: a single
    set, the candidates are the anchors; 2: anchors and candidates) so its repeated calls are kept."""
    if features not in (1, 2):
        raise ValueError(f"features must be 1 or 2, got {features!r}")
    two = features == 2

    def wrap(loss: F) -> F:
        @functools.wraps(loss)
        def call(*args: Any, **kwargs: Any) -> Tensor:
            if _compiling():  # a traced call: no guards on kept calls
                return loss(*args, **kwargs)
            try:  # the signature (the module docstring); the arguments' values and types, how they were passed
                kinds = (*map(type, args), *map(type, kwargs.values()))
                if Tensor in kinds[features:]:  # ids, labels, a learnable temperature: the set-up reads their values
                    return loss(*args, **kwargs)
                a = args[0]
                b: Any = args[1] if two else None
                key = (loss, a.shape, a.dtype, a.device, a.layout, a.requires_grad,
                       (b.shape, b.dtype, b.device, b.layout, b.requires_grad) if two else None,
                       args[features:], tuple(kwargs.items()), kinds, planner._SIMULATED, planner._SIMULATED_AREA,
                       planner.GPU_BUDGET, planner.PRODUCTS, _tf32())
                replay = _KEPT.get(key)
            except (IndexError, AttributeError, TypeError):  # too few arguments, not tensors, an unhashable one: not kept
                return loss(*args, **kwargs)
            # whether a kept call may stand for the full path now (the module docstring's conditions), asked
            # before a call is kept as before one is replayed; inline: this is the kept call's whole Python
            if replay is _NOT_KEPT or type(a) is not Tensor or planner._LOG is not None or _transforms_active() or \
                    _autocast(a.device.type) or EXECUTORS[_ONE_TILE_KEY] is not one_tile.ONE_TILE or \
                    (_dist_initialized() and distributed.is_active()):
                return loss(*args, **kwargs)
            if replay is None:
                return _record(loss, key, features, kinds, args, kwargs)
            function = replay.function
            if "apply" in function.__dict__:  # a wrapped apply (a test counting calls) is called as it is
                out = function.apply(replay.plan, replay.total, replay.scale, a, b)
            else:  # autograd.Function.apply's C part (its Python serves functorch transforms: none is active here)
                out = replay.apply(replay.plan, replay.total, replay.scale, _unwrap(a), b if b is None else _unwrap(b))
            if replay.validate and not math.isfinite(out.item()):  # the full path's one read; it names the culprit
                return loss(*args, **kwargs)
            return out

        return call  # type: ignore[return-value]

    return wrap


def _record(loss: Callable[..., Tensor], key: Any, features: int, kinds: tuple[type, ...], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Tensor:
    """The full path, kept when it ended in one lean one-tile call on the caller's own features (``kinds``: the
    arguments' types, positional then keyword)."""
    noted = one_tile.NOTED
    previous = getattr(noted, "calls", None)
    calls: list[tuple[Any, ...]] = []
    noted.calls = calls
    try:
        out = loss(*args, **kwargs)
    finally:
        noted.calls = previous
    if len(_KEPT) >= LIMIT:
        _KEPT.clear()
    if len(calls) != 1 or not all(kind in _SCALARS for kind in kinds[features:]):
        _KEPT[key] = _NOT_KEPT  # the full path, every time, without this one's bookkeeping
        return out
    function, plan, total, scale, a, b, result = calls[0]
    if result is not out or a is not args[0] or b is not (args[1] if features == 2 else None):
        _KEPT[key] = _NOT_KEPT
        return out
    _KEPT[key] = _Replay(function, _C_APPLY.__get__(None, function), plan, total, scale, bool(kwargs.get("validate", True)))
    return out

