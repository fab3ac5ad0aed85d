"""Backward of the row normalisation in one launch, in the caller's dtype:
``scale (g - y (g . y)) / ||x||`` for rows with ``||x|| > eps``, ``scale g / eps`` for smaller
non-zero rows, 0 for all-zero rows -- :func:`~torch_contrastive.engine.normalization.l2_normalize_backward`,
which is nine launches and a rounding to the input dtype on a GPU.

One program owns a block of rows: a first walk over the features sums ``g . y`` (fp32), a
second writes the gradient. ``g`` may come in two parts (a single set's row and column
accumulators, added here instead of in a launch of their own), and ``scale`` as a number or a
0-dim tensor (a learnable temperature), read in the kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._configs import autotune, bucket, feature_rows
from ._host import announced, check_device, interpreting, stand_in, tl, triton


@triton.jit
def _upstream(g_ptr, g2_ptr, rows, r_in, k0, d, TWO: tl.constexpr, BLOCK_D: tl.constexpr):
    """``(offsets, mask, g [+ g2])`` of the rows' features ``[k0, k0 + BLOCK_D)``."""
    cols = k0 + tl.arange(0, BLOCK_D)
    inside = r_in[:, None] & (cols[None, :] < d)
    at = rows[:, None] * d + cols[None, :]
    g = tl.load(g_ptr + at, mask=inside, other=0.0)
    if TWO:
        g += tl.load(g2_ptr + at, mask=inside, other=0.0)
    return at, inside, g


@autotune(feature_rows())
@triton.heuristics({"TWO": lambda args: args["g2_ptr"] is not None,
                    "SCALE_TENSOR": lambda args: args["scale_ptr"] is not None})
@triton.jit
def _normalize_rows_grad_kernel(x_ptr, g_ptr, g2_ptr, denom_ptr, norm_ptr, scale_ptr, out_ptr, n, d, eps, scale, bucket,
                                TWO: tl.constexpr, SCALE_TENSOR: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_in = rows < n
    radial = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, d, BLOCK_D):
        at, inside, g = _upstream(g_ptr, g2_ptr, rows, r_in, k0, d, TWO, BLOCK_D)
        radial += tl.sum(g * tl.load(x_ptr + at, mask=inside, other=0.0), axis=1)
    norm = tl.load(norm_ptr + rows, mask=r_in, other=0.0)
    denom = tl.load(denom_ptr + rows, mask=r_in, other=1.0)
    radial = tl.where(norm <= eps, 0.0, radial)  # below the floor the map is x / eps: no radial part
    factor = tl.where(norm > 0, tl.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32), denom), 0.0)  # an all-zero row: none
    if SCALE_TENSOR:
        factor = factor * tl.load(scale_ptr).to(tl.float32)
    else:
        factor = factor * scale
    for k0 in range(0, d, BLOCK_D):
        at, inside, g = _upstream(g_ptr, g2_ptr, rows, r_in, k0, d, TWO, BLOCK_D)
        y = tl.load(x_ptr + at, mask=inside, other=0.0)
        out = (g - y * radial[:, None]) * factor[:, None]
        tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=inside)


def normalize_rows_grad(g: Tensor, y: Tensor, denom: Tensor, norm: Tensor, eps: float, scale: float | Tensor,
                        out_dtype: torch.dtype, g2: Tensor | None = None) -> Tensor:
    """The gradient of the raw rows for the upstream gradient ``scale * (g + g2)`` of ``y``
    (:func:`~.normalize_rows.normalize_rows`'s output, fp32 (N, D)), with that call's ``denom``
    and ``norm``, written in ``out_dtype``. One launch."""
    check_device(y)
    n, d = y.shape
    # the interpreter does not round fp32 to half as a GPU does: it writes fp32, torch rounds below
    wide = interpreting() and out_dtype in (torch.float16, torch.bfloat16)
    out = stand_in(torch.empty((n, d), device=y.device), out_dtype) if wide else torch.empty((n, d), device=y.device, dtype=out_dtype)
    tensor_scale = isinstance(scale, Tensor)

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(n, meta["BLOCK_M"]),)

    with announced("normalize_rows_grad", reads=(), writes=()):
        _normalize_rows_grad_kernel[grid](y.contiguous(), g.contiguous(), None if g2 is None else g2.contiguous(),
                                          denom.contiguous(), norm.contiguous(), scale if tensor_scale else None, out, n, d,
                                          eps, 1.0 if tensor_scale else float(scale), bucket(n))
        if wide:
            out = out.to(out_dtype)
    return out
