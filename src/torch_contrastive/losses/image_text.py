"""The symmetric image-text contrastive loss of CLIP/ALIGN, with duplicate ids (seed 002)."""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from .. import _validation as v
from .._normalize import prepare
from ..distributed import Scope
from ..engine import Scale, compute_dtype, fixed_scale_applies, softmax_terms
from ._common import check_agreement, finish_checks, image_text_inputs, image_text_positives, positive_logits

__all__ = ["clip_loss", "image_text_contrastive_loss", "text_ids"]


def text_ids(texts: list[str]) -> Tensor:
    """Ids for caption strings: equal strings get equal ids (seed 002's text hash).

    Deterministic across processes and ranks (unlike Python's salted ``hash``): ids
    are the first 8 bytes of each string's BLAKE2b digest. Call it in the data loader,
    not in the training step.
    """
    if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be a list of str")
    values = [int.from_bytes(hashlib.blake2b(t.encode("utf-8"), digest_size=8).digest(), "little", signed=True) for t in texts]
    return torch.tensor(values, dtype=torch.int64)


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
) -> Tensor:
    """Symmetric image-text contrastive loss of CLIP/ALIGN (seed 002).

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
        image_id, text_id: optional (N,) integer ids (see :func:`text_ids`).
        normalize: L2-normalise (seed 002 insists; default True).
        reduction: ``"mean"``; ``"sum"``; ``"none"``: (N,) values ``e_i`` whose mean is
            the loss -- without ids ``e_i = (CE_image_i + CE_text_i) / 2``.
        chunk_size, gather, grad_reduction, eps, validate: see
            :func:`~torch_contrastive.nt_xent_loss`. With ``gather`` each rank computes
            only its own image rows against all gathered texts; the second direction's
            per-text log-sum-exp is completed by an O(N) all-reduce of partial column
            sums, so the N x N work is split across ranks.

    Memory: O(N * D + tile^2); forward+backward cost about four N x N x D matrix
    multiplies, one ``exp`` per logit when the fixed shift applies.
    """
    pair = image_text_inputs(image_feat, text_feat, image_id, text_id, reduction=reduction, chunk_size=chunk_size,
                             grad_reduction=grad_reduction, eps=eps, gather=gather, validate=validate)
    n, device, image_id, text_id, ids_given, scope, checks = pair
    scale, bound = v.inverse_temperature(temperature, checks, need_bound=normalize)
    check_agreement(scope, "image_feat/text_feat", image_feat, validate, *ids_given)

    fixed = fixed_scale_applies(normalize, bound, image_feat.dtype)
    if not scope.distributed:
        # gt is symmetric (gt_ij = gt_ji), so one Positives serves both directions, and the
        # whole loss -- normalisation, both directions, positives -- is one engine call.
        pos = image_text_positives(image_id, text_id, n, n, scope, device)
        counts = pos.row_counts()
        weights = (None, None) if pos.kind == "partner" else (counts.to(compute_dtype(image_feat.dtype)), None)
        per_image, per_text = softmax_terms(image_feat, text_feat.to(image_feat.dtype), scale, self_offset=None, positives=pos,
                                            row_weights=weights, col_weights=weights, columns=True, fixed=fixed,
                                            normalize=normalize, eps=eps, chunk_size=chunk_size)
        if per_text is None:
            raise RuntimeError("internal: columns=True returns the column terms")
    else:
        per_image, per_text, counts = _distributed_terms(image_feat, text_feat, scale, image_id, text_id, scope, fixed, normalize,
                                                         eps, chunk_size)
    finish_checks(per_image + per_text, checks, v.output_needs_check(normalize, bound))
    return _reduce_image_text(per_image, per_text, counts.sum(), n, reduction, scope)


def _distributed_terms(image_feat: Tensor, text_feat: Tensor, scale: Scale, image_id: Tensor | None, text_id: Tensor | None,
                       scope: Scope, fixed: bool, normalize: bool, eps: float, chunk_size: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-image and per-text terms of this rank's rows under ``gather=True``.

    One pass over this rank's image rows x all texts gives the image rows' terms and the
    column sums; the engine all-reduces those (O(N)) into every text's LSE, so the N x N
    work is split W ways instead of being done once per direction. Each text row's
    positive part needs all images, so it is computed here from the gathered images.
    """
    n = image_feat.shape[0]
    img = prepare(image_feat, normalize, eps)
    txt = prepare(text_feat.to(image_feat.dtype), normalize, eps)
    img_all, txt_all = scope.rows(img), scope.rows(txt)
    offset = scope.offset  # known once rows() has gathered the sizes
    pos = image_text_positives(image_id, text_id, n, img_all.shape[0], scope, img.device)
    counts = pos.row_counts()
    per_image, col_lse_all = softmax_terms(img, txt_all, scale, self_offset=None, positives=pos,
                                           row_weights=(counts.to(img.dtype), None), columns=True, column_positives=False,
                                           fixed=fixed, chunk_size=chunk_size, column_comm=scope)
    if col_lse_all is None:
        raise RuntimeError("internal: columns=True returns the column terms")
    per_text = counts * col_lse_all[offset : offset + n] - positive_logits(txt, img_all, pos, scale)
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
