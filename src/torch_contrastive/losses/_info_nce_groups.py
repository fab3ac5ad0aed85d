"""InfoNCE's candidates as engine problems: the in-batch keys, an unpaired pool, paired negatives.

``loss_i = log sum_{c in cand(i)} exp(s_ic - s_ii)`` where the candidates come in groups that
differ in what the engine must do with them: the keys (gathered under ``gather=True``, query
i's positive among them), an unpaired pool (a queue: a constant, so no gradient products and
no copy beside the batch) and paired negatives (each query's own K rows, one batched product).
Each shared group is one :class:`~torch_contrastive.engine.Problem`; the groups' log-sum-exps
are joined relative to the positive logit. False negatives leave each group through its
exclusion (:mod:`._false_negatives`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .. import _validation as v
from .._normalize import prepare
from ..distributed import Scope, all_gather_with_grad
from ..engine import Options, Problem, Scale, Softmax, solve
from ..positives import Exclusion, Positives
from ._false_negatives import Rules, key_exclusion, learn, learning, paired_exclusion, pool_exclusion
from ._pairing import pair_partner, safe_logsumexp

__all__ = ["candidate_groups", "in_batch"]


def in_batch(query: Tensor, key: Tensor, negatives: Tensor | None, scale: Scale, limit: float | None,
             options: Options) -> Tensor:
    """Per-query loss when every candidate is live and nothing is left out: one problem over the
    keys (and the pool after them), query i's positive is candidate i."""
    n = query.shape[0]
    cols = key if negatives is None else torch.cat([key, negatives])
    positives = Positives.from_partner(pair_partner(n, "identity", 0, query.device), cols.shape[0], self_offset=None,
                                       layout="identity" if negatives is None else None, shift=0)
    per_query, _ = solve(Problem(query, cols, scale, Softmax(), positives=positives, bound=limit, options=options))
    return per_query


def candidate_groups(query: Tensor, key: Tensor, negatives: Tensor | None, paired: bool, in_batch: bool, scale: Scale,
                     scope: Scope, spread: bool, limit: float | None, normalize: bool, options: Options, rules: Rules,
                     smoothing: float, checks: v.Checks) -> tuple[Tensor, tuple[Tensor, Callable[[list[float]], None]] | None]:
    """Per-query loss as ``log sum exp`` of terms relative to the positive logit ``s_ii``, and the
    guide's learned flags for the call's one validation read (see :func:`learning`), if any.

    With ``validate=True`` (one read anyway, one process) the guide's tiles learn in forward which
    of them exclude anything; backward then skips the others' guide products. (Not when a read
    happened already -- a tensor temperature's value -- which would make it two.)
    """
    learners: list[Exclusion] | None = [] if checks.enabled and checks.reads == 0 and not scope.distributed \
        and rules.guide_query is not None else None
    n = query.shape[0]
    eps = options.eps
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
        exclude = learning(key_exclusion(rules, scope, learners is not None), learners)
        terms.append(solve(Problem(q, keys, scale, Softmax(exclude=exclude), positives=positives, bound=limit,
                                   options=options))[0])
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
            exclude = learning(pool_exclusion(rules, spread, scope, learners is not None), learners)
            terms.append(solve(Problem(q, pool, scale, Softmax(exclude=exclude), bound=limit, options=options))[0] - s_pos)
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
        out = paired_exclusion(rules)
        relative = paired_logits - s_pos[:, None]
        terms.append(relative if out is None else relative.masked_fill(out, float("-inf")))
    flags = [f for f in (e.recorded() for e in learners or ()) if f is not None]
    learned = (torch.cat(flags), lambda values: learn(learners or [], values)) if flags else None
    if len(terms) == (0 if rules.decoupled or in_batch else 1):
        # in_batch_negatives=False and an empty pool: only the positive (or, decoupled, nothing)
        return s_pos * 0.0, learned
    loss = safe_logsumexp(torch.cat([t if t.ndim == 2 else t[:, None] for t in terms], 1))
    if uniform is not None:  # (1 - eps) CE + eps mean_c (LSE - s_ic) = CE + eps (s_ii - mean_c s_ic)
        loss = loss + smoothing * (s_pos - uniform / count)
    return loss, learned
