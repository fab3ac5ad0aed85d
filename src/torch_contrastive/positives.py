"""Positive structure: which (anchor, candidate) pairs are positives.

Every loss in this package describes its positives with one :class:`Positives`
object instead of building an N x N mask. The object can

* produce any (row-block, column-block) tile of the positive relation on demand
  (:meth:`Positives.tile`) -- the tiled engine asks for tiles it needs;
* count positives per anchor (:meth:`Positives.row_counts`) in O(N) memory;
* sum the positive candidates of every anchor (:meth:`Positives.aggregate`), which
  turns the positive part of a soft-max loss, ``sum_p s_ip``, into an O(N * D)
  computation that needs no tiles at all.

Three kinds of relation cover every convention in the seeds:

``keys``
    ``i ~ j`` iff ``row_key[i] == col_key[j]`` for at least one of up to two key
    pairs. Pairing rules (``adjacent``: key ``i // 2``; ``halves``: key ``i mod N``),
    class labels, SupCon views (key = sample index) and the image/text ids of
    seed 002 (image ids OR text ids) are all key relations.
``pairs``
    An explicit, directional list of (row, column) index pairs (seed 000's
    ``pos_indices``).
``mask``
    A small dense (bsz, bsz) mask over *samples*, repeated over views (the SupCon
    authors' ``mask`` argument, possibly asymmetric).

Anchors may be a slice of the candidates (single-set losses, and the local rows of
one rank in distributed training): ``self_offset`` then says that anchor ``i`` *is*
candidate ``i + self_offset``. :meth:`tile`, :meth:`row_counts` and
:meth:`aggregate` always leave that self pair out.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

__all__ = ["Positives"]


@dataclass(frozen=True)
class Positives:
    """Description of the positive relation between R anchors and C candidates.

    Build it with the class methods (:meth:`from_keys`, :meth:`from_pairs`,
    :meth:`from_sample_mask`) rather than the constructor.

    Attributes:
        num_rows: R, the number of anchors.
        num_cols: C, the number of candidates.
        self_offset: anchor ``i`` is candidate ``i + self_offset``; ``None`` when
            anchors and candidates are different sets (image-text).
        row_keys: for ``keys`` relations, a tuple of (R,) int64 tensors.
        col_keys: for ``keys`` relations, a tuple of (C,) int64 tensors, same length.
        pairs: for ``pairs`` relations, a (P, 2) int64 tensor of unique
            (row, column) pairs without self pairs.
        sample_mask: for ``mask`` relations, a (bsz, bsz) bool tensor; anchor ``i``
            is sample ``row_sample[i]``, candidate ``j`` is sample ``j % bsz``.
        row_sample: for ``mask`` relations, the (R,) sample index of every anchor.
    """

    num_rows: int
    num_cols: int
    self_offset: int | None
    row_keys: tuple[Tensor, ...] = ()
    col_keys: tuple[Tensor, ...] = ()
    pairs: Tensor | None = None
    sample_mask: Tensor | None = None
    row_sample: Tensor | None = None

    # ------------------------------------------------------------------ builders
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
                OR-combined as in seed 002's ``gt_image | gt_text``).
            col_keys: the same for the C candidates; defaults to ``row_keys``
                (single-set losses).
            self_offset: anchor ``i`` is candidate ``i + self_offset`` (``None``: none).
        """
        rk = (row_keys,) if isinstance(row_keys, Tensor) else tuple(row_keys)
        ck = rk if col_keys is None else ((col_keys,) if isinstance(col_keys, Tensor) else tuple(col_keys))
        if not 1 <= len(rk) <= 2 or len(rk) != len(ck):
            raise ValueError("row_keys and col_keys must be one or two key tensors each, the same number")
        rows = tuple(k.reshape(-1).long() for k in rk)
        same = col_keys is None or all(c is r for c, r in zip(ck, rk))  # one set of keys: share it
        cols = rows if same else tuple(k.reshape(-1).long() for k in ck)
        return cls(num_rows=int(rk[0].numel()), num_cols=int(ck[0].numel()), self_offset=self_offset, row_keys=rows, col_keys=cols)

    @classmethod
    def from_pairs(cls, pairs: Tensor, num_rows: int, num_cols: int, *, self_offset: int | None = 0) -> Positives:
        """Positives from an explicit (P, 2) list of directional (row, column) pairs.

        Duplicates and self pairs are dropped (the self pair is handled by each loss).
        """
        p = pairs.reshape(-1, 2).long()
        if self_offset is not None and p.numel():
            p = p[p[:, 1] != p[:, 0] + self_offset]
        if p.numel():
            p = torch.unique(p, dim=0)
        return cls(num_rows=num_rows, num_cols=num_cols, self_offset=self_offset, pairs=p)

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
    @property
    def _pair_list(self) -> Tensor:
        if self.pairs is None:
            raise RuntimeError("internal: not a 'pairs' relation")
        return self.pairs

    @property
    def _mask(self) -> Tensor:
        if self.sample_mask is None:
            raise RuntimeError("internal: not a 'mask' relation")
        return self.sample_mask

    @property
    def _rows(self) -> Tensor:
        if self.row_sample is None:
            raise RuntimeError("internal: not a 'mask' relation")
        return self.row_sample

    # ------------------------------------------------------------------ queries
    @property
    def kind(self) -> str:
        """``"keys"``, ``"pairs"`` or ``"mask"``."""
        if self.pairs is not None:
            return "pairs"
        if self.sample_mask is not None:
            return "mask"
        return "keys"

    def tile(self, r0: int, r1: int, c0: int, c1: int) -> Tensor:
        """The (r1 - r0, c1 - c0) bool block of the relation, self pairs excluded.

        Cost: O(tile) memory and time for ``keys``/``mask``, O(P) for ``pairs``.
        """
        if self.kind == "keys":
            block = self.row_keys[0][r0:r1, None] == self.col_keys[0][None, c0:c1]
            for rk, ck in zip(self.row_keys[1:], self.col_keys[1:]):
                block |= rk[r0:r1, None] == ck[None, c0:c1]
        elif self.kind == "pairs":
            device = self._pair_list.device
            block = torch.zeros(r1 - r0, c1 - c0, dtype=torch.bool, device=device)
            p = self._pair_list
            inside = (p[:, 0] >= r0) & (p[:, 0] < r1) & (p[:, 1] >= c0) & (p[:, 1] < c1)
            p = p[inside]
            block[p[:, 0] - r0, p[:, 1] - c0] = True
            return block  # self pairs were dropped at construction
        else:
            bsz = self._mask.shape[0]
            cols = torch.arange(c0, c1, device=self._mask.device) % bsz
            block = self._mask[self._rows[r0:r1]][:, cols]
        return self._drop_self(block, r0, c0)

    def _drop_self(self, block: Tensor, r0: int, c0: int) -> Tensor:
        if self.self_offset is None:
            return block
        rows = torch.arange(r0, r0 + block.shape[0], device=block.device)
        cols = rows + self.self_offset - c0
        inside = (cols >= 0) & (cols < block.shape[1])
        if bool(inside.any()):
            block[(rows - r0)[inside], cols[inside]] = False
        return block

    def row_counts(self) -> Tensor:
        """(R,) int64 number of positives of every anchor (self excluded). O(N) memory."""
        if self.kind == "keys":
            counts = torch.stack([sign * torch.bincount(cg, minlength=n)[rg] for rg, cg, n, sign in self._key_terms]).sum(0)
            return counts - self._self_in_relation().long()
        if self.kind == "pairs":
            return torch.bincount(self._pair_list[:, 0], minlength=self.num_rows)
        bsz = self._mask.shape[0]
        views_of = torch.bincount(torch.arange(self.num_cols, device=self._mask.device) % bsz, minlength=bsz)
        per_sample = (self._mask.long() * views_of[None, :]).sum(1)
        return per_sample[self._rows] - self._self_in_relation().long()

    def col_counts(self) -> Tensor:
        """(C,) int64 number of anchors each candidate is positive for (self excluded)."""
        if self.kind == "keys":
            counts = torch.stack([sign * torch.bincount(rg, minlength=n)[cg] for rg, cg, n, sign in self._key_terms]).sum(0)
            if self.self_offset is not None:
                own = torch.arange(self.num_rows, device=counts.device) + self.self_offset
                counts = counts.index_add(0, own, -self._self_in_relation().long())
            return counts
        if self.kind == "pairs":
            return torch.bincount(self._pair_list[:, 1], minlength=self.num_cols)
        raise NotImplementedError("col_counts is only used by two-set losses, which have key relations")

    def aggregate(self, candidates: Tensor) -> Tensor:
        """(R, D) sum of the positive candidates of every anchor, ``sum_j P_ij c_j``.

        Differentiable with respect to ``candidates``; O(N * D) memory and time for
        ``keys`` and ``pairs`` relations, O(bsz^2 + N * D) for ``mask``.
        """
        if self.kind == "keys":
            terms = self._key_terms
            if len(terms) == 1 and self.row_keys is self.col_keys and terms[0][2] == self.num_rows:
                # Every key distinct and rows are columns: row i's only positive is column i
                # (CLIP without ids). No copy at all.
                return self._minus_self(candidates, candidates)
            total = candidates.new_zeros(self.num_rows, candidates.shape[1])
            for rg, cg, n, sign in terms:
                per_group = candidates.new_zeros(n, candidates.shape[1]).index_add(0, cg, candidates)
                total = total + sign * per_group[rg]
            return self._minus_self(total, candidates)
        if self.kind == "pairs":
            out = candidates.new_zeros(self.num_rows, candidates.shape[1])
            return out.index_add(0, self._pair_list[:, 0], candidates[self._pair_list[:, 1]])
        bsz = self._mask.shape[0]
        per_sample = candidates.new_zeros(bsz, candidates.shape[1]).index_add(
            0, torch.arange(self.num_cols, device=candidates.device) % bsz, candidates
        )
        total = self._mask.to(candidates.dtype)[self._rows] @ per_sample
        return self._minus_self(total, candidates)

    # ------------------------------------------------------------------ helpers
    def _minus_self(self, total: Tensor, candidates: Tensor) -> Tensor:
        """Remove each anchor's own row from a relation sum that included it."""
        if self.self_offset is None:
            return total
        own = candidates[self.self_offset : self.self_offset + self.num_rows]
        return total - own * self._self_in_relation()[:, None].to(candidates.dtype)

    def _self_in_relation(self) -> Tensor:
        """(R,) bool: is the anchor's self pair inside the raw relation (to subtract it)?"""
        device = self._device()
        if self.self_offset is None:
            return torch.zeros(self.num_rows, dtype=torch.bool, device=device)
        if self.kind == "keys":
            return torch.ones(self.num_rows, dtype=torch.bool, device=device)
        if self.kind == "mask":
            return self._mask[self._rows, self._rows]
        return torch.zeros(self.num_rows, dtype=torch.bool, device=device)

    def _device(self) -> torch.device:
        for t in (*self.row_keys, self.pairs, self.sample_mask):
            if t is not None:
                return t.device
        return torch.device("cpu")

    @cached_property
    def _key_terms(self) -> tuple[tuple[Tensor, Tensor, int, int], ...]:
        """(row group ids, column group ids, number of groups, sign) of every key relation.

        Two relations combine by inclusion-exclusion, |A or B| = |A| + |B| - |A and B|,
        so their intersection (both keys equal) enters with sign -1. Computed once per
        object: ``torch.unique`` is O(N log N) and counts and aggregates all need it.
        """
        terms = []
        for rk, ck in zip(self.row_keys, self.col_keys):
            terms.append((*self._groups(torch.cat([rk, ck])), 1))
        if len(self.row_keys) == 2:
            both = torch.cat([torch.stack(self.row_keys, 1), torch.stack(self.col_keys, 1)], 0)
            terms.append((*self._groups(both), -1))
        return tuple(terms)

    def _groups(self, keys: Tensor) -> tuple[Tensor, Tensor, int]:
        """Group ids of the R row keys and C column keys stacked in ``keys``."""
        _, inverse = torch.unique(keys, dim=0 if keys.ndim > 1 else None, return_inverse=True)
        n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
        return inverse[: self.num_rows], inverse[self.num_rows :], n_groups
