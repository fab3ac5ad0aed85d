"""InfoNCE with candidates beyond the batch: hard negatives and queues (README, "Candidates beyond the batch").

One query/key form covers the retrieval and self-supervision losses that add candidates
to the batch: sentence-transformers' MultipleNegativesRankingLoss (in-batch keys plus a
pool of hard negatives), info-nce-pytorch (paired or unpaired negatives), MoCo (a queue
of past keys) and lightly's memory bank. False negatives (README, "False negatives") leave a query's
denominator by id (duplicates of its positive) or by a guide model's verdict (GISTEmbed);
``decoupled=True`` is DCL; ``label_smoothing`` as in ``F.cross_entropy``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _validation as v
from .._normalize import prepare
from ..distributed import Scope, all_gather_with_grad, gather_padded, gather_sizes, make_scope
from ..engine import Scale, fixed_scale_applies, softmax_terms
from ..positives import Exclusion, Positives
from ._common import check_agreement, pair_partner, reduce, safe_logsumexp

__all__ = ["info_nce_loss"]


def info_nce_loss(
    query: Tensor,
    key: Tensor,
    negatives: Tensor | None = None,
    temperature: float | Tensor = 0.07,
    *,
    negative_mode: str = "unpaired",
    in_batch_negatives: bool = True,
    key_ids: Tensor | None = None,
    negative_ids: Tensor | None = None,
    guide: tuple[Tensor, ...] | None = None,
    guide_margin: float = 0.0,
    guide_margin_mode: str = "absolute",
    decoupled: bool = False,
    label_smoothing: float = 0.0,
    normalize: bool = True,
    reduction: str = "mean",
    chunk_size: int | None = None,
    gather: bool = False,
    gather_negatives: bool | None = None,
    grad_reduction: str = "mean",
    eps: float = 1e-12,
    validate: bool = True,
    backend: str = "auto",
) -> Tensor:
    """InfoNCE of queries against their keys plus extra negatives (README, "Candidates beyond the batch", "False negatives").

    Key ``i`` is query ``i``'s positive. The candidates of query ``i`` are its key, the
    other keys (``in_batch_negatives=True``), and the negatives: the whole pool
    (``negative_mode="unpaired"``, (M, D)) or its own K rows (``"paired"``, (N, K, D)).

        ``loss_i = -s(q_i, k_i) + log sum_{c in cand(i)} exp(s(q_i, c))``

    with ``s = <q, c> / tau`` on L2-normalised rows (``normalize=True``).

    Equivalences (README, "Candidates beyond the batch", "False negatives"):

    * info-nce-pytorch ``info_nce(q, k)``: the defaults; ``info_nce(q, k, negs,
      negative_mode=m)``: ``in_batch_negatives=False``;
    * sentence-transformers' MultipleNegativesRankingLoss with ``scale``: ``temperature
      = 1 / scale``, ``negatives`` = the batch's hard negatives (unpaired pool); its
      duplicate masking: ``key_ids`` (and ``negative_ids``); GISTEmbed: ``guide``;
    * MoCo: ``negatives=queue.features`` (a :class:`~torch_contrastive.FeatureQueue`),
      ``in_batch_negatives=False``; lightly's DCL: ``decoupled=True``.

    Args:
        query: (N, D) float tensor.
        key: (N, D) float tensor, row i the positive of query i.
        negatives: None, (M, D) (``"unpaired"``) or (N, K, D) (``"paired"``).
        temperature: tau > 0, float or 0-dim tensor (default 0.07).
        negative_mode: ``"unpaired"`` (a pool shared by every query) or ``"paired"``.
        in_batch_negatives: the other queries' keys are negatives too.
        key_ids: (N,) integer ids of the keys (documents): a candidate whose id equals
            query i's key id is a duplicate of its positive and leaves its denominator
            (the positive itself stays). Needs ``negative_ids`` to mask negatives too.
        negative_ids: ids of the negatives, (M,) unpaired or (N, K) paired (a queue's
            ``labels`` slot). Gathered with the rows under ``gather=True``.
        guide: ``(g_query, g_key[, g_negatives])`` guide-model embeddings of the same rows
            (no gradient): a candidate c leaves query i's negatives when its guide cosine
            ``g_ic > g_ip - guide_margin`` (``"absolute"``) or ``g_ic > g_ip -
            guide_margin * |g_ip|`` (``"relative"``), ``g_ip`` the positive's. Computed
            tile by tile (one small product per tile), O(N) memory.
        guide_margin, guide_margin_mode: see ``guide`` (margin >= 0).
        decoupled: DCL (Yeh et al. 2021): the positive leaves the denominator.
        label_smoothing: epsilon in [0, 1): ``(1 - eps) * CE + eps * mean over query i's
            candidates of -log softmax``, as ``F.cross_entropy(label_smoothing=eps)``. Not
            combined with ids, a guide or ``decoupled``.
        normalize: cosine similarity (default) or raw dot products.
        reduction: ``"mean"`` over queries, ``"sum"``, or ``"none"`` ((N,) per query).
        chunk_size: tile edge of the query x shared-candidate products (None: automatic).
        gather: under ``torch.distributed``, every rank's keys (and unpaired negatives,
            see ``gather_negatives``, with their ids and guide rows) are candidates of every
            query; each rank computes its own queries; paired negatives stay with their query.
        gather_negatives: gather the unpaired negatives too (default: ``gather``). Pass
            ``False`` for rows that are already global, such as a queue filled with
            ``FeatureQueue.push(..., gather=True)``: gathering them again would repeat them.
        grad_reduction, eps, validate, backend: the shared options (:mod:`torch_contrastive.options`).

    Returns:
        0-dim loss (fp32 for half inputs), or (N,) per-query values. A query whose every
        candidate was left out contributes 0.

    Memory: O((N + M) * D + tile^2) for the shared candidates; paired negatives add
    O(N * K) logits (one batched product), never N x N x K. Candidates that do not require
    grad (a queue) skip their ``G.T @ Q`` products in backward.
    """
    n, paired = _check_inputs(query, key, negatives, negative_mode, in_batch_negatives)
    v.check_options(reduction=reduction, chunk_size=chunk_size, grad_reduction=grad_reduction, eps=eps)
    if gather_negatives is not None and not isinstance(gather_negatives, bool):
        raise TypeError(f"gather_negatives must be None or a bool, got {type(gather_negatives).__name__}")
    smoothing = v.check_fraction(label_smoothing, "label_smoothing")
    v.check_backend(backend, True, "InfoNCE")
    scope = make_scope(gather, grad_reduction)
    checks = v.Checks(validate, scope)
    checks.finite(query, "query")
    checks.finite(key, "key")
    if negatives is not None:
        checks.finite(negatives, "negatives")
    rules = _false_negative_rules(query, negatives, paired, key_ids, negative_ids, guide, guide_margin, guide_margin_mode,
                                  decoupled, eps, checks)
    if smoothing and rules.any:
        raise ValueError("label_smoothing is not combined with key_ids, a guide or decoupled=True")
    scale, bound = v.inverse_temperature(temperature, checks, need_bound=normalize)
    check_agreement(scope, "query/key", query, validate, negatives is not None, paired, in_batch_negatives)
    fixed = fixed_scale_applies(normalize, bound, query.dtype)
    key = key.to(query.dtype)
    negatives = None if negatives is None else negatives.to(query.dtype)

    constant_pool = negatives is not None and not paired and not negatives.requires_grad and negatives.shape[0] > 0
    plain = not rules.any and not smoothing
    if plain and not scope.distributed and in_batch_negatives and not paired and not constant_pool:
        # The common case (info-nce-pytorch's default, MNRL with live hard negatives): one
        # engine call on the raw rows, normalised inside; the positive is candidate i.
        per_query = _in_batch(query, key, negatives, scale, fixed, normalize, eps, chunk_size, backend)
    else:
        spread = gather if gather_negatives is None else gather_negatives
        # With validate=True (one read anyway, one process) the guide's tiles learn in forward
        # which of them exclude anything; backward then skips the others' guide products.
        # (Not when a read happened already -- a tensor temperature's value -- which would make it two.)
        learners: list[Exclusion] | None = [] if checks.enabled and checks.reads == 0 and not scope.distributed \
            and rules.guide_query is not None else None
        per_query = _general(query, key, negatives, paired, in_batch_negatives, scale, scope, spread, fixed, normalize, eps,
                             chunk_size, rules, smoothing, backend, learners)
        flags = [f for f in (e.recorded() for e in learners or ()) if f is not None]
        if flags:
            return reduce(per_query, float(n), reduction, scope, checks, v.output_needs_check(normalize, bound),
                          extra=(torch.cat(flags), lambda values: _learn(learners or [], values)))
    return reduce(per_query, float(n), reduction, scope, checks, v.output_needs_check(normalize, bound))


def _learn(learners: list[Exclusion], values: list[float]) -> None:
    """Hand each exclusion its part of the host-read tile flags (in recording order)."""
    start = 0
    for exclusion in learners:
        count = 2 * len(exclusion.flags)  # two counts per tile
        exclusion.learn_from(values[start : start + count])
        start += count


@dataclass
class _Rules:
    """What leaves a query's denominator (README, "False negatives"): ids, a guide's verdict, the positive (DCL)."""

    key_ids: Tensor | None = None  # (N,) int64
    negative_ids: Tensor | None = None  # (M,) or (N, K) int64
    guide_query: Tensor | None = None  # (N, Dg) unit rows, detached
    guide_key: Tensor | None = None  # (N, Dg)
    guide_negatives: Tensor | None = None  # (M, Dg) or (N, K, Dg)
    threshold: Tensor | None = None  # (N,): a candidate with guide cosine above it leaves
    decoupled: bool = False

    @property
    def any(self) -> bool:
        return self.key_ids is not None or self.threshold is not None or self.decoupled


def _unit(x: Tensor, eps: float) -> Tensor:
    """Detached L2-normalised rows (along the last dim) in fp32 / fp64."""
    x = prepare(x.detach().reshape(-1, x.shape[-1]), True, eps).reshape(x.shape)
    return x


def _false_negative_rules(query: Tensor, negatives: Tensor | None, paired: bool, key_ids: object, negative_ids: object,
                          guide: object, margin: object, mode: str, decoupled: object, eps: float, checks: v.Checks) -> _Rules:
    if not isinstance(decoupled, bool):
        raise TypeError(f"decoupled must be a bool, got {type(decoupled).__name__}")
    rules = _Rules(decoupled=decoupled)
    _check_ids(rules, query, negatives, paired, key_ids, negative_ids)
    if guide is not None:
        _check_guide(rules, query, negatives, paired, guide, margin, mode, eps, checks)
    return rules


def _check_ids(rules: _Rules, query: Tensor, negatives: Tensor | None, paired: bool, key_ids: object, negative_ids: object) -> None:
    if negative_ids is not None and key_ids is None:
        raise ValueError("negative_ids needs key_ids (a negative leaves query i's denominator when its id equals key_ids[i])")
    if key_ids is not None:
        rules.key_ids = v.check_labels(key_ids, "key_ids", query.shape[0], query.device)
    if negative_ids is None:
        return
    if negatives is None:
        raise ValueError("negative_ids was given without negatives")
    shape = tuple(negatives.shape[:2]) if paired else (negatives.shape[0],)
    if not isinstance(negative_ids, Tensor) or negative_ids.dtype not in v.LABEL_DTYPES:
        raise TypeError("negative_ids must be an integer tensor")
    if tuple(negative_ids.shape) != shape:
        raise ValueError(f"negative_ids must have shape {shape} (one id per negative), got {tuple(negative_ids.shape)}")
    rules.negative_ids = negative_ids.to(device=query.device, dtype=torch.int64)


def _check_guide(rules: _Rules, query: Tensor, negatives: Tensor | None, paired: bool, guide: object, margin: object, mode: str,
                 eps: float, checks: v.Checks) -> None:
    n = query.shape[0]
    v.check_choice(mode, "guide_margin_mode", ("absolute", "relative"))
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
        raise ValueError(f"guide_margin must be a float >= 0, got {margin!r}")
    if not isinstance(guide, (tuple, list)) or len(guide) not in (2, 3):
        raise TypeError("guide must be a tuple (g_query, g_key) or (g_query, g_key, g_negatives) of tensors")
    if negatives is not None and len(guide) != 3:
        raise ValueError("guide needs a third element, g_negatives, when negatives are given")
    g_query = v.check_embeddings(guide[0], "guide[0] (g_query)")
    g_key = v.check_embeddings(guide[1], "guide[1] (g_key)")
    for name, g in (("guide[0] (g_query)", g_query), ("guide[1] (g_key)", g_key)):
        if g.shape[0] != n:
            raise ValueError(f"{name} must have {n} rows (one per query), got {g.shape[0]}")
        checks.finite(g, name)
    if g_key.shape[1] != g_query.shape[1]:
        raise ValueError(f"guide embeddings must share one feature size, got {g_query.shape[1]} and {g_key.shape[1]}")
    rules.guide_query, rules.guide_key = _unit(g_query, eps), _unit(g_key, eps)
    if negatives is not None:
        g_neg = v.check_embeddings(guide[2], "guide[2] (g_negatives)", min_ndim=2, max_ndim=3, empty_rows=not paired)
        if tuple(g_neg.shape[:-1]) != tuple(negatives.shape[:-1]) or g_neg.shape[-1] != g_query.shape[1]:
            raise ValueError(f"guide[2] (g_negatives) must have shape {(*negatives.shape[:-1], g_query.shape[1])}, "
                             f"got {tuple(g_neg.shape)}")
        checks.finite(g_neg, "guide[2] (g_negatives)")
        rules.guide_negatives = _unit(g_neg, eps)
    positive = (rules.guide_query * rules.guide_key).sum(1)
    rules.threshold = positive - (margin if mode == "absolute" else margin * positive.abs())


def _check_inputs(query: Tensor, key: Tensor, negatives: Tensor | None, negative_mode: str,
                  in_batch_negatives: object) -> tuple[int, bool]:
    v.check_embeddings(query, "query")
    v.check_embeddings(key, "key")
    v.check_same_rows(query, "query", key, "key")
    v.check_choice(negative_mode, "negative_mode", v.NEGATIVE_MODES)
    if not isinstance(in_batch_negatives, bool):
        raise TypeError(f"in_batch_negatives must be a bool, got {type(in_batch_negatives).__name__}")
    n, d = query.shape
    paired = negatives is not None and negative_mode == "paired"
    if negatives is not None:
        if paired:
            v.check_embeddings(negatives, "negatives", min_ndim=3, max_ndim=3)
            if negatives.shape[0] != n:
                raise ValueError(f"paired negatives must have shape (N, K, D) with N = {n} (the number of queries), "
                                 f"got {tuple(negatives.shape)}")
        else:
            v.check_embeddings(negatives, "negatives", empty_rows=True)
        if negatives.shape[-1] != d:
            raise ValueError(f"negatives must have feature size {d} (as query), got {negatives.shape[-1]}")
    elif not in_batch_negatives:
        raise ValueError("in_batch_negatives=False needs negatives: otherwise a query's only candidate is its own key "
                         "and the loss is identically 0")
    return n, paired


def _in_batch(query: Tensor, key: Tensor, negatives: Tensor | None, scale: Scale, fixed: bool, normalize: bool,
              eps: float, chunk_size: int | None, backend: str = "auto") -> Tensor:
    n = query.shape[0]
    cols = key if negatives is None else torch.cat([key, negatives])
    positives = Positives.from_partner(pair_partner(n, "identity", 0, query.device), cols.shape[0], self_offset=None,
                                       layout="identity" if negatives is None else None, shift=0)
    per_query, _ = softmax_terms(query, cols, scale, self_offset=None, positives=positives, fixed=fixed, normalize=normalize,
                                 eps=eps, chunk_size=chunk_size, backend=backend)
    return per_query


def _general(query: Tensor, key: Tensor, negatives: Tensor | None, paired: bool, in_batch: bool, scale: Scale, scope: Scope,
             spread: bool, fixed: bool, normalize: bool, eps: float, chunk_size: int | None, rules: _Rules,
             smoothing: float, backend: str = "auto", learners: list[Exclusion] | None = None) -> Tensor:
    """Per-query loss as ``log sum exp`` of terms relative to the positive logit ``s_ii``.

    Each candidate group is its own engine call: the (gathered) keys, with query i's
    positive read off the tile, and the unpaired pool, whose log-sum-exp needs no
    positive -- a constant pool (a queue) then costs no gradient products and no copy
    beside the batch. The positive logit and the paired negatives are O(N * D) and
    O(N * K * D) products. False negatives leave each group through its exclusion.
    """
    n = query.shape[0]
    q = prepare(query, normalize, eps)
    k = prepare(key, normalize, eps)
    s_pos = (q * k).sum(1) * scale
    terms: list[Tensor] = []
    uniform = s_pos.new_zeros(n) if smoothing else None  # sum over candidates of s_ic (label smoothing)
    count = 0
    if in_batch:
        keys = scope.rows(k)
        # the engine's row term is LSE_i - s_ii: query i's key is global column offset + i
        positives = Positives.from_partner(pair_partner(n, "identity", scope.offset, q.device), keys.shape[0], self_offset=None,
                                           shift=scope.offset)
        exclude = _learning(_key_exclusion(rules, positives, scope, learners is not None), learners)
        terms.append(softmax_terms(q, keys, scale, self_offset=None, positives=positives, fixed=fixed, chunk_size=chunk_size,
                                   exclude=exclude, backend=backend)[0])
        if uniform is not None:
            uniform, count = uniform + (q * keys.sum(0)).sum(1) * scale, count + keys.shape[0]
    elif not rules.decoupled:
        terms.append(torch.zeros_like(s_pos))  # the positive's own exp(s_ii - s_ii)
        if uniform is not None:
            uniform, count = uniform + s_pos, count + 1
    if negatives is not None and not paired:
        pool = prepare(negatives, normalize, eps)
        pool = all_gather_with_grad(pool) if spread and scope.distributed else pool
        if pool.shape[0]:  # an empty queue adds nothing
            exclude = _learning(_pool_exclusion(rules, spread, scope, learners is not None), learners)
            terms.append(softmax_terms(q, pool, scale, self_offset=None, fixed=fixed, chunk_size=chunk_size, exclude=exclude,
                                       backend=backend)[0] - s_pos)
            if uniform is not None:
                uniform, count = uniform + (q * pool.sum(0)).sum(1) * scale, count + pool.shape[0]
    if paired and negatives is not None:
        own = prepare(negatives.reshape(-1, negatives.shape[-1]), normalize, eps).reshape(negatives.shape)
        # (N, K, D) x (N, D, 1): each query against its own K negatives only, in the
        # compute dtype even inside an autocast region (as the engine)
        with torch.autocast(q.device.type, enabled=False):
            paired_logits = torch.bmm(own, q[:, :, None])[:, :, 0] * scale
        if uniform is not None:
            uniform, count = uniform + paired_logits.sum(1), count + negatives.shape[1]
        out = _paired_exclusion(rules)
        relative = paired_logits - s_pos[:, None]
        terms.append(relative if out is None else relative.masked_fill(out, float("-inf")))
    if len(terms) == (0 if rules.decoupled or in_batch else 1):
        # in_batch_negatives=False and an empty pool: only the positive (or, decoupled, nothing)
        return s_pos * 0.0
    loss = safe_logsumexp(torch.cat([t if t.ndim == 2 else t[:, None] for t in terms], 1))
    if uniform is not None:  # (1 - eps) CE + eps mean_c (LSE - s_ic) = CE + eps (s_ii - mean_c s_ic)
        loss = loss + smoothing * (s_pos - uniform / count)
    return loss


def _learning(exclusion: Exclusion | None, learners: list[Exclusion] | None) -> Exclusion | None:
    """``exclusion``, registered among ``learners`` when it records tile flags."""
    if exclusion is not None and exclusion.learn and learners is not None:
        learners.append(exclusion)
    return exclusion


def _key_exclusion(rules: _Rules, positives: Positives, scope: Scope, learn: bool = False) -> Exclusion | None:
    """Keys that leave query i's denominator: duplicates of its key (ids), a guide's verdict,
    its own key under DCL; the positive (global column offset + i) stays otherwise."""
    if not rules.any:
        return None
    relation = None
    if rules.key_ids is not None:
        relation = Positives.from_keys(rules.key_ids, scope.ints(rules.key_ids), self_offset=None)
    guide = None
    if rules.threshold is not None and rules.guide_query is not None and rules.guide_key is not None:
        guide = (rules.guide_query, scope.ints(rules.guide_key), rules.threshold)
    offset = scope.offset
    if rules.decoupled:  # the positive leaves too: a strided diagonal (ids already include it)
        return Exclusion(relation=relation, guide=guide, diagonal=None if relation is not None else offset,
                         learn=learn and guide is not None)
    if relation is None and guide is None:
        return None
    return Exclusion(relation=relation, guide=guide, keep_diagonal=offset, learn=learn and guide is not None)


def _pool_exclusion(rules: _Rules, spread: bool, scope: Scope, learn: bool = False) -> Exclusion | None:
    relation, guide = None, None
    gathering = spread and scope.distributed
    sizes = None
    if rules.key_ids is not None and rules.negative_ids is not None:
        ids = rules.negative_ids
        if gathering:
            sizes = gather_sizes(ids.shape[0], ids.device)
            ids = gather_padded(ids, sizes)
        relation = Positives.from_keys(rules.key_ids, ids, self_offset=None)
    if rules.threshold is not None and rules.guide_query is not None and rules.guide_negatives is not None:
        g_neg = rules.guide_negatives
        if gathering:
            g_neg = gather_padded(g_neg, sizes or gather_sizes(g_neg.shape[0], g_neg.device))
        guide = (rules.guide_query, g_neg, rules.threshold)
    if relation is None and guide is None:
        return None
    return Exclusion(relation=relation, guide=guide, learn=learn and guide is not None)


def _paired_exclusion(rules: _Rules) -> Tensor | None:
    """(N, K) bool: paired negatives that leave their query's denominator."""
    out = None
    if rules.key_ids is not None and rules.negative_ids is not None:
        out = rules.negative_ids == rules.key_ids[:, None]
    if rules.threshold is not None and rules.guide_query is not None and rules.guide_negatives is not None:
        verdict = torch.bmm(rules.guide_negatives, rules.guide_query[:, :, None])[:, :, 0] > rules.threshold[:, None]
        out = verdict if out is None else out | verdict
    return out
