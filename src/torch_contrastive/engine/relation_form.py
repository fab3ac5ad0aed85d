"""The problem a label relation is built for (:class:`Reader`), as a loss describes it.

A relation of ``R x C`` label pairs is held as a dense 0/1 mask or grouped by key, by size alone and on every device
(:func:`~.planner.dense_relation`, at :data:`torch_contrastive.positives.DENSE_KEYS_LIMIT`, measured on a CPU). A
loss still says which problem reads its relation, so a rule measured on a GPU can come back through the plan without
changing the losses.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Reader"]


class Reader(NamedTuple):
    """The problem a label relation is built for: its dtypes, the caller's ``chunk_size`` and ``backend``, the
    feature size, whether one set's triangle, the pair kernel (``None``: soft-max terms) -- kept flat (a label call
    builds one every step: one tuple)."""

    dtype: torch.dtype
    other_dtype: torch.dtype
    chunk_size: int | None
    backend: str
    dim: int
    symmetric: bool
    pairs: str | None
