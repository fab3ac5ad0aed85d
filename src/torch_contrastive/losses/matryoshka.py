"""Matryoshka InfoNCE: the in-batch soft-max loss summed over prefixes of the embedding, in one pass.

Matryoshka Representation Learning (Kusupati et al. 2022, arXiv:2205.13147) trains an embedding whose
first ``d`` features are themselves a good embedding, for every ``d`` in a list (768, 512, 256, 128, 64):
the loss is ``sum_p w_p * L(X[:, :d_p] normalised, ...)``. sentence-transformers' ``MatryoshkaLoss``
calls its inner loss once per prefix; here every prefix comes out of one pass over the feature bands
(:mod:`torch_contrastive.engine.prefixes`): the products cost ``D`` per pair, not ``sum(d_p)``.

:func:`matryoshka_loss` wraps any loss of this library (or any function of embeddings) the plain way,
one call per prefix; :func:`matryoshka_info_nce_loss` is the one-pass form of the in-batch soft-max
family. Its loss is MultipleNegativesRankingLoss's (InfoNCE with in-batch negatives, van den Oord et al. 2018):
row ``i`` of ``query`` has ``key[i]`` as its positive and every other key and every row of
``negatives`` as negatives; ``symmetric=True`` averages it with the reverse direction (key ``i``
against every query: sentence-transformers' ``MultipleNegativesSymmetricRankingLoss``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from .. import _validation as v
from ..distributed import Scope, all_gather_with_grad, make_scope
from ..engine.precision import compute_dtype
from ..engine.prefix_pairs import PrefixPairs
from ..engine.prefix_sigmoid import PrefixSigmoid
from ..engine.prefixes import COLUMN_SCALE_LIMIT, PrefixSoftmax, Targets, prefix_plan
from ..options import shared
from ._labelled import check_reference
from .prefix_calls import check_prefixes, one_per_prefix, prefix_sum, prefix_term, refuse_shared_state
from .prefix_weights import PositiveWeights


def matryoshka_info_nce_loss(query: Tensor, key: Tensor, matryoshka_dims: Sequence[int],
                             matryoshka_weights: Sequence[float] | None = None, temperature: float = 0.05, *,
                             negatives: Tensor | None = None, symmetric: bool = False, eps: float = 1e-12,
                             chunk_size: int | None = None, validate: bool = True) -> Tensor:
    """``sum_p w_p * InfoNCE(query[:, :d_p], key[:, :d_p], negatives[:, :d_p])``, each prefix L2-normalised
    on its own, from one pass over the features.

    Args:
        query: (N, D) anchors.
        key: (N, D) positives: row ``i`` is query ``i``'s.
        matryoshka_dims: prefix sizes ``d_p <= D`` (any order; a size listed twice counts twice).
        matryoshka_weights: one weight per dim (None: all 1).
        temperature: tau of every prefix (sentence-transformers' scale 20 is tau 0.05).
        negatives: (K, D) hard negatives shared by every query (sentence-transformers' negative
            columns, stacked), or None.
        symmetric: average with the key-to-query direction (each key against every query).
        eps: the normalisation floor, ``x / max(||x||, eps)`` per prefix.
        chunk_size: anchor rows per strip (None: strips of about 64 MiB of tiles).
        validate: read the loss once on the host and raise ``ValueError`` naming a non-finite input
            (False: no host sync; a non-finite input gives a non-finite loss).

    Returns:
        0-dim loss (fp32 for half inputs), the mean over rows of each prefix's loss, weighted and summed.

    Memory: O((N + K) D) plus one strip's tiles (a running sum and one tile per distinct prefix);
    the products cost ``D`` per pair forward and backward, whatever the number of prefixes.
    """
    q = v.check_embeddings(query, "query")
    k = v.check_embeddings(key, "key")
    v.check_same_rows(q, "query", k, "key")
    candidates = k
    if negatives is not None:
        neg = v.check_embeddings(negatives, "negatives", empty_rows=True)
        v.check_same_device(neg, "negatives", q.device, "query")
        if neg.shape[1] != q.shape[1]:
            raise ValueError(f"negatives must have feature size {q.shape[1]} (as query), got {neg.shape[1]}")
        candidates = torch.cat([k, neg.to(k.dtype)])
    dims, weights = check_prefixes(matryoshka_dims, matryoshka_weights, q.shape[1])
    tau = v.check_positive(temperature, "temperature")
    symmetric = v.check_flag(symmetric, "symmetric")
    validate = v.check_flag(validate, "validate")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive float, got {eps!r}")
    chunk = v.check_chunk_size(chunk_size)
    named = [("query", q), ("key", k), *((("negatives", negatives),) if negatives is not None else ())]
    return one_pass_softmax(q, candidates, Targets(), dims, weights, tau, k if symmetric else None, float(eps), chunk,
                          named if validate else None)


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
    width = anchors.shape[-1]
    # a tensor (learnable) scale multiplies the cosines inside: the plan's scale is then 1
    scale_t = 1.0 / tau if isinstance(tau, Tensor) else None
    scale = 1.0 if isinstance(tau, Tensor) else 1.0 / tau
    plan = prefix_plan(dims, weights, width, scale, True, eps, anchors.shape[0], candidates.shape[0], chunk, mean, per_row)
    if reverse is candidates and scale_t is None and scale <= COLUMN_SCALE_LIMIT[compute_dtype(anchors.dtype)]:
        # the candidates' direction from the same tiles (CLIP): one product pass for both directions
        loss = PrefixSoftmax.apply(anchors, candidates.to(anchors.dtype), plan, replace(targets, columns=True), None)
        reverse = None
    else:
        loss = PrefixSoftmax.apply(anchors, candidates.to(anchors.dtype), plan, targets, scale_t)
    if reverse is not None:
        back = prefix_plan(dims, weights, width, scale, True, eps, reverse.shape[0], anchors.shape[0], chunk, mean, per_row)
        loss = 0.5 * (loss + PrefixSoftmax.apply(reverse.to(anchors.dtype), anchors, back, targets, scale_t))
    if factor != 1.0:
        loss = loss * factor
    if named is not None:
        _name_non_finite(loss, named, tau if isinstance(tau, Tensor) else None)
    return loss


def _name_non_finite(loss: Tensor, named: list[tuple[str, Tensor]], tau: Tensor | None = None) -> None:
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


def _default(fn: Callable[..., Tensor], name: str) -> Any:
    return inspect.signature(fn).parameters[name].default


def _scalar(value: object, device: torch.device) -> Tensor | None:
    """A float or 0-dim floating tensor as a 0-dim tensor (kept as given when a tensor); None otherwise."""
    if isinstance(value, Tensor):
        return value if value.ndim == 0 and value.is_floating_point() else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float64, device=device)
    return None


#: Runs a one-pass form: ``(dims, weights, inputs to name when the loss is not finite, or None)`` -> the loss.
OnePass = Callable[[list[int], list[float], "list[tuple[str, Tensor]] | None"], Tensor]


#: The shared options (:mod:`torch_contrastive.options`) the soft-max one pass honours itself.
_SHARED = ("normalize", "reduction", "chunk_size", "gather", "grad_reduction", "eps", "validate", "backend")


def _one_pass(loss_fn: Callable[..., Tensor], tensors: list[Tensor], kwargs: dict[str, Any]) -> OnePass | None:
    """The one-pass form of ``loss_fn(*tensors, **kwargs)`` when the prefix engine computes the call exactly
    (``validate`` is honoured by the caller); None otherwise."""
    from . import image_text_contrastive_loss, info_nce_loss, nt_bxent_loss, nt_xent_loss, siglip_loss, supcon_loss

    if loss_fn is siglip_loss:
        return _sigmoid_form(tensors, kwargs, set(kwargs) - set(_SHARED))
    if loss_fn not in (image_text_contrastive_loss, info_nce_loss, nt_xent_loss, supcon_loss, nt_bxent_loss):
        return None
    tau = kwargs.get("temperature", _default(loss_fn, "temperature"))
    if isinstance(tau, bool) or not isinstance(tau, (int, float, Tensor)) or \
            (isinstance(tau, Tensor) and (tau.numel() != 1 or not tau.is_floating_point())):
        return None  # let the loss refuse it
    options = _shared_options(kwargs)
    if options is None:
        return None
    chunk, reduction, scope = options
    mean, per_row = reduction == "mean", reduction == "none"
    pairs = loss_fn is nt_bxent_loss or (kwargs.get("labels") is not None and loss_fn is nt_xent_loss)
    if pairs:
        return _pair_form(loss_fn is nt_bxent_loss, tensors, kwargs, set(kwargs) - {"temperature", *_SHARED},
                          tau.reshape(()) if isinstance(tau, Tensor) else v.check_positive(tau, "temperature"), chunk,
                          reduction, scope)
    keys = set(kwargs) - {"temperature", *_SHARED}
    if scope.distributed:
        return _gathered(loss_fn, tensors, kwargs, keys, tau, scope, chunk, reduction)
    given_weight = kwargs.get("positive_weight") if loss_fn is nt_xent_loss else None
    form = _softmax_form(loss_fn, tensors, kwargs, keys - {"positive_weight"} if loss_fn is nt_xent_loss else keys)
    if form is None or (given_weight is not None and form[2].partner is None):
        return None
    anchors, candidates, targets, symmetric = form
    tau = tau.reshape(()) if isinstance(tau, Tensor) else v.check_positive(tau, "temperature")
    # CLIP's "sum" is N times its mean (its ids normalise by the positive pairs); the others sum their rows
    times_rows = loss_fn is image_text_contrastive_loss and reduction == "sum"
    weighted = None if given_weight is None or targets.partner is None else \
        PositiveWeights(given_weight, anchors, candidates, targets.partner, reduction)  # NT-Xent's positive terms weighted (DCLW)

    def run(dims: list[int], weights: list[float], named: list[tuple[str, Tensor]] | None) -> Tensor:
        values = None if weighted is None else weighted.of(dims)
        loss = one_pass_softmax(anchors, candidates, targets if weighted is None or values is None else weighted.targets(targets, values, dims),
                                dims, weights, tau, candidates if symmetric else None, 1e-12, chunk, named,
                                mean=mean or times_rows, per_row=per_row, factor=float(anchors.shape[0]) if times_rows else 1.0)
        own = None if weighted is None or values is None else weighted.gradient_term(values, dims, weights, tau)
        return loss if own is None else loss + own

    return run


def _pair_form(binary: bool, tensors: list[Tensor], kwargs: dict[str, Any], keys: set[str], tau: float | Tensor,
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
            normaliser = float(x.shape[0]) if binary else _counted(Targets(
                row_keys=labels, col_keys=col_labels, exclude_self=True, offset=own), x, by_pairs=True)

    # a tensor (learnable) temperature: the cosines are the plan's logits and 1 / tau multiplies them inside
    scale_t = 1.0 / tau if isinstance(tau, Tensor) else None

    def pairs(dims: list[int], weights: list[float], named: list[tuple[str, Tensor]] | None) -> Tensor:
        scale = 1.0 if isinstance(tau, Tensor) else 1.0 / tau
        plan = prefix_plan(dims, weights, x.shape[-1], scale, True, 1e-12, x.shape[0], candidates.shape[0], chunk, mean, per_row)
        loss = PrefixPairs.apply(x, candidates, plan, labels, kernel, scale_t, col_labels, own)
        if gathered and not per_row:
            loss = scope.finish(loss, normaliser)
        if named is not None:
            _name_non_finite(loss, named, tau if isinstance(tau, Tensor) else None)
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


def _shared_options(kwargs: dict[str, Any]) -> tuple[int | None, str, Scope] | None:
    """``(strip rows, reduction, the call's scope)`` from the shared options of a soft-max loss's call, checked
    as the loss checks them (the same errors, the same warning for ``gather=False`` among several ranks); None
    where the one pass does not compute that call: a kernel backend, or a floor ``eps >= 1`` (which would
    shrink the unit prefixes). ``normalize`` changes nothing here: every prefix arrives normalised (as
    :func:`shrink` gives it)."""
    given = {name: kwargs[name] for name in _SHARED if name in kwargs}
    options = shared(**given)
    if options.backend not in ("auto", "torch") or options.eps >= 1.0:
        return None
    # the warning names the caller of matryoshka_loss (-> _one_pass -> here -> make_scope)
    return options.chunk_size, options.reduction, make_scope(options.gather, options.grad_reduction, stacklevel=5)


#: Anchor rows per block when the positives of a gathered batch are counted (a bounded mask).
_COUNT_ROWS = 1024


def _gathered(loss_fn: Callable[..., Tensor], tensors: list[Tensor], kwargs: dict[str, Any], keys: set[str],
              tau: float | Tensor, scope: Scope, chunk: int | None, reduction: str) -> OnePass | None:
    """The soft-max forms under ``gather=True`` among several ranks, as the losses gather: this rank's anchors
    against every rank's candidates (gathered with their gradients, rank-ordered), each anchor's positive and
    self at its global column; CLIP's two directions as two passes (local images against every text, local
    texts against every image). Each rank sums its anchors' terms and :meth:`~torch_contrastive.distributed.Scope.finish`
    divides by the global count (``grad_reduction`` as the losses apply it); ``reduction="none"``: this rank's
    anchors' values. None for a sample mask (which the loss refuses with ``gather=True``)."""
    from . import image_text_contrastive_loss, nt_xent_loss

    given_weight = kwargs.get("positive_weight") if loss_fn is nt_xent_loss else None
    form = _softmax_form(loss_fn, tensors, kwargs, keys - {"positive_weight"} if loss_fn is nt_xent_loss else keys)
    if form is None or form[2].sample_mask is not None or (given_weight is not None and form[2].partner is None):
        return None  # (a mask relates this rank's samples only: the loss refuses it with gather=True)
    anchors, candidates, targets, _ = form
    temperature = tau.reshape(()) if isinstance(tau, Tensor) else v.check_positive(tau, "temperature")
    if loss_fn is image_text_contrastive_loss:
        images, texts = tensors[0], tensors[1].to(tensors[0].dtype)
        all_texts, all_images = scope.rows(texts), scope.rows(images)
        # gt is symmetric in the pairs: one relation serves both directions (row j's keys are pair j's)
        targets = _spread(_global_ids(targets, kwargs, scope), scope)
        normaliser = _counted(targets, anchors, by_pairs=True)
        if targets.smoothing:  # the uniform part's G and N are every rank's
            local = normaliser if isinstance(normaliser, Tensor) else anchors.new_tensor(normaliser)
            targets = replace(targets, population=(scope.total(local), int(sum(scope.sizes))))
        directions = [(images, all_texts, targets), (texts, all_images, targets)]
        factor = 0.5 * (float(sum(scope.sizes)) if reduction == "sum" else 1.0)  # CLIP's sum: N_all times its mean
    else:
        pool, targets = _gathered_candidates(loss_fn, tensors, kwargs, anchors, candidates, targets, scope)
        directions = [(anchors, pool, targets)]
        normaliser = _counted(targets, anchors, by_pairs=False) if reduction == "mean" else 1.0
        factor = 1.0
    # NT-Xent's weighted positive terms (DCLW): this rank's rows' weights, their own gradient summed here and
    # reduced over the ranks with the loss
    weighted = None if given_weight is None or targets.partner is None else \
        PositiveWeights(given_weight, anchors, directions[0][1], targets.partner, "none" if reduction == "none" else "sum")

    def run(dims: list[int], weights: list[float], named: list[tuple[str, Tensor]] | None) -> Tensor:
        per_row = reduction == "none"  # this rank's anchors' values
        values = None if weighted is None else weighted.of(dims)
        first = directions[0] if weighted is None or values is None else \
            (*directions[0][:2], weighted.targets(directions[0][2], values, dims))
        local = one_pass_softmax(*first, dims, weights, temperature, None, 1e-12, chunk, None, mean=False, per_row=per_row)
        own = None if weighted is None or values is None else weighted.gradient_term(values, dims, weights, temperature)
        local = local if own is None else local + own
        for a, c, t in directions[1:]:
            local = local + one_pass_softmax(a, c, t, dims, weights, temperature, None, 1e-12, chunk, None, mean=False, per_row=per_row)
        if per_row and len(directions) == 2:  # CLIP's rows: e_i with mean(e) the loss over every rank's rows
            local = local * _clip_rows_factor(targets, anchors, scope)
        loss = local if per_row else scope.finish(local * factor, normaliser)
        if named is not None:
            _name_non_finite(loss, named, temperature if isinstance(temperature, Tensor) else None)
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
    return pool, _spread(targets, scope)


def _gathered_supcon(kwargs: dict[str, Any], candidates: Tensor, targets: Targets, scope: Scope) -> tuple[Tensor, Targets]:
    """SupCon under ``gather``: every rank's rows, all views (each rank's view-major), as the loss gathers them, with
    their keys; this rank's anchors (every view, or the first with ``contrast_mode="one"``) at the rank's offset; a
    memory, this rank's own, after them; views without labels: a sample's key its row index made global."""
    memory = kwargs.get("memory_emb")
    extra = memory.shape[0] if isinstance(memory, Tensor) else 0
    n = candidates.shape[0] - extra  # the batch's rows, then the memory's
    pool = scope.rows(candidates[:n])  # (the rank's offset among every rank's rows is known from here)
    rows, cols = _one_key(targets.row_keys), _one_key(targets.col_keys)
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
    local = _counted(targets, anchors, by_pairs=True)
    counted = local if isinstance(local, Tensor) else anchors.new_tensor(local)
    return 0.5 * counted / anchors.shape[0] * float(sum(scope.sizes)) / scope.total(counted).clamp_min(1)


def _global_ids(targets: Targets, kwargs: dict[str, Any], scope: Scope) -> Targets:
    """An image-text relation by ids with a missing id tensor (every row its own id, ``arange``) made global: this
    rank's rows' own ids shifted by its offset, so that they match no other rank's."""
    if not isinstance(targets.row_keys, tuple):
        return targets
    ids = tuple(k + scope.offset if kwargs.get(name) is None else k for k, name in zip(targets.row_keys, ("image_id", "text_id")))
    return replace(targets, row_keys=ids)


def _one_key(keys: Tensor | tuple[Tensor, ...] | None) -> Tensor:
    """One key tensor (SupCon's), refused as anything else."""
    if not isinstance(keys, Tensor):
        raise RuntimeError("internal: one key tensor expected")
    return keys


def _spread(targets: Targets, scope: Scope) -> Targets:
    """``targets`` of this rank's anchors against the gathered candidates: the columns' keys gathered, the
    anchors' own columns from this rank's offset."""
    if targets.row_keys is None:
        return replace(targets, offset=scope.offset)
    cols = tuple(scope.ints(k) for k in targets.row_keys) if isinstance(targets.row_keys, tuple) else scope.ints(targets.row_keys)
    return replace(targets, col_keys=cols, offset=scope.offset)


def _counted(targets: Targets, anchors: Tensor, *, by_pairs: bool) -> Tensor | float:
    """This rank's share of the loss's denominator: its anchors (one positive each), its positive pairs
    (``by_pairs``, CLIP's ids) or its anchors with a positive (SupCon), in the loss's dtype."""
    counts = targets.positives(anchors.shape[0], _COUNT_ROWS, anchors.device)
    if counts is None:
        return float(anchors.shape[0])
    return (counts if by_pairs else counts > 0).sum().to(compute_dtype(anchors.dtype))


def _sigmoid_form(tensors: list[Tensor], kwargs: dict[str, Any], keys: set[str]) -> OnePass | None:
    """SigLIP's sigmoid pairs: two paired sets, a float or 0-dim tensor scale and bias, the diagonal positives or
    (``image_id`` / ``text_id``) every pair whose ids match, as the image-text loss relates them; ``reduction``
    "mean" (over the images) or "sum", and under ``gather=True`` among several ranks this rank's images against
    every rank's texts, as the loss gathers them."""
    if not {"logit_scale", "logit_bias"} <= keys <= {"logit_scale", "logit_bias", "image_id", "text_id"} or len(tensors) != 2 \
            or any(t.ndim != 2 for t in tensors) or tensors[0].shape[0] != tensors[1].shape[0]:
        return None
    t, b = (_scalar(kwargs[name], tensors[0].device) for name in ("logit_scale", "logit_bias"))
    options = _shared_options(kwargs)
    if t is None or b is None or options is None or options[1] == "none":
        return None  # let the loss refuse it, or take it per prefix (per-row values)
    chunk, reduction, scope = options
    scale, bias = t, b
    images, texts = tensors[0], tensors[1].to(tensors[0].dtype)
    form = _image_text_form(tensors, kwargs, keys & {"image_id", "text_id"})
    targets = Targets() if form is None else form[2]
    if scope.distributed:
        texts = scope.rows(texts)
        targets = _spread(_global_ids(targets, kwargs, scope), scope)
    n = images.shape[0]

    def sigmoid(dims: list[int], weights: list[float], named: list[tuple[str, Tensor]] | None) -> Tensor:
        mean = reduction == "mean" and not scope.distributed
        plan = prefix_plan(dims, weights, images.shape[-1], 1.0, True, 1e-12, n, texts.shape[0], chunk, mean)
        loss = PrefixSigmoid.apply(images, texts, plan, scale, bias, targets)
        if scope.distributed:  # the global sum over all pairs, over the global number of images for "mean"
            loss = scope.finish(loss, float(n) if reduction == "mean" else 1.0)
        if named is not None:
            _name_non_finite(loss, named)
        return loss

    return sigmoid


def _softmax_form(loss_fn: Callable[..., Tensor], tensors: list[Tensor], kwargs: dict[str, Any],
                  keys: set[str]) -> tuple[Tensor, Tensor, Targets, bool] | None:
    """``(anchors, candidates, targets, symmetric)`` of a soft-max loss's call (``keys``: its arguments
    besides the temperature and the shared options), or None."""
    from . import image_text_contrastive_loss, info_nce_loss, nt_xent_loss, supcon_loss

    two_d = all(t.ndim == 2 for t in tensors)
    if loss_fn is image_text_contrastive_loss and len(tensors) == 2 and two_d:
        return _image_text_form(tensors, kwargs, keys)
    if loss_fn is info_nce_loss and not keys and len(tensors) in (2, 3) and two_d:
        candidates = tensors[1] if len(tensors) == 2 else torch.cat([tensors[1], tensors[2].to(tensors[1].dtype)])
        return tensors[0], candidates, Targets(), False
    if loss_fn is nt_xent_loss and keys <= {"pairing", "decoupled"} and len(tensors) == 1 and two_d and tensors[0].shape[0] % 2 == 0:
        pairing, n = kwargs.get("pairing", _default(nt_xent_loss, "pairing")), tensors[0].shape[0]
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
        if mode != "all" and (mode != "one" or mask is not None or keys & set(_EXTRA_ROWS)):
            return None  # the loss refuses an unknown mode; "one" with a mask or extra rows goes per prefix
        bsz = features.shape[0]
        if mask is not None:
            return None if keys & set(_EXTRA_ROWS) else _sample_mask_form(features, mask, kwargs.get("validate", True))
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


def _sample_mask_form(features: Tensor, mask: object, validate: object) -> tuple[Tensor, Tensor, Targets, bool]:
    """SupCon with the authors' ``mask`` over samples (bsz, bsz): each view of sample ``b`` has the views of the
    samples ``mask[b]`` marks as positives, itself left out. A 0/1 float mask is checked as the loss checks it."""
    bsz = features.shape[0]
    checks = v.Checks(v.check_flag(validate, "validate"))
    bool_mask = v.check_mask(mask, bsz, features.device, checks)
    checks.flush()
    z = features if features.ndim == 2 else torch.cat(torch.unbind(features, 1))  # view-major, as the authors
    spread = bool_mask[:, torch.arange(z.shape[0], device=z.device) % bsz]  # (bsz, M): sample b's positive columns
    return z, z, Targets(sample_mask=spread, exclude_self=True), False


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


def _as_function(loss_fn: Callable[..., Tensor], tensors: list[Tensor],
                 kwargs: dict[str, Any]) -> tuple[Callable[..., Tensor], list[Tensor], dict[str, Any]]:
    """A module of ours as the functional call its ``forward`` makes (its temperature, options and
    parameters included, see ``functional``), so its one-pass form is found like the function's; anything
    else as given."""
    ours = isinstance(loss_fn, nn.Module) and all(getattr(getattr(type(loss_fn), name, None), "__module__", None) == _MODULES
                                                  for name in ("forward", "functional"))
    call = loss_fn.functional(*tensors, **kwargs) if ours else None  # type: ignore[attr-defined]
    if call is None:
        return loss_fn, tensors, kwargs
    fn, inputs, keywords = call
    return fn, list(inputs), keywords


#: Where the library's loss modules live: a module whose ``forward`` (or ``functional``) is written elsewhere -- a
#: user's subclass that changes the call -- runs as it is, one call per prefix.
_MODULES = "torch_contrastive.modules"


def matryoshka_loss(loss_fn: Callable[..., Tensor] | Sequence[Callable[..., Tensor]] | nn.ModuleList, embeddings: Sequence[Tensor],
                    matryoshka_dims: Sequence[int], matryoshka_weights: Sequence[float] | None = None, *,
                    one_pass: bool = True, **kwargs: Any) -> Tensor:
    """``sum_p w_p * loss_fn(*[normalize(e[..., :d_p]) for e in embeddings], **kwargs)``: any loss over
    embedding prefixes -- in one pass where the prefix engine covers the call, else one call per prefix.

    Example:
        >>> loss = tc.matryoshka_loss(tc.supcon_loss, [features], [128, 64, 32], labels=labels, temperature=0.1)

    Args:
        loss_fn: a loss of embeddings (``tc.nt_xent_loss``, ``tc.supcon_loss``, ...), or a list (or an
            ``nn.ModuleList``) of them, one per prefix, each called on its own prefix: a loss that keeps a state per embedding width (a
            :class:`~torch_contrastive.GlobalContrastiveLoss` per prefix: its per-sample normalisers are
            the prefix's own, so the prefixes cannot share one).
        embeddings: the tensors cut to each prefix (their last dimension), each L2-normalised on its own.
        matryoshka_dims: prefix sizes, at most the embeddings' last dimension.
        matryoshka_weights: one weight per dim (None: all 1).
        one_pass: take the one pass where it applies (False: always one call per prefix).
        **kwargs: passed to ``loss_fn`` unchanged (labels, temperature, options).

    Returns:
        the weighted sum of the prefixes' losses (``loss_fn``'s reduction).

    One pass (``D`` products per pair for all prefixes, :mod:`torch_contrastive.engine.prefixes`): the
    image-text loss (``tc.clip_loss``; ``image_id`` / ``text_id`` duplicates, ``decoupled=True`` or ``label_smoothing``),
    ``tc.info_nce_loss`` (with negatives), ``tc.nt_xent_loss`` (``pairing`` adjacent or halves,
    ``decoupled=True``), ``tc.supcon_loss`` (labels -- with a memory or a reference set too --, the authors' views, or their
    ``mask``; ``contrast_mode="one"`` with labels or views) and the label conventions scored
    pair by pair (``tc.nt_xent_loss(labels=...)``, pytorch-metric-learning's, with a memory or a reference set too,
    and ``tc.nt_bxent_loss`` by
    ``labels=`` or ``pos_indices=``),
    each with a float ``temperature`` or a learnable 0-dim tensor (which gets its gradient), and the shared
    options ``reduction`` (``"mean"``, ``"sum"`` or ``"none"``), ``chunk_size`` (the strip),
    ``normalize``, ``eps`` (< 1), ``backend`` (``"auto"`` / ``"torch"``) and ``validate``;
    ``tc.siglip_loss`` with ``logit_scale`` and ``logit_bias`` (floats or 0-dim tensors, which get their
    gradients), optional ``image_id`` / ``text_id``, ``reduction`` mean or sum, ``gather=True`` too.
    ``validate`` is honoured on either path (False: no host read). The soft-max forms
    keep the one pass under ``gather=True`` among several ranks (every ``reduction``, CLIP's label smoothing, a
    memory, positive weights): this rank's anchors against every rank's candidates, as the losses gather them, and
    so do the pair forms (by labels, a memory, NT-BXent's listed pairs).
    NT-Xent's ``positive_weight`` keeps the one pass (a tensor: every prefix's; a module's weights read off the
    outputs, DCLW's or a ``weight_fn``'s: each prefix's own). The loss modules of the library take the one pass of
    the functional call their ``forward`` makes (``module.functional``).
    One call per prefix (``sum(d_p)`` products per pair): a reference set with ``gather=True`` (which the losses
    refuse), the memories and reference sets of the losses not named here, and other losses. The rows of a memory
    or reference set (``memory_emb``, ``ref_emb``) are cut to each prefix like the embeddings.
    """
    if isinstance(loss_fn, nn.ModuleList):  # one module per prefix, registered with the model (their parameters)
        loss_fn = list(loss_fn)
    if isinstance(loss_fn, str) or not (callable(loss_fn) or isinstance(loss_fn, Sequence)):
        raise TypeError(f"loss_fn must be callable (or one callable per prefix), got {type(loss_fn).__name__}")
    if isinstance(embeddings, Tensor) or not isinstance(embeddings, Sequence) or not embeddings:
        raise TypeError("embeddings must be a non-empty list of tensors (the inputs cut to each prefix)")
    tensors = [v.check_embeddings(e, f"embeddings[{i}]", max_ndim=None) for i, e in enumerate(embeddings)]
    width = tensors[0].shape[-1]
    if any(t.shape[-1] != width for t in tensors):
        raise ValueError(f"embeddings must share their last dimension, got {[t.shape[-1] for t in tensors]}")
    dims, weights = check_prefixes(matryoshka_dims, matryoshka_weights, width)
    if isinstance(loss_fn, Sequence):
        losses = iter(one_per_prefix(loss_fn, len(dims)))
        # prefix_sum visits the prefixes in order: the i-th loss meets the i-th prefix
        return prefix_sum(dims, weights, lambda dim: prefix_term(next(losses), tensors, kwargs, dim, width))
    refuse_shared_state(loss_fn)
    form = _one_pass(*_as_function(loss_fn, tensors, kwargs)) if v.check_flag(one_pass, "one_pass") else None
    if form is not None:
        named = [(f"embeddings[{i}]", t) for i, t in enumerate(tensors)] if v.check_flag(kwargs.get("validate", True), "validate") else None
        return form(dims, weights, named)
    return prefix_sum(dims, weights, lambda dim: prefix_term(loss_fn, tensors, kwargs, dim, width))
