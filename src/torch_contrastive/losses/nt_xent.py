"""NT-Xent, the SimCLR loss (Chen et al. 2020)."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _validation as v
from .._normalize import prepare
from ..engine import Options, Problem, Scale, Softmax, compute_dtype, solve
from ..engine.pairwise import UNIT
from ..positives import Exclusion, Positives
from ._kept import kept
from ._labelled import check_reference, labelled_pairwise_rows
from ._pairing import partner_positives, positive_logits
from ._prologue import begin, engine_total, reduce, single_set

__all__ = ["nt_xent_loss"]


@kept(1, labels=True)
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
    validate: bool = True,
    memory_emb: Tensor | None = None,
    memory_labels: Tensor | None = None,
    decoupled: bool = False,
    positive_weight: Tensor | None = None,
    ref_emb: Tensor | None = None,
    ref_labels: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """NT-Xent, the SimCLR loss (Chen et al. 2020).

    Without labels every row has exactly one positive, chosen by ``pairing``, and

        ``loss_i = -s_{i,p(i)} + log sum_{j != i} exp(s_ij)``  (cross-entropy per row).

    With ``labels`` it follows pytorch-metric-learning's ``NTXentLoss``: one
    term per positive pair (i, p) -- same label, i != p --

        ``loss_ip = -s_ip + log(exp(s_ip) + sum_{n: y_n != y_i} exp(s_in))``

    averaged over all positive pairs. Unlike that library, no term is clamped, so the
    value and gradient stay exact at small temperatures.

    Args:
        embeddings: (2N, D) float tensor; rows are the views.
        temperature: tau > 0, float or 0-dim tensor (default 0.5).
        labels: optional (2N,) integer tensor; overrides ``pairing``.
        pairing: ``"adjacent"`` (pairs (0,1), (2,3), ...) or ``"halves"`` (i, i+N).
        reduction: ``"mean"`` (over rows; with labels over positive pairs), ``"sum"``,
            or ``"none"``: (2N,) per-row losses; with labels, each row's *sum* over
            its positive pairs (0 for rows without a positive).
        memory_emb: (M, D) rows kept from earlier batches (a
            :class:`~torch_contrastive.FeatureQueue`), with ``labels`` only: extra
            candidates of every row (positives and negatives by label) --
            pytorch-metric-learning's ``CrossBatchMemory`` around its ``NTXentLoss``, with
            this batch's rows live as candidates. Not gathered.
        memory_labels: (M,) integer labels of ``memory_emb``.
        ref_emb: (M, D) reference rows, with ``labels`` only: the candidates of every row
            instead of the batch (pytorch-metric-learning's ``loss(embeddings, labels,
            ref_emb=..., ref_labels=...)``); no self pair.
        ref_labels: (M,) integer labels of ``ref_emb``.
        decoupled: DCL (Yeh et al. 2021), pairing rules only: the positive leaves the
            denominator, ``loss_i = -s_ip + log sum_{j != i, p} exp(s_ij)`` (lightly's
            ``DCLLoss`` on ``torch.cat([out0, out1])`` with ``pairing="halves"``).
        positive_weight: optional (2N,) weight of each row's positive term, pairing rules
            only: ``loss_i = -w_i s_ip + LSE_i`` (DCLW's von Mises-Fisher weight, see
            :class:`~torch_contrastive.DCLWLoss`). A weight that requires grad gets its
            gradient ``d loss / d w_i = -s_ip`` (times the reduction's factor), as lightly's
            ``DCLLoss(weight_fn=...)``.

    Returns:
        0-dim loss (fp32 for half inputs), or per-row values for ``reduction="none"``.

    The shared options ``normalize``, ``chunk_size``, ``gather``, ``grad_reduction``, ``eps``, ``validate``,
    ``backend`` are documented once in :mod:`torch_contrastive.options`.

    Memory: O(N * D + tile^2). Without labels the forward+backward costs about two
    N x N x D matrix multiplies (symmetric tiles); with labels about five (two forward passes).
    """
    v.check_embeddings(embeddings, "embeddings")
    scope, checks = begin(normalize=normalize, reduction=reduction, chunk_size=chunk_size, grad_reduction=grad_reduction, eps=eps, backend=backend,
                          gather=gather, validate=validate)
    n = embeddings.shape[0]
    v.check_choice(pairing, "pairing", v.PAIRINGS)  # with labels it is unused, but a misspelt rule is still a mistake
    if labels is None:
        if n % 2 != 0:
            raise ValueError(f"embeddings must have an even number of rows (2N views) for pairing={pairing!r}, got {n}")
    else:
        labels = v.check_labels(labels, "labels", n, embeddings.device)
    checks.finite(embeddings, "embeddings", deferred=True)
    memory = v.check_memory(memory_emb, memory_labels, embeddings.shape[1], embeddings.device, checks)
    if memory is not None and labels is None:
        raise ValueError("memory_emb needs labels (positives with memory rows are found by label); pairing rules have none")
    reference = check_reference(ref_emb, ref_labels, labels, embeddings.shape[1], embeddings.device, checks, gather, memory)
    positive_weight = _check_dcl(decoupled, positive_weight, labels, n, embeddings.device, checks)
    # The fixed-shift choice (pairing rules) needs tau's value on the host; the labelled kernels do not.
    scale, bound = v.inverse_temperature(temperature, checks, need_bound=normalize and labels is None)
    z, z_all, offset, inside = single_set(embeddings, "embeddings", normalize, scope, checks, labels is not None)

    if labels is None:
        positives = partner_positives(n, pairing, offset, z.device, z_all.shape[0], offset, None if scope.distributed else pairing)
        # DCL: the positive (an involution's partner, so a symmetric relation) leaves the denominator
        exclude = Exclusion(relation=positives, symmetric=True) if decoupled else None
        # the engine takes row weights as constants; a weight's own gradient is added below
        weights = (None, None) if positive_weight is None else (None, positive_weight.detach().to(compute_dtype(z.dtype)))
        weight_term = None if positive_weight is None or not positive_weight.requires_grad else \
            _weight_term(positive_weight, z, z_all, positives, scale, inside, eps)
        total = None if decoupled or weight_term is not None else engine_total(reduction, scope, float(n), compute_dtype(z.dtype))
        per_row, _ = solve(Problem(z, z_all, scale, Softmax(row_weights=weights, exclude=exclude, total=total),
                                   positives=positives, self_offset=offset, symmetric=not scope.distributed,
                                   bound=bound if normalize else None, options=Options(inside, eps, chunk_size, backend)))
        if decoupled:  # a pair alone in the batch has no negative: its rows contribute 0
            per_row = torch.where(torch.isneginf(per_row), 0.0, per_row)
        if weight_term is not None:
            per_row = per_row + weight_term.to(per_row.dtype)
        # reduced inside: every row has its partner, so a non-finite row (normalised inside) makes the loss NaN
        return reduce(per_row, float(n), reduction, scope, checks, v.output_needs_check(normalize, bound),
                      inside=total is not None, covers=inside)

    cdtype = compute_dtype(z.dtype)

    def per_pair_mean(positives: Positives) -> tuple[tuple[float], Tensor | float] | None:
        total = engine_total(reduction, scope, positives.pair_count_as(cdtype), cdtype)  # the mean over positive pairs
        return None if total is None else (UNIT, total[0])

    rows = labelled_pairwise_rows(z, z_all, scope.ints(labels), offset, scale, bound, kernel="pair_softplus", checks=checks,
                                  scope=scope, normalize=normalize, inside=inside, eps=eps, chunk_size=chunk_size, memory=memory,
                                  combine=None if reduction == "none" or scope.distributed else per_pair_mean, reference=reference,
                                  backend=backend)
    check_output = v.output_needs_check(normalize, rows.scale_bound)
    inside_total = rows.outputs[0].ndim == 0  # reduced inside: the pair count is not needed again
    return reduce(rows.outputs[0], 1.0 if inside_total or rows.counts is None else rows.counts.sum(), reduction, scope,
                  checks, check_output,
                  inside=inside_total)


def _check_dcl(decoupled: object, positive_weight: object, labels: Tensor | None, n: int,
               device: torch.device, checks: v.Checks) -> Tensor | None:
    """DCL's options checked: pairing rules only; the weight a (2N,) floating tensor (or None) of finite values
    (a value check: an inf or NaN weight would give a wrong finite mean or NaN)."""
    if not isinstance(decoupled, bool):
        raise TypeError(f"decoupled must be a bool, got {type(decoupled).__name__}")
    if labels is not None and (decoupled or positive_weight is not None):
        raise ValueError("decoupled and positive_weight apply to pairing rules (one positive per row), not to labels")
    if positive_weight is None:
        return None
    weight = v.check_row_weight(positive_weight, "positive_weight", n, device)
    checks.finite(weight, "positive_weight")
    return weight


def _weight_term(weight: Tensor, z: Tensor, z_all: Tensor, positives: Positives, scale: Scale, inside: bool,
                 eps: float) -> Tensor:
    """``-(w_i - stop_grad(w_i)) * s_ip`` per row: zero in value, ``d loss_i / d w_i = -s_ip`` in
    gradient -- the part of ``loss_i = -w_i s_ip + LSE_i`` the engine (constant weights) leaves out.
    The positive logits are constants here: the engine's node already carries their gradient."""
    with torch.no_grad():
        rows = prepare(z.detach(), inside, eps)
        candidates = rows if z_all is z else prepare(z_all.detach(), inside, eps)
        s_p = positive_logits(rows, candidates, positives, scale.detach() if isinstance(scale, Tensor) else scale)
    return -(weight - weight.detach()) * s_p.to(weight.dtype)
