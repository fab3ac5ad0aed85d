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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._tensors import self_diagonal
from . import planner
from .driver import Gradients, Operands, Saved, run
from .planner import Decision
from .precision import Scale
from .problem import Options, Problem, SigmoidPairs
from .products import KernelOperands
from .tiling import Buffers, logits_tile, tiles

if TYPE_CHECKING:
    from ..positives import Positives


@dataclass(frozen=True)
class _Plan:
    positives: Positives
    # Positive of row i is column i + diagonal_offset (no ids): a strided diagonal of
    # each tile. None: positives come from Positives.tile (ids).
    diagonal_offset: int | None
    tile: int  # 0: one tile covers everything
    normalize: bool
    eps: float
    backend: str = "torch"
    # Triton on a GPU: half inputs reach tl.dot in their own dtype (None: the compute dtype)
    operand_dtype: torch.dtype | None = None


def _triton_positives(positives: Positives, diagonal: int | None) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]] | None:
    """The id keys the Triton kernels compare (None: a strided diagonal or no positive at all)."""
    if positives.kind == "keys" and diagonal is None:
        return positives.row_keys, positives.col_keys
    return None


def _signed_tile(s: Tensor, plan: _Plan, r0: int, r1: int, c0: int, c1: int) -> tuple[Tensor, Tensor | None]:
    """``-z_ij S_ij`` (in place on ``s``) and the positive mask (None for the diagonal layout)."""
    if plan.diagonal_offset is not None:
        diag = self_diagonal(s, r0, c0, plan.diagonal_offset)
        if diag is not None:
            diag.neg_()
        return s, None
    pos = plan.positives.tile(r0, r1, c0, c1)
    return torch.where(pos, -s, s), pos


def _grad_tile(signed: Tensor, pos: Tensor | None, g_row: Tensor, plan: _Plan, r0: int, c0: int) -> Tensor:
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


class _SigmoidKernel:
    """The sigmoid pairs as a kernel of the engine's driver (:mod:`.driver`); its one extra
    input is the bias (a float, or a 0-dim tensor that gets its gradient)."""

    def forward(self, ctx: Any, plan: _Plan, ops: Operands, extras: tuple[Any, ...]) -> tuple[Any, dict[str, Any]]:
        (bias,) = extras
        a_c, b_c = ops.a_c, ops.b_c
        bias_c = _bias_tensor(bias, a_c)
        a_s = a_c * ops.scale
        R, C = a_c.shape[0], b_c.shape[0]
        kept: tuple[Tensor, ...] = ()
        if plan.backend == "triton":
            from . import triton_backend

            kops = KernelOperands(plan, (ops.a, ops.b), a_c, b_c, ops.scale, ops.norms, a_s)
            keys = _triton_positives(plan.positives, plan.diagonal_offset)
            out = triton_backend.sigmoid_sums(kops.x, kops.y, bias_c, plan.diagonal_offset, keys, kops.pair())
            if plan.operand_dtype is not None:  # backward multiplies the raw rows again
                kept = tuple(t for t in (ops.a, ops.b) if t is not None)
        elif plan.tile == 0:
            signed, pos = _signed_tile(logits_tile(None, a_s, b_c).add_(bias_c), plan, 0, R, 0, C)
            out = F.softplus(signed).sum(1)
            kept = (signed,) if pos is None else (signed, pos)  # one tile: kept for backward
        else:
            out = a_c.new_zeros(R)
            bufs = Buffers(a_c.dtype, a_c.device)
            for r0, r1, c0, c1 in tiles(R, C, plan.tile, False):
                signed, _ = _signed_tile(logits_tile(bufs.get(r1 - r0, c1 - c0), a_s[r0:r1], b_c[c0:c1]).add_(bias_c),
                                         plan, r0, r1, c0, c1)
                out[r0:r1] += F.softplus(signed).sum(1)
        ctx.bias_is_tensor = isinstance(bias, Tensor)
        ctx.float_bias = None if isinstance(bias_c, Tensor) else bias_c
        return out, {"bias": bias_c if isinstance(bias_c, Tensor) else None, "kept": kept}

    def backward(self, ctx: Any, plan: _Plan, saved: Saved, grads: tuple[Tensor | None, ...]) -> Gradients:
        a, b, scale, rest = saved.a, saved.b, saved.scale, list(saved.keep["kept"])
        bias: Tensor | float = saved.keep["bias"] if ctx.float_bias is None else ctx.float_bias
        g_row = grads[0].to(a.dtype)  # type: ignore[union-attr]
        if plan.backend == "triton":
            from . import triton_backend

            kops = KernelOperands(plan, tuple(rest), a, b, scale, saved.norms)
            keys = _triton_positives(plan.positives, plan.diagonal_offset)
            gb, ga, gbias = triton_backend.sigmoid_grad(kops.x, kops.y, kops.z, g_row, bias, plan.diagonal_offset, keys,
                                                        kops.factors)
        elif rest:  # the one tile kept from forward
            signed, pos = rest[0], (rest[1] if len(rest) > 1 else None)
            grad = _grad_tile(signed, pos, g_row, plan, 0, 0)
            gb, ga, gbias = grad @ b, grad.t() @ a, grad.sum()
        else:
            a_s = a * scale
            gb, ga = torch.zeros_like(a), torch.zeros_like(b)
            gbias = a.new_zeros(())
            bufs = Buffers(a.dtype, a.device)
            for r0, r1, c0, c1 in tiles(a.shape[0], b.shape[0], plan.tile, False):
                signed, pos = _signed_tile(logits_tile(bufs.get(r1 - r0, c1 - c0), a_s[r0:r1], b[c0:c1]).add_(bias),
                                           plan, r0, r1, c0, c1)
                grad = _grad_tile(signed, pos, g_row[r0:r1], plan, r0, c0)
                gb[r0:r1].addmm_(grad, b[c0:c1])
                ga[c0:c1].addmm_(grad.t(), a[r0:r1])
                gbias += grad.sum()
        return Gradients(gb, ga, False, (gbias if ctx.bias_is_tensor else None,))


_SIGMOID = _SigmoidKernel()


def sigmoid_rows(
    anchors: Tensor,
    candidates: Tensor,
    scale: Scale,
    bias: Scale,
    positives: Positives,
    *,
    diagonal_offset: int | None = None,
    normalize: bool = False,
    eps: float = 1e-12,
    chunk_size: int | None = None,
    backend: str = "auto",
) -> Tensor:
    """Per-row ``sum_j softplus(-z_ij S_ij)`` with ``S = scale * anchors @ candidates.T + bias``.

    Args:
        anchors: (R, D) image embeddings; candidates: (C, D) text embeddings.
        scale: the logit scale (multiplier), float or 0-dim tensor (gets its gradient).
        bias: the logit bias, float or 0-dim tensor (gets its gradient).
        positives: a :class:`~torch_contrastive.positives.Positives` (R x C, no self
            pairs) giving ``z_ij = +1``.
        diagonal_offset: when the only positive of row i is column ``i + diagonal_offset``
            (no ids), positives are handled as a strided diagonal, without a mask.
        normalize, eps: L2-normalise both inputs inside the function.
        chunk_size: tile edge (see :func:`resolve_tile`).
        backend: ``"torch"``, ``"triton"`` (fused tile kernels, :mod:`.triton_backend.sigmoid_pairs`:
            positives on the diagonal, by ids or none) or ``"auto"`` -- the torch backend until
            the kernels are measured faster on a GPU.

    Returns:
        (R,) row sums in the compute dtype (fp32 for half inputs).

    Memory: O((R + C) * D) plus two tile buffers; a single tile is kept for backward.
    """
    problem = Problem(anchors, candidates, scale, SigmoidPairs(bias, diagonal_offset), positives=positives,
                      options=Options(normalize, float(eps), chunk_size, backend))
    return execute(problem, planner.plan(problem))


def execute(problem: Problem, decision: Decision) -> Tensor:
    """Run a :class:`~.problem.SigmoidPairs` problem as ``decision`` says (see :func:`sigmoid_rows`)."""
    stat, positives, opts = problem.statistic, problem.positives, problem.options
    if not isinstance(stat, SigmoidPairs) or positives is None:
        raise TypeError("sigmoid.execute runs SigmoidPairs problems (with positives)")
    sigmoid_plan = _Plan(positives, stat.diagonal_offset, decision.tile, opts.normalize, float(opts.eps), decision.backend,
                         decision.operand_dtype)
    return run(_SIGMOID, sigmoid_plan, problem.anchors, problem.candidates, problem.scale, stat.bias)
