"""Row-wise L2 normalisation as an autograd op, for inputs normalised before a gather.

Local losses normalise inside the engine's autograd functions; under ``gather=True``
each rank normalises its own rows first (with this op) and gathers the result.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._tensors import save_for_backward
from .engine.driver import first_order_only
from .engine.normalization import l2_normalize, l2_normalize_backward
from .engine.planner import rows_by_kernel
from .engine.precision import compute_dtype

__all__ = ["prepare"]


class _L2Normalize(torch.autograd.Function):
    """``x / max(||x||, eps)`` per row; see :func:`~torch_contrastive.engine.normalization.l2_normalize`.
    ``kernel``: by the Triton row kernels (one launch each way, half rows read as given)."""

    @staticmethod
    def forward(ctx, x: Tensor, eps: float, kernel: bool):  # type: ignore[override]
        if kernel:
            from .engine.triton_backend.normalize_rows import normalize_rows

            y, denom, norm = normalize_rows(x, eps)
        else:
            y, denom, norm = l2_normalize(x, eps)
        ctx.eps, ctx.kernel, ctx.in_dtype = eps, kernel, x.dtype
        save_for_backward(ctx, y, denom, norm)
        return y

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        first_order_only()
        y, denom, norm = ctx.saved_tensors
        if ctx.kernel:
            from .engine.triton_backend.normalize_rows_grad import normalize_rows_grad

            return normalize_rows_grad(g, y, denom, norm, ctx.eps, 1.0, ctx.in_dtype), None, None
        return l2_normalize_backward(g, y, denom, norm, ctx.eps), None, None


def prepare(x: Tensor, normalize: bool, eps: float, backend: str = "torch") -> Tensor:
    """Cast to the compute dtype (fp32 for fp16/bf16) and, if asked, L2-normalise rows (by the
    Triton row kernels where :func:`~.engine.planner.rows_by_kernel` says so for ``backend``)."""
    if normalize and rows_by_kernel(x.device, x.dtype, backend):
        return _L2Normalize.apply(x, float(eps), True)
    x = x.to(compute_dtype(x.dtype))
    if not normalize:
        return x
    return _L2Normalize.apply(x, float(eps), False)
