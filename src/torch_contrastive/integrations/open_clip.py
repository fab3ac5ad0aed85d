"""open_clip's ``ClipLoss`` and ``SigLipLoss`` in open_clip's call form, computed by torch-contrastive.

Swap ``from open_clip.loss import ClipLoss, SigLipLoss`` for this module and keep the
training loop: ``loss(image_features, text_features, logit_scale[, logit_bias],
output_dict=False)``, with ``logit_scale`` the multiplier (open_clip passes
``model.logit_scale.exp()``) and features already normalised by the model (no
normalisation here, as open_clip).

open_clip's distributed options in this package's terms (rank and world size come from
the arguments, as open_clip, and must agree with the running process group):

=================  ===============  ==========================================================
``local_loss``     ``gather_with_grad``  here
=================  ===============  ==========================================================
False              False            ``clip_loss(gather=True, grad_reduction="sum")``: the global
                                    loss on every rank, each rank's gradient only through its
                                    own rows (as open_clip's re-inserted local slice)
False              True             ``clip_loss(gather=True, grad_reduction="mean")``: the
                                    global loss, full-batch gradients under DDP averaging
True               True             ``clip_loss(gather=True, reduction="none").mean()``: this
                                    rank's rows against every candidate, gradients summed back
True               False            this rank's rows against detached candidates (open_clip's
                                    cheaper, biased gradient), computed in row strips
=================  ===============  ==========================================================

``SigLipLoss`` in a process group is ``siglip_loss(gather=True, reduction="none")`` summed
over this rank's images and divided by their number: open_clip's value on each rank (its
positive block plus ``negative_only`` blocks for the other ranks' texts) and its
gradients, whatever ``dist_impl`` moves the texts. Memory is O(N * D) in every case.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from .. import _validation as v
from ..distributed import is_active
from ..losses import clip_loss, siglip_loss
from ._strips import per_row_losses

__all__ = ["ClipLoss", "SigLipLoss"]


def _check_group(rank: int, world_size: int) -> bool:
    """True when the loss runs distributed; the arguments must describe the process group."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if world_size <= 1:
        return False
    if not is_active() or torch.distributed.get_world_size() != world_size or torch.distributed.get_rank() != rank:
        raise ValueError(f"rank={rank}, world_size={world_size} do not match the running process group "
                         "(initialise torch.distributed first, with the same rank and world size)")
    return True


def _output(loss: Tensor, output_dict: bool, key: str) -> Tensor | dict[str, Tensor]:
    return {key: loss} if output_dict else loss


class ClipLoss(nn.Module):
    """open_clip's ``ClipLoss``: symmetric cross-entropy over ``logit_scale * I @ T.T``.

    Args:
        local_loss: open_clip's distributed option: each rank's rows against the gathered
            columns only (module docstring).
        gather_with_grad: open_clip's distributed option: the gathered rows carry gradients.
        cache_labels: accepted for compatibility (no labels are built here).
        rank: this process's rank.
        world_size: the number of processes.
        use_horovod: must be False (Horovod is not supported).
        chunk_size: tile edge / rows per strip (None: automatic).
        backend: the engine backend (:mod:`torch_contrastive.options`).
    """

    def __init__(self, local_loss: bool = False, gather_with_grad: bool = False, cache_labels: bool = False, rank: int = 0,
                 world_size: int = 1, use_horovod: bool = False, *, chunk_size: int | None = None,
                 backend: str = "auto") -> None:
        super().__init__()
        if use_horovod:
            raise ValueError("use_horovod=True is not supported: use torch.distributed (NCCL or gloo)")
        self.local_loss, self.gather_with_grad, self.cache_labels = (v.check_flag(local_loss, "local_loss"),
                                                                     v.check_flag(gather_with_grad, "gather_with_grad"),
                                                                     v.check_flag(cache_labels, "cache_labels"))
        self.rank, self.world_size = rank, world_size
        self.chunk_size, self.backend = chunk_size, backend

    @v.in_callers_words(image_feat="image_features", text_feat="text_features")
    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: float | Tensor,
                logit_bias: float | Tensor | None = None, output_dict: bool = False) -> Tensor | dict[str, Tensor]:
        # A bias shared by every logit cancels in each softmax: it changes neither value nor gradient.
        temperature = 1.0 / _checked_scale(logit_scale)
        common: dict[str, Any] = {"normalize": False, "chunk_size": self.chunk_size, "backend": self.backend}
        if not _check_group(self.rank, self.world_size):
            loss = clip_loss(image_features, text_features, temperature, **common)
        elif not self.local_loss:
            loss = clip_loss(image_features, text_features, temperature, gather=True,
                             grad_reduction="mean" if self.gather_with_grad else "sum", **common)
        elif self.gather_with_grad:
            loss = clip_loss(image_features, text_features, temperature, gather=True, reduction="none", **common).mean()
        else:
            loss = _local_detached(image_features, text_features, logit_scale, self.rank, self.chunk_size)
        return _output(loss, output_dict, "contrastive_loss")


def _checked_scale(logit_scale: object) -> float | Tensor:
    """open_clip's ``logit_scale`` (the multiplier) checked in its own name: a positive finite float or a
    one-element floating tensor (whose value the loss checks with its other device values, as ``1 /
    temperature``)."""
    if isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float, Tensor)):
        raise TypeError(f"logit_scale must be a positive float or a 0-dim tensor, got {type(logit_scale).__name__}")
    if isinstance(logit_scale, Tensor):
        return v.check_scalar_tensor(logit_scale, "logit_scale")
    if not math.isfinite(logit_scale) or logit_scale <= 0:
        raise ValueError(f"logit_scale must be positive and finite, got {logit_scale}")
    return float(logit_scale)


def _local_detached(image: Tensor, text: Tensor, logit_scale: float | Tensor, rank: int, chunk_size: int | None) -> Tensor:
    """open_clip's ``local_loss=True, gather_with_grad=False``: local rows against every
    rank's rows gathered without gradient (the local slice included)."""
    world = torch.distributed.get_world_size()
    text = text.to(image.dtype)
    gathered = []
    for x in (image, text):
        parts = [torch.empty_like(x) for _ in range(world)]
        torch.distributed.all_gather(parts, x.detach().contiguous())
        gathered.append(torch.cat(parts))
    image_all, text_all = gathered
    n, offset = image.shape[0], rank * image.shape[0]
    scale = logit_scale if isinstance(logit_scale, Tensor) else torch.tensor(float(logit_scale))

    def row_loss(start: int, stop: int, rows: Tensor, columns: Tensor, scale: Tensor) -> Tensor:
        wide = torch.float64 if rows.dtype == torch.float64 else torch.float32
        logits = scale.to(wide) * (rows[start:stop].to(wide) @ columns.to(wide).T)
        own = torch.arange(start, stop, device=rows.device) + offset
        return torch.logsumexp(logits, dim=1) - logits[torch.arange(stop - start, device=rows.device), own]

    per_image = per_row_losses(row_loss, n, text_all.shape[0], (image, text_all, scale.to(image.device)), chunk_size)
    per_text = per_row_losses(row_loss, n, image_all.shape[0], (text, image_all, scale.to(image.device)), chunk_size)
    return (per_image.mean() + per_text.mean()) / 2


class SigLipLoss(nn.Module):
    """open_clip's ``SigLipLoss``: ``-sum log sigmoid(z * (logit_scale * I @ T.T + logit_bias)) / N``.

    Args:
        cache_labels: accepted for compatibility.
        rank: this process's rank.
        world_size: the number of processes.
        dist_impl: open_clip's text exchange (``"bidir"``, ``"shift"``, ``"reduce"``,
            ``"gather"``): accepted; every choice gives the same value and gradients, and
            here the texts are gathered once.
        chunk_size: tile edge (None: automatic).
    """

    def __init__(self, cache_labels: bool = False, rank: int = 0, world_size: int = 1, dist_impl: str | None = None, *,
                 chunk_size: int | None = None) -> None:
        super().__init__()
        if dist_impl not in (None, "bidir", "shift", "reduce", "gather"):
            raise ValueError(f"dist_impl must be None, 'bidir', 'shift', 'reduce' or 'gather', got {dist_impl!r}")
        self.cache_labels, self.rank, self.world_size = v.check_flag(cache_labels, "cache_labels"), rank, world_size
        self.dist_impl = dist_impl or "bidir"
        self.chunk_size = chunk_size

    @v.in_callers_words(image_feat="image_features", text_feat="text_features")
    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: float | Tensor, logit_bias: float | Tensor,
                output_dict: bool = False) -> Tensor | dict[str, Tensor]:
        common: dict[str, Any] = {"normalize": False, "chunk_size": self.chunk_size}
        if _check_group(self.rank, self.world_size):
            per_image = siglip_loss(image_features, text_features, logit_scale, logit_bias, gather=True, reduction="none", **common)
            loss = per_image.sum() / image_features.shape[0]
        else:
            loss = siglip_loss(image_features, text_features, logit_scale, logit_bias, **common)
        return _output(loss, output_dict, "contrastive_loss")

    @v.in_callers_words(image_feat="image_features", text_feat="text_features")
    def negative_only_loss(self, image_features: Tensor, text_features: Tensor, logit_scale: float | Tensor,
                           logit_bias: float | Tensor) -> Tensor:
        """open_clip's ``_loss(..., negative_only=True)``: every pair a negative."""
        return siglip_loss(image_features, text_features, logit_scale, logit_bias, negative_only=True, normalize=False,
                           chunk_size=self.chunk_size)
