"""The engine's three matrix products over a (row block, column block) tile.

Every pass of the tiled engine multiplies the same three ways::

    logits   S[r, c]  = scale * Â[r] @ B̂[c].T
    rows     acc[r]  += G @ B̂[c]          (the anchors' gradient, before normalisation)
    columns  acc[c]  += G.T @ Â[r]        (the candidates' gradient)

where ``Â``, ``B̂`` are the (optionally L2-normalised) inputs. How the products are
multiplied is a planning decision (:mod:`.planner`), made here in one place:

* :class:`Products` -- in the compute dtype (fp32, fp64): the inputs are normalised in
  fp32 and multiplied in fp32 (on a GPU PyTorch's own ``allow_tf32`` flag decides whether
  that is TF32). The CPU path.
* :class:`HalfProducts` -- fp16/bf16 inputs on a GPU: the tensor cores multiply the
  caller's *own* half-precision rows, unrounded, with fp32 accumulation and fp32 logits
  (``torch.mm(..., out_dtype=torch.float32)``). Normalisation and the scale are not
  folded into the operands (that would round ``x / ||x||`` to half precision, an error
  the temperature multiplies: at tau = 0.01 about 1 % in the gradients); they are applied
  to the fp32 logit tile as a row factor ``scale / ||a_i||`` and a column factor
  ``1 / ||b_j||``. In backward the gradient tile, with the other side's factor folded in,
  is rounded once to the input dtype for the two products -- what the dense formula's own
  backward does -- and fp16 tiles are first divided by their largest magnitude so that
  small entries do not underflow.
* :class:`KernelOperands` -- what the Triton kernels multiply: the same scheme (the caller's half
  rows with fp32 factors) or the compute-dtype rows, handed to the kernels instead of multiplied here.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .cost import GPUS
from .precision import Scale, zero
from .tiling import logits_tile


class Products:
    """Products in the compute dtype from the compute-dtype rows.

    Args:
        a_s: ``scale * Â`` (R, D), or None: formed on the first logit tile (a backward that
            reuses the kept tile never forms it).
        a: ``Â`` (R, D).
        b: ``B̂`` (C, D); ``a`` itself for a single set.
        scale: the logit scale (for ``a_s``).
    """

    half = False

    def __init__(self, a_s: Tensor | None, a: Tensor, b: Tensor, scale: Scale = 1.0) -> None:
        self._a_s, self.a, self.b, self.scale = a_s, a, b, scale

    @property
    def a_s(self) -> Tensor:
        """``scale * Â``, formed once."""
        if self._a_s is None:
            self._a_s = self.a * self.scale
        return self._a_s

    def logits(self, r0: int, r1: int, c0: int, c1: int, out: Tensor | None = None) -> Tensor:
        """``S[r0:r1, c0:c1]`` in the compute dtype, into ``out`` when given."""
        if self._a_s is None and out is None and isinstance(self.scale, float) and (r0, c0) == (0, 0) \
                and (r1, c1) == (self.a.shape[0], self.b.shape[0]):
            # the whole problem as one tile with a float scale: the GEMM applies the scale
            # itself (alpha), so ``scale * A`` is never formed -- one op fewer per small call
            return torch.addmm(zero(self.a), self.a, self.b.t(), beta=0, alpha=self.scale)
        a_s, b = self.a_s, self.b
        # the whole problem as one tile (small batches) takes no slice views: two ops fewer per call
        rows = a_s if r0 == 0 and r1 == a_s.shape[0] else a_s[r0:r1]
        cols = b if c0 == 0 and c1 == b.shape[0] else b[c0:c1]
        return logits_tile(out, rows, cols)

    def add_rows(self, acc: Tensor, g: Tensor, c0: int, c1: int) -> None:
        """``acc += g @ B̂[c0:c1]`` (``acc`` the rows' slice of the accumulator)."""
        acc.addmm_(g, self.b[c0:c1])

    def add_columns(self, acc: Tensor, g: Tensor, r0: int, r1: int) -> None:
        """``acc += g.T @ Â[r0:r1]`` (``acc`` the columns' slice of the accumulator: ``g``'s first
        ``len(acc)`` columns)."""
        acc.addmm_(_first_columns(g, acc.shape[0]).t(), self.a[r0:r1])

    def row_product(self, g: Tensor) -> Tensor:
        """``g @ B̂`` for a tile spanning every column."""
        return g @ self.b

    def column_product(self, g: Tensor) -> Tensor:
        """``g.T @ Â`` for a tile spanning every row (``g`` may cover the first columns only)."""
        return g.t() @ self.a



def _first_columns(g: Tensor, k: int) -> Tensor:
    """``g[:, :k]`` (no view when that is all of it)."""
    return g if g.shape[1] == k else g[:, :k]


def rounded_mul(x: Tensor, y: Tensor, dtype: torch.dtype) -> Tensor:
    """``x * y`` (one of them a tile, the other broadcast against it; computed in their dtype) rounded to
    ``dtype`` as it is written (``out=``): a gradient tile's one half-width write, never stored at full width --
    the same bits as multiplying, then rounding."""
    # the result has the tile's shape: torch.broadcast_shapes would cost a call hundreds of Python bytecodes
    shape = x.shape if x.numel() >= y.numel() else y.shape
    return torch.mul(x, y, out=torch.empty(shape, dtype=dtype, device=x.device))


def _mm32(x: Tensor, y: Tensor, out: Tensor | None = None) -> Tensor:
    """``x @ y`` of two half-precision matrices with fp32 accumulation and an fp32 result.

    On CUDA one tensor-core GEMM (``out_dtype``). CPU kernels lack that overload; there the
    operands are widened (exact: every half value is an fp32 value), which gives the same
    numbers -- so the tests exercise this path on a machine without a GPU.
    """
    if x.is_cuda:
        if out is None:
            return torch.mm(x, y, out_dtype=torch.float32)
        return torch.mm(x, y, out_dtype=torch.float32, out=out)
    WIDENING[0] += 1  # the CPU's stand-in for out_dtype: a cost count leaves it out (no context manager:
    try:  # a count of the host's Python would see its bytecodes, which no GPU runs)
        xw, yw = x.float(), y.float()
    finally:
        WIDENING[0] -= 1
    if out is None:
        return torch.mm(xw, yw)
    return torch.mm(xw, yw, out=out)


#: > 0 while :func:`_mm32` widens half operands on a CPU (no GPU would): the cost counter
#: (:mod:`torch_contrastive.cli.traffic`) skips those copies and counts the product at the
#: operands' own width.
WIDENING = [0]


#: The split product's operand dtype: fp16's 11 bits give the two parts 22 (bf16's 8 would give 16).
SPLIT = torch.float16


def tile_mm(tile: Tensor, operand: Tensor) -> Tensor:
    """``tile @ operand`` with an fp32 result where the tile is bf16 (tensor cores), else in the tile's dtype: a
    factored strip's product of its written factor against rows."""
    return _mm32(tile, operand) if tile.dtype == torch.bfloat16 else tile @ operand


def split_rows(rows: Tensor, scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x, x_low, u, v)`` of fp32 unit rows: ``x = sqrt(scale) * rows`` (fp32), ``x_low`` its rounding to
    ``dtype`` (the backward products' operand), and the forward GEMM's fp16 operands ``u = [l | h | h]``,
    ``v = [h | h | l]`` (``h`` the fp16 rounding of ``x``, ``l = x - h`` rounded), so that ``u_i . v_j =
    x_i . x_j`` to about 2^-21 of ``|x_i| |x_j|``; ``u[:, :2D]`` holds both parts of ``x``.

    Both operands are views of one ``[l | h | h | l]`` buffer (a leading dimension of 4D, which a GEMM reads
    without a copy), written by two ops: ``h`` into its two adjacent blocks at once, ``l`` into the outer
    two (a concatenation would add two launches)."""
    x = rows * math.sqrt(scale)
    n, dim = x.shape
    parts = torch.empty(n, 4, dim, dtype=SPLIT, device=x.device)
    wide = x.unsqueeze(1).expand(n, 2, dim)
    high = parts[:, 1:3]
    high.copy_(wide)  # h, rounded as it is written
    torch.sub(wide, high, out=parts[:, ::3])  # l = x - h, the remainder rounded as it is written
    flat = parts.view(n, 4 * dim)
    return x, x.to(dtype), flat[:, : 3 * dim], flat[:, dim:]



def scaled_blocks(x: Tensor, coefs: tuple[Tensor | None, ...], dtype: torch.dtype) -> Tensor:
    """``[k_0 * x | k_1 * x | ...]`` (n, len(coefs) D) in ``dtype``, each ``k`` a per-row coefficient (None: ``x``
    itself), each block rounded as it is written: the other operand of a product that takes its coefficients out of
    the tile (:mod:`.factored_strips`, :mod:`.pair_factored`, :mod:`.pair_strips`); a GEMM reads any run of adjacent
    blocks as it lies (a leading dimension of ``len(coefs) D``, no copy)."""
    n, dim = x.shape
    out = torch.empty(n, len(coefs) * dim, dtype=dtype, device=x.device)
    for k, coef in enumerate(coefs):
        block = out[:, k * dim : (k + 1) * dim]
        if coef is None:
            block.copy_(x)
        else:
            torch.mul(x, coef[:, None], out=block)
    return out

class _AddedProducts(ABC):
    """The tile loops' accumulation for products that return each tile's product (fp32 from tensor cores): added
    into the accumulator's slice, where :class:`Products` accumulates in its GEMM (``addmm_``)."""

    @abstractmethod
    def row_product(self, g: Tensor, c0: int = 0, c1: int | None = None) -> Tensor: ...

    @abstractmethod
    def column_product(self, g: Tensor, r0: int = 0, r1: int | None = None) -> Tensor: ...

    def add_rows(self, acc: Tensor, g: Tensor, c0: int, c1: int) -> None:
        acc.add_(self.row_product(g, c0, c1))

    def add_columns(self, acc: Tensor, g: Tensor, r0: int, r1: int) -> None:
        acc.add_(self.column_product(_first_columns(g, acc.shape[0]), r0, r1))


class HalfProducts(_AddedProducts):
    """Products on tensor cores from the caller's fp16/bf16 rows (see the module docstring).

    Args:
        a_raw: the anchors as given (R, D), fp16 or bf16.
        b_raw: the candidates as given (C, D), same dtype; ``a_raw`` for a single set.
        a: ``Â`` in fp32 (the column products' other operand never uses it; kept for
            the shapes and the accumulators' dtype).
        inv_a: ``1 / max(||a_i||, eps)`` (R,) fp32, or None when not normalised.
        inv_b: the same for the candidates (C,), or None.
        scale: the logit scale (a float or a 0-dim fp32 tensor).
    """

    half = True

    def __init__(self, a_raw: Tensor, b_raw: Tensor, a: Tensor, inv_a: Tensor | None, inv_b: Tensor | None,
                 scale: Scale) -> None:
        self.a_raw, self.b_raw, self.a = a_raw, b_raw, a
        self.inv_a, self.inv_b = inv_a, inv_b
        self.row_factor: Tensor | Scale = scale if inv_a is None else inv_a * scale
        self.dtype = a_raw.dtype
        # fp16 has 5 exponent bits: a gradient entry of 1e-9 would flush to zero, so each
        # tile is normalised by its largest magnitude before rounding (bf16 has fp32's range).
        self.rescale = a_raw.dtype == torch.float16
        # A learnable scale's gradient sums G @ B̂ against Â: with G rounded once to bf16 it would
        # carry ~2^-9 relative error. Then the row product also multiplies the rounding remainder
        # (G = G_hi + G_lo, one more GEMM), which makes it accurate to ~2^-17.
        self.split_rows = isinstance(scale, Tensor)

    def logits(self, r0: int, r1: int, c0: int, c1: int, out: Tensor | None = None) -> Tensor:
        s = _mm32(self.a_raw[r0:r1], self.b_raw[c0:c1].t(), out)
        factor = self.row_factor
        if isinstance(factor, Tensor) and factor.dim() == 1:
            s.mul_(factor[r0:r1, None])
        else:
            s.mul_(factor)
        if self.inv_b is not None:
            s.mul_(self.inv_b[None, c0:c1])
        return s

    def _scaled(self, g: Tensor, factor: Tensor | None, dim: int) -> tuple[Tensor, Tensor | None]:
        """``g`` times the other side's factor (along ``dim``), in fp32; with fp16 also divided by
        its largest magnitude, returned as the second item (None otherwise)."""
        if factor is not None:
            g = g * (factor[None, :] if dim == 1 else factor[:, None])
        if not self.rescale:
            return g, None
        peak = g.abs().amax().clamp_min(torch.finfo(torch.float32).tiny)
        return g / peak, peak

    def _rounded(self, g: Tensor, factor: Tensor | None, dim: int) -> Tensor:
        """``g`` times the other side's factor, rounded to the operand dtype by the multiply itself
        (``out=``): the fp32 product is never stored, so the gradient tile costs one read of ``g``
        and one half-width write -- the same bits as multiplying in fp32 and rounding after."""
        if factor is None:
            return torch.empty(g.shape, dtype=self.dtype, device=g.device).copy_(g)
        return rounded_mul(g, factor[None, :] if dim == 1 else factor[:, None], self.dtype)

    def row_product(self, g: Tensor, c0: int = 0, c1: int | None = None) -> Tensor:
        c1 = self.b_raw.shape[0] if c1 is None else c1
        factor = None if self.inv_b is None else self.inv_b[c0:c1]
        if not (self.rescale or self.split_rows):  # bf16: the gradient tile rounded as it is formed
            return _mm32(self._rounded(g, factor, 1), self.b_raw[c0:c1])
        wide, peak = self._scaled(g, factor, 1)
        gh = wide.to(self.dtype)
        out = _mm32(gh, self.b_raw[c0:c1])
        if self.split_rows:  # the rounding remainder, from the same scaled tile
            out.add_(_mm32((wide - gh.float()).to(self.dtype), self.b_raw[c0:c1]))
        return out if peak is None else out.mul_(peak)

    def column_product(self, g: Tensor, r0: int = 0, r1: int | None = None) -> Tensor:
        r1 = self.a_raw.shape[0] if r1 is None else r1
        factor = None if self.inv_a is None else self.inv_a[r0:r1]
        if not self.rescale:
            return _mm32(self._rounded(g, factor, 0).t(), self.a_raw[r0:r1])
        wide, peak = self._scaled(g, factor, 0)
        out = _mm32(wide.to(self.dtype).t(), self.a_raw[r0:r1])
        return out if peak is None else out.mul_(peak)


#: Features below which the split product pays (:class:`SplitProducts`): per logit entry it saves two read-write
#: passes of fp32 (16 bytes) for two more GEMM-equivalents (4 D FLOPs), so ``D < 4 * FLOP rate / bandwidth`` --
#: from the cost model's table (the H100's constants: about 1,100 features).
SPLIT_FEATURES = int(4 * GPUS["H100"].gemm_flops["bfloat16"] / GPUS["H100"].bandwidth)


class SplitProducts(_AddedProducts):
    """Tensor-core products for bf16 rows with a positive float scale, from split operands: the logits from one
    GEMM of fp16 parts, ``[l | h | h] @ [h | h | l]^T = x_a . x_b`` to about 2^-21 of the scale (``x = sqrt(scale)
    z``, ``z`` the fp32 unit rows; :func:`split_rows`), so a logit tile costs one write where
    :class:`HalfProducts`' factors add two read-write passes per tile, forward and backward; the backward products
    multiply the gradient tile, rounded once to bf16 with ``1 / sqrt(scale)`` folded in, by ``x`` rounded to bf16 --
    the same 2^-9 rounding as the tile's own (the lean one tile's scheme, :mod:`.one_tile_half`, on every tile).

    Args:
        a: ``Â`` (R, D) in fp32 (the unit rows, or the rows as given when not normalised).
        b: ``B̂`` (C, D); ``a`` itself for a single set.
        scale: the logit scale (a positive float).
        dtype: the operand dtype of the backward products (bf16).
    """

    half = True

    def __init__(self, a: Tensor, b: Tensor, scale: float, dtype: torch.dtype) -> None:
        self.a, self.dtype, self.inverse_root = a, dtype, 1.0 / math.sqrt(scale)
        _, self.low_a, self.u, v = split_rows(a, scale, dtype)
        if b is a:  # one set: its split serves both sides
            self.low_b, self.v = self.low_a, v
        else:
            _, self.low_b, _, self.v = split_rows(b, scale, dtype)

    def logits(self, r0: int, r1: int, c0: int, c1: int, out: Tensor | None = None) -> Tensor:
        return _mm32(self.u[r0:r1], self.v[c0:c1].t(), out)

    def _rounded(self, g: Tensor) -> Tensor:
        return torch.mul(g, self.inverse_root, out=torch.empty(g.shape, dtype=self.dtype, device=g.device))

    def row_product(self, g: Tensor, c0: int = 0, c1: int | None = None) -> Tensor:
        return _mm32(self._rounded(g), self.low_b[c0:c1])

    def column_product(self, g: Tensor, r0: int = 0, r1: int | None = None) -> Tensor:
        return _mm32(self._rounded(g).t(), self.low_a[r0:r1])


AnyProducts = Products | HalfProducts | SplitProducts

#: Columns an offset adds to a product's operands (:func:`offset_logits`): its parts, a factor of 1 each, then zeros
#: to a multiple of 8 (tensor cores and vectorised GEMMs read the inner dimension in eights).
OFFSET_COLUMNS = 8

#: A tile of ``o_i - S_ij``: ``tile(r0, r1, c0, c1, out)``.
OffsetTile = Callable[[int, int, int, int, Tensor], Tensor]


def offset_logits(prod: AnyProducts, offsets: Tensor) -> OffsetTile:
    """``o_i - S_ij`` tile by tile, written once by the GEMM itself: the operands carry ``o`` as extra columns against
    columns of 1, so no tile-wide subtraction reads and writes the tile again (two passes saved per tile).

    :class:`SplitProducts` negate their fp16 ``u`` and carry ``o`` in three fp16 parts (``o = h + m + l`` to about
    2^-33 of ``|o|``, finer than the split product's own 2^-21) and a fourth for a row's ``-inf`` (a row without
    negatives: no remainder of it is taken), and
    :class:`Products` carry ``-scale * Â`` and ``o`` in the compute dtype (exact as the product is) -- except on a GPU
    that may round fp32 GEMMs to TF32 (``o`` would lose digits the logits keep): there, as for
    :class:`HalfProducts` (whose factors apply after the product), the tile is formed and subtracted from ``o``.
    The operands are built once per call: O((R + C) D), a few launches.
    """
    if isinstance(prod, SplitProducts):
        rows, width = prod.u.shape
        left = prod.u.new_zeros(rows, width + OFFSET_COLUMNS)
        torch.neg(prod.u, out=left[:, :width])
        finite = torch.where(offsets.isfinite(), offsets, 0.0)
        parts = left[:, width : width + 4]
        parts[:, 0].copy_(finite)  # o rounded
        torch.sub(finite, parts[:, 0], out=parts[:, 1])  # the remainder, rounded
        torch.sub(finite, parts[:, :2].float().sum(1), out=parts[:, 2])  # the remainder's, rounded
        torch.sub(offsets, finite, out=parts[:, 3])  # a row's -inf (0 elsewhere): no part subtracts from it
        right = prod.v.new_zeros(prod.v.shape[0], width + OFFSET_COLUMNS)
        right[:, :width].copy_(prod.v)
        right[:, width : width + 4].fill_(1.0)
        return lambda r0, r1, c0, c1, out: _mm32(left[r0:r1], right[c0:c1].t(), out)
    if isinstance(prod, Products) and not (prod.a.is_cuda and prod.a.dtype == torch.float32 and _tf32_allowed()):
        dim = prod.a.shape[1]
        left = prod.a.new_zeros(prod.a.shape[0], dim + OFFSET_COLUMNS)
        torch.neg(prod.a_s, out=left[:, :dim])
        left[:, dim].copy_(offsets)
        right = prod.b.new_zeros(prod.b.shape[0], dim + OFFSET_COLUMNS)
        right[:, :dim].copy_(prod.b)
        right[:, dim].fill_(1.0)
        return lambda r0, r1, c0, c1, out: logits_tile(out, left[r0:r1], right[c0:c1])

    def subtracted(r0: int, r1: int, c0: int, c1: int, out: Tensor) -> Tensor:
        return torch.sub(offsets[r0:r1, None], prod.logits(r0, r1, c0, c1, out), out=out)

    return subtracted


#: Whether a CUDA fp32 GEMM may round to TF32 (read in C, as the planner reads it).
_tf32_allowed: Callable[[], bool] = getattr(torch._C, "_get_cublas_allow_tf32",
                                            lambda: bool(torch.backends.cuda.matmul.allow_tf32))


class KernelOperands:
    """What the Triton kernels multiply. Half-precision inputs (a plan with ``operand_dtype``):
    the caller's own rows, unrounded, with the scale and the normalisation as fp32 factors on the
    logit tile (``S_ij = fx_i fy_j <a_i, b_j>``) and folded into the gradient tile before its
    products -- as the torch backend's tensor-core products (:mod:`.products`); rounding
    ``scale * a / ||a||`` to half instead costs ~1 % of the gradients at tau = 0.01. Otherwise
    the compute-dtype rows, ``x = scale * Â``, no factors. Under the interpreter half operands
    are widened to fp32 (its bf16 dot is inexact): the same numbers."""

    def __init__(self, plan: Any, raw: tuple[Tensor | None, ...], a: Tensor, b: Tensor, scale: Scale,
                 norms: list[Tensor], a_s: Tensor | None = None) -> None:
        self.factors: tuple[Tensor, Tensor, Tensor] | None = None
        a_raw = raw[0] if raw else None
        if plan.operand_dtype is None or a_raw is None:
            self.x, self.y, self.z = (a * scale if a_s is None else a_s), b, a
            return
        single = len(raw) < 2 or raw[1] is None  # a single set: the candidates are the anchors
        b_raw = raw[1] if not single and raw[1] is not None else a_raw
        inv_a = norms[0].reciprocal().squeeze(1) if plan.normalize else a.new_ones(a.shape[0])
        inv_b = (inv_a if single else norms[2].reciprocal().squeeze(1)) if plan.normalize else b.new_ones(b.shape[0])
        self.x, self.y, self.z = a_raw, b_raw, a_raw
        self.factors = ((inv_a * scale).contiguous(), inv_b.contiguous(), inv_a.contiguous())

    def pair(self, swapped: bool = False, rows: int | None = None) -> tuple[Tensor, Tensor] | None:
        """``(fx, fy)`` of ``S`` -- of ``S.T`` when ``swapped`` (its first ``rows`` rows)."""
        if self.factors is None:
            return None
        fx, fy, _ = self.factors
        return (fy[:rows], fx) if swapped else (fx, fy)


def make_products(half: bool, raw: tuple[Tensor | None, ...], a_s: Tensor | None, a: Tensor, b: Tensor, scale: Scale,
                  norms: list[Tensor], normalize: bool, tiles: bool = False) -> AnyProducts:
    """The products a plan asked for.

    Args:
        half: multiply the raw fp16/bf16 inputs on tensor cores (:class:`HalfProducts`).
        raw: ``(anchors, candidates)`` as the caller gave them (candidates None for a single set).
        a_s: ``scale * Â`` when already formed (forward), else None.
        a, b: ``Â``, ``B̂`` in the compute dtype.
        norms: ``(denominator, norm)`` of the anchors, then of the candidates unless they
            are the anchors, as the engine's normalisation returned them.
        tiles: the problem spans tiles (the split's few launches per call pay back on every tile's two passes;
            one tile, host-bound where the general executor serves it, keeps the factors).
    """
    if not half:
        return Products(a_s, a, b, scale)
    a_raw, b_raw = raw[0], raw[1]
    if a_raw is None:
        raise ValueError("half-precision products need the raw inputs")
    # unit rows keep the split's fp16 parts in range (rows as given may not); fp16 tiles need a rescale; a tensor
    # scale (a learnable temperature) needs the remainder product (HalfProducts.split_rows)
    if tiles and normalize and a_raw.dtype == torch.bfloat16 and isinstance(scale, float) and scale > 0 \
            and a.shape[1] < SPLIT_FEATURES:
        return SplitProducts(a, b, scale, a_raw.dtype)
    inv_a = inv_b = None
    if normalize:
        inv_a = norms[0].reciprocal().squeeze(1)
        inv_b = inv_a if b_raw is None else norms[2].reciprocal().squeeze(1)
    return HalfProducts(a_raw, a_raw if b_raw is None else b_raw, a, inv_a, inv_b, scale)
