"""Row-wise L2 normalisation as one autograd op: overflow-free and memory-lean."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .engine import compute_dtype

__all__ = ["prepare"]


class _L2Normalize(torch.autograd.Function):
    """``x / max(||x||, eps)`` per row.

    The row is divided by its largest magnitude before the norm is taken, so norms of
    1e30 or 1e-30 neither overflow nor underflow. Backward saves only the output and
    the per-row norm (``F.normalize`` keeps two more N x D tensors): for rows with
    ``||x|| > eps`` the gradient is ``(g - y (g . y)) / ||x||``, otherwise ``g / eps``;
    an all-zero row gets a zero gradient (not ``g / eps``).
    """

    @staticmethod
    def forward(ctx, x: Tensor, eps: float):  # type: ignore[override]
        peak = x.abs().amax(dim=1, keepdim=True)
        nonzero = peak > 0
        peak = torch.where(nonzero, peak, torch.ones_like(peak))
        norm = torch.linalg.vector_norm(x / peak, dim=1, keepdim=True) * peak
        denom = torch.clamp_min(norm, eps)
        y = x / denom
        ctx.save_for_backward(y, denom, norm > eps, nonzero)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor):  # type: ignore[override]
        y, denom, above, nonzero = ctx.saved_tensors
        radial = torch.where(above, (g * y).sum(dim=1, keepdim=True), torch.zeros_like(denom))
        return (g - y * radial) / denom * nonzero, None


def prepare(x: Tensor, normalize: bool, eps: float) -> Tensor:
    """Cast to the compute dtype (fp32 for fp16/bf16) and, if asked, L2-normalise rows."""
    x = x.to(compute_dtype(x.dtype))
    if not normalize:
        return x
    return _L2Normalize.apply(x, float(eps))
