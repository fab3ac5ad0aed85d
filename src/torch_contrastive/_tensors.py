"""Small tensor helpers shared by the positive relations and the engine (no imports of either)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["as_dtype", "clear_self_diagonal", "mask_as", "refuse_transforms", "save_for_backward", "self_diagonal"]


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


def save_for_backward(ctx: object, *tensors: Tensor | None) -> None:
    """``ctx.save_for_backward(*tensors)``, each saved tensor its own storage while ``torch.compile`` traces.

    Dynamo traces an autograd function's forward as a subgraph whose saved tensors become extra outputs, and
    it refuses one that shares storage with an earlier tensor of that subgraph -- a view, or the result of an
    in-place op such as ``exp_()`` on a tile (torch 2.13: "an intermediate tensor ... aliases an input or
    output"). A traced call therefore saves copies, which the compiler plans as ordinary buffers; an eager
    call saves the tensors themselves, copying nothing.
    """
    if torch.compiler.is_compiling():
        tensors = tuple(None if t is None else t.clone() for t in tensors)
    ctx.save_for_backward(*tensors)  # type: ignore[attr-defined]


def refuse_transforms() -> None:
    """Refuse a call under a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``, ...): the losses are custom
    autograd functions without functorch rules, and autograd's own refusal ("must override the setup_context
    staticmethod") does not say what to do instead."""
    if torch._C._are_functorch_transforms_active():
        raise NotImplementedError("torch-contrastive losses do not support torch.func transforms (grad, vmap, jacrev, ...): "
                                  "differentiate with loss.backward() or torch.autograd.grad, "
                                  "and batch by concatenating rows instead of vmap")
