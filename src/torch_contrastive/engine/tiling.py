"""Tiles of the ``R x C`` logits: their size on a CPU, the visiting order, reused buffers, one logit tile."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from torch import Tensor

#: Rows (and columns) per tile when ``chunk_size=None`` and the batch is too big for
#: one tile. 1024 x 1024 fp32 logit tiles (4 MiB) stay in a CPU's L3 cache and were
#: fastest on the 2-core benchmark machine (512 and 256 were 5-30 % slower).
DEFAULT_TILE = int(os.environ.get("TORCH_CONTRASTIVE_TILE", "1024"))


#: ``chunk_size=None`` computes the whole R x C logit matrix as one tile while it
#: needs at most this many bytes (two fp32 buffers); larger batches are tiled.
DENSE_BUDGET_BYTES = int(os.environ.get("TORCH_CONTRASTIVE_DENSE_BUDGET", str(8 * 2**20)))

# Largest 1/tau for which exp(+-scale) and a sum of 2**40 such terms stay normal numbers
# (fp32: exp(40) * 2**40 ~ 2.6e29 < 3.4e38 and exp(-40) ~ 4e-18 > 1.2e-38).


def tiles(rows: int, cols: int, tile: int, symmetric: bool) -> Iterator[tuple[int, int, int, int]]:
    """(r0, r1, c0, c1) of every tile to visit; only the upper triangle when symmetric."""
    for r0 in range(0, rows, tile):
        r1 = min(r0 + tile, rows)
        for c0 in range(r0 if symmetric else 0, cols, tile):
            yield r0, r1, c0, min(c0 + tile, cols)


class Buffers:
    """Preallocated tile buffers, one per distinct (rows, cols, slot)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self._store: dict[tuple[int, int, int], Tensor] = {}

    def get(self, rows: int, cols: int, slot: int = 0) -> Tensor:
        key = (rows, cols, slot)
        if key not in self._store:
            self._store[key] = torch.empty(rows, cols, dtype=self.dtype, device=self.device)
        return self._store[key]


def logits_tile(out: Tensor | None, a_scaled: Tensor, b: Tensor) -> Tensor:
    """``a_scaled @ b.T``, into ``out`` when given (a reused tile buffer)."""
    if out is None:
        return torch.mm(a_scaled, b.t())
    return torch.mm(a_scaled, b.t(), out=out)
