"""Row-wise L2 normalisation in one launch: ``y = x / max(||x||, eps)`` with its denominator and
norm, as :func:`~torch_contrastive.engine.normalization.l2_normalize` computes them.

The torch form is five launches per input on a GPU (the widening of half rows, the norm, its
rounding, the clamp, the division); at a few thousand rows, where a loss is launch-bound, they
cost more than the logit tile's epilogue. One program owns a block of rows and walks their
features in blocks twice: the squares summed in fp64 (no overflow or underflow for any fp32 or
half value: the torch form's accumulation), then every element divided by its row's
denominator and written in fp32. Given the denominators (``denom=``), only the second walk
runs: backward rebuilds the normalised rows from the caller's half rows, the same bits as
forward wrote.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..normalization import KERNEL_DTYPES
from ._configs import autotune, bucket, feature_rows
from ._host import announced, check_device, operand, tl, triton


@autotune(feature_rows())
@triton.heuristics({"GIVEN": lambda args: args["denom_in_ptr"] is not None})
@triton.jit
def _normalize_rows_kernel(x_ptr, y_ptr, denom_ptr, norm_ptr, denom_in_ptr, n, d, eps, bucket, GIVEN: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_in = rows < n
    if GIVEN:
        denom = tl.load(denom_in_ptr + rows, mask=r_in, other=1.0)
    else:
        squares = tl.zeros((BLOCK_M,), dtype=tl.float64)
        for k0 in range(0, d, BLOCK_D):
            cols = k0 + tl.arange(0, BLOCK_D)
            x = tl.load(x_ptr + rows[:, None] * d + cols[None, :], mask=r_in[:, None] & (cols[None, :] < d), other=0.0)
            x = x.to(tl.float64)
            squares += tl.sum(x * x, axis=1)
        norm = tl.sqrt(squares).to(tl.float32)  # fp64 sqrt is correctly rounded
        denom = tl.maximum(norm, eps)
        tl.store(norm_ptr + rows, norm, mask=r_in)
        tl.store(denom_ptr + rows, denom, mask=r_in)
    for k0 in range(0, d, BLOCK_D):
        cols = k0 + tl.arange(0, BLOCK_D)
        inside = r_in[:, None] & (cols[None, :] < d)
        x = tl.load(x_ptr + rows[:, None] * d + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows[:, None] * d + cols[None, :], tl.div_rn(x, denom[:, None]), mask=inside)


def normalize_rows(x: Tensor, eps: float, denom: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(y, denom, norm)`` of (N, D) fp32/bf16/fp16 rows ``x``: ``y`` (fp32) ``= x / denom`` with
    ``denom = max(norm, eps)`` and ``norm`` the rows' L2 norms, (N, 1) fp32 like
    :func:`~torch_contrastive.engine.normalization.l2_normalize`'s. Given ``denom`` (N, 1), only
    ``y`` is formed (``norm`` comes back None). One launch."""
    check_device(x)
    if x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"normalize_rows takes fp32 or half rows, got {x.dtype}")
    n, d = x.shape
    y = torch.empty((n, d), device=x.device, dtype=torch.float32)
    given = denom
    norm = None if given is not None else torch.empty((n, 1), device=x.device, dtype=torch.float32)
    denom = given if given is not None else torch.empty((n, 1), device=x.device, dtype=torch.float32)

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(n, meta["BLOCK_M"]),)

    with announced("normalize_rows", reads=(), writes=()):
        rows = operand(x)  # contiguous; under the interpreter (numpy has no bf16) half rows as their fp32 values
        _normalize_rows_kernel[grid](rows, y, denom, norm, None if given is None else given.contiguous(), n, d, eps,
                                     bucket(n))
    return y, denom, norm
