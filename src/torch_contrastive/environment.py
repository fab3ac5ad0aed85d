"""The environment variables the library reads, each checked here, in one place, when it is read.

=====================================  ==========  ======================================================
variable                               default     what it sets
=====================================  ==========  ======================================================
``TORCH_CONTRASTIVE_TILE``             1024        rows per tile when ``chunk_size=None`` tiles a batch
``TORCH_CONTRASTIVE_DENSE_BUDGET``     8388608     bytes under which a CPU call is one tile
``TORCH_CONTRASTIVE_GPU_BUDGET``       1 GiB       scratch bytes for tiles on a GPU
``TORCH_CONTRASTIVE_PRODUCTS``         ``auto``    ``auto``, ``half`` or ``compute``: tensor-core products
``TORCH_CONTRASTIVE_AUTOTUNE``         ``1``       ``0`` or ``1``: the Triton kernels time their configs
=====================================  ==========  ======================================================

The sizes are read once, at import (a call never consults the environment on its hot path, and
``torch.compile`` traces module constants); a value that is not what the table says is a ``ValueError``
naming the variable, never a silent fallback (``TORCH_CONTRASTIVE_TILE=-5`` once made every tiled call 0).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["choice", "positive_int", "switch"]


def positive_int(name: str, default: int) -> int:
    """``name`` as a positive integer (``1e9`` and ``2**30``-style decimals accepted as whole numbers), else ``default``."""
    given = os.environ.get(name, "").strip()
    if not given:
        return default
    try:
        value = float(given)
    except ValueError:
        raise ValueError(f"{name} must be a positive integer, got {given!r}") from None
    if not value.is_integer() or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {given!r}")
    return int(value)


def choice(name: str, default: str, choices: Sequence[str]) -> str:
    """``name`` as one of ``choices``, else ``default``."""
    given = os.environ.get(name, "").strip() or default
    if given not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {given!r}")
    return given


def switch(name: str, default: bool) -> bool:
    """``name`` as ``0`` or ``1``, else ``default``."""
    given = os.environ.get(name, "").strip()
    if not given:
        return default
    if given not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {given!r}")
    return given == "1"
