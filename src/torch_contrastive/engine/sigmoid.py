"""Pairwise sigmoid (binary cross-entropy) terms: the SigLIP loss (Zhai et al. 2023).

For ``S = scale * A @ B.T + bias`` and labels ``z_ij = +1`` on positives, -1 elsewhere,
this computes per row ``sum_j softplus(-z_ij S_ij)`` (= ``-sum_j log sigmoid(z_ij S_ij)``)
block by block. Every element is a negative except the few positives, so a tile costs
one ``softplus`` per element; positives are fixed in place -- a strided diagonal when
the positive of image i is text i (no ids), a mask where ids make duplicates positive.
Never ``log(sigmoid(.))`` and never ``softplus(s) - s`` for a positive: both lose the
small terms that remain when the model is confident (a test pins scale 100, bias 20).

Backward: ``dS_ij = -z_ij sigmoid(-z_ij S_ij) g_i``; ``dA += scale G B``,
``dB += scale G.T A``, ``dscale = sum_ij G_ij a_i.b_j``, ``dbias = sum_ij G_ij``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._tensors import self_diagonal
from .driver import Gradients, Operands, Saved, run
from .precision import Scale
from .problem import Problem, SigmoidPairs
from .products import Products, logits_tile
from .tiling import Buffers, gradient_sweep, sweep

if TYPE_CHECKING:
    from .plans import SigmoidPlan


def _signed_tile(s: Tensor, plan: SigmoidPlan, r0: int, r1: int, c0: int, c1: int) -> tuple[Tensor, Tensor | None]:
    """``-z_ij S_ij`` (in place on ``s``) and the positive mask (None for the diagonal layout)."""
    if plan.diagonal_offset is not None:
        diag = self_diagonal(s, r0, c0, plan.diagonal_offset)
        if diag is not None:
            diag.neg_()
        return s, None
    pos = plan.positives.tile(r0, r1, c0, c1)
    return torch.where(pos, -s, s), pos


def _grad_tile(signed: Tensor, pos: Tensor | None, g_row: Tensor, plan: SigmoidPlan, r0: int, c0: int) -> Tensor:
    """``dS = -z sigmoid(-z S) g_i``: ``sigmoid(signed)`` times ``+g`` (negatives) or ``-g`` (positives)."""
    grad = torch.sigmoid(signed)
    if pos is None:
        grad.mul_(g_row[:, None])
        diag = self_diagonal(grad, r0, c0, plan.diagonal_offset)
        if diag is not None:
            diag.neg_()
        return grad
    return grad.mul_(torch.where(pos, -g_row[:, None], g_row[:, None]))


def _bias_tensor(bias: Scale, like: Tensor) -> Tensor | float:
    return bias.detach().to(device=like.device, dtype=like.dtype) if isinstance(bias, Tensor) else float(bias)


class SigmoidExecutor:
    """The sigmoid pairs as an executor of the engine's driver (:mod:`.driver`). This class owns
    the logit bias (the one extra input: a float, or a 0-dim tensor that gets its gradient) and a
    backend supplies :meth:`row_sums` and :meth:`gradients`."""

    def run(self, problem: Problem, plan: SigmoidPlan) -> Tensor:
        """Run a :class:`~.problem.SigmoidPairs` problem as ``plan`` says (see :func:`sigmoid_rows`)."""
        stat = problem.statistic
        if not isinstance(stat, SigmoidPairs):
            raise TypeError(f"the sigmoid executor runs SigmoidPairs problems, got {type(stat).__name__}")
        return run(self, plan, problem.anchors, problem.candidates, problem.scale, stat.bias)

    def row_sums(self, plan: SigmoidPlan, ops: Operands, a_s: Tensor, bias: Tensor | float) -> tuple[Tensor, tuple[Tensor, ...]]:
        raise NotImplementedError

    def gradients(self, plan: SigmoidPlan, saved: Saved, g_row: Tensor, bias: Tensor | float) -> tuple[Tensor, Tensor | None, Tensor]:
        raise NotImplementedError

    def forward(self, ctx: Any, plan: SigmoidPlan, ops: Operands, extras: tuple[Any, ...]) -> tuple[Any, dict[str, Any]]:
        (bias,) = extras
        bias_c = _bias_tensor(bias, ops.a_c)
        out, kept = self.row_sums(plan, ops, ops.a_c * ops.scale, bias_c)
        ctx.bias_is_tensor = isinstance(bias, Tensor)
        ctx.float_bias = None if isinstance(bias_c, Tensor) else bias_c
        return out, {"bias": bias_c if isinstance(bias_c, Tensor) else None, "kept": kept}

    def backward(self, ctx: Any, plan: SigmoidPlan, saved: Saved, grads: tuple[Tensor | None, ...]) -> Gradients:
        bias: Tensor | float = saved.keep["bias"] if ctx.float_bias is None else ctx.float_bias
        g_row = grads[0].to(saved.a.dtype)  # type: ignore[union-attr]
        gb, ga, gbias = self.gradients(plan, saved, g_row, bias)
        return Gradients(gb, ga, False, (gbias if ctx.bias_is_tensor else None,))


class TorchSigmoid(SigmoidExecutor):
    """The sigmoid pairs on torch: one tile kept for backward, or a tile loop each way."""

    def row_sums(self, plan: SigmoidPlan, ops: Operands, a_s: Tensor, bias: Tensor | float) -> tuple[Tensor, tuple[Tensor, ...]]:
        b_c = ops.b_c
        R, C = a_s.shape[0], b_c.shape[0]
        if plan.single_tile:
            signed, pos = _signed_tile(logits_tile(None, a_s, b_c).add_(bias), plan, 0, R, 0, C)
            return F.softplus(signed).sum(1), ((signed,) if pos is None else (signed, pos))  # one tile: kept for backward
        out = a_s.new_zeros(R)

        def visit(s: Tensor, r0: int, r1: int, c0: int, c1: int, bufs: Buffers) -> None:
            signed, _ = _signed_tile(s.add_(bias), plan, r0, r1, c0, c1)
            out[r0:r1] += F.softplus(signed).sum(1)

        sweep(Products(a_s, ops.a_c, b_c), R, C, plan.tile, False, visit)
        return out, ()

    def gradients(self, plan: SigmoidPlan, saved: Saved, g_row: Tensor, bias: Tensor | float) -> tuple[Tensor, Tensor | None, Tensor]:
        a, b, kept = saved.a, saved.b, saved.keep["kept"]
        if kept:  # the one tile kept from forward
            grad = _grad_tile(kept[0], kept[1] if len(kept) > 1 else None, g_row, plan, 0, 0)
            return grad @ b, grad.t() @ a, grad.sum()
        gbias = a.new_zeros(())

        def grad_tile(s: Tensor, r0: int, r1: int, c0: int, c1: int, bufs: Buffers) -> Tensor:
            signed, pos = _signed_tile(s.add_(bias), plan, r0, r1, c0, c1)
            grad = _grad_tile(signed, pos, g_row[r0:r1], plan, r0, c0)
            gbias.add_(grad.sum())
            return grad

        gb, ga = gradient_sweep(Products(a * saved.scale, a, b), a, b, plan.tile, False, grad_tile)
        return gb, ga, gbias


#: The torch sigmoid executor (a form of the torch loops: :mod:`.torch_loops`).
TORCH = TorchSigmoid()
