"""The options every loss shares, defined and documented once.

Every loss function takes them as keyword arguments, and every ``nn.Module`` twin takes them
at construction (checked there once, by :func:`check`):

normalize (bool, default True)
    L2-normalise the embeddings inside the loss (``x / max(||x||, eps)``): cosine logits.
    ``False`` uses raw dot products (as the SupCon authors' code); a logit beyond the
    compute dtype is then a ``ValueError``, never inf/NaN.
reduction (``"mean"`` | ``"sum"`` | ``"none"``)
    ``"mean"`` over the loss's terms (rows, anchors with positives, positive pairs -- each
    loss says which), ``"sum"``, or ``"none"``: the per-row values.
chunk_size (int or None)
    Tile edge of the ``N x N`` logits; ``None``: the planner's choice for the device
    (:func:`torch_contrastive.explain` shows it). Memory is O(N * D + tile^2).
gather (bool)
    Under ``torch.distributed``, compute over the batch of every rank (an autograd-aware
    all-gather; each rank computes its own anchor rows).
grad_reduction (``"mean"`` | ``"sum"``)
    How the framework combines gradients over ranks: ``"mean"`` for DDP (the local
    gradient is scaled by the world size), ``"sum"`` if it sums them.
eps (float, default 1e-12)
    The normalisation floor.
validate (bool, default True)
    Check device values (finite inputs, a positive tensor temperature, rank agreement) in
    one host synchronisation; ``False`` makes none (``torch.compile``, CUDA graphs, GPU
    pipelines).
backend (``"auto"`` | ``"torch"`` | ``"triton"``)
    ``"auto"``: the planner's choice for the device, dtype and shape (CPU: torch tile loops;
    CUDA: tensor-core products, Triton kernels past 8,192^2 half-precision logits).
    ``"torch"`` / ``"triton"`` force one; a backend that cannot serve a call is a
    ``ValueError`` that says why. ``TRITON_INTERPRET=1`` runs the kernels on a CPU (tests).
"""

from __future__ import annotations

from typing import Any

from . import _validation as v

__all__ = ["SHARED", "check"]

#: The shared option names, in signature order.
SHARED = ("normalize", "reduction", "chunk_size", "gather", "grad_reduction", "eps", "validate", "backend")


def check(*, normalize: bool = True, reduction: str = "mean", chunk_size: int | None = None, gather: bool = False,
          grad_reduction: str = "mean", eps: float = 1e-12, validate: bool = True, backend: str = "auto") -> dict[str, Any]:
    """The shared options, checked, as keyword arguments for a loss function."""
    v.check_options(reduction=reduction, chunk_size=chunk_size, grad_reduction=grad_reduction, eps=eps, backend=backend)
    return dict(normalize=bool(normalize), reduction=reduction, chunk_size=chunk_size, gather=bool(gather),
                grad_reduction=grad_reduction, eps=float(eps), validate=bool(validate), backend=backend)
