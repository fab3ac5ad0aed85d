"""False negatives of InfoNCE (README, "False negatives"): which candidates leave a query's denominator.

Three rules, each optional: equal ids (a candidate that duplicates the query's positive), a
guide model's verdict (GISTEmbed: a candidate whose guide cosine with the query beats the
positive's, less a margin), and the positive itself (DCL). :func:`false_negative_rules` checks
the arguments and builds :class:`Rules`; :func:`key_exclusion`, :func:`pool_exclusion` and
:func:`paired_exclusion` turn them into what each candidate group's engine call takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _validation as v
from .._normalize import prepare
from ..distributed import Scope, gather_padded, gather_sizes
from ..positives import Exclusion, Positives

__all__ = ["Rules", "false_negative_rules", "key_exclusion", "learn", "learning", "paired_exclusion", "pool_exclusion"]


def learn(learners: list[Exclusion], values: list[float]) -> None:
    """Hand each exclusion its part of the host-read tile flags (in recording order)."""
    start = 0
    for exclusion in learners:
        count = 2 * len(exclusion.record.flags)  # two counts per tile
        exclusion.learn_from(values[start : start + count])
        start += count


@dataclass
class Rules:
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


def unit(x: Tensor, eps: float) -> Tensor:
    """Detached L2-normalised rows (along the last dim) in fp32 / fp64."""
    x = prepare(x.detach().reshape(-1, x.shape[-1]), True, eps).reshape(x.shape)
    return x


def false_negative_rules(query: Tensor, negatives: Tensor | None, paired: bool, key_ids: object, negative_ids: object,
                          guide: object, margin: object, mode: str, decoupled: object, eps: float, checks: v.Checks) -> Rules:
    if not isinstance(decoupled, bool):
        raise TypeError(f"decoupled must be a bool, got {type(decoupled).__name__}")
    rules = Rules(decoupled=decoupled)
    _check_ids(rules, query, negatives, paired, key_ids, negative_ids)
    if guide is not None:
        _check_guide(rules, query, negatives, paired, guide, margin, mode, eps, checks)
    return rules


def _check_ids(rules: Rules, query: Tensor, negatives: Tensor | None, paired: bool, key_ids: object, negative_ids: object) -> None:
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


def _check_guide(rules: Rules, query: Tensor, negatives: Tensor | None, paired: bool, guide: object, margin: object, mode: str,
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
    rules.guide_query, rules.guide_key = unit(g_query, eps), unit(g_key, eps)
    if negatives is not None:
        g_neg = v.check_embeddings(guide[2], "guide[2] (g_negatives)", min_ndim=2, max_ndim=3, empty_rows=not paired)
        if tuple(g_neg.shape[:-1]) != tuple(negatives.shape[:-1]) or g_neg.shape[-1] != g_query.shape[1]:
            raise ValueError(f"guide[2] (g_negatives) must have shape {(*negatives.shape[:-1], g_query.shape[1])}, "
                             f"got {tuple(g_neg.shape)}")
        checks.finite(g_neg, "guide[2] (g_negatives)")
        rules.guide_negatives = unit(g_neg, eps)
    positive = (rules.guide_query * rules.guide_key).sum(1)
    rules.threshold = positive - (margin if mode == "absolute" else margin * positive.abs())


def learning(exclusion: Exclusion | None, learners: list[Exclusion] | None) -> Exclusion | None:
    """``exclusion``, registered among ``learners`` when it records tile flags."""
    if exclusion is not None and exclusion.learn and learners is not None:
        learners.append(exclusion)
    return exclusion


def key_exclusion(rules: Rules, scope: Scope, learn: bool = False) -> Exclusion | None:
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


def pool_exclusion(rules: Rules, spread: bool, scope: Scope, learn: bool = False) -> Exclusion | None:
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


def paired_exclusion(rules: Rules) -> Tensor | None:
    """(N, K) bool: paired negatives that leave their query's denominator."""
    out = None
    if rules.key_ids is not None and rules.negative_ids is not None:
        out = rules.negative_ids == rules.key_ids[:, None]
    if rules.threshold is not None and rules.guide_query is not None and rules.guide_negatives is not None:
        verdict = torch.bmm(rules.guide_negatives, rules.guide_query[:, :, None])[:, :, 0] > rules.threshold[:, None]
        out = verdict if out is None else out | verdict
    return out
