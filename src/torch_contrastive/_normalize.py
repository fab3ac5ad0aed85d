"""Row-wise L2 normalisation as an autograd op, for inputs normalised before a gather.

Local losses normalise inside the engine's autograd functions; under ``gather=True``
each rank normalises its own rows first (with this op) and gathers the result.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .engine.driver import first_order_only
from .engine.normalization import l2_normalize, l2_normalize_backward
from .engine.precision import compute_dtype

__all__ = ["prepare"]


class _L2Normalize(torch.autograd.Function):
    """``x / max(||x||, eps)`` per row; see :func:`~torch_contrastive.engine.normalization.l2_normalize`."""

    @staticmethod
    def forward(ctx, x: Tensor, eps: float):  # type: ignore[override]
        y, denom, norm = l2_normalize(x, eps)
        ctx.eps = eps
        ctx.save_for_backward(y, denom, norm)
        return y

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        first_order_only()
        y, denom, norm = ctx.saved_tensors
        return l2_normalize_backward(g, y, denom, norm, ctx.eps), None


def prepare(x: Tensor, normalize: bool, eps: float) -> Tensor:
    """Cast to the compute dtype (fp32 for fp16/bf16) and, if asked, L2-normalise rows."""
    x = x.to(compute_dtype(x.dtype))
    if not normalize:
        return x
    return _L2Normalize.apply(x, float(eps))
