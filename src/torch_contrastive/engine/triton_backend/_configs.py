"""The kernels' autotuning: a small config list per kernel, keyed on (size bucket, D, dtypes).

``triton.autotune`` times every config on the user's GPU the first time a key is seen (then
caches the winner, on disk too), so the blocks fit whatever GPU runs them -- also when the code
was written on a machine without one. The lists hold GEMM-shaped tiles (128 where the shape
allows, pipelined K loops through ``num_stages``) and one small safe config that fits any GPU's
shared memory. :func:`prune` narrows a list before timing:

* under ``TRITON_INTERPRET=1`` (the CPU tests) to one 32-wide config, so small test problems
  still span several tiles and nothing is timed;
* for fp64 operands (no tensor cores, twice the registers) to the small configs;
* to configs whose tile is not larger than the problem (a 64-row problem gets no 128-row tile);
* with ``TORCH_CONTRASTIVE_AUTOTUNE=0`` to the config with the smallest tile, timed nothing: the
  suite on a GPU checks values, not speed, and compiles one variant per kernel instead of four
  (small test problems then still span several tiles, as under the interpreter).

The key holds ``bucket`` -- the next power of two of the larger side -- rather than the sizes
themselves, so the last, smaller batch of an epoch does not trigger another round of timing.
"""

from __future__ import annotations

from typing import Any

import torch

from ...environment import switch
from ._host import interpreting, triton

#: The tile side under the interpreter (CPU tests): small problems still span tiles.
INTERPRETER_BLOCK = 32


def bucket(*sizes: int) -> int:
    """The autotuning key's size bucket: the next power of two of the largest size."""
    return int(triton.next_power_of_2(max(max(sizes), 1)))


def _config(num_warps: int, num_stages: int, **blocks: int) -> Any:
    return triton.Config(blocks, num_warps=num_warps, num_stages=num_stages)


def square_tiles() -> list[Any]:
    """Configs of the tile-scheduled kernels (one square ``BLOCK`` tile per program)."""
    return [
        _config(8, 3, BLOCK=128, BLOCK_D=64),
        _config(8, 4, BLOCK=128, BLOCK_D=32),
        _config(4, 3, BLOCK=128, BLOCK_D=64),
        _config(4, 4, BLOCK=64, BLOCK_D=64),
        _config(4, 2, BLOCK=64, BLOCK_D=32),
    ]


def row_blocks() -> list[Any]:
    """Configs of the row-owned log-sum-exp kernel (a block of rows sweeps the columns)."""
    return [
        _config(8, 3, BLOCK_M=128, BLOCK_N=64, BLOCK_D=64),
        _config(8, 3, BLOCK_M=128, BLOCK_N=128, BLOCK_D=32),
        _config(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_D=64),
        _config(4, 2, BLOCK_M=64, BLOCK_N=32, BLOCK_D=32),
    ]


def row_output_blocks() -> list[Any]:
    """Configs of the row-owned gradient kernel (rows x output features per program)."""
    return [
        _config(8, 2, BLOCK_M=128, BLOCK_N=64, BLOCK_D=64, BLOCK_O=128),
        _config(4, 2, BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, BLOCK_O=128),
        _config(4, 2, BLOCK_M=64, BLOCK_N=32, BLOCK_D=32, BLOCK_O=64),
    ]


def owned_outputs() -> list[Any]:
    """Configs of the deterministic pair / sigmoid gradients (a block of outputs -- rows or
    columns by features -- per program, square tiles swept in order)."""
    return [
        _config(8, 2, BLOCK=128, BLOCK_D=64, BLOCK_O=128),
        _config(4, 2, BLOCK=64, BLOCK_D=64, BLOCK_O=128),
        _config(4, 2, BLOCK=64, BLOCK_D=32, BLOCK_O=64),
    ]


def epilogue_rows() -> list[Any]:
    """Configs of the forward epilogue (a block of rows reads a logit tile's columns block by block)."""
    return [
        _config(8, 2, BLOCK_M=64, BLOCK_N=256),
        _config(4, 2, BLOCK_M=32, BLOCK_N=256),
        _config(8, 2, BLOCK_M=128, BLOCK_N=128),
        _config(4, 2, BLOCK_M=64, BLOCK_N=128),
    ]


def column_blocks() -> list[Any]:
    """Configs of the column partials' fold (a block of columns per program)."""
    return [_config(4, 1, BLOCK_N=256), _config(4, 1, BLOCK_N=1024)]


def epilogue_tiles() -> list[Any]:
    """Configs of the backward epilogue (one block of a logit tile per program)."""
    return [
        _config(8, 2, BLOCK_M=64, BLOCK_N=256),
        _config(8, 2, BLOCK_M=128, BLOCK_N=128),
        _config(4, 2, BLOCK_M=64, BLOCK_N=128),
        _config(4, 2, BLOCK_M=32, BLOCK_N=64),
    ]


def feature_rows() -> list[Any]:
    """Configs of the row normalisation and its backward (a block of rows walks its features in blocks)."""
    return [
        _config(4, 1, BLOCK_M=16, BLOCK_D=128),
        _config(4, 1, BLOCK_M=4, BLOCK_D=512),
        _config(8, 1, BLOCK_M=32, BLOCK_D=256),
    ]


def tile_grid(r: int, c: int, owned: bool = False) -> Any:
    """Grid of a square-tile kernel: one program per tile, or (``owned``) one per row block."""
    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(r, meta["BLOCK"]) * (1 if owned else triton.cdiv(c, meta["BLOCK"])),)

    return grid


def row_grid(r: int) -> Any:
    """One program per block of ``BLOCK_M`` rows (the row-owned log-sum-exp)."""

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(r, meta["BLOCK_M"]),)

    return grid


def output_grid(r: int, d_out: int) -> Any:
    """A program per (block of ``BLOCK_M`` rows, block of ``BLOCK_O`` output features)."""

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(r, meta["BLOCK_M"]), triton.cdiv(d_out, meta["BLOCK_O"]))

    return grid


def owned_grid(blocks_of: int, d: int) -> Any:
    """Grid of a deterministic gradient kernel: output blocks (rows or columns) by feature blocks."""
    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(blocks_of, meta["BLOCK"]), triton.cdiv(d, meta["BLOCK_O"]))

    return grid


def _interpreter_config(configs: list[Any]) -> Any:
    blocks = {name: INTERPRETER_BLOCK for name in configs[0].kwargs}
    return _config(4, 1, **blocks)


def _side(config: Any) -> int:
    return max((v for k, v in config.kwargs.items() if k in ("BLOCK", "BLOCK_M", "BLOCK_N")), default=0)


#: The tensor argument whose dtype says fp64 for each kind of kernel: the operands, a logit tile,
#: a fold's partial sums.
_DTYPE_ARGS = ("x_ptr", "s_ptr", "part_sum_ptr")


def tuning() -> bool:
    """Whether the kernels time their configs (``TORCH_CONTRASTIVE_AUTOTUNE=0`` turns it off)."""
    return switch("TORCH_CONTRASTIVE_AUTOTUNE", True)


def prune(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    """``early_config_prune`` of every kernel: see the module docstring."""
    if interpreting():
        return [_interpreter_config(configs)]
    if not tuning():
        return [min(configs, key=lambda c: (_side(c), c.num_stages))]
    x = next(named_args[name] for name in _DTYPE_ARGS if name in named_args)
    if x.dtype == torch.float64:
        small = [c for c in configs if _side(c) <= 64 and c.num_stages <= 2]
        return small or configs[-1:]
    fitting = [c for c in configs if _side(c) <= max(64, named_args["bucket"])]
    return fitting or configs[-1:]


def autotune(configs: list[Any], reset_to_zero: list[str] | None = None, key: list[str] | None = None,
             restore_value: list[str] | None = None) -> Any:
    """``triton.autotune`` with the kernels' key (default: size bucket and D) and pruning. Timing runs
    a kernel several times: kernels that accumulate with atomics name their outputs in
    ``reset_to_zero``, kernels that update a statistic in place name it in ``restore_value``."""
    return triton.autotune(configs=configs, key=key or ["bucket", "d"], prune_configs_by={"early_config_prune": prune},
                           reset_to_zero=reset_to_zero, restore_value=restore_value)
