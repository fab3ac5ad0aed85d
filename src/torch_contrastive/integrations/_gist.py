"""sentence-transformers' ``GISTEmbedLoss`` and ``CachedGISTEmbedLoss`` (Solatorio 2024), computed by
torch-contrastive: a guide model's similarities remove false negatives from the in-batch blocks, in row
strips (no N x N matrix held); the cached form embeds in mini-batches and replays (gradient caching)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validation as v
from ..distributed import all_gather_with_grad, is_active
from ._citations import GIST, GRADCACHE
from ._strips import per_row_losses
from .sentence_transformers import GradientCache, embed, encoder_of, widened


class GISTEmbedLoss(nn.Module):
    """sentence-transformers' ``GISTEmbedLoss`` (Solatorio 2024), same arguments and values.

    Row i's softmax (temperature ``temperature``, cosine similarities) runs over the
    anchor-positive block, and with ``contrast_anchors`` the anchor-anchor block, with
    ``contrast_positives`` the positive-positive block (positive i against every positive),
    and the anchor-negative block when a third column is given. A candidate leaves row i
    when the guide model rates it above the row's positive: guide similarity
    ``> g_ip - margin`` (``"absolute"``) or ``> g_ip - margin * |g_ip|`` (``"relative"``);
    the positive itself stays.

    Args:
        model: the SentenceTransformer being trained.
        guide: a SentenceTransformer run without gradients; when its vocabulary differs
            from the model's (or its ``max_seq_length`` is shorter), texts are decoded
            with the model's tokenizer and re-tokenised for the guide.
        temperature: tau (default 0.01).
        margin_strategy: ``"absolute"`` or ``"relative"``.
        margin: m >= 0 (default 0).
        contrast_anchors: add the anchor-anchor block (default True, as the peer).
        contrast_positives: add the positive-positive block (default True, as the peer).
        gather_across_devices: positives and negatives of every rank are candidates.
        chunk_size: rows per strip (None: automatic).
    """

    def __init__(self, model: nn.Module, guide: nn.Module, temperature: float = 0.01, margin_strategy: str = "absolute",
                 margin: float = 0.0, contrast_anchors: bool = True, contrast_positives: bool = True,
                 gather_across_devices: bool = False, *, chunk_size: int | None = None) -> None:
        super().__init__()
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"temperature must be a positive float, got {temperature!r}")
        if margin_strategy not in ("absolute", "relative"):
            raise ValueError(f"margin_strategy must be 'absolute' or 'relative', got {margin_strategy!r}")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
            raise ValueError(f"margin must be a float >= 0, got {margin!r}")
        self.model, self.guide = encoder_of(model, "model"), encoder_of(guide, "guide")
        self.temperature, self.margin_strategy, self.margin = float(temperature), margin_strategy, float(margin)
        self.contrast_anchors = v.check_flag(contrast_anchors, "contrast_anchors")
        self.contrast_positives = v.check_flag(contrast_positives, "contrast_positives")
        self.gather_across_devices = v.check_flag(gather_across_devices, "gather_across_devices")
        self.chunk_size = chunk_size
        self.must_retokenize = self._must_retokenize()

    def get_config_dict(self) -> dict[str, Any]:
        """What the trainer's model card shows, as the peer's."""
        return {"guide": self.guide, "temperature": self.temperature, "margin_strategy": self.margin_strategy,
                "margin": self.margin, "contrast_anchors": self.contrast_anchors, "contrast_positives": self.contrast_positives,
                "gather_across_devices": self.gather_across_devices}

    @property
    def citation(self) -> str:
        return GIST

    def _must_retokenize(self) -> bool:
        mine, theirs = getattr(self.model, "tokenizer", None), getattr(self.guide, "tokenizer", None)
        if mine is None or theirs is None:
            return False
        shorter = getattr(self.guide, "max_seq_length", 0) < getattr(self.model, "max_seq_length", 0)
        return bool(mine.get_vocab() != theirs.get_vocab() or shorter)

    def _guide_features(self, features: dict[str, Any]) -> dict[str, Any]:
        if not self.must_retokenize:
            return features
        tokenizer: Any = getattr(self.model, "tokenizer")  # noqa: B009 (a SentenceTransformer attribute)
        texts = tokenizer.batch_decode(features["input_ids"], skip_special_tokens=True)
        prepare: Any = getattr(self.guide, "preprocess", None) or getattr(self.guide, "tokenize")  # noqa: B009
        device = next(self.guide.parameters()).device
        return {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in prepare(texts).items()}

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        columns = list(sentence_features)
        embeddings = [embed(self.model, f) for f in columns]
        return self.compute_loss_from_embeddings(embeddings, self.guide_embeddings(columns))

    def guide_embeddings(self, columns: list[dict[str, Any]]) -> list[Tensor]:
        """The guide's embeddings of every column (no graph; retokenised when the tokenisers differ)."""
        with torch.no_grad():
            return [embed(self.guide, self._guide_features(f)) for f in columns]

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], guide_embeddings: list[Tensor],
                                     prefixes: tuple[Sequence[int], Sequence[float]] | None = None) -> Tensor:
        """The loss of ``[anchor, positive(, negative)]`` and the guide's embeddings of the same rows;
        ``prefixes`` ``(dims, weights)``: every Matryoshka prefix's, weighted and summed, in one pass (see
        :func:`gist_loss`)."""
        if len(embeddings) not in (2, 3) or len(guide_embeddings) != len(embeddings):
            raise ValueError(f"expected 2 or 3 embedding columns and as many guide columns, got {len(embeddings)} and {len(guide_embeddings)}")
        third = len(embeddings) == 3
        return gist_loss(embeddings[0], embeddings[1], guide_embeddings[0], guide_embeddings[1],
                         embeddings[2] if third else None, guide_embeddings[2] if third else None, temperature=self.temperature,
                         margin=self.margin, margin_strategy=self.margin_strategy, contrast_anchors=self.contrast_anchors,
                         contrast_positives=self.contrast_positives, gather=self.gather_across_devices,
                         chunk_size=self.chunk_size, prefixes=prefixes)


def gist_loss(anchor: Tensor, positive: Tensor, guide_anchor: Tensor, guide_positive: Tensor,
              negative: Tensor | None = None, guide_negative: Tensor | None = None, *, temperature: float = 0.01,
              margin: float = 0.0, margin_strategy: str = "absolute", contrast_anchors: bool = True,
              contrast_positives: bool = True, gather: bool = False, chunk_size: int | None = None,
              prefixes: tuple[Sequence[int], Sequence[float]] | None = None) -> Tensor:
    """GISTEmbed's loss on embeddings (see :class:`GISTEmbedLoss`); the mean over this rank's anchors.

    ``prefixes``: ``(dims, weights)``: ``sum_p w_p`` of the loss of every embedding cut to ``d_p`` features and
    normalised on its own (Matryoshka; the guide's embeddings are not cut), in one pass: each block's products
    accumulate over the feature bands, ``D`` per pair for every prefix, and the guide's verdicts are formed once.
    """
    dims, weights = (None, None) if prefixes is None else (list(prefixes[0]), [float(w) for w in prefixes[1]])
    # the model's rows: normalised here for the plain loss, per prefix (raw here) for Matryoshka
    unit = [widened(x) if dims else F.normalize(widened(x), dim=-1) for x in (anchor, positive)]
    g_unit = [F.normalize(widened(x.detach()), dim=-1) for x in (guide_anchor, guide_positive)]
    neg = None if negative is None else widened(negative) if dims else F.normalize(widened(negative), dim=-1)
    g_neg = None if guide_negative is None else F.normalize(widened(guide_negative.detach()), dim=-1)
    batch, offset = anchor.shape[0], 0
    a, p_local = unit
    ga, gp_local = g_unit
    p_all, gp_all = p_local, gp_local
    if gather and is_active():
        offset = torch.distributed.get_rank() * batch
        p_all, gp_all = all_gather_with_grad(p_local), all_gather_with_grad(gp_local)
        if neg is not None and g_neg is not None:
            neg, g_neg = all_gather_with_grad(neg), all_gather_with_grad(g_neg)
    empty = a.new_zeros(0, a.shape[1])
    n_all, gn_all = (empty, empty) if neg is None or g_neg is None else (neg, g_neg)

    def row_loss(start: int, stop: int, a: Tensor, ga: Tensor, p_all: Tensor, gp_all: Tensor, n_all: Tensor,
                 gn_all: Tensor) -> Tensor:
        rows = torch.arange(stop - start, device=a.device)
        own = rows + offset + start
        g_pos = (ga[start:stop] * gp_all[offset + start:offset + stop]).sum(1, keepdim=True)
        limit = g_pos - (margin * g_pos.abs() if margin_strategy == "relative" else margin)

        def drop(gx: Tensor, gy: Tensor, keep_positive: bool = False) -> Tensor:
            """The guide's verdict: the candidates it rates above the row's positive leave the row."""
            out = gx @ gy.T > limit
            if keep_positive:
                out[rows, own] = False
            return out

        pieces = [(a[start:stop], p_all, drop(ga[start:stop], gp_all, keep_positive=True))]
        if contrast_anchors:
            pieces.append((a[start:stop], a, drop(ga[start:stop], ga)))
        if contrast_positives:
            pieces.append((p_all[offset + start:offset + stop], p_all, drop(gp_all[offset + start:offset + stop], gp_all)))
        if n_all.shape[0]:
            pieces.append((a[start:stop], n_all, drop(ga[start:stop], gn_all)))
        if dims is None or weights is None:
            logits = torch.cat([(x @ y.T).masked_fill(out, -torch.inf) for x, y, out in pieces], dim=1) / temperature
            return torch.logsumexp(logits, dim=1) - logits[rows, own]
        per_prefix = [_prefix_cosines(x, y, dims) for x, y, _ in pieces]  # each piece's cosines of every prefix
        total = a.new_zeros(stop - start)
        for k, w in enumerate(weights):
            logits = torch.cat([c[k].masked_fill(out, -torch.inf) for c, (_, _, out) in zip(per_prefix, pieces)], dim=1) / temperature
            total = total + w * (torch.logsumexp(logits, dim=1) - logits[rows, own])
        return total

    width = p_all.shape[0] * (1 + contrast_positives) + batch * contrast_anchors + n_all.shape[0]
    # a strip holds every prefix's logits at once under Matryoshka
    width *= 1 if dims is None else len(set(dims)) + 1
    return per_row_losses(row_loss, batch, width, (a, ga, p_all, gp_all, n_all, gn_all), chunk_size).mean()


def _prefix_cosines(x: Tensor, y: Tensor, dims: list[int]) -> list[Tensor]:
    """``normalize(x[:, :d]) @ normalize(y[:, :d]).T`` for every ``d`` of ``dims`` (in that order), from one running
    sum of the products over the feature bands between the distinct prefix ends: ``D`` products per pair for all
    of them (autograd's backward, too, takes each band's product once)."""
    cuts = sorted(set(dims))
    raw, sq_x, sq_y = [x[:, :0] @ y[:, :0].T], [x.new_zeros(x.shape[0])], [y.new_zeros(y.shape[0])]
    for lo, hi in zip((0, *cuts[:-1]), cuts):
        raw.append(raw[-1] + x[:, lo:hi] @ y[:, lo:hi].T)
        sq_x.append(sq_x[-1] + x[:, lo:hi].pow(2).sum(1))
        sq_y.append(sq_y[-1] + y[:, lo:hi].pow(2).sum(1))
    # x / max(||x||, eps) per prefix, as F.normalize
    cos = [r / sx.sqrt().clamp_min(1e-12)[:, None] / sy.sqrt().clamp_min(1e-12)[None, :]
           for r, sx, sy in zip(raw[1:], sq_x[1:], sq_y[1:])]
    return [cos[cuts.index(d)] for d in dims]


class CachedGISTEmbedLoss(GISTEmbedLoss, GradientCache):
    """sentence-transformers' ``CachedGISTEmbedLoss``: :class:`GISTEmbedLoss` with gradient caching
    (the guide's embeddings computed once, without a graph; the model's in mini-batches, replayed in
    backward), same arguments and values.

    Args:
        mini_batch_size: rows per mini-batch (default 32).
        mini_batch_num_tokens: instead, a budget of real tokens per mini-batch.
        show_progress_bar: accepted for compatibility; no bar is drawn.

    The other arguments are those of :class:`GISTEmbedLoss`.
    """

    def __init__(self, model: nn.Module, guide: nn.Module, temperature: float = 0.01, mini_batch_size: int = 32,
                 mini_batch_num_tokens: int | None = None, show_progress_bar: bool = False, margin_strategy: str = "absolute",
                 margin: float = 0.0, contrast_anchors: bool = True, contrast_positives: bool = True,
                 gather_across_devices: bool = False, *, chunk_size: int | None = None) -> None:
        super().__init__(model, guide, temperature, margin_strategy, margin, contrast_anchors, contrast_positives,
                         gather_across_devices, chunk_size=chunk_size)
        self._set_budget(mini_batch_size, mini_batch_num_tokens)
        self.show_progress_bar = show_progress_bar

    def embedding_loss(self, columns: list[dict[str, Any]], labels: Tensor | None) -> Callable[[list[Tensor], Tensor | None], Tensor]:
        guides = self.guide_embeddings(columns)
        return lambda embeddings, _labels: self.compute_loss_from_embeddings(embeddings, guides)

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        return self.cached_forward(sentence_features, labels)

    def get_config_dict(self) -> dict[str, Any]:
        return {**super().get_config_dict(), "mini_batch_size": self.mini_batch_size,
                "mini_batch_num_tokens": self.mini_batch_num_tokens}

    @property
    def citation(self) -> str:
        return GRADCACHE
