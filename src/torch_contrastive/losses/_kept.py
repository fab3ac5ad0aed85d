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
reads (the :class:`~torch_contrastive.engine.planner.Target` planned for -- a simulated device, the GPU scratch
budget, the product scheme -- and TF32). A call is never kept with a
tensor or container among its other arguments (a learnable temperature, ids, a mask, a memory: values the set-up
reads; only ``bool``, ``int``, ``float``, ``str`` and ``None``) -- except a label loss's ``labels``, whose
shape, dtype and device are in the signature: its relation is new every step, so while its first call is kept
the loss notes the function that built the lean call's relation and statistic from the labels
(:func:`~torch_contrastive.engine.one_tile.note_rebuild`), the call is kept only when the lean call read
exactly those objects, and a kept call runs that function on its own labels and puts the relation into the
kept plan (in the form the plan was made for; another form -- a size rule changed -- runs the full path). The
full path runs whenever a kept call could not stand for it: under ``torch.compile``, during
:func:`~torch_contrastive.engine.explain`, under an ambient autocast, under a process group of several
ranks (the full path's warning, gathering), under a functorch transform, or when the lean executor was replaced.
A kept call calls the lean function's ``apply`` without the Python of ``torch.autograd.Function.apply``
(default arguments bound, functorch's dead wrappers unwrapped -- done here -- and transforms dispatched):
about 110 bytecodes a call (counted).

``validate=True`` keeps its meaning: a kept call reads the loss value once, as the full path does for such
a call, and on a non-finite value runs the full path, which names the offending argument.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor

from .. import distributed
from ..engine import one_tile, planner, recorded
from ..engine.problem import PairTerms, Softmax
from ..engine.torch_loops import TORCH_LOOPS

F = TypeVar("F", bound=Callable[..., Tensor])

#: Kept calls by their signature (at most :data:`LIMIT`: many distinct signatures start it afresh).
_KEPT: dict[Any, _Replay] = {}
LIMIT = 256
_ONE_TILE_KEY = (Softmax, "one_tile")
_PAIRS_KEY = (PairTerms, "one_tile")
#: The torch loops' forms (a test may replace one: then the full path), the lean forms by their key, and the pair
#: terms' lean functions.
_FORMS = TORCH_LOOPS.forms
_LEAN = {_ONE_TILE_KEY: one_tile.ONE_TILE, _PAIRS_KEY: one_tile.ONE_TILE_PAIRS}
_PAIRS = (one_tile.OneTilePairsFunction,)
#: The lean functions of a call without labels (a single positive on a strided layout): kept with their plan.
_STRIDED = (one_tile.OneTileFunction,)
#: The types a kept call's other arguments may have: values, never tensors or containers the set-up reads.
_SCALARS = frozenset({bool, int, float, str, type(None)})


class _Replay(NamedTuple):
    function: Any  # the lean autograd function
    apply: Any  # its ``apply`` without the Python around the C part
    plan: Any
    total: tuple[Any, Any] | None  # a call without labels: the statistic's total (with labels: rebuilt)
    scale: float
    validate: bool
    rebuild: Any  # a call with labels: labels -> (relation, statistic), the loss's own functions; else None
    grouped: bool  # a call with labels: its relation was grouped by key (else a dense mask), as the plan kept
    site: tuple[Any, Any]  # the key of the torch loops' form that made the lean call
    executor: Any  # that executor (another one registered there since: the full path)


#: A signature whose full path is not one lean call (several tiles, per-row values, ...): run as it is.
_NOT_KEPT: Any = object()


def clear() -> None:
    """Forget every kept call (the next call of each signature runs its full path)."""
    _KEPT.clear()


# autograd.Function.apply without its Python wrapper (one_tile.C_APPLY; calls under a functorch transform are never kept)
_C_APPLY = one_tile.C_APPLY
_unwrap = one_tile.unwrap
_transforms_active = one_tile.transforms_active
# bound once: a kept call's Python is a few dozen bytecodes, and each attribute path costs some
_compiling = torch.compiler.is_compiling
_autocast = torch.is_autocast_enabled
_dist_initialized = torch.distributed.is_initialized if torch.distributed.is_available() else (lambda: False)
_tf32 = planner.tf32  # the TF32 switch of fp32 GEMMs, read in C
_target = planner.target  # the device planned for (a simulated one inside planner.simulate)


def kept(features: int, labels: bool = False) -> Callable[[F], F]:
    """Wrap a loss whose first ``features`` positional arguments are its feature tensors (1: a single
    set, the candidates are the anchors; 2: anchors and candidates) so its repeated calls are kept.
    ``labels``: the loss has a ``labels`` argument, a tensor whose shape, dtype and device are part of the
    signature and whose values a kept call rebuilds its relation from (by the function the loss noted,
    :func:`~torch_contrastive.engine.one_tile.note_rebuild`)."""
    two = _two_sets(features)

    def wrap(loss: F) -> F:
        at = _position(loss, "labels") if labels else None
        @functools.wraps(loss)
        def call(*args: Any, **kwargs: Any) -> Tensor:
            if _compiling():  # a traced call: no guards on kept calls
                return loss(*args, **kwargs)
            try:  # the signature (the module docstring); the arguments' values and types, how they were passed
                kinds = (*map(type, args), *map(type, kwargs.values()))
                lab = others = None
                if Tensor in kinds[features:]:  # ids, labels, a learnable temperature: the set-up reads their values
                    lab, others = _labels_apart(args, kwargs, features, at)  # (a loss without labels: TypeError)
                    if kinds.count(Tensor) != features + 1:  # the labels the only other tensor
                        return loss(*args, **kwargs)
                a = args[0]
                b: Any = args[1] if two else None
                key = (loss, a.shape, a.dtype, a.device, a.layout, a.requires_grad,
                       (b.shape, b.dtype, b.device, b.layout, b.requires_grad) if two else None,
                       others or (args[features:], tuple(kwargs.items())), kinds, _target(a.device), _tf32())
                replay = _KEPT.get(key)
            except (IndexError, AttributeError, TypeError, KeyError):  # too few arguments, not tensors, an unhashable one
                return loss(*args, **kwargs)
            # whether a kept call may stand for the full path now (the module docstring's conditions), asked
            # before a call is kept as before one is replayed; inline: this is the kept call's whole Python
            if replay is _NOT_KEPT or type(a) is not Tensor or recorded.LOG is not None or _transforms_active() or \
                    _autocast(a.device.type) or (_dist_initialized() and distributed.is_active()):
                return loss(*args, **kwargs)
            if replay is None:
                return _record(loss, key, features, kinds, args, kwargs, lab)
            if _FORMS[replay.site] is not replay.executor:  # a replaced executor: the full path
                return loss(*args, **kwargs)
            function = replay.function
            inputs = (replay.plan, replay.total, replay.scale, _unwrap(a), b if b is None else _unwrap(b)) \
                if replay.rebuild is None else _rebuilt(replay, a, lab)
            if inputs is None:  # the relation's form changed under the signature (a size rule changed): the full path
                return loss(*args, **kwargs)
            # autograd.Function.apply's C part (its Python serves functorch transforms: none is active here); a
            # wrapped apply (a test counting calls) is called as it is
            out = function.apply(*inputs) if "apply" in function.__dict__ else replay.apply(*inputs)
            if replay.validate and not math.isfinite(out.item()):  # the full path's one read; it names the culprit
                return loss(*args, **kwargs)
            return out

        return call  # type: ignore[return-value]

    return wrap


def _rebuilt(replay: _Replay, a: Tensor, labels: Any) -> tuple[Any, ...] | None:
    """A kept label call's lean arguments: the relation and statistic from these labels, by the loss's own
    functions, in the kept plan; None when the relation came out in the other form than the plan's."""
    positives, stat = replay.rebuild(labels)
    if (positives.dense is None) is not replay.grouped:
        return None
    return one_tile.arguments(replay.function, replay.plan.with_relation(positives), stat, replay.scale, _unwrap(a), None)


def _two_sets(features: int) -> bool:
    if features not in (1, 2):
        raise ValueError(f"features must be 1 or 2, got {features!r}")
    return features == 2


def _position(loss: Callable[..., Any], name: str) -> int:
    """Where the argument ``name`` of ``loss`` may be passed positionally (past the last position: keyword-only)."""
    parameters = list(inspect.signature(loss).parameters.values())
    for i, p in enumerate(parameters):
        if p.name == name:
            return i if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else len(parameters)
    raise ValueError(f"{loss.__name__} has no argument {name!r}")


def _labels_apart(args: tuple[Any, ...], kwargs: dict[str, Any], features: int, at: int | None) -> tuple[Tensor, Any]:
    """The labels (at position ``at``, or the keyword ``labels``: else a KeyError; a tensor: else a TypeError, as
    for a loss without labels, ``at`` None), and the signature's part of the other arguments besides the features:
    their values without the labels, and the labels' shape, dtype and device."""
    if at is None:
        raise TypeError("a tensor argument other than labels")
    if len(args) > at:
        lab, others, named = args[at], (*args[features:at], *args[at + 1 :]), kwargs
    else:
        named = kwargs.copy()
        lab, others = named.pop("labels"), args[features:]
    if type(lab) is not Tensor:
        raise TypeError("labels that are not a tensor")
    return lab, (others, tuple(named.items()), lab.shape, lab.dtype, lab.device)


def _record(loss: Callable[..., Tensor], key: Any, features: int, kinds: tuple[type, ...], args: tuple[Any, ...],
            kwargs: dict[str, Any], lab: Tensor | None) -> Tensor:
    """The full path, kept when it ended in one lean one-tile call on the caller's own features (``kinds``: the
    arguments' types, positional then keyword); with labels (``lab``), when the loss noted how it rebuilds that
    call's relation and statistic from them."""
    noted = one_tile.NOTED
    previous = getattr(noted, "calls", None), getattr(noted, "rebuilds", None)
    calls: list[tuple[Any, ...]] = []
    rebuilds: list[tuple[Any, ...]] = []
    noted.calls, noted.rebuilds = calls, rebuilds
    try:
        out = loss(*args, **kwargs)
    finally:
        noted.calls, noted.rebuilds = previous
    if len(_KEPT) >= LIMIT:
        _KEPT.clear()
    _KEPT[key] = _NOT_KEPT  # the full path, every time, without this one's bookkeeping -- unless kept below
    allowed = (*_SCALARS, Tensor) if lab is not None else _SCALARS
    if len(calls) != 1 or not all(kind in allowed for kind in kinds[features:]):
        return out
    function, plan, stat, scale, a, b, result = calls[0]
    if result is not out or a is not args[0] or b is not (args[1] if features == 2 else None):
        return out
    rebuild = None
    if lab is not None:  # the call's relation and statistic must be the ones the noted function built
        if len(rebuilds) != 1 or rebuilds[0][1] is not plan.positives or rebuilds[0][2] is not stat:
            return out
        rebuild = rebuilds[0][0]
    elif function not in _STRIDED:  # a relation built without labels to rebuild it from: shapes alone (not kept)
        return out
    site = _PAIRS_KEY if function in _PAIRS else _ONE_TILE_KEY
    _KEPT[key] = _Replay(function, _C_APPLY.__get__(None, function), plan, None if rebuild else stat.total, scale,
                         bool(kwargs.get("validate", True)), rebuild, getattr(plan.positives, "dense", None) is None, site,
                         _LEAN[site])
    return out
