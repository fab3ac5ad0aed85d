"""SigLIP: the sigmoid image-text loss (Zhai et al. 2023), with CLIP's duplicate-id rule."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import _validation as v
from ..engine import Options, Problem, Scale, SigmoidPairs, solve
from ..positives import PartnerPositives, Positives
from ._pairing import image_text_positives
from ._prologue import check_agreement, image_text_inputs, reduce

__all__ = ["siglip_loss"]


def _check_bias(bias: object, checks: v.Checks) -> Scale:
    if isinstance(bias, bool) or not isinstance(bias, (int, float, Tensor)):
        raise TypeError(f"logit_bias must be a float or a 0-dim tensor, got {type(bias).__name__}")
    if isinstance(bias, Tensor):
        b = v.check_scalar_tensor(bias, "logit_bias")
        checks.add(b, lambda: f"logit_bias must be finite, got {float(b.detach())}", v.not_finite, what="logit_bias must be finite")
        return b
    if not math.isfinite(float(bias)):
        raise ValueError(f"logit_bias must be finite, got {bias}")
    return float(bias)


def siglip_loss(
    image_feat: Tensor,
    text_feat: Tensor,
    logit_scale: float | Tensor,
    logit_bias: float | Tensor,
    image_id: Tensor | None = None,
    text_id: Tensor | None = None,
    *,
    negative_only: bool = False,
    normalize: bool = True,
    reduction: str = "mean",
    chunk_size: int | None = None,
    gather: bool = False,
    grad_reduction: str = "mean",
    eps: float = 1e-12,
    validate: bool = True,
    backend: str = "auto",
) -> Tensor:
    """SigLIP, the sigmoid loss for language-image pre-training (Zhai et al. 2023).

    Every image-text pair is an independent binary problem:

        ``s_ij = logit_scale * <a_i, b_j> + logit_bias``,
        ``loss = -sum_ij log sigmoid(z_ij s_ij) / N``

    with ``z_ij = +1`` for positives and -1 otherwise, N the number of images -- the
    value of open_clip's ``SigLipLoss`` (world size 1). Positives are the diagonal or,
    with ids, ``image_id_i == image_id_j or text_id_i == text_id_j`` (the image-text loss's rule,
    which the paper's implementation cannot express). Computed as ``softplus(-z s)``,
    never ``log(sigmoid(.))``.

    Args:
        image_feat: (N, D) image embeddings (the rows).
        text_feat: (N, D) text embeddings, row i paired with image i.
        logit_scale: the multiplier ``t > 0`` (open_clip passes ``exp(t')``; the paper
            initialises ``t' = log 10``), float or 0-dim tensor (gets its gradient).
        logit_bias: ``b`` (paper init -10), float or 0-dim tensor (gets its gradient).
        image_id: optional (N,) integer ids of the images; duplicates are positives.
        text_id: optional (N,) integer ids of the texts; duplicates are positives.
        negative_only: every pair is a negative (``z_ij = -1``): the term open_clip's
            distributed SigLIP adds for the texts of other ranks (its neighbour exchange).
            Not combined with ids.
        normalize: L2-normalise both inputs (default; open_clip expects normalised features).
        reduction: ``"mean"`` (sum over all pairs / N, as open_clip), ``"sum"`` (no ``/N``),
            ``"none"``: (N,) per-image row sums ``sum_j softplus(-z_ij s_ij)``.
        gather: the shared option; the texts (and ids) of every rank are gathered and each
            rank computes its own image rows against all of them; the value is the global
            loss on every rank.
        backend: ``"auto"`` (default: the torch backend), ``"torch"`` or ``"triton"`` (fused
            sigmoid tile kernels: positives on the diagonal or by ids, or none).

    The shared options ``chunk_size``, ``grad_reduction``, ``eps``, ``validate`` are documented once in
    :mod:`torch_contrastive.options`.

    Memory: O(N * D + tile^2); forward+backward about three N x N x D matrix multiplies
    (forward, recomputed tile, two gradient products) plus one softplus and one sigmoid
    per pair.
    """
    if not isinstance(negative_only, bool):
        raise TypeError(f"negative_only must be a bool, got {type(negative_only).__name__}")
    if negative_only:
        if image_id is not None or text_id is not None:
            raise ValueError("negative_only=True has no positives: do not pass image_id/text_id")
    pair = image_text_inputs(image_feat, text_feat, image_id, text_id, normalize=normalize, reduction=reduction, chunk_size=chunk_size,
                             grad_reduction=grad_reduction, eps=eps, gather=gather, validate=validate, backend=backend)
    n, device, image_id, text_id, ids_given, scope, checks = pair
    # The scale is a multiplier: 1 / scale is a "temperature" that must be positive and finite.
    v.inverse_temperature(logit_scale, checks, name="logit_scale")  # positive and finite, like a temperature
    scale: Scale = logit_scale.reshape(()) if isinstance(logit_scale, Tensor) else float(logit_scale)
    bias = _check_bias(logit_bias, checks)
    check_agreement(scope, "image_feat/text_feat", image_feat, validate, *ids_given)

    text_feat = text_feat.to(image_feat.dtype)
    # every rank's texts gathered as the caller gave them (half rows in half precision), normalised inside the engine
    img, txt_all, inside = image_feat, scope.rows(text_feat), normalize
    if negative_only:
        positives: Positives = Positives.from_pairs(torch.zeros(0, 2, dtype=torch.long, device=device), n, txt_all.shape[0], self_offset=None)
    else:
        positives = image_text_positives(image_id, text_id, n, txt_all.shape[0], scope, device)
    # Without ids image i's positive is text offset + i: a strided diagonal of each tile.
    diagonal = scope.offset if isinstance(positives, PartnerPositives) and not negative_only else None
    per_image = solve(Problem(img, txt_all, scale, SigmoidPairs(bias, diagonal), positives=positives,
                              options=Options(inside, eps, chunk_size, backend)))
    # "mean": the global sum over all pairs / the global number of images (open_clip's / N).
    bound = None if isinstance(scale, Tensor) or isinstance(bias, Tensor) else scale + abs(bias)
    return reduce(per_image, float(n), reduction, scope, checks, v.output_needs_check(normalize, bound))
