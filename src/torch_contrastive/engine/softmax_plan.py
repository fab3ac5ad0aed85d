"""The soft-max engine's plan and the tile primitives every pass shares.

:class:`SoftmaxPlan` is what :func:`~.softmax.softmax_terms` decided for one call; the helpers
leave out the self pairs, the excluded candidates and (``confident.py``) the positives kept
apart, turn sums into log-sum-exps and complete column statistics across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .._tensors import self_diagonal
from .confident import Apart

if TYPE_CHECKING:
    from ..positives import Positives

__all__ = ["Direction", "SoftmaxPlan", "blank", "complete_columns", "drop", "excluded", "inverse_exp", "log_total"]


@dataclass(frozen=True)
class SoftmaxPlan:
    self_offset: int | None
    columns: bool
    symmetric: bool
    tile: int
    # True: |S| <= scale is small enough that exp(S) neither overflows nor underflows,
    # so no shift at all is needed; False: an online maximum keeps every exp finite.
    fixed: bool
    normalize: bool
    eps: float
    positives: Positives | None
    column_positives: bool
    # One tile, and the positive relation is cheap to lay over it (a partner per row, a
    # small dense or sample mask, index pairs): the positive part is read off the tile.
    # Otherwise (large key relations) it goes through Positives.aggregate in O(N * D).
    tile_positives: bool
    # The column weights alpha' are the row weights alpha (same tensor; passed once, as
    # torch.compile cannot trace a duplicate input).
    shared_alpha: bool
    # Distributed column statistics: an object with in-place ``all_sum(t)`` and
    # ``all_max(t)`` over ranks (a distributed.Scope). Each rank then holds only some
    # anchor rows, and the column log-sum-exp is completed across ranks.
    column_comm: Any = None
    # Only candidates [0, grad_columns) get a gradient; the rest are constants (a queue of
    # past keys, detached hard negatives), so their G.T @ A products are skipped.
    grad_columns: int = 0
    # Candidates left out of a row's denominator besides the self pair (false negatives:
    # equal ids, a guide model's verdict, DCL's positives): an object whose
    # ``tile(r0, r1, c0, c1)`` is the bool block to leave out (see positives.Exclusion).
    exclude: Any = None
    # "torch" (this module's tile loops) or "triton" (engine/triton_backend.py kernels)
    backend: str = "auto"
    # triton on a GPU: half-precision inputs reach tl.dot in this dtype (None: the compute dtype)
    operand_dtype: torch.dtype | None = None
    # torch backend: fp16/bf16 inputs multiplied as given on tensor cores (products.HalfProducts)
    half: bool = False
    # a row's single positive kept out of the soft-max sums and added back exactly (confident.py)
    apart: Apart | None = None

    @property
    def single_tile(self) -> bool:
        return self.tile == 0


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


def complete_columns(col_sum: Tensor, col_max: Tensor, plan: SoftmaxPlan) -> Tensor:
    """Column LSE from (sum, max); across ranks: bring partial sums to the global maximum."""
    if plan.column_comm is not None:
        global_max = col_max.clone()
        plan.column_comm.all_max(global_max)
        col_sum = col_sum * torch.exp(col_max - global_max)
        plan.column_comm.all_sum(col_sum)
        col_max = global_max
    return col_sum.log() + col_max
