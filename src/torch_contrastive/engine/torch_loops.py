"""The torch loops: every statistic as ATen ops over bounded tiles, on every device -- the CPU's only strategy and
the CUDA policy's default below the measured crossovers (:mod:`.policy`).

The tile loop is :func:`~.tiling.sweep` / :func:`~.tiling.gradient_sweep` (shared with the epilogue strategy);
the statistics' executors are :mod:`.softmax` (over :mod:`.softmax_tiles`), :mod:`.pairwise` and
:mod:`.sigmoid`. A problem of one bounded tile of the narrow kinds :func:`~.one_tile.lean_softmax` and
:func:`~.one_tile.lean_pairs` name runs through one lean autograd function instead (:mod:`.one_tile`: the same
ATen ops in the same order, without the general executor's Python). Matryoshka's :class:`~.problem.Prefixes` run
as the prefix passes (:mod:`.prefix_passes`: strips of anchor rows, every prefix's products from one pass over the
features).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import one_tile, pairwise, sigmoid, softmax
from .prefix_passes import PREFIX_PASSES
from .problem import PairTerms, Prefixes, SigmoidPairs, Softmax
from .strategy import Strategy

if TYPE_CHECKING:
    from .planner import Target
    from .problem import Problem

__all__ = ["TORCH_LOOPS", "TorchLoops"]


class TorchLoops(Strategy):
    """The torch loops (``backend="torch"``)."""

    name = "torch"

    def serves(self, problem: Problem, on: Target) -> str | None:
        """Every problem: device-agnostic ATen ops."""
        return None


#: The torch loops (the registry: :data:`~.strategies.STRATEGIES`).
TORCH_LOOPS = TorchLoops({(Softmax, "torch"): softmax.TORCH, (Softmax, "one_tile"): one_tile.ONE_TILE,
                          (PairTerms, "torch"): pairwise.TORCH, (PairTerms, "one_tile"): one_tile.ONE_TILE_PAIRS,
                          (SigmoidPairs, "torch"): sigmoid.TORCH, (Prefixes, "torch"): PREFIX_PASSES})
