"""Row-wise L2 normalisation inside the engine's autograd functions, and its backward."""

from __future__ import annotations

from typing import Any

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

    On a GPU (also a :func:`~.planner.simulate` d one) written ``g f - y (g . y) k`` with two per-row factors,
    ``f = scale [||x|| > 0] / denom`` and ``k = scale [||x|| > eps] / denom``, formed together: the norms against
    the two thresholds ``(0, eps)`` in one comparison, divided in one op -- six ops in all (a row dot product as
    one batched product, the two factors, one multiply, one fused multiply-add), where masking the dot product
    and the factor separately takes eight: a host-bound call's launches are its time. On a CPU, where an op
    costs microseconds rather than a launch and a batch of tiny products is slow (a 256 x 128 call's backward:
    58 us against 43, measured), the eight: a row dot product as a multiply and a sum, masked, one factor.
    """
    if not (_PLANNER or _planner()).launch_bound(g.device):
        radial = (g * y).sum(1, keepdim=True).masked_fill_(norm <= eps, 0.0)
        if isinstance(scale, float):  # a float scale folded into the division (addcdiv), a tensor one multiplied after
            factor = torch.div(norm > 0, denom) if scale == 1.0 else torch.addcdiv(zero(denom), norm > 0, denom, value=scale)
        else:
            factor = torch.div(norm > 0, denom).mul_(scale)
        return torch.addcmul(g, y, radial, value=-1).mul_(factor)
    # (N, 2): [||x|| > 0, ||x|| > eps]; the thresholds looked up inline (a small call pays each Python call)
    thresholds = _THRESHOLDS.get((eps, norm.dtype, norm.device))
    masks = torch.gt(norm, _thresholds(eps, norm) if thresholds is None else thresholds)
    if isinstance(scale, float):
        factors = torch.div(masks, denom) if scale == 1.0 else torch.addcdiv(zero(denom), masks, denom, value=scale)
    else:
        factors = torch.div(masks, denom).mul_(scale)
    radial = torch.bmm(g.unsqueeze(1), y.unsqueeze(2)).view(-1, 1)  # g . y per row, one op
    return torch.addcmul(g * factors[:, :1], y, radial * factors[:, 1:], value=-1)


# the engine's planner (its launch_bound rule), which imports the engine: imported on first use, then kept
_PLANNER: Any = None


def _planner() -> Any:
    global _PLANNER
    from . import planner

    if not torch.compiler.is_compiling():  # (a traced call may not write a module global: Dynamo refuses the side effect)
        _PLANNER = planner
    return planner


#: ``(0, eps)`` per (eps, dtype, device), made once (:func:`l2_normalize_backward`'s two row masks in one comparison).
_THRESHOLDS: dict[tuple[float, torch.dtype, torch.device], Tensor] = {}


def _thresholds(eps: float, like: Tensor) -> Tensor:
    key = (eps, like.dtype, like.device)
    found = _THRESHOLDS.get(key)
    if found is None:
        found = torch.tensor([0.0, eps], dtype=like.dtype, device=like.device)
        if not torch.compiler.is_compiling():  # a traced tensor kept in a module would outlive its trace
            _THRESHOLDS[key] = found
    return found
