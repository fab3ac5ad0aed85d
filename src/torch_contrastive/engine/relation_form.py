"""The problem a label relation is built for (:class:`Reader`), as a loss describes it.

A relation of ``R x C`` label pairs is held as a dense 0/1 mask or grouped by key, by size alone and on every device
(:data:`torch_contrastive.positives.DENSE_KEYS_LIMIT`, measured on a CPU): the forms a GPU would price otherwise
(a mask sized by the cost model, read on tensor cores) are ones no GPU has measured, and left the engine with the
cost model's run-time decisions (CHANGELOG, issue 64). A loss still says which problem reads its relation, so a
rule measured on a GPU can come back through the plan without changing the losses.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import planner

__all__ = ["Reader", "dense_relation"]


def dense_relation(rows: int, cols: int, limit: int) -> bool:
    """Whether a label relation of ``R x C`` entries is held as a dense mask: up to ``limit`` entries, on every
    device -- at the size a problem counted small under :func:`~.planner.simulate` stands for."""
    return rows * cols * planner._SIMULATED_AREA <= limit


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
