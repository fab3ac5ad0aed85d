"""``nn.Module`` twins of the functional losses: they only hold hyper-parameters.

Each module stores its options and, optionally, a learnable temperature in CLIP's
parameterisation (``logit_scale = log(1 / tau)``, initialised from ``temperature``
and clamped at ``log(100)`` when used, as OpenAI's CLIP does). ``forward`` accepts
the call forms of the peer libraries: ``loss(embeddings, labels)``
(pytorch-metric-learning), ``loss(features, labels)`` / ``loss(features, mask=...)``
(the SupCon authors), ``loss(image_features, text_features)`` (open_clip).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from . import _validation as v
from .losses import image_text_contrastive_loss, nt_bxent_loss, nt_xent_loss, supcon_loss

__all__ = ["ClipLoss", "ImageTextContrastiveLoss", "NTBXentLoss", "NTXentLoss", "SupConLoss"]

#: CLIP clamps its logit scale at 100 (temperature 0.01).
MAX_LOGIT_SCALE = math.log(100.0)


class _Temperature(nn.Module):
    """Holds a fixed temperature or a learnable ``logit_scale`` (one level, no deeper)."""

    def __init__(self, temperature: float, learnable: bool) -> None:
        super().__init__()
        v.check_temperature(temperature)
        self.learnable = bool(learnable)
        if self.learnable:
            self.logit_scale = nn.Parameter(torch.tensor(math.log(1.0 / float(temperature))))
        else:
            self.fixed_temperature = float(temperature)

    @property
    def temperature(self) -> float | Tensor:
        """The temperature in use: a float, or a 0-dim tensor with a gradient path."""
        if self.learnable:
            return torch.exp(-self.logit_scale.clamp(max=MAX_LOGIT_SCALE))
        return self.fixed_temperature

    def _common(self) -> str:
        if self.learnable:
            return f"logit_scale={float(self.logit_scale.detach()):.4f}"
        return f"temperature={self.fixed_temperature}"


class NTXentLoss(_Temperature):
    """Module form of :func:`~torch_contrastive.nt_xent_loss`.

    Example:
        >>> loss_fn = NTXentLoss(temperature=0.5, pairing="halves")
        >>> loss = loss_fn(torch.cat([view1, view2]))          # SimCLR
        >>> loss = loss_fn(embeddings, labels)                 # pytorch-metric-learning form
    """

    def __init__(self, temperature: float = 0.5, *, pairing: str = "adjacent", normalize: bool = True,
                 reduction: str = "mean", chunk_size: int | None = None, gather: bool = False,
                 grad_reduction: str = "mean", learnable_temperature: bool = False) -> None:
        super().__init__(temperature, learnable_temperature)
        self.pairing, self.normalize, self.reduction = pairing, normalize, reduction
        self.chunk_size, self.gather, self.grad_reduction = chunk_size, gather, grad_reduction

    def forward(self, embeddings: Tensor, labels: Tensor | None = None) -> Tensor:
        return nt_xent_loss(embeddings, self.temperature, labels=labels, pairing=self.pairing,
                            normalize=self.normalize, reduction=self.reduction, chunk_size=self.chunk_size,
                            gather=self.gather, grad_reduction=self.grad_reduction)

    def extra_repr(self) -> str:
        return f"{self._common()}, pairing={self.pairing!r}, reduction={self.reduction!r}"


class NTBXentLoss(_Temperature):
    """Module form of :func:`~torch_contrastive.nt_bxent_loss`: ``loss(embeddings, pos_indices)``
    or ``loss(embeddings, labels=labels)``."""

    def __init__(self, temperature: float = 0.5, *, normalize: bool = True, reduction: str = "mean",
                 chunk_size: int | None = None, gather: bool = False, grad_reduction: str = "mean",
                 learnable_temperature: bool = False) -> None:
        super().__init__(temperature, learnable_temperature)
        self.normalize, self.reduction, self.chunk_size = normalize, reduction, chunk_size
        self.gather, self.grad_reduction = gather, grad_reduction

    def forward(self, embeddings: Tensor, pos_indices: Tensor | None = None, labels: Tensor | None = None) -> Tensor:
        return nt_bxent_loss(embeddings, pos_indices, self.temperature, labels=labels, normalize=self.normalize,
                             reduction=self.reduction, chunk_size=self.chunk_size, gather=self.gather,
                             grad_reduction=self.grad_reduction)

    def extra_repr(self) -> str:
        return f"{self._common()}, reduction={self.reduction!r}"


class ImageTextContrastiveLoss(_Temperature):
    """Module form of :func:`~torch_contrastive.image_text_contrastive_loss` (alias ``ClipLoss``).

    ``learnable_temperature=True`` owns CLIP's ``logit_scale`` (init ``log(1/0.07)``,
    clamped at ``log(100)``); put the module's parameters in the optimiser.

    Example:
        >>> loss_fn = ClipLoss(learnable_temperature=True)
        >>> loss = loss_fn(image_features, text_features, text_id=text_ids(captions))
    """

    def __init__(self, temperature: float = 0.07, *, normalize: bool = True, reduction: str = "mean",
                 chunk_size: int | None = None, gather: bool = False, grad_reduction: str = "mean",
                 learnable_temperature: bool = False) -> None:
        super().__init__(temperature, learnable_temperature)
        self.normalize, self.reduction, self.chunk_size = normalize, reduction, chunk_size
        self.gather, self.grad_reduction = gather, grad_reduction

    def forward(self, image_features: Tensor, text_features: Tensor, image_id: Tensor | None = None,
                text_id: Tensor | None = None) -> Tensor:
        return image_text_contrastive_loss(image_features, text_features, self.temperature, image_id, text_id,
                                           normalize=self.normalize, reduction=self.reduction,
                                           chunk_size=self.chunk_size, gather=self.gather,
                                           grad_reduction=self.grad_reduction)

    def extra_repr(self) -> str:
        return f"{self._common()}, reduction={self.reduction!r}"


ClipLoss = ImageTextContrastiveLoss


class SupConLoss(_Temperature):
    """Module form of :func:`~torch_contrastive.supcon_loss`.

    ``loss(features, labels)`` with (bsz, n_views, D) features as in the authors' code,
    or (N, D) embeddings as in pytorch-metric-learning; ``loss(features)`` is SimCLR.
    """

    def __init__(self, temperature: float = 0.07, *, base_temperature: float | None = None,
                 contrast_mode: str = "all", normalize: bool = True, reduction: str = "mean",
                 chunk_size: int | None = None, gather: bool = False, grad_reduction: str = "mean",
                 learnable_temperature: bool = False) -> None:
        super().__init__(temperature, learnable_temperature)
        if base_temperature is not None:
            v.check_temperature(base_temperature, "base_temperature")
        v.check_choice(contrast_mode, "contrast_mode", ("all", "one"))
        self.base_temperature, self.contrast_mode = base_temperature, contrast_mode
        self.normalize, self.reduction, self.chunk_size = normalize, reduction, chunk_size
        self.gather, self.grad_reduction = gather, grad_reduction

    def forward(self, features: Tensor, labels: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        return supcon_loss(features, labels, mask, self.temperature, base_temperature=self.base_temperature,
                           contrast_mode=self.contrast_mode, normalize=self.normalize, reduction=self.reduction,
                           chunk_size=self.chunk_size, gather=self.gather, grad_reduction=self.grad_reduction)

    def extra_repr(self) -> str:
        return f"{self._common()}, base_temperature={self.base_temperature}, contrast_mode={self.contrast_mode!r}"
