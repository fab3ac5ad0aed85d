"""Matryoshka's soft-max forms under ``gather=True`` among several ranks, as the losses gather: this rank's anchors
against every rank's candidates, each anchor's positive and self at its global column, the loss's denominator
summed over the ranks (:meth:`~torch_contrastive.distributed.Scope.finish`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from .. import _validation as v
from ..distributed import Scope, all_gather_with_grad
from ..engine.prefixes import Targets
from .prefix_forms import (
    OnePass,
    counted_positives,
    global_ids,
    info_nce_form,
    name_non_finite,
    one_key,
    one_pass_softmax,
    spread_targets,
    weighted_form,
)
from .prefix_weights import PositiveWeights


def gathered_form(loss_fn: Callable[..., Tensor], tensors: list[Tensor], kwargs: dict[str, Any], keys: set[str],
              tau: float | Tensor, scope: Scope, chunk: int | None, reduction: str) -> OnePass | None:
    """The soft-max forms under ``gather=True`` among several ranks, as the losses gather: this rank's anchors
    against every rank's candidates (gathered with their gradients, rank-ordered), each anchor's positive and
    self at its global column; CLIP's two directions as two passes (local images against every text, local
    texts against every image). Each rank sums its anchors' terms and :meth:`~torch_contrastive.distributed.Scope.finish`
    divides by the global count (``grad_reduction`` as the losses apply it); ``reduction="none"``: this rank's
    anchors' values. None for a sample mask (which the loss refuses with ``gather=True``)."""
    from . import image_text_contrastive_loss, info_nce_loss

    # InfoNCE's false-negative rules: its form gathers every rank's candidates and the rules' rows itself
    rules = loss_fn is info_nce_loss and bool(keys)
    if rules:
        form = info_nce_form(tensors, kwargs, keys, scope)
        found = None if form is None else (form, None)
    else:
        found = weighted_form(loss_fn, tensors, kwargs, keys)
    if found is None or found[0][2].sample_mask is not None:
        return None  # (a mask relates this rank's samples only: the loss refuses it with gather=True)
    (anchors, candidates, targets, _), given_weight = found
    temperature = tau.reshape(()) if isinstance(tau, Tensor) else v.check_positive(tau, "temperature")
    if loss_fn is image_text_contrastive_loss:
        images, texts = tensors[0], tensors[1].to(tensors[0].dtype)
        all_texts, all_images = scope.rows_of(texts, images)
        # gt is symmetric in the pairs: one relation serves both directions (row j's keys are pair j's)
        targets = spread_targets(global_ids(targets, kwargs, scope), scope)
        normaliser = counted_positives(targets, anchors, by_pairs=True)
        if targets.smoothing:  # the uniform part's G and N are every rank's
            local = normaliser if isinstance(normaliser, Tensor) else anchors.new_tensor(normaliser)
            targets = replace(targets, population=(scope.total(local), int(sum(scope.sizes))))
        directions = [(images, all_texts, targets), (texts, all_images, targets)]
        factor = 0.5 * (float(sum(scope.sizes)) if reduction == "sum" else 1.0)  # CLIP's sum: N_all times its mean
    else:
        pool, targets = (candidates, targets) if rules else _gathered_candidates(loss_fn, tensors, kwargs, anchors, candidates,
                                                                                 targets, scope)
        if targets.smoothing:  # InfoNCE's: one positive per query, every rank's queries, as many keys (G = N = theirs)
            everyone = int(sum(scope.sizes))
            targets = replace(targets, population=(anchors.new_tensor(float(everyone)), everyone))
        directions = [(anchors, pool, targets)]
        normaliser = counted_positives(targets, anchors, by_pairs=False) if reduction == "mean" else 1.0
        factor = 1.0
    # NT-Xent's weighted positive terms (DCLW): this rank's rows' weights, their own gradient summed here and
    # reduced over the ranks with the loss
    weighted = None if given_weight is None or targets.partner is None else \
        PositiveWeights(given_weight, anchors, directions[0][1], targets.partner, "none" if reduction == "none" else "sum")

    def run(dims: list[int], weights: list[float], named: list[tuple[str, Tensor]] | None) -> Tensor:
        per_row = reduction == "none"  # this rank's anchors' values

        def softmax(t: Targets) -> Tensor:
            return one_pass_softmax(*directions[0][:2], t, dims, weights, temperature, None, 1e-12, chunk, None, mean=False,
                                    per_row=per_row)

        first = directions[0][2]
        local = softmax(first) if weighted is None else weighted.around(first, dims, weights, temperature, softmax)
        for a, c, t in directions[1:]:
            local = local + one_pass_softmax(a, c, t, dims, weights, temperature, None, 1e-12, chunk, None, mean=False, per_row=per_row)
        if per_row and len(directions) == 2:  # CLIP's rows: e_i with mean(e) the loss over every rank's rows
            local = local * _clip_rows_factor(targets, anchors, scope)
        loss = local if per_row else scope.finish(local * factor, normaliser)
        if named is not None:
            name_non_finite(loss, named, temperature if isinstance(temperature, Tensor) else None)
        return loss

    return run


def _gathered_candidates(loss_fn: Callable[..., Tensor], tensors: list[Tensor], kwargs: dict[str, Any], anchors: Tensor,
                         candidates: Tensor, targets: Targets, scope: Scope) -> tuple[Tensor, Targets]:
    """A one-direction soft-max form's candidates under ``gather`` and its targets made global, as the losses
    gather: every rank's rows (InfoNCE's keys, then every rank's negatives), each anchor's partner or keys at its
    global column."""
    from . import info_nce_loss, nt_xent_loss, supcon_loss

    if loss_fn is supcon_loss:
        return _gathered_supcon(kwargs, candidates, targets, scope)
    if loss_fn is info_nce_loss:  # the keys, then (gathered too, as gather_negatives defaults) the negatives
        pool = scope.rows(tensors[1].to(anchors.dtype))
        if len(tensors) == 3:
            pool = torch.cat([pool, all_gather_with_grad(tensors[2].to(anchors.dtype))])  # any count per rank
    else:
        pool = scope.rows(anchors)
    if loss_fn is nt_xent_loss and targets.partner is not None:  # each rank pairs its own rows
        targets = replace(targets, partner=targets.partner + scope.offset)
    return pool, spread_targets(targets, scope)


def _gathered_supcon(kwargs: dict[str, Any], candidates: Tensor, targets: Targets, scope: Scope) -> tuple[Tensor, Targets]:
    """SupCon under ``gather``: every rank's rows, all views (each rank's view-major), as the loss gathers them, with
    their keys; this rank's anchors (every view, or the first with ``contrast_mode="one"``) at the rank's offset; a
    memory, this rank's own, after them; views without labels: a sample's key its row index made global."""
    memory = kwargs.get("memory_emb")
    extra = memory.shape[0] if isinstance(memory, Tensor) else 0
    n = candidates.shape[0] - extra  # the batch's rows, then the memory's
    pool = scope.rows(candidates[:n])  # (the rank's offset among every rank's rows is known from here)
    rows, cols = one_key(targets.row_keys), one_key(targets.col_keys)
    if kwargs.get("labels") is None:  # views without labels: a sample's key is its own row index, made global
        rows, cols = rows + scope.offset, cols + scope.offset
    col_keys = scope.ints(cols[:n])
    if extra:
        pool, col_keys = torch.cat([pool, candidates[n:]]), torch.cat([col_keys, cols[n:]])
    return pool, replace(targets, row_keys=rows, col_keys=col_keys, offset=scope.offset)


def _clip_rows_factor(targets: Targets, anchors: Tensor, scope: Scope) -> Tensor | float:
    """What turns the sum of CLIP's two directions' per-row values (each as the prefix engine gives them for this
    rank's rows) into the loss's ``reduction="none"`` values under ``gather``: ``e_i = (image_i + text_i) N / (2 G)``
    with ``N`` every rank's rows and ``G`` every rank's positive pairs. By pairs the engine scaled this rank's rows by
    its own ``n / g``, undone here; without ids ``G = N`` (the mean of the two directions)."""
    if not targets.by_pairs:
        return 0.5
    local = counted_positives(targets, anchors, by_pairs=True)
    counted = local if isinstance(local, Tensor) else anchors.new_tensor(local)
    return 0.5 * counted / anchors.shape[0] * float(sum(scope.sizes)) / scope.total(counted).clamp_min(1)

