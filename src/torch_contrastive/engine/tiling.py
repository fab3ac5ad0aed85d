"""Tiles of the ``R x C`` logits: their size on a CPU, the visiting order, reused buffers and the engine's two
tile loops -- :func:`sweep` (forward: each tile's logits to the statistic's tile function) and
:func:`gradient_sweep` (backward: each tile's gradient into ``G @ B`` and ``G.T @ A``) -- with the online
maximum's step, :func:`raise_max`. The products themselves are :mod:`.products`'."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor

from ..environment import positive_int


class TileProducts(Protocol):
    """What the two tile loops ask of a call's products (:mod:`.products`, :mod:`.epilogue`)."""

    @property
    def a(self) -> Tensor: ...  # the anchors in the compute dtype: the tile buffers' dtype and device

    def logits(self, r0: int, r1: int, c0: int, c1: int, out: Tensor | None = None) -> Tensor: ...

    def add_rows(self, acc: Tensor, g: Any, c0: int, c1: int) -> None: ...

    def add_columns(self, acc: Tensor, g: Any, r0: int, r1: int) -> None: ...

#: Rows (and columns) per tile when ``chunk_size=None`` and the batch is too big for
#: one tile. 1024 x 1024 fp32 logit tiles (4 MiB) stay in a CPU's L3 cache and were
#: fastest on the 2-core benchmark machine (512 and 256 were 5-30 % slower).
DEFAULT_TILE = positive_int("TORCH_CONTRASTIVE_TILE", 1024)


#: ``chunk_size=None`` computes the whole R x C logit matrix as one tile while it
#: needs at most this many bytes (two fp32 buffers); larger batches are tiled.
DENSE_BUDGET_BYTES = positive_int("TORCH_CONTRASTIVE_DENSE_BUDGET", 8 * 2**20)

# Largest 1/tau for which exp(+-scale) and a sum of 2**40 such terms stay normal numbers
# (fp32: exp(40) * 2**40 ~ 2.6e29 < 3.4e38 and exp(-40) ~ 4e-18 > 1.2e-38).


def tiles(rows: int, cols: int, tile: int, symmetric: bool, tile_cols: int = 0) -> Iterator[tuple[int, int, int, int]]:
    """(r0, r1, c0, c1) of every tile to visit; only the upper triangle when symmetric (square tiles).
    ``tile_cols``: columns per tile where they differ from ``tile`` (row strips; 0: square tiles)."""
    if tile_cols and symmetric:
        raise ValueError("a symmetric walk visits square tiles: tile_cols must be 0")
    width = tile_cols or tile
    for r0 in range(0, rows, tile):
        r1 = min(r0 + tile, rows)
        for c0 in range(r0 if symmetric else 0, cols, width):
            yield r0, r1, c0, min(c0 + width, cols)


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


#: A forward tile function: ``visit(s, r0, r1, c0, c1, bufs)`` with ``s`` the logit tile (slot 0
#: of ``bufs``; the function may overwrite it and use the other slots).
Visit = Callable[[Tensor, int, int, int, int, Buffers], None]
#: A backward tile function: ``grad_tile(s, r0, r1, c0, c1, bufs)`` returns the gradient tile
#: ``G[r0:r1, c0:c1]`` (``dloss / dS``), possibly in ``s``'s own buffer -- or whatever the
#: products' ``add_rows`` / ``add_columns`` read as it (the epilogue's rounded tiles).
GradTile = Callable[[Tensor, int, int, int, int, Buffers], Any]


def sweep(prod: TileProducts, rows: int, cols: int, tile: int, symmetric: bool, visit: Visit,
          skip: Callable[[int, int], bool] | None = None, tile_cols: int = 0) -> None:
    """The forward tile loop: every tile's logits, formed into a reused buffer, handed to ``visit``.

    Args:
        prod: the call's products (:mod:`.products`).
        rows: ``R``.
        cols: ``C``.
        tile: the tile edge.
        symmetric: visit the upper triangle only (a single set: the function feeds both blocks).
        visit: the statistic's tile function (:data:`Visit`).
        skip: ``skip(r0, c0)`` True for a tile that has nothing to add (its logits are not formed).
        tile_cols: columns per tile where they differ from ``tile`` (0: square tiles).
    """
    bufs = Buffers(prod.a.dtype, prod.a.device)
    for r0, r1, c0, c1 in tiles(rows, cols, tile, symmetric, tile_cols):
        if skip is None or not skip(r0, c0):
            visit(prod.logits(r0, r1, c0, c1, bufs.get(r1 - r0, c1 - c0)), r0, r1, c0, c1, bufs)


def gradient_sweep(prod: TileProducts, a: Tensor, b: Tensor, tile: int, symmetric: bool, grad_tile: GradTile,
                   grad_columns: int | None = None, tile_cols: int = 0) -> tuple[Tensor, Tensor | None]:
    """The backward tile loop: every tile's logits recomputed, its gradient ``G`` from
    ``grad_tile`` and added into ``G @ B`` (rows) and ``G.T @ A`` (columns).

    Args:
        prod: the call's products.
        a: ``Â`` (R, D): the accumulators' shape and dtype.
        b: ``B̂`` (C, D).
        tile: the tile edge.
        symmetric: a single set over the upper triangle: ``G`` holds both roles of its pairs and
            both products land in the one accumulator (``(G + G.T) @ A`` -- no column accumulator).
        grad_tile: the statistic's gradient tile (:data:`GradTile`).
        grad_columns: only candidates ``[0, grad_columns)`` need a gradient (None: all; 0: no
            column accumulator); the others' products are skipped and their rows stay 0.
        tile_cols: columns per tile where they differ from ``tile`` (0: square tiles).

    Returns:
        ``(G @ B, G.T @ A or None)``, unscaled.
    """
    rows, cols = a.shape[0], b.shape[0]
    wanted = cols if grad_columns is None else grad_columns
    gb_acc = torch.zeros_like(a)
    ga_acc = None if symmetric or wanted == 0 else torch.zeros_like(b)
    bufs = Buffers(a.dtype, a.device)
    for r0, r1, c0, c1 in tiles(rows, cols, tile, symmetric, tile_cols):
        g = grad_tile(prod.logits(r0, r1, c0, c1, bufs.get(r1 - r0, c1 - c0)), r0, r1, c0, c1, bufs)
        prod.add_rows(gb_acc[r0:r1], g, c0, c1)
        if symmetric:
            if c0 != r0:  # a diagonal tile's G already holds both roles of its pairs
                prod.add_columns(gb_acc[c0:c1], g, r0, r1)
        elif ga_acc is not None and c0 < wanted:
            end = min(c1, wanted)
            prod.add_columns(ga_acc[c0:end], g, r0, r1)  # the products read g's first end - c0 columns
    return gb_acc, ga_acc


def raise_max(run_max: Tensor, run_sum: Tensor, i0: int, i1: int, tile_max: Tensor) -> Tensor:
    """The online maximum's step for indices ``i0:i1``: the running maximum raised to the tile's,
    the running sum of shifted exps rescaled to it; returns the new maximum (the caller adds the
    tile's ``exp(s - new_max)``)."""
    new_max = torch.maximum(run_max[i0:i1], tile_max)
    run_sum[i0:i1] *= torch.exp(run_max[i0:i1] - new_max)
    run_max[i0:i1] = new_max
    return new_max
