"""Row-wise L2 normalisation inside the engine's autograd functions, and its backward."""

from __future__ import annotations

import torch
from torch import Tensor

from .precision import Scale, zero

#: The row dtypes the Triton row kernels (``triton_backend.normalize_rows``) take; fp64 rows keep the torch form.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Elements per block of the fp64 norm accumulation: a 32 MiB fp64 copy at most, small beside the logits of any call
#: that big; one block (one op) up to 8,192 rows of 512 features -- every host-bound size, where each op is host time.
_NORM_BLOCK = 1 << 22


def l2_normalize(x: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``y = x / max(||x||, eps)`` per row, overflow- and underflow-free.

    Returns ``(y, denom, norm)`` for :func:`l2_normalize_backward`. The norm of a fp32
    row is accumulated in fp64, where squares of any fp32 value neither overflow nor
    underflow (one op instead of a rescaling pass); fp64 rows are divided by their
    largest magnitude first. Rows whose norm exceeds the fp32 range (> 3.4e38) cannot
    be normalised in fp32 and come out as zero.
    """
    if x.dtype == torch.float64:
        peak = x.abs().amax(dim=1, keepdim=True)
        peak = torch.where(peak > 0, peak, 1.0)
        norm = torch.linalg.vector_norm(x / peak, dim=1, keepdim=True) * peak
    elif x.numel() <= _NORM_BLOCK:
        norm = torch.linalg.vector_norm(x, dim=1, keepdim=True, dtype=torch.float64).to(x.dtype)
    else:  # the fp64 accumulation copies its input: bound that copy by going through row blocks
        rows = max(1, _NORM_BLOCK // max(1, x.shape[1]))
        norm = torch.cat([torch.linalg.vector_norm(part, dim=1, keepdim=True, dtype=torch.float64).to(x.dtype)
                          for part in x.split(rows)])
    denom = norm.clamp_min(eps)
    return x / denom, denom, norm


def l2_normalize_backward(g: Tensor, y: Tensor, denom: Tensor, norm: Tensor, eps: float, scale: Scale = 1.0) -> Tensor:
    """Gradient of :func:`l2_normalize` for the upstream gradient ``scale * g``:
    ``scale (g - y (g . y)) / ||x||`` for rows with ``||x|| > eps``, ``scale g / eps`` for
    smaller non-zero rows, 0 for all-zero rows.

    Written as a row dot product (a multiply and a sum), masked, and one factor -- on every device: the form
    with fewer launches (one batched product and two factors at once) is one no GPU has measured, and on a CPU
    it is slower (a 256 x 128 call's backward: 58 us against 43, measured).
    """
    radial = (g * y).sum(1, keepdim=True).masked_fill_(norm <= eps, 0.0)
    if isinstance(scale, float):  # a float scale folded into the division (addcdiv), a tensor one multiplied after
        factor = torch.div(norm > 0, denom) if scale == 1.0 else torch.addcdiv(zero(denom), norm > 0, denom, value=scale)
    else:
        factor = torch.div(norm > 0, denom).mul_(scale)
    return torch.addcmul(g, y, radial, value=-1).mul_(factor)
