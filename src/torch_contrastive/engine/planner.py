"""Every device-dependent decision of the engine, made by one function: :func:`decide`.

A loss describes its problem (rows, columns, dtype, the exactness regime it may use) and the
engine asks :func:`decide` how to run it on the inputs' device:

* **backend** -- ``"auto"`` picks the fastest exact path: on a CPU the torch tile loops, on a GPU
  the backend the cost model (:mod:`.cost`) predicts fastest among those that serve the call
  (:func:`predictions`; ``str(decision)`` lists them); an explicit ``"torch"`` / ``"triton"`` /
  ``"epilogue"`` is honoured or refused with a ``ValueError`` (never a silent switch).
* **products** -- fp16/bf16 inputs on a GPU are multiplied as given on tensor cores with fp32
  accumulation and fp32 logits (:class:`~.products.HalfProducts`); everything else in the
  compute dtype (fp32 on a GPU follows ``torch.backends.cuda.matmul.allow_tf32``).
* **tile** -- on a CPU cache-sized (:data:`~.tiling.DEFAULT_TILE`, one tile up to
  :data:`~.tiling.DENSE_BUDGET_BYTES`); on a GPU sized from a scratch budget
  (:data:`GPU_BUDGET`: 1 GiB unless ``TORCH_CONTRASTIVE_GPU_BUDGET`` gives bytes), so
  a GPU runs a few large GEMMs instead of thousands of small ones. Memory stays
  ``O((R + C) * D + budget)``, never ``R x C`` beyond the budget.

The decision is a frozen :class:`Decision`; :func:`explain` returns the decisions a call
made, and the tests check :func:`decide` per device without running a kernel.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from ..positives import KeyPositives, PairPositives, PartnerPositives, Positives
from .confident import apart_rule
from .cost import PAIR_RELATION_FORMS, PATHS, RELATION_FORMS, PathCost, dense_relation_pays, path_terms, predict_path, tile_mask_pays
from .plans import AnyPlan, PairPlan, SigmoidPlan, SoftmaxPlan
from .precision import compute_dtype, fixed_scale_applies
from .problem import PairTerms, Problem, SigmoidPairs, Softmax
from .softmax_tiles import flat_places
from .tiling import DEFAULT_TILE, DENSE_BUDGET_BYTES

#: GPU scratch budget (bytes) unless ``TORCH_CONTRASTIVE_GPU_BUDGET`` says otherwise.
GPU_BUDGET_DEFAULT = 1 << 30
#: GPU tile edges are multiples of this (GEMM-friendly shapes).
_GPU_TILE_QUANTUM = 256

BACKENDS = ("auto", "torch", "triton", "epilogue")
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
        predicted: on a GPU, the cost model's time of each backend it has counts for (a prediction,
            in seconds): what ``"auto"`` chose from.
        executor: in :func:`explain`'s answer, the executor that ran the plan (``"one_tile"``: the lean
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
    predicted: tuple[tuple[str, float], ...] = ()
    tile_cols: int = 0
    executor: str = field(default="", compare=False)

    def __str__(self) -> str:
        if self.backend == "triton":
            tiles = "autotiled kernels"
        elif self.tile == 0:
            tiles = "one tile"
        elif self.tile_cols:
            tiles = f"{math.ceil(self.rows / self.tile)} strips of {self.tile}x{self.tile_cols}"
        else:
            tiles = f"{math.ceil(self.rows / self.tile)}x{math.ceil(self.cols / self.tile)} tiles of {self.tile}"
        if self.backend == "epilogue":
            products = "GEMMs by torch.mm ({}), Triton epilogues".format(
                "bf16 operands as given, fp32 logits" if self.operand_dtype is not None else "compute dtype")
        else:
            products = "fp16/bf16 operands on tensor cores, fp32 logits" if self.half else "kernel operands" \
                if self.backend == "triton" else "compute-dtype products"
        regime = "bounded (one exp)" if self.fixed else "online maximum"
        model = ""
        if self.predicted:
            model = "; predicted (H100 cost model, not a measurement): " + ", ".join(
                f"{name} {1e3 * t:.3g} ms" for name, t in self.predicted)
        lean = ", the lean one-tile executor" if self.executor == "one_tile" else ""
        return (f"{self.kernel} {self.rows}x{self.cols} on {self.device}: backend={self.backend}, {tiles} "
                f"(scratch budget {self.budget / 2**20:.0f} MiB), {products}, {regime}{lean}{model}")


def _budget_from_environment() -> int:
    given = os.environ.get("TORCH_CONTRASTIVE_GPU_BUDGET")
    if not given:
        return GPU_BUDGET_DEFAULT
    try:
        value = int(float(given))
    except ValueError:
        raise ValueError(f"TORCH_CONTRASTIVE_GPU_BUDGET must be a number of bytes, got {given!r}") from None
    if value <= 0:
        raise ValueError(f"TORCH_CONTRASTIVE_GPU_BUDGET must be positive, got {given!r}")
    return value


def _products_from_environment() -> str:
    mode = os.environ.get("TORCH_CONTRASTIVE_PRODUCTS", "auto")
    if mode not in ("auto", "half", "compute"):
        raise ValueError(f"TORCH_CONTRASTIVE_PRODUCTS must be 'auto', 'half' or 'compute', got {mode!r}")
    return mode


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


def half_products(device: torch.device, dtype: torch.dtype, other: torch.dtype) -> bool:
    """Whether the torch backend multiplies the inputs as given on tensor cores.

    fp16/bf16 inputs of one dtype on a GPU. ``TORCH_CONTRASTIVE_PRODUCTS=half`` asks for the
    same arithmetic on a CPU (widened operands: the same numbers; for tests), ``=compute``
    turns it off.
    """
    if dtype not in _HALF or other != dtype:
        return False
    if PRODUCTS == "auto":
        return device.type == "cuda"
    return PRODUCTS == "half"


def choose_backend(backend: str, triton_serves: Callable[[], str | None],
                   epilogue_serves: Callable[[], str | None] | None = None) -> str:
    """An explicit backend checked (``"auto"`` is returned as it is: :func:`decide` resolves it).

    ``triton_serves()`` (``epilogue_serves()``) returns None when the fused Triton kernels (the
    cuBLAS GEMMs with Triton epilogues) can run this call, else why not; no ``epilogue_serves``:
    the statistic has no epilogue kernels. A backend that cannot run the call is a ``ValueError``
    that says why -- never a silent switch.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend in ("triton", "epilogue"):
        serves = triton_serves if backend == "triton" else epilogue_serves
        why = "this statistic has no epilogue kernels" if serves is None else serves()
        if why is not None:
            raise ValueError(f"backend={backend!r} cannot run this call: {why}")
    return backend


class Traits(NamedTuple):
    """What the cost model needs of a problem besides its shape: the feature size, whether it has
    column terms (two sets, CLIP), whether it is a single set's triangle, and for pair terms their
    kernel (``"pair_softplus"``, ``"binary"``; None for the soft-max terms)."""

    dim: int = 0
    columns: bool = False
    symmetric: bool = False
    pairs: str | None = None


#: No traits: a decision without the cost model (``dim`` 0).
NO_TRAITS = Traits()


def decide(*, kernel: str, rows: int, cols: int, device: torch.device, dtype: torch.dtype, other_dtype: torch.dtype,
           chunk_size: int | None, backend: str, fixed: bool = False, bound: float | None = None,
           triton_serves: Callable[[], str | None] = lambda: None, epilogue_serves: Callable[[], str | None] | None = None,
           one_tile_torch_only: bool = True, half_ok: bool = True, auto_triton: bool = True,
           traits: Traits = NO_TRAITS) -> Decision:
    """Every decision for one engine call (see the module docstring).

    Args:
        kernel: the engine function asking (recorded in the decision).
        rows, cols: ``R`` anchors, ``C`` candidates.
        device: the inputs' device.
        dtype, other_dtype: the anchors' and candidates' dtypes.
        chunk_size: the caller's tile (None: chosen here).
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"epilogue"``.
        fixed: force the bounded one-``exp`` algorithm (tests; the caller vouches for it).
        bound: the loss's promise that every ``|S| <= bound`` (unit rows and a host-known scale;
            None: no promise). The bounded algorithm is chosen when it is exact for the dtype
            (:func:`~.precision.fixed_scale_applies`).
        triton_serves: None when the Triton kernels can serve the call, else the reason.
        epilogue_serves: the same for the epilogue kernels (None: the statistic has none).
        one_tile_torch_only: the Triton kernels tile themselves (their tile field is unused).
        half_ok: the kernel can take tensor-core products (:mod:`.products`).
        auto_triton: ``"auto"`` may pick a kernel backend on a GPU, by the cost model (:func:`predictions`);
            False keeps ``"auto"`` on torch (kernels not yet counted for the model).
        traits: the problem's feature size and kind, which the cost model prices.
    """
    if _SIMULATED is not None:  # a cost count of another device's plan (simulate())
        device = _SIMULATED
    fixed = fixed or fixed_scale_applies(bound is not None, bound, dtype)
    # On a GPU "auto" is the cost model's choice among the backends that serve this problem: which
    # serve is part of the key, so a training loop's same question is answered from the cache.
    by_model = backend == "auto" and device.type == "cuda" and auto_triton and traits.dim > 0
    served = (triton_serves() is None, epilogue_serves is not None and epilogue_serves() is None) if by_model else None
    cacheable = backend in ("auto", "torch")
    key = (kernel, rows, cols, device, dtype, other_dtype, chunk_size, backend, fixed, half_ok, GPU_BUDGET, PRODUCTS, served,
           traits, _tf32(), _SIMULATED_AREA)
    decision = _DECISIONS.get(key) if cacheable else None
    if decision is None:
        decision = _decide(kernel, rows, cols, device, dtype, other_dtype, chunk_size, backend, fixed,
                           (triton_serves, epilogue_serves), one_tile_torch_only, half_ok, served, traits)
        if cacheable:
            if len(_DECISIONS) > 512:  # many distinct shapes: keep the cache small
                _DECISIONS.clear()
            _DECISIONS[key] = decision
    _record(decision)
    return decision


# Set only while simulate() runs (a module global: torch.compile guards on it being None).
_SIMULATED: torch.device | None = None
_SIMULATED_AREA = 1.0


@contextlib.contextmanager
def simulate(device: str, budget: int | None = None, area: float = 1.0) -> Iterator[None]:
    """Plan every engine call as for ``device`` (``"cuda"``) while the tensors stay where they are:
    a CPU then runs the GPU's plan -- its tile budget, its tensor-core product scheme (half
    operands, widened here to the same numbers) -- so its launches, bytes and FLOPs can be counted
    (:mod:`torch_contrastive.cli.traffic`). ``budget``: the GPU scratch budget in bytes for the
    duration (default :data:`GPU_BUDGET`). ``area``: the counted problem stands for one with this
    many times its logits (counted small, scaled after): size rules that are not the tile's (the
    form of a label relation) are decided at that size. The Triton kernels are not simulated: a
    plan that would choose them needs the device itself."""
    global _SIMULATED, GPU_BUDGET, _SIMULATED_AREA
    previous = (_SIMULATED, GPU_BUDGET, _SIMULATED_AREA)
    _SIMULATED, _SIMULATED_AREA = torch.device(device), float(area)
    if budget is not None:
        GPU_BUDGET = int(budget)
    try:
        yield
    finally:
        _SIMULATED, GPU_BUDGET, _SIMULATED_AREA = previous


#: ``decide``'s answers by their key (the problem's shape, dtypes, device and options).
_DECISIONS: dict[tuple[Any, ...], Decision] = {}


def _decide(kernel: str, rows: int, cols: int, device: torch.device, dtype: torch.dtype, other_dtype: torch.dtype,
            chunk_size: int | None, backend: str, fixed: bool,
            serves: tuple[Callable[[], str | None], Callable[[], str | None] | None], one_tile_torch_only: bool,
            half_ok: bool, served: tuple[bool, bool] | None, traits: Traits) -> Decision:
    """:func:`decide` without its cache."""
    chosen = choose_backend(backend, serves[0], serves[1])
    predicted: tuple[tuple[str, float], ...] = ()
    if device.type == "cuda" and kernel in ("softmax", "pairwise") and traits.dim > 0:
        side = math.sqrt(_SIMULATED_AREA)  # a problem counted small is priced at the size it stands for
        predicted = predictions(round(rows * side), round(cols * side), dtype, other_dtype,
                                None if chunk_size is None else round(chunk_size * side), traits)
    if chosen == "auto":
        chosen = "torch"
        if served is not None and predicted:
            allowed = {"torch": True, WIDE: True, "triton": served[0], "epilogue": served[1]}
            chosen = min((t, name) for name, t in predicted if allowed[name])[1]
    wide = chosen == WIDE
    chosen = "torch" if wide else chosen
    half = half_ok and chosen == "torch" and half_products(device, dtype, other_dtype) \
        and not (PRODUCTS == "auto" and (wide or _wide_pays(predicted)))
    budget = GPU_BUDGET if device.type == "cuda" else DENSE_BUDGET_BYTES
    strips = _walks_strips(chosen, traits, kernel == "softmax")
    tile, tile_cols = _tile_shape(chunk_size, rows, cols, device, _bytes_per_logit(chosen, dtype, other_dtype, half)
                                  if device.type == "cuda" else 8, strips)
    single = tile >= max(rows, cols) and (chosen != "triton" or not one_tile_torch_only)
    operand_dtype = dtype if chosen != "torch" and dtype in _HALF and other_dtype == dtype else None
    return Decision(kernel, device.type, chosen, 0 if single else tile, half, fixed, budget, rows, cols, operand_dtype,
                    predicted, 0 if single else tile_cols)


def _walks_strips(backend: str, traits: Traits, softmax: bool = True) -> bool:
    """Whether a problem may walk row strips: on the epilogue, unless it is a single set's soft-max triangle (which
    needs squares; the pair and sigmoid kernels walk every tile)."""
    return backend == "epilogue" and (not softmax or traits.pairs is not None or not traits.symmetric)


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


def _tile_shape(chunk_size: int | None, rows: int, cols: int, device: torch.device, bytes_per_logit: int,
                strips: bool) -> tuple[int, int]:
    """``(tile, tile_cols)`` of :class:`Decision` before the one-tile test: a caller's ``chunk_size`` and a
    CPU's tiles as :func:`resolve_tile` gives them; on a GPU row strips (:func:`strip_rows`) where ``strips``
    allows them and they are fewer. A problem counted small under :func:`simulate` (an area above 1) is
    shaped at the size it stands for and its tiles scaled down to as many per side."""
    if chunk_size is not None or device.type != "cuda":
        return resolve_tile(chunk_size, rows, cols, device, bytes_per_logit), 0
    side = math.sqrt(_SIMULATED_AREA)
    big_rows, big_cols = round(rows * side), round(cols * side)
    strip = strip_rows(big_rows, big_cols, bytes_per_logit) if strips else 0
    if strip:
        return (strip if side == 1.0 else math.ceil(rows / math.ceil(big_rows / strip))), cols
    edge = resolve_tile(None, big_rows, big_cols, device, bytes_per_logit)
    if side == 1.0 or edge >= max(big_rows, big_cols):
        return (edge if side == 1.0 else max(rows, cols, 1)), 0
    return math.ceil(max(rows, cols) / math.ceil(max(big_rows, big_cols) / edge)), 0


#: The torch backend with half inputs widened to fp32 and multiplied in fp32 (no tensor cores), as the cost model
#: names it among the backends (:func:`predictions`): a host-bound call's fewest launches.
WIDE = "torch-fp32"


#: Whether fp32 GEMMs on a GPU may round their operands to TF32 (then a widened product is not exact): the switch
#: read in C, without the Python of ``torch.backends.cuda.matmul.allow_tf32`` (a plan key reads it every call).
_tf32: Callable[[], bool] = getattr(torch._C, "_get_cublas_allow_tf32", lambda: bool(torch.backends.cuda.matmul.allow_tf32))


def _wide_pays(predicted: tuple[tuple[str, float], ...]) -> bool:
    """Whether the model prices the torch backend's widened fp32 products below its tensor-core products."""
    times = dict(predicted)
    return times.get(WIDE, math.inf) < times.get("torch", math.inf)


def _bytes_per_logit(backend: str, dtype: torch.dtype, other_dtype: torch.dtype, half: bool) -> int:
    """Scratch per logit of a GPU tile: two fp32 tile buffers (fp64: 16 bytes), plus two half copies of the
    torch backend's gradient tile (the epilogue's gradient tiles fit the second buffer's bytes)."""
    wide = 16 if torch.float64 in (dtype, other_dtype) else 8
    return wide + (4 if half and backend == "torch" else 0)


def predictions(rows: int, cols: int, dtype: torch.dtype, other_dtype: torch.dtype, chunk_size: int | None,
                traits: Traits, gpu: str = "H100") -> tuple[tuple[str, float], ...]:
    """The cost model's time (seconds, a prediction) of each backend that has counts for this soft-max or
    pair-term problem (:data:`~.cost.PATHS`): ``(("torch", t), ("epilogue", t), ("triton", t))`` as available --
    the H100's constants for any CUDA device until others are measured. Half operands of one dtype are
    priced as tensor-core products, and the torch backend also as :data:`WIDE` -- the operands widened and
    multiplied in fp32 (exact; not offered while TF32 may round fp32 GEMMs): fewer launches, more GEMM time,
    so the host-bound small calls' choice; fp32 as fp32 (the fused kernels are counted for half operands only);
    fp64 is not priced."""
    return tuple((label, predict_path(*priced, gpu)) for label, priced in _priced(rows, cols, dtype, other_dtype, chunk_size,
                                                                                     traits))


def _priced(rows: int, cols: int, dtype: torch.dtype, other_dtype: torch.dtype, chunk_size: int | None,
            traits: Traits) -> list[tuple[str, tuple[PathCost, str, int, int, int, str, int]]]:
    """Each backend :func:`predictions` prices, with the arguments of :func:`~.cost.predict_path` (or
    :func:`~.cost.path_terms`) but the GPU: its counted path, the shape, the GEMM dtype and the tiles visited."""
    if dtype in _HALF and other_dtype == dtype:
        operands, name = "half", "bfloat16"
    elif dtype == other_dtype == torch.float32:
        operands, name = "fp32", "float32"
    else:
        return []
    kind = traits.pairs or ("columns" if traits.columns else "rows")
    # (name, backend, counts' operands, GEMM dtype): the widened torch products for half inputs while exact
    candidates = [(b, b, operands, name) for b in ("torch", "epilogue", "triton")]
    if operands == "half" and not _tf32():
        candidates.append((WIDE, "torch", "wide", "float32"))
    out = []
    for label, backend, counted, gemm_dtype in candidates:
        path = PATHS.get((kind, backend, counted))
        if path is None:
            continue
        half = backend == "torch" and counted == "half"
        per_logit = _bytes_per_logit(backend, dtype, other_dtype, half)
        strip = strip_rows(rows, cols, per_logit) if chunk_size is None and _walks_strips(backend, traits) else 0
        tile = resolve_tile(chunk_size, rows, cols, "cuda", per_logit)
        per_side = math.ceil(rows / tile), math.ceil(cols / tile)
        # a single set's triangle: the soft-max terms on every backend, the pair terms on the torch loops
        triangle = traits.symmetric and per_side[0] == per_side[1] and (traits.pairs is None or backend == "torch")
        tiles = math.ceil(rows / strip) if strip else per_side[0] * (per_side[0] + 1) // 2 if triangle \
            else per_side[0] * per_side[1]
        out.append((label, (path, backend, rows, cols, traits.dim, gemm_dtype, 1 if backend == "triton" else tiles)))
    return out


def plan(problem: Problem) -> AnyPlan:
    """The one complete plan of a :class:`~.problem.Problem` on its inputs' device -- the one
    planning function every engine call goes through. Nothing runs: ``plan(problem)`` says what
    :func:`~torch_contrastive.engine.solve` would do (``str(plan)`` in words) and is a frozen
    :class:`~.plans.SoftmaxPlan`, :class:`~.plans.PairPlan` or :class:`~.plans.SigmoidPlan`.

    The statistic's traits: the soft-max and pair terms take tensor-core products; the soft-max
    terms may move to the Triton kernels under ``"auto"``, the pair and sigmoid kernels stay on
    torch under ``"auto"`` until measured faster on a GPU. :func:`triton_refusal` says whether the Triton
    kernels serve the problem.

    A soft-max plan is kept per key (:func:`_softmax_key`): a training loop asks the same question
    every step, and the answer costs one dictionary look-up instead of a decision and a plan.
    """
    stat = problem.statistic
    kind = type(stat)
    key = _softmax_key(problem, stat) if kind is Softmax else _pair_key(problem, stat) if kind is PairTerms else None
    if key is not None:
        found = _PLANS.get(key)
        if found is not None:
            if problem.options.backend in ("triton", "epilogue"):  # an explicit kernel backend: still its refusal
                choose_backend(problem.options.backend, lambda: triton_refusal(problem), lambda: epilogue_refusal(problem))
            relation = problem.positives
            if found.positives is relation:  # (a partner's key holds its id(): the kept plan holds it, so it is its own)
                _record_plan(found)
                return found
            if found.positives is None and isinstance(relation, KeyPositives):  # the plan of its shape, kept without it
                _record_plan(found)
                return found.with_relation(relation)
    decision = _decision(problem, stat)
    if isinstance(stat, (Softmax, PairTerms)):
        chosen = _softmax_plan(problem, stat, decision) if isinstance(stat, Softmax) else _pair_plan(problem, stat, decision)
        if key is not None:
            if len(_PLANS) > 256:  # many distinct problems: keep the cache small
                _PLANS.clear()
            # a label relation is not held (its dense mask can be large on a GPU): the plan is kept without it
            _PLANS[key] = chosen.with_relation(None) if isinstance(problem.positives, KeyPositives) else chosen
        name_executor(chosen.executor)
        return chosen
    if problem.positives is None:  # Problem refuses it when built
        raise ValueError("SigmoidPairs needs positives")
    sigmoid = SigmoidPlan(decision=decision, positives=problem.positives, diagonal_offset=stat.diagonal_offset,
                          normalize=problem.options.normalize, eps=float(problem.options.eps),
                          stack_rows=_stacks(decision, problem))
    name_executor(sigmoid.executor)
    return sigmoid


def _decision(problem: Problem, stat: Softmax | PairTerms | SigmoidPairs) -> Decision:
    """:func:`decide` asked about ``problem``."""
    rows, cols = problem.shape
    anchors, opts = problem.anchors, problem.options
    kernel = "softmax" if isinstance(stat, Softmax) else "pairwise" if isinstance(stat, PairTerms) else "sigmoid"
    fixed = stat.fixed if isinstance(stat, (Softmax, PairTerms)) else False
    return decide(kernel=kernel, rows=rows, cols=cols, device=anchors.device, dtype=anchors.dtype,
                  other_dtype=problem.candidates.dtype, chunk_size=opts.chunk_size, backend=opts.backend, fixed=fixed,
                  bound=None if isinstance(stat, SigmoidPairs) else problem.bound,
                  half_ok=not isinstance(stat, SigmoidPairs), auto_triton=not isinstance(stat, SigmoidPairs),
                  traits=Traits(int(anchors.shape[-1]), isinstance(stat, Softmax) and stat.columns, problem.symmetric,
                                stat.kernel if isinstance(stat, PairTerms) else None),
                  triton_serves=lambda: triton_refusal(problem),
                  epilogue_serves=lambda: epilogue_refusal(problem))


def _softmax_key(problem: Problem, stat: Softmax) -> tuple[Any, ...] | None:
    """Everything a soft-max plan is decided from, as a dictionary key (a relation by
    :func:`_relation_key`); None for a problem that is planned afresh every call: a per-call object in
    it (an exclusion, a distributed column reduction, a relation listed pair by pair or by a sample
    mask) or a traced call (under ``torch.compile`` the plan is traced once anyway, and an ``id()`` of a
    traced object is not its own). A simulated device (:func:`simulate`) and its area are part of the key; an
    explicit kernel backend's plan is kept too, and its refusal asked again at every look-up (it reads more
    of the problem than the key)."""
    if stat.exclude is not None or stat.column_comm is not None or not _keyed(problem):  # (no id() under tracing)
        return None
    relation = _relation_key(problem.positives)
    if relation is None:
        return None
    a, c, opts = problem.anchors, problem.candidates, problem.options
    return (Softmax, a.shape[0], c.shape[0], a.shape[-1], a.device, _SIMULATED, _SIMULATED_AREA, a.dtype, c.dtype,
            opts.chunk_size, opts.backend, stat.fixed, problem.bound, GPU_BUDGET, PRODUCTS, _tf32(), relation, problem.self_offset,
            problem.symmetric, problem.grad_columns, opts.normalize, opts.eps, stat.columns, stat.column_positives,
            stat.columns_share_alpha, stat.row_weights[0] is not None, stat.row_weights[1] is not None,
            stat.col_weights[0] is not None, stat.col_weights[1] is not None)


def _pair_key(problem: Problem, stat: PairTerms) -> tuple[Any, ...] | None:
    """:func:`_softmax_key` of a pair problem: None with label ranges (per-call data the plan reads)."""
    if stat.label_ranges is not None or not _keyed(problem):
        return None
    relation = _relation_key(problem.positives)
    if relation is None:
        return None
    a, c, opts = problem.anchors, problem.candidates, problem.options
    return (PairTerms, a.shape[0], c.shape[0], a.shape[-1], a.device, _SIMULATED, _SIMULATED_AREA, a.dtype, c.dtype,
            _tf32(), opts.chunk_size, opts.backend,
            stat.fixed, stat.kernel, problem.bound, GPU_BUDGET, PRODUCTS, relation, problem.self_offset, problem.symmetric,
            problem.single, opts.normalize, opts.eps)


def _keyed(problem: Problem) -> bool:
    """A problem whose plan may be kept: not a traced call. A simulated device's plan is kept under its own
    key (the device simulated and the area are part of it): a count then sees a training loop's steady
    step, whose plan is a look-up, as on the GPU itself."""
    return not torch.compiler.is_compiling()


def _relation_key(positives: Positives | None) -> Any:
    """What a plan reads of a relation, as part of a key: a partner relation (kept by its loss, one
    object per shape) by its ``id()``; a label relation (new every call) by its shape -- the plan
    reads its kind, size, self offset and dense form, never its labels; the plan is kept without it and
    :meth:`~.plans.SoftmaxPlan.with_relation` puts each call's relation in); None: a relation whose plan is
    built afresh."""
    if positives is None:
        return ()
    if isinstance(positives, PartnerPositives):
        return id(positives)
    if isinstance(positives, KeyPositives):
        return ("keys", positives.num_rows, positives.num_cols, positives.self_offset, len(positives.row_keys),
                positives.dense is not None)
    return None


#: :func:`plan`'s soft-max and pair plans by :func:`_softmax_key` / :func:`_pair_key`.
_PLANS: dict[tuple[Any, ...], SoftmaxPlan | PairPlan] = {}


def _softmax_plan(problem: Problem, stat: Softmax, decision: Decision) -> SoftmaxPlan:
    """The soft-max choices: where the positive part is read, shared weights, kept-apart positives, gradient columns."""
    positives, columns, n_cols = problem.positives, stat.columns, problem.shape[1]
    tile_positives = decision.backend == "torch" and decision.tile == 0 and positives is not None \
        and (not isinstance(positives, KeyPositives) or positives.dense is not None)
    # the one torch tile reads, clears and updates a strided relation's entries by flat places
    places = flat_places(positives, problem.self_offset, compute_dtype(problem.anchors.dtype)) \
        if tile_positives and isinstance(positives, PartnerPositives) and positives.layout is not None else None
    chosen = SoftmaxPlan(
        decision=decision, self_offset=problem.self_offset, columns=columns, symmetric=problem.symmetric,
        normalize=problem.options.normalize, eps=float(problem.options.eps), positives=positives,
        column_positives=columns and stat.column_positives,
        tile_positives=tile_positives,
        fold_positives=tile_positives or (decision.backend == "epilogue" and isinstance(positives, (KeyPositives, PartnerPositives))),
        shared_alpha=stat.columns_share_alpha and stat.row_weights[0] is not None,
        column_comm=stat.column_comm if columns else None,
        grad_columns=n_cols if problem.grad_columns is None else max(0, min(int(problem.grad_columns), n_cols)),
        exclude=stat.exclude,
        apart=apart_rule(positives, stat.exclude, columns, stat.column_positives, stat.column_comm, problem.symmetric,
                         decision.backend),
        places=places,
        weighted=any(w is not None for w in (*stat.row_weights, *stat.col_weights)),
        stack_rows=_stacks(decision, problem))
    return replace(chosen, one_tile=True) if one_tile(chosen, problem) else chosen


def one_tile(plan: SoftmaxPlan, problem: Problem) -> bool:
    """Whether the lean one-tile executor (:mod:`.one_tile`) serves ``plan``: the torch backend's one
    bounded tile (the compute dtype, or bf16 on tensor cores), rows normalised inside, nothing excluded, one process; and either an
    unweighted strided relation kept apart -- a single set visited as its symmetric triangle (the self pair
    left out, no column terms), or two sets of one dtype on the identity layout (no self pair; the column
    terms with their positives, or none) whose candidates all take a gradient -- or a single set's dense
    label relation read off the tile, rows weighted, no column terms (SupCon). (Per call, :mod:`.one_tile` also
    sends a reduction outside the engine, a tensor scale and an ambient autocast to the general executor.)"""
    places, n_cols = plan.places, problem.shape[1]
    if places is None:  # a dense label relation read off the tile (SupCon), rows weighted, no column terms
        stat = problem.statistic
        # (two rows or more: every row's sum of exp then holds a candidate, so backward divides by it)
        positives = plan.positives
        # (a grouped relation: only the GPU's executor, which sums the positives by key, .one_tile_half)
        read = plan.tile_positives or (isinstance(positives, KeyPositives) and plan.decision.device == "cuda"
                                       and problem.anchors.dtype in _HALF)
        masked = problem.single and n_cols >= 2 and plan.symmetric and plan.self_offset == 0 and not plan.columns and read \
            and isinstance(positives, KeyPositives) and isinstance(stat, Softmax) and stat.col_weights == (None, None)
        return bool(masked and _one_bounded_tile(plan, problem))
    if problem.single:
        shape = plan.symmetric and plan.self_offset == 0 and not plan.columns
    else:
        shape = (not plan.symmetric and plan.self_offset is None and problem.anchors.dtype == problem.candidates.dtype
                 and (plan.column_positives or not plan.columns) and getattr(plan.positives, "layout", None) == "identity")
    return bool(shape and plan.grad_columns == n_cols and plan.apart is not None and not plan.weighted
                and _one_bounded_tile(plan, problem))


def _one_bounded_tile(plan: SoftmaxPlan, problem: Problem) -> bool:
    """The torch backend's one bounded tile, rows normalised inside, nothing excluded, one process; in the compute
    dtype, or bf16 on tensor cores (:mod:`.one_tile_half`; fp16 keeps the general scheme's rescaled rounding)."""
    return (plan.backend == "torch" and plan.single_tile and plan.fixed and plan.operand_dtype is None
            and (not plan.half or problem.anchors.dtype == torch.bfloat16)
            and plan.normalize and plan.exclude is None and plan.column_comm is None)


def _stacks(decision: Decision, problem: Problem) -> bool:
    """Two sets normalised as one stack of rows (half the normalisation ops, forward and backward; the
    stack's one copy of the rows is small beside the logits): the torch backend, rows normalised inside
    (tensor-core products read each set's part of the stack's norms)."""
    return decision.backend == "torch" and problem.options.normalize and not problem.single


def _pair_plan(problem: Problem, stat: PairTerms, decision: Decision) -> PairPlan:
    """The pair choices: which tiles can hold a positive (label-sorted rows), and the symmetric walk."""
    positives = problem.positives
    if positives is None:  # Problem refuses it when built
        raise ValueError("PairTerms needs positives")
    mixed = None
    # The Triton kernels form every tile's mask in registers: no skipped tiles, no triangle walk.
    if stat.label_ranges is not None and decision.tile != 0 and decision.backend == "torch":
        row_ranges, col_ranges = stat.label_ranges
        mixed = tuple(tuple(not (r_hi < c_lo or c_hi < r_lo) for c_lo, c_hi in col_ranges) for r_lo, r_hi in row_ranges)
    # PML's one exp for both blocks of a tile needs the bounded regime
    symmetric = (mixed is not None and problem.single and positives.self_offset == 0
                 and (stat.kernel == "binary" or decision.fixed))
    # the lean one-tile executor: one set's label relation on the torch backend's one bounded tile, rows normalised inside
    # (in the compute dtype, or bf16 on tensor cores: engine/one_tile_half.py; fp16 keeps the general scheme)
    one_tile = (problem.single and isinstance(positives, KeyPositives) and positives.self_offset == 0
                and decision.backend == "torch" and decision.tile == 0 and decision.fixed
                and (not decision.half or problem.anchors.dtype == torch.bfloat16)
                and decision.operand_dtype is None and problem.options.normalize)
    return PairPlan(decision=decision, kernel=stat.kernel, positives=positives, normalize=problem.options.normalize,
                    eps=float(problem.options.eps), mixed=mixed, symmetric=symmetric, one_tile=one_tile)


def triton_refusal(problem: Problem) -> str | None:
    """None when the Triton kernels can run ``problem``, else why not (in words, for the error
    of an explicit ``backend="triton"``)."""
    from . import triton_backend

    try:
        triton_backend.check_device(problem.anchors)
    except ValueError as err:
        return str(err)
    stat, positives = problem.statistic, problem.positives
    if isinstance(stat, Softmax):
        try:
            triton_backend.check_exclusion(stat.exclude)
        except ValueError as err:
            return str(err)
        return None
    if positives is None:  # Problem refuses pair and sigmoid terms without positives when built
        return f"{type(stat).__name__} needs positives"
    kind = positives.kind
    by_ids = isinstance(positives, KeyPositives)  # one or two keys: the kernels compare both
    if isinstance(stat, PairTerms):
        if isinstance(positives, (PartnerPositives, PairPositives)) or by_ids:
            return None
        return f"the pair kernels take positives by ids, a partner or index pairs, not a {kind!r} relation"
    covered = (isinstance(positives, PartnerPositives) and stat.diagonal_offset is not None) \
        or (by_ids and positives.self_offset is None) \
        or (isinstance(positives, PairPositives) and positives.pairs.shape[0] == 0)
    return None if covered else f"the SigLIP kernels take positives on a diagonal, by ids or none, not a {kind!r} relation"


def epilogue_refusal(problem: Problem) -> str | None:
    """None when the epilogue kernels can run ``problem`` (a problem the Triton kernels cover, without
    fp16 inputs), else why not."""
    why = triton_refusal(problem)
    if why is not None:
        return why.replace("backend='triton'", "backend='epilogue'")
    if torch.float16 in (problem.anchors.dtype, problem.candidates.dtype):
        return "fp16 gradient tiles need a tile-wide rescale; use backend='torch' or 'triton' (or bf16 inputs)"
    return None


class Reader(NamedTuple):
    """The problem a label relation is built for, as the planner will price it (what :func:`dense_relation`
    asks of it): its dtypes, the caller's ``chunk_size`` and ``backend``, and its :class:`Traits` -- the
    feature size, whether one set's triangle, the pair kernel (``None``: soft-max terms) -- kept flat (a label
    call builds one every step: one tuple, not two)."""

    dtype: torch.dtype
    other_dtype: torch.dtype
    chunk_size: int | None
    backend: str
    dim: int
    symmetric: bool
    pairs: str | None


def dense_relation(rows: int, cols: int, device: torch.device, cpu_limit: int, reader: Reader | None = None) -> bool:
    """Whether a label relation of ``R x C`` entries is held as a dense mask (else grouped by key):
    on a CPU up to ``cpu_limit`` entries (measured there). On a GPU -- also one :func:`simulate` d -- while the
    mask fits the scratch budget: where the cost model prices the mask's extra passes over strips below the
    grouped form's extra launches (:func:`~.cost.dense_relation_pays`, the H100's constants for any CUDA device
    until others are measured), or where the problem it is built for (``reader``) wants it
    (:func:`reader_wants_mask`: the torch backend's one tile, whose lean executor reads the mask by GEMMs, or
    host-bound torch strips). The kernel backends compare the keys themselves: a mask only adds its passes there."""
    entries = rows * cols * _SIMULATED_AREA  # a problem counted small stands for its full size
    if (_SIMULATED or device).type != "cuda":
        return entries <= cpu_limit
    if entries > GPU_BUDGET:
        return False
    # the strips' rule first: it holds for every small relation; its answer kept per shape (a training loop asks
    # the same every step, and a host-bound call pays each bytecode)
    if reader is not None and reader_wants_mask(rows, cols, reader):  # (the reader first: a small call's mask)
        return True
    key = (rows, cols, _SIMULATED_AREA)
    pays = _RELATION_PAYS.get(key)
    if pays is None:
        if len(_RELATION_PAYS) > 512:
            _RELATION_PAYS.clear()
        pays = _RELATION_PAYS[key] = dense_relation_pays(rows, cols * _SIMULATED_AREA)
    return pays


#: :func:`~.cost.dense_relation_pays`'s answers by ``(rows, cols, simulated area)`` (:func:`dense_relation`).
_RELATION_PAYS: dict[tuple[int, int, float], bool] = {}


#: :func:`reader_wants_mask`'s answers by their key (a training loop asks the same question every step).
_READER_MASKS: dict[tuple[Any, ...], bool] = {}


def reader_wants_mask(rows: int, cols: int, reader: Reader) -> bool:
    """Whether a label relation of ``R x C`` entries is cheaper as a dense mask for the problem that reads it
    (``reader``), priced at the size it stands for: when that problem runs on the torch backend's one tile
    (:func:`_torch_tile_reads`), or on the torch loops' strips where the mask costs their call less
    (:func:`_mask_pays_in_call`). The backend is the caller's, or under ``"auto"`` the one the cost model prices
    fastest among every backend with counts (one the call cannot use makes the answer False, the grouped form's
    safe side). Kept per key."""
    key = (rows, cols, reader, GPU_BUDGET, PRODUCTS, _tf32(), _SIMULATED_AREA)
    found = _READER_MASKS.get(key)
    if found is None:
        if len(_READER_MASKS) > 512:
            _READER_MASKS.clear()
        found = _READER_MASKS[key] = _reader_wants_mask(rows, cols, reader)
    return found


def _reader_wants_mask(rows: int, cols: int, reader: Reader) -> bool:
    """:func:`reader_wants_mask` without its cache: the reader's problem priced once, then asked both ways."""
    side = math.sqrt(_SIMULATED_AREA)  # a problem counted small is priced at the size it stands for
    rows, cols = round(rows * side), round(cols * side)
    chunk = None if reader.chunk_size is None else round(reader.chunk_size * side)
    traits = Traits(reader.dim, False, reader.symmetric, reader.pairs)  # a label relation's problem: no column terms
    priced = dict(_priced(rows, cols, reader.dtype, reader.other_dtype, chunk, traits)) if reader.dim > 0 else {}
    predicted = tuple((name, predict_path(*args)) for name, args in priced.items())
    label = reader.backend if reader.backend != "auto" else min((t, name) for name, t in predicted)[1] if predicted else None
    if _torch_tile_reads(rows, cols, chunk, reader, label, predicted):
        return _tile_mask_pays(rows, cols, reader, label, priced, predicted)
    return _mask_pays_in_call(rows, cols, label, priced, reader.pairs is not None)


def _tile_mask_pays(rows: int, cols: int, reader: Reader, label: str | None, priced: dict[str, Any],
                    predicted: tuple[tuple[str, float], ...]) -> bool:
    """Whether the torch backend's one tile reads the relation as a mask: always, but for a single set's soft-max
    terms on bf16 rows (SupCon's lean executor, which sums the positives by key in the grouped form), where
    the mask's products and passes are priced against the grouped form's launches inside the call
    (:func:`~.cost.tile_mask_pays`)."""
    if reader.pairs is not None or not reader.symmetric or reader.dtype != torch.bfloat16 or label not in priced:
        return True
    wide = label == WIDE or (PRODUCTS == "auto" and _wide_pays(predicted))
    terms = path_terms(*(priced[WIDE] if wide and WIDE in priced else priced[label]))
    return tile_mask_pays(rows, cols, reader.dim, "wide" if wide else "half", terms)


def _torch_tile_reads(rows: int, cols: int, chunk: int | None, reader: Reader, label: str | None,
                      predicted: tuple[tuple[str, float], ...]) -> bool:
    """Whether the reader's problem runs on the torch backend's one tile, as :func:`decide` will choose it: its
    backend (``label``; None: ``"auto"`` without prices) the torch loops, and one tile at the scratch budget."""
    if label not in (None, "torch", WIDE) or (chunk is not None and chunk < max(rows, cols)):
        return False
    # the tile's scratch as _decide sizes it: the half gradient copies unless the widened products are chosen
    half = half_products(torch.device("cuda"), reader.dtype, reader.other_dtype) \
        and not (PRODUCTS == "auto" and _wide_pays(predicted))
    return resolve_tile(None, rows, cols, "cuda", _bytes_per_logit("torch", reader.dtype, reader.other_dtype, half)) \
        >= max(rows, cols)


def _mask_pays_in_call(rows: int, cols: int, label: str | None, priced: dict[str, Any], pairs: bool) -> bool:
    """Whether the dense mask is the cheaper form inside the torch loops' call that reads it (backend ``label``):
    that call's device and host times (:func:`~.cost.path_terms`) against the grouped form's
    (:func:`~.cost.dense_relation_pays` with ``call``), by the forms of the terms that read it (``pairs``: the pair
    terms', which compare the keys of every tile again; else the soft-max terms'). A host-bound call keeps the
    mask, whose passes the device hides, where the device alone would choose the grouped form's launches."""
    # the forms' constants were counted on the torch loops' strips; the kernel backends compare the keys in
    # registers, where a mask only adds bytes (the epilogue holds to its byte budget, issue 34: at most 6 passes)
    if label not in priced or priced[label][1] != "torch":
        return False
    return dense_relation_pays(rows, cols, call=path_terms(*priced[label]), forms=PAIR_RELATION_FORMS if pairs else RELATION_FORMS)


def counts_from_values(device: torch.device) -> bool:
    """Whether a dense label relation's counts are summed from its 0/1 values in the compute dtype: on a
    CPU, where a bool reduction takes a slow path and the one tile reads those values anyway; on a GPU
    (also one :func:`simulate` d) the bools are summed, one byte an entry, and no values are formed for it."""
    return (_SIMULATED or device).type == "cpu"


def launch_bound(device: torch.device) -> bool:
    """Whether a call's small ops are priced as launches (a GPU, also one :func:`simulate` d): there fewer ops
    win even through more views; on a CPU an op costs microseconds and a view about as much, so the plain forms
    stay (NT-BXent's stacked weights measured 7 % slower on a CPU at 64 rows)."""
    return (_SIMULATED or device).type == "cuda"


def mask_on_tensor_cores(device: torch.device) -> bool:
    """Whether a dense 0/1 relation multiplies fp32 rows as a bf16 mask against the rows split in three bf16 parts
    (:func:`~torch_contrastive.positives._mask_product`): on a GPU (also one :func:`simulate` d), where that is one
    half-width read of the mask by a tensor-core GEMM; on a CPU the fp32 product."""
    return (_SIMULATED or device).type == "cuda"


def reduce_inside(reduction: str, distributed: bool) -> bool:
    """Whether a loss's ``mean`` / ``sum`` is applied inside the engine's autograd node (one
    process: the per-row values never come back, which saves a small batch a few nodes); not
    for ``"none"`` or a distributed loss, whose value needs the ranks' sums."""
    return reduction != "none" and not distributed


def label_sorted(rows: int, tile: int, *, reads_anyway: bool, distributed: bool, normalized: bool, backend: str) -> bool:
    """Whether a labelled mask-in-tile loss sorts its rows by label first (most tiles then hold
    only negatives and skip the mask work). Which tiles do is known from values on the device,
    read in the call's one validation transfer -- so only when that read happens anyway
    (``validate=True``), on one process, for normalised inputs (raw dot products need a second
    read) and when the batch spans several tiles. The Triton kernels form every tile's mask in
    registers and gain nothing from it."""
    return reads_anyway and not distributed and normalized and tile < rows and backend != "triton"


# ------------------------------------------------------------------------------ explain
# Set only while explain() runs (a module global: torch.compile guards on it being None).
_LOG: list[Decision] | None = None


def _record(decision: Decision) -> None:
    if _LOG is not None:
        _LOG.append(decision)


def _record_plan(found: AnyPlan) -> None:
    """A kept plan's decision, with its executor (read only while :func:`explain` runs: off the hot path)."""
    if _LOG is not None:
        _LOG.append(replace(found.decision, executor=found.executor))


def name_executor(executor: str) -> None:
    """While :func:`explain` runs, name the executor in the decision just recorded: the plan chose it, and an
    executor that hands a call on (:mod:`.one_tile`'s per-call checks) names the one that ran it."""
    if _LOG:
        _LOG[-1] = replace(_LOG[-1], executor=executor)


def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Decision]:
    """The engine decisions a call makes: ``explain(tc.clip_loss, img, txt, 0.07)``.

    Runs ``fn(*args, **kwargs)`` once without autograd and returns one :class:`Decision`
    per engine call (``str(decision)`` says it in words). For a decision without running
    anything, call :func:`decide` itself.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a callable (a loss function or module), got {type(fn).__name__}")
    global _LOG
    previous, _LOG = _LOG, []
    try:
        with torch.no_grad():
            fn(*args, **kwargs)
        return list(_LOG)
    finally:
        _LOG = previous
