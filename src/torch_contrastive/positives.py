"""Positive structure: which (anchor, candidate) pairs are positives.

Every loss in this package describes its positives with one :class:`Positives`
object instead of building an N x N mask. The object can

* produce any (row-block, column-block) tile of the positive relation on demand
  (:meth:`Positives.tile`) -- the tiled engine asks for tiles it needs;
* count positives per anchor (:meth:`Positives.row_counts`) in O(N) memory;
* sum the positive candidates of every anchor (:meth:`Positives.aggregate`), which
  turns the positive part of a soft-max loss, ``sum_p s_ip``, into an O(N * D)
  computation that needs no tiles at all.

Four kinds of relation cover every convention in the seeds:

``partner``
    Exactly one positive per anchor, ``partner[i]`` (pairing rules ``adjacent`` and
    ``halves`` pairing rules, CLIP without ids): aggregates are a gather.
``keys``
    ``i ~ j`` iff ``row_key[i] == col_key[j]`` for at least one of up to two key
    pairs: class labels, SupCon views (key = sample index) and the image/text ids of
    Wang's image-text write-up (image ids OR text ids; README, "Conventions").
``pairs``
    An explicit, directional list of (row, column) index pairs (the NT-BXent write-up's
    ``pos_indices``).
``mask``
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
from typing import Any

import torch
from torch import Tensor

from ._tensors import mask_as, self_diagonal

__all__ = ["DENSE_KEYS_LIMIT", "Positives"]

#: Key relations with at most this many (row, column) entries are held as a dense bool
#: matrix (64 KiB): for small batches a few element-wise ops beat grouping by a sort.
DENSE_KEYS_LIMIT = 256 * 256


@dataclass(frozen=True)
class Positives:
    """Description of the positive relation between R anchors and C candidates.

    Build it with the class methods (:meth:`from_partner`, :meth:`from_keys`,
    :meth:`from_pairs`, :meth:`from_sample_mask`) rather than the constructor.

    Attributes:
        num_rows: R, the number of anchors.
        num_cols: C, the number of candidates.
        self_offset: anchor ``i`` is candidate ``i + self_offset``; ``None`` when
            anchors and candidates are different sets (image-text).
        partner: for ``partner`` relations, the (R,) int64 column of each anchor's
            only positive (never its self column).
        layout: for ``partner`` relations whose positives lie on strided diagonals of the
            R x C matrix (``"identity"``: column i; ``"adjacent"``: i ^ 1; ``"halves"``:
            (i + R/2) mod R), so a single tile reads and writes them as views.
        shift: for ``partner`` relations, ``k`` when ``partner[i] == i + k`` for every row
            (the caller's promise; 0 for the ``identity`` layout), so the engine can keep
            the positive apart from the soft-max sums (``engine/confident.py``).
        row_keys: for ``keys`` relations, a tuple of (R,) int64 tensors.
        col_keys: for ``keys`` relations, a tuple of (C,) int64 tensors, same length.
        pairs: for ``pairs`` relations, a (P, 2) int64 tensor of (row, column) pairs.
        pair_weight: for ``pairs`` relations, (P,) 1 for a pair that counts, 0 for a
            self pair or a repeat of an earlier pair.
        sample_mask: for ``mask`` relations, a (bsz, bsz) bool tensor; anchor ``i``
            is sample ``row_sample[i]``, candidate ``j`` is sample ``j % bsz``.
        row_sample: for ``mask`` relations, the (R,) sample index of every anchor.
        key_terms: for large ``keys`` relations, the sorted grouping of the keys
            (see :func:`_key_terms`).
        dense: for small ``keys`` relations (at most :data:`DENSE_KEYS_LIMIT` entries),
            the (R, C) bool relation itself, self pairs excluded.
    """

    num_rows: int
    num_cols: int
    self_offset: int | None
    partner: Tensor | None = None
    layout: str | None = None
    shift: int | None = None
    row_keys: tuple[Tensor, ...] = ()
    col_keys: tuple[Tensor, ...] = ()
    pairs: Tensor | None = None
    pair_weight: Tensor | None = None
    sample_mask: Tensor | None = None
    row_sample: Tensor | None = None
    key_terms: tuple[tuple[Tensor, Tensor, int, int], ...] = ()
    dense: Tensor | None = None
    # ``dense`` as 0/1 values per dtype (see dense_as); not a property of the relation
    _dense_values: dict[torch.dtype, Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_partner(cls, partner: Tensor, num_cols: int, *, self_offset: int | None = 0, layout: str | None = None,
                     shift: int | None = None) -> Positives:
        """One positive per anchor: column ``partner[i]`` (which must not be the self column).

        Pairing rules (``adjacent``: ``i ^ 1``; ``halves``: ``(i + N) mod 2N``) and
        CLIP without ids (``partner[i] = i``, ``self_offset=None``). ``layout`` names the
        rule when ``partner`` follows it exactly on a square problem; ``shift=k`` says
        ``partner[i] == i + k`` (see the attributes).
        """
        p = partner.reshape(-1).long()
        if layout is not None and (layout not in ("identity", "adjacent", "halves") or int(p.numel()) != num_cols):
            raise ValueError(f"layout must be 'identity', 'adjacent' or 'halves' on a square problem, got {layout!r}")
        if shift is None and layout == "identity":
            shift = 0
        return cls(num_rows=int(p.numel()), num_cols=num_cols, self_offset=self_offset, partner=p, layout=layout, shift=shift)

    @classmethod
    def from_keys(
        cls,
        row_keys: Tensor | tuple[Tensor, ...],
        col_keys: Tensor | tuple[Tensor, ...] | None = None,
        *,
        self_offset: int | None = 0,
    ) -> Positives:
        """Positives by key equality: ``i ~ j`` iff any ``row_keys[k][i] == col_keys[k][j]``.

        Args:
            row_keys: (R,) integer tensor, or a tuple of up to two (one per relation,
                OR-combined as ``gt_image | gt_text`` in Wang's image-text write-up).
            col_keys: the same for the C candidates; defaults to ``row_keys``
                (single-set losses).
            self_offset: anchor ``i`` is candidate ``i + self_offset`` (``None``: none).
        """
        rk = (row_keys,) if isinstance(row_keys, Tensor) else tuple(row_keys)
        ck = rk if col_keys is None else ((col_keys,) if isinstance(col_keys, Tensor) else tuple(col_keys))
        if not 1 <= len(rk) <= 2 or len(rk) != len(ck):
            raise ValueError("row_keys and col_keys must be one or two key tensors each, the same number")
        rows = tuple(_index_vector(k) for k in rk)
        cols = rows if col_keys is None else tuple(_index_vector(k) for k in ck)
        num_rows, num_cols = int(rows[0].numel()), int(cols[0].numel())
        if num_rows * num_cols <= DENSE_KEYS_LIMIT:
            # Small batches: the R x C relation itself is cheaper than grouping by a sort
            # (a few element-wise ops instead of a dozen small ones).
            dense = rows[0][:, None] == cols[0][None, :]
            for r, c in zip(rows[1:], cols[1:]):
                dense |= r[:, None] == c[None, :]
            if self_offset is not None:
                k = self_offset
                if k < num_cols and -k < num_rows:
                    dense.diagonal(k).fill_(False)
            return cls(num_rows=num_rows, num_cols=num_cols, self_offset=self_offset, row_keys=rows, col_keys=cols, dense=dense)
        return cls(num_rows=num_rows, num_cols=num_cols, self_offset=self_offset, row_keys=rows,
                   col_keys=cols, key_terms=_key_terms(rows, cols))

    @classmethod
    def from_pairs(cls, pairs: Tensor, num_rows: int, num_cols: int, *, self_offset: int | None = 0) -> Positives:
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
        return cls(num_rows=num_rows, num_cols=num_cols, self_offset=self_offset, pairs=p, pair_weight=weight)

    @classmethod
    def from_sample_mask(cls, sample_mask: Tensor, row_sample: Tensor, num_cols: int) -> Positives:
        """Positives from a (bsz, bsz) sample mask repeated over views (SupCon's ``mask``).

        Candidates are the view-major flattening ``j -> sample j % bsz``; anchor ``i``
        is candidate ``i`` (``self_offset=0``) and belongs to sample ``row_sample[i]``.
        """
        return cls(
            num_rows=int(row_sample.numel()),
            num_cols=num_cols,
            self_offset=0,
            sample_mask=sample_mask.bool(),
            row_sample=row_sample.long(),
        )

    # ------------------------------------------------------------------ typed access
    @staticmethod
    def require(t: Tensor | None, kind: str) -> Tensor:
        """``t``, which the relation's kind guarantees; an internal error otherwise."""
        if t is None:
            raise RuntimeError(f"internal: not a {kind!r} relation")
        return t

    @property
    def kind(self) -> str:
        """``"partner"``, ``"keys"``, ``"pairs"`` or ``"mask"``."""
        if self.partner is not None:
            return "partner"
        if self.pairs is not None:
            return "pairs"
        if self.sample_mask is not None:
            return "mask"
        return "keys"

    # ------------------------------------------------------------------ queries
    def tile(self, r0: int, r1: int, c0: int, c1: int) -> Tensor:
        """The (r1 - r0, c1 - c0) bool block of the relation, self pairs excluded (read-only).

        Cost: O(tile) memory and time for ``partner``/``keys``/``mask``, O(P + tile)
        for ``pairs``.
        """
        kind = self.kind
        device = self._device()
        if self.dense is not None:
            return self.dense[r0:r1, c0:c1]
        if kind == "partner":
            cols = torch.arange(c0, c1, device=device)
            return self.require(self.partner, kind)[r0:r1, None] == cols[None, :]  # never the self column
        if kind == "pairs":
            return self._pair_tile(r0, r1, c0, c1)
        if kind == "keys":
            block = self.row_keys[0][r0:r1, None] == self.col_keys[0][None, c0:c1]
            for rk, ck in zip(self.row_keys[1:], self.col_keys[1:]):
                block |= rk[r0:r1, None] == ck[None, c0:c1]
        else:
            mask = self.require(self.sample_mask, kind)
            cols = torch.arange(c0, c1, device=device) % mask.shape[0]
            block = mask[self.require(self.row_sample, kind)[r0:r1]][:, cols]
        diag = self_diagonal(block, r0, c0, self.self_offset)
        if diag is not None:
            diag.fill_(False)
        return block

    def _pair_tile(self, r0: int, r1: int, c0: int, c1: int) -> Tensor:
        # Pairs outside the tile (or with zero weight) write into one spare slot past
        # its end, so the scatter has the same shape whatever the data.
        p, w = self.require(self.pairs, "pairs"), self.require(self.pair_weight, "pairs")
        h, wdt = r1 - r0, c1 - c0
        inside = w & (p[:, 0] >= r0) & (p[:, 0] < r1) & (p[:, 1] >= c0) & (p[:, 1] < c1)
        flat = torch.where(inside, (p[:, 0] - r0) * wdt + (p[:, 1] - c0), h * wdt)
        block = torch.zeros(h * wdt + 1, dtype=torch.bool, device=p.device)
        # index_fill_ takes the value as a scalar: `block[flat] = True` builds a value tensor
        # and synchronised with the host on CUDA
        block.index_fill_(0, flat, True)
        return block[:-1].view(h, wdt)

    def row_counts(self) -> Tensor:
        """(R,) int64 number of positives of every anchor (self excluded). O(N) memory."""
        kind = self.kind
        device = self._device()
        if kind == "partner":
            return torch.ones(self.num_rows, dtype=torch.int64, device=device)
        if self.dense is not None:
            return self.dense.sum(1)
        if kind == "keys":
            counts = torch.zeros(self.num_rows, dtype=torch.int64, device=device)
            for rg, cg, n_bound, sign in self.key_terms:
                per_group = torch.zeros(n_bound, dtype=torch.int64, device=device).index_add_(0, cg, torch.ones_like(cg))
                counts += sign * per_group[rg]
            return counts - self._self_in_relation().long()
        if kind == "pairs":
            p, w = self.require(self.pairs, kind), self.require(self.pair_weight, kind)
            return torch.zeros(self.num_rows, dtype=torch.int64, device=device).index_add_(0, p[:, 0], w.long())
        mask = self.require(self.sample_mask, kind)
        views = self.num_cols // mask.shape[0]  # candidates are bsz * n_views, view-major
        per_sample = mask.long().sum(1) * views
        return per_sample[self.require(self.row_sample, kind)] - self._self_in_relation().long()

    def tile_values(self, r0: int, r1: int, c0: int, c1: int, dtype: torch.dtype) -> Tensor:
        """:meth:`tile` as 0/1 values of ``dtype`` (read-only): a dense relation's whole block is
        converted once per relation and dtype (:meth:`dense_as`)."""
        if self.dense is not None and (r0, c0) == (0, 0) and (r1, c1) == tuple(self.dense.shape):
            return self.dense_as(dtype)
        return mask_as(self.tile(r0, r1, c0, c1), dtype)

    def dense_as(self, dtype: torch.dtype) -> Tensor:
        """The dense relation as 0/1 values of ``dtype``, converted once per relation and dtype
        (a small batch's forward and backward read it several times); under ``torch.compile``
        converted where asked (the compiler fuses it)."""
        if torch.compiler.is_compiling():
            return mask_as(self.require(self.dense, "dense"), dtype)
        values = self._dense_values.get(dtype)
        if values is None:
            values = self._dense_values[dtype] = mask_as(self.require(self.dense, "dense"), dtype)
        return values

    @cached_property
    def row_lists(self) -> tuple[Tensor, Tensor]:
        """A ``pairs`` relation as sorted per-row lists (CSR): ``(offsets, columns)``, int32.

        Row ``r``'s listed columns are ``columns[offsets[r]:offsets[r + 1]]`` in increasing
        order; repeats and the self pair (weight 0) are left out. ``columns`` has one spare
        ``-1`` at its end so that it is never empty. One sort of the P pairs, O(R + P) memory,
        no host read (the Triton pair kernels test membership with it, ``_tile.listed``);
        computed once per relation, so a loss's forward and backward share it.
        """
        p, w = self.require(self.pairs, "pairs"), self.require(self.pair_weight, "pairs")
        counts = self.row_counts()
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
        # pairs that do not count sort past every real one (offsets never reach them)
        code = torch.where(w, p[:, 0] * self.num_cols + p[:, 1], self.num_rows * self.num_cols)
        columns = torch.sort(code).values % max(self.num_cols, 1)
        return offsets, torch.cat([columns, columns.new_full((1,), -1)]).to(torch.int32)

    def aggregate(self, candidates: Tensor) -> Tensor:
        """(R, D) sum of the positive candidates of every anchor, ``sum_j P_ij c_j``.

        Differentiable with respect to ``candidates``; O(N * D) memory and time for
        ``partner``, ``keys`` and ``pairs`` relations, O(bsz^2 + N * D) for ``mask``.
        """
        kind = self.kind
        if kind == "partner":
            if self.layout == "identity":  # CLIP without ids: row i's positive is column i. No copy at all.
                return candidates
            return candidates[self.require(self.partner, kind)]
        if self.dense is not None:
            with torch.autocast(candidates.device.type, enabled=False):
                return self.dense_as(candidates.dtype) @ candidates
        if kind == "keys":
            total = candidates.new_zeros(self.num_rows, candidates.shape[1])
            for rg, cg, n_bound, sign in self.key_terms:
                per_group = candidates.new_zeros(n_bound, candidates.shape[1]).index_add_(0, cg, candidates)
                total = total + sign * per_group[rg]
            return self._minus_self(total, candidates)
        if kind == "pairs":
            p, w = self.require(self.pairs, kind), self.require(self.pair_weight, kind)
            out = candidates.new_zeros(self.num_rows, candidates.shape[1])
            return out.index_add(0, p[:, 0], candidates[p[:, 1]] * w[:, None].to(candidates.dtype))
        mask = self.require(self.sample_mask, kind)
        bsz = mask.shape[0]
        per_sample = candidates.reshape(-1, bsz, candidates.shape[1]).sum(0)  # view-major: j -> sample j % bsz
        with torch.autocast(candidates.device.type, enabled=False):  # keep the compute dtype under autocast
            total = mask_as(mask, candidates.dtype)[self.require(self.row_sample, kind)] @ per_sample
        return self._minus_self(total, candidates)

    def aggregate_transposed(self, rows: Tensor) -> Tensor:
        """(C, D) ``sum_i P_ij r_i``: the transpose of :meth:`aggregate`, for gradients
        with respect to candidates and for column statistics. Same cost as :meth:`aggregate`."""
        kind = self.kind
        width = rows.shape[1]
        if kind == "partner":
            if self.layout == "identity":
                return rows  # CLIP without ids: column j's positive is row j
            return rows.new_zeros(self.num_cols, width).index_add(0, self.require(self.partner, kind), rows)
        if self.dense is not None:
            with torch.autocast(rows.device.type, enabled=False):
                return self.dense_as(rows.dtype).t() @ rows
        if kind == "keys":
            total = rows.new_zeros(self.num_cols, width)
            for rg, cg, n_bound, sign in self.key_terms:
                per_group = rows.new_zeros(n_bound, width).index_add_(0, rg, rows)
                total = total + sign * per_group[cg]
            if self.self_offset is not None:  # every key relation contains the self pair
                total = total.index_add(0, torch.arange(self.num_rows, device=rows.device) + self.self_offset, rows, alpha=-1)
            return total
        if kind == "pairs":
            p, w = self.require(self.pairs, kind), self.require(self.pair_weight, kind)
            return rows.new_zeros(self.num_cols, width).index_add(0, p[:, 1], rows[p[:, 0]] * w[:, None].to(rows.dtype))
        mask = self.require(self.sample_mask, kind)
        bsz = mask.shape[0]
        row_sample = self.require(self.row_sample, kind)
        per_sample = rows.new_zeros(bsz, width).index_add_(0, row_sample, rows)
        with torch.autocast(rows.device.type, enabled=False):
            per_col_sample = mask.to(rows.dtype).t() @ per_sample
        total = per_col_sample.repeat(self.num_cols // bsz, 1)  # view-major: column j is sample j % bsz
        own = rows * mask[row_sample, row_sample][:, None].to(rows.dtype)
        return total.index_add(0, torch.arange(self.num_rows, device=rows.device), own, alpha=-1)

    # ------------------------------------------------------------------ helpers
    def _minus_self(self, total: Tensor, candidates: Tensor) -> Tensor:
        """Remove each anchor's own row from a relation sum that included it."""
        if self.self_offset is None:
            return total
        own = candidates[self.self_offset : self.self_offset + self.num_rows]
        if self.kind == "keys":
            return total - own  # every key relation contains the self pair
        return total - own * self._self_in_relation()[:, None].to(candidates.dtype)

    def _self_in_relation(self) -> Tensor:
        """(R,) bool: is the anchor's self pair inside the raw relation (to subtract it)?"""
        device = self._device()
        if self.self_offset is None or self.kind in ("partner", "pairs"):
            return torch.zeros(self.num_rows, dtype=torch.bool, device=device)
        if self.kind == "keys":
            return torch.ones(self.num_rows, dtype=torch.bool, device=device)
        rows = self.require(self.row_sample, "mask")
        return self.require(self.sample_mask, "mask")[rows, rows]

    def _device(self) -> torch.device:
        for t in (self.partner, *self.row_keys, self.pairs, self.sample_mask):
            if t is not None:
                return t.device
        return torch.device("cpu")


def _index_vector(k: Tensor) -> Tensor:
    """``k`` as a 1-D int64 tensor (itself when it already is one: no dispatch)."""
    return k if k.ndim == 1 and k.dtype == torch.int64 else k.reshape(-1).long()


def _key_terms(row_keys: tuple[Tensor, ...], col_keys: tuple[Tensor, ...]) -> tuple[tuple[Tensor, Tensor, int, int], ...]:
    """(row group ids, column group ids, bound on the number of groups, sign) per relation.

    Two relations combine by inclusion-exclusion, |A or B| = |A| + |B| - |A and B|,
    so their intersection (both keys equal) enters with sign -1. Computed once, when
    the object is built: the sort is O(N log N) and counts and aggregates all need it.
    """
    terms = []
    for rk, ck in zip(row_keys, col_keys):
        terms.append((*_groups(torch.cat([rk, ck])[:, None], rk.numel()), 1))
    if len(row_keys) == 2:
        both = torch.cat([torch.stack(row_keys, 1), torch.stack(col_keys, 1)], 0)
        terms.append((*_groups(both, row_keys[0].numel()), -1))
    return tuple(terms)


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
    # Per-call state below (an Exclusion is built for one loss call and lives through its
    # backward): not frozen, compared by identity.
    scratch: dict[Any, Tensor] = field(default_factory=dict, repr=False, compare=False)
    # per-tile counts recorded in forward ((r0, c0) -> (excluded entries, rows excluding more
    # than one)), each tile row's first excluded column and whether it has one (guide alone;
    # after learn_from only for the tiles whose rows exclude one at most), and the tiles
    # known on the host to exclude nothing
    flags: dict[tuple[int, int], Tensor] = field(default_factory=dict, repr=False, compare=False)
    firsts: dict[tuple[int, int], tuple[Tensor, Tensor]] = field(default_factory=dict, repr=False, compare=False)
    clear: set[tuple[int, int]] = field(default_factory=set, repr=False, compare=False)

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

    def _recording(self) -> bool:
        return self.learn and not self.learned and not torch.compiler.is_compiling()

    def _note(self, r0: int, c0: int, excluded: Tensor, multiple: Tensor) -> None:
        self.flags[(r0, c0)] = torch.stack((excluded.to(torch.float32), multiple.to(torch.float32)))

    def tile(self, r0: int, r1: int, c0: int, c1: int) -> Tensor | None:
        """The (r1 - r0, c1 - c0) bool block of excluded candidates (without ``diagonal``),
        or None when only ``diagonal`` is excluded (or the tile is known to exclude nothing)."""
        if (r0, c0) in self.clear:
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
        if (r0, c0) in self.clear:
            return
        firsts = self.firsts.get((r0, c0)) if self.learned else None
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
        self.firsts[(r0, c0)] = (column.to(torch.int32), excluded == 0)

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A per-shape scratch tensor (tiles repeat a few shapes; no allocation per tile)."""
        return self._cached((name, tuple(shape), dtype, device), lambda: torch.empty(shape, dtype=dtype, device=device))

    def _cached(self, key: tuple[Any, ...], make: Callable[[], Tensor]) -> Tensor:
        """``make()`` once per key, kept in ``scratch``; a traced graph makes its own (no
        side effect to capture)."""
        if torch.compiler.is_compiling():
            return make()
        value = self.scratch.get(key)
        if value is None:
            value = self.scratch[key] = make()
        return value
