"""What a soft-max tile leaves out: the self pairs, the excluded candidates and (:mod:`.confident`)
the positives kept apart -- cleared in a tile, and what a row that loses every candidate gets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._tensors import self_diagonal

if TYPE_CHECKING:
    from .plans import SoftmaxPlan

__all__ = ["Direction", "blank", "drop", "excluded", "inverse_exp", "log_total"]


def log_total(total: Tensor, shift: Tensor | None, plan: SoftmaxPlan, n_other: int) -> Tensor:
    """``log(total) (+ shift)``; 0 for a row without any candidate (a batch of one).

    With exclusions a row whose every candidate is left out gets ``-inf`` (an empty
    log-sum-exp), so callers combining several candidate groups can tell; the backward
    passes give such rows a zero gradient (:func:`inverse_exp`).
    """
    out = total.log() if shift is None else total.log() + shift
    if plan.apart is not None:  # log of the excess over the positive: -inf when there is none
        return out
    if plan.exclude is not None:
        return torch.where(total > 0, out, float("-inf"))
    if plan.self_offset is not None and n_other <= 1:
        out = torch.where(total > 0, out, 0.0)
    return out


def inverse_exp(lse: Tensor, plan: SoftmaxPlan) -> Tensor:
    """``exp(-LSE)``, 0 for an empty row (``LSE = -inf``, possible only with exclusions)."""
    if plan.exclude is None:
        return torch.exp(-lse)
    return torch.where(torch.isneginf(lse), 0.0, torch.exp(-lse))


def excluded(plan: SoftmaxPlan, r0: int, r1: int, c0: int, c1: int) -> Tensor | None:
    """The tile's bool block of excluded candidates, or None (none, or only a diagonal)."""
    return None if plan.exclude is None else plan.exclude.tile(r0, r1, c0, c1)


def drop(t: Tensor, plan: SoftmaxPlan, r0: int, r1: int, c0: int, c1: int) -> None:
    """Zero the excluded entries of a tile of finite values (the fixed path's ``exp(S)``
    and gradient tiles): a strided diagonal and a multiplication by the 0/1 factor; the
    positives kept apart are zeroed too."""
    if plan.apart is not None:
        plan.apart.clear(t, r0, c0, 0.0)
    if plan.exclude is None:
        return
    diag = self_diagonal(t, r0, c0, plan.exclude.diagonal)
    if diag is not None:
        diag.zero_()
    plan.exclude.drop(t, r0, r1, c0, c1)


def blank(t: Tensor, plan: SoftmaxPlan, r0: int, c0: int, out: Tensor | None, value: float) -> None:
    """Set the excluded entries of a tile to ``value`` in place: an excluded strided
    diagonal (a view, as for the self pairs) and the masked block ``out``; the positives
    kept apart too."""
    if plan.apart is not None:
        plan.apart.clear(t, r0, c0, value)
    if plan.exclude is None:
        return
    diag = self_diagonal(t, r0, c0, plan.exclude.diagonal)
    if diag is not None:
        diag.fill_(value)
    if out is not None:
        t.masked_fill_(out, value)


Direction = tuple[Tensor, Tensor]  # (gradient weight per index, its log-sum-exp)
