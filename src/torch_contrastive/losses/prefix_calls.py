"""One call of a loss per embedding prefix: the plain Matryoshka form (Kusupati et al. 2022) and its checks.

``sum_p w_p * loss(*[normalize(x[..., :d_p]) for x in inputs])``: the prefixes' dimensions and weights
checked once, each input cut to its prefix and L2-normalised on its own, one call per prefix (or one loss
per prefix, for a loss that keeps a state per embedding width). :mod:`.matryoshka` takes every prefix
in one pass where the prefix engine covers the call and falls back to this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch.nn.functional as F
from torch import Tensor

__all__ = ["check_prefixes", "cut_rows", "one_per_prefix", "prefix_sum", "prefix_term", "refuse_shared_state", "shrink"]


def check_prefixes(dims: object, weights: object, width: int | None = None) -> tuple[list[int], list[float]]:
    """``matryoshka_dims`` (positive ints, at most ``width``) and ``matryoshka_weights`` (one finite
    number per dim; None: all 1), as lists."""
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence) or len(dims) == 0:
        raise ValueError(f"matryoshka_dims must be a non-empty sequence of positive ints, got {dims!r}")
    if any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in dims):
        raise ValueError(f"matryoshka_dims must hold positive ints, got {list(dims)!r}")
    if width is not None and max(dims) > width:
        raise ValueError(f"matryoshka_dims cannot exceed the embedding size {width}, got {max(dims)}")
    if weights is None:
        return list(dims), [1.0] * len(dims)
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence) or len(weights) != len(dims):
        raise ValueError(f"matryoshka_weights must hold one number per dim ({len(dims)}), got {weights!r}")
    if any(isinstance(w, bool) or not isinstance(w, (int, float)) or w != w or abs(w) == float("inf") for w in weights):
        raise ValueError(f"matryoshka_weights must be finite numbers, got {list(weights)!r}")
    return list(dims), [float(w) for w in weights]


def shrink(x: Tensor, dim: int) -> Tensor:
    """The first ``dim`` features of each row (the last dimension), L2-normalised on their own."""
    return F.normalize(x[..., :dim], p=2, dim=-1)


def prefix_sum(dims: Sequence[int], weights: Sequence[float], term: Callable[[int], Tensor]) -> Tensor:
    """``sum_p w_p * term(d_p)``: the per-prefix form, one call of ``term`` per prefix."""
    total: Tensor | None = None
    for dim, weight in zip(dims, weights):
        value = weight * term(dim)
        total = value if total is None else total + value
    if total is None:
        raise ValueError("matryoshka_dims must not be empty")
    return total


def prefix_term(loss_fn: Callable[..., Any], tensors: list[Tensor], kwargs: dict[str, Any], dim: int, width: int) -> Tensor:
    """``loss_fn`` on the prefix ``dim`` of every input, which must give the loss as a tensor."""
    value = loss_fn(*[shrink(t, dim) for t in tensors], **cut_rows(kwargs, dim, width))
    if not isinstance(value, Tensor):
        raise TypeError(f"loss_fn must return the loss as a tensor, got {type(value).__name__}")
    return value


def one_per_prefix(loss_fns: Sequence[object], prefixes: int) -> list[Callable[..., Any]]:
    """A list of losses, one per prefix, checked."""
    fns = list(loss_fns)
    if len(fns) != prefixes:
        raise ValueError(f"loss_fn must be one loss or one per prefix: {len(fns)} losses for {prefixes} matryoshka_dims")
    for i, fn in enumerate(fns):
        if not callable(fn):
            raise TypeError(f"loss_fn[{i}] must be callable, got {type(fn).__name__}")
    return cast(list[Callable[..., Any]], fns)


def refuse_shared_state(loss_fn: object) -> None:
    """A global contrastive loss keeps one normaliser per sample for the embedding it is given: the
    prefixes (each its own logits) cannot share it."""
    from .global_contrastive import GlobalContrastiveLoss, global_contrastive_loss

    if isinstance(loss_fn, GlobalContrastiveLoss) or loss_fn is global_contrastive_loss:
        raise ValueError("a global contrastive loss keeps one state per sample for one embedding width, which the prefixes "
                         "cannot share: pass one GlobalContrastiveLoss per prefix, "
                         "loss_fn=[GlobalContrastiveLoss(...) for _ in matryoshka_dims]")


def cut_rows(kwargs: dict[str, Any], dim: int, width: int) -> dict[str, Any]:
    """``kwargs`` with the rows of a memory or reference set (``memory_emb``, ``ref_emb``) cut to the prefix and
    normalised like the embeddings; anything else as given."""
    rows = {name: shrink(kwargs[name], dim) for name in ("memory_emb", "ref_emb")
            if isinstance(kwargs.get(name), Tensor) and kwargs[name].ndim == 2 and kwargs[name].shape[-1] == width}
    return {**kwargs, **rows} if rows else kwargs
