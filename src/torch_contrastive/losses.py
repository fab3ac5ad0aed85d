"""The four contrastive losses of the seeds, functional form (SPEC section 3).

Conventions shared by every function here (SPEC section 2):

* ``s_ij = <a_i, c_j> / temperature`` with ``a = a / max(||a||, eps)`` when
  ``normalize=True`` (cosine similarity, the default). ``normalize=False`` uses raw
  dot products.
* ``temperature`` is a positive float or a 0-dim tensor; a tensor gets its exact
  gradient.
* fp16/bf16 inputs are computed in fp32 and the loss is returned in fp32 (fp64 inputs
  stay fp64); gradients reach the inputs in their own dtype.
* ``chunk_size=None`` picks one tile for small batches and tiles of
  :data:`~torch_contrastive.engine.DEFAULT_TILE` rows above a memory budget; an int
  forces tiles of that many rows. Extra memory is O(N * D + tile^2), never N x N.
* ``gather=True`` on an initialised process group computes the loss of the global
  batch (see :mod:`torch_contrastive.distributed`); ``grad_reduction`` says whether
  the framework averages (``"mean"``, DDP) or sums gradients over ranks.
* Inputs are never modified; bad input raises ``TypeError``/``ValueError`` naming the
  argument.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import _validation as v
from .distributed import Scope, make_scope
from .engine import logsumexp_rows, pairwise_rows
from .positives import Positives

__all__ = [
    "clip_loss",
    "image_text_contrastive_loss",
    "nt_bxent_loss",
    "nt_xent_loss",
    "pair_keys",
    "supcon_loss",
    "text_ids",
]

REDUCTIONS = ("mean", "sum", "none")
PAIRINGS = ("adjacent", "halves")
GRAD_REDUCTIONS = ("mean", "sum")


# ---------------------------------------------------------------------------------
# shared preparation
# ---------------------------------------------------------------------------------
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _L2Normalize(torch.autograd.Function):
    """``x / max(||x||, eps)`` per row, overflow-free and memory-lean.

    The row is divided by its largest magnitude before the norm is taken, so norms of
    1e30 or 1e-30 neither overflow nor underflow. Backward saves only the output and
    the per-row norm (F.normalize keeps two more N x D tensors): for rows with
    ``||x|| > eps`` the gradient is ``(g - y (g . y)) / ||x||``, otherwise ``g / eps``;
    an all-zero row gets a zero gradient (not ``g / eps``).
    """

    @staticmethod
    def forward(ctx, x: Tensor, eps: float):  # type: ignore[override]
        peak = x.abs().amax(dim=1, keepdim=True)
        nonzero = peak > 0
        peak = torch.where(nonzero, peak, torch.ones_like(peak))
        norm = torch.linalg.vector_norm(x / peak, dim=1, keepdim=True) * peak
        denom = torch.clamp_min(norm, eps)
        y = x / denom
        ctx.save_for_backward(y, denom, norm > eps, nonzero)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor):  # type: ignore[override]
        y, denom, above, nonzero = ctx.saved_tensors
        radial = torch.where(above, (g * y).sum(dim=1, keepdim=True), torch.zeros_like(denom))
        return (g - y * radial) / denom * nonzero, None


def _prepare(x: Tensor, normalize: bool, eps: float) -> Tensor:
    """Cast to the compute dtype and L2-normalise rows: ``x / max(||x||, eps)``."""
    x = x.to(_compute_dtype(x.dtype))
    if not normalize:
        return x
    return _L2Normalize.apply(x, float(eps))


def _options(reduction: str, chunk_size: object, grad_reduction: str, eps: float) -> int | None:
    v.check_choice(reduction, "reduction", REDUCTIONS)
    v.check_choice(grad_reduction, "grad_reduction", GRAD_REDUCTIONS)
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive float, got {eps!r}")
    return v.check_chunk_size(chunk_size)


_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def _check_agreement(scope: Scope, what: str, x: Tensor, *flags: bool) -> None:
    """Ranks must agree on feature shape, dtype and which optional inputs were given."""
    scope.agree(f"{what} (feature size, dtype code, optional inputs given)",
                [float(x[0].numel()), float(_DTYPE_CODES.get(x.dtype, -1)), *(float(f) for f in flags)])


class _SingleSet(NamedTuple):
    scope: Scope
    z: Tensor  # this rank's rows, normalised, in the compute dtype
    z_all: Tensor  # the global batch (z itself when local)
    scale: Tensor  # 1 / temperature in the compute dtype
    offset: int  # global index of this rank's first row


def _single_set(x: Tensor, name: str, scale: Tensor, normalize: bool, eps: float, gather: bool,
                grad_reduction: str, *given: bool) -> _SingleSet:
    """Shared set-up of the single-set losses: agreement check, normalisation, gather."""
    scope = make_scope(gather, grad_reduction)
    _check_agreement(scope, name, x, *given)
    z = _prepare(x, normalize, eps)
    z_all = scope.rows(z)
    return _SingleSet(scope, z, z_all, scale.to(device=z.device, dtype=z.dtype), scope.offset)


def _reduce(per_anchor: Tensor, normaliser: Tensor, reduction: str, scope: Scope) -> Tensor:
    """Apply ``reduction`` to this rank's per-anchor values.

    ``mean`` divides the global sum by the global ``normaliser``; ``sum`` is the global
    sum; ``none`` returns this rank's per-anchor values (no communication).
    """
    _check_finite(per_anchor, scope)
    if reduction == "none":
        return per_anchor
    local_sum = per_anchor.sum()
    if reduction == "sum":
        return scope.finish(local_sum, torch.ones((), dtype=local_sum.dtype, device=local_sum.device))
    return scope.finish(local_sum, normaliser.to(local_sum.dtype).clamp_min(1))


def _check_finite(values: Tensor, scope: Scope) -> None:
    # Finite inputs give finite losses unless raw dot products (normalize=False)
    # overflow the compute dtype: say so instead of returning inf or NaN. Under
    # gather=True every rank learns of any rank's overflow, so none is left waiting.
    bad = (~torch.isfinite(values.detach())).any().to(torch.float64)
    if scope.distributed:
        scope.all_max(bad)
    if bool(bad):
        raise ValueError(
            f"the loss overflowed {values.dtype}: with normalize=False the logits <a_i, c_j> / temperature exceed its range; "
            "use normalize=True, smaller embeddings or a larger temperature"
        )


def _positive_logits(anchors: Tensor, candidates: Tensor, positives: Positives, scale: Tensor) -> Tensor:
    """(R,) ``sum_{p in P(i)} s_ip``, in O(N * D) through the positive aggregate."""
    return (anchors * positives.aggregate(candidates)).sum(dim=1) * scale


def pair_keys(n_rows: int, pairing: str, device: torch.device | None = None) -> Tensor:
    """Key of each row under a pairing rule: rows with equal keys are positives.

    Args:
        n_rows: 2N, the number of rows (even).
        pairing: ``"adjacent"`` pairs rows (0, 1), (2, 3), ... (seeds 000/001);
            ``"halves"`` pairs row i with i + N, as in ``torch.cat([view1, view2])``
            (seed 003, the SimCLR and SupCon papers).
    """
    rows = torch.arange(n_rows, device=device)
    return rows // 2 if pairing == "adjacent" else rows % (n_rows // 2)


# ---------------------------------------------------------------------------------
# NT-Xent
# ---------------------------------------------------------------------------------
def nt_xent_loss(
    embeddings: Tensor,
    temperature: float | Tensor = 0.5,
    *,
    labels: Tensor | None = None,
    pairing: str = "adjacent",
    normalize: bool = True,
    reduction: str = "mean",
    chunk_size: int | None = None,
    gather: bool = False,
    grad_reduction: str = "mean",
    eps: float = 1e-12,
) -> Tensor:
    """NT-Xent, the SimCLR loss (seeds 000, 001, 003, 004).

    Without labels every row has exactly one positive, chosen by ``pairing``, and

        ``loss_i = -s_{i,p(i)} + log sum_{j != i} exp(s_ij)``  (cross-entropy per row).

    With ``labels`` it follows pytorch-metric-learning's ``NTXentLoss`` (seed 004): one
    term per positive pair (i, p) -- same label, i != p --

        ``loss_ip = -s_ip + log(exp(s_ip) + sum_{n: y_n != y_i} exp(s_in))``

    averaged over all positive pairs. Unlike that library, no term is clamped, so the
    value and gradient stay exact at small temperatures.

    Args:
        embeddings: (2N, D) float tensor; rows are the views.
        temperature: tau > 0, float or 0-dim tensor (default 0.5).
        labels: optional (2N,) integer tensor; overrides ``pairing``.
        pairing: ``"adjacent"`` (pairs (0,1), (2,3), ...) or ``"halves"`` (i, i+N).
        normalize: cosine similarity (True) or raw dot product.
        reduction: ``"mean"`` (over rows; with labels over positive pairs), ``"sum"``,
            or ``"none"``: (2N,) per-row losses; with labels, each row's *sum* over
            its positive pairs (0 for rows without a positive).
        chunk_size: tile rows, None for automatic.
        gather: compute over the batch of all ranks (``torch.distributed``).
        grad_reduction: ``"mean"`` if the framework averages gradients over ranks
            (DDP), ``"sum"`` if it sums them.
        eps: normalisation floor.

    Returns:
        0-dim loss (fp32 for half inputs), or per-row values for ``reduction="none"``.

    Memory: O(N * D + tile^2). Without labels the forward+backward costs about two
    N x N x D matrix multiplies (symmetric tiles); with labels about five (two forward passes).
    """
    v.check_embeddings(embeddings, "embeddings")
    chunk = _options(reduction, chunk_size, grad_reduction, eps)
    scale = v.check_temperature(temperature)
    n = embeddings.shape[0]
    if labels is None:
        v.check_choice(pairing, "pairing", PAIRINGS)
        if n % 2 != 0:
            raise ValueError(f"embeddings must have an even number of rows (2N views) for pairing={pairing!r}, got {n}")
    else:
        labels = v.check_labels(labels, "labels", n, embeddings.device)
    scope, z, z_all, scale, offset = _single_set(embeddings, "embeddings", scale, normalize, eps, gather, grad_reduction,
                                                 labels is not None)
    if labels is None:
        keys = scope.ints(pair_keys(n, pairing, z.device) + offset)
    else:
        keys = scope.ints(labels)
    positives = Positives.from_keys(keys[offset : offset + n], keys, self_offset=offset)

    if labels is None:
        candidates = z if not scope.distributed else z_all
        lse, _ = logsumexp_rows(z, candidates, scale, self_offset=offset, bounded=normalize, chunk_size=chunk)
        per_row = lse - _positive_logits(z, z_all, positives, scale)
        return _reduce(per_row, torch.tensor(float(n), device=z.device), reduction, scope)

    (per_row,) = pairwise_rows(z, z_all, scale, positives, kernel="pair_softplus", chunk_size=chunk)
    n_pairs = positives.row_counts().sum()
    return _reduce(per_row, n_pairs, reduction, scope)


# ---------------------------------------------------------------------------------
# NT-BXent
# ---------------------------------------------------------------------------------
def nt_bxent_loss(
    embeddings: Tensor,
    pos_indices: Tensor | None = None,
    temperature: float | Tensor = 0.5,
    *,
    labels: Tensor | None = None,
    normalize: bool = True,
    reduction: str = "mean",
    chunk_size: int | None = None,
    gather: bool = False,
    grad_reduction: str = "mean",
    eps: float = 1e-12,
) -> Tensor:
    """NT-BXent, the multi-positive binary cross-entropy loss of seed 000.

    Positives are the directional (row, column) pairs of ``pos_indices`` or the pairs
    with equal ``labels``. The diagonal is always a positive with zero loss and is
    counted in ``n_pos_i``, exactly as the seed's code does. Per row

        ``loss_i = sum_{j pos} -log sigmoid(s_ij) / n_pos_i
                 + sum_{j neg} -log sigmoid(-s_ij) / n_neg_i``

    with ``n_neg_i = 2N - n_pos_i`` (no negative term when it is 0), then the mean over
    rows. Computed with log-sigmoid (softplus), so tau = 0.01 gives the exact 48.286442
    on seed 000's batch where the seed's float32 ``sigmoid`` + ``binary_cross_entropy``
    prints 62.8988.

    Args:
        embeddings: (M, D) float tensor.
        pos_indices: (P, 2) integer tensor of (row, column) positive pairs, each in
            ``[0, M)``; pairs are directional, as in the seed.
        temperature: tau > 0 (default 0.5).
        labels: (M,) integer tensor instead of ``pos_indices``.
        normalize, chunk_size, gather, grad_reduction, eps: see :func:`nt_xent_loss`.
        reduction: ``"mean"`` over rows, ``"sum"``, or ``"none"`` (M,) per-row losses.

    Memory: O(M * D + tile^2).
    """
    v.check_embeddings(embeddings, "embeddings")
    chunk = _options(reduction, chunk_size, grad_reduction, eps)
    scale = v.check_temperature(temperature)
    n = embeddings.shape[0]
    if (pos_indices is None) == (labels is None):
        raise ValueError("nt_bxent_loss needs exactly one of pos_indices or labels")
    if pos_indices is not None:
        pos_indices = _check_pos_indices(pos_indices, n, embeddings.device)
    else:
        labels = v.check_labels(labels, "labels", n, embeddings.device)
    scope, z, z_all, scale, offset = _single_set(embeddings, "embeddings", scale, normalize, eps, gather, grad_reduction,
                                                 labels is not None)
    total = z_all.shape[0]
    if pos_indices is not None:
        # pos_indices index this rank's own batch: shift the columns to global rows.
        pairs = pos_indices + torch.tensor([0, offset], device=pos_indices.device)
        positives = Positives.from_pairs(pairs, n, total, self_offset=offset)
    elif labels is not None:
        keys = scope.ints(labels)
        positives = Positives.from_keys(keys[offset : offset + n], keys, self_offset=offset)
    pos_sum, neg_sum = pairwise_rows(z, z_all, scale, positives, kernel="binary", chunk_size=chunk)
    n_pos = (positives.row_counts() + 1).to(z.dtype)  # + the diagonal, as in the seed
    n_neg = total - n_pos
    per_row = pos_sum / n_pos + torch.where(n_neg > 0, neg_sum / n_neg.clamp_min(1), torch.zeros_like(neg_sum))
    return _reduce(per_row, torch.tensor(float(n), device=z.device), reduction, scope)


def _check_pos_indices(pos_indices: object, n: int, device: torch.device) -> Tensor:
    if not isinstance(pos_indices, Tensor):
        raise TypeError(f"pos_indices must be a (P, 2) integer tensor, got {type(pos_indices).__name__}")
    if pos_indices.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        raise TypeError(f"pos_indices must have an integer dtype, got {pos_indices.dtype}")
    if pos_indices.ndim != 2 or pos_indices.shape[1] != 2:
        raise ValueError(f"pos_indices must have shape (P, 2), got {tuple(pos_indices.shape)}")
    p = pos_indices.to(device=device, dtype=torch.int64)
    if p.numel() and (int(p.min()) < 0 or int(p.max()) >= n):
        raise ValueError(f"pos_indices must lie in [0, {n}) (rows of embeddings), got values in [{int(p.min())}, {int(p.max())}]")
    return p


# ---------------------------------------------------------------------------------
# Image-text contrastive loss
# ---------------------------------------------------------------------------------
def text_ids(texts: list[str]) -> Tensor:
    """Ids for caption strings: equal strings get equal ids (seed 002's text hash).

    Deterministic across processes and ranks (unlike Python's salted ``hash``): ids
    are the first 8 bytes of each string's BLAKE2b digest. Call it in the data loader,
    not in the training step.
    """
    import hashlib

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
        chunk_size, gather, grad_reduction, eps: see :func:`nt_xent_loss`. With
            ``gather`` each rank computes only its own image rows against all gathered
            texts; the second direction's per-text log-sum-exp is completed by an O(N)
            all-reduce of partial column sums, so the N x N work is split across ranks.

    Memory: O(N * D + tile^2); forward+backward cost about four N x N x D matrix
    multiplies, one ``exp`` per logit when the fixed shift applies.
    """
    v.check_embeddings(image_feat, "image_feat")
    v.check_embeddings(text_feat, "text_feat")
    v.check_same_rows(image_feat, "image_feat", text_feat, "text_feat")
    chunk = _options(reduction, chunk_size, grad_reduction, eps)
    scale = v.check_temperature(temperature)
    n = image_feat.shape[0]
    device = image_feat.device
    ids_given = (image_id is not None, text_id is not None)
    image_id = None if image_id is None else v.check_labels(image_id, "image_id", n, device)
    text_id = None if text_id is None else v.check_labels(text_id, "text_id", n, device)
    scope = make_scope(gather, grad_reduction)
    _check_agreement(scope, "image_feat/text_feat", image_feat, *ids_given)

    img = _prepare(image_feat, normalize, eps)
    txt = _prepare(text_feat.to(image_feat.dtype), normalize, eps)
    scale = scale.to(device=img.device, dtype=img.dtype)
    # Locally every "global" tensor below is the local one itself (same objects, no copy).
    img_all, txt_all = scope.rows(img), scope.rows(txt)
    offset = scope.offset  # known once rows() has gathered the sizes
    key_list = [k for k in (image_id, text_id) if k is not None] or [torch.arange(n, device=device) + offset]
    global_keys = tuple(scope.ints(k) for k in key_list)
    local_keys = tuple(k[offset : offset + n] for k in global_keys) if scope.distributed else global_keys
    # gt is symmetric (gt_ij = gt_ji), so one Positives serves both directions.
    pos = Positives.from_keys(local_keys, global_keys, self_offset=None)
    # One pass over this rank's image rows x all texts gives the image rows' LSE and the
    # column sums; under gather=True the engine all-reduces those (O(N)) into every text's
    # LSE, so the N x N work is split W ways instead of being done once per direction.
    row_lse, col_lse_all = logsumexp_rows(img, txt_all, scale, self_offset=None, columns=True, bounded=normalize,
                                          chunk_size=chunk, column_comm=scope if scope.distributed else None)
    col_lse = col_lse_all[offset : offset + n]  # type: ignore[index]
    counts = pos.row_counts()
    per_image = counts * row_lse - _positive_logits(img, txt_all, pos, scale)
    per_text = counts * col_lse - _positive_logits(txt, img_all, pos, scale)
    return _finish_image_text(per_image, per_text, counts.sum(), n, reduction, scope)


def _finish_image_text(per_image: Tensor, per_text: Tensor, n_gt: Tensor, n: int, reduction: str, scope: Scope) -> Tensor:
    _check_finite(per_image + per_text, scope)
    if reduction == "none":
        # e_i such that mean(e) is the loss: scale each direction by N / (2 sum gt).
        n_gt_all = scope.total(n_gt).to(per_image.dtype)
        n_all = float(sum(scope.sizes)) if scope.distributed else float(n)
        return (per_image + per_text) * (n_all / (2 * n_gt_all))
    local_sum = (per_image.sum() + per_text.sum()) / 2
    if reduction == "sum":
        n_all_t = scope.total(torch.tensor(float(n), dtype=per_image.dtype, device=per_image.device))
        return scope.finish(local_sum * n_all_t, n_gt.to(per_image.dtype))
    return scope.finish(local_sum, n_gt.to(per_image.dtype))


clip_loss = image_text_contrastive_loss


# ---------------------------------------------------------------------------------
# SupCon
# ---------------------------------------------------------------------------------
def supcon_loss(
    features: Tensor,
    labels: Tensor | None = None,
    mask: Tensor | None = None,
    temperature: float | Tensor = 0.07,
    *,
    base_temperature: float | Tensor | None = None,
    contrast_mode: str = "all",
    normalize: bool = True,
    reduction: str = "mean",
    chunk_size: int | None = None,
    gather: bool = False,
    grad_reduction: str = "mean",
    eps: float = 1e-12,
) -> Tensor:
    """Supervised contrastive loss (Khosla et al. 2020; seed 004).

    ``loss_i = -(tau / tau_base) * mean_{p in P(i)} [ s_ip - log sum_{a != i} exp(s_ia) ]``

    Two input forms:

    * the SupCon authors' ``features`` of shape (bsz, n_views, ...) (trailing dims are
      flattened), flattened view-major (``torch.cat(torch.unbind(features, 1))``).
      Positives: same ``labels`` (bsz,), or ``mask`` (bsz, bsz) (may be asymmetric),
      or, with neither, the other views of the same sample (SimCLR);
    * pytorch-metric-learning's (N, D) embeddings with ``labels`` (N,) (or an (N, N)
      ``mask``).

    Anchors without a positive are left out of the mean (as pytorch-metric-learning
    does; the authors' code returns NaN); with no positive at all the loss is 0 with
    a zero gradient.

    Args:
        features: (bsz, n_views, ...) or (N, D) float tensor.
        labels: (bsz,) or (N,) integer class labels.
        mask: (bsz, bsz) positive mask instead of labels (not with ``gather``).
        temperature: tau > 0 (default 0.07).
        base_temperature: tau_base; ``None`` means tau (no rescaling, as
            pytorch-metric-learning). Pass 0.07 to reproduce the authors' scale.
        contrast_mode: ``"all"`` (every view is an anchor) or ``"one"`` (view 0 only).
        normalize: cosine similarity (default). The authors' code uses raw dot
            products of features it expects to be normalised already.
        reduction: ``"mean"`` over anchors with positives, ``"sum"``, or ``"none"``:
            per-anchor losses in view-major order (0 for anchors without positives).
        chunk_size, gather, grad_reduction, eps: see :func:`nt_xent_loss`.

    Memory: O(N * D + tile^2); forward+backward about two N x N x D matrix
    multiplies in ``"all"`` mode, whatever the labels.
    """
    v.check_embeddings(features, "features", min_ndim=2, max_ndim=None)
    chunk = _options(reduction, chunk_size, grad_reduction, eps)
    v.check_choice(contrast_mode, "contrast_mode", ("all", "one"))
    scale = v.check_temperature(temperature)
    factor = None if base_temperature is None else (1.0 / scale) / (1.0 / v.check_temperature(base_temperature, "base_temperature")).to(scale.device)
    if labels is not None and mask is not None:
        raise ValueError("supcon_loss takes labels or mask, not both")
    if features.ndim == 2:
        if labels is None and mask is None:
            raise ValueError("features of shape (N, D) need labels (or a mask); pass (bsz, n_views, D) for SimCLR-style views")
        features = features[:, None]
    bsz, n_views = features.shape[0], features.shape[1]
    flat = features.transpose(0, 1).reshape(bsz * n_views, -1)  # view-major, as the authors' code
    device = features.device
    if labels is not None:
        labels = v.check_labels(labels, "labels", bsz, device)
    if mask is not None:
        mask = _check_mask(mask, bsz, device)
        if gather:
            raise ValueError("mask cannot be combined with gather=True (it only relates this rank's samples); pass labels")
    scope, z, z_all, scale, offset = _single_set(flat, "features", scale, normalize, eps, gather, grad_reduction,
                                                 labels is not None)
    n_anchor = bsz if contrast_mode == "one" else bsz * n_views
    if mask is not None:
        positives = Positives.from_sample_mask(mask, torch.arange(n_anchor, device=device) % bsz, bsz * n_views)
    else:
        sample_keys = labels if labels is not None else torch.arange(bsz, device=device) + offset
        keys = scope.ints(sample_keys.repeat(n_views))
        # This rank's anchors are its first n_anchor flattened rows.
        positives = Positives.from_keys(keys[offset : offset + n_anchor], keys, self_offset=offset)
    anchors = z if n_anchor == z.shape[0] else z[:n_anchor]
    candidates = z if not scope.distributed else z_all
    lse, _ = logsumexp_rows(anchors, candidates, scale, self_offset=offset, bounded=normalize, chunk_size=chunk)
    counts = positives.row_counts()
    has_pos = counts > 0
    mean_pos = _positive_logits(anchors, z_all, positives, scale) / counts.clamp_min(1).to(z.dtype)
    per_anchor = torch.where(has_pos, lse - mean_pos, torch.zeros_like(lse))
    if factor is not None:
        per_anchor = per_anchor * factor.to(per_anchor.dtype)
    return _reduce(per_anchor, has_pos.sum(), reduction, scope)


def _check_mask(mask: object, bsz: int, device: torch.device) -> Tensor:
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a ({bsz}, {bsz}) tensor, got {type(mask).__name__}")
    if mask.shape != (bsz, bsz):
        raise ValueError(f"mask must have shape ({bsz}, {bsz}), got {tuple(mask.shape)}")
    if mask.is_floating_point() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must contain only 0 and 1")
    return mask.to(device=device).bool()
