"""NT-Xent's weighted positive terms (``positive_weight``: DCLW, lightly's ``weight_fn``) in Matryoshka's one pass.

``loss_i = -w_i S_ip + LSE_i`` per prefix: the prefix engine takes each prefix's weights as constants
(:attr:`~torch_contrastive.engine.prefixes.Targets.positive_weight`), and a weight that requires grad gets
``d loss_i / d w_i = -S_ip`` from a term that is zero in value -- as :func:`~torch_contrastive.nt_xent_loss`
does for one width. A weight given as a tensor is every prefix's; a module's weights read off its inputs
(DCLW's von Mises-Fisher factor, a ``weight_fn``) are each prefix's own (:class:`PerPrefix`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .. import _validation as v
from ..engine.prefixes import Targets
from .prefix_calls import shrink

__all__ = ["PerPrefix", "PositiveWeights"]


@dataclass(frozen=True)
class PerPrefix:
    """A keyword argument whose value depends on the prefix: ``of(d)`` is its value for the prefix of
    width ``d`` (the loss's inputs cut to ``d`` features and normalised, as one call per prefix sees them)."""

    of: Callable[[int], Tensor]


class PositiveWeights:
    """The positive terms' weights of a one-pass NT-Xent over the prefixes.

    Args:
        given: a (N,) floating tensor (every prefix's), or a :class:`PerPrefix` of them.
        rows: the (N, D) anchors.
        candidates: the (M, D) candidates (``rows`` itself on one process; every rank's rows under ``gather``).
        partner: (N,) each anchor's positive among the candidates.
        reduction: the loss's ``reduction`` (the weights' own gradient term follows it; ``"sum"`` for a rank's
            part of a gathered loss, which the caller reduces over the ranks).
    """

    def __init__(self, given: Tensor | PerPrefix, rows: Tensor, candidates: Tensor, partner: Tensor, reduction: str) -> None:
        self.given, self.rows, self.candidates, self.partner, self.reduction = given, rows, candidates, partner, reduction
        if isinstance(given, Tensor):
            v.check_row_weight(given, "positive_weight", rows.shape[0], rows.device)

    def of(self, dims: list[int]) -> list[Tensor]:
        """Each prefix's (N,) weights, checked as the loss checks them."""
        if isinstance(self.given, Tensor):
            return [self.given.to(self.rows.device)] * len(dims)
        return [v.check_row_weight(self.given.of(d), "positive_weight", self.rows.shape[0], self.rows.device) for d in dims]

    def targets(self, targets: Targets, values: list[Tensor], dims: list[int]) -> Targets:
        """``targets`` with the weights as the engine's constants: (N, distinct prefixes) in the compute dtype, a
        column per prefix end in ascending order (the plan's ``cuts``; a prefix listed twice is one column)."""
        dtype = torch.promote_types(self.rows.dtype, torch.float32)
        columns = [values[dims.index(cut)].detach().to(dtype) for cut in sorted(set(dims))]
        return replace(targets, positive_weight=torch.stack(columns, 1))

    def around(self, targets: Targets, dims: list[int], weights: list[float], tau: float | Tensor,
               softmax: Callable[[Targets], Tensor]) -> Tensor:
        """``softmax(targets)`` with each prefix's weights in the targets, plus the weights' own gradient term."""
        values = self.of(dims)
        loss = softmax(self.targets(targets, values, dims))
        own = self.gradient_term(values, dims, weights, tau)
        return loss if own is None else loss + own

    def gradient_term(self, values: list[Tensor], dims: list[int], weights: list[float], tau: float | Tensor) -> Tensor | None:
        """``sum_p weight_p * reduce(-(w_p - stop_grad(w_p)) * S_p)``: zero in value, the weights' own gradient
        (the positives' logits ``S_p`` of prefix ``p`` held constant: the engine carries their gradient);
        None when no weight requires grad."""
        total: Tensor | None = None
        scale = tau.detach() if isinstance(tau, Tensor) else tau
        for w, d, weight in zip(values, dims, weights):
            if not w.requires_grad:
                continue
            with torch.no_grad():
                z = shrink(self.rows.detach(), d)  # the prefix as the one pass normalises it
                c = z if self.candidates is self.rows else shrink(self.candidates.detach(), d)
                positive = (z * c[self.partner]).sum(1) / scale
            term = -(w - w.detach()) * positive.to(w.dtype)
            part = weight * (term if self.reduction == "none" else term.sum() if self.reduction == "sum" else term.mean())
            total = part if total is None else total + part
        return total

