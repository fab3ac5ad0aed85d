"""The symmetric image-text contrastive loss of CLIP/ALIGN, with duplicate ids (Radford et al. 2021, Jia et al. 2021)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _validation as v
from .._normalize import prepare
from .._tensors import as_dtype
from ..distributed import Scope
from ..engine import Options, Problem, Scale, Softmax, compute_dtype, solve
from ..positives import Exclusion, PartnerPositives, Positives
from ._kept import kept
from ._pairing import image_text_positives, positive_logits
from ._prologue import check_agreement, engine_total, finish_checks, image_text_inputs

__all__ = ["clip_loss", "image_text_contrastive_loss", "text_ids"]


def text_ids(texts: list[str]) -> Tensor:
    """Ids for caption strings: equal strings get equal ids (a caption hash).

    Deterministic across processes and ranks (unlike Python's salted ``hash``): ids
    are the first 8 bytes of each string's BLAKE2b digest. Call it in the data loader,
    not in the training step.
    """
    if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be a list of str")
    values = [int.from_bytes(hashlib.blake2b(t.encode("utf-8"), digest_size=8).digest(), "little", signed=True) for t in texts]
    return torch.tensor(values, dtype=torch.int64)


@kept(2)
def image_text_contrastive_loss(
    image_feat: Tensor,
    text_feat: Tensor,
    temperature: float | Tensor = 0.07,
    image_id: Tensor | None = None,
    text_id: Tensor | None = None,
    *,
    normalize: bool = True,
    reduction: str = "mean",
    chunk_size: int | None = None,
    gather: bool = False,
    grad_reduction: str = "mean",
    eps: float = 1e-12,
    validate: bool = True,
    decoupled: bool = False,
    label_smoothing: float = 0.0,
    backend: str = "auto",
) -> Tensor:
    """Symmetric image-text contrastive loss of CLIP/ALIGN (Radford et al. 2021; Jia et al. 2021).

    ``S = image @ text.T / tau`` on L2-normalised features. Without ids it is
    ``(CE(S, arange) + CE(S.T, arange)) / 2``. With ids, duplicates are positives:
    ``gt_ij = (image_id_i == image_id_j) or (text_id_i == text_id_j)`` and

        ``loss = -(sum gt * log_softmax(S, 1) + sum gt.T * log_softmax(S.T, 1)) / (2 sum gt)``

    -- the seed's global normalisation by ``sum gt``. A missing id tensor means every
    image (text) is distinct.

    Args:
        image_feat: (N, D) image embeddings (anchors of the first direction).
        text_feat: (N, D) text embeddings, row i paired with image i.
        temperature: tau > 0 (default 0.07), float or 0-dim tensor (e.g.
            ``1 / logit_scale.exp()``).
        image_id: optional (N,) integer ids of the images (duplicates are positives).
        text_id: optional (N,) integer ids of the captions (see :func:`text_ids`).
        normalize: L2-normalise (CLIP's convention; default True).
        reduction: ``"mean"``; ``"sum"``; ``"none"``: (N,) values ``e_i`` whose mean is
            the loss -- without ids ``e_i = (CE_image_i + CE_text_i) / 2``.
        gather: the shared option; each rank computes only its own image rows against all
            gathered texts, and the second direction's per-text log-sum-exp is completed by
            an O(N) all-reduce of partial column sums (on either backend), so the N x N
            work is split across ranks.
        decoupled: DCL (Yeh et al. 2021): the positives (the diagonal, or every pair seed
            002's rule relates) leave both directions' denominators. A row left with no
            candidate contributes 0.
        label_smoothing: epsilon in [0, 1), per direction ``(1 - eps) * (the loss above) +
            eps * mean_i mean_j (-log softmax_ij)``; without ids exactly
            ``F.cross_entropy(S, arange(N), label_smoothing=eps)`` per direction. The uniform
            part needs only ``sum_j S_ij = <a_i, sum_j b_j> / tau``: O(N * D), no extra tile
            pass. Not combined with ``decoupled``.

    The shared options ``chunk_size``, ``grad_reduction``, ``eps``, ``validate``, ``backend`` are documented
    once in :mod:`torch_contrastive.options`.

    Memory: O(N * D + tile^2); forward+backward cost about four N x N x D matrix
    multiplies, one ``exp`` per logit when the fixed shift applies.
    """
    pair = image_text_inputs(image_feat, text_feat, image_id, text_id, normalize=normalize, reduction=reduction, chunk_size=chunk_size,
                             grad_reduction=grad_reduction, eps=eps, gather=gather, validate=validate, backend=backend)
    n, device, image_id, text_id, ids_given, scope, checks = pair
    if not isinstance(decoupled, bool):
        raise TypeError(f"decoupled must be a bool, got {type(decoupled).__name__}")
    smoothing = v.check_fraction(label_smoothing, "label_smoothing")
    if smoothing and decoupled:
        raise ValueError("label_smoothing is not combined with decoupled=True")
    scale, bound = v.inverse_temperature(temperature, checks, need_bound=normalize)
    check_agreement(scope, "image_feat/text_feat", image_feat, validate, *ids_given)

    limit = bound if normalize else None  # |S| <= limit: unit rows, a host-known scale
    variant = _Variant(decoupled, smoothing)
    if not scope.distributed:
        # gt is symmetric (gt_ij = gt_ji), so one Positives serves both directions, and the
        # whole loss -- normalisation, both directions, positives -- is one engine call.
        pos = image_text_positives(image_id, text_id, n, n, scope, device)
        # a partner relation has one positive per row: its counts are formed only for the paths that read them
        partner = isinstance(pos, PartnerPositives)
        counts = pos.row_counts() if smoothing or decoupled or not partner or reduction == "none" else None
        cdtype = compute_dtype(image_feat.dtype)
        weights = variant.weights(_counted(counts), _counted(counts).sum(), n, cdtype) if smoothing else \
            (None, None) if partner else (_counted(counts).to(cdtype), None)
        # mean: sum / (2 sum gt); sum: N times that -- inside the engine when nothing follows
        n_gt = float(n) if partner else _counted(counts).sum()
        total = None if smoothing or decoupled or reduction == "none" else \
            engine_total("mean", scope, 2 * n_gt, cdtype, float(n) if reduction == "sum" else 1.0)
        text = as_dtype(text_feat, image_feat.dtype)
        # gt is symmetric: the columns' alpha is the rows'; beta as its own tensor (one tensor given
        # as two inputs is more than torch.compile traces)
        both = Softmax(row_weights=weights, col_weights=(None, None if weights[1] is None else weights[1].clone()),
                       columns_share_alpha=True, columns=True, exclude=variant.exclusion(pos), total=total)
        per_image, per_text = solve(Problem(image_feat, text, scale, both, positives=pos, bound=limit,
                                            options=Options(normalize, eps, chunk_size, backend)))
        if total is not None:
            # image i and text i meet in S_ii: a non-finite row (normalised inside) makes the loss NaN
            finish_checks(per_image, checks, v.output_needs_check(normalize, bound), covers=normalize)
            return per_image
        if per_text is None:
            raise RuntimeError("internal: columns=True returns the column terms")
        counts = _counted(counts)
        if smoothing:
            img, txt = prepare(image_feat, normalize, eps), prepare(text_feat.to(image_feat.dtype), normalize, eps)
            per_image, per_text = variant.smooth(per_image, per_text, img, txt, img, txt, counts.sum(), n, scale)
    else:
        per_image, per_text, counts = _distributed_terms(image_feat, text_feat, scale, image_id, text_id, scope, limit, normalize,
                                                         eps, chunk_size, variant, backend)
    if decoupled:  # a row left without candidates (every text a positive) contributes 0
        per_image = torch.where(torch.isneginf(per_image), 0.0, per_image)
        per_text = torch.where(torch.isneginf(per_text), 0.0, per_text)
    finish_checks((per_image, per_text), checks, v.output_needs_check(normalize, bound))
    return _reduce_image_text(per_image, per_text, counts.sum(), n, reduction, scope)


def _counted(counts: Tensor | None) -> Tensor:
    if counts is None:  # formed above for every path that reads it
        raise RuntimeError("internal: the positive counts were not formed")
    return counts


@dataclass(frozen=True)
class _Variant:
    """DCL and label smoothing on the image-text loss (README, "False negatives")."""

    decoupled: bool
    smoothing: float

    def exclusion(self, positives: Positives) -> Exclusion | None:
        """DCL: the positives leave the denominators (gt is symmetric: both directions)."""
        return Exclusion(relation=positives, symmetric=True) if self.decoupled else None

    def weights(self, counts: Tensor, n_gt: Tensor, n_all: int, cdtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(alpha, beta)`` with ``alpha_i = (1 - eps) c_i + eps G / N`` and ``beta = 1 - eps``:
        times ``1 / G`` per direction, the smoothed loss's log-sum-exp and positive parts."""
        eps = self.smoothing
        alpha = (1 - eps) * counts.to(cdtype) + eps * n_gt.to(cdtype) / n_all
        return alpha, torch.full_like(alpha, 1 - eps)

    def smooth(self, per_image: Tensor, per_text: Tensor, img: Tensor, txt: Tensor, img_all: Tensor, txt_all: Tensor,
               n_gt: Tensor, n_all: int, scale: Scale) -> tuple[Tensor, Tensor]:
        """Subtract the uniform part ``eps G / (N N) * sum_j S_ij`` of each row (and column)."""
        factor = self.smoothing * n_gt.to(img.dtype) / (n_all * n_all)
        uniform_image = (img * txt_all.sum(0)).sum(1) * scale
        uniform_text = (txt * img_all.sum(0)).sum(1) * scale
        return per_image - factor * uniform_image, per_text - factor * uniform_text


def _distributed_terms(image_feat: Tensor, text_feat: Tensor, scale: Scale, image_id: Tensor | None, text_id: Tensor | None,
                       scope: Scope, limit: float | None, normalize: bool, eps: float, chunk_size: int | None,
                       variant: _Variant, backend: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """Per-image and per-text terms of this rank's rows under ``gather=True``.

    One pass over this rank's image rows x all texts gives the image rows' terms and the
    column sums; the engine all-reduces those (O(N)) into every text's LSE, so the N x N
    work is split W ways instead of being done once per direction. A text's positives: without
    ids its one image is on this rank, and the engine's column terms include it; with ids they
    may be anywhere, and are summed here from the gathered images.
    """
    n = image_feat.shape[0]
    text_feat = as_dtype(text_feat, image_feat.dtype)
    # every rank's images are read by the text direction's positives only with ids, and by label smoothing;
    # without either, text j's one positive is this rank's image j: the engine's own column positives
    every_image = bool(variant.smoothing) or image_id is not None or text_id is not None
    # the caller's rows gathered as given (half rows: half the bytes of fp32) and normalised inside the engine, as
    # one process's call is -- on a GPU half rows are multiplied on tensor cores, with fp32 factors
    gathered = scope.rows_of(*((image_feat, text_feat) if every_image else (text_feat,)))  # their counts read once
    candidates = gathered[-1]
    offset, n_all = scope.offset, candidates.shape[0]  # the offset is known once the sizes are gathered
    pos = image_text_positives(image_id, text_id, n, n_all, scope, image_feat.device)
    counts = pos.row_counts()
    n_gt = scope.total(counts.sum()) if variant.smoothing else counts.sum()
    cdtype = compute_dtype(image_feat.dtype)
    alpha, beta = variant.weights(counts, n_gt, n_all, cdtype) if variant.smoothing else (counts.to(cdtype), None)
    rows_and_columns = Softmax(row_weights=(alpha, beta), columns=True, column_positives=not every_image, column_comm=scope,
                               exclude=variant.exclusion(pos))
    per_image, col_all = solve(Problem(image_feat, candidates, scale, rows_and_columns, positives=pos, bound=limit,
                                       options=Options(normalize=normalize, eps=eps, chunk_size=chunk_size, backend=backend)))
    if col_all is None:
        raise RuntimeError("internal: columns=True returns the column terms")
    if not every_image:  # each text's log-sum-exp less its one positive, this rank's columns
        return per_image, col_all[offset : offset + n], counts
    # text j's positives are its column of gt: as many as image j's row (gt is symmetric)
    img, txt = prepare(image_feat, normalize, eps, backend), prepare(text_feat, normalize, eps, backend)
    every_img = prepare(gathered[0], normalize, eps, backend)
    text_pos = positive_logits(txt, every_img, pos, scale)
    per_text = alpha * col_all[offset : offset + n] - (text_pos if beta is None else beta * text_pos)
    if variant.smoothing:
        every_txt = prepare(candidates, normalize, eps, backend)
        per_image, per_text = variant.smooth(per_image, per_text, img, txt, every_img, every_txt, n_gt, n_all, scale)
    return per_image, per_text, counts


def _reduce_image_text(per_image: Tensor, per_text: Tensor, n_gt: Tensor, n: int, reduction: str, scope: Scope) -> Tensor:
    if reduction == "none":
        # e_i such that mean(e) is the loss: scale each direction by N / (2 sum gt).
        n_gt_all = scope.total(n_gt).to(per_image.dtype)
        n_all = float(sum(scope.sizes)) if scope.distributed else float(n)
        return (per_image + per_text) * (n_all / (2 * n_gt_all))
    local_sum = (per_image.sum() + per_text.sum()) / 2
    if reduction == "sum":
        n_all_f = float(sum(scope.sizes)) if scope.distributed else float(n)
        return scope.finish(local_sum * n_all_f, n_gt.to(per_image.dtype))
    return scope.finish(local_sum, n_gt.to(per_image.dtype))


clip_loss = image_text_contrastive_loss
