"""The options every loss shares, defined and documented once.

Every loss function takes them as keyword arguments, and every ``nn.Module`` twin takes them
at construction. Either way they become one frozen :class:`Shared`, checked the first time a set
of values is seen (:func:`shared`), so neither a module nor a training loop re-checks them per call:

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
backend (``"auto"`` | ``"torch"`` | ``"triton"`` | ``"epilogue"`` | ``"gemm"``)
    ``"auto"``: the device's measured policy for the dtype and shape (CPU: torch tile loops;
    CUDA: tensor-core products, cuBLAS GEMMs with Triton epilogues past 8,192^2 bf16 logits).
    The others force one: the torch loops, the fused Triton kernels, the epilogues, or the matmul
    with the soft-max statistic in its epilogue (``"gemm"``, opt-in until a GPU measures it); a
    backend that cannot serve a call is a ``ValueError`` that says why. ``TRITON_INTERPRET=1``
    runs the kernels on a CPU (tests).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from . import _validation as v

__all__ = ["SHARED", "Shared", "check", "shared"]

#: The shared option names, in signature order.
SHARED = ("normalize", "reduction", "chunk_size", "gather", "grad_reduction", "eps", "validate", "backend")


@dataclass(frozen=True)
class Shared:
    """The shared options of one call, checked when built (a ``ValueError`` names the option).

    Build it with :func:`shared`, which keeps each distinct set of values once: a training loop
    (and a module, which builds its set at construction) pays the checks once, not per call.

    Attributes:
        normalize: L2-normalise the embeddings inside the loss.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        chunk_size: the tile edge, or None (the planner's choice).
        gather: compute over every rank's batch.
        grad_reduction: ``"mean"`` (DDP) or ``"sum"``.
        eps: the normalisation floor.
        validate: check device values in one host synchronisation.
        backend: ``"auto"``, ``"torch"``, ``"triton"``, ``"epilogue"`` (cuBLAS GEMMs with Triton
            epilogues) or ``"gemm"`` (the soft-max statistic in a matmul's epilogue; the soft-max losses).
    """

    normalize: bool = True
    reduction: str = "mean"
    chunk_size: int | None = None
    gather: bool = False
    grad_reduction: str = "mean"
    eps: float = 1e-12
    validate: bool = True
    backend: str = "auto"

    def __post_init__(self) -> None:
        v.check_options(reduction=self.reduction, chunk_size=self.chunk_size, grad_reduction=self.grad_reduction,
                        eps=self.eps, backend=self.backend)
        for name in ("normalize", "gather", "validate"):  # "no" or None would read as a silent True / False
            v.check_flag(getattr(self, name), name)
        object.__setattr__(self, "eps", float(self.eps))  # checked as given (a bool eps is refused), then a float

    def kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments for a loss function."""
        return asdict(self)


def shared(*, normalize: bool = True, reduction: str = "mean", chunk_size: int | None = None, gather: bool = False,
           grad_reduction: str = "mean", eps: float = 1e-12, validate: bool = True, backend: str = "auto") -> Shared:
    """The :class:`Shared` options for these values, checked the first time they are seen."""
    # True and 1 are equal keys, but not the same option: the types are part of the key
    key: Any = (normalize, reduction, chunk_size, gather, grad_reduction, eps, validate, backend,
                type(normalize), type(reduction), type(chunk_size), type(gather), type(grad_reduction), type(eps),
                type(validate), type(backend))
    try:
        found = _KNOWN.get(key)
    except TypeError:  # an unhashable value: the checks say what is wrong with it
        found = None
        key = None
    if found is None:
        found = Shared(normalize, reduction, chunk_size, gather, grad_reduction, eps, validate, backend)
        if key is not None:
            if len(_KNOWN) > 256:  # many distinct option sets: keep the record small
                _KNOWN.clear()
            _KNOWN[key] = found
    return found


_KNOWN: dict[Any, Shared] = {}


def check(*, normalize: bool = True, reduction: str = "mean", chunk_size: int | None = None, gather: bool = False,
          grad_reduction: str = "mean", eps: float = 1e-12, validate: bool = True, backend: str = "auto") -> dict[str, Any]:
    """The shared options, checked, as keyword arguments for a loss function."""
    return shared(normalize=normalize, reduction=reduction, chunk_size=chunk_size, gather=gather,
                  grad_reduction=grad_reduction, eps=eps, validate=validate, backend=backend).kwargs()
