"""The ``bench --loss matryoshka`` case: MultipleNegativesRankingLoss summed over five embedding prefixes.

Ours is :func:`~torch_contrastive.matryoshka_info_nce_loss` (every prefix from one pass over the feature
bands); the peer is what sentence-transformers' ``MatryoshkaLoss`` computes after its one forward: each
prefix cut and normalised, then its ``MultipleNegativesRankingLoss`` on those embeddings, once per prefix.
Both take the same (N, D) queries and positives with scale 20 and the prefixes of :data:`PREFIXES` up to D.
"""

from __future__ import annotations

from typing import Any

import torch

#: The prefixes of sentence-transformers' Matryoshka examples (those up to D are used, D itself first).
PREFIXES = (768, 512, 256, 128, 64)


def prefixes(d: int) -> list[int]:
    return [d, *(p for p in PREFIXES if p < d)]


def build(impl: str, x: torch.Tensor, gen: torch.Generator) -> tuple[Any, list[torch.Tensor]]:
    """``impl`` ``"ours"`` or ``"sentence-transformers"``: the closure and its leaves (queries, positives)."""
    import torch_contrastive as tc
    from torch_contrastive.losses.prefix_calls import prefix_sum, shrink

    n, d = x.shape
    k = torch.randn(n, d, generator=gen).to(x).requires_grad_()
    dims = prefixes(d)
    if impl == "ours":
        return (lambda: tc.matryoshka_info_nce_loss(x, k, dims, None, 0.05)), [x, k]
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    peer = MultipleNegativesRankingLoss(torch.nn.Identity())  # type: ignore[arg-type]  # the model is not used on embeddings

    def per_prefix() -> torch.Tensor:  # what the peer's wrapper computes after its one forward
        return prefix_sum(dims, [1.0] * len(dims),
                          lambda p: peer.compute_loss_from_embeddings([shrink(e, p) for e in (x, k)], None))  # type: ignore[arg-type]

    return per_prefix, [x, k]
