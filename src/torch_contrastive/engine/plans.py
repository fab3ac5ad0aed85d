"""What one engine call will do: one frozen, typed plan per statistic.

:func:`~.problem_plan.plan` builds the plan once per call, by keywords, from the problem and the
device :class:`~.planner.Decision`; the statistic's executor reads it and decides nothing
itself. Every plan holds its ``decision`` (backend, tile, regime, products, operand dtype,
read through the properties below) and the statistic's own choices.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields
from itertools import repeat
from operator import attrgetter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..positives import Exclusion, Positives
    from .confident import Apart
    from .planner import Decision
    from .prefixes import PrefixPlan
    from .softmax_tiles import FlatPlaces

__all__ = ["AnyPlan", "PairPlan", "SigmoidPlan", "SoftmaxPlan"]


class _Device:
    """The device decisions every plan reads from its :class:`~.planner.Decision`."""

    __slots__ = ()
    decision: Decision

    @property
    def backend(self) -> str:
        """``"torch"`` or ``"triton"``: which executor runs the plan."""
        return self.decision.backend

    @property
    def tile(self) -> int:
        """Rows (and columns) per tile; 0: the whole problem is one tile."""
        return self.decision.tile

    @property
    def tile_cols(self) -> int:
        """Columns per tile where they differ from :attr:`tile` (the epilogue's row strips); 0: square tiles."""
        return self.decision.tile_cols

    @property
    def fixed(self) -> bool:
        """The bounded one-``exp`` regime (no running maximum)."""
        return self.decision.fixed

    @property
    def half(self) -> bool:
        """The torch backend multiplies fp16/bf16 inputs as given on tensor cores."""
        return self.decision.half

    @property
    def operand_dtype(self) -> torch.dtype | None:
        """The Triton kernels' half operand dtype (None: the compute dtype)."""
        return self.decision.operand_dtype

    @property
    def executor(self) -> str:
        """The executor's name in the engine's registry (:data:`~.solve.EXECUTORS`): the backend's."""
        return self.decision.backend

    @property
    def single_tile(self) -> bool:
        return self.decision.tile == 0

    def __str__(self) -> str:
        return str(self.decision)

    def with_relation(self, positives: Positives | None) -> Any:
        """This plan for another relation of the same shape and kind (a label relation is new every
        call; what the plan decided from it -- kind, size, self offset, dense form -- is the same):
        a field-by-field copy, cheaper than building the plan again (the fields read and set by C loops:
        a plan has some 25 of them, and a Python loop over them cost a host-bound call 300 bytecodes)."""
        cls = type(self)
        names, read = _FIELDS[cls]
        new = object.__new__(cls)
        deque(map(object.__setattr__, repeat(new), names, read(self)), maxlen=0)
        object.__setattr__(new, "positives", positives)
        return new


@dataclass(frozen=True, slots=True, kw_only=True)
class SoftmaxPlan(_Device):
    """A :class:`~.problem.Softmax` call.

    Attributes:
        decision: the device decisions.
        self_offset: anchor ``i`` is candidate ``i + self_offset`` (left out); None: none.
        columns: the column terms are computed too.
        symmetric: one set on one process: only the upper-triangle tiles are visited.
        normalize: rows L2-normalised inside.
        eps: the normalisation floor.
        positives: the relation P; None: no positive part.
        column_positives: the column terms include ``sum_i P_ij S_ij``.
        tile_positives: one tile and a relation cheap to lay over it (a partner, a strided
            layout, a small mask): the positive part is read off the tile; otherwise it goes
            through ``Positives.aggregate`` in O(N * D).
        fold_positives: backward adds the positive part's coefficients to the gradient tiles
            themselves (before a half-precision tile is rounded: a confident model's ``p_ii - 1`` keeps
            its digits) instead of through ``Positives.aggregate``: the one torch tile whose positives
            are read off it, and the epilogue kernels, which form a partner or key relation in registers.
        shared_alpha: the column weights alpha' are the row weights alpha (one tensor,
            passed once: ``torch.compile`` cannot trace a duplicate input).
        column_comm: distributed column statistics (in-place ``all_sum`` / ``all_max`` over
            ranks); None on one process.
        grad_columns: only candidates ``[0, grad_columns)`` get a gradient (the rest are
            constants: a queue, detached negatives); their ``G.T @ A`` products are skipped.
        exclude: candidates left out besides the self pair (false negatives).
        apart: a row's single positive kept out of the sums and added back exactly
            (:mod:`.confident`); None: not kept apart.
        places: the one torch tile's flat places of a strided relation's positives (and what the
            kept-apart sums leave out), built once when planned; None otherwise.
        weighted: rows or columns carry weights (alpha or beta): the outputs need the positive
            logits besides the margins.
        stack_rows: two sets normalised as one stack of rows (the torch backend, compute-dtype or
            tensor-core products: each normalisation op, forward and backward, runs once for both sets
            instead of once per set).
        one_tile: the lean one-tile executor serves the plan (:func:`~.problem_plan.one_tile`:
            :mod:`.one_tile`, the commonest small call without the general executor's Python).
    """

    decision: Decision
    self_offset: int | None
    columns: bool
    symmetric: bool
    normalize: bool
    eps: float
    positives: Positives | None
    column_positives: bool
    tile_positives: bool
    fold_positives: bool
    shared_alpha: bool
    column_comm: Any = None
    grad_columns: int = 0
    exclude: Exclusion | None = None
    apart: Apart | None = None
    places: FlatPlaces | None = None
    weighted: bool = False
    stack_rows: bool = False
    one_tile: bool = False

    @property
    def executor(self) -> str:
        """``"one_tile"`` for a plan the lean one-tile executor serves, else the backend's."""
        return "one_tile" if self.one_tile else self.decision.backend


@dataclass(frozen=True, slots=True, kw_only=True)
class PairPlan(_Device):
    """A :class:`~.problem.PairTerms` call.

    Attributes:
        decision: the device decisions.
        kernel: ``"pair_softplus"`` (PML NT-Xent) or ``"binary"`` (NT-BXent).
        positives: the relation (labels, a partner or index pairs).
        normalize: rows L2-normalised inside.
        eps: the normalisation floor.
        mixed: which (row tile, column tile) can hold a positive or self pair, from rows
            and columns sorted by label; None: every tile is treated as mixed.
        symmetric: one set sorted by label: only upper-triangle tiles are visited, each
            feeding its row block and its column block.
        one_tile: the lean one-tile executor serves the plan (one set's label relation on the torch
            backend's one bounded tile, rows normalised inside: :mod:`.one_tile`).
    """

    decision: Decision
    kernel: str
    positives: Positives
    normalize: bool
    eps: float
    mixed: tuple[tuple[bool, ...], ...] | None = None
    symmetric: bool = False
    one_tile: bool = False

    @property
    def executor(self) -> str:
        """``"one_tile"`` for a plan the lean one-tile executor serves, else the backend's."""
        return "one_tile" if self.one_tile else self.decision.backend

    def is_mixed(self, r0: int, c0: int) -> bool:
        return self.mixed is None or self.mixed[r0 // self.tile][c0 // self.tile]


@dataclass(frozen=True, slots=True, kw_only=True)
class SigmoidPlan(_Device):
    """A :class:`~.problem.SigmoidPairs` call.

    Attributes:
        decision: the device decisions.
        positives: the relation.
        diagonal_offset: row i's only positive is column ``i + diagonal_offset`` (a strided
            diagonal of each tile); None: positives by ids.
        normalize: rows L2-normalised inside.
        eps: the normalisation floor.
        stack_rows: the two sets normalised as one stack of rows (as :class:`SoftmaxPlan`'s).
    """

    decision: Decision
    positives: Positives
    diagonal_offset: int | None
    normalize: bool
    eps: float
    stack_rows: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixesPlan(_Device):
    """A :class:`~.problem.Prefixes` call.

    Attributes:
        decision: the device decisions (its tile: the strip's rows, across every column).
        prefix: the prefix engine's own plan (the distinct cuts, each prefix's place and weight, the scale,
            normalisation, the strip height, the reduction).
    """

    decision: Decision
    prefix: PrefixPlan


AnyPlan = SoftmaxPlan | PairPlan | SigmoidPlan | PrefixesPlan

#: every plan class's field names, and a reader of their values in that order (:meth:`_Device.with_relation`)
_FIELDS: dict[type, tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]] = {
    cls: (names, attrgetter(*names)) for cls in (SoftmaxPlan, PairPlan, SigmoidPlan)
    for names in [tuple(f.name for f in fields(cls))]}
