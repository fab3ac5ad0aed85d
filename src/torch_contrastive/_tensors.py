"""Small tensor helpers shared by the positive relations and the engine (no imports of either)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["as_dtype", "clear_self_diagonal", "mask_as", "self_diagonal"]


def self_diagonal(tile: Tensor, r0: int, c0: int, self_offset: int | None) -> Tensor | None:
    """Strided view of the self pairs inside a tile (anchor i is candidate i + self_offset).

    A view, not index tensors: filling it is one strided write, and no index tensor is
    built per tile. ``None`` when the tile holds no self pair.
    """
    if self_offset is None:
        return None
    k = r0 + self_offset - c0
    if k >= tile.shape[1] or -k >= tile.shape[0]:
        return None
    return tile.diagonal(k)


def clear_self_diagonal(tile: Tensor, self_offset: int | None, r0: int = 0, c0: int = 0) -> None:
    """Zero the self pairs inside a tile in place (see :func:`self_diagonal`); nothing when it holds none."""
    diag = self_diagonal(tile, r0, c0, self_offset)
    if diag is not None:
        diag.zero_()


def mask_as(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask as 0/1 values of ``dtype``, through a uint8 view: converting bool
    directly takes a slow path on CPU (about 4x the time). Not under ``torch.compile``:
    inductor cannot lower a bool ``view(dtype)`` (torch 2.11: "torch.bool is not supported by
    torch.iinfo") and fuses the plain conversion anyway."""
    if mask.dtype != torch.bool or torch.compiler.is_compiling():
        return mask.to(dtype)
    return mask.view(torch.uint8).to(dtype)


def as_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in ``dtype`` (itself when it already is: ``.to`` costs a dispatch even then)."""
    return x if x.dtype == dtype else x.to(dtype)
