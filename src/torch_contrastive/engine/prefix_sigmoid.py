"""SigLIP's sigmoid pairs over every prefix of the features in one pass (Matryoshka representations), on the
prefix engine's band products, strips and shared backward (:mod:`.prefixes`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._tensors import save_for_backward
from .prefixes import PerStrip, PrefixPlan, Targets, compute_dtype_of, operands, prefix_backward, prefix_products, scaled, weight_of

__all__ = ["PrefixSigmoid"]


class PrefixSigmoid(torch.autograd.Function):
    """SigLIP's sigmoid pairs over every prefix in one pass (Zhai et al. 2023):
    ``sum_p w_p * sum_ij softplus(-z_ij (t * cos_p(i, j) + b)) / N`` (``plan.mean`` False: not divided by N),
    ``z = +1`` for the positives -- the diagonal (row ``i``'s candidate ``targets.offset + i``), or with keys in
    ``targets`` the same-key pairs (SigLIP's ids: an image and a text whose image ids or text ids match) -- and
    -1 elsewhere; ``t`` and ``b`` 0-dim tensors (gradients when they require them). The plan's scale is 1: the
    cosines are the engine's logits and ``t`` is applied here."""

    @staticmethod
    def forward(ctx: Any, anchors: Tensor, candidates: Tensor, plan: PrefixPlan, t: Tensor,  # type: ignore[override]
                b: Tensor, targets: Targets | None = None) -> Tensor:
        a, c, inv_a, inv_c = operands(anchors, candidates, plan)
        n, cuts = a.shape[0], plan.cuts
        t_, b_ = t.to(a.dtype), b.to(a.dtype)
        total = a.new_zeros(())
        shift = 0 if targets is None else targets.offset  # row i's own candidate: column shift + i
        for start in range(0, n, plan.strip):
            stop = min(start + plan.strip, n)
            positive = _sigmoid_positives(targets, start, stop, a.device)
            for k, raw in enumerate(prefix_products(a[start:stop], c, cuts)):
                u = _signed(scaled(raw, plan, inv_a, inv_c, k, start, stop), t_, b_, start + shift, positive)
                total = total + weight_of(plan, k) * torch.nn.functional.softplus(u).sum()
        save_for_backward(ctx, anchors, candidates, t, b)
        ctx.plan, ctx.targets = plan, targets
        return (total / n if plan.mean else total).to(torch.promote_types(anchors.dtype, torch.float32))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, Tensor | None, Tensor | None, None]:  # type: ignore[override]
        anchors, candidates, t, b = ctx.saved_tensors
        plan: PrefixPlan = ctx.plan
        targets: Targets | None = ctx.targets
        dtype = compute_dtype_of(anchors)
        t_, b_ = t.to(dtype), b.to(dtype)
        dt, db = t_.new_zeros(()), t_.new_zeros(())
        strip = PerStrip(lambda start, stop: _sigmoid_positives(targets, start, stop, anchors.device))
        shift = 0 if targets is None else targets.offset

        def grad_tile(cos: Tensor, k: int, start: int, stop: int, weight: Tensor) -> Tensor:
            nonlocal dt, db
            positive = strip(start, stop)
            tile = torch.sigmoid(_signed(cos, t_, b_, start + shift, positive))  # d softplus(u) / du, u = -z s
            tile = _flip(tile, start + shift, positive)  # d u / d s = -z
            dt = dt + weight * (tile * cos).sum()
            db = db + weight * tile.sum()
            return tile.mul_(t_)  # d value / d cos

        g = grad.to(dtype) / anchors.shape[0] if plan.mean else grad.to(dtype)
        da, dc = prefix_backward(anchors, candidates, plan, g, grad_tile)
        return (da.to(anchors.dtype) if ctx.needs_input_grad[0] else None,
                dc.to(candidates.dtype) if ctx.needs_input_grad[1] else None, None,
                dt.to(t) if ctx.needs_input_grad[3] else None, db.to(b) if ctx.needs_input_grad[4] else None, None)


def _sigmoid_positives(targets: Targets | None, start: int, stop: int, device: torch.device) -> Tensor | None:
    """Rows ``start:stop``'s positive mask under keys; None for the diagonal (no keys)."""
    return None if targets is None or targets.row_keys is None else targets.strip(start, stop, device)[1]


def _flip(tile: Tensor, start: int, positive: Tensor | None) -> Tensor:
    """``tile`` with the positives' entries negated: in place on the diagonal (the tile's row ``i``'s candidate
    ``start + i``), a new tile under a positive mask."""
    if positive is not None:
        return torch.where(positive, -tile, tile)
    rows = torch.arange(tile.shape[0], device=tile.device)
    tile[rows, rows + start] *= -1.0
    return tile


def _signed(cos: Tensor, t: Tensor, b: Tensor, start: int, positive: Tensor | None) -> Tensor:
    """``u = -z (t cos + b)``: the logits of the negatives as they are, the positives' negated (a new tile)."""
    return _flip(cos * t + b, start, positive)
