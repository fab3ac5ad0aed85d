"""What both autograd functions of the engine share: tiles, buffers, dtypes, saved state,
and the row-wise L2 normalisation that runs inside them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from .._tensors import as_dtype

#: Rows (and columns) per tile when ``chunk_size=None`` and the batch is too big for
#: one tile. 1024 x 1024 fp32 logit tiles (4 MiB) stay in a CPU's L3 cache and were
#: fastest on the 2-core benchmark machine (512 and 256 were 5-30 % slower).
DEFAULT_TILE = int(os.environ.get("TORCH_CONTRASTIVE_TILE", "1024"))

#: ``chunk_size=None`` computes the whole R x C logit matrix as one tile while it
#: needs at most this many bytes (two fp32 buffers); larger batches are tiled.
DENSE_BUDGET_BYTES = int(os.environ.get("TORCH_CONTRASTIVE_DENSE_BUDGET", str(8 * 2**20)))

# Largest 1/tau for which exp(+-scale) and a sum of 2**40 such terms stay normal numbers
# (fp32: exp(40) * 2**40 ~ 2.6e29 < 3.4e38 and exp(-40) ~ 4e-18 > 1.2e-38).
_MAX_FIXED_SCALE = {torch.float32: 40.0, torch.float64: 340.0}

Scale = Tensor | float


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the engine computes in: fp64 stays fp64, everything else is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fixed_scale_applies(bounded: bool, scale_bound: float | None, dtype: torch.dtype) -> bool:
    """Whether the fixed (no-shift) algorithm is exact.

    Args:
        bounded: every input row has norm <= 1 (L2-normalised), so ``|S| <= scale``.
        scale_bound: a host-side upper bound of ``scale`` (``None``: unknown, e.g. a
            learnable temperature under ``validate=False``, which never reads it).
        dtype: the input dtype.
    """
    return bounded and scale_bound is not None and scale_bound <= _MAX_FIXED_SCALE[compute_dtype(dtype)]


def tiles(rows: int, cols: int, tile: int, symmetric: bool) -> Iterator[tuple[int, int, int, int]]:
    """(r0, r1, c0, c1) of every tile to visit; only the upper triangle when symmetric."""
    for r0 in range(0, rows, tile):
        r1 = min(r0 + tile, rows)
        for c0 in range(r0 if symmetric else 0, cols, tile):
            yield r0, r1, c0, min(c0 + tile, cols)


class Buffers:
    """Preallocated tile buffers, one per distinct (rows, cols, slot)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self._store: dict[tuple[int, int, int], Tensor] = {}

    def get(self, rows: int, cols: int, slot: int = 0) -> Tensor:
        key = (rows, cols, slot)
        if key not in self._store:
            self._store[key] = torch.empty(rows, cols, dtype=self.dtype, device=self.device)
        return self._store[key]


def autocast_enabled(device_type: str) -> bool:
    """Whether an autocast region is active for ``device_type`` (cheaper than entering a
    disabling context on every call)."""
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except TypeError:  # torch < 2.4 takes no argument
        return bool(torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled())


def logits_tile(out: Tensor | None, a_scaled: Tensor, b: Tensor) -> Tensor:
    """``a_scaled @ b.T``, into ``out`` when given (a reused tile buffer)."""
    if out is None:
        return torch.mm(a_scaled, b.t())
    return torch.mm(a_scaled, b.t(), out=out)


# ---------------------------------------------------------------------------------
# Row-wise L2 normalisation inside the engine's autograd functions
# ---------------------------------------------------------------------------------
#: Elements per block of the fp64 norm accumulation (a 4 MiB fp64 copy at most).
_NORM_BLOCK = 1 << 19


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

    Three passes over the (N, D) rows (a row dot product, one fused multiply-add, one
    row scaling); the per-row cases are decided on (N, 1) vectors. Folding ``scale`` in
    saves the caller a pass.
    """
    # (g * y).sum over the row, kept as a column: one op fewer than vecdot + unsqueeze; a masked
    # fill takes the bool mask as it is (a multiply by it would first widen it to a float copy)
    radial = (g * y).sum(1, keepdim=True).masked_fill_(norm <= eps, 0.0)
    factor = torch.div(norm > 0, denom)  # 0 for an all-zero row (a multiply by a mask, cheaper than where)
    if not isinstance(scale, float) or scale != 1.0:
        factor = factor.mul_(scale)
    return torch.addcmul(g, y, radial, value=-1).mul_(factor)


# ---------------------------------------------------------------------------------
# Saved state
# ---------------------------------------------------------------------------------
def to_compute(a: Tensor, b: Tensor | None, scale: Scale) -> tuple[Tensor, Tensor, Scale]:
    """Inputs in the compute dtype (fp32 for fp16/bf16; no copy when already there).

    ``b=None`` (a single set) returns ``a`` itself as the candidates. A float scale stays
    a Python float: turning it into a device tensor would be a host-to-device copy on
    every call.
    """
    cdtype = compute_dtype(a.dtype)
    if isinstance(scale, Tensor):
        scale = scale.detach().to(device=a.device, dtype=cdtype)
    a_c = a if a.dtype == cdtype else a.to(cdtype)
    if b is None:
        return a_c, a_c, scale
    return a_c, (b if b.dtype == cdtype else b.to(cdtype)), scale


def prepare_inputs(a: Tensor, b: Tensor | None, scale: Scale, normalize: bool,
                   eps: float) -> tuple[Tensor, Tensor, Scale, list[Tensor]]:
    """Compute-dtype inputs, L2-normalised inside the autograd function when asked.

    Returns ``(a, b, scale, norms)``: ``b`` is ``a`` for a single set (``b=None``), and
    ``norms`` the (denominator, norm) of ``a`` -- then of ``b`` unless it is ``a`` -- for
    :func:`finish_gradients`.
    """
    a_c, b_c, scale_c = to_compute(a, b, scale)
    norms: list[Tensor] = []
    if normalize:
        a_c, *norm_a = l2_normalize(a_c, eps)
        norms += norm_a
        if b is None:
            b_c = a_c
        else:
            b_c, *norm_b = l2_normalize(b_c, eps)
            norms += norm_b
    return a_c, b_c, scale_c, norms


def save(ctx: Any, scale: Scale, a: Tensor, b: Tensor, *tensors: Tensor) -> None:
    """Save tensors for backward: ``b`` only when it is not ``a`` (a single set), a float
    scale on ``ctx`` (it is not a tensor)."""
    ctx.float_scale = None if isinstance(scale, Tensor) else scale
    ctx.single = b is a
    ctx.save_for_backward(a, *(() if ctx.single else (b,)), *tensors, *((scale,) if isinstance(scale, Tensor) else ()))


def saved(ctx: Any) -> tuple[Tensor, Tensor, list[Tensor], Scale]:
    """``(a, b, other saved tensors, scale)`` as given to :func:`save`."""
    stored = list(ctx.saved_tensors)
    scale: Scale = ctx.float_scale if ctx.float_scale is not None else stored.pop()
    a = stored.pop(0)
    b = a if ctx.single else stored.pop(0)
    return a, b, stored, scale


def finish_gradients(ctx: Any, a: Tensor, scale: Scale, gb_acc: Tensor, ga_acc: Tensor | None, symmetric: bool,
                     norm_a: tuple[Tensor, Tensor] | None, norm_b: tuple[Tensor, Tensor] | None,
                     b: Tensor, eps: float = 0.0) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """From ``G @ B`` and ``G.T @ A`` (unscaled) to the gradients of the raw inputs and scale.

    ``dscale = sum_ij G_ij a_i . b_j = sum_i a_i . (G @ B)_i``; when ``symmetric`` the
    accumulator holds ``H @ Z`` with ``H = G + G.T``, which counts every pair twice. For
    a single set (B is A, not symmetric) both accumulators are A's gradient. ``norm_a``
    / ``norm_b`` are the ``(denom, state)`` of a normalisation done inside the function,
    whose backward is applied last (with floor ``eps``). A float scale gets no gradient.
    """
    gscale = None
    if isinstance(scale, Tensor):
        gscale = torch.linalg.vecdot(gb_acc, a).sum()
        if symmetric:
            gscale = gscale / 2
    if ctx.single and ga_acc is not None:
        gb_acc = gb_acc + ga_acc
        ga_acc = None
    ga = gb_acc * scale if norm_a is None else l2_normalize_backward(gb_acc, a, *norm_a, eps, scale)
    gb = None
    if ga_acc is not None:
        gb = ga_acc * scale if norm_b is None else l2_normalize_backward(ga_acc, b, *norm_b, eps, scale)
        gb = as_dtype(gb, ctx.in_dtypes[1])
    return as_dtype(ga, ctx.in_dtypes[0]), gb, gscale
