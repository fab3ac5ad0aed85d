"""Every loss call's set-up and finish (README, "Conventions").

* ``s_ij = <a_i, c_j> / temperature`` with ``a = a / max(||a||, eps)`` when
  ``normalize=True`` (cosine similarity, the default); raw dot products otherwise.
* fp16/bf16 inputs are computed in fp32 and the loss is returned in fp32.
* ``validate=True`` reads device values once per call (one combined check);
  ``validate=False`` reads none, so a call makes no host synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from .. import _validation as v
from .._tensors import as_dtype
from ..distributed import Scope, make_scope
from ..engine.planner import reduce_inside
from ..options import shared


def begin(*, normalize: bool, reduction: str, chunk_size: int | None, grad_reduction: str, eps: float, backend: str, gather: bool,
          validate: bool, stacklevel: int = 4) -> tuple[Scope, v.Checks]:
    """Every loss's prologue: the shared options checked (:mod:`torch_contrastive.options`), the
    call's :class:`~torch_contrastive.distributed.Scope` and its :class:`~torch_contrastive._validation.Checks`."""
    shared(normalize=normalize, reduction=reduction, chunk_size=chunk_size, grad_reduction=grad_reduction, eps=eps, backend=backend, gather=gather,
           validate=validate)  # checked the first time these values are seen
    scope = make_scope(gather, grad_reduction, stacklevel=stacklevel)  # a warning names the caller's line
    return scope, v.Checks(validate, scope)


_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def check_agreement(scope: Scope, what: str, x: Tensor, validate: bool, *flags: bool) -> None:
    """Ranks must agree on feature shape, dtype and which optional inputs were given."""
    if validate and scope.distributed:
        scope.agree(f"{what} (feature size, dtype code, optional inputs given)",
                    [float(x[0].numel()), float(_DTYPE_CODES.get(x.dtype, -1)), *(float(f) for f in flags)])


class ImageTextInputs(NamedTuple):
    n: int  # rows (images) on this rank
    device: torch.device
    image_id: Tensor | None  # int64 on device
    text_id: Tensor | None
    ids_given: tuple[bool, bool]
    scope: Scope
    checks: v.Checks


def image_text_inputs(image_feat: Tensor, text_feat: Tensor, image_id: Tensor | None, text_id: Tensor | None, *,
                      normalize: bool, reduction: str, chunk_size: int | None, grad_reduction: str, eps: float, gather: bool,
                      validate: bool, backend: str) -> ImageTextInputs:
    """Checks and set-up shared by the two-set image-text losses (CLIP's and SigLIP)."""
    v.check_embeddings(image_feat, "image_feat")
    v.check_embeddings(text_feat, "text_feat")
    v.check_same_rows(image_feat, "image_feat", text_feat, "text_feat")
    scope, checks = begin(normalize=normalize, reduction=reduction, chunk_size=chunk_size, grad_reduction=grad_reduction, eps=eps,
                          backend=backend, gather=gather, validate=validate, stacklevel=5)
    n = image_feat.shape[0]
    device = image_feat.device
    ids_given = (image_id is not None, text_id is not None)
    image_id = None if image_id is None else v.check_labels(image_id, "image_id", n, device)
    text_id = None if text_id is None else v.check_labels(text_id, "text_id", n, device)
    checks.finite(image_feat, "image_feat", deferred=True)
    checks.finite(text_feat, "text_feat", deferred=True)
    return ImageTextInputs(n, device, image_id, text_id, ids_given, scope, checks)


class SingleSet(NamedTuple):
    z: Tensor  # this rank's rows
    z_all: Tensor  # the global batch (z itself when local)
    offset: int  # global index of this rank's first row
    normalize_inside: bool  # the engine normalises z and z_all (the caller's ``normalize``, local or gathered)


def single_set(x: Tensor, name: str, normalize: bool, scope: Scope, checks: v.Checks, *given: bool) -> SingleSet:
    """Shared set-up of the single-set losses: agreement check, gather.

    The raw rows go to the engine, which normalises them inside its autograd function (fewer
    autograd nodes); under ``gather=True`` every rank's rows are gathered as the caller gave
    them (fp16/bf16 rows in half precision: half the bytes, and on a GPU multiplied on tensor
    cores with fp32 factors, as in one process) and normalised inside too.
    """
    check_agreement(scope, name, x, checks.enabled, *given)
    if not scope.distributed:
        return SingleSet(x, x, 0, normalize)
    return SingleSet(x, scope.rows(x), scope.offset, normalize)


def reduce(per_anchor: Tensor, normaliser: Tensor | float, reduction: str, scope: Scope, checks: v.Checks,
           check_output: bool, extra: tuple[Tensor, Callable[[list[float]], None]] | None = None, *,
           inside: bool = False, covers: bool = False) -> Tensor:
    """Apply ``reduction`` to this rank's per-anchor values and run the call's checks -- every
    loss's one way out.

    ``inside``: the engine already applied the reduction (:func:`engine_total`): ``per_anchor`` is
    the loss, only checked (``covers``: its value answers the deferred finite checks).

    ``mean`` divides the global sum by the global ``normaliser`` (at least 1); ``sum``
    is the global sum; ``none`` returns this rank's per-anchor values. ``extra``: see
    :meth:`~torch_contrastive._validation.Checks.finish`.
    """
    if inside:
        finish_checks(per_anchor, checks, check_output, covers, extra=extra)
        return per_anchor
    finish_checks(per_anchor, checks, check_output, extra=extra)
    if reduction == "none":
        return per_anchor
    local_sum = per_anchor.sum()
    if reduction == "sum":
        return scope.finish(local_sum, 1.0)
    if isinstance(normaliser, Tensor):
        normaliser = normaliser.to(local_sum.dtype).clamp_min(1)
    return scope.finish(local_sum, max(normaliser, 1.0) if isinstance(normaliser, float) else normaliser)


def engine_total(reduction: str, scope: Scope, normaliser: Tensor | float, dtype: torch.dtype,
                 factor: float = 1.0) -> tuple[Tensor | float, Tensor | float] | None:
    """The coefficient pair of ``Softmax(total=...)`` that applies ``reduction``
    inside the engine (one process, ``mean``/``sum``), times ``factor``; ``None`` when the
    per-row values must come back (``none``, or a distributed loss, whose value needs
    the ranks' sums). A tensor ``normaliser`` (a count) gives a coefficient in ``dtype``.
    """
    if not reduce_inside(reduction, scope.distributed):
        return None
    if reduction == "mean":
        if isinstance(normaliser, Tensor):
            # an integer count's reciprocal comes out in the default float dtype: one op fewer than
            # a conversion first, where that is the compute dtype (fp64 counts convert first: exact)
            coef: Tensor | float = normaliser.clamp_min(1).reciprocal() \
                if not normaliser.is_floating_point() and dtype == torch.get_default_dtype() else \
                as_dtype(normaliser, dtype).clamp_min(1).reciprocal()
            if factor != 1.0:
                coef = coef * factor
        else:
            coef = factor / max(float(normaliser), 1.0)
        return coef, coef
    return factor, factor


def finish_checks(values: Tensor | tuple[Tensor, ...], checks: v.Checks, check_output: bool, covers: bool = False,
                  extra: tuple[Tensor, Callable[[list[float]], None]] | None = None) -> None:
    """Read the call's value checks at once; with ``check_output`` also the result's finiteness.

    Finite inputs give finite losses unless raw dot products (``normalize=False``)
    overflow the compute dtype: then say so instead of returning inf or NaN. ``values``
    may be several tensors (e.g. both directions); they are only touched when checked.
    ``covers``: ``values`` is the scalar loss and answers the deferred finite checks
    (:meth:`~torch_contrastive._validation.Checks.finish`).
    """
    if not checks.active:
        return
    parts = values if isinstance(values, tuple) else (values,)
    value = parts[0]
    if len(parts) > 1 and check_output:
        value = torch.stack([t.detach().abs().amax() for t in parts]).amax()
    overflow = (lambda: f"the loss overflowed {parts[0].dtype}: with normalize=False the logits <a_i, c_j> / temperature "
                "exceed its range; use normalize=True, smaller embeddings or a larger temperature") if check_output else None
    checks.finish(value, covers=covers, overflow=overflow, extra=extra)
