"""Input checks shared by every public entry point (README, "Errors").

Each check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError``
(wrong shape or value) with a message that names the argument and says what was
expected. None of them modifies its input.

Two kinds of check:

* metadata checks (type, dtype, ndim, shape, option values) run on the host and cost
  no device work; they always run;
* value checks (finite entries, index ranges, a positive tensor temperature) need
  device values. They are collected as 0-dim flags in a :class:`Checks` object and
  read back together in **one** transfer, so a call with ``validate=True`` makes at
  most one host synchronisation; ``validate=False`` skips them all.

Under ``torch.compile`` a read would break the graph (and fail ``fullgraph=True``), so a traced call with
``validate=True`` asserts each value check inside the graph instead (``torch._assert_async``): the compiled
step still refuses bad input, with a ``RuntimeError`` that names the argument (on CUDA a device-side
assertion, which ends the process), and nothing is read on the host.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

from .engine.planner import BACKENDS

_F = TypeVar("_F", bound=Callable[..., Any])

#: Integer dtypes accepted for indices (``pos_indices``).
INDEX_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
#: Dtypes accepted for labels and ids: integers, and bool for two classes.
LABEL_DTYPES = (*INDEX_DTYPES, torch.bool)

REDUCTIONS = ("mean", "sum", "none")
GRAD_REDUCTIONS = ("mean", "sum")
PAIRINGS = ("adjacent", "halves")
CONTRAST_MODES = ("all", "one")
NEGATIVE_MODES = ("unpaired", "paired")

#: Above this 1/tau a normalised loss could overflow fp32 (2 * scale + log N), so the
#: output is checked too; below it the result is finite by construction.
_SAFE_SCALE = 1e30


class Checks:
    """Device-side validity checks of one call, read back together.

    ``add`` records a 0-dim tensor with a host-side predicate that says whether its
    value is bad, and a function that builds the error message (called only on
    failure, when extra reads no longer matter). ``flush`` reads every value in one
    transfer -- and optionally one value the caller needs on the host -- and raises the
    first error.
    """

    def __init__(self, enabled: bool, scope: Any = None) -> None:
        #: value checks asserted inside a traced graph (``torch.compile`` with ``validate=True``): nothing is read
        self.asserting = bool(enabled) and torch.compiler.is_compiling()
        #: value checks read on the host (``validate=True`` outside a trace)
        self.enabled = bool(enabled) and not self.asserting
        #: value checks made at all, read or asserted
        self.active = bool(enabled)
        self.scope = scope
        self._values: list[Tensor] = []
        self._bad: list[Callable[[float], bool]] = []
        self._messages: list[Callable[[], str | None]] = []
        # finite checks left to the loss value (see finite(..., deferred=True) and finish)
        self._pending: list[tuple[Tensor, str]] = []
        self.reads = 0  # transfers so far (a caller adding values to the last one checks it is still to come)

    def add(self, value: Tensor, message: Callable[[], str | None], bad: Callable[[float], bool] = bool, *,
            what: str = "an input failed its value check") -> None:
        """Record ``value`` (0-dim); the call fails with ``message()`` when ``bad(value)``
        (unless the message is ``None``: the flag was a false alarm). ``bad`` is one of this module's
        predicates (``bool``: any non-zero flag is bad), each with a tensor twin; ``what`` is the message of a
        traced call, which cannot read values to build ``message()``."""
        if self.asserting:
            torch._assert_async(_TENSOR_OK[bad](value.detach()), f"torch-contrastive (validate=True, compiled): {what}")
        elif self.enabled:
            # a 0-dim value is kept as it is (its one read needs no view of it); packing several
            # happens without grad mode (see _pack)
            self._values.append(value if value.ndim == 0 else value.reshape(()))
            self._bad.append(bad)
            self._messages.append(message)

    def finite(self, x: Tensor, name: str, *, deferred: bool = False) -> None:
        """Every entry of ``x`` is finite.

        One sum (``isfinite(x).all()`` is several times slower): NaN or inf whenever an
        entry is; a rare overflow of finite entries is cleared by the exact check.

        ``deferred``: the check may be answered by the loss value instead (:meth:`finish`
        with ``covers=True``), which costs no reduction at all; any earlier read, or a
        ``finish`` that cannot vouch for ``x``, runs the reduction as usual.
        """
        if not self.active or x.numel() == 0:
            return
        if self.asserting:  # one exact flag inside the graph (no false alarm to clear later)
            self.add(torch.isfinite(x.detach()).all(), lambda: None, _false, what=f"{name} contains non-finite values (NaN or inf)")
            return
        if deferred:
            self._pending.append((x, name))
            return
        message = _finite_message(x, name)
        # detached: a reduction of a tensor that requires grad would record an autograd node.
        # (Across ranks the flags are max-reduced, which would lose a -inf or negative flag:
        # max |x| there, which is finite exactly when every entry is.)
        if self.scope is not None and self.scope.distributed:
            self.add(x.detach().abs().amax(), message, _not_finite)
            return
        # One plain sum: NaN or inf whenever an entry is. It can also overflow for finite
        # entries (|sum| > 3.4e38 in fp32, half inputs are summed in fp32): then the exact
        # check on the failure path clears the alarm (the message is None).
        total = x.detach().sum(dtype=torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else None)
        self.add(total, lambda: None if bool(torch.isfinite(x).all()) else message(), _not_finite)

    def _run_pending(self) -> None:
        pending, self._pending = self._pending, []
        for x, name in pending:
            self.finite(x, name)

    def finish(self, value: Tensor, *, covers: bool, overflow: Callable[[], str] | None,
               extra: tuple[Tensor, Callable[[list[float]], None]] | None = None) -> None:
        """The call's last read: every check recorded, and the loss ``value``.

        ``covers``: ``value`` is a scalar that is NaN or inf whenever an input given to
        ``finite(..., deferred=True)`` is (every such row meets every loss term through the
        engine's normalisation, see the callers); then that one value answers those checks
        and the offending argument is named afterwards. Otherwise they run as reductions.
        ``overflow``: the message for a non-finite loss from finite inputs (raw dot products
        can overflow); ``None`` when that cannot happen (then the value is not read for it).
        ``extra``: ``(values, receive)``: a 1-D tensor read in the same transfer, whose host
        values go to ``receive`` (e.g. an exclusion's per-tile flags, for the backward pass).
        """
        if self.asserting:
            if overflow is not None:
                self.add(value.detach().abs().amax(), lambda: None, _not_finite, what="the loss is not finite although every "
                         "input is: with normalize=False the logits overflowed; use normalize=True or a larger temperature")
            return
        if not self.enabled:
            return
        pending = self._pending
        if covers and pending and value.ndim == 0:
            self._pending = []
            if not self._values and extra is None and not (self.scope is not None and self.scope.distributed):
                # the common small call: the loss value is the only read, with nothing to pack
                self.reads += 1
                if not math.isfinite(value.item()):
                    raise ValueError(_covered_message(pending, overflow))
                return
            self.add(value, lambda: _covered_message(pending, overflow), _not_finite)
        else:
            self._run_pending()
            if overflow is not None:
                self.add(value.detach().abs().amax(), overflow, _not_finite)
        if extra is None:
            self.flush()
        else:
            extra[1](self.flush_values(extra[0]))

    def flush_values(self, values: Tensor) -> list[float]:
        """Like :meth:`flush`, with a 1-D tensor of values the caller needs on the host
        (e.g. a tile plan), read in the same single transfer."""
        return self._read(values.detach().reshape(-1))

    def flush(self, value: Tensor | None = None) -> float | None:
        """Read every check (and ``value``) in one transfer; raise the first failure.

        Under ``gather=True`` the checks are max-reduced over ranks first (NaN counts as
        the largest), so every rank raises when any rank has bad input and none is left
        waiting in a collective.
        """
        self._run_pending()
        if not self._values and value is None:
            return None
        host = self._read(None if value is None else value.detach().reshape(1))
        return host[-1] if value is not None else None

    def _read(self, extra: Tensor | None) -> list[float]:
        """Read the checks and ``extra`` in one transfer, raise the first failure, reset.

        Returns the host values of ``extra`` (empty list without it).
        """
        self._run_pending()
        self.reads += 1
        n = len(self._values)
        distributed = self.scope is not None and self.scope.distributed and n > 0
        if n == 1 and extra is None and not distributed:
            host = [self._values[0].item()]  # one value: no packing
        else:
            checked = _pack(self._values)
            if distributed:
                checked = checked.nan_to_num(nan=math.inf)  # MAX would drop a NaN on some backends
                self.scope.all_max(checked)
            if extra is not None:
                checked = torch.cat([checked.to(device=extra.device, dtype=torch.float64), extra.to(torch.float64)])
            host = checked.tolist()
        bad, messages = self._bad, self._messages
        self._values, self._bad, self._messages = [], [], []
        for is_bad, message, got in zip(bad, messages, host):
            if is_bad(got):
                text = message()
                if text is not None:  # None: a cheap flag's false alarm, cleared by the exact check
                    raise ValueError(text)
        return host[n:]


def _covered_message(pending: list[tuple[Tensor, str]], overflow: Callable[[], str] | None) -> str:
    """Why a loss value that answers deferred finite checks is not finite: the first non-finite
    input by name, else the overflow (failure path only: reads the inputs again)."""
    for x, name in pending:
        if not bool(torch.isfinite(x).all()):
            return _finite_message(x, name)()
    return overflow() if overflow is not None else (
        "the loss is not finite although every input is (please report this with the inputs)")


def _finite_message(x: Tensor, name: str) -> Callable[[], str]:
    """The error message of a failed finite check of ``x`` (reads ``x`` again: failure path only)."""

    def message() -> str:
        rows = torch.isfinite(x).reshape(x.shape[0], -1).all(dim=1)
        if bool(rows.all()):  # the flag came from another rank (gather=True)
            return f"{name} contains non-finite values (NaN or inf) on another rank"
        return (f"{name} contains non-finite values (NaN or inf) in {int((~rows).sum())} of {x.shape[0]} rows "
                f"(first bad row: {int((~rows).nonzero()[0])})")

    return message


def _not_finite(value: float) -> bool:
    return not math.isfinite(value)


#: the host predicate of a value that must be finite (:meth:`Checks.add`)
not_finite = _not_finite


def _not_positive(value: float) -> bool:
    return not (math.isfinite(value) and value > 0)


#: the host predicate of a value that must be positive and finite (:meth:`Checks.add`)
not_positive = _not_positive


def _false(value: float) -> bool:
    return not value


#: Each host predicate of :meth:`Checks.add` as a tensor that is True where the value is good (a traced call's assertion).
_TENSOR_OK: dict[Callable[[float], bool], Callable[[Tensor], Tensor]] = {
    bool: lambda t: t == 0,
    _not_finite: torch.isfinite,
    _not_positive: lambda t: torch.isfinite(t) & (t > 0),
    _false: lambda t: t != 0,
}


def _pack(values: list[Tensor]) -> Tensor:
    """The 0-dim check values as one fp64 vector: one ``stack`` (and at most one cast)
    when they share a dtype, which is the common case (float flags of one call)."""
    if not values:
        return torch.zeros(0, dtype=torch.float64)
    dtype, device = values[0].dtype, values[0].device
    if any(t.device != device for t in values):  # a flag of a CPU-side argument (labels, a mask) beside CUDA ones
        values = [t.to(device) for t in values]
    with torch.no_grad():  # a flag may be a loss value that requires grad: the read records no graph
        if all(t.dtype == dtype for t in values):  # fp32 flags read exactly as Python floats: no cast
            packed = torch.stack(values)
            return packed if dtype in (torch.float32, torch.float64) else packed.to(torch.float64)
        return torch.cat([t.reshape(1).to(torch.float64) for t in values])


def check_embeddings(x: object, name: str, *, min_ndim: int = 2, max_ndim: int | None = 2, empty_rows: bool = False) -> Tensor:
    """A floating tensor with ``min_ndim <= ndim <= max_ndim`` and at least one row (metadata only).

    ``empty_rows``: zero rows are allowed (a queue or memory that has not filled yet),
    but not a zero feature size.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.ndim < min_ndim or (max_ndim is not None and x.ndim > max_ndim):
        expected = f"{min_ndim}" if max_ndim == min_ndim else f"at least {min_ndim}" if max_ndim is None else f"{min_ndim} to {max_ndim}"
        raise ValueError(f"{name} must have {expected} dimensions, got shape {tuple(x.shape)}")
    if x.numel() == 0 and not (empty_rows and x.shape[0] == 0 and all(d > 0 for d in x.shape[1:])):
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    return x




def in_callers_words(**names: str) -> Callable[[_F], _F]:
    """A wrapper for an entry point whose arguments the function it calls names otherwise (a
    module's ``forward``, a drop-in): a ``ValueError``/``TypeError`` raised inside names the
    caller's arguments -- every whole word ``inner=outer`` of ``names`` replaced. The happy path
    pays one frame; the message is rewritten only on failure."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except (ValueError, TypeError) as err:
                message = str(err)
                renamed = pattern.sub(lambda m: names[m.group(1)], message)
                if renamed == message or type(err) not in (ValueError, TypeError):
                    raise
                raise type(err)(renamed).with_traceback(err.__traceback__) from None

        return cast(_F, inner)

    return wrap


def named_non_finite(err: ValueError, tensors: Sequence[tuple[str, Tensor]]) -> ValueError:
    """``err`` of a call whose inputs were stacked or renamed before the loss checked them, with a
    non-finite input named as the caller gave it (its own rows counted); ``err`` itself when it is
    about something else. Failure path only: reads the inputs again."""
    if "non-finite" in str(err):
        for name, x in tensors:
            if isinstance(x, Tensor) and x.numel() and not bool(torch.isfinite(x).all()):
                return ValueError(_finite_message(x, name)())
    return err


def check_backend(backend: object) -> str:
    """``"auto"``, ``"torch"`` or ``"triton"`` (every loss in every form runs on each)."""
    check_choice(backend, "backend", BACKENDS)
    return str(backend)


def check_flag(value: object, name: str) -> bool:
    """A true ``bool`` (not 0/1, not a tensor)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_positive(value: object, name: str) -> float:
    """A finite number > 0 (a temperature, a scale's start): ``TypeError`` for another kind of object."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a positive float, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return float(value)


def check_fraction(value: object, name: str) -> float:
    """A float in [0, 1) (label smoothing)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a float in [0, 1), got {value!r}")
    return float(value)


def check_row_weight(weight: object, name: str, length: int, device: torch.device) -> Tensor:
    """A (length,) floating tensor of per-row weights on ``device`` (a weight that requires grad
    keeps its graph: the loss propagates into it)."""
    if not isinstance(weight, Tensor) or not weight.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor")
    if weight.ndim != 1 or weight.shape[0] != length:
        raise ValueError(f"{name} must have shape ({length},), got {tuple(weight.shape)}")
    return weight.to(device)


def check_memory(memory_emb: object, memory_labels: object, width: int, device: torch.device,
                 checks: Checks) -> tuple[Tensor, Tensor] | None:
    """``memory_emb`` (M, D) rows with ``memory_labels`` (M,) for a supervised loss, or None.

    Both or neither; ``D`` must be the batch's feature size; M may be 0 (a queue that
    has not filled yet).
    """
    if memory_emb is None and memory_labels is None:
        return None
    if memory_emb is None:
        raise ValueError("memory_labels was given without memory_emb")
    if memory_labels is None:
        raise ValueError("memory_emb needs memory_labels: positives among memory rows are found by label")
    emb = check_embeddings(memory_emb, "memory_emb", empty_rows=True)
    if emb.shape[1] != width:
        raise ValueError(f"memory_emb must have feature size {width} (as the batch), got {emb.shape[1]}")
    check_same_device(emb, "memory_emb", device)
    labels = check_labels(memory_labels, "memory_labels", emb.shape[0], device)
    checks.finite(emb, "memory_emb")
    return emb, labels


def check_labels(labels: object, name: str, length: int, device: torch.device) -> Tensor:
    """A 1-D integer (or bool) tensor of ``length`` entries, returned as int64 on ``device``."""
    if not isinstance(labels, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integers, got {type(labels).__name__}")
    if labels.dtype not in LABEL_DTYPES:
        raise TypeError(f"{name} must have an integer dtype (class or id per row), got {labels.dtype}")
    if labels.ndim != 1 or labels.shape[0] != length:
        raise ValueError(f"{name} must have shape ({length},), got {tuple(labels.shape)}")
    if labels.dtype == torch.int64 and labels.device == device:
        return labels
    return labels.to(device=device, dtype=torch.int64)


def check_pos_indices(pos_indices: object, n: int, device: torch.device, checks: Checks) -> Tensor:
    """A (P, 2) integer tensor of (row, column) pairs in ``[0, n)``, as int64 on ``device``.

    The range is a value check (recorded in ``checks``); until it is read, the returned
    indices are clamped into range so that no kernel indexes out of bounds.
    """
    if not isinstance(pos_indices, Tensor):
        raise TypeError(f"pos_indices must be a (P, 2) integer tensor, got {type(pos_indices).__name__}")
    if pos_indices.dtype not in INDEX_DTYPES:
        raise TypeError(f"pos_indices must have an integer dtype, got {pos_indices.dtype}")
    if pos_indices.ndim != 2 or pos_indices.shape[1] != 2:
        raise ValueError(f"pos_indices must have shape (P, 2), got {tuple(pos_indices.shape)}")
    p = pos_indices.to(device=device, dtype=torch.int64)
    if not checks.active or p.numel() == 0:
        return p
    checks.add(((p < 0) | (p >= n)).any(), lambda: (
        f"pos_indices must lie in [0, {n}) (rows of embeddings), got values in [{int(p.min())}, {int(p.max())}]"),
        what=f"pos_indices must lie in [0, {n}) (rows of embeddings)")
    return p.clamp(0, n - 1)


def check_mask(mask: object, bsz: int, device: torch.device, checks: Checks) -> Tensor:
    """A (bsz, bsz) mask of 0/1 (or bool) values, returned as bool on ``device``."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a ({bsz}, {bsz}) tensor, got {type(mask).__name__}")
    if mask.shape != (bsz, bsz):
        raise ValueError(f"mask must have shape ({bsz}, {bsz}), got {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        checks.add(((mask != 0) & (mask != 1)).any(), lambda: "mask must contain only 0 and 1", what="mask must contain only 0 and 1")
    return mask.to(device=device) != 0


def inverse_temperature(temperature: object, checks: Checks, *, name: str = "temperature",
                        need_bound: bool = False) -> tuple[Tensor | float, float | None]:
    """``1 / temperature`` and a host-side bound of it.

    A Python float is checked on the host and returned as a float (exact gradient is
    not needed). A 0-dim tensor keeps its autograd graph, so its gradient is exact;
    its value is a value check. With ``need_bound`` (the caller's fast path depends
    on the value) the checks are flushed now and the value read in the same single
    transfer; otherwise the bound is ``None`` and nothing is read.

    Returns:
        ``(scale, bound)``: ``scale`` is ``1 / temperature`` (float or 0-dim tensor),
        ``bound`` the value of ``scale`` if known on the host, else ``None``.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, Tensor)):
        raise TypeError(f"{name} must be a positive float or a 0-dim tensor, got {type(temperature).__name__}")
    if not isinstance(temperature, Tensor):
        value = float(temperature)
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be positive and finite, got {value}")
        return 1.0 / value, 1.0 / value
    t = check_scalar_tensor(temperature, name)
    checks.add(t, lambda: f"{name} must be positive and finite, got {float(t.detach())}", _not_positive,
               what=f"{name} must be positive and finite")
    scale = 1.0 / t
    if need_bound and checks.enabled:
        return scale, checks.flush(scale)
    return scale, None


def check_scalar_tensor(value: Tensor, name: str) -> Tensor:
    """A one-element floating tensor (a learnable scalar), returned as 0-dim (metadata only)."""
    if value.numel() != 1 or value.ndim > 1:
        raise ValueError(f"{name} must be a scalar (0-dim tensor), got shape {tuple(value.shape)}")
    if not value.is_floating_point():
        raise TypeError(f"{name} tensor must be floating point, got {value.dtype}")
    return value.reshape(())


def output_needs_check(normalize: bool, bound: float | None) -> bool:
    """Whether a finite-input loss could still overflow (raw dot products or a huge scale)."""
    return not normalize or bound is None or bound > _SAFE_SCALE


def check_choice(value: object, name: str, choices: Sequence[str]) -> str:
    """One of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_chunk_size(chunk_size: object) -> int | None:
    """``None`` or a positive int."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be None or a positive int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size}")
    return chunk_size


def check_options(*, reduction: object, chunk_size: object, grad_reduction: object, eps: object, backend: object = "auto") -> None:
    """The options every loss shares (also checked by the modules at construction)."""
    check_backend(backend)
    check_choice(reduction, "reduction", REDUCTIONS)
    check_choice(grad_reduction, "grad_reduction", GRAD_REDUCTIONS)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive float, got {eps!r}")
    check_chunk_size(chunk_size)


def check_same_device(t: Tensor, name: str, device: torch.device, of: str = "the batch") -> None:
    """``t`` on ``device``: an embedding on another device would fail deep inside a product (or copy
    across devices on every call), so it is refused here, by name."""
    if t.device != device:
        raise ValueError(f"{name} must be on the same device as {of} ({device}), got {t.device}")


def check_same_rows(a: Tensor, a_name: str, b: Tensor, b_name: str) -> None:
    """Equal batch sizes and feature shapes, on one device."""
    check_same_device(b, b_name, a.device, a_name)
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"{a_name} and {b_name} must have the same batch size, got {a.shape[0]} and {b.shape[0]}")
    if a.shape[1:] != b.shape[1:]:
        raise ValueError(f"{a_name} and {b_name} must have the same feature dimension, got {tuple(a.shape[1:])} and {tuple(b.shape[1:])}")
