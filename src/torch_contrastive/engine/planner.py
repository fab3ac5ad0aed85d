"""Every device-dependent decision of the engine, made by one function: :func:`decide`.

A loss describes its problem (rows, columns, dtype, the exactness regime it may use) and the
engine asks :func:`decide` how to run it on the inputs' device:

* **backend** -- ``"auto"`` is the device's policy (:mod:`.policy`): an ordered list of rules whose crossovers
  come from measured rows, the first that serves the call wins (``str(decision)`` says which and why); an
  explicit ``"torch"`` / ``"triton"`` / ``"epilogue"`` / ``"gemm"`` is honoured or refused with a ``ValueError`` (never a
  silent switch). The cost model (:mod:`torch_contrastive.cli.cost`) is an offline tool that proposes
  crossovers (``torch-contrastive bench --traffic``); the engine does not import it.
* **products** -- fp16/bf16 inputs on a GPU are multiplied as given on tensor cores with fp32
  accumulation and fp32 logits (:class:`~.products.HalfProducts`); everything else in the
  compute dtype (fp32 on a GPU follows ``torch.backends.cuda.matmul.allow_tf32``).
* **tile** -- on a CPU cache-sized (:data:`~.tiling.DEFAULT_TILE`, one tile up to
  :data:`~.tiling.DENSE_BUDGET_BYTES`); on a GPU sized from a scratch budget
  (:data:`GPU_BUDGET`: 1 GiB unless ``TORCH_CONTRASTIVE_GPU_BUDGET`` gives bytes), so
  a GPU runs a few large GEMMs instead of thousands of small ones. Memory stays
  ``O((R + C) * D + budget)``, never ``R x C`` beyond the budget.

The decision is a frozen :class:`Decision`; :func:`~.recorded.explain` returns the decisions a call
made, and the tests check :func:`decide` per device without running a kernel. A problem's whole plan (its
executor and the choices that follow from the problem itself) is built from these decisions in
:mod:`.problem_plan`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..environment import choice, positive_int
from . import policy
from .normalization import KERNEL_DTYPES
from .precision import fixed_scale_applies
from .recorded import record
from .tiling import DEFAULT_TILE, DENSE_BUDGET_BYTES

#: GPU scratch budget (bytes) unless ``TORCH_CONTRASTIVE_GPU_BUDGET`` says otherwise.
GPU_BUDGET_DEFAULT = 1 << 30
#: GPU tile edges are multiples of this (GEMM-friendly shapes).
_GPU_TILE_QUANTUM = 256

BACKENDS = ("auto", "torch", "triton", "epilogue", "gemm")
#: The strategies whose backward is the epilogue's (its tile loops, strips and gradient tiles): the epilogue
#: strategy, and the fused matmul whose forward replaces its strips (:mod:`.gemm`).
EPILOGUE_BACKWARD = ("epilogue", "gemm")
#: The strategies that run Triton kernels: an explicit one is asked whether it serves the call even on a kept plan.
KERNEL_STRATEGIES = ("triton", *EPILOGUE_BACKWARD)
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Decision:
    """How one engine call runs.

    Attributes:
        kernel: which engine function (``"softmax"``, ``"pairwise"``, ``"sigmoid"``).
        device: the inputs' device type.
        backend: ``"torch"`` or ``"triton"``.
        tile: rows (and columns) per tile; ``0`` means the whole ``R x C`` problem is one tile.
        tile_cols: columns per tile where they differ from ``tile`` (``0``: square tiles): the epilogue's
            row strips, each across every column (:func:`strip_rows`).
        half: fp16/bf16 inputs multiplied as given on tensor cores, fp32 logits.
        fixed: the one-``exp`` bounded algorithm (no running maximum).
        budget: the scratch bytes the tile was sized for.
        rows, cols: the problem's shape.
        operand_dtype: the Triton kernels' operand dtype when they take the caller's fp16/bf16
            rows as given (one half dtype on both sides); None: the compute dtype.
        reason: why the backend was chosen (the policy rule, or the caller's explicit backend).
        executor: in :func:`~.recorded.explain`'s answer, the executor that ran the plan (``"one_tile"``: the lean
            one-tile executor, :mod:`.one_tile`; else the backend's); ``""`` from :func:`decide` alone, which
            makes no plan. Not compared: the same decision, whichever executor ran it.
    """

    kernel: str
    device: str
    backend: str
    tile: int
    half: bool
    fixed: bool
    budget: int
    rows: int
    cols: int
    operand_dtype: torch.dtype | None = None
    tile_cols: int = 0
    executor: str = field(default="", compare=False)
    reason: str = field(default="", compare=False)

    def __str__(self) -> str:
        if self.backend == "triton":
            tiles = "autotiled kernels"
        elif self.tile == 0:
            tiles = "one tile"
        elif self.tile_cols:
            tiles = f"{math.ceil(self.rows / self.tile)} strips of {self.tile}x{self.tile_cols}"
        else:
            tiles = f"{math.ceil(self.rows / self.tile)}x{math.ceil(self.cols / self.tile)} tiles of {self.tile}"
        if self.backend in EPILOGUE_BACKWARD:
            products = "{}GEMMs by torch.mm ({}), Triton epilogues".format(
                "forward one fused matmul (Triton, no logit in memory), backward " if self.backend == "gemm" else "",
                "bf16 operands as given, fp32 logits" if self.operand_dtype is not None else "compute dtype")
        else:
            products = "fp16/bf16 operands on tensor cores, fp32 logits" if self.half else "kernel operands" \
                if self.backend == "triton" else "compute-dtype products"
        regime = "bounded (one exp)" if self.fixed else "online maximum"
        lean = ", the lean one-tile executor" if self.executor == "one_tile" else ""
        reason = f"; {self.reason}" if self.reason else ""
        return (f"{self.kernel} {self.rows}x{self.cols} on {self.device}: backend={self.backend}, {tiles} "
                f"(scratch budget {self.budget / 2**20:.0f} MiB), {products}, {regime}{lean}{reason}")


def _budget_from_environment() -> int:
    return positive_int("TORCH_CONTRASTIVE_GPU_BUDGET", GPU_BUDGET_DEFAULT)


def _products_from_environment() -> str:
    return choice("TORCH_CONTRASTIVE_PRODUCTS", "auto", ("auto", "half", "compute"))


# Read once at import: a call must not consult the environment (or the driver) on its hot
# path, and torch.compile traces module constants, not os.environ.
#: Scratch bytes for tiles on a GPU (``TORCH_CONTRASTIVE_GPU_BUDGET`` at import, else 1 GiB).
GPU_BUDGET = _budget_from_environment()
#: ``"auto"`` (tensor-core products for half inputs on a GPU), ``"half"`` (also on a CPU, with
#: widened operands -- the same numbers; for tests) or ``"compute"`` (never); from
#: ``TORCH_CONTRASTIVE_PRODUCTS`` at import.
PRODUCTS = _products_from_environment()


def resolve_tile(chunk_size: int | None, rows: int, cols: int, device: torch.device | str | None = None,
                 bytes_per_logit: int = 8, budget: int | None = None) -> int:
    """Tile edge for a problem of ``rows`` x ``cols`` logits (``max(rows, cols)`` = one tile).

    ``chunk_size`` (an int) forces the tile. Otherwise on a CPU: one tile while two fp32
    ``rows x cols`` buffers fit in :data:`DENSE_BUDGET_BYTES`, else :data:`DEFAULT_TILE`. On a
    GPU: one tile while ``rows * cols * bytes_per_logit`` fits the scratch budget, else the
    largest square tile that does, rounded down to a multiple of 256.
    """
    if chunk_size is not None:
        return max(1, int(chunk_size))
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda" and budget is None:
        if 2 * 4 * rows * cols <= DENSE_BUDGET_BYTES:
            return max(rows, cols, 1)
        return DEFAULT_TILE
    budget = GPU_BUDGET if budget is None else budget
    if rows * cols * bytes_per_logit <= budget:
        return max(rows, cols, 1)
    edge = math.isqrt(budget // bytes_per_logit)
    return max(_GPU_TILE_QUANTUM, edge // _GPU_TILE_QUANTUM * _GPU_TILE_QUANTUM)


def half_products(on: Target, dtype: torch.dtype, other: torch.dtype) -> bool:
    """Whether the torch backend multiplies the inputs as given on tensor cores.

    fp16/bf16 inputs of one dtype on a GPU. ``TORCH_CONTRASTIVE_PRODUCTS=half`` asks for the
    same arithmetic on a CPU (widened operands: the same numbers; for tests), ``=compute``
    turns it off.
    """
    if dtype not in _HALF or other != dtype:
        return False
    if on.products == "auto":
        return on.device == "cuda"
    return on.products == "half"


def choose_backend(backend: str, serves: Callable[[str], str | None]) -> str:
    """An explicit backend checked (``"auto"`` is returned as it is: :func:`decide` resolves it).

    ``serves(name)`` is None when the strategy ``name`` can run this call, else why not
    (:func:`~.problem_plan.serves`). A strategy that cannot run the call is a ``ValueError`` that says why --
    never a silent switch.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        why = serves(backend)
        if why is not None:
            raise ValueError(f"backend={backend!r} cannot run this call: {why}")
    return backend


def _as_named(name: str) -> str | None:
    """:func:`decide` alone, asked for a strategy by name: taken as named (there is no problem to ask it about)."""
    return None


def _torch_only(name: str) -> str | None:
    """:func:`decide` alone, under ``"auto"``: only the torch loops, which serve every problem, are taken."""
    return None if name == "torch" else "no problem was given to ask the strategy"


class Traits(NamedTuple):
    """What a plan reads of a problem besides its shape: whether it is a single set's triangle (the epilogue then
    walks squares, not row strips) and, for pair terms, their kernel (``"pair_softplus"``, ``"binary"``; None for
    the soft-max terms). The feature size and the column terms are carried for the offline cost model
    (:mod:`torch_contrastive.cli.cost`), which prices a problem from the same traits."""

    dim: int = 0
    columns: bool = False
    symmetric: bool = False
    pairs: str | None = None


#: No traits: a problem of one set's rows is not assumed.
NO_TRAITS = Traits()


def decide(*, kernel: str, rows: int, cols: int, device: torch.device, dtype: torch.dtype, other_dtype: torch.dtype,
           chunk_size: int | None, backend: str, fixed: bool = False, bound: float | None = None,
           serves: Callable[[str], str | None] | None = None, half_ok: bool = True,
           traits: Traits = NO_TRAITS, on: Target | None = None) -> Decision:
    """Every decision for one engine call (see the module docstring).

    Args:
        kernel: the engine function asking (recorded in the decision).
        rows, cols: ``R`` anchors, ``C`` candidates.
        device: the inputs' device.
        dtype, other_dtype: the anchors' and candidates' dtypes.
        chunk_size: the caller's tile (None: chosen here).
        backend: ``"auto"``, ``"torch"``, ``"triton"``, ``"epilogue"`` or ``"gemm"``.
        fixed: force the bounded one-``exp`` algorithm (tests; the caller vouches for it).
        bound: the loss's promise that every ``|S| <= bound`` (unit rows and a host-known scale;
            None: no promise). The bounded algorithm is chosen when it is exact for the dtype
            (:func:`~.precision.fixed_scale_applies`).
        serves: ``serves(name)`` is None when the strategy ``name`` can run the call, else why not
            (:func:`~.problem_plan.serves`). None: a decision alone, without a problem -- an explicit backend is
            taken as named, and ``"auto"`` takes the torch loops.
        half_ok: the kernel can take tensor-core products (:mod:`.products`).
        traits: the problem's kind (:class:`Traits`).
        on: the device planned for (None: :func:`target` of ``device``, the simulated one inside :func:`simulate`).
    """
    on = target(device) if on is None else on
    fixed = fixed or fixed_scale_applies(bound is not None, bound, dtype)
    chosen = choose_backend(backend, serves or _as_named)
    reason = f"backend={backend!r} as asked"
    if chosen == "auto":  # the device's policy: its first rule that covers the call and whose strategy serves it
        # a problem counted small under simulate() is placed at the size it stands for: the square with as many
        # logits (policy.Rule)
        side = round(math.sqrt(rows * cols * on.area))
        chosen, reason = policy.choose(on.device, kernel, side, dtype, other_dtype, serves or _torch_only)
    half = half_ok and chosen == "torch" and half_products(on, dtype, other_dtype)
    gpu = on.device == "cuda"
    strips = _walks_strips(chosen, traits, kernel == "softmax")
    tile, tile_cols = _tile_shape(chunk_size, rows, cols, on, bytes_per_logit(chosen, dtype, other_dtype, half)
                                  if gpu else 8, strips)
    single = tile >= max(rows, cols) and chosen != "triton"  # (the Triton kernels tile themselves)
    operand_dtype = dtype if chosen != "torch" and dtype in _HALF and other_dtype == dtype else None
    decision = Decision(kernel, on.device, chosen, 0 if single else tile, half, fixed,
                        on.budget if gpu else DENSE_BUDGET_BYTES, rows, cols, operand_dtype, 0 if single else tile_cols,
                        reason=reason)
    record(decision)
    return decision


class Target(NamedTuple):
    """The device a call is planned for -- what a plan reads of the machine besides the tensors.

    Attributes:
        device: the device type whose policy and tile rules apply (``"cpu"``, ``"cuda"``).
        budget: the GPU scratch budget in bytes (:data:`GPU_BUDGET` unless simulated with another).
        products: the product scheme (:data:`PRODUCTS`).
        area: the counted problem stands for one with this many times its logits (:func:`simulate`; 1: itself).
    """

    device: str
    budget: int
    products: str
    area: float = 1.0


#: The targets :func:`simulate` holds, innermost last (a list that is pushed and popped, never rebound: a traced
#: call reads it as a constant, and each plan key holds the target it was planned for).
SIMULATING: list[Target] = []


def target(device: torch.device) -> Target:
    """The device a call on ``device`` is planned for: the one the innermost :func:`simulate` holds, else ``device`` itself
    with this process's scratch budget and product scheme. Part of every plan key (:mod:`.problem_plan`) and of a
    kept call's signature: what a plan reads outside the problem, in one object."""
    if SIMULATING:
        return SIMULATING[-1]
    return Target(device.type, GPU_BUDGET, PRODUCTS)


@contextlib.contextmanager
def simulate(device: str | Target, budget: int | None = None, area: float = 1.0) -> Iterator[Target]:
    """Plan every engine call as for ``device`` while the tensors stay where they are.

    A CPU then runs the GPU's plan -- its policy, its tile budget, its tensor-core product scheme (half operands,
    widened here to the same numbers) -- so the suite checks the CUDA plans' values on any machine and
    :mod:`torch_contrastive.cli.traffic` counts their launches, bytes and FLOPs. Nothing is rebound: the
    :class:`Target` is pushed on :data:`SIMULATING` for the duration, and every plan key holds it.

    Args:
        device: a device type (``"cuda"``) or a whole :class:`Target`.
        budget: the GPU scratch budget in bytes (default :data:`GPU_BUDGET`); with a device type only.
        area: the counted problem stands for one with this many times its logits (counted small, scaled after):
            the policy's crossover, the tile shape and the form of a label relation are decided at that size.

    The Triton kernels are not simulated: a plan that would choose them needs the device itself.

    Yields:
        the target planned for.
    """
    if isinstance(device, Target):
        if budget is not None or area != 1.0:
            raise ValueError("simulate(): give budget and area inside the Target, not beside it")
        on = device
    else:
        on = Target(torch.device(device).type, GPU_BUDGET if budget is None else int(budget), PRODUCTS, float(area))
    SIMULATING.append(on)
    try:
        yield on
    finally:
        SIMULATING.pop()


def _walks_strips(backend: str, traits: Traits, softmax: bool = True) -> bool:
    """Whether a problem may walk row strips: on the epilogue, unless it is a single set's soft-max triangle (which
    needs squares; the pair and sigmoid kernels walk every tile)."""
    return backend in EPILOGUE_BACKWARD and (not softmax or traits.pairs is not None or not traits.symmetric)


def strip_rows(rows: int, cols: int, bytes_per_logit: int, budget: int | None = None) -> int:
    """Rows of a GPU strip across all ``cols`` columns within the scratch budget, a multiple of
    ``_GPU_TILE_QUANTUM`` -- when such strips are fewer than :func:`resolve_tile`'s square tiles (each
    tile is a GEMM, a few Triton launches and its Python: a host-bound call pays per tile); else 0.

    At 16,384 x 16,384 bf16 logits on the epilogue's 8 bytes per logit and 1 GiB: 2 strips of 8,192
    rows instead of 2 x 2 squares of 11,520.
    """
    budget = GPU_BUDGET if budget is None else budget
    strip = budget // max(1, cols * bytes_per_logit) // _GPU_TILE_QUANTUM * _GPU_TILE_QUANTUM
    if strip <= 0 or strip >= rows:
        return 0
    edge = resolve_tile(None, rows, cols, "cuda", bytes_per_logit, budget)
    squares = math.ceil(rows / edge) * math.ceil(cols / edge)
    return strip if math.ceil(rows / strip) < squares else 0


def _tile_shape(chunk_size: int | None, rows: int, cols: int, on: Target, bytes_per_logit: int,
                strips: bool) -> tuple[int, int]:
    """``(tile, tile_cols)`` of :class:`Decision` before the one-tile test: a caller's ``chunk_size`` and a
    CPU's tiles as :func:`resolve_tile` gives them; on a GPU row strips (:func:`strip_rows`) where ``strips``
    allows them and they are fewer. A problem counted small under :func:`simulate` (an area above 1) is
    shaped at the size it stands for and its tiles scaled down to as many per side."""
    if chunk_size is not None or on.device != "cuda":
        return resolve_tile(chunk_size, rows, cols, on.device, bytes_per_logit), 0
    side = math.sqrt(on.area)
    big_rows, big_cols = round(rows * side), round(cols * side)
    strip = strip_rows(big_rows, big_cols, bytes_per_logit, on.budget) if strips else 0
    if strip:
        return (strip if side == 1.0 else math.ceil(rows / math.ceil(big_rows / strip))), cols
    edge = resolve_tile(None, big_rows, big_cols, on.device, bytes_per_logit, on.budget)
    if side == 1.0 or edge >= max(big_rows, big_cols):
        return (edge if side == 1.0 else max(rows, cols, 1)), 0
    return math.ceil(max(rows, cols) / math.ceil(max(big_rows, big_cols) / edge)), 0


#: Whether fp32 GEMMs on a GPU may round their operands to TF32 (then a widened product is not exact): the switch
#: read in C, without the Python of ``torch.backends.cuda.matmul.allow_tf32`` (a plan key reads it every call).
tf32: Callable[[], bool] = getattr(torch._C, "_get_cublas_allow_tf32", lambda: bool(torch.backends.cuda.matmul.allow_tf32))


def bytes_per_logit(backend: str, dtype: torch.dtype, other_dtype: torch.dtype, half: bool) -> int:
    """Scratch per logit of a GPU tile: two fp32 tile buffers (fp64: 16 bytes), plus two half copies of the
    torch backend's gradient tile (the epilogue's gradient tiles fit the second buffer's bytes)."""
    wide = 16 if torch.float64 in (dtype, other_dtype) else 8
    return wide + (4 if half and backend == "torch" else 0)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def rows_by_kernel(device: torch.device, dtype: torch.dtype, backend: str) -> bool:
    """Whether rows are normalised (and their gradients finished) by the Triton row kernels -- one launch each way
    instead of the torch form's five and ten, where a loss is launch-bound at a few thousand rows: on the kernel
    strategies (a plan's, :func:`~.driver.by_kernel`), and for ``"auto"`` rows normalised before a gather on a CUDA
    device with triton installed; fp64 keeps the torch form. The device is the tensors' own, never a simulated one:
    the Triton kernels are not simulated (:func:`simulate`)."""
    if dtype not in KERNEL_DTYPES:
        return False
    if backend in KERNEL_STRATEGIES:
        return True
    return backend == "auto" and device.type == "cuda" and _triton_installed()


def reduce_inside(reduction: str, distributed: bool) -> bool:
    """Whether a loss's ``mean`` / ``sum`` is applied inside the engine's autograd node (one
    process: the per-row values never come back, which saves a small batch a few nodes); not
    for ``"none"`` or a distributed loss, whose value needs the ranks' sums."""
    return reduction != "none" and not distributed
