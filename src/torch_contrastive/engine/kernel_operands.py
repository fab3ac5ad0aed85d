"""What the Triton kernels multiply, from a plan and the saved operands (see :class:`KernelOperands`)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ._common import Scale


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
