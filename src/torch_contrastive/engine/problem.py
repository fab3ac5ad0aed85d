"""One engine call, described: what a loss hands the engine.

A loss checks its arguments and builds a :class:`Problem` -- the logits ``S = scale * A @ B.T``,
the relation of positives, and the statistic it wants of them -- then calls
:func:`~torch_contrastive.engine.solve`. The description is immutable and says nothing about
how to run it: :func:`~torch_contrastive.engine.plan` turns it and the inputs' device into
every decision (backend, tiles, products, algorithm), and one executor per statistic runs it
through the engine's one autograd driver (:mod:`.driver`).

The statistics:

:class:`Softmax`
    ``alpha_i * log sum_{j != self(i)} exp(S_ij) - beta_i * sum_j P_ij S_ij`` per row (and per
    column): NT-Xent with pairing rules, SupCon, the image-text loss, InfoNCE.
:class:`PairTerms`
    statistics that need the positive mask inside the tile: pytorch-metric-learning's
    per-pair NT-Xent (``"pair_softplus"``) and NT-BXent's binary cross-entropy (``"binary"``).
:class:`SigmoidPairs`
    SigLIP's ``softplus(-z_ij (S_ij + bias))`` per pair.
:class:`Prefixes`
    every prefix of the features at once (Matryoshka): one of the prefix engine's passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from torch import Tensor

from .precision import Scale

if TYPE_CHECKING:
    from ..positives import Exclusion, Positives

__all__ = ["Options", "PairTerms", "Prefixes", "Problem", "SigmoidPairs", "Softmax", "Statistic"]

#: (per-output row weights, reduction factor) of :class:`PairTerms` ``combine``: the weights one per output, or every
#: output's as the rows of one (K, N) tensor (combined in fewer ops: :func:`~.pairwise.combined`)
Combine = tuple[tuple[Tensor | float, ...] | Tensor, Tensor | float]


@dataclass(frozen=True)
class Options:
    """The loss options the engine reads (the shared options of :mod:`torch_contrastive.options`).

    Attributes:
        normalize: L2-normalise anchors and candidates inside the engine (``x / max(||x||, eps)``),
            so the whole loss is one autograd node. ``False`` when the rows come normalised
            (gathered rows) or raw dot products are wanted.
        eps: the normalisation floor.
        chunk_size: the caller's tile edge; None: the planner's choice for the device.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
    """

    normalize: bool = False
    eps: float = 1e-12
    chunk_size: int | None = None
    backend: str = "auto"


@dataclass(frozen=True)
class Softmax:
    """Soft-max terms ``row_out_i = alpha_i * LSE_i - beta_i * sum_j P_ij S_ij`` (and, with
    ``columns``, ``col_out_j = alpha'_j * LSE'_j - beta'_j * sum_i P_ij S_ij``).

    Attributes:
        row_weights, col_weights: ``(alpha, beta)``, (R,) / (C,) tensors without gradient;
            None means 1.
        columns_share_alpha: the column ``alpha'`` is the row ``alpha`` (a square two-set loss
            whose relation is symmetric, as CLIP's): ``col_weights[0]`` is then None, and the
            tensor is passed to the engine once (``torch.compile`` cannot trace one tensor given
            as two inputs).
        columns: also return the column terms (two-set losses: no self pair).
        column_positives: include ``sum_i P_ij S_ij`` in the column terms (False when the
            caller computes it, as a rank that holds only some rows does).
        column_comm: with ``columns`` under ``torch.distributed``: an object with in-place
            ``all_sum``/``all_max`` (a :class:`~torch_contrastive.distributed.Scope`) that
            completes the column statistics across ranks.
        exclude: candidates left out of the log-sum-exp besides the self pair
            (an :class:`~torch_contrastive.positives.Exclusion`: false negatives, DCL).
        total: ``(c, c')``: return ``c * sum_i row_out_i + c' * sum_j col_out_j`` instead (the
            loss's reduction inside the autograd node).
        fixed: force the bounded one-``exp`` algorithm (tests; :attr:`Problem.bound` is the
            loss's way to allow it).
    """

    row_weights: tuple[Tensor | None, Tensor | None] = (None, None)
    col_weights: tuple[Tensor | None, Tensor | None] = (None, None)
    columns_share_alpha: bool = False
    columns: bool = False
    column_positives: bool = True
    column_comm: Any = None
    exclude: Exclusion | None = None
    total: tuple[Scale, Scale] | None = None
    fixed: bool = False


@dataclass(frozen=True)
class LabelRanges:
    """The first and last label of every ``step``-row block of rows and of columns sorted by label.

    The plan reads them at its own tile (:meth:`over`), whatever step they were read at: a tile's labels lie
    between the first label of the block holding its first row and the last label of the block holding its
    last row, so a tile that covers blocks exactly gets its exact range and any other tile a wider one --
    which can only treat an all-negative tile as mixed (slower), never skip a tile that holds a positive.

    Attributes:
        step: rows per block (the last block may be shorter).
        rows, cols: ``(first, last)`` label of each block of rows, of columns.
    """

    step: int
    rows: tuple[tuple[float, float], ...]
    cols: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 1:
            raise ValueError(f"LabelRanges.step must be a positive int, got {self.step!r}")

    def covers(self, rows: int, cols: int) -> bool:
        """Whether the blocks are exactly those of ``rows`` rows and ``cols`` columns."""
        return len(self.rows) == -(-rows // self.step) and len(self.cols) == -(-cols // self.step)

    def over(self, tile: int, rows: int, cols: int) -> tuple[tuple[bool, ...], ...]:
        """Which ``tile`` x ``tile`` tiles of a ``rows`` x ``cols`` problem can hold a positive: their row and
        column label ranges overlap."""
        row_ranges, col_ranges = self._ranges(self.rows, tile, rows), self._ranges(self.cols, tile, cols)
        return tuple(tuple(not (r_hi < c_lo or c_hi < r_lo) for c_lo, c_hi in col_ranges) for r_lo, r_hi in row_ranges)

    def _ranges(self, blocks: tuple[tuple[float, float], ...], tile: int, n: int) -> list[tuple[float, float]]:
        step = self.step
        return [(blocks[start // step][0], blocks[(min(start + tile, n) - 1) // step][1]) for start in range(0, n, tile)]


@dataclass(frozen=True)
class PairTerms:
    """Per-row statistics with the positive mask in every tile.

    Attributes:
        kernel: ``"pair_softplus"`` (``(sum_p softplus(L_i - S_ip),)``, PML's NT-Xent numerators)
            or ``"binary"`` (``(sum_pos softplus(-S_ij), sum_neg softplus(S_ij))``, NT-BXent).
        label_ranges: rows and columns sorted by label: the (lowest, highest) label of every block of
            rows and of columns (:class:`LabelRanges`; tiles whose ranges do not overlap hold only negatives).
        combine: ``(weights, total)``: return ``total * sum_i sum_k weights[k]_i out_k,i``
            instead (the loss's row combination and reduction inside the autograd node).
        fixed: force the bounded mode (tests).
    """

    kernel: str
    label_ranges: LabelRanges | None = None
    combine: Combine | None = None
    fixed: bool = False

    def __post_init__(self) -> None:
        if self.kernel not in ("pair_softplus", "binary"):
            raise ValueError(f"PairTerms.kernel must be 'pair_softplus' or 'binary', got {self.kernel!r}")
        if self.label_ranges is not None and not isinstance(self.label_ranges, LabelRanges):
            raise TypeError(f"PairTerms.label_ranges must be a LabelRanges, got {type(self.label_ranges).__name__}")


@dataclass(frozen=True)
class SigmoidPairs:
    """SigLIP's per-row ``sum_j softplus(-z_ij (S_ij + bias))``, ``z_ij = +1`` on positives.

    Attributes:
        bias: the logit bias, a float or a 0-dim tensor (gets its gradient).
        diagonal_offset: row i's only positive is column ``i + diagonal_offset`` (no ids): a
            strided diagonal of each tile, no mask. None: positives from the relation.
    """

    bias: Scale = 0.0
    diagonal_offset: int | None = None


#: The prefix engine's passes (:mod:`.prefix_passes`).
PREFIX_FORMS = ("softmax", "row_lse", "pairs", "sigmoid")


@dataclass(frozen=True, eq=False)
class Prefixes:
    """Every prefix of the features in one pass (Matryoshka, Kusupati et al. 2022; :mod:`.prefixes`): the pass
    ``form`` over the prefix ends ``dims`` (each prefix normalised on its own), weighted ``weights``.

    Attributes:
        form: ``"softmax"`` (each prefix's soft-max cross-entropy, :class:`~.prefixes.PrefixSoftmax`),
            ``"row_lse"`` (each prefix's row log-sum-exps, :class:`~.prefix_lse.PrefixRowLSE`), ``"pairs"`` (the
            pair conventions, :class:`~.prefix_pairs.PrefixPairs`) or ``"sigmoid"`` (SigLIP's pairs,
            :class:`~.prefix_sigmoid.PrefixSigmoid`).
        dims: each prefix's end, in the caller's order.
        weights: each prefix's weight.
        arguments: the pass's own arguments after its rows and plan, in its function's order (the relation or
            targets, a tensor scale, ...).
        mean: each prefix's loss is a mean (False: a sum); :class:`~.prefixes.PrefixPlan`'s ``mean``.
        per_row: per-row values (``reduction="none"``); the plan's ``rows``.
        upper: the strips of one set's upper triangle (:func:`~.prefix_lse.upper_strip`).
    """

    form: str
    dims: tuple[int, ...]
    weights: tuple[float, ...]
    arguments: tuple[Any, ...] = ()
    mean: bool = True
    per_row: bool = False
    upper: bool = False

    def __post_init__(self) -> None:
        if self.form not in PREFIX_FORMS:
            raise ValueError(f"Prefixes.form must be one of {PREFIX_FORMS}, got {self.form!r}")
        if not self.dims or len(self.dims) != len(self.weights):
            raise ValueError(f"Prefixes needs one weight per prefix end, got {len(self.dims)} ends and "
                             f"{len(self.weights)} weights")


Statistic = Softmax | PairTerms | SigmoidPairs | Prefixes
S = TypeVar("S", Softmax, PairTerms, SigmoidPairs, Prefixes)


@dataclass(frozen=True)
class Problem(Generic[S]):
    """One engine call: the statistic of ``S = scale * anchors @ candidates.T`` a loss wants.

    Attributes:
        anchors: (R, D) rows, any float dtype.
        candidates: (C, D) rows; ``anchors`` itself for a single set.
        scale: ``1 / temperature`` (SigLIP: the logit scale), a float or a 0-dim tensor whose
            value is never read on the host; gradients flow to it.
        statistic: what to compute (:class:`Softmax`, :class:`PairTerms`, :class:`SigmoidPairs`).
        positives: the relation P (R x C) of :class:`~torch_contrastive.positives.Positives`;
            None: none (a plain log-sum-exp).
        self_offset: anchor i is candidate ``i + self_offset`` (left out of its row); None: none. For
            pair and sigmoid terms it must be the relation's own (``positives.self_offset``).
        symmetric: the candidates are the anchors, on one process (``self_offset == 0``): the
            soft-max visits only the upper-triangle tiles.
        bound: the loss's promise that every ``|S| <= bound`` (unit rows, a scale known on the
            host); None: no promise. The planner picks the bounded algorithm where it is exact.
        grad_columns: only candidates ``[0, grad_columns)`` need a gradient (a queue or memory
            after the live rows); None: all.
        options: normalisation, tile, backend (:class:`Options`).
    """

    anchors: Tensor
    candidates: Tensor
    scale: Scale
    statistic: S
    positives: Positives | None = None
    self_offset: int | None = None
    symmetric: bool = False
    bound: float | None = None
    grad_columns: int | None = None
    options: Options = Options()

    def __post_init__(self) -> None:
        stat = self.statistic
        _constant_weights(stat)
        if isinstance(stat, Softmax):
            if stat.columns and self.self_offset is not None:
                raise ValueError("Softmax(columns=True) needs self_offset=None (two-set losses only)")
            if self.symmetric and (self.self_offset != 0 or stat.columns or self.anchors.shape != self.candidates.shape):
                raise ValueError("symmetric=True needs candidates equal to anchors, self_offset=0 and columns=False")
            if self.symmetric and stat.exclude is not None and not stat.exclude.symmetric:
                # one mask serves a tile's row block and, transposed, its column block
                raise ValueError("symmetric=True needs a symmetric exclusion (Exclusion(symmetric=True))")
        elif isinstance(stat, Prefixes):  # the pass's arguments carry its relation
            return
        elif self.positives is None:
            raise ValueError(f"{type(stat).__name__} needs positives")
        elif isinstance(stat, PairTerms) and stat.label_ranges is not None \
                and not stat.label_ranges.covers(*self.shape):
            ranges = stat.label_ranges
            raise ValueError(f"PairTerms.label_ranges: {len(ranges.rows)} row and {len(ranges.cols)} column blocks of "
                             f"{ranges.step} do not cover {self.shape[0]} x {self.shape[1]}")
        elif self.self_offset != self.positives.self_offset:
            # the pair and sigmoid kernels read the self pair off the relation: one value, not two
            raise ValueError(f"{type(stat).__name__}: self_offset {self.self_offset} disagrees with the positives' "
                             f"{self.positives.self_offset}")

    @property
    def single(self) -> bool:
        """The candidates are the anchors themselves (one set of rows)."""
        return self.candidates is self.anchors

    @property
    def shape(self) -> tuple[int, int]:
        """``(R, C)``: anchors and candidates."""
        return self.anchors.shape[0], self.candidates.shape[0]


def _constant_weights(stat: Statistic) -> None:
    """The engine's weights are constants (its backward returns no gradient for them): a weight
    that requires grad is refused here, so it can never be dropped silently -- a loss that takes
    a learnable weight adds that gradient itself (``nt_xent_loss``'s ``positive_weight``)."""
    if isinstance(stat, Softmax):
        (alpha, beta), (col_alpha, col_beta) = stat.row_weights, stat.col_weights
        if alpha is None and beta is None and col_alpha is None and col_beta is None:  # the common call: nothing to check
            return
        weights: tuple[object, ...] = (alpha, beta, col_alpha, col_beta)
    elif isinstance(stat, PairTerms) and stat.combine is not None:
        given = stat.combine[0]
        weights = (given, stat.combine[1]) if isinstance(given, Tensor) else (*given, stat.combine[1])
    else:
        return
    for w in weights:  # a loop, not any() over a generator: this runs on every loss call
        if isinstance(w, Tensor) and w.requires_grad:
            raise ValueError(f"{type(stat).__name__}: weights must not require grad (the engine treats them as constants; "
                             "the loss adds a learnable weight's gradient itself)")
