"""Positive structure: which (anchor, candidate) pairs are positives.

Every loss in this package describes its positives with one :class:`Positives`
object instead of building an N x N mask. The object can

* produce any (row-block, column-block) tile of the positive relation on demand
  (:meth:`Positives.tile`) -- the tiled engine asks for tiles it needs;
* count positives per anchor (:meth:`Positives.row_counts`) in O(N) memory;
* sum the positive candidates of every anchor (:meth:`Positives.aggregate`), which
  turns the positive part of a soft-max loss, ``sum_p s_ip``, into an O(N * D)
  computation that needs no tiles at all.

Four kinds of relation cover every convention in the seeds, one frozen class each (its
``kind`` a class constant), each owning its tile rule, row counts and aggregates:

:class:`PartnerPositives` (``partner``)
    Exactly one positive per anchor, ``partner[i]`` (pairing rules ``adjacent`` and
    ``halves`` pairing rules, CLIP without ids): aggregates are a gather.
:class:`KeyPositives` (``keys``)
    ``i ~ j`` iff ``row_key[i] == col_key[j]`` for at least one of up to two key
    pairs: class labels, SupCon views (key = sample index) and the image/text ids of
    Wang's image-text write-up (image ids OR text ids; README, "Conventions").
:class:`PairPositives` (``pairs``)
    An explicit, directional list of (row, column) index pairs (the NT-BXent write-up's
    ``pos_indices``).
:class:`MaskPositives` (``mask``)
    A small dense (bsz, bsz) mask over *samples*, repeated over views (the SupCon
    authors' ``mask`` argument, possibly asymmetric).

Anchors may be a slice of the candidates (single-set losses, and the local rows of
one rank in distributed training): ``self_offset`` then says that anchor ``i`` *is*
candidate ``i + self_offset``. :meth:`tile`, :meth:`row_counts` and
:meth:`aggregate` always leave that self pair out.

Nothing here reads a device value on the host or makes a shape depend on data:
groups of equal keys come from a sort (not ``torch.unique``), duplicate and self
pairs get a zero weight instead of being filtered out. So a loss built on it makes
no host synchronisation and can be compiled with ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, TypeGuard

import torch
from torch import Tensor

from ._tensors import mask_as, self_diagonal
from .engine.precision import ones

__all__ = [
    "DENSE_KEYS_LIMIT",
    "LAYOUTS",
    "Exclusion",
    "KeyPositives",
    "MaskPositives",
    "PairPositives",
    "PartnerPositives",
    "Positives",
    "Strided",
]

#: Key relations with at most this many (row, column) entries are held as a dense bool matrix (64 KiB): for small
#: batches a few element-wise ops beat grouping by a sort (measured on a CPU). One rule on every device: the forms a
#: GPU would price otherwise are ones no GPU has measured.
DENSE_KEYS_LIMIT = 256 * 256

# the floating dtypes whose sums of 0/1 values count exactly (up to 2**24 terms in float32)
_EXACT_COUNTS = (torch.float32, torch.float64)


def _dense_pays(rows: int, cols: int) -> bool:
    """Whether a key relation is held as a dense mask (else grouped by key): up to :data:`DENSE_KEYS_LIMIT` entries.

    A rule of the relation's own size, the same on every device: the forms a GPU would choose by price (a mask sized
    by a cost model, read on tensor cores) are ones no GPU has measured (CHANGELOG, issue 64). A counted problem that
    stands for a larger one (``bench --traffic``) is counted at a size on the same side of the limit."""
    return rows * cols <= DENSE_KEYS_LIMIT


@dataclass(frozen=True)
class Positives:
    """The positive relation between R anchors and C candidates: one frozen class per kind.

    Build it with the class methods (:meth:`from_partner`, :meth:`from_keys`,
    :meth:`from_pairs`, :meth:`from_sample_mask`), which return a :class:`PartnerPositives`,
    :class:`KeyPositives`, :class:`PairPositives` or :class:`MaskPositives`; each owns its tile
    rule, its row counts and its aggregates.

    Attributes:
        num_rows: R, the number of anchors.
        num_cols: C, the number of candidates.
        self_offset: anchor ``i`` is candidate ``i + self_offset``; ``None`` when
            anchors and candidates are different sets (image-text).
        kind: ``"partner"``, ``"keys"``, ``"pairs"`` or ``"mask"`` (a class constant).
    """

    num_rows: int
    num_cols: int
    self_offset: int | None
    kind: ClassVar[str] = ""

    # ------------------------------------------------------------------ builders
    @staticmethod
    def from_partner(partner: Tensor, num_cols: int, *, self_offset: int | None = 0, layout: str | None = None,
                     shift: int | None = None) -> PartnerPositives:
        """One positive per anchor: column ``partner[i]`` (which must not be the self column).

        Pairing rules (``adjacent``: ``i ^ 1``; ``halves``: ``(i + N) mod 2N``) and
        CLIP without ids (``partner[i] = i``, ``self_offset=None``). ``layout`` names the
        rule when ``partner`` follows it exactly on a square problem; ``shift=k`` says
        ``partner[i] == i + k`` (see :class:`PartnerPositives`).
        """
        p = partner.reshape(-1).long()
        if layout is not None and (layout not in LAYOUTS or int(p.numel()) != num_cols):
            raise ValueError(f"layout must be 'identity', 'adjacent' or 'halves' on a square problem, got {layout!r}")
        if shift is None and layout == "identity":
            shift = 0
        return PartnerPositives(int(p.numel()), num_cols, self_offset, p, layout, shift)

    @staticmethod
    def from_keys(row_keys: Tensor | tuple[Tensor, ...], col_keys: Tensor | tuple[Tensor, ...] | None = None, *,
                  self_offset: int | None = 0) -> KeyPositives:
        """Positives by key equality: ``i ~ j`` iff any ``row_keys[k][i] == col_keys[k][j]``.

        Args:
            row_keys: (R,) integer tensor, or a tuple of up to two (one per relation,
                OR-combined as ``gt_image | gt_text`` in Wang's image-text write-up).
            col_keys: the same for the C candidates; defaults to ``row_keys``
                (single-set losses).
            self_offset: anchor ``i`` is candidate ``i + self_offset`` (``None``: none).
        """
        if _int64_vector(row_keys) and (col_keys is None or _int64_vector(col_keys)):  # a loss's labels: no loops
            rows: tuple[Tensor, ...] = (row_keys,)
            cols: tuple[Tensor, ...] = rows if col_keys is None or col_keys is row_keys else (col_keys,)
        else:
            rows, cols = _key_vectors(row_keys, col_keys)
        num_rows, num_cols = rows[0].shape[0], cols[0].shape[0]
        if _dense_pays(num_rows, num_cols):
            # Small batches: the R x C relation itself is cheaper than grouping by a sort
            # (a few element-wise ops instead of a dozen small ones).
            dense = rows[0].unsqueeze(1) == cols[0]  # (R, 1) against (C,): no view of the columns
            for r, c in zip(rows[1:], cols[1:]):
                dense |= r.unsqueeze(1) == c
            if self_offset == 0:
                dense.fill_diagonal_(False)  # one op, no diagonal view
            elif self_offset is not None:
                k = self_offset
                if k < num_cols and -k < num_rows:
                    dense.diagonal(k).fill_(False)
            return KeyPositives(num_rows, num_cols, self_offset, rows, cols, dense=dense)
        return KeyPositives(num_rows, num_cols, self_offset, rows, cols, key_terms=_key_terms(rows, cols))

    @staticmethod
    def from_pairs(pairs: Tensor, num_rows: int, num_cols: int, *, self_offset: int | None = 0) -> PairPositives:
        """Positives from an explicit (P, 2) list of directional (row, column) pairs.

        Repeated pairs count once and self pairs not at all (the self pair is handled
        by each loss); both only get a zero weight, so no shape depends on the data.
        """
        p = pairs.reshape(-1, 2).long()
        weight = torch.ones(p.shape[0], dtype=torch.bool, device=p.device)
        if p.shape[0]:
            code = p[:, 0] * num_cols + p[:, 1]
            sorted_code, order = torch.sort(code, stable=True)
            first = torch.ones_like(weight)
            first[1:] = sorted_code[1:] != sorted_code[:-1]
            weight = torch.empty_like(weight).scatter_(0, order, first)
            if self_offset is not None:
                weight &= p[:, 1] != p[:, 0] + self_offset
        return PairPositives(num_rows, num_cols, self_offset, p, weight)

    @staticmethod
    def from_sample_mask(sample_mask: Tensor, row_sample: Tensor, num_cols: int) -> MaskPositives:
        """Positives from a (bsz, bsz) sample mask repeated over views (SupCon's ``mask``).

        Candidates are the view-major flattening ``j -> sample j % bsz``; anchor ``i``
        is candidate ``i`` (``self_offset=0``) and belongs to sample ``row_sample[i]``.
        """
        return MaskPositives(int(row_sample.numel()), num_cols, 0, sample_mask.bool(), row_sample.long())

    # ------------------------------------------------------------------ queries
    def tile(self, r0: int, r1: int, c0: int, c1: int) -> Tensor:
        """The (r1 - r0, c1 - c0) bool block of the relation, self pairs excluded (read-only).
        O(tile) memory and time (O(P + tile) for listed pairs)."""
        raise NotImplementedError

    def row_counts(self) -> Tensor:
        """(R,) int64 number of positives of every anchor (self excluded). O(N) memory."""
        raise NotImplementedError

    def pair_count(self) -> Tensor:
        """0-dim int64 number of (anchor, positive) pairs, ``row_counts().sum()``."""
        return self.row_counts().sum()

    def row_counts_as(self, dtype: torch.dtype) -> Tensor:
        """:meth:`row_counts` as values of a floating ``dtype`` (a loss's per-row weights)."""
        return self.row_counts().to(dtype)

    def pair_count_as(self, dtype: torch.dtype) -> Tensor:
        """:meth:`pair_count` as a 0-dim value of a floating ``dtype`` (a per-pair mean's denominator)."""
        return self.pair_count().to(dtype)

    def aggregate(self, candidates: Tensor) -> Tensor:
        """(R, D) sum of the positive candidates of every anchor, ``sum_j P_ij c_j``.

        Differentiable with respect to ``candidates``; O(N * D) memory and time (the sample
        mask: O(bsz^2 + N * D)).
        """
        raise NotImplementedError

    def aggregate_transposed(self, rows: Tensor) -> Tensor:
        """(C, D) ``sum_i P_ij r_i``: the transpose of :meth:`aggregate`, for gradients
        with respect to candidates and for column statistics. Same cost as :meth:`aggregate`."""
        raise NotImplementedError

    def tile_values(self, r0: int, r1: int, c0: int, c1: int, dtype: torch.dtype) -> Tensor:
        """:meth:`tile` as 0/1 values of ``dtype`` (read-only)."""
        return mask_as(self.tile(r0, r1, c0, c1), dtype)

    # ------------------------------------------------------------------ helpers
    def _self_diagonal_cleared(self, block: Tensor, r0: int, c0: int) -> Tensor:
        diag = self_diagonal(block, r0, c0, self.self_offset)
        if diag is not None:
            diag.fill_(False)
        return block

    def _self_in_relation(self, device: torch.device) -> Tensor:
        """(R,) bool: is the anchor's self pair inside the raw relation (to subtract it)?"""
        return torch.zeros(self.num_rows, dtype=torch.bool, device=device)

    def _minus_self(self, total: Tensor, candidates: Tensor) -> Tensor:
        """Remove each anchor's own row from a relation sum that included it."""
        if self.self_offset is None:
            return total
        own = candidates[self.self_offset : self.self_offset + self.num_rows]
        return total - own * self._self_in_relation(candidates.device)[:, None].to(candidates.dtype)


#: The strided layouts of a one-positive relation on a square problem (:class:`PartnerPositives`).
LAYOUTS = ("identity", "adjacent", "halves")


@dataclass(frozen=True)
class Strided:
    """Where row ``i``'s one positive lies on a strided pattern of the logit matrix -- the
    layout's single definition: its columns, its pairing keys and its places in a tile.

    Attributes:
        kind: ``"shift"`` (column ``i + k``; CLIP and InfoNCE with ``k`` the rank's offset),
            ``"halves"`` (``i + k`` for ``i < k``, ``i - k`` otherwise: ``torch.cat([view1,
            view2])`` with ``k = N``) or ``"adjacent"`` (``i ^ 1``: views stored row by row).
        k: the shift, or the half size.
    """

    kind: str
    k: int = 0

    @staticmethod
    def of(layout: str, n_rows: int, shift: int = 0) -> Strided:
        """The pattern of a named layout (:data:`LAYOUTS`) over ``n_rows`` rows; ``identity`` shifted by ``shift``."""
        if layout == "identity":
            return Strided("shift", shift)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        return Strided(layout, n_rows // 2)

    def columns(self, rows: Tensor) -> Tensor:
        """The positive's column of each row index in ``rows``."""
        if self.kind == "shift":
            return rows + self.k
        if self.kind == "halves":
            return (rows + self.k) % (2 * self.k)
        return rows ^ 1

    def keys(self, rows: Tensor) -> Tensor:
        """A key per row index such that rows with equal keys are each other's positive (a pairing rule)."""
        return rows // 2 if self.kind == "adjacent" else rows % max(self.k, 1)

    def views(self, t: Tensor, r0: int, c0: int) -> list[Tensor]:
        """Strided views of the positive entries inside the tile ``t`` at ``(r0, c0)``."""
        if self.kind == "shift":
            return _present([self_diagonal(t, r0, c0, self.k)])
        if self.kind == "halves":
            return _present([self_diagonal(t, r0, c0, self.k), self_diagonal(t, r0, c0, -self.k)])
        out = []
        for step, parity in ((1, 0), (-1, 1)):  # even rows look right, odd rows left
            diag = self_diagonal(t, r0, c0, step)
            if diag is not None:
                first_row = r0 + max(0, c0 - r0 - step)  # the global row of the diagonal's first entry
                out.append(diag[(first_row + parity) % 2 :: 2])
        return out

    def clear(self, t: Tensor, r0: int, c0: int, value: float) -> None:
        """Set the positive entries of a tile to ``value`` in place."""
        for view in self.views(t, r0, c0):
            view.fill_(value)


def _present(views: list[Tensor | None]) -> list[Tensor]:
    return [v for v in views if v is not None]


@dataclass(frozen=True)
class PartnerPositives(Positives):
    """Exactly one positive per anchor (the pairing rules, CLIP without ids): aggregates are a gather.

    Attributes:
        partner: the (R,) int64 column of each anchor's only positive (never its self column).
        layout: the positives lie on strided diagonals of the square matrix (``"identity"``:
            column i; ``"adjacent"``: i ^ 1; ``"halves"``: (i + R/2) mod R), so a single tile
            reads and writes them by strided places; None: no such layout.
        shift: ``k`` when ``partner[i] == i + k`` for every row (the caller's promise; 0 for
            the ``identity`` layout), so the engine can keep the positive apart from the
            soft-max sums (``engine/confident.py``).
    """

    partner: Tensor
    layout: str | None = None
    shift: int | None = None
    kind: ClassVar[str] = "partner"

    @property
    def strided(self) -> Strided | None:
        """The positives' strided pattern: the named layout, or the promised shift; None: neither."""
        if self.layout is not None:
            return Strided.of(self.layout, self.num_rows, self.shift or 0)
        return None if self.shift is None else Strided("shift", self.shift)

    def tile(self, r0: int, r1: int, c0: int, c1: int) -> Tensor:
        cols = torch.arange(c0, c1, device=self.partner.device)
        return self.partner[r0:r1, None] == cols[None, :]  # never the self column

    def row_counts(self) -> Tensor:
        return torch.ones(self.num_rows, dtype=torch.int64, device=self.partner.device)

    def aggregate(self, candidates: Tensor) -> Tensor:
        if self.layout == "identity":  # CLIP without ids: row i's positive is column i. No copy at all.
            return candidates
        return candidates[self.partner]

    def aggregate_transposed(self, rows: Tensor) -> Tensor:
        if self.layout == "identity":
            return rows  # CLIP without ids: column j's positive is row j
        return rows.new_zeros(self.num_cols, rows.shape[1]).index_add(0, self.partner, rows)


@dataclass(frozen=True)
class KeyPositives(Positives):
    """``i ~ j`` iff ``row_keys[k][i] == col_keys[k][j]`` for one of up to two key pairs: class
    labels, SupCon views (key = sample index), the image and text ids of the image-text loss.

    Attributes:
        row_keys: a tuple of (R,) int64 tensors.
        col_keys: a tuple of (C,) int64 tensors, same length.
        dense: small relations (:data:`DENSE_KEYS_LIMIT` entries, on every device): the (R, C) bool
            relation itself, self pairs excluded; None for large ones.
        key_terms: large relations: the sorted grouping of the keys (see :func:`_key_terms`).
    """

    row_keys: tuple[Tensor, ...]
    col_keys: tuple[Tensor, ...]
    dense: Tensor | None = None
    key_terms: tuple[tuple[Tensor, Tensor, int, int], ...] = ()
    # ``dense`` as 0/1 values per dtype (see dense_as); not a property of the relation
    _dense_values: dict[torch.dtype, Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)
    kind: ClassVar[str] = "keys"

    def tile(self, r0: int, r1: int, c0: int, c1: int) -> Tensor:
        if self.dense is not None:
            return self.dense[r0:r1, c0:c1]
        block = self.row_keys[0][r0:r1, None] == self.col_keys[0][None, c0:c1]
        for rk, ck in zip(self.row_keys[1:], self.col_keys[1:]):
            block |= rk[r0:r1, None] == ck[None, c0:c1]
        return self._self_diagonal_cleared(block, r0, c0)

    def pair_count(self) -> Tensor:
        # the dense relation's one reduction (a small batch's per-pair mean pays no per-row pass)
        return self.dense.sum() if self.dense is not None else super().pair_count()

    def row_counts(self) -> Tensor:
        if self.dense is not None:
            return self.dense.sum(1)
        return self._grouped_row_counts()

    def row_counts_as(self, dtype: torch.dtype) -> Tensor:
        # A dense relation's counts in one op, exactly: every count is an integer below 2**24 (float32's exact range).
        # Its 0/1 values (converted once, read again by the tile) sum faster than its bools on a CPU.
        if self.dense is not None and dtype in _EXACT_COUNTS and self.dense.shape[1] < 2**24:
            return self.dense_as(dtype).sum(1)
        if self.dense is None and len(self.key_terms) == 1 and dtype in _EXACT_COUNTS and self.num_cols < 2**24:
            return self._grouped_row_counts(dtype)  # summed in the dtype: no conversion after
        return super().row_counts_as(dtype)

    def pair_count_as(self, dtype: torch.dtype) -> Tensor:
        if self.dense is not None and dtype in _EXACT_COUNTS and self.dense.numel() < 2**24:
            return self.dense_as(dtype).sum()
        if self.dense is None and len(self.key_terms) == 1 and dtype in _EXACT_COUNTS and self.num_rows * self.num_cols < 2**24:
            return self._grouped_row_counts(dtype).sum()  # in the dtype, exact below 2**24 pairs (no conversion after)
        return super().pair_count_as(dtype)

    def _grouped_row_counts(self, dtype: torch.dtype = torch.int64) -> Tensor:
        device = self.row_keys[0].device
        if len(self.key_terms) == 1:  # one key: its groups' sizes, less the self pair (five ops)
            rg, cg, n_bound, _ = self.key_terms[0]
            per_group = torch.zeros(n_bound, dtype=dtype, device=device).index_add_(0, cg, ones(cg.numel(), dtype, device))
            return per_group[rg] if self.self_offset is None else per_group[rg] - 1
        counts = torch.zeros(self.num_rows, dtype=torch.int64, device=device)
        for rg, cg, n_bound, sign in self.key_terms:
            per_group = torch.zeros(n_bound, dtype=torch.int64, device=device).index_add_(0, cg, torch.ones_like(cg))
            counts += sign * per_group[rg]
        return counts - int(self.self_offset is not None)  # every key relation contains the self pair

    def tile_values(self, r0: int, r1: int, c0: int, c1: int, dtype: torch.dtype) -> Tensor:
        """A dense relation's whole block is converted once per relation and dtype (:meth:`dense_as`)."""
        if self.dense is not None and (r0, c0) == (0, 0) and (r1, c1) == tuple(self.dense.shape):
            return self.dense_as(dtype)
        return mask_as(self.tile(r0, r1, c0, c1), dtype)

    def dense_as(self, dtype: torch.dtype) -> Tensor:
        """The dense relation as 0/1 values of ``dtype``, converted once per relation and dtype
        (a small batch's forward and backward read it several times); under ``torch.compile``
        converted where asked (the compiler fuses it)."""
        if self.dense is None:
            raise RuntimeError("internal: a large key relation has no dense form")
        if torch.compiler.is_compiling():
            return mask_as(self.dense, dtype)
        values = self._dense_values.get(dtype)
        if values is None:  # mask_as's eager form inline: a small call pays each Python call
            values = self._dense_values[dtype] = self.dense.view(torch.uint8).to(dtype)
        return values

    def aggregate(self, candidates: Tensor) -> Tensor:
        if self.dense is not None:
            with torch.autocast(candidates.device.type, enabled=False):
                return self.dense_as(candidates.dtype) @ candidates
        if len(self.key_terms) == 1:  # one key: its groups' sums, less the self pair (four ops)
            rg, cg, n_bound, _ = self.key_terms[0]
            total = candidates.new_zeros(n_bound, candidates.shape[1]).index_add_(0, cg, candidates)[rg]
            return total if self.self_offset is None else total.sub_(candidates[self.self_offset : self.self_offset + self.num_rows])
        total = candidates.new_zeros(self.num_rows, candidates.shape[1])
        for rg, cg, n_bound, sign in self.key_terms:
            per_group = candidates.new_zeros(n_bound, candidates.shape[1]).index_add_(0, cg, candidates)
            total = total + sign * per_group[rg]
        if self.self_offset is None:
            return total
        return total - candidates[self.self_offset : self.self_offset + self.num_rows]  # every key relation holds the self pair

    def aggregate_transposed(self, rows: Tensor) -> Tensor:
        if self.dense is not None:
            with torch.autocast(rows.device.type, enabled=False):
                return self.dense_as(rows.dtype).t() @ rows
        width = rows.shape[1]
        total = rows.new_zeros(self.num_cols, width)
        for rg, cg, n_bound, sign in self.key_terms:
            per_group = rows.new_zeros(n_bound, width).index_add_(0, rg, rows)
            total = total + sign * per_group[cg]
        if self.self_offset is not None:  # every key relation contains the self pair
            total = total.index_add(0, torch.arange(self.num_rows, device=rows.device) + self.self_offset, rows, alpha=-1)
        return total


@dataclass(frozen=True)
class PairPositives(Positives):
    """An explicit, directional list of (row, column) index pairs (NT-BXent's ``pos_indices``).

    Attributes:
        pairs: a (P, 2) int64 tensor of (row, column) pairs.
        pair_weight: (P,) 1 for a pair that counts, 0 for a self pair or a repeat of an earlier pair.
    """

    pairs: Tensor
    pair_weight: Tensor
    kind: ClassVar[str] = "pairs"

    def tile(self, r0: int, r1: int, c0: int, c1: int) -> Tensor:
        # Pairs outside the tile (or with zero weight) write into one spare slot past
        # its end, so the scatter has the same shape whatever the data.
        p, w = self.pairs, self.pair_weight
        h, wdt = r1 - r0, c1 - c0
        inside = w & (p[:, 0] >= r0) & (p[:, 0] < r1) & (p[:, 1] >= c0) & (p[:, 1] < c1)
        flat = torch.where(inside, (p[:, 0] - r0) * wdt + (p[:, 1] - c0), h * wdt)
        block = torch.zeros(h * wdt + 1, dtype=torch.bool, device=p.device)
        # index_fill_ takes the value as a scalar: `block[flat] = True` builds a value tensor
        # and synchronised with the host on CUDA
        block.index_fill_(0, flat, True)
        return block[:-1].view(h, wdt)

    def row_counts(self) -> Tensor:
        out = torch.zeros(self.num_rows, dtype=torch.int64, device=self.pairs.device)
        return out.index_add_(0, self.pairs[:, 0], self.pair_weight.long())

    @cached_property
    def row_lists(self) -> tuple[Tensor, Tensor]:
        """The relation as sorted per-row lists (CSR): ``(offsets, columns)``, int32.

        Row ``r``'s listed columns are ``columns[offsets[r]:offsets[r + 1]]`` in increasing
        order; repeats and the self pair (weight 0) are left out. ``columns`` has one spare
        ``-1`` at its end so that it is never empty. One sort of the P pairs, O(R + P) memory,
        no host read (the Triton pair kernels test membership with it, ``_tile.listed``);
        computed once per relation, so a loss's forward and backward share it.
        """
        p, w = self.pairs, self.pair_weight
        counts = self.row_counts()
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
        # pairs that do not count sort past every real one (offsets never reach them)
        code = torch.where(w, p[:, 0] * self.num_cols + p[:, 1], self.num_rows * self.num_cols)
        columns = torch.sort(code).values % max(self.num_cols, 1)
        return offsets, torch.cat([columns, columns.new_full((1,), -1)]).to(torch.int32)

    def aggregate(self, candidates: Tensor) -> Tensor:
        p, w = self.pairs, self.pair_weight
        out = candidates.new_zeros(self.num_rows, candidates.shape[1])
        return out.index_add(0, p[:, 0], candidates[p[:, 1]] * w[:, None].to(candidates.dtype))

    def aggregate_transposed(self, rows: Tensor) -> Tensor:
        p, w = self.pairs, self.pair_weight
        return rows.new_zeros(self.num_cols, rows.shape[1]).index_add(0, p[:, 1], rows[p[:, 0]] * w[:, None].to(rows.dtype))


@dataclass(frozen=True)
class MaskPositives(Positives):
    """A small dense (bsz, bsz) mask over *samples*, repeated over views (the SupCon authors'
    ``mask`` argument, possibly asymmetric).

    Attributes:
        sample_mask: a (bsz, bsz) bool tensor; anchor ``i`` is sample ``row_sample[i]``,
            candidate ``j`` is sample ``j % bsz``.
        row_sample: the (R,) sample index of every anchor.
    """

    sample_mask: Tensor
    row_sample: Tensor
    kind: ClassVar[str] = "mask"

    def tile(self, r0: int, r1: int, c0: int, c1: int) -> Tensor:
        cols = torch.arange(c0, c1, device=self.sample_mask.device) % self.sample_mask.shape[0]
        return self._self_diagonal_cleared(self.sample_mask[self.row_sample[r0:r1]][:, cols], r0, c0)

    def row_counts(self) -> Tensor:
        views = self.num_cols // self.sample_mask.shape[0]  # candidates are bsz * n_views, view-major
        per_sample = self.sample_mask.long().sum(1) * views
        return per_sample[self.row_sample] - self._self_in_relation(self.sample_mask.device).long()

    def aggregate(self, candidates: Tensor) -> Tensor:
        bsz = self.sample_mask.shape[0]
        per_sample = candidates.reshape(-1, bsz, candidates.shape[1]).sum(0)  # view-major: j -> sample j % bsz
        with torch.autocast(candidates.device.type, enabled=False):  # keep the compute dtype under autocast
            total = mask_as(self.sample_mask, candidates.dtype)[self.row_sample] @ per_sample
        return self._minus_self(total, candidates)

    def aggregate_transposed(self, rows: Tensor) -> Tensor:
        bsz = self.sample_mask.shape[0]
        per_sample = rows.new_zeros(bsz, rows.shape[1]).index_add_(0, self.row_sample, rows)
        with torch.autocast(rows.device.type, enabled=False):
            per_col_sample = self.sample_mask.to(rows.dtype).t() @ per_sample
        total = per_col_sample.repeat(self.num_cols // bsz, 1)  # view-major: column j is sample j % bsz
        own = rows * self.sample_mask[self.row_sample, self.row_sample][:, None].to(rows.dtype)
        return total.index_add(0, torch.arange(self.num_rows, device=rows.device), own, alpha=-1)

    def _self_in_relation(self, device: torch.device) -> Tensor:
        if self.self_offset is None:
            return torch.zeros(self.num_rows, dtype=torch.bool, device=device)
        return self.sample_mask[self.row_sample, self.row_sample]


def _int64_vector(k: object) -> TypeGuard[Tensor]:
    """Whether ``k`` is a 1-D int64 tensor (a key as :meth:`Positives.from_keys` holds it)."""
    return type(k) is Tensor and k.dtype == torch.int64 and k.ndim == 1


def _key_vectors(row_keys: Tensor | tuple[Tensor, ...],
                 col_keys: Tensor | tuple[Tensor, ...] | None) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """:meth:`Positives.from_keys`'s keys checked (their metadata only: a float key would be truncated, a 2-D one
    flattened) and made 1-D int64."""
    rk = (row_keys,) if isinstance(row_keys, Tensor) else tuple(row_keys)
    ck = rk if col_keys is None else ((col_keys,) if isinstance(col_keys, Tensor) else tuple(col_keys))
    if not 1 <= len(rk) <= 2 or len(rk) != len(ck):
        raise ValueError("row_keys and col_keys must be one or two key tensors each, the same number")
    for name, given in (("row_keys", rk), ("col_keys", ck)):
        for key in given:
            if not isinstance(key, Tensor) or key.ndim != 1 or key.dtype.is_floating_point or key.is_complex():
                what = f"{tuple(key.shape)} {key.dtype}" if isinstance(key, Tensor) else type(key).__name__
                raise TypeError(f"{name} must be 1-D integer (or bool) tensors, got {what}")
    rows = tuple(_index_vector(k) for k in rk)
    return rows, rows if col_keys is None else tuple(_index_vector(k) for k in ck)


def _index_vector(k: Tensor) -> Tensor:
    """``k`` as a 1-D int64 tensor (itself when it already is one: no dispatch)."""
    return k if k.ndim == 1 and k.dtype == torch.int64 else k.reshape(-1).long()


def _key_terms(row_keys: tuple[Tensor, ...], col_keys: tuple[Tensor, ...]) -> tuple[tuple[Tensor, Tensor, int, int], ...]:
    """(row group ids, column group ids, bound on the number of groups, sign) per relation.

    Two relations combine by inclusion-exclusion, |A or B| = |A| + |B| - |A and B|,
    so their intersection (both keys equal) enters with sign -1. Computed once, when
    the object is built: the sort is O(N log N) and counts and aggregates all need it.
    """
    if row_keys is col_keys and len(row_keys) == 1:  # one set's one key: no columns to stack
        return ((*_sorted_ids(row_keys[0], None), 1),)
    terms = [(*_sorted_ids(rk, ck), 1) for rk, ck in zip(row_keys, col_keys)]
    if len(row_keys) == 2:
        both = torch.cat([torch.stack(row_keys, 1), torch.stack(col_keys, 1)], 0)
        terms.append((*_groups(both, row_keys[0].numel()), -1))
    return tuple(terms)


def _sorted_ids(row_keys: Tensor, col_keys: Tensor | None) -> tuple[Tensor, Tensor, int]:
    """Group ids of one key: where each key first occurs among the sorted keys of both sides (``col_keys`` None:
    one set, the rows' own keys), so equal keys share an id in ``[0, R + C)`` -- a static bound, nothing read
    back. Two ops (a sort and a search) where a lexicographic grouping (:func:`_groups`, for key pairs) takes a
    dozen: the grouped form's launches are what it costs a GPU."""
    keys = row_keys if col_keys is None else torch.cat([row_keys, col_keys])
    ordered = torch.sort(keys).values
    if col_keys is None:
        ids = torch.searchsorted(ordered, row_keys)
        return ids, ids, keys.numel()
    both = torch.searchsorted(ordered, keys)
    return both[: row_keys.numel()], both[row_keys.numel() :], keys.numel()


def _groups(keys: Tensor, num_rows: int) -> tuple[Tensor, Tensor, int]:
    """Group ids of the R row keys and C column keys stacked in ``keys`` (R + C, k).

    A lexicographic stable sort puts equal key tuples next to each other; a new group
    starts wherever a tuple differs from its predecessor. Ids lie in ``[0, R + C)``, a
    static bound, so nothing is read back from the device.
    """
    order = torch.arange(keys.shape[0], device=keys.device)
    for column in reversed(range(keys.shape[1])):
        order = order[torch.sort(keys[order, column], stable=True).indices]
    ordered = keys[order]
    starts = torch.ones(keys.shape[0], dtype=torch.int64, device=keys.device)
    starts[1:] = (ordered[1:] != ordered[:-1]).any(1).long()
    group = torch.empty_like(starts).scatter_(0, order, starts.cumsum(0) - 1)
    return group[:num_rows], group[num_rows:], int(keys.shape[0])


_LEARNED = (-1, -1)  # marks an Exclusion whose tile flags have been read


@dataclass(eq=False)
class TileRecord:
    """What one call's forward pass learned about the tiles of an :class:`Exclusion` -- the call's
    only mutable state, apart from the rule itself; built with the rule for one loss call, it
    lives through that call's backward.

    Attributes:
        flags: per tile ``(r0, c0)``, recorded in forward: (excluded entries, rows excluding more
            than one) as device scalars, read in the loss's one validation transfer.
        firsts: per tile, each row's first excluded column and whether it has one (a guide alone;
            after :meth:`learn_from` only for the tiles whose rows exclude one at most).
        clear: the tiles known on the host to exclude nothing (and a marker once learned).
        scratch: reused tile buffers (the rule's per-shape scratch).
    """

    flags: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    firsts: dict[tuple[int, int], tuple[Tensor, Tensor]] = field(default_factory=dict)
    clear: set[tuple[int, int]] = field(default_factory=set)
    scratch: dict[Any, Tensor] = field(default_factory=dict)

    @property
    def learned(self) -> bool:
        """Whether :meth:`learn_from` has run (the backward pass may use what it kept)."""
        return _LEARNED in self.clear

    def recorded(self) -> Tensor | None:
        """The forward pass's per-tile counts as one float vector, two entries per tile
        (None when none were recorded)."""
        if not self.flags:
            return None
        return torch.cat([f.to(torch.float32) for f in self.flags.values()])

    def learn_from(self, values: list[float]) -> None:
        """The host values of :meth:`recorded`: tiles that exclude nothing are skipped from
        now on; those whose rows exclude one candidate at most are zeroed from the kept
        first columns."""
        for k, tile_key in enumerate(list(self.flags)):
            excluded, multiple = values[2 * k], values[2 * k + 1]
            if excluded == 0:
                self.clear.add(tile_key)
            if excluded == 0 or multiple != 0:  # skipped, or masked again: its columns are not needed
                self.firsts.pop(tile_key, None)
        self.flags.clear()
        self.clear.add(_LEARNED)  # later passes (backward) record nothing


@dataclass(frozen=True, eq=False)
class Exclusion:
    """Candidates left out of an anchor's denominator, besides the self pair.

    The engine asks for one (row-block, column-block) tile at a time, so no R x C mask
    is ever held. The excluded block is ``relation | guide_verdict`` minus ``keep``, plus
    the strided ``diagonal``:

    * ``relation``: pairs to leave out, as a :class:`Positives` (ids equal to the
      positive's id; DCL's positives themselves);
    * ``guide``: ``(g_rows, g_cols, threshold)`` with L2-normalised guide embeddings:
      candidate j leaves row i when ``<g_rows_i, g_cols_j> > threshold_i`` (GISTEmbed's
      guide-model filter; one small matrix product per tile, no gradient);
    * ``keep``: pairs never left out (the positive itself), as a :class:`Positives`, or
      ``keep_diagonal = k``: the pairs ``(i, i + k)`` (a strided view, no mask);
    * ``diagonal = k``: the pairs ``(i, i + k)`` are left out (DCL's positive when it is
      candidate ``offset + i``), handled by the engine as a strided view like the self pair.

    Attributes:
        symmetric: the relation is symmetric (``excluded(i, j) == excluded(j, i)``), so the
            single-set engine may serve a tile's row and column blocks from one mask.
        learn: record, while the forward pass asks for tiles, whether each tile excludes
            anything (two 0-dim counts per tile, no read). The caller may read them in its one
            validation transfer and hand them back through :meth:`learn_from`; the backward
            pass then skips the tiles that exclude nothing (no guide product, no mask) --
            false negatives are rare, so most tiles have none. For a guide alone the forward
            pass also keeps, per tile row, the first excluded column (an int32 and a 0/1 per
            row: ``R * ceil(C / tile) * 5`` bytes); a tile where no row excludes more than one
            candidate is then zeroed in backward by one scatter, without its guide product.
            Without the read every tile is masked again (exact either way).
    """

    relation: Positives | None = None
    guide: tuple[Tensor, Tensor, Tensor] | None = None
    keep: Positives | None = None
    keep_diagonal: int | None = None
    diagonal: int | None = None
    symmetric: bool = False
    learn: bool = False
    # what this call's passes learn about its tiles (mutable; the rule above is not)
    record: TileRecord = field(default_factory=lambda: TileRecord(), repr=False, compare=False)

    @property
    def learned(self) -> bool:
        """Whether the call's tile record has been learned from (the backward pass may use it)."""
        return self.record.learned

    def recorded(self) -> Tensor | None:
        """See :meth:`TileRecord.recorded`."""
        return self.record.recorded()

    def learn_from(self, values: list[float]) -> None:
        """See :meth:`TileRecord.learn_from`."""
        self.record.learn_from(values)

    def _recording(self) -> bool:
        return self.learn and not self.learned and not torch.compiler.is_compiling()

    def _note(self, r0: int, c0: int, excluded: Tensor, multiple: Tensor) -> None:
        self.record.flags[(r0, c0)] = torch.stack((excluded.to(torch.float32), multiple.to(torch.float32)))

    def tile(self, r0: int, r1: int, c0: int, c1: int) -> Tensor | None:
        """The (r1 - r0, c1 - c0) bool block of excluded candidates (without ``diagonal``),
        or None when only ``diagonal`` is excluded (or the tile is known to exclude nothing)."""
        if (r0, c0) in self.record.clear:
            return None
        block: Tensor | None = None
        if self.relation is not None:
            block = self.relation.tile(r0, r1, c0, c1)
        if self.guide is not None:
            rows, cols, threshold = self.guide
            # reused buffers: the verdict is consumed before the next tile is asked for
            scores = torch.mm(rows[r0:r1], cols[c0:c1].t(), out=self._buffer("scores", (r1 - r0, c1 - c0), rows.dtype, rows.device))
            verdict = torch.gt(scores, threshold[r0:r1, None], out=self._buffer("verdict", scores.shape, torch.bool, rows.device))
            block = verdict if block is None else block | verdict
        if block is None:
            if self.diagonal is None:
                raise ValueError("an Exclusion needs a relation, a guide or a diagonal")
            return None
        if self.keep is not None:
            block = block & ~self.keep.tile(r0, r1, c0, c1)
        if self.guide is None and self_diagonal(block, r0, c0, self.keep_diagonal) is not None:
            block = block.clone()  # the block may be the relation's own tensor: write into a copy
        kept = self_diagonal(block, r0, c0, self.keep_diagonal)  # the positive itself never leaves
        if kept is not None:
            kept.fill_(False)
        if self._recording():  # the backward pass masks such a tile again (multiple = 1)
            self._note(r0, c0, block.any(), torch.ones((), device=block.device))
        return block

    def drop(self, t: Tensor, r0: int, r1: int, c0: int, c1: int) -> None:
        """Zero the excluded entries (without ``diagonal``) of a tile ``t`` of finite values
        in place: a multiplication by the 0/1 factor, several times cheaper than a masked
        fill; for a guide alone one comparison written straight into floats, or -- in a
        backward pass after :meth:`learn_from` -- one scatter at the kept first columns."""
        if (r0, c0) in self.record.clear:
            return
        firsts = self.record.firsts.get((r0, c0)) if self.learned else None
        if firsts is not None:
            column, kept = firsts
            column = column.to(torch.int64)[:, None]
            t.scatter_(1, column, t.gather(1, column) * kept.to(t.dtype)[:, None])
            return
        if self.guide is not None and self.relation is None and self.keep is None:
            rows, cols, threshold = self.guide
            scores = torch.mm(rows[r0:r1], cols[c0:c1].t(), out=self._buffer("scores", (r1 - r0, c1 - c0), rows.dtype, rows.device))
            keep = scores if scores.dtype == t.dtype else self._buffer("keep", scores.shape, t.dtype, rows.device)
            keep = torch.le(scores, threshold[r0:r1, None], out=keep)  # in place: one 0/1 tile in cache, not two
            kept_diagonal = self_diagonal(keep, r0, c0, self.keep_diagonal)  # the positive itself never leaves
            if kept_diagonal is not None:
                kept_diagonal.fill_(1.0)
            if self._recording():
                self._remember(keep, r0, c0)
            t.mul_(keep)
            return
        block = self.tile(r0, r1, c0, c1)
        if block is not None:
            t.mul_(torch.logical_not(block, out=self._buffer("keep", block.shape, t.dtype, block.device)))

    def _remember(self, keep: Tensor, r0: int, c0: int) -> None:
        """Record a guide tile's counts and, per row, its excluded column if it has one.

        A row sum gives each row's kept count and one matrix-vector product ``keep @ j``
        the sum of its kept column indices; for a row that excludes exactly one column, that
        column is ``sum_j j - sum_{kept} j`` (integers, exact in fp32 below 2**24: tiles up to
        4,096 columns; wider ones use an argmin, several times slower on CPU)."""
        width = keep.shape[1]
        excluded = width - keep.sum(1)
        if keep.dtype == torch.float64 or width <= 4096:
            index = self._cached(("index", width, keep.dtype, keep.device),
                                 lambda: torch.arange(width, dtype=keep.dtype, device=keep.device))
            column = (width * (width - 1) // 2) - torch.mv(keep, index)  # a row without exclusion gets 0
        else:
            column = keep.argmin(1)  # the first of equal minima
        self._note(r0, c0, excluded.sum(), (excluded > 1).sum())
        self.record.firsts[(r0, c0)] = (column.to(torch.int32), excluded == 0)

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A per-shape scratch tensor (tiles repeat a few shapes; no allocation per tile)."""
        return self._cached((name, tuple(shape), dtype, device), lambda: torch.empty(shape, dtype=dtype, device=device))

    def _cached(self, key: tuple[Any, ...], make: Callable[[], Tensor]) -> Tensor:
        """``make()`` once per key, kept in ``scratch``; a traced graph makes its own (no
        side effect to capture)."""
        if torch.compiler.is_compiling():
            return make()
        value = self.record.scratch.get(key)
        if value is None:
            value = self.record.scratch[key] = make()
        return value
