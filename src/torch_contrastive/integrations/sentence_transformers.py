"""sentence-transformers' in-batch-negative losses, computed by torch-contrastive.

Drop-in classes with sentence-transformers' names, arguments and call form
``loss(sentence_features, labels)``, usable as ``loss=`` of a
``SentenceTransformerTrainer``:

* :class:`MultipleNegativesRankingLoss` (Henderson et al. 2017; van den Oord et al. 2018):
  ``directions`` (query->doc, query->query, doc->query, doc->doc), ``partition_mode``
  ``"joint"`` / ``"per_direction"``, hardness weighting (``hardness_mode``,
  ``hardness_strength``: ``alpha * stop_grad(sim)`` added to negative logits);
* :class:`CachedMultipleNegativesRankingLoss`: the same loss with gradient caching (Gao et
  al. 2021), mini-batches by rows or by a token budget (``mini_batch_num_tokens``);
* :class:`GISTEmbedLoss` (Solatorio 2024): a guide model's similarities remove false
  negatives (absolute or relative margin) from the anchor-positive, anchor-anchor,
  positive-positive and anchor-negative blocks; :class:`CachedGISTEmbedLoss`, the same with
  gradient caching;
* :class:`MatryoshkaLoss` (Kusupati et al. 2022): any of these summed over embedding prefixes,
  the ranking losses' prefixes in one pass (:func:`~torch_contrastive.matryoshka_info_nce_loss`).

Values and gradients equal sentence-transformers' own (tested against the installed
package). Memory is O(N * D): the plain MNRL (``query_to_doc`` only, no hardness, one
process) runs in the engine (:func:`~torch_contrastive.info_nce_loss`); the other forms
are computed in row strips under activation checkpointing, so no N x N matrix is held.
sentence-transformers itself is not imported: ``model`` is any module that maps a
features dict to ``{"sentence_embedding": (B, D)}``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validation as v
from ..distributed import all_gather_with_grad, is_active
from ..grad_cache import RngSnapshot
from ..losses import info_nce_loss
from ._citations import GRADCACHE, GTE, SMART_REPLY
from ._strips import per_row_losses

__all__ = ["CachedGISTEmbedLoss", "CachedMultipleNegativesRankingLoss", "CachedMultipleNegativesSymmetricRankingLoss", "GISTEmbedLoss",
           "MatryoshkaLoss", "MultipleNegativesRankingLoss", "MultipleNegativesSymmetricRankingLoss", "mnrl_loss"]

#: The symmetric losses' terms: sentence-transformers' ``MultipleNegativesSymmetricRankingLoss`` is its
#: ranking loss over both directions, each direction's log-sum-exp on its own, averaged.
SYMMETRIC_DIRECTIONS, SYMMETRIC_PARTITION = ("query_to_doc", "doc_to_query"), "per_direction"

DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
HARDNESS_MODES = (None, "in_batch_negatives", "hard_negatives", "all_negatives")


def cos_sim(a: Tensor, b: Tensor) -> Tensor:
    """The cosine of every row of ``a`` with every row of ``b``: (len(a), len(b)) (sentence-transformers' ``util.cos_sim``,
    under its name: the model card and ``get_config_dict`` say ``"cos_sim"``, as the peer's do)."""
    a, b = (x if x.ndim == 2 else x.reshape(1, -1) for x in (torch.as_tensor(a), torch.as_tensor(b)))
    return F.normalize(a, dim=1) @ F.normalize(b, dim=1).T


def dot_score(a: Tensor, b: Tensor) -> Tensor:
    """The dot product of every row of ``a`` with every row of ``b`` (sentence-transformers' ``util.dot_score``)."""
    a, b = (x if x.ndim == 2 else x.reshape(1, -1) for x in (torch.as_tensor(a), torch.as_tensor(b)))
    return a @ b.T


def _similarity_function(similarity_fct: Callable[..., Tensor] | str) -> Callable[..., Tensor]:
    """The callable a loss keeps as ``similarity_fct``: the caller's own, or :func:`cos_sim` / :func:`dot_score` for a name."""
    if callable(similarity_fct):
        return similarity_fct
    return cos_sim if _similarity_name(similarity_fct) == "cosine" else dot_score


def _similarity_name(similarity_fct: Callable[..., Tensor] | str) -> str:
    """'cosine' or 'dot' for sentence-transformers' ``cos_sim`` / ``dot_score`` (or those strings)."""
    name = similarity_fct if isinstance(similarity_fct, str) else getattr(similarity_fct, "__name__", "")
    if name in ("cos_sim", "cosine", "pairwise_cos_sim"):
        return "cosine"
    if name in ("dot_score", "dot", "pairwise_dot_score"):
        return "dot"
    raise ValueError(f"similarity_fct must be sentence_transformers.util.cos_sim or dot_score (or 'cosine'/'dot'), got {similarity_fct!r}")


def _check_mnrl(scale: float, directions: tuple[str, ...], partition_mode: str, hardness_mode: str | None,
                hardness_strength: float) -> tuple[str, ...]:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    directions = tuple(directions)
    if not directions or any(d not in DIRECTIONS for d in directions):
        raise ValueError(f"directions must be a non-empty tuple drawn from {DIRECTIONS}, got {directions!r}")
    if "query_to_doc" not in directions:
        raise ValueError("directions must include 'query_to_doc' (it holds the positive pair)")
    if partition_mode not in ("joint", "per_direction"):
        raise ValueError(f"partition_mode must be 'joint' or 'per_direction', got {partition_mode!r}")
    if partition_mode == "per_direction" and {"query_to_query", "doc_to_doc"} & set(directions):
        raise ValueError("partition_mode='per_direction' needs every direction to contain the positive pair; "
                         "'query_to_query' and 'doc_to_doc' do not (use partition_mode='joint')")
    if hardness_mode not in HARDNESS_MODES:
        raise ValueError(f"hardness_mode must be one of {HARDNESS_MODES}, got {hardness_mode!r}")
    if isinstance(hardness_strength, bool) or not isinstance(hardness_strength, (int, float)) \
            or not 0 <= hardness_strength < math.inf:
        raise ValueError(f"hardness_strength must be a finite float >= 0, got {hardness_strength!r}")
    return directions


def encoder_of(model: object, name: str) -> nn.Module:
    """The encoder a loss wraps: an ``nn.Module`` (a SentenceTransformer is one)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{name} must be an nn.Module (a SentenceTransformer), got {type(model).__name__}")
    return model


def _check_mnrl_inputs(queries: object, docs: object, similarity: object, chunk_size: object) -> list[Tensor]:
    """The tensors and options every direction reads, checked in the caller's words before any work
    (the default direction's :func:`~torch_contrastive.info_nce_loss` checks them again, as its own)."""
    v.check_chunk_size(chunk_size)
    q = v.check_embeddings(queries, "queries")
    if not isinstance(docs, (list, tuple)):
        raise TypeError(f"docs must be a list of (B, D) tensors (the positives first), got {type(docs).__name__}")
    if not docs:
        raise ValueError("docs must hold at least the positive column")
    for i, doc in enumerate(docs):
        d = v.check_embeddings(doc, f"docs[{i}]")
        v.check_same_rows(q, "queries", d, f"docs[{i}]")  # rows and feature size
    v.check_choice(similarity, "similarity", ("cosine", "dot"))
    v.check_chunk_size(chunk_size)
    return list(docs)


def _finite_or_why(loss: Tensor, queries: Tensor, docs: list[Tensor], similarity: str) -> Tensor:
    """``loss``, or a ``ValueError`` that says why it is not finite: one host read, as the core losses'
    validation (a non-finite input, or -- for dot products -- logits that overflow)."""
    if bool(torch.isfinite(loss.detach())):
        return loss
    for name, t in (("queries", queries), *((f"docs[{i}]", d) for i, d in enumerate(docs))):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} has non-finite values (NaN or inf)")
    raise ValueError(f"the logits overflow (scale x {similarity} similarity is not finite in the input dtype): use "
                     "similarity='cosine', a smaller scale or a wider dtype")


def mnrl_loss(queries: Tensor, docs: list[Tensor], scale: float = 20.0, *, similarity: str = "cosine",
              directions: tuple[str, ...] = ("query_to_doc",), partition_mode: str = "joint",
              hardness_mode: str | None = None, hardness_strength: float = 0.0, gather: bool = False,
              chunk_size: int | None = None) -> Tensor:
    """MultipleNegativesRankingLoss on embeddings: the mean over this rank's queries of
    ``log Z_i - scale * sim(q_i, d_i)``.

    ``Z_i`` sums ``exp`` of the logits of row i over the chosen directions: ``query_to_doc``
    (q_i against every doc: the positives ``docs[0]`` and the hard-negative columns
    ``docs[1:]``), ``query_to_query`` (q_i against the other queries), ``doc_to_query``
    (d_i against every query), ``doc_to_doc`` (d_i against every doc but row i's own).
    ``"joint"`` takes one log-sum over all of them; ``"per_direction"`` averages one
    log-sum per direction. Hardness weighting adds ``hardness_strength * sim(q_i, d)``
    (no gradient) to the ``query_to_doc`` logits of the in-batch negatives (other rows'
    docs), of the row's own hard negatives, or of every doc but the positive.

    Args:
        queries: (B, D) anchors.
        docs: list of (B, D) columns; ``docs[0]`` holds the positives.
        scale: inverse temperature (sentence-transformers' default 20).
        similarity: ``"cosine"`` or ``"dot"``.
        directions: the terms summed (``"query_to_doc"``, ``"query_to_query"``,
            ``"doc_to_query"``, ``"doc_to_doc"``), as :class:`MultipleNegativesRankingLoss`.
        partition_mode: ``"joint"`` (one soft-max over every direction's candidates) or
            ``"per_direction"``, as :class:`MultipleNegativesRankingLoss`.
        hardness_mode: which negatives get ``hardness_strength * stop_grad(sim)`` added
            (None, ``"in_batch_negatives"``, ``"hard_negatives"``, ``"all_negatives"``).
        hardness_strength: alpha >= 0 of that term.
        gather: every rank's queries and docs are candidates (``gather_across_devices``);
            gradients flow back to their ranks; the value is this rank's mean.
        chunk_size: rows per strip (None: automatic).

    Returns:
        0-dim fp32 loss.
    """
    v.check_flag(gather, "gather")  # "yes" or 0 would read as a silent True / False
    directions = _check_mnrl(scale, directions, partition_mode, hardness_mode, hardness_strength)
    docs = _check_mnrl_inputs(queries, docs, similarity, chunk_size)
    cols = [d.to(queries.dtype) for d in docs]
    weighted = hardness_mode is not None and hardness_strength > 0
    if directions == ("query_to_doc",) and not weighted and not (gather and is_active()):
        try:
            return info_nce_loss(queries, cols[0], torch.cat(cols[1:]) if len(cols) > 1 else None, 1.0 / scale,
                                 normalize=similarity == "cosine", chunk_size=chunk_size)
        except ValueError as err:  # info_nce_loss names its own arguments: the caller's are queries and docs[i]
            raise v.named_non_finite(err, (("queries", queries), *((f"docs[{i}]", d) for i, d in enumerate(docs)))) from None
    if similarity == "cosine":
        queries, cols = F.normalize(queries, dim=-1), [F.normalize(c, dim=-1) for c in cols]
    batch = queries.shape[0]
    offset = 0
    if gather and is_active():
        offset = torch.distributed.get_rank() * batch
        all_queries, cols = all_gather_with_grad(queries), [all_gather_with_grad(c) for c in cols]
    else:
        all_queries = queries
    world = all_queries.shape[0]
    all_docs = torch.cat(cols)
    positives = cols[0]

    def row_loss(start: int, stop: int, q_local: Tensor, q_all: Tensor, d_pos: Tensor, d_all: Tensor) -> Tensor:
        rows = torch.arange(stop - start, device=q_local.device)
        own = rows + offset + start  # global index of each row's query and positive
        q = widened(q_local[start:stop])
        d = widened(d_pos[offset + start:offset + stop])
        q2d = q @ widened(d_all).T
        blocks = {"query_to_doc": q2d * scale}
        if weighted:
            blocks["query_to_doc"] = blocks["query_to_doc"] + hardness_strength * q2d.detach() * _hardness_mask(
                hardness_mode, own, world, len(cols))
        if "query_to_query" in directions:
            blocks["query_to_query"] = (q @ widened(q_all).T * scale).index_put((rows, own), q.new_tensor(-torch.inf))
        if "doc_to_query" in directions:
            blocks["doc_to_query"] = d @ widened(q_all).T * scale
        if "doc_to_doc" in directions:
            blocks["doc_to_doc"] = (d @ widened(d_all).T * scale).masked_fill(_own_docs(own, world, len(cols)), -torch.inf)
        positive = blocks["query_to_doc"][rows, own]
        if partition_mode == "joint":
            log_z = torch.logsumexp(torch.cat(list(blocks.values()), dim=1), dim=1)
        else:
            log_z = torch.stack([torch.logsumexp(b, dim=1) for b in blocks.values()]).mean(0)
        return log_z - positive

    width = all_docs.shape[0] * (1 + ("doc_to_doc" in directions)) + world * (
        ("query_to_query" in directions) + ("doc_to_query" in directions))
    loss = per_row_losses(row_loss, batch, width, (queries, all_queries, positives, all_docs), chunk_size).mean()
    return _finite_or_why(loss, queries, cols, similarity)


def _own_docs(own: Tensor, world: int, n_cols: int) -> Tensor:
    """(rows, n_cols * world) bool: True at row i's own docs -- its positive (column block 0)
    and its own hard negatives (blocks 1..n_cols-1), at global index ``own[i]`` of each block."""
    rows = torch.arange(own.shape[0], device=own.device)
    mine = torch.zeros(own.shape[0], n_cols * world, dtype=torch.bool, device=own.device)
    for k in range(n_cols):
        mine[rows, own + k * world] = True
    return mine


def _hardness_mask(mode: str | None, own: Tensor, world: int, n_cols: int) -> Tensor:
    """(rows, n_cols * world) 1.0 where row i's ``query_to_doc`` logit gets the hardness term."""
    rows = torch.arange(own.shape[0], device=own.device)
    mine = _own_docs(own, world, n_cols)
    if mode == "hard_negatives":  # only the row's own hard negatives
        keep = mine.clone()
        keep[:, :world] = False
    elif mode == "in_batch_negatives":  # every doc of another row
        keep = ~mine
    else:  # "all_negatives": every doc but the positive
        keep = torch.ones_like(mine)
        keep[rows, own] = False
    return keep.float()


def widened(x: Tensor) -> Tensor:
    """Half inputs compute in fp32, fp32/fp64 in their own precision."""
    return x if x.dtype == torch.float64 else x.float()


def embed(model: nn.Module, features: dict[str, Any]) -> Tensor:
    out = model(features)
    try:
        return out["sentence_embedding"]
    except (TypeError, KeyError, IndexError):
        raise TypeError("model must map a features dict to a dict with 'sentence_embedding' (a SentenceTransformer)") from None


class MultipleNegativesRankingLoss(nn.Module):
    """sentence-transformers' ``MultipleNegativesRankingLoss``, same arguments and values.

    Example:
        >>> from torch_contrastive.integrations.sentence_transformers import MultipleNegativesRankingLoss
        >>> loss = MultipleNegativesRankingLoss(model, directions=("query_to_doc", "doc_to_query"))
        >>> trainer = SentenceTransformerTrainer(model=model, train_dataset=pairs, loss=loss)

    Args:
        model: the SentenceTransformer being trained.
        scale: inverse temperature (default 20).
        similarity_fct: ``sentence_transformers.util.cos_sim`` (default) or ``dot_score``.
        gather_across_devices: every rank's queries and docs are candidates of every query.
        directions: any of ``"query_to_doc"`` (required), ``"query_to_query"``,
            ``"doc_to_query"``, ``"doc_to_doc"``.
        partition_mode: ``"joint"`` (one softmax over every direction's logits) or
            ``"per_direction"`` (the mean of one log-partition per direction).
        hardness_mode: None, ``"in_batch_negatives"``, ``"hard_negatives"`` or
            ``"all_negatives"``: which negatives get ``hardness_strength * sim`` (detached)
            added to their logits.
        hardness_strength: alpha >= 0.
        chunk_size: rows per strip or engine tile (None: automatic).

    Memory: O(B * D) beyond the model's activations (see the module docstring).
    """

    def __init__(self, model: nn.Module, scale: float = 20.0, similarity_fct: Callable[..., Tensor] | str = "cosine",
                 gather_across_devices: bool = False, directions: tuple[str, ...] = ("query_to_doc",),
                 partition_mode: str = "joint", hardness_mode: str | None = None, hardness_strength: float = 0.0, *,
                 chunk_size: int | None = None) -> None:
        super().__init__()
        self.directions = _check_mnrl(scale, directions, partition_mode, hardness_mode, hardness_strength)
        self.model = encoder_of(model, "model")
        self.scale = float(scale)
        self.similarity = _similarity_name(similarity_fct)
        self.similarity_fct = _similarity_function(similarity_fct)  # (read by the peer's users; the engine takes the name)
        self.gather_across_devices = v.check_flag(gather_across_devices, "gather_across_devices")
        self.partition_mode = partition_mode
        self.hardness_mode = hardness_mode
        self.hardness_strength = float(hardness_strength)
        self.chunk_size = chunk_size

    @property
    def temperature(self) -> float:
        return 1.0 / self.scale

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        return self.compute_loss_from_embeddings([embed(self.model, f) for f in sentence_features], labels)

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None = None) -> Tensor:
        """The loss of ``embeddings = [queries, positives, *hard_negative_columns]``."""
        if len(embeddings) < 2:
            raise ValueError(f"expected at least 2 embedding columns (queries, positives), got {len(embeddings)}")
        return mnrl_loss(embeddings[0], list(embeddings[1:]), self.scale, similarity=self.similarity,
                         directions=self.directions, partition_mode=self.partition_mode, hardness_mode=self.hardness_mode,
                         hardness_strength=self.hardness_strength, gather=self.gather_across_devices,
                         chunk_size=self.chunk_size)

    def get_config_dict(self) -> dict[str, Any]:
        """What the trainer's model card shows, as the peer's (the similarity by its function's name: ``"cos_sim"``)."""
        return {"scale": self.scale, "similarity_fct": getattr(self.similarity_fct, "__name__", self.similarity),
                "gather_across_devices": self.gather_across_devices, "directions": self.directions,
                "partition_mode": self.partition_mode, "hardness_mode": self.hardness_mode,
                "hardness_strength": self.hardness_strength}

    @property
    def citation(self) -> str:
        """The paper of this loss (BibTeX; GTE's improved contrastive loss when every direction shares one soft-max)."""
        if set(self.directions) == set(DIRECTIONS) and self.partition_mode == "joint":
            return GTE
        return SMART_REPLY


def _batch_rows(features: dict[str, Any]) -> int:
    for key in ("input_ids", "attention_mask"):
        value = features.get(key)
        if isinstance(value, Tensor):
            return int(value.shape[0])
    for value in features.values():
        if isinstance(value, Tensor) and value.ndim > 0:
            return int(value.shape[0])
    raise ValueError("sentence_features: no batch-first tensor in a features dict")


def mini_batch_ranges(features: dict[str, Any], mini_batch_size: int, mini_batch_num_tokens: int | None = None) -> list[tuple[int, int]]:
    """Consecutive row ranges of one column: ``mini_batch_size`` rows each, or, with a token
    budget, as many rows as fit ``mini_batch_num_tokens`` real (attention-mask) tokens (at
    least one row per range)."""
    n = _batch_rows(features)
    if mini_batch_num_tokens is None:
        return [(s, min(s + mini_batch_size, n)) for s in range(0, n, mini_batch_size)]
    mask = features.get("attention_mask")
    if not isinstance(mask, Tensor):
        raise ValueError("mini_batch_num_tokens needs an 'attention_mask' in the features (use mini_batch_size)")
    tokens = mask.sum(dim=1).tolist()  # host copy once per batch, before any graph exists
    ranges, start = [], 0
    while start < n:
        stop, used = start, 0
        while stop < n and (stop == start or used + tokens[stop] <= mini_batch_num_tokens):
            used += tokens[stop]
            stop += 1
        ranges.append((start, stop))
        start = stop
    return ranges


def _row_ends(features: dict[str, Any]) -> list[int] | None:
    """Each row's last real token + 1 (its attention mask), read once per column; None without a 2-D mask."""
    mask = features.get("attention_mask")
    if not isinstance(mask, Tensor) or mask.ndim != 2:
        return None
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask.bool() * positions).amax(dim=1).tolist()


def _rows_of(features: dict[str, Any], start: int, stop: int, n: int, ends: list[int] | None = None) -> dict[str, Any]:
    """Rows ``start:stop`` of a features dict, trimmed to the mini-batch's own longest sequence: the columns of padding
    that every one of its rows has at the end are dropped (leading padding stays: positions are kept), as the peer's
    gradient-caching losses do -- a mini-batch of short texts is not embedded at the whole batch's width, and the
    model (its dropout draws too) sees what the peer's sees."""
    width = None
    if ends is not None:
        mask = features["attention_mask"]
        longest = max(ends[start:stop])
        if 0 < longest < mask.shape[1]:
            width = (mask.shape[1], longest)
    out = {}
    for key, value in features.items():
        if not isinstance(value, Tensor) or value.ndim == 0 or value.shape[0] != n:
            out[key] = value
        elif width is not None and value.ndim >= 2 and value.shape[1] == width[0]:
            out[key] = value[start:stop, : width[1]]
        else:
            out[key] = value[start:stop]
    return out


class _ReplayBackward(torch.autograd.Function):
    """Identity on the loss value whose backward runs the second, gradient-carrying pass."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, anchor: Tensor, replay: Callable[[Tensor], None]) -> Tensor:  # type: ignore[override]
        ctx.replay = replay
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None]:  # type: ignore[override]
        with torch.enable_grad():
            ctx.replay(grad)
        return None, None, None


class GradientCache:
    """Gradient caching (Gao et al. 2021) for a loss module with ``model``, ``mini_batch_size`` and
    ``mini_batch_num_tokens``: :meth:`cached_forward`."""

    model: nn.Module
    mini_batch_size: int
    mini_batch_num_tokens: int | None

    def _set_budget(self, mini_batch_size: object, mini_batch_num_tokens: object) -> None:
        for name, value in (("mini_batch_size", mini_batch_size), ("mini_batch_num_tokens", mini_batch_num_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.mini_batch_size = int(mini_batch_size)  # type: ignore[call-overload]
        self.mini_batch_num_tokens = mini_batch_num_tokens  # type: ignore[assignment]

    #: sentence-transformers' mark of a loss that back-propagates later, from its own replay: the peer's MatryoshkaLoss
    #: then wraps :meth:`calculate_loss` (it cannot patch the model's forward for a backward it does not see)
    uses_gradient_cache = True

    def _mini_batches(self, columns: list[dict[str, Any]]) -> Iterator[tuple[int, dict[str, Any]]]:
        for k, features in enumerate(columns):
            n = _batch_rows(features)
            ends = _row_ends(features)
            for start, stop in mini_batch_ranges(features, self.mini_batch_size, self.mini_batch_num_tokens):
                yield k, _rows_of(features, start, stop, n, ends)

    def calculate_loss(self, reps: list[list[Tensor]], labels: Tensor | None = None) -> Tensor:
        """The loss of the mini-batches' embeddings ``reps[column][mini_batch]``; with grad mode on, back-propagated into
        them (their ``.grad``) and returned detached -- the peer's protocol, which its ``MatryoshkaLoss`` wraps to add
        each prefix's loss."""
        compute = self._compute
        if compute is None:
            raise RuntimeError("calculate_loss runs inside the loss's forward (the batch's loss function is set there)")
        value = compute([torch.cat(column) for column in reps], labels)
        if torch.is_grad_enabled() and value.requires_grad:
            value.backward()
        return value.detach()

    _compute: Callable[[list[Tensor], Tensor | None], Tensor] | None = None

    def embedding_loss(self, columns: list[dict[str, Any]], labels: Tensor | None) -> Callable[[list[Tensor], Tensor | None], Tensor]:
        """The loss of the whole batch's embeddings, for :meth:`cached_forward` (a guide's embeddings, if
        any, computed here once)."""
        raise NotImplementedError

    def cached_forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None,
                       compute: Callable[[list[Tensor], Tensor | None], Tensor] | None = None) -> Tensor:
        """The gradient-cached call with ``compute(embeddings, labels)`` as the loss of the whole batch's
        embeddings (default :meth:`embedding_loss`; :class:`MatryoshkaLoss` passes every prefix's loss at once)."""
        columns = list(sentence_features)
        if len(columns) < 2:
            raise ValueError(f"expected at least 2 feature columns (queries, positives), got {len(columns)}")
        compute = compute or self.embedding_loss(columns, labels)
        snapshots: list[RngSnapshot] = []
        parts: list[list[Tensor]] = [[] for _ in columns]
        with torch.no_grad():
            for k, features in self._mini_batches(columns):
                snapshots.append(RngSnapshot())
                parts[k].append(embed(self.model, features))
        reps = [[p.detach().requires_grad_() for p in column] for column in parts]
        self._compute = compute
        try:
            with torch.enable_grad():
                loss = self.calculate_loss(reps, labels)  # (an instance attribute when the peer's MatryoshkaLoss wraps it)
        finally:
            self._compute = None
        cached = [torch.cat([torch.zeros_like(r) if r.grad is None else r.grad for r in column]) for column in reps]

        def replay(grad_output: Tensor) -> None:
            offsets = [0] * len(columns)
            for (k, features), snapshot in zip(self._mini_batches(columns), snapshots):
                with snapshot.restored():
                    out = embed(self.model, features)
                rows = out.shape[0]
                if out.requires_grad:
                    out.backward(cached[k][offsets[k]:offsets[k] + rows].to(out.dtype) * grad_output.to(out.dtype))
                offsets[k] += rows

        # A fresh leaf makes the output require grad; the loss's own graph is spent already.
        anchor = torch.zeros((), device=loss.device, requires_grad=True)
        return _ReplayBackward.apply(loss.detach(), anchor, replay)


class CachedMultipleNegativesRankingLoss(MultipleNegativesRankingLoss, GradientCache):
    """sentence-transformers' ``CachedMultipleNegativesRankingLoss`` (GradCache): batches
    far beyond activation memory, parameter gradients of the full batch.

    The forward embeds every column in mini-batches without a graph (recording each
    mini-batch's random state, :class:`~torch_contrastive.grad_cache.RngSnapshot`), computes
    the loss and its gradient with respect to the embeddings, and returns the loss; its
    ``backward()`` re-embeds each mini-batch with the same random draws (dropout) and pushes
    the cached gradient through. Peak activation memory is one mini-batch's.

    Args:
        mini_batch_size: rows per mini-batch (default 32).
        mini_batch_num_tokens: instead, a budget of real tokens per mini-batch (rows are
            taken in order while their attention-mask lengths fit; at least one row).
        show_progress_bar: accepted for compatibility; no bar is drawn.

    The other arguments are those of :class:`MultipleNegativesRankingLoss`.
    """

    def __init__(self, model: nn.Module, scale: float = 20.0, similarity_fct: Callable[..., Tensor] | str = "cosine",
                 mini_batch_size: int = 32, mini_batch_num_tokens: int | None = None, gather_across_devices: bool = False,
                 directions: tuple[str, ...] = ("query_to_doc",), partition_mode: str = "joint",
                 show_progress_bar: bool = False, hardness_mode: str | None = None, hardness_strength: float = 0.0, *,
                 chunk_size: int | None = None) -> None:
        super().__init__(model, scale, similarity_fct, gather_across_devices, directions, partition_mode, hardness_mode,
                         hardness_strength, chunk_size=chunk_size)
        self._set_budget(mini_batch_size, mini_batch_num_tokens)
        self.show_progress_bar = show_progress_bar

    def embedding_loss(self, columns: list[dict[str, Any]], labels: Tensor | None) -> Callable[[list[Tensor], Tensor | None], Tensor]:
        return self.compute_loss_from_embeddings

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        return self.cached_forward(sentence_features, labels)

    def get_config_dict(self) -> dict[str, Any]:
        return {**super().get_config_dict(), "mini_batch_size": self.mini_batch_size,
                "mini_batch_num_tokens": self.mini_batch_num_tokens}

    @property
    def citation(self) -> str:
        return GRADCACHE


class MultipleNegativesSymmetricRankingLoss(MultipleNegativesRankingLoss):
    """sentence-transformers' ``MultipleNegativesSymmetricRankingLoss``: each query finds its document
    among the batch's documents and each (positive) document its query among the batch's queries, the
    two cross-entropies averaged -- :class:`MultipleNegativesRankingLoss` with
    ``directions=("query_to_doc", "doc_to_query")`` and ``partition_mode="per_direction"``, as the
    peer itself is now. Hard-negative columns take part in the first direction only.

    Args:
        model: the encoder (a SentenceTransformer).
        scale: inverse temperature (default 20).
        similarity_fct: ``util.cos_sim`` / ``"cosine"`` or ``util.dot_score`` / ``"dot"``.
        gather_across_devices: every rank's rows are candidates (gradients flow back to their ranks).
        chunk_size: rows per strip of the engine (None: automatic).
    """

    def __init__(self, model: nn.Module, scale: float = 20.0, similarity_fct: Callable[..., Tensor] | str = "cosine",
                 gather_across_devices: bool = False, *, chunk_size: int | None = None) -> None:
        super().__init__(model, scale, similarity_fct, gather_across_devices, SYMMETRIC_DIRECTIONS, SYMMETRIC_PARTITION,
                         chunk_size=chunk_size)


class CachedMultipleNegativesSymmetricRankingLoss(CachedMultipleNegativesRankingLoss):
    """sentence-transformers' ``CachedMultipleNegativesSymmetricRankingLoss``: the symmetric ranking loss
    (:class:`MultipleNegativesSymmetricRankingLoss`) with gradient caching (mini-batches of
    ``mini_batch_size`` rows or ``mini_batch_num_tokens`` tokens; see :class:`CachedMultipleNegativesRankingLoss`).

    Args:
        model: the encoder (a SentenceTransformer).
        scale: inverse temperature (default 20).
        similarity_fct: ``util.cos_sim`` / ``"cosine"`` or ``util.dot_score`` / ``"dot"``.
        mini_batch_size: rows per mini-batch (default 32).
        mini_batch_num_tokens: instead, a budget of real tokens per mini-batch.
        gather_across_devices: every rank's rows are candidates.
        show_progress_bar: accepted for compatibility; no bar is drawn.
        chunk_size: rows per strip of the engine (None: automatic).
    """

    def __init__(self, model: nn.Module, scale: float = 20.0, similarity_fct: Callable[..., Tensor] | str = "cosine",
                 mini_batch_size: int = 32, mini_batch_num_tokens: int | None = None, gather_across_devices: bool = False,
                 show_progress_bar: bool = False, *, chunk_size: int | None = None) -> None:
        super().__init__(model, scale, similarity_fct, mini_batch_size, mini_batch_num_tokens, gather_across_devices,
                         SYMMETRIC_DIRECTIONS, SYMMETRIC_PARTITION, show_progress_bar, chunk_size=chunk_size)


from ._gist import CachedGISTEmbedLoss, GISTEmbedLoss  # noqa: E402 -- they use the pieces above
from ._matryoshka import MatryoshkaLoss  # noqa: E402 -- it wraps the classes above

# Every drop-in by its public path (a saved model card names a loss by its class's module: never a private one).
for _public in (CachedGISTEmbedLoss, GISTEmbedLoss, MatryoshkaLoss):
    _public.__module__ = __name__
del _public
