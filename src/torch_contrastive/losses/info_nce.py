"""InfoNCE with candidates beyond the batch: hard negatives and queues (SPEC §10).

One query/key form covers the retrieval and self-supervision losses that add candidates
to the batch: sentence-transformers' MultipleNegativesRankingLoss (in-batch keys plus a
pool of hard negatives), info-nce-pytorch (paired or unpaired negatives), MoCo (a queue
of past keys) and lightly's memory bank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _validation as v
from .._normalize import prepare
from ..distributed import Scope, all_gather_with_grad, make_scope
from ..engine import Scale, fixed_scale_applies, softmax_terms
from ..positives import Positives
from ._common import check_agreement, pair_partner, reduce

__all__ = ["info_nce_loss"]


def info_nce_loss(
    query: Tensor,
    key: Tensor,
    negatives: Tensor | None = None,
    temperature: float | Tensor = 0.07,
    *,
    negative_mode: str = "unpaired",
    in_batch_negatives: bool = True,
    normalize: bool = True,
    reduction: str = "mean",
    chunk_size: int | None = None,
    gather: bool = False,
    gather_negatives: bool | None = None,
    grad_reduction: str = "mean",
    eps: float = 1e-12,
    validate: bool = True,
) -> Tensor:
    """InfoNCE of queries against their keys plus extra negatives (SPEC §10).

    Key ``i`` is query ``i``'s positive. The candidates of query ``i`` are its key, the
    other keys (``in_batch_negatives=True``), and the negatives: the whole pool
    (``negative_mode="unpaired"``, (M, D)) or its own K rows (``"paired"``, (N, K, D)).

        ``loss_i = -s(q_i, k_i) + log sum_{c in cand(i)} exp(s(q_i, c))``

    with ``s = <q, c> / tau`` on L2-normalised rows (``normalize=True``).

    Equivalences (README, "Candidates beyond the batch"):

    * info-nce-pytorch ``info_nce(q, k)``: the defaults; ``info_nce(q, k, negs,
      negative_mode=m)``: ``in_batch_negatives=False``;
    * sentence-transformers' MultipleNegativesRankingLoss with ``scale``: ``temperature
      = 1 / scale``, ``negatives`` = the batch's hard negatives (unpaired pool);
    * MoCo: ``negatives=queue.features`` (a :class:`~torch_contrastive.FeatureQueue`),
      ``in_batch_negatives=False``.

    Args:
        query: (N, D) float tensor.
        key: (N, D) float tensor, row i the positive of query i.
        negatives: None, (M, D) (``"unpaired"``) or (N, K, D) (``"paired"``).
        temperature: tau > 0, float or 0-dim tensor (default 0.07).
        negative_mode: ``"unpaired"`` (a pool shared by every query) or ``"paired"``.
        in_batch_negatives: the other queries' keys are negatives too.
        normalize: cosine similarity (default) or raw dot products.
        reduction: ``"mean"`` over queries, ``"sum"``, or ``"none"`` ((N,) per query).
        chunk_size: tile edge of the query x shared-candidate products (None: automatic).
        gather: under ``torch.distributed``, every rank's keys (and unpaired negatives,
            see ``gather_negatives``) are candidates of every query; each rank computes
            its own queries; paired negatives stay with their query.
        gather_negatives: gather the unpaired negatives too (default: ``gather``). Pass
            ``False`` for rows that are already global, such as a queue filled with
            ``FeatureQueue.push(..., gather=True)``: gathering them again would repeat them.
        grad_reduction, eps, validate: see :func:`~torch_contrastive.nt_xent_loss`.

    Returns:
        0-dim loss (fp32 for half inputs), or (N,) per-query values.

    Memory: O((N + M) * D + tile^2) for the shared candidates; paired negatives add
    O(N * K) logits (one batched product), never N x N x K. Candidates that do not require
    grad (a queue) skip their ``G.T @ Q`` products in backward.
    """
    n, paired = _check_inputs(query, key, negatives, negative_mode, in_batch_negatives)
    v.check_options(reduction=reduction, chunk_size=chunk_size, grad_reduction=grad_reduction, eps=eps)
    if gather_negatives is not None and not isinstance(gather_negatives, bool):
        raise TypeError(f"gather_negatives must be None or a bool, got {type(gather_negatives).__name__}")
    scope = make_scope(gather, grad_reduction)
    checks = v.Checks(validate, scope)
    checks.finite(query, "query")
    checks.finite(key, "key")
    if negatives is not None:
        checks.finite(negatives, "negatives")
    scale, bound = v.inverse_temperature(temperature, checks, need_bound=normalize)
    check_agreement(scope, "query/key", query, validate, negatives is not None, paired, in_batch_negatives)
    fixed = fixed_scale_applies(normalize, bound, query.dtype)
    key = key.to(query.dtype)
    negatives = None if negatives is None else negatives.to(query.dtype)

    constant_pool = negatives is not None and not paired and not negatives.requires_grad and negatives.shape[0] > 0
    if not scope.distributed and in_batch_negatives and not paired and not constant_pool:
        # The common case (info-nce-pytorch's default, MNRL with live hard negatives): one
        # engine call on the raw rows, normalised inside; the positive is candidate i.
        per_query = _in_batch(query, key, negatives, scale, fixed, normalize, eps, chunk_size)
    else:
        spread = gather if gather_negatives is None else gather_negatives
        per_query = _general(query, key, negatives, paired, in_batch_negatives, scale, scope, spread, fixed, normalize, eps,
                             chunk_size)
    return reduce(per_query, float(n), reduction, scope, checks, v.output_needs_check(normalize, bound))


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
              eps: float, chunk_size: int | None) -> Tensor:
    n = query.shape[0]
    cols = key if negatives is None else torch.cat([key, negatives])
    positives = Positives.from_partner(pair_partner(n, "identity", 0, query.device), cols.shape[0], self_offset=None,
                                       layout="identity" if negatives is None else None)
    per_query, _ = softmax_terms(query, cols, scale, self_offset=None, positives=positives, fixed=fixed, normalize=normalize,
                                 eps=eps, chunk_size=chunk_size)
    return per_query


def _general(query: Tensor, key: Tensor, negatives: Tensor | None, paired: bool, in_batch: bool, scale: Scale, scope: Scope,
             spread: bool, fixed: bool, normalize: bool, eps: float, chunk_size: int | None) -> Tensor:
    """Per-query loss as ``log sum exp`` of terms relative to the positive logit ``s_ii``.

    Each candidate group is its own engine call: the (gathered) keys, with query i's
    positive read off the tile, and the unpaired pool, whose log-sum-exp needs no
    positive -- a constant pool (a queue) then costs no gradient products and no copy
    beside the batch. The positive logit and the paired negatives are O(N * D) and
    O(N * K * D) products.
    """
    n = query.shape[0]
    q = prepare(query, normalize, eps)
    k = prepare(key, normalize, eps)
    s_pos = (q * k).sum(1) * scale
    terms: list[Tensor] = []
    if in_batch:
        keys = scope.rows(k)
        # the engine's row term is LSE_i - s_ii: query i's key is global column offset + i
        positives = Positives.from_partner(pair_partner(n, "identity", scope.offset, q.device), keys.shape[0], self_offset=None)
        terms.append(softmax_terms(q, keys, scale, self_offset=None, positives=positives, fixed=fixed, chunk_size=chunk_size)[0])
    else:
        terms.append(torch.zeros_like(s_pos))  # the positive's own exp(s_ii - s_ii)
    if negatives is not None and not paired:
        pool = prepare(negatives, normalize, eps)
        pool = all_gather_with_grad(pool) if spread and scope.distributed else pool
        if pool.shape[0]:  # an empty queue adds nothing
            terms.append(softmax_terms(q, pool, scale, self_offset=None, fixed=fixed, chunk_size=chunk_size)[0] - s_pos)
    if paired and negatives is not None:
        own = prepare(negatives.reshape(-1, negatives.shape[-1]), normalize, eps).reshape(negatives.shape)
        # (N, K, D) x (N, D, 1): each query against its own K negatives only, in the
        # compute dtype even inside an autocast region (as the engine)
        with torch.autocast(q.device.type, enabled=False):
            paired_logits = torch.bmm(own, q[:, :, None])[:, :, 0]
        terms.append(paired_logits * scale - s_pos[:, None])
    if len(terms) == 1:
        # in_batch_negatives=False and an empty pool: the positive is the only candidate
        return terms[0] if in_batch else s_pos * 0.0
    return torch.logsumexp(torch.cat([t if t.ndim == 2 else t[:, None] for t in terms], 1), 1)
