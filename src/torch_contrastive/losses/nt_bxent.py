"""NT-BXent, the multi-positive binary cross-entropy loss (README, "Conventions")."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _validation as v
from ..engine import Options, PairTerms, Problem, compute_dtype, solve
from ..positives import Positives
from ._kept import kept
from ._labelled import labelled_pairwise_rows
from ._prologue import begin, engine_total, reduce, single_set

__all__ = ["nt_bxent_loss"]


@kept(1, labels=True)
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
    validate: bool = True,
    backend: str = "auto",
) -> Tensor:
    """NT-BXent, the multi-positive binary cross-entropy loss (README, "Conventions").

    Positives are the directional (row, column) pairs of ``pos_indices`` or the pairs
    with equal ``labels``. The diagonal is always a positive with zero loss and is
    counted in ``n_pos_i``, exactly as the seed's code does. Per row

        ``loss_i = sum_{j pos} -log sigmoid(s_ij) / n_pos_i
                 + sum_{j neg} -log sigmoid(-s_ij) / n_neg_i``

    with ``n_neg_i = 2N - n_pos_i`` (no negative term when it is 0), then the mean over
    rows. Computed with log-sigmoid (softplus), so tau = 0.01 gives the exact 48.286442
    on the write-up's example batch where its float32 ``sigmoid`` + ``binary_cross_entropy``
    prints 62.8988.

    Args:
        embeddings: (M, D) float tensor.
        pos_indices: (P, 2) integer tensor of (row, column) positive pairs, each in
            ``[0, M)``; pairs are directional, as in the seed.
        temperature: tau > 0 (default 0.5).
        labels: (M,) integer tensor instead of ``pos_indices``.
        reduction: ``"mean"`` over rows, ``"sum"``, or ``"none"`` (M,) per-row losses.

    The shared options ``normalize``, ``chunk_size``, ``gather``, ``grad_reduction``, ``eps``, ``validate``,
    ``backend`` are documented once in :mod:`torch_contrastive.options`.

    Memory: O(M * D + tile^2).
    """
    v.check_embeddings(embeddings, "embeddings")
    scope, checks = begin(normalize=normalize, reduction=reduction, chunk_size=chunk_size, grad_reduction=grad_reduction, eps=eps, backend=backend,
                          gather=gather, validate=validate)
    n = embeddings.shape[0]
    if (pos_indices is None) == (labels is None):
        raise ValueError("nt_bxent_loss needs exactly one of pos_indices or labels")
    if pos_indices is not None:
        pos_indices = v.check_pos_indices(pos_indices, n, embeddings.device, checks)
    else:
        labels = v.check_labels(labels, "labels", n, embeddings.device)
    checks.finite(embeddings, "embeddings", deferred=True)
    scale, bound = v.inverse_temperature(temperature, checks)
    z, z_all, offset, inside = single_set(embeddings, "embeddings", normalize, scope, checks, labels is not None)
    total = z_all.shape[0]
    cdtype = compute_dtype(z.dtype)
    reduced = engine_total(reduction, scope, float(n), cdtype)

    def row_weights(positives: Positives) -> tuple[Tensor | tuple[Tensor, Tensor], Tensor | float] | None:
        """The write-up's per-row means: the positive sum over |P_i| + 1 (the diagonal counts,
        unscored), the negative sum over the negatives (none: 0); then the mean over rows."""
        if reduced is None:
            return None
        n_pos = positives.row_counts_as(cdtype) + 1
        # no negatives: a 0 weight (1 / 0's infinity made 0)
        return (n_pos.reciprocal(), (total - n_pos).reciprocal().nan_to_num_(posinf=0.0)), reduced[0]

    if pos_indices is not None:
        # pos_indices index this rank's own batch: shift the columns to global rows.
        pairs = pos_indices if not offset else pos_indices + torch.tensor([0, offset], device=pos_indices.device)
        positives = Positives.from_pairs(pairs, n, total, self_offset=offset)
        outputs = solve(Problem(z, z_all, scale, PairTerms("binary", combine=row_weights(positives)), positives=positives,
                                self_offset=offset, options=Options(inside, eps, chunk_size, backend)))
        counts = None if reduced is not None else positives.row_counts()
    else:
        rows = labelled_pairwise_rows(z, z_all, scope.ints(labels), offset, scale, bound, kernel="binary",  # type: ignore[arg-type]
                                      checks=checks, scope=scope, normalize=normalize, inside=inside, eps=eps, chunk_size=chunk_size,
                                      combine=None if reduced is None else row_weights, backend=backend)
        outputs, counts, bound = rows
    check_output = v.output_needs_check(normalize, bound)
    if reduced is not None:  # combined and reduced inside the engine
        # normalised inside, a non-finite row makes the loss NaN: every other row is its positive or its
        # negative, and both weights are positive (no negatives: no negative weight, but then all positives)
        return reduce(outputs[0], float(n), reduction, scope, checks, check_output, inside=True, covers=inside and n >= 2)
    pos_sum, neg_sum = outputs
    if counts is None:
        raise RuntimeError("internal: the per-row path keeps the positive counts")
    n_pos = (counts + 1).to(pos_sum.dtype)  # + the diagonal, as in the seed
    n_neg = total - n_pos
    per_row = pos_sum / n_pos + torch.where(n_neg > 0, neg_sum / n_neg.clamp_min(1), 0.0)
    return reduce(per_row, float(n), reduction, scope, checks, check_output)
