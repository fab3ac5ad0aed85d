"""The kernels' autotuning: a small config list per kernel, keyed on (size bucket, D, dtypes).

``triton.autotune`` times every config on the user's GPU the first time a key is seen (then
caches the winner, on disk too), so the blocks fit whatever GPU runs them -- also when the code
was written on a machine without one. Every config in the lists compiles for sm_80 and sm_90 without a
spill and within shared memory for the dtypes it names (``tools/compile_check.py``, run in the suite):
GEMM-shaped tiles, 128-wide where a kernel's registers allow, pipelined K loops through ``num_stages``.
:func:`prune` narrows a list before timing:

* under ``TRITON_INTERPRET=1`` (the CPU tests) to one 32-wide config, so small test problems
  still span several tiles and nothing is timed;
* to the configs that serve the operands' dtype (each config names them: fp32 and fp64 products are FMA
  loops, with more registers per operand element than the tensor cores' half ones, and take smaller tiles);
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


#: The operand dtypes a config serves: half operands (tensor-core products, fp32 accumulators); every dtype.
HALF = frozenset({torch.bfloat16, torch.float16})
ANY = HALF | {torch.float32, torch.float64}
#: fp32 and fp64 operands (their products FMA loops: twice the registers per operand element, or four times).
WIDE = frozenset({torch.float32, torch.float64})
#: The logit tiles an epilogue reads in every dtype but fp64 (an fp64 tile takes half the logits per thread).
NOT_FP64 = HALF | {torch.float32}


def _config(num_warps: int, num_stages: int, dtypes: frozenset[torch.dtype] = ANY, /, **blocks: int) -> Any:
    """A config for operands of ``dtypes``: the compile check (``tools/compile_check.py``) finds it clean -- no spill,
    within shared memory -- for each of them on sm_80 and sm_90; :func:`prune` offers it to no other dtype."""
    config = triton.Config(blocks, num_warps=num_warps, num_stages=num_stages)
    config.dtypes = dtypes
    return config


# The lists below hold the configs that compile clean for sm_80 and sm_90 (tools/compile_check.py, docs/gpu.md
# "Compile check"): 128-wide tiles where a kernel's registers allow them, else the widest that do; fp32 and fp64
# operands take only the configs marked for them (at most 8 operand elements per thread: FMA products), half
# operands none narrower than 64 (a 32-row tile's products are mma.sync, not the warpgroup HGMMA, on sm_90).
def square_sums() -> list[Any]:
    """Configs of the tile-scheduled sums (one square ``BLOCK`` tile per program: exp and row / column sums)."""
    return [
        _config(8, 2, HALF, BLOCK=64, BLOCK_D=64),
        _config(4, 3, HALF, BLOCK=64, BLOCK_D=32),
        _config(8, 2, ANY, BLOCK=64, BLOCK_D=32),
        _config(4, 2, WIDE, BLOCK=32, BLOCK_D=16),
    ]


def gemm_tiles() -> list[Any]:
    """Configs of the matmul with the soft-max statistic in its epilogue (:mod:`.gemm_sums`): one tile side per
    dtype (the host sizes the partials' slots by it), 128 for half rows -- the tensor cores' GEMM tile -- and 64 for
    fp32 and fp64 (FMA products); the lists differ in warps, pipeline stages and the K slice. A 64-wide K slice
    spills in the online regime's column statistics when the compiler is given no alignment (a ragged call).
    A 16-wide K slice spills for fp32 (4 or 8 warps), and fp64 at 4 warps."""
    return [
        _config(8, 3, HALF, BLOCK=128, BLOCK_D=32),
        _config(8, 4, HALF, BLOCK=128, BLOCK_D=32),
        _config(8, 2, WIDE, BLOCK=64, BLOCK_D=32),
    ]


def square_grads() -> list[Any]:
    """Configs of the tile-scheduled gradients (a tile's gradient and its two products per program)."""
    return [
        _config(8, 2, ANY, BLOCK=64, BLOCK_D=32),
        _config(4, 2, HALF, BLOCK=64, BLOCK_D=32),
        _config(4, 2, WIDE, BLOCK=32, BLOCK_D=16),
    ]


def row_blocks() -> list[Any]:
    """Configs of the row-owned log-sum-exp kernel (a block of rows sweeps the columns)."""
    return [
        _config(8, 3, HALF, BLOCK_M=128, BLOCK_N=64, BLOCK_D=64),
        _config(8, 3, HALF, BLOCK_M=128, BLOCK_N=128, BLOCK_D=32),
        _config(8, 2, HALF, BLOCK_M=64, BLOCK_N=64, BLOCK_D=32),
        _config(4, 2, frozenset({torch.float32}), BLOCK_M=32, BLOCK_N=32, BLOCK_D=16),
        _config(8, 1, frozenset({torch.float64}), BLOCK_M=64, BLOCK_N=64, BLOCK_D=16),
    ]


def row_output_blocks() -> list[Any]:
    """Configs of the row-owned gradient kernel (rows x output features per program)."""
    return [
        _config(8, 2, HALF, BLOCK_M=128, BLOCK_N=32, BLOCK_D=32, BLOCK_O=64),
        _config(8, 2, HALF, BLOCK_M=64, BLOCK_N=64, BLOCK_D=32, BLOCK_O=64),
        _config(4, 2, HALF, BLOCK_M=64, BLOCK_N=32, BLOCK_D=32, BLOCK_O=64),
        _config(8, 2, HALF | {torch.float64}, BLOCK_M=64, BLOCK_N=32, BLOCK_D=32, BLOCK_O=64),
        _config(4, 2, WIDE, BLOCK_M=32, BLOCK_N=32, BLOCK_D=16, BLOCK_O=32),
    ]


def owned_outputs() -> list[Any]:
    """Configs of the deterministic pair / sigmoid gradients (a block of outputs -- rows or
    columns by features -- per program, square tiles swept in order)."""
    return [
        _config(8, 2, HALF, BLOCK=64, BLOCK_D=64, BLOCK_O=128),
        _config(8, 1, frozenset({torch.float32}), BLOCK=32, BLOCK_D=16, BLOCK_O=32),
        _config(4, 1, frozenset({torch.float64}), BLOCK=32, BLOCK_D=16, BLOCK_O=32),
    ]


def epilogue_rows() -> list[Any]:
    """Configs of the forward epilogue (a block of rows reads a logit tile's columns block by block): at most 16
    logits per thread (32 spill in the log-sum-exp kernels)."""
    return [
        _config(8, 2, NOT_FP64, BLOCK_M=32, BLOCK_N=128),
        _config(8, 2, NOT_FP64, BLOCK_M=64, BLOCK_N=64),
        _config(4, 2, NOT_FP64, BLOCK_M=32, BLOCK_N=64),
        _config(8, 2, ANY, BLOCK_M=16, BLOCK_N=128),
        _config(4, 2, ANY, BLOCK_M=16, BLOCK_N=32),
    ]


def epilogue_pair_rows() -> list[Any]:
    """Configs of the pair terms' forward epilogue (positives and negatives kept apart: more live values per logit
    than :func:`epilogue_rows`'s kernels)."""
    return [
        _config(8, 2, BLOCK_M=32, BLOCK_N=64),
        _config(8, 2, BLOCK_M=16, BLOCK_N=128),
        _config(4, 2, BLOCK_M=16, BLOCK_N=64),
    ]


def column_blocks() -> list[Any]:
    """Configs of the column partials' fold (a block of columns per program)."""
    return [_config(4, 1, BLOCK_N=256), _config(4, 1, BLOCK_N=1024)]


def epilogue_tiles() -> list[Any]:
    """Configs of the backward epilogue (one block of a logit tile per program): 64 x 128 at 8 warps spills on
    sm_80 under triton 3.6."""
    return [
        _config(8, 2, BLOCK_M=32, BLOCK_N=128),
        _config(8, 2, BLOCK_M=64, BLOCK_N=64),
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
    x = next(named_args[name] for name in _DTYPE_ARGS if name in named_args)
    served = [c for c in configs if x.dtype in getattr(c, "dtypes", ANY)] or configs[-1:]
    if not tuning():
        return [min(served, key=lambda c: (_side(c), c.num_stages))]
    fitting = [c for c in served if _side(c) <= max(64, named_args["bucket"])]
    return fitting or served[-1:]


def autotune(configs: list[Any], reset_to_zero: list[str] | None = None, key: list[str] | None = None,
             restore_value: list[str] | None = None) -> Any:
    """``triton.autotune`` with the kernels' key (default: size bucket and D) and pruning. Timing runs
    a kernel several times: kernels that accumulate with atomics name their outputs in
    ``reset_to_zero``, kernels that update a statistic in place name it in ``restore_value``."""
    if interpreting():
        # The interpreter's one config from the start (the process chose the interpreter before defining its kernels):
        # triton 3.6's autotuner times even a single pruned config, which asks for a GPU driver.
        configs = [_interpreter_config(configs)]
    return triton.autotune(configs=configs, key=key or ["bucket", "d"], prune_configs_by={"early_config_prune": prune},
                           reset_to_zero=reset_to_zero, restore_value=restore_value)
