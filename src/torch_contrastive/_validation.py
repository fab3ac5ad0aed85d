"""Input checks shared by every public entry point (SPEC section 7).

Each check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError``
(wrong shape or value) with a message that names the argument and says what was
expected. None of them modifies its input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)


def check_embeddings(x: object, name: str, *, min_ndim: int = 2, max_ndim: int | None = 2) -> Tensor:
    """A floating tensor with ``min_ndim <= ndim <= max_ndim``, at least one row, all finite."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.ndim < min_ndim or (max_ndim is not None and x.ndim > max_ndim):
        expected = f"{min_ndim}" if max_ndim == min_ndim else f"at least {min_ndim}" if max_ndim is None else f"{min_ndim} to {max_ndim}"
        raise ValueError(f"{name} must have {expected} dimensions, got shape {tuple(x.shape)}")
    if x.shape[0] == 0 or x[0].numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    finite = torch.isfinite(x).reshape(x.shape[0], -1).all(dim=1)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise ValueError(
            f"{name} contains non-finite values (NaN or inf) in {bad} of {x.shape[0]} rows "
            f"(first bad row: {int((~finite).nonzero()[0])})"
        )
    return x


def check_labels(labels: object, name: str, length: int, device: torch.device) -> Tensor:
    """A 1-D integer (or bool) tensor of ``length`` entries, returned as int64 on ``device``."""
    if not isinstance(labels, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integers, got {type(labels).__name__}")
    if labels.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"{name} must have an integer dtype (class or id per row), got {labels.dtype}")
    if labels.ndim != 1 or labels.shape[0] != length:
        raise ValueError(f"{name} must have shape ({length},), got {tuple(labels.shape)}")
    return labels.to(device=device, dtype=torch.int64)


def check_temperature(temperature: object, name: str = "temperature") -> Tensor:
    """A positive finite float or 0-dim tensor; returns ``1 / temperature`` as a tensor.

    The result keeps the autograd graph of a tensor temperature, so its gradient is exact.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, Tensor)):
        raise TypeError(f"{name} must be a positive float or a 0-dim tensor, got {type(temperature).__name__}")
    if isinstance(temperature, Tensor):
        if temperature.numel() != 1 or temperature.ndim > 1:
            raise ValueError(f"{name} must be a scalar (0-dim tensor), got shape {tuple(temperature.shape)}")
        if not temperature.is_floating_point():
            raise TypeError(f"{name} tensor must be floating point, got {temperature.dtype}")
        value = float(temperature.detach())
    else:
        value = float(temperature)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be positive and finite, got {value}")
    if isinstance(temperature, Tensor):
        return 1.0 / temperature.reshape(())
    return torch.tensor(1.0 / value, dtype=torch.float64)


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


def check_same_rows(a: Tensor, a_name: str, b: Tensor, b_name: str) -> None:
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"{a_name} and {b_name} must have the same batch size, got {a.shape[0]} and {b.shape[0]}")
    if a.shape[1:] != b.shape[1:]:
        raise ValueError(f"{a_name} and {b_name} must have the same feature dimension, got {tuple(a.shape[1:])} and {tuple(b.shape[1:])}")
