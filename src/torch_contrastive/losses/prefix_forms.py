"""What each loss's call is to the prefix engine (:mod:`torch_contrastive.engine.prefixes`): its anchors,
candidates and targets -- the soft-max forms (CLIP, InfoNCE, NT-Xent, SupCon), the pair forms (pytorch-metric-learning's
NT-Xent, NT-BXent) and SigLIP's sigmoid pairs -- read off the call's arguments and checked as the loss checks them.
:func:`~.matryoshka.matryoshka_loss` runs the form it finds; :mod:`.prefix_gather` makes the soft-max forms global
under ``gather=True``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from .. import _validation as v
from ..distributed import Scope, all_gather_with_grad, make_scope
from ..engine.keywords import prefix_pass
from ..engine.precision import compute_dtype
from ..engine.prefixes import COLUMN_SCALE_LIMIT, Targets
from ..options import shared
from . import prefix_symmetric as upper
from ._labelled import check_reference

#: Runs a one-pass form: ``(dims, weights, inputs to name when the loss is not finite, or None)`` -> the loss.
OnePass = Callable[[list[int], list[float], "list[tuple[str, Tensor]] | None"], Tensor]


#: The shared options (:mod:`torch_contrastive.options`) the soft-max one pass honours itself.
SHARED = ("normalize", "reduction", "chunk_size", "gather", "grad_reduction", "eps", "validate", "backend")


def one_pass_softmax(anchors: Tensor, candidates: Tensor, targets: Targets, dims: list[int], weights: list[float],
                   tau: float | Tensor, reverse: Tensor | None, eps: float, chunk: int | None,
                   named: list[tuple[str, Tensor]] | None, *, mean: bool = True, factor: float = 1.0,
                   per_row: bool = False) -> Tensor:
    """Every prefix's loss of ``anchors`` against ``candidates`` in one pass; with ``reverse``, averaged with
    ``reverse``'s rows against the anchors (row ``i``'s positives: as anchor ``i``'s, the relation being
    symmetric). ``tau``: a float, or a 0-dim tensor that gets its gradient (a learnable temperature; its
    value is checked in the one read). ``named``: the inputs to name when the loss is not finite (None: no
    host read). ``mean``: each prefix's mean over its counted anchors (False: their sum), times ``factor``;
    ``per_row``: the per-row values instead (``reduction="none"``, see :class:`~.engine.prefixes.PrefixPlan`)."""
    # a tensor (learnable) scale multiplies the cosines inside: the plan's scale is then 1
    scale_t = 1.0 / tau if isinstance(tau, Tensor) else None
    scale = 1.0 if isinstance(tau, Tensor) else 1.0 / tau
    one: dict[str, Any] = {"eps": eps, "chunk_size": chunk, "mean": mean, "per_row": per_row}
    if scale_t is None and upper.covers(anchors, candidates, targets, scale, reverse):  # one set: the upper triangle
        loss = upper.upper_softmax(anchors, targets, dims, weights, scale, eps, chunk, mean, per_row)
        reverse = None
    elif reverse is candidates and scale_t is None and scale <= COLUMN_SCALE_LIMIT[compute_dtype(anchors.dtype)]:
        # the candidates' direction from the same tiles (CLIP): one product pass for both directions
        same = candidates.to(anchors.dtype)
        loss = prefix_pass("softmax", anchors, same, dims, weights, scale, replace(targets, columns=True), None, **one)
        reverse = None
    else:
        same = candidates.to(anchors.dtype)
        loss = prefix_pass("softmax", anchors, same, dims, weights, scale, targets, scale_t, **one)
    if reverse is not None:
        flipped = reverse.to(anchors.dtype)
        loss = 0.5 * (loss + prefix_pass("softmax", flipped, anchors, dims, weights, scale, targets, scale_t, **one))
    if factor != 1.0:
        loss = loss * factor
    if named is not None:
        name_non_finite(loss, named, tau if isinstance(tau, Tensor) else None)
    return loss


def name_non_finite(loss: Tensor, named: list[tuple[str, Tensor]], tau: Tensor | None = None) -> None:
    """One host read: a non-finite loss raises ``ValueError`` naming the first non-finite input; with a tensor
    temperature, one that is not positive and finite is named instead (read in the same transfer)."""
    if torch.compiler.is_compiling():
        return
    finite = torch.isfinite(loss.detach()).all()
    if tau is None:
        ok, tau_ok = bool(finite), True
    else:
        t = tau.detach()
        ok, tau_ok = (bool(f) for f in torch.stack([finite, torch.isfinite(t) & (t > 0)]).tolist())
    if not tau_ok:
        raise ValueError(f"temperature must be positive and finite, got {float(tau.detach())}")  # type: ignore[union-attr]
    if not ok:
        for name, t in named:
            if t.numel() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} has non-finite values (NaN or inf)")


def default_of(fn: Callable[..., Tensor], name: str) -> Any:
    return inspect.signature(fn).parameters[name].default


def _scalar(value: object, device: torch.device) -> Tensor | None:
    """A float or 0-dim floating tensor as a 0-dim tensor (kept as given when a tensor); None otherwise."""
    if isinstance(value, Tensor):
        return value if value.ndim == 0 and value.is_floating_point() else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float64, device=device)
    return None


def shared_options(kwargs: dict[str, Any]) -> tuple[int | None, str, Scope] | None:
    """``(strip rows, reduction, the call's scope)`` from the shared options of a soft-max loss's call, checked
    as the loss checks them (the same errors, the same warning for ``gather=False`` among several ranks); None
    where the one pass does not compute that call: a kernel backend, or a floor ``eps >= 1`` (which would
    shrink the unit prefixes). ``normalize`` changes nothing here: every prefix arrives normalised (as
    :func:`shrink` gives it)."""
    given = {name: kwargs[name] for name in SHARED if name in kwargs}
    options = shared(**given)
    if options.backend not in ("auto", "torch") or options.eps >= 1.0:
        return None
    # the warning names the caller of matryoshka_loss (-> _one_pass -> here -> make_scope)
    return options.chunk_size, options.reduction, make_scope(options.gather, options.grad_reduction, stacklevel=5)


#: Anchor rows per block when the positives of a gathered batch are counted (a bounded mask).
_COUNT_ROWS = 1024


def _softmax_form(loss_fn: Callable[..., Tensor], tensors: list[Tensor], kwargs: dict[str, Any],
                  keys: set[str]) -> tuple[Tensor, Tensor, Targets, bool] | None:
    """``(anchors, candidates, targets, symmetric)`` of a soft-max loss's call (``keys``: its arguments
    besides the temperature and the shared options), or None."""
    from . import image_text_contrastive_loss, info_nce_loss, nt_xent_loss, supcon_loss

    two_d = all(t.ndim == 2 for t in tensors)
    if loss_fn is image_text_contrastive_loss and len(tensors) == 2 and two_d:
        return _image_text_form(tensors, kwargs, keys)
    if loss_fn is info_nce_loss and len(tensors) in (2, 3) and two_d:
        return info_nce_form(tensors, kwargs, keys)
    if loss_fn is nt_xent_loss and keys <= {"pairing", "decoupled"} and len(tensors) == 1 and two_d and tensors[0].shape[0] % 2 == 0:
        pairing, n = kwargs.get("pairing", default_of(nt_xent_loss, "pairing")), tensors[0].shape[0]
        decoupled = kwargs.get("decoupled", False)
        rows = torch.arange(n, device=tensors[0].device)
        partner = {"adjacent": rows ^ 1, "halves": (rows + n // 2) % n}.get(pairing)
        if partner is None or not isinstance(decoupled, bool):
            return None  # let the loss refuse it
        return tensors[0], tensors[0], Targets(partner=partner, exclude_self=True, exclude_positive=decoupled), False
    if loss_fn is supcon_loss and keys <= {"labels", "mask", "contrast_mode", *_EXTRA_ROWS} and len(tensors) == 1 \
            and tensors[0].ndim in (2, 3):
        features, labels, mask = tensors[0], kwargs.get("labels"), kwargs.get("mask")
        if (labels is None and mask is None and features.ndim == 2) or (labels is not None and mask is not None):
            return None  # no positives to find, or two relations: let the loss say so
        mode = kwargs.get("contrast_mode", "all")
        if mode != "all" and (mode != "one" or keys & set(_EXTRA_ROWS)):
            return None  # the loss refuses an unknown mode; "one" with extra rows goes per prefix
        bsz = features.shape[0]
        if mask is not None:
            return None if keys & set(_EXTRA_ROWS) else _sample_mask_form(features, mask, kwargs.get("validate", True), mode == "one")
        key = v.check_labels(labels, "labels", bsz, features.device) if labels is not None else torch.arange(bsz, device=features.device)
        views = 1 if features.ndim == 2 else features.shape[1]
        z = features if features.ndim == 2 else torch.cat(torch.unbind(features, 1))  # view-major, as the authors
        keys_all = key.repeat(views)
        if keys & set(_EXTRA_ROWS):
            return _extra_rows_form(z, keys_all, kwargs, labels is not None)
        if mode == "one":  # the authors' "one": the first view's rows are the anchors, every view a candidate
            return z[:bsz], z, Targets(row_keys=keys_all[:bsz], col_keys=keys_all, exclude_self=True), False
        return z, z, Targets(row_keys=keys_all, col_keys=keys_all, exclude_self=True), False
    return None


def weighted_form(loss_fn: Callable[..., Tensor], tensors: list[Tensor], kwargs: dict[str, Any],
                   keys: set[str]) -> tuple[tuple[Tensor, Tensor, Targets, bool], Any] | None:
    """:func:`_softmax_form` and NT-Xent's ``positive_weight`` beside it (None without one; a weight needs one
    positive per anchor), or None."""
    from . import nt_xent_loss

    given = kwargs.get("positive_weight") if loss_fn is nt_xent_loss else None
    form = _softmax_form(loss_fn, tensors, kwargs, keys - {"positive_weight"} if loss_fn is nt_xent_loss else keys)
    if form is None or (given is not None and form[2].partner is None):
        return None
    return form, given


#: InfoNCE's arguments the one pass takes (the ones the loss's false-negative rules read, and the candidates' groups).
_INFO_NCE = {"key_ids", "negative_ids", "guide", "guide_margin", "guide_margin_mode", "decoupled", "in_batch_negatives",
             "negative_mode", "label_smoothing", "gather_negatives"}


def info_nce_form(tensors: list[Tensor], kwargs: dict[str, Any], keys: set[str],
                   scope: Scope | None = None) -> tuple[Tensor, Tensor, Targets, bool] | None:
    """InfoNCE: query ``i`` against the keys, then the pool of negatives, key ``i`` its positive; the false negatives
    the loss's rules name (duplicate ids, a guide's verdict -- the guide at its full width --, the other keys with
    ``in_batch_negatives=False``) leave the soft-max, DCL's positive too; label smoothing over the keys alone. None
    for paired negatives and what the loss refuses (it then says why). ``scope`` among several ranks (``gather``):
    this rank's queries against every rank's keys and -- as ``gather_negatives`` says -- negatives, gathered with their
    gradients as the loss gathers them, the rules' ids and guide rows gathered with them, key ``i`` at its global
    column; label smoothing over every rank's keys (:mod:`.prefix_gather` gives it their count)."""
    from ..positives import Exclusion, Positives
    from ._false_negatives import false_negative_rules, key_exclusion, pool_exclusion

    if not keys <= _INFO_NCE or kwargs.get("negative_mode", "unpaired") != "unpaired":
        return None
    query, key = tensors[0], tensors[1]
    negatives = tensors[2].to(key.dtype) if len(tensors) == 3 else None
    in_batch, n = kwargs.get("in_batch_negatives", True), query.shape[0]
    smoothing = v.check_fraction(kwargs.get("label_smoothing", 0.0), "label_smoothing")
    spread = kwargs.get("gather_negatives")
    if not isinstance(in_batch, bool) or key.shape[0] != n or (not in_batch and negatives is None) or \
            not (spread is None or isinstance(spread, bool)):
        return None  # let the loss refuse it
    checks = v.Checks(v.check_flag(kwargs.get("validate", True), "validate"))
    rules = false_negative_rules(query, negatives, False, kwargs.get("key_ids"), kwargs.get("negative_ids"), kwargs.get("guide"),
                                 kwargs.get("guide_margin", 0.0), kwargs.get("guide_margin_mode", "absolute"),
                                 kwargs.get("decoupled", False), float(kwargs.get("eps", 1e-12)), checks)
    checks.flush()
    scope = scope or Scope()  # one process: the call's own rows
    if smoothing and (rules.any or negatives is not None or not in_batch):
        return None  # smoothing over the keys alone here; the loss refuses it with the rules
    spread = scope.distributed and (spread is None or spread)  # gather_negatives defaults to gather
    keys_all = scope.rows(key)  # every rank's keys (this rank's own on one process); the offset is known from here
    pool = None if negatives is None else all_gather_with_grad(negatives) if spread else negatives
    total = keys_all.shape[0]
    # DCL's positive leaves through the targets; the exclusions keep it
    kept = replace(rules, decoupled=False)
    key_group = key_exclusion(kept, scope)
    if not in_batch:  # every other key leaves: all pairs "equal", the positive (global column offset + i) kept
        zeros = torch.zeros(total, dtype=torch.int64, device=query.device)
        key_group = Exclusion(relation=Positives.from_keys(zeros[:n], zeros, self_offset=None), keep_diagonal=scope.offset)
    groups = [(0, total, key_group)]
    if pool is not None:
        groups.append((total, total + pool.shape[0], pool_exclusion(kept, spread, scope)))
    candidates = keys_all if pool is None else torch.cat([keys_all, pool])
    leave_out = tuple((first, end, ex) for first, end, ex in groups if ex is not None)
    return query, candidates, Targets(exclude_positive=rules.decoupled, smoothing=smoothing, leave_out=leave_out,
                                      offset=scope.offset), False


#: The keyword arguments that carry rows of features besides the embeddings (a memory, a reference set):
#: cut to each prefix like the embeddings.
_EXTRA_ROWS = ("memory_emb", "memory_labels", "ref_emb", "ref_labels")


def _extra_rows_form(z: Tensor, keys: Tensor, kwargs: dict[str, Any], labelled: bool) -> tuple[Tensor, Tensor, Targets, bool] | None:
    """SupCon with a memory (its rows extra candidates after the batch, positives by label, the self pairs
    left out) or a reference set (its rows the only candidates, no self pair), checked as the loss checks them;
    None where the loss refuses the call (it then says why)."""
    if not labelled or (kwargs.get("gather", False) and kwargs.get("ref_emb") is not None):
        return None  # (the loss refuses a reference set with gather=True)
    checks = v.Checks(v.check_flag(kwargs.get("validate", True), "validate"))
    candidates, col_keys, own = _extra_candidates(z, keys, kwargs, checks)
    checks.flush()
    return z, candidates, Targets(row_keys=keys, col_keys=keys if col_keys is None else col_keys, exclude_self=own is not None), False


def _sample_mask_form(features: Tensor, mask: object, validate: object, one: bool = False) -> tuple[Tensor, Tensor, Targets, bool]:
    """SupCon with the authors' ``mask`` over samples (bsz, bsz): each view of sample ``b`` has the views of the
    samples ``mask[b]`` marks as positives, itself left out; ``one`` (``contrast_mode="one"``): the first view's rows
    are the anchors (sample ``b``'s is row ``b``). A 0/1 float mask is checked as the loss checks it."""
    bsz = features.shape[0]
    checks = v.Checks(v.check_flag(validate, "validate"))
    bool_mask = v.check_mask(mask, bsz, features.device, checks)
    checks.flush()
    z = features if features.ndim == 2 else torch.cat(torch.unbind(features, 1))  # view-major, as the authors
    spread = bool_mask[:, torch.arange(z.shape[0], device=z.device) % bsz]  # (bsz, M): sample b's positive columns
    return z[:bsz] if one else z, z, Targets(sample_mask=spread, exclude_self=True), False


def _image_text_form(tensors: list[Tensor], kwargs: dict[str, Any], keys: set[str]) -> tuple[Tensor, Tensor, Targets, bool] | None:
    """CLIP's two directions: the diagonal positives, DCL's excluded diagonal, or duplicates by ids (an image
    and a text are positives when their image ids or their text ids match; a missing id tensor: every image,
    or text, distinct) with the loss normalised by the positive pairs."""
    if not keys <= {"image_id", "text_id", "decoupled", "label_smoothing"}:
        return None
    images, texts = tensors
    if images.shape[0] != texts.shape[0]:
        return None  # let the loss say so
    n, device = images.shape[0], images.device
    decoupled = kwargs.get("decoupled", False)
    smoothing = v.check_fraction(kwargs.get("label_smoothing", 0.0), "label_smoothing")
    ids = [kwargs.get(name) for name in ("image_id", "text_id")]
    if not isinstance(decoupled, bool) or (decoupled and smoothing):
        return None  # let the loss refuse it
    if all(i is None for i in ids):
        return images, texts, Targets(exclude_positive=decoupled, smoothing=smoothing), True
    own = torch.arange(n, device=device)  # a missing id tensor: every row its own id
    keys_given = tuple(own if i is None else v.check_labels(i, name, n, device) for i, name in zip(ids, ("image_id", "text_id")))
    return images, texts, Targets(row_keys=keys_given, col_keys=keys_given, by_pairs=True, exclude_positive=decoupled,
                                  smoothing=smoothing), True


def pair_form(binary: bool, tensors: list[Tensor], kwargs: dict[str, Any], keys: set[str], tau: float | Tensor,
               chunk: int | None, reduction: str, scope: Scope) -> OnePass | None:
    """The label conventions scored pair by pair (:class:`~torch_contrastive.engine.prefix_pairs.PrefixPairs`):
    pytorch-metric-learning's NT-Xent (``nt_xent_loss(labels=...)``) and NT-BXent (``nt_bxent_loss(labels=...)``),
    a single (N, D) set, NT-BXent also by its listed ``pos_indices``, PML's NT-Xent also with a memory (its rows
    extra candidates) or a reference set (the only candidates); by labels also under ``gather=True`` among several
    ranks (this rank's rows against every rank's, the labels gathered, the global count through
    :meth:`~torch_contrastive.distributed.Scope.finish`); None for anything else (one call per prefix)."""
    extra = set() if binary else set(_EXTRA_ROWS)
    if not ({"labels"} <= keys <= {"labels", *extra} or (binary and keys == {"pos_indices"})) or len(tensors) != 1 \
            or tensors[0].ndim != 2:
        return None
    x = tensors[0]
    # the value checks (an index range, a memory's or reference set's rows) read now, as the loss reads them
    checks = v.Checks(v.check_flag(kwargs.get("validate", True), "validate"))
    candidates: Tensor = x
    col_labels: Tensor | None = None
    own: int | None = 0  # the column of row 0 among the candidates (None: no candidate is a row)
    if kwargs.get("gather", False) and keys & {"ref_emb", "ref_labels"}:
        return None  # the loss refuses a reference set with gather=True: let it say so
    if "pos_indices" in keys:
        labels = v.check_pos_indices(kwargs["pos_indices"], x.shape[0], x.device, checks)
    else:
        labels = v.check_labels(kwargs["labels"], "labels", x.shape[0], x.device)
    if keys & extra:
        candidates, col_labels, own = _extra_candidates(x, labels, kwargs, checks)
    checks.flush()
    kernel = "binary" if binary else "pair_softplus"
    gathered = scope.distributed
    mean, per_row = reduction == "mean" and not gathered, reduction == "none"
    normaliser: Tensor | float = 1.0
    if gathered:  # this rank's rows against the gathered batch, each row's own column at the rank's offset
        memory = candidates[x.shape[0]:]  # a memory's rows follow the batch: this rank's own, not gathered (as the loss)
        candidates = scope.rows(x) if memory.shape[0] == 0 else torch.cat([scope.rows(x), memory])
        own = scope.offset
        if "pos_indices" in keys:  # this rank's listed pairs, their columns among every rank's rows
            labels = labels + torch.tensor([0, own], device=labels.device)
        else:
            col_labels = scope.ints(labels) if col_labels is None else torch.cat([scope.ints(labels), col_labels[x.shape[0]:]])
        if reduction == "mean":  # the positive pairs (PML) or the rows (NT-BXent) of this rank
            # PML: the positive pairs, same-label columns but the row's own, as the soft-max forms count them
            normaliser = float(x.shape[0]) if binary else counted_positives(Targets(
                row_keys=labels, col_keys=col_labels, exclude_self=True, offset=own), x, by_pairs=True)

    # a tensor (learnable) temperature: the cosines are the plan's logits and 1 / tau multiplies them inside
    scale_t = 1.0 / tau if isinstance(tau, Tensor) else None

    def pairs(dims: list[int], weights: list[float], named: list[tuple[str, Tensor]] | None) -> Tensor:
        scale = 1.0 if isinstance(tau, Tensor) else 1.0 / tau
        loss = prefix_pass("pairs", x, candidates, dims, weights, scale, labels, kernel, scale_t, col_labels, own,
                           chunk_size=chunk, mean=mean, per_row=per_row)
        if gathered and not per_row:
            loss = scope.finish(loss, normaliser)
        if named is not None:
            name_non_finite(loss, named, tau if isinstance(tau, Tensor) else None)
        return loss

    return pairs


def _extra_candidates(x: Tensor, labels: Tensor, kwargs: dict[str, Any],
                      checks: v.Checks) -> tuple[Tensor, Tensor | None, int | None]:
    """``(candidates, their labels, the column of row 0 among them)`` of a labelled loss (SupCon, PML's NT-Xent) with
    a memory (its rows after the batch) or a reference set (the only candidates: no row's own column; None), checked
    as the losses check them; the batch itself (labels None: the rows') without either."""
    memory = v.check_memory(kwargs.get("memory_emb"), kwargs.get("memory_labels"), x.shape[1], x.device, checks)
    reference = check_reference(kwargs.get("ref_emb"), kwargs.get("ref_labels"), labels, x.shape[1], x.device, checks,
                                False, memory)
    if reference is not None:
        return reference[0].to(x.dtype), reference[1], None
    if memory is not None:
        return torch.cat([x, memory[0].to(x.dtype)]), torch.cat([labels, memory[1]]), 0
    return x, None, 0


def sigmoid_form(tensors: list[Tensor], kwargs: dict[str, Any], keys: set[str]) -> OnePass | None:
    """SigLIP's sigmoid pairs: two paired sets, a float or 0-dim tensor scale and bias, the diagonal positives or
    (``image_id`` / ``text_id``) every pair whose ids match, as the image-text loss relates them; ``reduction``
    "mean" (over the images) or "sum", and under ``gather=True`` among several ranks this rank's images against
    every rank's texts, as the loss gathers them; ``negative_only=True`` (open_clip's exchanged blocks: every pair a
    negative) as keys that never match."""
    if not {"logit_scale", "logit_bias"} <= keys <= {"logit_scale", "logit_bias", "image_id", "text_id", "negative_only"} \
            or len(tensors) != 2 or any(t.ndim != 2 for t in tensors) or tensors[0].shape[0] != tensors[1].shape[0]:
        return None
    negative_only = kwargs.get("negative_only", False)
    if not isinstance(negative_only, bool) or (negative_only and keys & {"image_id", "text_id"}):
        return None  # let the loss refuse it
    t, b = (_scalar(kwargs[name], tensors[0].device) for name in ("logit_scale", "logit_bias"))
    options = shared_options(kwargs)
    if t is None or b is None or options is None or options[1] == "none":
        return None  # let the loss refuse it, or take it per prefix (per-row values)
    chunk, reduction, scope = options
    scale, bias = t, b
    images, texts = tensors[0], tensors[1].to(tensors[0].dtype)
    form = _image_text_form(tensors, kwargs, keys & {"image_id", "text_id"})
    targets = Targets() if form is None else form[2]
    if scope.distributed:
        texts = scope.rows(texts)
        targets = spread_targets(global_ids(targets, kwargs, scope), scope)
    n = images.shape[0]
    if negative_only:  # no pair is a positive: row keys 0 against column keys 1
        zeros = torch.zeros(n, dtype=torch.long, device=images.device)
        targets = Targets(row_keys=zeros, col_keys=torch.ones(texts.shape[0], dtype=torch.long, device=images.device))

    def sigmoid(dims: list[int], weights: list[float], named: list[tuple[str, Tensor]] | None) -> Tensor:
        mean = reduction == "mean" and not scope.distributed
        loss = prefix_pass("sigmoid", images, texts, dims, weights, 1.0, scale, bias, targets, chunk_size=chunk, mean=mean)
        if scope.distributed:  # the global sum over all pairs, over the global number of images for "mean"
            loss = scope.finish(loss, float(n) if reduction == "mean" else 1.0)
        if named is not None:
            name_non_finite(loss, named)
        return loss

    return sigmoid


def global_ids(targets: Targets, kwargs: dict[str, Any], scope: Scope) -> Targets:
    """An image-text relation by ids with a missing id tensor (every row its own id, ``arange``) made global: this
    rank's rows' own ids shifted by its offset, so that they match no other rank's."""
    if not isinstance(targets.row_keys, tuple):
        return targets
    ids = tuple(k + scope.offset if kwargs.get(name) is None else k for k, name in zip(targets.row_keys, ("image_id", "text_id")))
    return replace(targets, row_keys=ids)


def one_key(keys: Tensor | tuple[Tensor, ...] | None) -> Tensor:
    """One key tensor (SupCon's), refused as anything else."""
    if not isinstance(keys, Tensor):
        raise RuntimeError("internal: one key tensor expected")
    return keys


def spread_targets(targets: Targets, scope: Scope) -> Targets:
    """``targets`` of this rank's anchors against the gathered candidates: the columns' keys gathered, the
    anchors' own columns from this rank's offset."""
    if targets.row_keys is None:
        return replace(targets, offset=scope.offset)
    cols = tuple(scope.ints(k) for k in targets.row_keys) if isinstance(targets.row_keys, tuple) else scope.ints(targets.row_keys)
    return replace(targets, col_keys=cols, offset=scope.offset)


def counted_positives(targets: Targets, anchors: Tensor, *, by_pairs: bool) -> Tensor | float:
    """This rank's share of the loss's denominator: its anchors (one positive each), its positive pairs
    (``by_pairs``, CLIP's ids) or its anchors with a positive (SupCon), in the loss's dtype."""
    counts = targets.positives(anchors.shape[0], _COUNT_ROWS, anchors.device)
    if counts is None:
        return float(anchors.shape[0])
    return (counts if by_pairs else counts > 0).sum().to(compute_dtype(anchors.dtype))
