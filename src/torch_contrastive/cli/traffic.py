"""Count what a loss call would cost a GPU, on any machine: launches, logit-sized bytes, GEMM FLOPs,
host syncs (``torch-contrastive bench --traffic``).

A ``TorchDispatchMode`` sees every ATen op of a forward + backward call. Under
:func:`~torch_contrastive.engine.planner.simulate` the engine plans as on a GPU (its tile budget,
its tensor-core products), so a CPU runs the GPU's plan and the counts are the GPU's:

* a **launch** is an op that runs a kernel: views, allocations and host reads are not;
* **logit bytes** are the bytes of every logit-sized tensor an op reads or writes (inputs and
  outputs; an in-place op's tensor twice). Logit-sized: no side of length ``D``, ``2D`` or ``3D`` (a
  feature tensor, as it is or transposed, or features stacked along a product's inner side), and at least
  ``2 * max(R, C)`` numbers -- a vector more than that and ``R * C / 64``, so a flattened tile counts and a
  per-row statistic of both directions does not (a tile whose edge is one of those sides would be missed:
  :func:`count_loss` counts at a size where none is). Indexed ops (``take``, ``index_fill_``, ``index_add_``, ...)
  touch only their indexed entries, which is what they count;
* **GEMM FLOPs** are ``2 m k n`` per product, by the operands' dtype (a batch of row dot products -- ``bmm`` of
  ``1 x k`` by ``k x 1``, and their gradients -- is an O(N D) pass, not counted);
* the copies a CPU makes to widen half operands (``torch.mm`` has no ``out_dtype`` on a CPU) are
  not counted, and the product counts those operands at their own width;
* **host syncs** as :mod:`.synccount` sees them;
* **Python bytecodes** the call runs on the host (a run of its own under ``sys.settrace``, autograd's
  backward on the calling thread; a Triton launch's inside is not counted, the model prices the launch).

:func:`torch_contrastive.cli.cost.predict` turns the counts into a predicted time (offline: the engine's policy
does not read the model).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..engine import policy, products
from ..engine.planner import Traits, simulate
from ..positives import DENSE_KEYS_LIMIT
from .cost import (
    BYTECODES_PER_OP,
    DEVICE_ROWS,
    GPUS,
    HOST_ROWS,
    MEASURED,
    PATHS,
    PEAK_BANDWIDTH,
    Counts,
    Fused,
    Gpu,
    Measured,
    fit,
    fit_bytecodes,
    fit_fused,
    fit_host,
    predict,
    predictions,
)
from .synccount import SYNC_OPERATORS, host_sync_events

#: Ops that make no kernel launch on a GPU (allocation or metadata only).
_FREE = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_local_scalar_dense",
                   "lift_fresh", "set_", "resize_", "_to_copy_noop"})
#: Ops that touch only the entries their index names, not the whole tensor they index.
_INDEXED = frozenset({"take", "index_fill", "index_fill_", "index_add", "index_add_", "index_put", "index_put_",
                      "_index_put_impl_", "put", "put_", "gather", "scatter", "scatter_", "scatter_add", "scatter_add_",
                      "index_select"})
_GEMMS = frozenset({"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "_scaled_mm"})  # in-place forms accumulate
#: The sides of a feature tensor, in multiples of ``D``: the features, and the features stacked along a
#: product's inner side (two or three blocks), so that no such tensor reads as logit-sized.
FEATURE_SIDES = (1, 2, 3)


def feature_sides(dim: int) -> frozenset[int]:
    """Every side a feature tensor of ``dim`` features may have (:data:`FEATURE_SIDES`)."""
    return frozenset(k * dim for k in FEATURE_SIDES)
#: The losses :func:`cases` builds, in the order ``bench --traffic`` prints them.
LOSSES = ("clip", "nt_xent", "supcon", "nt_xent_pml", "nt_bxent")


class _Count(TorchDispatchMode):
    def __init__(self, rows: int, cols: int, dim: int) -> None:
        super().__init__()
        self.rows, self.cols, self.dim = rows, cols, dim
        self.features = feature_sides(dim)
        self.launches = 0
        self.logit_bytes = 0
        self.flops: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()
        self.widened: dict[int, torch.dtype] = {}  # id of a CPU-widened copy -> the operand's own dtype
        self.inside = 0  # > 0 during an announced kernel launch: its own tensor work is not counted

    def launch_begins(self, name: str, reads: tuple[torch.Tensor, ...], writes: tuple[torch.Tensor, ...]) -> None:
        """A Triton launch (:func:`~torch_contrastive.engine.triton_backend._host.announced`): one
        launch, the logit bytes of the tensors it declares; nothing it does inside is counted."""
        if self.inside == 0:
            self.launches += 1
            self.ops[f"triton:{name}"] += 1
            self.logit_bytes += sum(self._bytes(t) for t in (*reads, *writes))
        self.inside += 1

    def launch_ends(self) -> None:
        self.inside -= 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.inside:
            return out
        name = func.overloadpacket.__name__
        if products.WIDENING[0]:  # a CPU-only copy: remember what it stands for
            for t in _tensors(out):
                self.widened[id(t)] = _tensors(args)[0].dtype
            return out
        if func.is_view or name in _FREE or name in SYNC_OPERATORS:
            return out
        self.launches += 1
        self.ops[name] += 1
        given = {k: v for k, v in kwargs.items() if k != "out"}  # an out= tensor is written, not read
        inputs, outputs = _tensors((args, given)), _tensors(out)
        if name in _INDEXED:
            self.logit_bytes += self._indexed_bytes(inputs)
        else:
            self.logit_bytes += sum(self._bytes(t) for t in inputs) + sum(self._bytes(t) for t in outputs)
        if name in _GEMMS:  # after the bytes: a widened operand is counted at its own width, then forgotten
            self._gemm(_tensors(args))
        return out

    def _width(self, t: torch.Tensor) -> int:
        own = self.widened.get(id(t))
        return (own if own is not None else t.dtype).itemsize

    def _logit_sized(self, t: torch.Tensor) -> bool:
        # a feature tensor has D along one side, as it is or transposed -- or 2D, 3D: features stacked along
        # the products' inner side (a split fp32 operand, engine/one_tile_half.py); a vector is a tile only
        # when it is one flattened (a per-row statistic of both directions has 2 max(R, C) numbers)
        if t.ndim < 1 or any(side in self.features for side in t.shape):
            return False
        base = t._base  # a view of a feature tensor (rows flattened for one dot product) is features
        if base is not None and any(side in self.features for side in base.shape):
            return False
        edge = 2 * max(self.rows, self.cols)
        return t.numel() >= edge if t.ndim >= 2 else t.numel() > max(edge, self.rows * self.cols // 64)

    def _bytes(self, t: torch.Tensor) -> int:
        """What reading or writing ``t`` moves: its numbers at their own width, no more than its
        storage holds (an expanded tensor is read from its one stored value)."""
        if not self._logit_sized(t):
            return 0
        width = self._width(t)
        return min(t.numel(), t.untyped_storage().nbytes() // t.itemsize) * width

    def _indexed_bytes(self, inputs: list[torch.Tensor]) -> int:
        """An indexed op on a logit-sized tensor reads (and, in place, writes) the indexed entries only."""
        big = [t for t in inputs if self._logit_sized(t)]
        if not big:
            return 0
        touched = max((t.numel() for t in inputs if not self._logit_sized(t)), default=0)
        return 2 * touched * self._width(big[0])  # read and written (or gathered and stored)

    def _gemm(self, args: list[torch.Tensor]) -> None:
        mats = [t for t in args if t.ndim >= 2]
        a, b = mats[-2], mats[-1]  # (bias,) a, b
        batch = math.prod(a.shape[:-2]) if a.ndim > 2 else 1
        if a.ndim > 2 and 1 in (a.shape[-2], a.shape[-1], b.shape[-1]):  # a batch of row dot products (or their
            return  # gradients, outer products of a row and a number): an O(N D) pass, no GEMM work
        own = self.widened.get(id(a), a.dtype)
        for t in (a, b):  # a widened copy is used once: its id may name another tensor later
            self.widened.pop(id(t), None)
        self.flops[str(own).replace("torch.", "")] += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


class _Bytecodes:
    """Counts the Python bytecodes a call runs (``sys.settrace`` with opcode events), outside Triton launches."""

    def __init__(self) -> None:
        self.count = 0
        self.inside = 0

    def launch_begins(self, name: str, reads: tuple[torch.Tensor, ...], writes: tuple[torch.Tensor, ...]) -> None:
        self.inside += 1
        sys.settrace(None)  # the launch's own frames go untraced (in Triton's interpreter: a great many)

    def launch_ends(self) -> None:
        self.inside -= 1
        if self.inside == 0:
            sys.settrace(self.trace)

    def trace(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes, frame.f_trace_lines = True, False
        elif event == "opcode" and not self.inside:
            self.count += 1
        return self.trace


def bytecodes(fn: Callable[[], torch.Tensor]) -> int:
    """The Python bytecodes of one ``fn().backward()`` (backward on this thread: a GPU's autograd runs its
    Python on a worker thread, which ``sys.settrace`` would not see)."""
    tracer = _Bytecodes()
    listeners = _launch_listeners()
    listeners.append(tracer)
    previous = sys.gettrace()
    try:
        with torch.autograd.set_multithreading_enabled(False):
            sys.settrace(tracer.trace)
            try:
                fn().backward()
            finally:
                sys.settrace(previous)
    finally:
        listeners.remove(tracer)
    return tracer.count


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def count(fn: Callable[[], torch.Tensor], rows: int, cols: int, dim: int, *, simulate_device: str | None = "cuda",
          budget: int | None = None, area: float = 1.0) -> Counts:
    """Run ``fn().backward()`` twice and count the second call: a training loop's steady step (see
    the module docstring).

    Args:
        fn: builds the loss (its inputs require grad).
        rows: ``R`` of the call's logit matrix.
        cols: ``C``.
        dim: the feature size ``D`` (tensors ``(·, D)`` are features, not logits).
        simulate_device: plan as on this device type (``"cuda"``: the GPU's plan, run here);
            None: this machine's own plan.
        budget: the simulated GPU's scratch budget in bytes (default: the engine's).
        area: the call stands for one with this many times its logits (see
            :func:`~torch_contrastive.engine.planner.simulate`).
    """
    counter = _Count(rows, cols, dim)

    def run() -> None:
        listeners = _launch_listeners()
        listeners.append(counter)
        try:
            with counter:
                fn().backward()
        finally:
            listeners.remove(counter)

    with simulate(simulate_device, budget, area) if simulate_device is not None else contextlib.nullcontext():
        fn().backward()  # once uncounted: what a training loop builds on its first step is cached by its second
        syncs = host_sync_events(run)
        python = bytecodes(fn)  # a run of its own: the dispatch mode's Python is the counter's, not the call's
    return Counts(rows, cols, counter.launches, counter.logit_bytes, dict(counter.flops), len(syncs), dict(counter.ops),
                  python)


def _launch_listeners() -> list[Any]:
    from ..engine.triton_backend import _host  # imports triton when installed (not needed otherwise)

    return _host.LAUNCH_LISTENERS


# ------------------------------------------------------------------------ the losses, counted
def count_device() -> torch.device:
    """Where :func:`cases` puts its tensors: a GPU's own plan where there is one (its kernels compiled,
    nothing simulated but the tile budget), else this CPU running the GPU's plan (the kernels in
    Triton's interpreter, which a process chooses once, before its kernels are defined)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cases(n: int, d: int, dtype: torch.dtype = torch.bfloat16, chunk: int | None = None,
          seed: int = 0, backend: str = "auto") -> dict[str, tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]]:
    """name -> (our call, the dense formula it replaces), fwd+bwd ready, at ``n`` rows of ``d``
    features (``chunk``: our tile edge, to count a large problem's tile structure at a small size;
    ``backend``: ours on this backend -- the default call's ``"auto"``, or ``"epilogue"``)."""
    import torch_contrastive as tc

    from .bench import dense_clip, dense_nt_xent
    from .bench_small import CLASSES, plain_nt_bxent, plain_nt_xent_pml, plain_supcon

    g = torch.Generator().manual_seed(seed)
    device = count_device()
    x = torch.randn(n, d, generator=g).to(device, dtype).requires_grad_()
    y = torch.randn(n, d, generator=g).to(device, dtype).requires_grad_()
    labels = torch.randint(0, CLASSES, (n,), generator=g).to(device)
    opts: dict[str, Any] = {"validate": False, "chunk_size": chunk, "backend": backend}
    return {
        "clip": (lambda: tc.image_text_contrastive_loss(x, y, 0.07, **opts), lambda: dense_clip(x, y, 0.07)),
        "nt_xent": (lambda: tc.nt_xent_loss(x, 0.1, pairing="halves", **opts), lambda: dense_nt_xent(x, 0.1)),
        "supcon": (lambda: tc.supcon_loss(x, labels, temperature=0.1, **opts), lambda: plain_supcon(x, labels, 0.1)),
        "nt_xent_pml": (lambda: tc.nt_xent_loss(x, 0.1, labels=labels, **opts), lambda: plain_nt_xent_pml(x, labels, 0.1)),
        "nt_bxent": (lambda: tc.nt_bxent_loss(x, labels=labels, temperature=0.1, **opts), lambda: plain_nt_bxent(x, labels, 0.1)),
    }


#: What :func:`count_loss` counts: our default call (``"ours"``: the backend ``"auto"`` picks), our
#: torch tile loops, the cuBLAS + epilogue path, the fused Triton kernels, the dense formula.
IMPLS = ("ours", "torch", "epilogue", "triton", "dense")
#: The losses the epilogue path runs (every loss :func:`cases` builds).
EPILOGUE_LOSSES = LOSSES


def count_loss(name: str, impl: str, n: int, d: int, *, at: int | None = None, tiles: int | None = None) -> Counts:
    """The counts of one loss (``impl`` one of :data:`IMPLS`) on the simulated GPU at ``n`` rows,
    counted at ``at`` rows (default ``n``) and scaled. ``tiles`` None: the tiles of the backend's plan at
    ``n`` on the GPU's budget (the planner shapes a problem counted small at the size it stands for:
    square tiles, or the epilogue's row strips, as many per side); an int: that many square tiles per side
    at the counted size. ``at`` moves two rows up while a tile edge would be a feature side
    (:data:`FEATURE_SIDES`)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    small = at or n
    per_side = tiles if tiles is not None else 1 if impl == "dense" else \
        gpu_tiles(n, default_backend(name, n, d) if impl == "ours" else impl, name)
    small = counted_rows(small, n, d, per_side)
    chunk = None if tiles is None or tiles <= 1 else -(-small // tiles)
    ours, dense = cases(small, d, chunk=chunk, backend="auto" if impl in ("ours", "dense") else impl)[name]
    return count(dense if impl == "dense" else ours, small, small, d, area=(n / small) ** 2).scaled(n, n)


#: The distributed shape of issue 34: 1,024 local rows of CLIP against 32,768 gathered columns (32 ranks).
GATHERED = (1024, 32)
#: The distributed shapes ``bench --traffic`` counts: issue 34's, and issue 35's larger one (4,096 x 65,536).
GATHERED_SHAPES = (GATHERED, (4096, 16))


def dense_clip_gathered(img: torch.Tensor, txt: torch.Tensor, tau: float) -> torch.Tensor:
    """open_clip's gathered CLIP (``local_loss=True, gather_with_grad=True``): every rank's features gathered
    with their gradients (``torch.distributed.nn.all_gather``), this rank's rows against every rank's, both
    directions, the dense formula per direction."""
    from torch.distributed.nn import all_gather

    img, txt = torch.nn.functional.normalize(img, dim=1), torch.nn.functional.normalize(txt, dim=1)
    world = torch.distributed.group.WORLD  # (the function's default is the group of when it was imported)
    every_img, every_txt = torch.cat(all_gather(img, group=world)), torch.cat(all_gather(txt, group=world))
    target = torch.arange(img.shape[0], device=img.device) + img.shape[0] * torch.distributed.get_rank()
    f = torch.nn.functional.cross_entropy
    return (f(img @ every_txt.T / tau, target) + f(txt @ every_img.T / tau, target)) / 2


def counted_rows(small: int, n: int, d: int, per_side: int = 1) -> int:
    """The rows a call of ``n`` rows is counted at, from ``small`` up by twos (pairings stay even): until no tile edge is
    a feature side (``D``, ``2D``, ``3D`` would read as features) and a label relation takes the real call's form."""
    while any(edge in feature_sides(d) for edge in (small, -(-small // per_side))) or not same_relation_form(small, n):
        small += 2
    return small


def same_relation_form(counted: int, rows: int, world: int = 1) -> bool:
    """Whether a label relation of ``counted`` rows (against ``world`` times as many columns) takes the form the real
    one of ``rows`` takes: both dense masks or both grouped by key (:data:`~torch_contrastive.positives.DENSE_KEYS_LIMIT`
    decides by the relation's own size, and the two forms issue different operations)."""
    return (counted * counted * world <= DENSE_KEYS_LIMIT) == (rows * rows * world <= DENSE_KEYS_LIMIT)


def count_gathered(impl: str, local: int, world: int, d: int, at: int = 66) -> Counts:
    """CLIP under ``gather=True`` on one rank of ``world`` (``impl`` ``"ours"``, the default call, or ``"dense"``,
    :func:`dense_clip_gathered`) on the simulated GPU at ``local`` rows per rank, counted at ``at`` rows per
    rank and scaled. The ranks are a fake process group (``torch.testing``'s: its collectives move nothing, the
    Python around them is a real group's): each collective counts as one launch, and the time it moves data
    over the network is not in the model. ``at`` moves two rows up while a side would read as features."""
    if impl not in ("ours", "dense"):
        raise ValueError(f"impl must be 'ours' or 'dense', got {impl!r}")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import torch_contrastive as tc

    while any(edge in feature_sides(d) for edge in (at, at * world)) or not same_relation_form(at, local, world):
        at += 2
    if dist.is_initialized():
        raise RuntimeError("count_gathered makes its own process group: none may be running")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        g = torch.Generator().manual_seed(0)
        x, y = (torch.randn(at, d, generator=g).to(count_device(), torch.bfloat16).requires_grad_() for _ in range(2))
        fn = (lambda: tc.image_text_contrastive_loss(x, y, 0.07, gather=True, validate=False)) if impl == "ours" else \
            (lambda: dense_clip_gathered(x, y, 0.07))
        with warnings.catch_warnings():  # open_clip's gather, which torch 2.13 deprecates: its formula as it is
            warnings.filterwarnings("ignore", "torch.distributed.nn.functional.all_gather", FutureWarning)
            return count(fn, at, at * world, d, area=(local / at) ** 2).scaled(local, local * world)
    finally:
        dist.destroy_process_group()


def gpu_tiles(n: int, impl: str = "torch", name: str = "clip") -> int:
    """Tiles along the rows of a backend's plan for one bf16 loss of :func:`cases` (``name``) at ``n`` rows on a
    GPU, as the planner decides it: square tiles per side, or the epilogue's row strips (``impl``: ``"torch"``
    or ``"epilogue"``, whose tiles hold fewer bytes per logit; the fused kernels tile themselves: 1)."""
    from ..engine.planner import decide

    if impl not in ("torch", "epilogue"):
        return 1
    bf16, traits = torch.bfloat16, _traits(name, 0)
    tile = decide(kernel="pairwise" if traits.pairs else "softmax", rows=n, cols=n, device=torch.device("cuda"), dtype=bf16,
                  other_dtype=bf16, chunk_size=None, backend=impl, serves=lambda name: None, traits=traits).tile
    return 1 if tile == 0 else -(-n // tile)


@contextlib.contextmanager
def _as_measured() -> Any:
    """Count the measured rows (2026-11-23/24) as that code ran them where a later change is a switch: square
    tiles (``_square_tiles``; row strips came later) and a kernel backend's one tile rebuilding its unit rows in
    backward (``driver.ONE_TILE_KEEPS_ROWS`` off)."""
    from ..engine import driver

    previous = driver.ONE_TILE_KEEPS_ROWS
    driver.ONE_TILE_KEEPS_ROWS = False
    try:
        yield
    finally:
        driver.ONE_TILE_KEEPS_ROWS = previous


def _square_tiles(n: int, impl: str) -> int:
    """Square tiles per side of a bf16 ``n x n`` problem on a backend's GPU budget (the plans of the measured rows)."""
    from ..engine.planner import bytes_per_logit, resolve_tile

    bf16 = torch.bfloat16
    tile = resolve_tile(None, n, n, "cuda", bytes_per_logit(impl, bf16, bf16, impl == "torch"))
    return -(-n // tile)


def calibration(at: int = 256) -> tuple[Gpu, float, list[tuple[Measured, Counts]]]:
    """The H100 constants fitted to :data:`~torch_contrastive.cli.cost.MEASURED` -- the host's on the
    host-bound rows (up to :data:`~torch_contrastive.cli.cost.HOST_ROWS`), the device's on the
    device-bound ones (from :data:`~torch_contrastive.cli.cost.DEVICE_ROWS`) -- the RMS relative
    error of the whole model over every counted row, and each row's counts (counted at ``at`` rows with
    the row's tile structure, scaled to its size; the epilogue's rows where its kernels can run)."""
    impls = ("torch", "dense", "epilogue") if epilogue_countable() else ("torch", "dense")
    counted = []
    with _as_measured():
        for row in MEASURED:
            if row.impl not in impls:  # the fused kernels' own GEMMs are not counted: fit_fused prices them
                continue
            tiles = 1 if row.impl == "dense" else _square_tiles(row.n, row.impl)
            counted.append((row, count_loss(row.loss, row.impl, row.n, row.d, at=min(at, row.n), tiles=tiles)))
    host_rows = [(c, row.ms / 1e3, row.impl != "dense") for row, c in counted if row.n <= HOST_ROWS]
    fitted, _ = fit_host(host_rows, GPUS["H100"])
    fitted, _ = fit([(c, row.ms / 1e3) for row, c in counted if row.n >= DEVICE_ROWS], fitted, PEAK_BANDWIDTH["H100"])
    fitted = replace(fitted, source=f"fitted to {len(counted)} measured rows")
    rms = (sum((predict(c, fitted) / (row.ms / 1e3) - 1.0) ** 2 for row, c in counted) / len(counted)) ** 0.5
    return fitted, rms, counted


def _traits(name: str, dim: int) -> Traits:
    pairs = {"nt_xent_pml": "pair_softplus", "nt_bxent": "binary"}.get(name)
    return Traits(dim, columns=name == "clip", symmetric=name in ("nt_xent", "supcon"), pairs=pairs)


def proposed(name: str, n: int, dim: int) -> str:
    """The backend the cost model prices fastest for one bf16 loss of :func:`cases` at ``n`` rows: a proposal
    for a GPU run to measure, not what the default call runs (:func:`default_backend`)."""
    predicted = predictions(n, n, torch.bfloat16, torch.bfloat16, None, _traits(name, dim))
    return min((t, b) for b, t in predicted)[1] if predicted else "torch"


def default_backend(name: str, n: int, dim: int) -> str:
    """The backend our default call runs on a GPU for one bf16 loss of :func:`cases` (the epilogue serving it):
    the CUDA policy's first rule that takes the call (``engine/policy.py``)."""
    kernel = "pairwise" if name in ("nt_xent_pml", "nt_bxent") else "softmax"
    return policy.choose("cuda", kernel, n, torch.bfloat16, torch.bfloat16, lambda name: None)[0]


def fused_calibration() -> tuple[Fused, float]:
    """The fused kernels' constants fitted to the ``"triton"`` rows of
    :data:`~torch_contrastive.cli.cost.MEASURED` (their GEMM-equivalents from :data:`~torch_contrastive.cli.cost.PATHS`)."""
    rows = []
    for m in MEASURED:
        if m.impl == "triton":
            path = PATHS[("columns" if m.loss == "clip" else "rows", "triton", "half")]
            rows.append((path.gemms_strips * 2.0 * m.n * m.n * m.d, m.ms / 1e3))
    return fit_fused(rows)


def host_ratio(reps: int = 200, rounds: int = 5) -> tuple[list[tuple[str, str, int, int, float]], tuple[float, float, float]]:
    """Time every loss of :func:`cases` at 16 rows of 8 features in fp32 on this CPU, ours and the plain
    formula, forward + backward (best of ``rounds`` means of ``reps`` calls), with their launches and
    bytecodes counted on this machine's own plan; fit seconds per op and per bytecode
    (:func:`~torch_contrastive.cli.cost.fit_bytecodes`). Returns the rows ``(loss, impl, launches,
    bytecodes, seconds)`` and the fit ``(op, bytecode, rms)``."""
    rows = []
    for name, (ours, dense) in cases(16, 8, dtype=torch.float32).items():
        for impl, fn in (("ours", ours), ("dense", dense)):
            c = count(fn, 16, 16, 8, simulate_device=None)
            for _ in range(max(1, reps // 10)):
                fn().backward()
            best = math.inf
            for _ in range(rounds):
                start = time.perf_counter()
                for _ in range(reps):
                    fn().backward()
                best = min(best, (time.perf_counter() - start) / reps)
            rows.append((name, impl, c.launches, c.bytecodes, best))
    return rows, fit_bytecodes([(n, b, t) for _, _, n, b, t in rows])


def run_host(reps: int = 200) -> int:
    """``torch-contrastive bench --traffic --host``: the host's cost of a Python bytecode against an eager op's."""
    rows, (op, bytecode, rms) = host_ratio(reps)
    print("torch-contrastive bench --traffic --host: small fp32 calls timed on this CPU (16 rows, 8 features, fwd+bwd)")
    print(f"{'loss':<12} {'impl':<6} {'launches':>8} {'bytecodes':>9} {'measured us':>11} {'fit us':>7}")
    for name, impl, n, b, t in rows:
        print(f"{name:<12} {impl:<6} {n:>8} {b:>9} {t * 1e6:>11.1f} {(n * op + b * bytecode) * 1e6:>7.1f}")
    print(f"per eager op {op * 1e6:.2f} us, per bytecode {bytecode * 1e9:.1f} ns: {op / bytecode:.0f} bytecodes per op "
          f"(cost.BYTECODES_PER_OP: {BYTECODES_PER_OP:.0f}); RMS relative error {100 * rms:.0f} %")
    return 0


# ------------------------------------------------------------------------------------ the CLI
def epilogue_countable() -> bool:
    """Whether the epilogue path can be counted here: triton installed, and a GPU, or the kernels run
    by the interpreter on the CPU tensors a count uses (switched on here when triton is not yet
    imported: the interpreter is chosen when the kernels are defined)."""
    if importlib.util.find_spec("triton") is None:
        return False
    if count_device().type == "cuda":  # counted on the GPU itself, the kernels compiled
        return True
    if os.environ.get("TRITON_INTERPRET") != "1" and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"  # this process only counts: nothing runs on a GPU
    return os.environ.get("TRITON_INTERPRET") == "1"


def _constants(g: Gpu) -> str:
    return (f"bandwidth {g.bandwidth / 1e12:.2f} TB/s, device per-op {g.launch * 1e6:.1f} us, host per eager op "
            f"{g.host_op * 1e6:.1f} us, per Triton launch {g.host_kernel * 1e6:.0f} us, per Python bytecode "
            f"{g.host_bytecode * 1e9:.0f} ns")


def _gathered_rows(dim: int, gpu: Gpu) -> list[dict[str, Any]]:
    """The distributed shapes' rows of ``bench --traffic`` (:data:`GATHERED_SHAPES`, :func:`count_gathered`), printed."""
    rows = []
    for local, world in GATHERED_SHAPES:
        for impl in ("ours", "dense"):
            c = count_gathered(impl, local, world, dim)
            label = "torch" if impl == "ours" else impl
            row = {"loss": f"clip_gathered_{world}", "n": local, "d": dim, "impl": label, "tiles": 1,
                   "launches": c.launches, "passes": round(c.passes, 2), "gflop": round(sum(c.gemm_flops.values()) / 1e9, 2),
                   "syncs": c.syncs, "bytecodes": c.bytecodes, "predicted_ms": round(predict(c, gpu) * 1e3, 4),
                   "default": impl == "ours"}
            rows.append(row)
            print(f"{'clip x' + str(world):<12} {local:>6} {label + ('*' if impl == 'ours' else ''):<9} {1:>4} "
                  f"{c.launches:>8} {c.passes:>7.1f} {row['gflop']:>8.1f} {c.syncs:>5} {c.bytecodes:>9} "
                  f"{row['predicted_ms']:>13.3f}   ({local:,} rows per rank against {local * world:,} gathered)", flush=True)
    return rows


def run_traffic(sizes: list[int] | None, dim: int, calibrate: bool, out_dir: Any, machine: str) -> int:
    """``torch-contrastive bench --traffic``: every loss's counts on the simulated GPU plan beside
    the dense formula's, with the model's predicted H100 time; ``--calibrate`` adds the fit."""
    import csv

    gpu = GPUS["H100"]
    sizes = sizes or [1024]
    print(f"torch-contrastive bench --traffic: D = {dim}, bf16, fwd+bwd, the CUDA plan counted on {machine}")
    print("passes = logit bytes / (4 R C); predicted = the model's H100 time (a prediction, not a measurement); "
          "* = the backend the default call (backend='auto') runs on a GPU, by the CUDA policy; "
          "the model's proposal (its fastest) after each loss")
    print(f"{'loss':<12} {'N':>6} {'impl':<9} {'tiles':>4} {'launches':>8} {'passes':>7} {'GFLOP':>8} {'syncs':>5} "
          f"{'bytecodes':>9} {'predicted ms':>13}")
    rows = []
    impls = ("torch", "epilogue", "dense") if epilogue_countable() else ("torch", "dense")
    if "epilogue" not in impls:
        print("(the epilogue path is not counted: it needs triton, run in its interpreter -- TRITON_INTERPRET=1)")
    for n in sizes:
        at = min(n, 1024)
        for name in LOSSES:
            picks = default_backend(name, n, dim)
            for impl in impls:
                if impl == "epilogue" and name not in EPILOGUE_LOSSES:
                    continue
                tiles = 1 if impl == "dense" else gpu_tiles(n, impl, name)
                c = count_loss(name, impl, n, dim, at=at)
                row = {"loss": name, "n": n, "d": dim, "impl": impl, "tiles": tiles,
                       "launches": c.launches, "passes": round(c.passes, 2), "gflop": round(sum(c.gemm_flops.values()) / 1e9, 2),
                       "syncs": c.syncs, "bytecodes": c.bytecodes, "predicted_ms": round(predict(c, gpu) * 1e3, 4),
                       "default": impl == picks}
                rows.append(row)
                print(f"{name:<12} {n:>6} {impl + ('*' if impl == picks else ''):<9} {row['tiles']:>4} {c.launches:>8} "
                      f"{c.passes:>7.1f} {row['gflop']:>8.1f} {c.syncs:>5} {c.bytecodes:>9} {row['predicted_ms']:>13.3f}", flush=True)
            print(f"{name:<12} {n:>6} (the model proposes: {proposed(name, n, dim)}; a prediction, to be measured)")
    rows.extend(_gathered_rows(dim, gpu))
    with open(out_dir / "traffic.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out_dir / 'traffic.csv'}")
    if calibrate:
        fused, fused_rms = fused_calibration()
        print(f"\nthe fused Triton kernels fitted to the measured rows: {fused.rate / 1e12:.1f} TFLOP/s and "
              f"{fused.overhead * 1e3:.2f} ms per call, RMS relative error {100 * fused_rms:.1f} %")
        fitted, rms, counted = calibration()
        print(f"\nfit to the measured H100 rows: {_constants(fitted)}; RMS relative error {100 * rms:.0f} %\n"
              f"(the table in cli/cost.py: {_constants(gpu)})")
        print(f"{'loss':<10} {'impl':<9} {'N':>6} {'D':>4} {'measured ms':>12} {'predicted ms':>13} {'error':>7}  bound")
        for measured, c in counted:
            p = predict(c, gpu) * 1e3
            bound = "host" if measured.n <= HOST_ROWS else "device" if measured.n >= DEVICE_ROWS else "(not fitted)"
            print(f"{measured.loss:<10} {measured.impl:<9} {measured.n:>6} {measured.d:>4} {measured.ms:>12.2f} {p:>13.2f} "
                  f"{100 * (p / measured.ms - 1):>+6.0f}%  {bound}")
    return 0
