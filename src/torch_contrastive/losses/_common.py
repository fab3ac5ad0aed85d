"""Set-up and reduction shared by the losses (README, "Conventions").

* ``s_ij = <a_i, c_j> / temperature`` with ``a = a / max(||a||, eps)`` when
  ``normalize=True`` (cosine similarity, the default); raw dot products otherwise.
* fp16/bf16 inputs are computed in fp32 and the loss is returned in fp32.
* ``validate=True`` reads device values once per call (one combined check);
  ``validate=False`` reads none, so a call makes no host synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _validation as v
from .._normalize import prepare
from .._tensors import as_dtype
from ..distributed import Scope, make_scope
from ..engine import Options, PairTerms, Problem, Scale, resolve_tile, solve, tile_label_bounds
from ..engine.planner import label_sorted, reduce_inside
from ..positives import Positives

_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def begin(*, reduction: str, chunk_size: int | None, grad_reduction: str, eps: float, backend: str, gather: bool,
          validate: bool, stacklevel: int = 4) -> tuple[Scope, v.Checks]:
    """Every loss's prologue: the shared options checked (:mod:`torch_contrastive.options`), the
    call's :class:`~torch_contrastive.distributed.Scope` and its :class:`~torch_contrastive._validation.Checks`."""
    v.check_options(reduction=reduction, chunk_size=chunk_size, grad_reduction=grad_reduction, eps=eps, backend=backend)
    scope = make_scope(gather, grad_reduction, stacklevel=stacklevel)  # a warning names the caller's line
    return scope, v.Checks(validate, scope)


def check_agreement(scope: Scope, what: str, x: Tensor, validate: bool, *flags: bool) -> None:
    """Ranks must agree on feature shape, dtype and which optional inputs were given."""
    if validate and scope.distributed:
        scope.agree(f"{what} (feature size, dtype code, optional inputs given)",
                    [float(x[0].numel()), float(_DTYPE_CODES.get(x.dtype, -1)), *(float(f) for f in flags)])


class ImageTextInputs(NamedTuple):
    n: int  # rows (images) on this rank
    device: torch.device
    image_id: Tensor | None  # int64 on device
    text_id: Tensor | None
    ids_given: tuple[bool, bool]
    scope: Scope
    checks: v.Checks


def image_text_inputs(image_feat: Tensor, text_feat: Tensor, image_id: Tensor | None, text_id: Tensor | None, *,
                      reduction: str, chunk_size: int | None, grad_reduction: str, eps: float, gather: bool,
                      validate: bool, backend: str) -> ImageTextInputs:
    """Checks and set-up shared by the two-set image-text losses (CLIP's and SigLIP)."""
    v.check_embeddings(image_feat, "image_feat")
    v.check_embeddings(text_feat, "text_feat")
    v.check_same_rows(image_feat, "image_feat", text_feat, "text_feat")
    scope, checks = begin(reduction=reduction, chunk_size=chunk_size, grad_reduction=grad_reduction, eps=eps, backend=backend,
                          gather=gather, validate=validate, stacklevel=5)
    n = image_feat.shape[0]
    device = image_feat.device
    ids_given = (image_id is not None, text_id is not None)
    image_id = None if image_id is None else v.check_labels(image_id, "image_id", n, device)
    text_id = None if text_id is None else v.check_labels(text_id, "text_id", n, device)
    checks.finite(image_feat, "image_feat", deferred=True)
    checks.finite(text_feat, "text_feat", deferred=True)
    return ImageTextInputs(n, device, image_id, text_id, ids_given, scope, checks)


def image_text_positives(image_id: Tensor | None, text_id: Tensor | None, n: int, num_cols: int, scope: Scope,
                         device: torch.device) -> Positives:
    """Positives of this rank's n image rows against all ``num_cols`` texts (CLIP's duplicate-id rule).

    With ids: ``image_id_i == image_id_j or text_id_i == text_id_j`` (ids gathered under
    ``gather=True``); without: image i's positive is text ``offset + i``. The relation is
    symmetric, so it serves both directions.
    """
    keys = [k for k in (image_id, text_id) if k is not None]
    offset = scope.offset
    if keys:
        global_keys = tuple(scope.ints(k) for k in keys)
        local_keys = tuple(k[offset : offset + n] for k in global_keys) if scope.distributed else global_keys
        return Positives.from_keys(local_keys, global_keys, self_offset=None)
    return partner_positives(n, "identity", offset, device, num_cols, None, None if scope.distributed else "identity")


class SingleSet(NamedTuple):
    z: Tensor  # this rank's rows
    z_all: Tensor  # the global batch (z itself when local)
    offset: int  # global index of this rank's first row
    normalize_inside: bool  # the engine normalises z (local); else z is normalised already


def single_set(x: Tensor, name: str, normalize: bool, eps: float, scope: Scope, checks: v.Checks, *given: bool) -> SingleSet:
    """Shared set-up of the single-set losses: agreement check, normalisation, gather.

    Locally the raw rows go to the engine, which normalises them inside its autograd
    function (fewer autograd nodes); under ``gather=True`` each rank normalises its own
    rows before they are gathered.
    """
    check_agreement(scope, name, x, checks.enabled, *given)
    if not scope.distributed:
        return SingleSet(x, x, 0, normalize)
    z = prepare(x, normalize, eps)
    return SingleSet(z, scope.rows(z), scope.offset, False)


def reduce(per_anchor: Tensor, normaliser: Tensor | float, reduction: str, scope: Scope, checks: v.Checks,
           check_output: bool, extra: tuple[Tensor, Callable[[list[float]], None]] | None = None) -> Tensor:
    """Apply ``reduction`` to this rank's per-anchor values and run the call's checks.

    ``mean`` divides the global sum by the global ``normaliser`` (at least 1); ``sum``
    is the global sum; ``none`` returns this rank's per-anchor values. ``extra``: see
    :meth:`~torch_contrastive._validation.Checks.finish`.
    """
    finish_checks(per_anchor, checks, check_output, extra=extra)
    if reduction == "none":
        return per_anchor
    local_sum = per_anchor.sum()
    if reduction == "sum":
        return scope.finish(local_sum, 1.0)
    if isinstance(normaliser, Tensor):
        normaliser = normaliser.to(local_sum.dtype).clamp_min(1)
    return scope.finish(local_sum, max(normaliser, 1.0) if isinstance(normaliser, float) else normaliser)


def engine_total(reduction: str, scope: Scope, normaliser: Tensor | float, dtype: torch.dtype,
                 factor: float = 1.0) -> tuple[Tensor | float, Tensor | float] | None:
    """The coefficient pair of ``Softmax(total=...)`` that applies ``reduction``
    inside the engine (one process, ``mean``/``sum``), times ``factor``; ``None`` when the
    per-row values must come back (``none``, or a distributed loss, whose value needs
    the ranks' sums). A tensor ``normaliser`` (a count) gives a coefficient in ``dtype``.
    """
    if not reduce_inside(reduction, scope.distributed):
        return None
    if reduction == "mean":
        if isinstance(normaliser, Tensor):
            coef: Tensor | float = as_dtype(normaliser, dtype).clamp_min(1).reciprocal()
            if factor != 1.0:
                coef = coef * factor
        else:
            coef = factor / max(float(normaliser), 1.0)
        return coef, coef
    return factor, factor


def finish_checks(values: Tensor | tuple[Tensor, ...], checks: v.Checks, check_output: bool, covers: bool = False,
                  extra: tuple[Tensor, Callable[[list[float]], None]] | None = None) -> None:
    """Read the call's value checks at once; with ``check_output`` also the result's finiteness.

    Finite inputs give finite losses unless raw dot products (``normalize=False``)
    overflow the compute dtype: then say so instead of returning inf or NaN. ``values``
    may be several tensors (e.g. both directions); they are only touched when checked.
    ``covers``: ``values`` is the scalar loss and answers the deferred finite checks
    (:meth:`~torch_contrastive._validation.Checks.finish`).
    """
    if not checks.enabled:
        return
    parts = values if isinstance(values, tuple) else (values,)
    value = parts[0]
    if len(parts) > 1 and check_output:
        value = torch.stack([t.detach().abs().amax() for t in parts]).amax()
    overflow = (lambda: f"the loss overflowed {parts[0].dtype}: with normalize=False the logits <a_i, c_j> / temperature "
                "exceed its range; use normalize=True, smaller embeddings or a larger temperature") if check_output else None
    checks.finish(value, covers=covers, overflow=overflow, extra=extra)


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
    ranges: list[tuple[float, float]]  # (first, last) label of every tile of sorted rows
    order: Tensor  # sorted position of every original row: per_row_sorted[order] is in the caller's order
    scale_bound: float | None  # the value of a tensor scale, read in the same transfer (None for a float scale)


def sort_by_label(z: Tensor, labels: Tensor, chunk_size: int | None, checks: v.Checks, scope: Scope,
                  normalize: bool, scale: Scale, backend: str = "auto") -> SortedByLabel | None:
    """Rows sorted by label and the tile plan of the mask-in-tile kernels, or None.

    Sorted by label, the positives of a single-set labelled loss are contiguous diagonal
    blocks, so most tiles hold only negatives and skip the mask work. Which tiles do is
    known from each tile's first and last label, read in the call's one validation
    transfer; when to sort is the planner's decision (:func:`~..engine.planner.label_sorted`).
    A tensor scale is read in the same transfer, so no output check (a second read) is
    needed afterwards.
    """
    n = z.shape[0]
    tile = resolve_tile(chunk_size, n, n, z.device, 16 if z.dtype == torch.float64 else 8)
    if not label_sorted(n, tile, reads_anyway=checks.enabled, distributed=scope.distributed, normalized=normalize,
                        backend=backend):
        return None
    sorted_labels, perm = torch.sort(labels, stable=True)
    bounds = tile_label_bounds(sorted_labels, tile)
    if isinstance(scale, Tensor):
        bounds = torch.cat([bounds.to(torch.float64), scale.detach().reshape(1).to(device=bounds.device, dtype=torch.float64)])
    values = checks.flush_values(bounds)
    scale_bound = values.pop() if isinstance(scale, Tensor) else None
    ranges = [(values[2 * i], values[2 * i + 1]) for i in range(len(values) // 2)]
    return SortedByLabel(z[perm], sorted_labels, ranges, torch.argsort(perm), scale_bound)


class LabelledRows(NamedTuple):
    outputs: tuple[Tensor, ...]  # the kernel's per-row statistics, in the caller's row order
    counts: Tensor  # (R,) positives per row, same order
    scale_bound: float | None  # the scale's value when it was read (see SortedByLabel), else the bound given


def labelled_pairwise_rows(z: Tensor, z_all: Tensor, keys: Tensor, offset: int, scale: Scale, bound: float | None, *,
                           kernel: str, checks: v.Checks, scope: Scope, normalize: bool, inside: bool, eps: float,
                           chunk_size: int | None, memory: tuple[Tensor, Tensor] | None = None,
                           combine: Callable[[Tensor], Any] | None = None,
                           reference: tuple[Tensor, Tensor] | None = None, backend: str = "auto") -> LabelledRows:
    """A mask-in-tile kernel on a same-label relation: sorted by label when that pays (see
    :func:`sort_by_label`), in the given order otherwise. ``keys`` are the global labels;
    ``memory`` (rows, labels) adds candidates, ``reference`` (rows, labels) replaces them
    (then the given order is kept).

    ``combine``: from the positive counts (in the engine's row order) to the
    ``PairTerms(combine=...)`` weights and reduction; ``outputs`` is then the scalar
    loss alone (order does not matter for a sum).
    """
    given_order = memory is not None or reference is not None
    options = Options(inside, eps, chunk_size, backend)
    by_label = None if given_order else sort_by_label(z, keys, chunk_size, checks, scope, normalize, scale, backend)
    if by_label is None:
        positives = Positives.from_keys(keys[offset : offset + z.shape[0]] if scope.distributed else keys, keys, self_offset=offset)
        if reference is not None:
            z_all, positives, _ = with_reference(reference, keys, z_all.dtype, inside, normalize, eps)
        if memory is not None:
            z_all, positives, _ = with_memory(z_all, memory, positives, inside, normalize, eps)
        counts = positives.row_counts()
        outputs = solve(Problem(z, z_all, scale, PairTerms(kernel, combine=combine and combine(counts)), positives=positives,
                                self_offset=positives.self_offset, bound=bound if normalize else None, options=options))
        return LabelledRows(outputs, counts, bound)
    # Sorted: most tiles hold only negatives.
    known = bound if by_label.scale_bound is None else by_label.scale_bound
    positives = Positives.from_keys(by_label.labels, self_offset=0)
    counts = positives.row_counts()
    stat = PairTerms(kernel, label_ranges=(by_label.ranges, by_label.ranges), combine=combine and combine(counts))
    outputs = solve(Problem(by_label.rows, by_label.rows, scale, stat, positives=positives, self_offset=0,
                            bound=known if normalize else None, options=options))
    order = by_label.order
    if combine is not None:
        return LabelledRows(outputs, counts, known)
    return LabelledRows(tuple(t[order] for t in outputs), counts[order], known)


def safe_logsumexp(terms: Tensor) -> Tensor:
    """``logsumexp`` over dim 1 where a row of only ``-inf`` (no candidate left: every one
    excluded as a false negative) gives 0 and a zero gradient instead of ``-inf``/NaN."""
    empty = torch.isneginf(terms).all(1)
    safe = torch.where(empty[:, None], 0.0, terms)
    return torch.where(empty, 0.0, torch.logsumexp(safe, 1))


def positive_logits(anchors: Tensor, candidates: Tensor, positives: Positives, scale: Scale) -> Tensor:
    """(R,) ``sum_{p in P(i)} s_ip``, in O(N * D) through the positive aggregate.

    An element-wise product and sum, not ``vecdot``: autocast would run that in half precision.
    """
    return (anchors * positives.aggregate(candidates)).sum(1) * scale


_PARTNERS: dict[tuple[int, str, int, torch.device], Tensor] = {}


def pair_partner(n_rows: int, pairing: str, offset: int = 0, device: torch.device | None = None) -> Tensor:
    """Global index of each row's positive under a pairing rule (rows ``offset ...``).

    ``"adjacent"``: ``i ^ 1``; ``"halves"``: ``(i + n_rows / 2) mod n_rows`` with
    ``n_rows`` the size of the batch the rule applies to; ``"identity"``: ``i``. The
    index tensors are constants, built once per (size, rule, offset, device) and reused
    (a training loop calls with the same shapes every step). Treat them as read-only.
    """
    key = (n_rows, pairing, offset, torch.device(device) if device is not None else torch.device("cpu"))
    cached = _PARTNERS.get(key)
    if cached is None:
        rows = torch.arange(n_rows, device=device)
        local = rows if pairing == "identity" else rows ^ 1 if pairing == "adjacent" else (rows + n_rows // 2) % n_rows
        cached = local + offset
        if len(_PARTNERS) > 256:  # many distinct shapes: keep the cache small
            _PARTNERS.clear()
        _PARTNERS[key] = cached
    return cached


_PARTNER_POSITIVES: dict[tuple[int, str, int, torch.device, int, int | None, str | None], Positives] = {}


def partner_positives(n_rows: int, pairing: str, offset: int, device: torch.device, num_cols: int,
                      self_offset: int | None, layout: str | None) -> Positives:
    """``Positives.from_partner(pair_partner(...), ...)``, built once per shape and reused
    (like the partner indices themselves: a training loop asks for the same one every step)."""
    key = (n_rows, pairing, offset, torch.device(device), num_cols, self_offset, layout)
    cached = _PARTNER_POSITIVES.get(key)
    if cached is None:
        cached = Positives.from_partner(pair_partner(n_rows, pairing, offset, device), num_cols, self_offset=self_offset,
                                        layout=layout, shift=offset if pairing == "identity" else None)
        if len(_PARTNER_POSITIVES) > 256:
            _PARTNER_POSITIVES.clear()
        _PARTNER_POSITIVES[key] = cached
    return cached


def pair_keys(n_rows: int, pairing: str, device: torch.device | None = None) -> Tensor:
    """Key of each row under a pairing rule: rows with equal keys are positives.

    Args:
        n_rows: 2N, the number of rows (even).
        pairing: ``"adjacent"`` pairs rows (0, 1), (2, 3), ... (two views stored row by row);
            ``"halves"`` pairs row i with i + N, as in ``torch.cat([view1, view2])``
            (the SimCLR and SupCon papers).
    """
    rows = torch.arange(n_rows, device=device)
    return rows // 2 if pairing == "adjacent" else rows % (n_rows // 2)
