"""Supervised contrastive loss (Khosla et al. 2020)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import _validation as v
from .._tensors import mask_as
from ..distributed import Scope
from ..engine import Options, Problem, Softmax, compute_dtype, solve
from ..engine.one_tile import note_rebuild
from ..positives import KeyPositives, Positives
from ._kept import kept
from ._labelled import check_reference, with_memory, with_reference
from ._prologue import begin, engine_total, reduce, single_set

__all__ = ["supcon_loss"]


@kept(1, labels=True)
def supcon_loss(
    features: Tensor,
    labels: Tensor | None = None,
    mask: Tensor | None = None,
    temperature: float | Tensor = 0.07,
    *,
    base_temperature: float | Tensor | None = None,
    contrast_mode: str = "all",
    normalize: bool = True,
    reduction: str = "mean",
    chunk_size: int | None = None,
    gather: bool = False,
    grad_reduction: str = "mean",
    eps: float = 1e-12,
    validate: bool = True,
    memory_emb: Tensor | None = None,
    memory_labels: Tensor | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    single_class: str = "keep",
    backend: str = "auto",
) -> Tensor:
    """Supervised contrastive loss (Khosla et al. 2020).

    ``loss_i = -(tau / tau_base) * mean_{p in P(i)} [ s_ip - log sum_{a != i} exp(s_ia) ]``

    Two input forms:

    * the SupCon authors' ``features`` of shape (bsz, n_views, ...) (trailing dims are
      flattened), flattened view-major (``torch.cat(torch.unbind(features, 1))``).
      Positives: same ``labels`` (bsz,), or ``mask`` (bsz, bsz) (may be asymmetric),
      or, with neither, the other views of the same sample (SimCLR);
    * pytorch-metric-learning's (N, D) embeddings with ``labels`` (N,) (or an (N, N)
      ``mask``).

    Anchors without a positive are left out of the mean (as pytorch-metric-learning
    does; the authors' code returns NaN); with no positive at all the loss is 0 with
    a zero gradient.

    Args:
        features: (bsz, n_views, ...) or (N, D) float tensor.
        labels: (bsz,) or (N,) integer class labels.
        mask: (bsz, bsz) positive mask instead of labels (not with ``gather``).
        temperature: tau > 0 (default 0.07).
        base_temperature: tau_base; ``None`` means tau (no rescaling, as
            pytorch-metric-learning). Pass 0.07 to reproduce the authors' scale.
        contrast_mode: ``"all"`` (every view is an anchor) or ``"one"`` (view 0 only).
        normalize: cosine similarity (default). The authors' code uses raw dot
            products of features it expects to be normalised already.
        reduction: ``"mean"`` over anchors with positives, ``"sum"``, or ``"none"``:
            per-anchor losses in view-major order (0 for anchors without positives).
        memory_emb: (M, D) rows kept from earlier batches (a
            :class:`~torch_contrastive.FeatureQueue`): extra candidates of every anchor,
            positives by label -- pytorch-metric-learning's ``CrossBatchMemory`` around its
            ``SupConLoss``, with this batch's rows live (they get gradients as candidates
            too). Needs ``labels``. Memory rows are not gathered (a queue pushed with
            ``gather=True`` is global already).
        memory_labels: (M,) integer labels of ``memory_emb``.
        ref_emb: (M, D) reference rows: the candidates of every anchor instead of the batch
            (pytorch-metric-learning's ``ref_emb``/``ref_labels``); no self pair. Needs
            ``labels``.
        ref_labels: (M,) integer labels of ``ref_emb``.
        single_class: a batch without a negative pair (every label equal): ``"keep"``
            (default: the formula's value, at least ``log |P(i)|`` per anchor, as the
            SupCon authors' code) or ``"zero"`` (pytorch-metric-learning: 0 with a zero
            gradient). Needs ``labels``.

    The shared options ``chunk_size``, ``gather``, ``grad_reduction``, ``eps``, ``validate``, ``backend`` are
    documented once in :mod:`torch_contrastive.options`.

    Memory: O((N + M) * D + tile^2); forward+backward about two N x N x D matrix
    multiplies in ``"all"`` mode, whatever the labels (plus N x M x D products per
    direction with a memory).
    """
    v.check_embeddings(features, "features", min_ndim=2, max_ndim=None)
    scope, checks = begin(normalize=normalize, reduction=reduction, chunk_size=chunk_size, grad_reduction=grad_reduction, eps=eps, backend=backend,
                          gather=gather, validate=validate)
    v.check_choice(contrast_mode, "contrast_mode", v.CONTRAST_MODES)
    if labels is not None and mask is not None:
        raise ValueError("supcon_loss takes labels or mask, not both")
    _check_single_class(single_class, labels)
    if features.ndim == 2:
        if labels is None and mask is None:
            raise ValueError("features of shape (N, D) need labels (or a mask); pass (bsz, n_views, D) for SimCLR-style views")
    bsz, n_views = features.shape[0], (1 if features.ndim == 2 else features.shape[1])
    device = features.device
    if labels is not None:
        labels = v.check_labels(labels, "labels", bsz, device)
    if mask is not None:
        if gather:
            raise ValueError("mask cannot be combined with gather=True (it only relates this rank's samples); pass labels")
        mask = v.check_mask(mask, bsz, device, checks)
    checks.finite(features, "features", deferred=True)
    # view-major, as the authors' code ((N, D) features are one view already)
    flat = features if features.ndim == 2 else features.transpose(0, 1).reshape(bsz * n_views, -1)
    memory = v.check_memory(memory_emb, memory_labels, flat.shape[1], device, checks)
    if memory is not None and labels is None:
        raise ValueError("memory_emb needs labels for the batch (positives with memory rows are found by label)")
    reference = check_reference(ref_emb, ref_labels, labels, flat.shape[1], device, checks, gather, memory)
    scale, bound = v.inverse_temperature(temperature, checks, need_bound=normalize)
    factor = None
    if base_temperature is not None:
        base_scale, _ = v.inverse_temperature(base_temperature, checks, name="base_temperature")
        factor = base_scale / scale  # tau / tau_base
    z, z_all, offset, inside = single_set(flat, "features", normalize, scope, checks, labels is not None)
    n_anchor = bsz if contrast_mode == "one" else bsz * n_views
    symmetric = not scope.distributed and n_anchor == z.shape[0] and memory is None and reference is None
    if mask is not None:
        positives: Positives = Positives.from_sample_mask(mask, torch.arange(n_anchor, device=device) % bsz, bsz * n_views)
    else:
        relation = (n_views, n_anchor, offset, scope)
        positives = _key_relation(labels if labels is not None else torch.arange(bsz, device=device) + offset, *relation)
    anchors = z if n_anchor == z.shape[0] else z[:n_anchor]
    z_all, positives, grad_columns, self_offset = _candidates(z_all, positives, offset, memory, reference, inside, normalize, eps)
    weighting = (compute_dtype(z.dtype), reduction, scope, factor)
    stat, n_with_positives = _weighted_rows(positives, *weighting)
    if labels is not None and mask is memory is reference is None:  # the labels alone: a kept call rebuilds these
        note_rebuild(positives, stat, _rebuild, bsz, device, relation, weighting)
    total = stat.total
    per_anchor, _ = solve(Problem(anchors, z_all, scale, stat, positives=positives,
                                  self_offset=self_offset, symmetric=symmetric, bound=bound if normalize else None,
                                  grad_columns=grad_columns, options=Options(inside, eps, chunk_size, backend)))
    # With two rows or more every row meets every anchor's denominator (a row's only
    # exclusion is its self pair), so a non-finite row normalised inside makes the loss NaN.
    covers = inside and z_all.shape[0] >= 2
    loss = _finish(per_anchor, total, factor, n_with_positives, reduction, scope, checks, v.output_needs_check(normalize, bound),
                   covers)
    if single_class == "zero" and labels is not None:
        loss = loss * mask_as(has_negative_pair(scope.ints(labels), memory, reference), loss.dtype)
    return loss


def _check_single_class(single_class: object, labels: Tensor | None) -> None:
    v.check_choice(single_class, "single_class", ("keep", "zero"))
    if single_class == "zero" and labels is None:
        raise ValueError("single_class='zero' needs labels (it looks for a pair of different labels)")


def _key_relation(sample_keys: Tensor, n_views: int, n_anchor: int, offset: int, scope: Scope) -> KeyPositives:
    """Same key, same class: ``sample_keys`` (labels, or sample indices for SimCLR-style views) per view, this
    rank's anchors its first ``n_anchor`` flattened rows."""
    keys = scope.ints(sample_keys if n_views == 1 else sample_keys.repeat(n_views))
    anchor_keys = keys if offset == 0 and n_anchor == keys.shape[0] else keys[offset : offset + n_anchor]
    return Positives.from_keys(anchor_keys, None if anchor_keys is keys else keys, self_offset=offset)


def _weighted_rows(positives: Positives, cdtype: torch.dtype, reduction: str, scope: Scope,
                   factor: Tensor | float | None) -> tuple[Softmax, Tensor]:
    """The soft-max statistic of SupCon's rows, and how many anchors have a positive. Per anchor
    ``has_pos * LSE - has_pos / |P(i)| * sum_p s_ip`` (anchors without positives give 0); ``has_pos`` as
    ``min(|P(i)|, 1)``: one op fewer than a comparison and a cast. A tensor ``factor`` (a learnable temperature)
    carries a gradient: then the loss is reduced outside the engine (no ``total``)."""
    counts = positives.row_counts_as(cdtype)
    has_pos_f = counts.clamp_max(1)
    weights = (has_pos_f, has_pos_f / counts.clamp_min(1))
    n_with_positives = has_pos_f.sum()
    total = None if isinstance(factor, Tensor) else engine_total(reduction, scope, n_with_positives, cdtype,
                                                                  1.0 if factor is None else factor)
    return Softmax(row_weights=weights, total=total), n_with_positives


def _rebuild(bsz: int, device: torch.device, relation: tuple[Any, ...], weighting: tuple[Any, ...],
             labels: Tensor) -> tuple[KeyPositives, Softmax]:
    """A kept call's relation and statistic from its ``labels`` (:mod:`._kept`): the full path's functions."""
    positives = _key_relation(v.check_labels(labels, "labels", bsz, device), *relation)
    return positives, _weighted_rows(positives, *weighting)[0]


def _candidates(z_all: Tensor, positives: Positives, offset: int, memory: tuple[Tensor, Tensor] | None,
                reference: tuple[Tensor, Tensor] | None, inside: bool, normalize: bool,
                eps: float) -> tuple[Tensor, Positives, int | None, int | None]:
    """The candidate rows, positives, first constant column and self offset: the batch, the
    batch and a memory, or a reference set (no self pairs)."""
    if reference is not None:
        if not isinstance(positives, KeyPositives):
            raise ValueError("reference_embeddings take labels, not a mask")
        rows, extended, constant = with_reference(reference, positives.row_keys[0], z_all.dtype, inside, normalize, eps)
        return rows, extended, constant, None
    if memory is not None:
        rows, extended, constant = with_memory(z_all, memory, positives, inside, normalize, eps)
        return rows, extended, constant, offset
    return z_all, positives, None, offset


def has_negative_pair(labels: Tensor, memory: tuple[Tensor, Tensor] | None, reference: tuple[Tensor, Tensor] | None) -> Tensor:
    """0-dim bool: some anchor and some candidate carry different labels (no host read).

    With a reference set the candidates are its rows; otherwise the batch (and memory)."""
    candidates = reference[1] if reference is not None else (labels if memory is None else torch.cat([labels, memory[1]]))
    first = labels[:1]
    return (labels != first).any() | (candidates != first).any()


def _finish(per_anchor: Tensor, total: object, factor: Tensor | float | None, n_anchors: Tensor, reduction: str,
            scope: Scope, checks: v.Checks, check_output: bool, covers: bool) -> Tensor:
    """The loss from the engine's output: already reduced (``total``), or reduced here."""
    if factor is not None and total is None:
        per_anchor = per_anchor * (factor.to(per_anchor.dtype) if isinstance(factor, Tensor) else factor)
    return reduce(per_anchor, n_anchors, reduction, scope, checks, check_output, inside=total is not None, covers=covers)
