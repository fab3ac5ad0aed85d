"""InfoNCE with candidates beyond the batch: hard negatives and queues (README, "Candidates beyond the batch").

One query/key form covers the retrieval and self-supervision losses that add candidates
to the batch: sentence-transformers' MultipleNegativesRankingLoss (in-batch keys plus a
pool of hard negatives), info-nce-pytorch (paired or unpaired negatives), MoCo (a queue
of past keys) and lightly's memory bank. False negatives (README, "False negatives") leave a query's
denominator by id (duplicates of its positive) or by a guide model's verdict (GISTEmbed);
``decoupled=True`` is DCL; ``label_smoothing`` as in ``F.cross_entropy``.
"""

from __future__ import annotations

from torch import Tensor

from .. import _validation as v
from ..engine import Options
from ._false_negatives import false_negative_rules
from ._info_nce_groups import candidate_groups, in_batch
from ._prologue import begin, check_agreement, reduce

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
        guide_margin: the margin of ``guide`` (>= 0).
        guide_margin_mode: ``"absolute"`` or ``"relative"`` (see ``guide``).
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

    Returns:
        0-dim loss (fp32 for half inputs), or (N,) per-query values. A query whose every
        candidate was left out contributes 0.

    The shared options ``grad_reduction``, ``eps``, ``validate``, ``backend`` are documented once in
    :mod:`torch_contrastive.options`.

    Memory: O((N + M) * D + tile^2) for the shared candidates; paired negatives add
    O(N * K) logits (one batched product), never N x N x K. Candidates that do not require
    grad (a queue) skip their ``G.T @ Q`` products in backward.
    """
    n, paired = _check_inputs(query, key, negatives, negative_mode, in_batch_negatives)
    scope, checks = begin(normalize=normalize, reduction=reduction, chunk_size=chunk_size, grad_reduction=grad_reduction, eps=eps, backend=backend,
                          gather=gather, validate=validate)
    if gather_negatives is not None and not isinstance(gather_negatives, bool):
        raise TypeError(f"gather_negatives must be None or a bool, got {type(gather_negatives).__name__}")
    smoothing = v.check_fraction(label_smoothing, "label_smoothing")
    checks.finite(query, "query")
    checks.finite(key, "key")
    if negatives is not None:
        checks.finite(negatives, "negatives")
    rules = false_negative_rules(query, negatives, paired, key_ids, negative_ids, guide, guide_margin, guide_margin_mode,
                                  decoupled, eps, checks)
    if smoothing and rules.any:
        raise ValueError("label_smoothing is not combined with key_ids, a guide or decoupled=True")
    scale, bound = v.inverse_temperature(temperature, checks, need_bound=normalize)
    check_agreement(scope, "query/key", query, validate, negatives is not None, paired, in_batch_negatives)
    limit = bound if normalize else None  # |S| <= limit: unit rows, a host-known scale
    key = key.to(query.dtype)
    negatives = None if negatives is None else negatives.to(query.dtype)

    constant_pool = negatives is not None and not paired and not negatives.requires_grad and negatives.shape[0] > 0
    plain = not rules.any and not smoothing
    if plain and not scope.distributed and in_batch_negatives and not paired and not constant_pool:
        # The common case (info-nce-pytorch's default, MNRL with live hard negatives): one
        # engine problem on the raw rows, normalised inside; the positive is candidate i.
        per_query = in_batch(query, key, negatives, scale, limit, Options(normalize, eps, chunk_size, backend))
        return reduce(per_query, float(n), reduction, scope, checks, v.output_needs_check(normalize, bound))
    spread = gather if gather_negatives is None else gather_negatives
    # Otherwise loss_i = log sum over candidate groups of exp(s_ic - s_ii): the keys, the pool, the
    # paired negatives, each with its false negatives left out (see _info_nce_groups).
    per_query, learned = candidate_groups(query, key, negatives, paired, in_batch_negatives, scale, scope, spread, limit,
                                          normalize, Options(normalize=False, eps=eps, chunk_size=chunk_size, backend=backend),
                                          rules, smoothing, checks)
    return reduce(per_query, float(n), reduction, scope, checks, v.output_needs_check(normalize, bound), extra=learned)


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
    no_negatives = negatives is None or negatives.shape[-2] == 0
    if no_negatives and not in_batch_negatives:
        # one answer whichever way the caller got here: no argument, or an empty pool (a fresh queue)
        given = "needs negatives" if negatives is None else "got an empty negatives pool (a queue not yet filled?)"
        raise ValueError(f"in_batch_negatives=False {given}: a query's only candidate is then its own key and the loss "
                         "is identically 0")
    return n, paired
