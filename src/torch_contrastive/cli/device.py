"""Where the command-line programs run: ``--device`` and ``--precision``.

``--device auto`` is CUDA when a GPU is visible, else the CPU; under ``torchrun`` each rank
takes its local GPU (``LOCAL_RANK``). ``--precision auto`` is bf16 autocast on a GPU that
supports it and fp32 elsewhere (the CPU default is unchanged, bit for bit). The loss itself
always accumulates in fp32 (the library's engine).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class DeviceError(Exception):
    """A ``--device`` / ``--precision`` choice this machine cannot serve (exit 2)."""


def resolve_device(name: str, distributed: bool = False) -> torch.device:
    """The torch device for ``--device name``; under ``torchrun`` on CUDA, this rank's GPU."""
    if name not in DEVICES:
        raise DeviceError(f"--device takes {', '.join(DEVICES)}, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceError("--device cuda: no CUDA device is visible to PyTorch (try --device cpu)")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0")) if distributed else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise DeviceError(f"LOCAL_RANK {index} has no GPU: {torch.cuda.device_count()} visible")
    return torch.device("cuda", index)


def resolve_precision(name: str, device: torch.device) -> str:
    """``fp32``, ``bf16`` or ``fp16`` for ``--precision name`` on ``device``."""
    if name not in PRECISIONS:
        raise DeviceError(f"--precision takes {', '.join(PRECISIONS)}, got {name!r}")
    if name == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError("--precision bf16: this GPU has no bf16 support (use fp16 or fp32)")
    return name


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """Mixed precision for the encoders; nothing for fp32."""
    if precision == "fp32":
        yield
        return
    with torch.autocast(device.type, dtype=_DTYPES[precision]):
        yield
