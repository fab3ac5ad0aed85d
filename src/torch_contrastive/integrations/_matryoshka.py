"""sentence-transformers' ``MatryoshkaLoss`` with its arguments and values, the ranking losses' prefixes in one pass.

The peer embeds once and calls its inner loss once per prefix (each prefix cut and L2-normalised). Here
the ranking losses of :mod:`.sentence_transformers` -- ``MultipleNegativesRankingLoss``, its cached and
symmetric forms -- take every prefix from one pass over the feature bands
(:func:`~torch_contrastive.matryoshka_info_nce_loss`), and the cached form embeds once and replays once
for all prefixes. Any other loss (ours with options the one pass does not cover, or a foreign module)
is called once per prefix on the once-computed embeddings, as the peer does.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..distributed import all_gather_with_grad, is_active
from ..engine.prefixes import Targets
from ..losses.matryoshka import matryoshka_info_nce_loss, one_pass_softmax
from ..losses.prefix_calls import check_prefixes, prefix_sum, shrink
from ._citations import MATRYOSHKA
from ._gist import GISTEmbedLoss
from .sentence_transformers import (
    SYMMETRIC_DIRECTIONS,
    SYMMETRIC_PARTITION,
    GradientCache,
    MultipleNegativesRankingLoss,
    embed,
    encoder_of,
)


def one_pass(loss: nn.Module) -> bool:
    """Whether ``loss`` is a ranking loss whose prefixes the prefix engine computes in one pass: query-to-doc
    alone, or the symmetric pair per direction; no hardness term (``gather_across_devices`` included)."""
    if not isinstance(loss, MultipleNegativesRankingLoss):
        return False
    forms = loss.directions == ("query_to_doc",) or (loss.directions == SYMMETRIC_DIRECTIONS and loss.partition_mode == SYMMETRIC_PARTITION)
    hard = loss.hardness_mode is not None and loss.hardness_strength > 0
    return forms and not hard


def _gathered_one_pass(queries: Tensor, docs: list[Tensor], dims: Sequence[int], weights: Sequence[float], tau: float,
                       symmetric: bool, chunk_size: int | None) -> Tensor:
    """The ranking loss with ``gather_across_devices`` over every prefix in one pass, as the peer gathers: this
    rank's queries against every rank's docs (each column gathered with its gradient, rank-ordered), query
    ``i``'s positive at its global row; symmetric: this rank's positives against every rank's queries too, the
    mean of both. The value is this rank's mean (the framework averages the gradients)."""
    rows = queries.shape[0]
    if any(d.shape[0] != rows for d in docs):
        raise ValueError(f"every embedding column must have the queries' {rows} rows, got {[d.shape[0] for d in docs]}")
    partner = torch.arange(rows, device=queries.device) + torch.distributed.get_rank() * rows
    all_docs = torch.cat([all_gather_with_grad(d.to(queries.dtype)) for d in docs])
    targets = Targets(partner=partner)
    dims_, weights_ = list(dims), list(weights)
    loss = one_pass_softmax(queries, all_docs, targets, dims_, weights_, tau, None, 1e-12, chunk_size, None)
    if symmetric:
        back = one_pass_softmax(docs[0].to(queries.dtype), all_gather_with_grad(queries), targets, dims_, weights_, tau, None,
                                1e-12, chunk_size, None)
        loss = 0.5 * (loss + back)
    return loss


class _Shrunk:
    """The model's forward during a foreign loss's calls: the first prefix runs the model and keeps each
    output; later prefixes reuse them in call order; every call returns the output with its embedding cut
    to the current prefix and normalised (a new dict: the model's own output is left as it was)."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward, self.dim, self.calls, self.first = forward, 0, 0, True
        self.kept: list[dict[str, Tensor]] = []

    def prefix(self, dim: int, first: bool) -> None:
        self.dim, self.calls, self.first = dim, 0, first

    def __call__(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        if self.first:
            out = self.forward(features)
            # a copy: a SentenceTransformer returns its input dict, which a later call (a guide model's, on
            # the same features) overwrites in place
            self.kept.append(dict(out))
        out = self.kept[self.calls]
        self.calls += 1
        return {**out, "sentence_embedding": shrink(out["sentence_embedding"], self.dim)}


class MatryoshkaLoss(nn.Module):
    """sentence-transformers' ``MatryoshkaLoss``: ``loss`` summed over embedding prefixes, same arguments
    and values.

    Example:
        >>> from torch_contrastive.integrations.sentence_transformers import MatryoshkaLoss, MultipleNegativesRankingLoss
        >>> loss = MatryoshkaLoss(model, MultipleNegativesRankingLoss(model), [768, 512, 256, 128, 64])
        >>> trainer = SentenceTransformerTrainer(model=model, train_dataset=pairs, loss=loss)

    Args:
        model: the SentenceTransformer being trained.
        loss: the inner loss; the ranking losses and GIST of this module run every prefix in one pass.
        matryoshka_dims: prefix sizes (sorted largest first, with their weights, as the peer does).
        matryoshka_weights: one weight per dim (None: all 1).
        n_dims_per_step: the prefixes per call: -1 all, else a random sample of that many (Python's
            ``random``, as the peer draws them).

    Memory and products: the ranking losses and GIST take ``D`` products per pair for all prefixes together
    (the peer ``sum(d_p)``) and one strip of tiles per distinct prefix (GIST runs its guide once); other losses
    as the peer.
    """

    def __init__(self, model: nn.Module, loss: nn.Module, matryoshka_dims: Sequence[int],
                 matryoshka_weights: Sequence[float] | None = None, n_dims_per_step: int = -1) -> None:
        super().__init__()
        self.model = encoder_of(model, "model")
        self.loss = encoder_of(loss, "loss")
        width = getattr(model, "get_embedding_dimension", None)
        self.width: int | None = width() if callable(width) else None
        dims, weights = check_prefixes(matryoshka_dims, matryoshka_weights, self.width)
        if isinstance(n_dims_per_step, bool) or not isinstance(n_dims_per_step, int) or n_dims_per_step == 0 or n_dims_per_step < -1:
            raise ValueError(f"n_dims_per_step must be -1 (every dim) or a positive int, got {n_dims_per_step!r}")
        if hasattr(loss, "calculate_loss") and not isinstance(loss, GradientCache):
            raise TypeError("a foreign gradient-caching loss cannot be wrapped here: use "
                            "torch_contrastive's CachedMultipleNegativesRankingLoss")
        pairs = sorted(zip(dims, weights), key=lambda p: p[0], reverse=True)
        self.matryoshka_dims = tuple(d for d, _ in pairs)
        self.matryoshka_weights = tuple(w for _, w in pairs)
        self.n_dims_per_step = n_dims_per_step

    def _prefixes(self, cached: bool) -> tuple[list[int], list[float]]:
        chosen = list(range(len(self.matryoshka_dims)))
        if 0 < self.n_dims_per_step < len(chosen):
            chosen = random.sample(chosen, self.n_dims_per_step)
            if not cached:  # the peer sorts its sample for the plain losses only
                chosen.sort()
        return [self.matryoshka_dims[i] for i in chosen], [self.matryoshka_weights[i] for i in chosen]

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        features = list(sentence_features)
        dims, weights = self._prefixes(isinstance(self.loss, GradientCache))
        if isinstance(self.loss, GISTEmbedLoss):  # the guide's embeddings once, every prefix in one pass
            return self._gist(self.loss, features, labels, dims, weights)
        if isinstance(self.loss, GradientCache):  # ours: one embedding pass and one replay for every prefix
            base = self.loss.embedding_loss(features, labels)
            return self.loss.cached_forward(features, labels,
                                            lambda embeddings, labels: self.loss_from_embeddings(embeddings, labels, dims, weights, base))
        if isinstance(self.loss, MultipleNegativesRankingLoss):
            embeddings = [embed(self.loss.model, f) for f in features]
            return self.loss_from_embeddings(embeddings, labels, dims, weights, self.loss.compute_loss_from_embeddings)
        return self._per_prefix(features, labels, dims, weights)

    @staticmethod
    def _gist(inner: GISTEmbedLoss, features: list[dict[str, Tensor]], labels: Tensor | None, dims: list[int],
              weights: list[float]) -> Tensor:
        """GISTEmbed (cached or not) over every prefix: the guide run once (its embeddings are not cut), the model's
        embeddings once (the cached form: in mini-batches, replayed once), the prefixes' products in one pass."""
        guides = inner.guide_embeddings(features)

        def every_prefix(embeddings: list[Tensor], _labels: Tensor | None) -> Tensor:
            return inner.compute_loss_from_embeddings(embeddings, guides, (dims, weights))

        if isinstance(inner, GradientCache):
            return inner.cached_forward(features, labels, every_prefix)
        return every_prefix([embed(inner.model, f) for f in features], labels)

    def loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None, dims: Sequence[int], weights: Sequence[float],
                             base: Callable[[list[Tensor], Tensor | None], Tensor] | None = None) -> Tensor:
        """Every prefix's loss of the whole batch's ``embeddings`` (``[queries, positives, *negatives]``),
        weighted and summed: the ranking losses' in one pass, another's by ``base(cut embeddings, labels)``
        (default: the inner loss's ``compute_loss_from_embeddings``) once per prefix."""
        inner = self.loss
        if len(embeddings) < 2:
            raise ValueError(f"expected at least 2 embedding columns (queries, positives), got {len(embeddings)}")
        if one_pass(inner):
            assert isinstance(inner, MultipleNegativesRankingLoss)  # one_pass says so
            docs = embeddings[1:]
            symmetric = inner.directions == SYMMETRIC_DIRECTIONS
            if inner.gather_across_devices and is_active():
                return _gathered_one_pass(embeddings[0], docs, dims, weights, 1.0 / inner.scale, symmetric, inner.chunk_size)
            return matryoshka_info_nce_loss(embeddings[0], docs[0], dims, weights, 1.0 / inner.scale,
                                            negatives=torch.cat(docs[1:]) if len(docs) > 1 else None,
                                            symmetric=symmetric, chunk_size=inner.chunk_size)
        if base is None:
            base = getattr(inner, "compute_loss_from_embeddings", None)
            if base is None:
                raise TypeError(f"{type(inner).__name__} has no compute_loss_from_embeddings: call the MatryoshkaLoss itself")
        per_prefix = base
        return prefix_sum(dims, weights, lambda dim: per_prefix([shrink(e, dim) for e in embeddings], labels))

    def _per_prefix(self, features: list[dict[str, Tensor]], labels: Tensor | None, dims: list[int],
                    weights: list[float]) -> Tensor:
        """A foreign loss, called once per prefix with the model's outputs computed once (the peer's way)."""
        shrunk = _Shrunk(self.model.forward)
        self.model.forward = shrunk  # type: ignore[method-assign]
        calls = iter(range(len(dims)))

        def term(dim: int) -> Tensor:
            shrunk.prefix(dim, first=next(calls) == 0)  # the first prefix runs the model, the others reuse it
            # distillation labels of the embedding's width are cut with it, as the peer does
            wide = isinstance(labels, Tensor) and labels.ndim in (2, 3) and labels.shape[-1] == self.width
            return self.loss(features, labels[..., :dim] if wide else labels)  # type: ignore[index]

        try:
            return prefix_sum(dims, weights, term)
        finally:
            del self.model.forward  # the instance attribute: the class's forward again

    @property
    def citation(self) -> str:
        return MATRYOSHKA

    def get_config_dict(self) -> dict[str, Any]:
        return {"loss": type(self.loss).__name__, "matryoshka_dims": self.matryoshka_dims,
                "matryoshka_weights": self.matryoshka_weights, "n_dims_per_step": self.n_dims_per_step}
