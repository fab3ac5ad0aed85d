"""The engine's numbers: the compute dtype, when the bounded one-``exp`` regime is exact, autocast."""

from __future__ import annotations

import torch
from torch import Tensor

_MAX_FIXED_SCALE = {torch.float32: 40.0, torch.float64: 340.0}


Scale = Tensor | float


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the engine computes in: fp64 stays fp64, everything else is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fixed_scale_applies(bounded: bool, scale_bound: float | None, dtype: torch.dtype) -> bool:
    """Whether the fixed (no-shift) algorithm is exact.

    Args:
        bounded: every input row has norm <= 1 (L2-normalised), so ``|S| <= scale``.
        scale_bound: a host-side upper bound of ``scale`` (``None``: unknown, e.g. a
            learnable temperature under ``validate=False``, which never reads it).
        dtype: the input dtype.
    """
    return bounded and scale_bound is not None and scale_bound <= _MAX_FIXED_SCALE[compute_dtype(dtype)]


def autocast_enabled(device_type: str) -> bool:
    """Whether an autocast region is active for ``device_type`` (cheaper than entering a
    disabling context on every call)."""
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except TypeError:  # torch < 2.4 takes no argument
        return bool(torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled())


_ZEROS: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def zero(like: Tensor) -> Tensor:
    """A 0-dim zero of ``like``'s dtype and device, made once: the ignored or broadcast base of a
    fused op (``addmm`` with ``beta=0``, ``addcmul``) costs no allocation per call."""
    key = (like.dtype, like.device)
    found = _ZEROS.get(key)
    if found is None:
        found = torch.zeros((), dtype=like.dtype, device=like.device)
        if not torch.compiler.is_compiling():  # a traced tensor kept in a module would outlive its trace
            _ZEROS[key] = found
    return found


_ONES: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def ones(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``n`` ones of ``dtype`` on ``device`` as one stored value expanded (read-only): a count's summands
    (``index_add_``'s source) without an op per call."""
    key = (dtype, device)
    found = _ONES.get(key)
    if found is None:
        found = torch.ones((), dtype=dtype, device=device)
        if not torch.compiler.is_compiling():  # a traced tensor kept in a module would outlive its trace
            _ONES[key] = found
    return found.expand(n)
