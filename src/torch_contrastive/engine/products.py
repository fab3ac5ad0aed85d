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

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor

from .precision import Scale, zero


def logits_tile(out: Tensor | None, a_scaled: Tensor, b: Tensor) -> Tensor:
    """``a_scaled @ b.T``, into ``out`` when given (a reused tile buffer)."""
    if out is None:
        return torch.mm(a_scaled, b.t())
    return torch.mm(a_scaled, b.t(), out=out)


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


def mm32(x: Tensor, y: Tensor, out: Tensor | None = None) -> Tensor:
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


#: > 0 while :func:`mm32` widens half operands on a CPU (no GPU would): the cost counter
#: (:mod:`torch_contrastive.cli.traffic`) skips those copies and counts the product at the
#: operands' own width.
WIDENING = [0]


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
        s = mm32(self.a_raw[r0:r1], self.b_raw[c0:c1].t(), out)
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
            return mm32(self._rounded(g, factor, 1), self.b_raw[c0:c1])
        wide, peak = self._scaled(g, factor, 1)
        gh = wide.to(self.dtype)
        out = mm32(gh, self.b_raw[c0:c1])
        if self.split_rows:  # the rounding remainder, from the same scaled tile
            out.add_(mm32((wide - gh.float()).to(self.dtype), self.b_raw[c0:c1]))
        return out if peak is None else out.mul_(peak)

    def column_product(self, g: Tensor, r0: int = 0, r1: int | None = None) -> Tensor:
        r1 = self.a_raw.shape[0] if r1 is None else r1
        factor = None if self.inv_a is None else self.inv_a[r0:r1]
        if not self.rescale:
            return mm32(self._rounded(g, factor, 0).t(), self.a_raw[r0:r1])
        wide, peak = self._scaled(g, factor, 0)
        out = mm32(wide.to(self.dtype).t(), self.a_raw[r0:r1])
        return out if peak is None else out.mul_(peak)


AnyProducts = Products | HalfProducts


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
                  norms: list[Tensor], normalize: bool) -> AnyProducts:
    """The products a plan asked for.

    Args:
        half: multiply the raw fp16/bf16 inputs on tensor cores (:class:`HalfProducts`).
        raw: ``(anchors, candidates)`` as the caller gave them (candidates None for a single set).
        a_s: ``scale * Â`` when already formed (forward), else None.
        a, b: ``Â``, ``B̂`` in the compute dtype.
        norms: ``(denominator, norm)`` of the anchors, then of the candidates unless they
            are the anchors, as the engine's normalisation returned them.
    """
    if not half:
        return Products(a_s, a, b, scale)
    a_raw, b_raw = raw[0], raw[1]
    if a_raw is None:
        raise ValueError("half-precision products need the raw inputs")
    inv_a = inv_b = None
    if normalize:
        inv_a = norms[0].reciprocal().squeeze(1)
        inv_b = inv_a if b_raw is None else norms[2].reciprocal().squeeze(1)
    return HalfProducts(a_raw, a_raw if b_raw is None else b_raw, a, inv_a, inv_b, scale)
