"""The labelled losses' candidates (a memory, a reference set) and their label-sorted tiles."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _validation as v
from .._normalize import prepare
from ..distributed import Scope
from ..engine import LabelRanges, Options, PairTerms, Problem, Scale, label_sort_tile, solve, tile_label_bounds
from ..engine.one_tile import note_rebuild
from ..positives import KeyPositives, Positives


def with_memory(z_all: Tensor, memory: tuple[Tensor, Tensor], positives: Positives, inside: bool, normalize: bool,
                eps: float) -> tuple[Tensor, Positives, int | None]:
    """Candidates and positives of a single-set labelled loss extended by memory rows.

    The memory rows follow the batch as extra candidate columns (the self pairs keep
    their place); their labels extend the column keys. Returns ``(candidates, positives,
    grad_columns)``: a memory that does not require grad skips its gradient products.
    """
    emb, labels = memory
    # normalised like the batch: inside the engine (local) or already (gathered rows)
    rows = emb.to(z_all.dtype) if inside else prepare(emb.to(z_all.dtype), normalize, eps)
    candidates = torch.cat([z_all, rows])
    if not isinstance(positives, KeyPositives):
        raise TypeError(f"a memory extends a label relation, got a {positives.kind!r} relation")
    row_keys, col_keys = positives.row_keys[0], positives.col_keys[0]
    extended = Positives.from_keys(row_keys, torch.cat([col_keys, labels]), self_offset=positives.self_offset)
    return candidates, extended, (None if emb.requires_grad else z_all.shape[0])


def with_reference(reference: tuple[Tensor, Tensor], anchor_keys: Tensor, dtype: torch.dtype, inside: bool, normalize: bool,
                   eps: float) -> tuple[Tensor, Positives, int | None]:
    """Candidates and positives when a separate reference set replaces the batch as candidates
    (pytorch-metric-learning's ``ref_emb``/``ref_labels``): anchors i and reference rows j
    are positives when their labels match; no pair is a self pair. Returns
    ``(candidates, positives, grad_columns)`` as :func:`with_memory`."""
    emb, labels = reference
    rows = emb.to(dtype) if inside else prepare(emb.to(dtype), normalize, eps)
    positives = Positives.from_keys(anchor_keys, labels, self_offset=None)
    return rows, positives, (None if emb.requires_grad else 0)


def check_reference(ref_emb: object, ref_labels: object, labels: object, width: int, device: torch.device, checks: v.Checks,
                    gather: bool, memory: object) -> tuple[Tensor, Tensor] | None:
    """``(ref_emb, ref_labels)`` checked, or None; a reference set needs labels, and is not
    combined with ``gather`` or a memory."""
    if ref_emb is None and ref_labels is None:
        return None
    if ref_emb is None or ref_labels is None:
        raise ValueError("ref_emb and ref_labels go together: pass both or neither")
    if labels is None:
        raise ValueError("ref_emb needs labels for the batch (positives with reference rows are found by label)")
    if gather or memory is not None:
        raise ValueError("ref_emb is not combined with gather=True or memory_emb (the reference set is the only candidate set)")
    emb = v.check_embeddings(ref_emb, "ref_emb")
    if emb.shape[1] != width:
        raise ValueError(f"ref_emb must have feature size {width} (as the batch), got {emb.shape[1]}")
    ref = v.check_labels(ref_labels, "ref_labels", emb.shape[0], device)
    checks.finite(emb, "ref_emb")
    return emb, ref


class SortedByLabel(NamedTuple):
    rows: Tensor  # the rows, sorted by label
    labels: Tensor  # their labels, sorted
    ranges: LabelRanges  # (first, last) label of every block of sorted rows, blocks of the plan's tile
    order: Tensor  # sorted position of every original row: per_row_sorted[order] is in the caller's order
    scale_bound: float | None  # the value of a tensor scale, read in the same transfer (None for a float scale)


def sort_by_label(problem: Problem, labels: Tensor, checks: v.Checks, scope: Scope, normalize: bool) -> SortedByLabel | None:
    """Rows sorted by label and the tile plan of the mask-in-tile kernels, or None.

    Sorted by label, the positives of a single-set labelled loss are contiguous diagonal
    blocks, so most tiles hold only negatives and skip the mask work. Which tiles do is
    known from each tile's first and last label, read in the call's one validation
    transfer -- so only when that read happens anyway (``validate=True``), on one process,
    for normalised inputs (raw dot products need a second read). Whether the batch spans
    several tiles, and how large they are, is the plan's answer for ``problem`` (the
    unsorted call, whose anchors and scale are the ones sorted and read here:
    :func:`~..engine.label_sort_tile`), not the loss's. A tensor scale is read in the same
    transfer, so no output check (a second read) is needed afterwards.
    """
    if not checks.enabled or scope.distributed or not normalize:
        return None
    tile = label_sort_tile(problem)
    if tile == 0:
        return None
    z, scale = problem.anchors, problem.scale
    sorted_labels, perm = torch.sort(labels, stable=True)
    bounds = tile_label_bounds(sorted_labels, tile)
    if isinstance(scale, Tensor):
        bounds = torch.cat([bounds.to(torch.float64), scale.detach().reshape(1).to(device=bounds.device, dtype=torch.float64)])
    values = checks.flush_values(bounds)
    scale_bound = values.pop() if isinstance(scale, Tensor) else None
    blocks = tuple((values[2 * i], values[2 * i + 1]) for i in range(len(values) // 2))
    return SortedByLabel(z[perm], sorted_labels, LabelRanges(tile, blocks, blocks), torch.argsort(perm), scale_bound)


def _rebuild_pairs(n: int, device: torch.device, offset: int, kernel: str,
                   combine: Callable[[Positives], Any] | None, labels: Tensor) -> tuple[Positives, PairTerms]:
    """A kept call's relation and statistic from its ``labels`` (:mod:`._kept`): the full path's functions
    for one process's labels, checked as the loss checks them."""
    keys = v.check_labels(labels, "labels", n, device)
    positives = _same_key(keys, keys, offset)
    return positives, PairTerms(kernel, combine=combine and combine(positives))


def _same_key(row_keys: Tensor, keys: Tensor, offset: int) -> KeyPositives:
    """The same-label relation of this rank's rows (``row_keys``) to the global batch (``keys``)."""
    return Positives.from_keys(row_keys, keys, self_offset=offset)


class LabelledRows(NamedTuple):
    outputs: tuple[Tensor, ...]  # the kernel's per-row statistics, in the caller's row order
    counts: Tensor | None  # (R,) positives per row, same order; None when ``combine`` reduced inside
    scale_bound: float | None  # the scale's value when it was read (see SortedByLabel), else the bound given


def labelled_pairwise_rows(z: Tensor, z_all: Tensor, keys: Tensor, offset: int, scale: Scale, bound: float | None, *,
                           kernel: str, checks: v.Checks, scope: Scope, normalize: bool, inside: bool, eps: float,
                           chunk_size: int | None, memory: tuple[Tensor, Tensor] | None = None,
                           combine: Callable[[Positives], Any] | None = None,
                           reference: tuple[Tensor, Tensor] | None = None, backend: str = "auto") -> LabelledRows:
    """A mask-in-tile kernel on a same-label relation: sorted by label when that pays (see
    :func:`sort_by_label`), in the given order otherwise. ``keys`` are the global labels;
    ``memory`` (rows, labels) adds candidates, ``reference`` (rows, labels) replaces them
    (then the given order is kept).

    ``combine``: from the relation (in the engine's row order) to the
    ``PairTerms(combine=...)`` weights and reduction; ``outputs`` is then the scalar
    loss alone (order does not matter for a sum), and ``counts`` None: the combine reads
    what it needs of the relation (a per-pair mean only its pair count).
    """
    given_order = memory is not None or reference is not None
    options = Options(inside, eps, chunk_size, backend)
    positives: Positives = _same_key(keys[offset : offset + z.shape[0]] if scope.distributed else keys, keys, offset)
    if reference is not None:
        z_all, positives, _ = with_reference(reference, keys, z_all.dtype, inside, normalize, eps)
    if memory is not None:
        z_all, positives, _ = with_memory(z_all, memory, positives, inside, normalize, eps)
    stat = PairTerms(kernel, combine=combine and combine(positives))
    problem = Problem(z, z_all, scale, stat, positives=positives, self_offset=positives.self_offset,
                      bound=bound if normalize else None, options=options)
    by_label = None if given_order else sort_by_label(problem, keys, checks, scope, normalize)
    if by_label is None:
        if memory is reference is None and not scope.distributed:  # the labels alone: a kept call rebuilds these
            note_rebuild(positives, stat, _rebuild_pairs, z.shape[0], z.device, offset, kernel, combine)
        outputs = solve(problem)
        return LabelledRows(outputs, None if combine else positives.row_counts(), bound)
    # Sorted: most tiles hold only negatives.
    known = bound if by_label.scale_bound is None else by_label.scale_bound
    positives = Positives.from_keys(by_label.labels, self_offset=0)
    stat = PairTerms(kernel, label_ranges=by_label.ranges, combine=combine and combine(positives))
    outputs = solve(Problem(by_label.rows, by_label.rows, scale, stat, positives=positives, self_offset=0,
                            bound=known if normalize else None, options=options))
    order = by_label.order
    if combine is not None:
        return LabelledRows(outputs, None, known)
    return LabelledRows(tuple(t[order] for t in outputs), positives.row_counts()[order], known)
