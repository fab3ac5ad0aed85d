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

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .. import _validation as v
from ..distributed import Scope
from ..engine.prefixes import Targets
from .prefix_calls import check_prefixes, one_per_prefix, prefix_sum, prefix_term, refuse_shared_state
from .prefix_forms import SHARED, OnePass, default_of, one_pass_softmax, pair_form, shared_options, sigmoid_form, weighted_form
from .prefix_gather import gathered_form
from .prefix_global import global_one_pass
from .prefix_paired import paired_form
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


def _one_pass(loss_fn: Callable[..., Tensor], tensors: list[Tensor], kwargs: dict[str, Any]) -> OnePass | None:
    """The one-pass form of ``loss_fn(*tensors, **kwargs)`` when the prefix engine computes the call exactly
    (``validate`` is honoured by the caller); None otherwise."""
    from . import image_text_contrastive_loss, info_nce_loss, nt_bxent_loss, nt_xent_loss, siglip_loss, supcon_loss

    if loss_fn is siglip_loss:
        return sigmoid_form(tensors, kwargs, set(kwargs) - set(SHARED))
    if loss_fn not in (image_text_contrastive_loss, info_nce_loss, nt_xent_loss, supcon_loss, nt_bxent_loss):
        return None
    tau = kwargs.get("temperature", default_of(loss_fn, "temperature"))
    if isinstance(tau, bool) or not isinstance(tau, (int, float, Tensor)) or \
            (isinstance(tau, Tensor) and (tau.numel() != 1 or not tau.is_floating_point())):
        return None  # let the loss refuse it
    options = shared_options(kwargs)
    if options is None:
        return None
    chunk, reduction, scope = options
    if loss_fn is info_nce_loss and kwargs.get("negative_mode") == "paired":  # each query's own negatives
        return paired_form(tensors, kwargs, set(kwargs) - {"temperature", *SHARED}, tau, chunk, reduction, scope)
    pairs = loss_fn is nt_bxent_loss or (kwargs.get("labels") is not None and loss_fn is nt_xent_loss)
    if pairs:
        return pair_form(loss_fn is nt_bxent_loss, tensors, kwargs, set(kwargs) - {"temperature", *SHARED},
                          tau.reshape(()) if isinstance(tau, Tensor) else v.check_positive(tau, "temperature"), chunk,
                          reduction, scope)
    # SupCon's scale (tau / tau_base) and its single-class rule apply to the value: the form does not read them
    keys = set(kwargs) - {"temperature", *SHARED} - (_SUPCON_VALUE if loss_fn is supcon_loss else set())
    run = gathered_form(loss_fn, tensors, kwargs, keys, tau, scope, chunk, reduction) if scope.distributed else \
        _local(loss_fn, tensors, kwargs, keys, tau, chunk, reduction)
    return run if run is None or loss_fn is not supcon_loss else _supcon_value(run, tensors[0], kwargs, tau, scope)


def _local(loss_fn: Callable[..., Tensor], tensors: list[Tensor], kwargs: dict[str, Any], keys: set[str],
           tau: float | Tensor, chunk: int | None, reduction: str) -> OnePass | None:
    """A soft-max form on one process: its anchors against its candidates (CLIP both directions from the same
    tiles), NT-Xent's positive terms weighted where the call gives weights."""
    from . import image_text_contrastive_loss

    found = weighted_form(loss_fn, tensors, kwargs, keys)
    if found is None:
        return None
    (anchors, candidates, targets, symmetric), given_weight = found
    temperature = tau.reshape(()) if isinstance(tau, Tensor) else v.check_positive(tau, "temperature")
    mean, per_row = reduction == "mean", reduction == "none"
    # CLIP's "sum" is N times its mean (its ids normalise by the positive pairs); the others sum their rows
    times_rows = loss_fn is image_text_contrastive_loss and reduction == "sum"
    weighted = None if given_weight is None or targets.partner is None else \
        PositiveWeights(given_weight, anchors, candidates, targets.partner, reduction)  # NT-Xent's positive terms weighted (DCLW)

    def run(dims: list[int], weights: list[float], named: list[tuple[str, Tensor]] | None) -> Tensor:
        def softmax(t: Targets) -> Tensor:
            return one_pass_softmax(anchors, candidates, t, dims, weights, temperature, candidates if symmetric else None, 1e-12,
                                    chunk, named, mean=mean or times_rows, per_row=per_row,
                                    factor=float(anchors.shape[0]) if times_rows else 1.0)

        return softmax(targets) if weighted is None else weighted.around(targets, dims, weights, temperature, softmax)

    return run


#: SupCon's arguments that act on the loss's value, not on its form.
_SUPCON_VALUE = {"base_temperature", "single_class"}


def _supcon_value(run: OnePass, features: Tensor, kwargs: dict[str, Any], tau: float | Tensor, scope: Scope) -> OnePass | None:
    """SupCon's ``base_temperature`` (the loss times ``tau / tau_base``, a learnable tau's gradient through it too)
    and ``single_class="zero"`` (0 when every anchor and candidate share one label), as the loss applies them to
    its value; None for values the loss refuses (it then says why)."""
    from .supcon import has_negative_pair

    base, mode = kwargs.get("base_temperature"), kwargs.get("single_class", "keep")
    if mode not in ("keep", "zero") or not (base is None or (isinstance(base, (int, float)) and not isinstance(base, bool))):
        return None
    factor = None if base is None else tau / v.check_positive(base, "base_temperature")
    labels = kwargs.get("labels")
    flag = None
    if mode == "zero" and isinstance(labels, Tensor):
        memory, reference = (kwargs.get(name) for name in ("memory_labels", "ref_labels"))
        flag = has_negative_pair(scope.ints(labels.to(features.device)), None if memory is None else (memory, memory),
                                  None if reference is None else (reference, reference))
    if factor is None and flag is None:
        return run

    def scaled(dims: list[int], weights: list[float], named: list[tuple[str, Tensor]] | None) -> Tensor:
        loss = run(dims, weights, named)
        if factor is not None:
            loss = loss * (factor.to(loss.dtype) if isinstance(factor, Tensor) else factor)
        return loss if flag is None else loss * flag.to(loss.dtype)

    return scaled


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
            the prefix's own, so the prefixes cannot share one; their rows' statistics come from one pass,
            :mod:`~torch_contrastive.losses.prefix_global`).
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
    ``mask``; ``contrast_mode="one"`` with labels, views or a mask) and the label conventions scored
    pair by pair (``tc.nt_xent_loss(labels=...)``, pytorch-metric-learning's, with a memory or a reference set too,
    and ``tc.nt_bxent_loss`` by
    ``labels=`` or ``pos_indices=``),
    each with a float ``temperature`` or a learnable 0-dim tensor (which gets its gradient), and the shared
    options ``reduction`` (``"mean"``, ``"sum"`` or ``"none"``), ``chunk_size`` (the strip),
    ``normalize``, ``eps`` (< 1), ``backend`` (``"auto"`` / ``"torch"``) and ``validate``;
    ``tc.siglip_loss`` with ``logit_scale`` and ``logit_bias`` (floats or 0-dim tensors, which get their
    gradients), optional ``image_id`` / ``text_id`` or ``negative_only``, ``reduction`` mean or sum, ``gather=True`` too.
    ``validate`` is honoured on either path (False: no host read). The soft-max forms
    keep the one pass under ``gather=True`` among several ranks (every ``reduction``, CLIP's and InfoNCE's label smoothing, a
    memory, positive weights): this rank's anchors against every rank's candidates, as the losses gather them, and
    so do the pair forms (by labels, a memory, NT-BXent's listed pairs).
    InfoNCE's false negatives (``key_ids``, ``guide``, ``in_batch_negatives=False``, ``decoupled``) keep it, under
    ``gather=True`` too, and so do its paired negatives (``negative_mode="paired"``), with those rules or label smoothing. NT-Xent's
    ``positive_weight`` keeps the one pass (a tensor: every prefix's; a module's weights read off the
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
        fns = one_per_prefix(loss_fn, len(dims))
        together = global_one_pass(fns, tensors, kwargs, dims, weights) if v.check_flag(one_pass, "one_pass") else None
        if together is not None:
            return together
        losses = iter(fns)
        # prefix_sum visits the prefixes in order: the i-th loss meets the i-th prefix
        return prefix_sum(dims, weights, lambda dim: prefix_term(next(losses), tensors, kwargs, dim, width))
    refuse_shared_state(loss_fn)
    form = _one_pass(*_as_function(loss_fn, tensors, kwargs)) if v.check_flag(one_pass, "one_pass") else None
    if form is not None:
        named = [(f"embeddings[{i}]", t) for i, t in enumerate(tensors)] if v.check_flag(kwargs.get("validate", True), "validate") else None
        return form(dims, weights, named)
    return prefix_sum(dims, weights, lambda dim: prefix_term(loss_fn, tensors, kwargs, dim, width))
