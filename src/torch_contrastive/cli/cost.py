"""GPU time as a sum of what a CPU can count: GEMM FLOPs, logit-sized memory traffic, launches.

Between the GEMMs a contrastive loss is memory-bound: every pass over the logit matrix (an
``exp``, a sum, a mask, the gradient tile) reads or writes ``rows * cols`` numbers, and each op
pays a launch. The model prices a call's counts (:class:`Counts`, measured on any machine by
:func:`torch_contrastive.cli.traffic.count`) on a named GPU:

    ``device = sum over GEMMs of FLOPs / rate(dtype) + logit bytes / bandwidth + launches * launch``

A call is also work for the CPU that drives the GPU: each eager op costs it dispatch and autograd
time, each Triton launch more (argument binding, the autotuner's lookup), and every Python bytecode
the call runs -- ours (arguments checked, the problem built, the plan looked up) and autograd's own,
which a plain formula pays too -- is counted as well (:attr:`Counts.bytecodes`). The GPU runs behind the
host, so a call takes whichever is longer:

    ``host = eager ops * host_op + bytecodes * host_bytecode + Triton launches * host_kernel``;
    ``time = max(device, host)``

``host_bytecode`` is ``host_op / BYTECODES_PER_OP``: the ratio of a bytecode's time to an eager op's host
time is a property of CPython against ATen's dispatch on one CPU, measured where no GPU is
(``torch-contrastive bench --traffic --host``), and the scale is fitted to the GPU host's measured rows.

Small calls are host-bound (on the H100 measured, every call up to about 8,192 rows: the eager dense
formula too), large ones device-bound. The constants of each GPU live in one table, :data:`GPUS`: a session on a GPU re-measures them
and changes numbers, not code (docs/gpu.md, "Counting GPU time on a CPU", says how well they fit
the measured rows). Every figure the model gives is a prediction, and is labelled as one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ..engine.planner import Traits, resolve_tile, strip_rows

__all__ = [
    "BYTECODES_PER_OP",
    "FUSED",
    "GPUS",
    "MEASURED",
    "PATHS",
    "PEAK_BANDWIDTH",
    "WIDE",
    "Counts",
    "Fused",
    "Gpu",
    "Measured",
    "PathCost",
    "fit",
    "fit_bytecodes",
    "fit_fused",
    "fit_host",
    "host_time",
    "kernels",
    "path_terms",
    "predict",
    "predict_path",
    "predictions",
    "terms",
]


@dataclass(frozen=True)
class Gpu:
    """One GPU's constants.

    Attributes:
        name: as reported by the device (``torch.cuda.get_device_name``), shortened.
        gemm_flops: sustained GEMM FLOP/s by operand dtype name (``"bfloat16"``, ``"float16"``,
            ``"float32"``): cuBLAS at large square shapes.
        bandwidth: sustained bytes/s of an elementwise pass over a large tensor.
        launch: device seconds per op between GEMMs (the tail of a small kernel, and what the
            byte count misses: a reduction that reads its input twice).
        source: where the numbers come from (a measurement, or the fit to measured rows).
        host_op: host seconds per eager op (dispatch and autograd) on the CPU that drove the GPU
            measured -- a property of that machine's CPU as much as of the GPU.
        host_kernel: host seconds per Triton launch.
        host_bytecode: host seconds per Python bytecode a call runs (``host_op / BYTECODES_PER_OP``).
    """

    name: str
    gemm_flops: dict[str, float]
    bandwidth: float
    launch: float
    source: str
    host_op: float = 0.0
    host_kernel: float = 0.0
    host_bytecode: float = 0.0


#: Python bytecodes that take a CPU as long as one eager op's host time (dispatch and autograd of a small op):
#: ``torch-contrastive bench --traffic --host`` fits ``t = ops * op + bytecodes * bytecode`` to the small calls of
#: every loss, ours and the plain formula's, timed on one CPU. Measured 2026-11-28 on this project's CPU (x86_64
#: AMD EPYC, 2 cores, torch 2.13.0+cpu, Python 3.11.7): 4.8 us per op, 27.8 ns per bytecode, RMS error 6 %.
BYTECODES_PER_OP = 173.0

#: The GPUs the model knows. H100 (SXM, 80 GB): bf16 GEMM 645 TFLOP/s as cuBLAS measured
#: (docs/gpu.md, 2026-11-23); fp32 without TF32 at the data sheet's non-tensor rate; bandwidth
#: and the device per-op cost fitted to the device-bound rows of :data:`MEASURED` by :func:`fit`, the
#: host constants to its host-bound rows by :func:`fit_host` (``torch-contrastive bench --traffic
#: --calibrate`` prints the fit and each row's error; docs/gpu.md has the table).
GPUS: dict[str, Gpu] = {
    "H100": Gpu(
        name="H100",
        gemm_flops={"bfloat16": 645e12, "float16": 645e12, "float32": 51e12},
        bandwidth=2.29e12,
        launch=15.2e-6,
        source="bf16 GEMM rate measured 2026-11-23; the rest fitted 2026-11-28 to the 27 counted rows of docs/gpu.md "
               "with that day's counts (RMS relative error 25 %: the torch loops' host-bound rows were measured on older code); the "
               "host constants are those of the machine's CPU that drove the H100 measured",
        host_op=35.9e-6,
        host_kernel=272e-6,
        host_bytecode=207e-9,
    ),
}


#: Data-sheet memory bandwidth (bytes/s): the ceiling of a fitted bandwidth.
PEAK_BANDWIDTH = {"H100": 3.35e12}


@dataclass(frozen=True)
class Measured:
    """One measured row the constants are fitted to: forward + backward of ``loss`` at ``n x n`` bf16
    logits of ``d`` features, ``impl`` ``"torch"`` (our torch tile loops), ``"triton"`` (our fused
    kernels) or ``"dense"`` (the eager formula it replaces), on ``gpu``."""

    gpu: str
    loss: str
    impl: str
    n: int
    d: int
    ms: float
    source: str


#: The measured rows (docs/gpu.md, bf16, fwd+bwd, one H100 80GB HBM3). 2026-11-23: ``torch-contrastive bench
#: --gpu`` at that day's commit (the fit compares today's counts with it). 2026-11-24 (torch 2.11.0+cu130,
#: triton 3.6.0): ``tools/gpu_profile.py`` (device time of 20 calls queued back to back) at 1,024-8,192
#: rows and ``bench --gpu`` (best of 5) from 16,384. ``impl`` ``"triton"``: the fused Triton kernels,
#: which :func:`fit_fused` prices. Rows up to :data:`HOST_ROWS` fit the host constants, rows from
#: :data:`DEVICE_ROWS` the device's; those between are predicted, not fitted.
MEASURED: tuple[Measured, ...] = (
    Measured("H100", "clip", "dense", 8192, 512, 2.96, "docs/gpu.md 2026-11-23"),
    Measured("H100", "clip", "torch", 8192, 512, 4.03, "docs/gpu.md 2026-11-23"),
    Measured("H100", "clip", "dense", 65536, 768, 157.0, "docs/gpu.md 2026-11-23"),
    Measured("H100", "clip", "torch", 65536, 768, 226.0, "docs/gpu.md 2026-11-23"),
    Measured("H100", "nt_xent", "dense", 65536, 768, 91.1, "docs/gpu.md 2026-11-23"),
    Measured("H100", "nt_xent", "torch", 65536, 768, 123.0, "docs/gpu.md 2026-11-23"),
    Measured("H100", "clip", "triton", 8192, 512, 4.09, "docs/gpu.md 2026-11-23"),
    Measured("H100", "clip", "triton", 65536, 768, 186.0, "docs/gpu.md 2026-11-23"),
    Measured("H100", "nt_xent", "triton", 65536, 768, 94.6, "docs/gpu.md 2026-11-23"),
    Measured("H100", "clip", "dense", 1024, 512, 1.872, "gpu_profile 2026-11-24"),
    Measured("H100", "clip", "torch", 1024, 512, 3.626, "gpu_profile 2026-11-24"),
    Measured("H100", "clip", "epilogue", 1024, 512, 6.186, "gpu_profile 2026-11-24"),
    Measured("H100", "clip", "dense", 4096, 512, 2.525, "gpu_profile 2026-11-24"),
    Measured("H100", "clip", "torch", 4096, 512, 3.821, "gpu_profile 2026-11-24"),
    Measured("H100", "clip", "epilogue", 4096, 512, 5.004, "gpu_profile 2026-11-24"),
    Measured("H100", "nt_xent", "dense", 4096, 512, 1.415, "gpu_profile 2026-11-24"),
    Measured("H100", "nt_xent", "torch", 4096, 512, 3.119, "gpu_profile 2026-11-24"),
    Measured("H100", "nt_xent", "epilogue", 4096, 512, 4.074, "gpu_profile 2026-11-24"),
    Measured("H100", "clip", "dense", 8192, 512, 2.724, "gpu_profile 2026-11-24"),
    Measured("H100", "clip", "torch", 8192, 512, 5.246, "gpu_profile 2026-11-24"),
    Measured("H100", "clip", "epilogue", 8192, 512, 4.873, "gpu_profile 2026-11-24"),
    Measured("H100", "nt_xent", "dense", 8192, 512, 1.524, "gpu_profile 2026-11-24"),
    Measured("H100", "nt_xent", "torch", 8192, 512, 3.651, "gpu_profile 2026-11-24"),
    Measured("H100", "nt_xent", "epilogue", 8192, 512, 3.152, "gpu_profile 2026-11-24"),
    Measured("H100", "clip", "dense", 16384, 768, 10.1, "bench --gpu 2026-11-24"),
    Measured("H100", "clip", "epilogue", 16384, 768, 7.6, "bench --gpu 2026-11-24"),
    Measured("H100", "clip", "dense", 32768, 768, 38.2, "bench --gpu 2026-11-24"),
    Measured("H100", "clip", "epilogue", 32768, 768, 21.8, "bench --gpu 2026-11-24"),
    Measured("H100", "clip", "dense", 65536, 768, 156.0, "bench --gpu 2026-11-24"),
    Measured("H100", "clip", "epilogue", 65536, 768, 77.3, "bench --gpu 2026-11-24"),
)

#: Measured rows up to this many rows are host-bound (their device work is a small part of the time).
HOST_ROWS = 4096
#: Measured rows from this many rows are device-bound.
DEVICE_ROWS = 16384


@dataclass(frozen=True)
class PathCost:
    """What one backend's call costs besides its GEMMs, counted on the GPU plan for one kind of problem
    (``tests/cli/test_traffic.py`` re-counts every entry of :data:`PATHS`, so a change to a path shows; its
    failure message prints the re-counted entry).

    Attributes:
        launches: launches when the whole problem is one tile.
        per_tile: launches each further tile adds (tiles visited: every tile of two sets, a single
            set's upper triangle).
        passes_one: fp32 passes over the logits, one tile (kept from forward).
        passes_strips: the same when the problem spans tiles (recomputed in backward).
        gemms_one: GEMM-equivalents (``2 R C D`` FLOPs each), one tile.
        gemms_strips: the same, strips.
        kernels: how many of ``launches`` are Triton launches (the host pays more for them), one tile.
        kernels_per_tile: the Triton launches each further tile adds.
        bytecodes: Python bytecodes of one call, one tile (the host's share besides its launches).
        bytecodes_per_tile: the bytecodes each further tile adds (the tile loop's Python).
    """

    launches: int
    per_tile: float
    passes_one: float
    passes_strips: float
    gemms_one: float
    gemms_strips: float
    kernels: int = 0
    kernels_per_tile: float = 0.0
    bytecodes: int = 0
    bytecodes_per_tile: float = 0.0


#: The counts of each (problem kind, backend, operands): ``"columns"`` two sets with column terms (CLIP),
#: ``"rows"`` row terms (a single set's triangle: NT-Xent; SupCon and InfoNCE cost about the same),
#: the pair terms ``"pair_softplus"`` (PML NT-Xent) and ``"binary"`` (NT-BXent) with labels (every tile visited:
#: the few classes of :func:`~torch_contrastive.cli.traffic.cases` put a positive in every tile);
#: operands ``"half"`` (bf16 on tensor cores), ``"wide"`` (bf16 inputs widened, fp32 products,
#: ``TORCH_CONTRASTIVE_PRODUCTS=compute``: :data:`WIDE`) or ``"fp32"``. Counted 2026-12-02 on the CUDA plan of
#: issue 64's policy (the torch loops' general executors, no factored or split forms) by
#: ``tests/cli/test_traffic.py``'s own count (Python 3.11.7, the epilogue's kernels in Triton's interpreter, whose
#: host-side checks add bytecodes a GPU's compiled launch would not) at 256 rows of 48 features, one tile and
#: 4 x 4 tiles (``bench --traffic`` counts any loss at any size; the fused kernels' own GEMMs are not visible to the
#: counter: their GEMM-equivalents are the kernels' design, 4 with column terms, 2 for a triangle). Earlier counts,
#: of forms since removed, are in git's history of this table.
PATHS: dict[tuple[str, str, str], PathCost] = {
    ("columns", "torch", "half"): PathCost(54, 24.9, 17.16, 24.14, 3.0, 4.0, 0, 0.0, 4898, 1132),
    ("columns", "torch", "wide"): PathCost(44, 16.7, 11.16, 14.14, 3.0, 4.0, 0, 0.0, 1265, 972),
    ("columns", "epilogue", "half"): PathCost(51, 9.2, 5.0, 6.0, 3.0, 4.0, 7, 3.13, 7236, 1179),
    ("columns", "triton", "half"): PathCost(48, 0.0, 0.0, 0.0, 4.0, 4.0, 8, 0.0, 7220, 0),
    ("rows", "torch", "half"): PathCost(39, 24.2, 14.03, 14.25, 2.0, 2.25, 0, 0.0, 4205, 1243),
    ("rows", "torch", "wide"): PathCost(32, 16.7, 9.03, 8.25, 2.0, 2.25, 0, 0.0, 1140, 1219),
    ("rows", "epilogue", "half"): PathCost(31, 8.2, 4.0, 3.5, 2.0, 2.25, 4, 2.78, 6028, 1105),
    ("rows", "triton", "half"): PathCost(36, 0.0, 0.0, 0.0, 2.0, 2.0, 5, 0.0, 6122, 0),
    ("columns", "torch", "fp32"): PathCost(42, 16.7, 11.16, 14.14, 3.0, 4.0, 0, 0.0, 1260, 972),
    ("columns", "epilogue", "fp32"): PathCost(44, 7.1, 6.0, 7.0, 3.0, 4.0, 7, 3.0, 6862, 903),
    ("rows", "torch", "fp32"): PathCost(30, 16.7, 9.03, 8.25, 2.0, 2.25, 0, 0.0, 1135, 1219),
    ("rows", "epilogue", "fp32"): PathCost(27, 6.4, 5.0, 4.12, 2.0, 2.25, 4, 2.67, 5751, 850),
    ("pair_softplus", "torch", "half"): PathCost(50, 62.1, 36.5, 68.5, 2.0, 5.0, 0, 0.0, 4622, 2166),
    ("pair_softplus", "torch", "wide"): PathCost(43, 51.8, 31.5, 54.5, 2.0, 5.0, 0, 0.0, 2014, 1881),
    ("pair_softplus", "epilogue", "half"): PathCost(27, 10.7, 7.5, 10.5, 3.0, 5.0, 4, 3.13, 6132, 1414),
    ("binary", "torch", "half"): PathCost(57, 37.9, 36.5, 47.5, 2.0, 4.0, 0, 0.0, 4623, 1268),
    ("binary", "torch", "wide"): PathCost(50, 29.7, 31.5, 37.5, 2.0, 4.0, 0, 0.0, 2044, 1039),
    ("binary", "epilogue", "half"): PathCost(35, 8.1, 7.5, 8.5, 3.0, 4.0, 4, 2.07, 6164, 1014),
}


@dataclass(frozen=True)
class Fused:
    """The fused Triton kernels on one GPU: their GEMMs (``tl.dot`` inside the kernels) run at ``rate``
    FLOP/s, and a call pays ``overhead`` seconds besides (what the measured rows cannot separate: a
    small problem's grid, the atomics). Fitted by :func:`fit_fused` to the ``"triton"`` rows of
    :data:`MEASURED`."""

    rate: float
    overhead: float
    source: str


#: The fused kernels' constants per GPU (bf16 operands; fp32 is not measured and not offered by ``"auto"``).
FUSED: dict[str, Fused] = {
    "H100": Fused(rate=143.2e12, overhead=2.17e-3,
                  source="fitted 2026-11-24 to the 3 measured Triton rows of docs/gpu.md (RMS relative error 0.2 %)"),
}


@dataclass(frozen=True)
class Counts:
    """What one call costs, counted (see :func:`torch_contrastive.cli.traffic.count`).

    Attributes:
        rows: ``R``, the anchors of the call's logit matrix.
        cols: ``C``, its candidates.
        launches: device ops (views and host reads excluded; a widening that only a CPU does
            excluded).
        logit_bytes: bytes of logit-sized tensors read and written, each op's inputs and outputs
            (indexed ops count the entries they touch).
        gemm_flops: FLOPs of the matrix products, by operand dtype name.
        syncs: host synchronisations.
        ops: how many launches each op name made (for reading a count, not for the model).
        bytecodes: Python bytecodes the call runs on the host (forward and backward, ours and autograd's;
            not inside a Triton launch, which :attr:`Gpu.host_kernel` prices).
    """

    rows: int
    cols: int
    launches: int
    logit_bytes: int
    gemm_flops: dict[str, int]
    syncs: int
    ops: dict[str, int] = field(default_factory=dict, compare=False)
    bytecodes: int = 0

    @property
    def passes(self) -> float:
        """``logit_bytes`` in fp32 passes over the ``R x C`` logit matrix (``4 * R * C`` bytes each)."""
        return self.logit_bytes / (4.0 * self.rows * self.cols)

    def scaled(self, rows: int, cols: int) -> Counts:
        """The counts of the same plan at ``rows x cols`` (bytes and FLOPs grow with ``R * C`` at a
        fixed feature size; launches and syncs do not): a large problem counted at a small size
        with the same tile structure."""
        f = rows * cols / (self.rows * self.cols)
        return Counts(rows, cols, self.launches, round(self.logit_bytes * f),
                      {k: round(v * f) for k, v in self.gemm_flops.items()}, self.syncs, dict(self.ops), self.bytecodes)


def predict(counts: Counts, gpu: Gpu | str = "H100") -> float:
    """The model's time (seconds) of ``counts`` on ``gpu``, the longer of the device's and the host's:
    a prediction, not a measurement."""
    return max(sum(terms(counts, gpu)), host_time(counts, gpu))


def kernels(counts: Counts) -> int:
    """The Triton launches among ``counts.launches``."""
    return sum(n for op, n in counts.ops.items() if op.startswith("triton:"))


def host_time(counts: Counts, gpu: Gpu | str = "H100") -> float:
    """Seconds the host spends issuing ``counts`` (see the module docstring)."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    k = kernels(counts)
    return (counts.launches - k) * g.host_op + counts.bytecodes * g.host_bytecode + k * g.host_kernel


def terms(counts: Counts, gpu: Gpu | str = "H100") -> tuple[float, float, float]:
    """``(GEMM, traffic, launch)`` seconds of the device's time, in that order."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    gemm = sum(flops / g.gemm_flops[dtype] for dtype, flops in counts.gemm_flops.items())
    return gemm, counts.logit_bytes / g.bandwidth, counts.launches * g.launch


def fit(rows: list[tuple[Counts, float]], gpu: Gpu, peak_bandwidth: float) -> tuple[Gpu, float]:
    """``gpu`` with its bandwidth and device launch cost fitted to measured ``(counts, seconds)`` rows of
    device-bound calls: least squares on the relative error of the device time, the bandwidth kept
    physical (at most ``peak_bandwidth``, the memory's data-sheet rate), the launch cost at least
    1 µs; the GEMM rates and the host constants stay. Returns the fitted GPU and the
    root-mean-square relative error of the fit."""
    best: tuple[float, float, float] | None = None
    for step in range(1, 201):  # the bandwidth on a grid; for each, the launch cost in closed form
        bandwidth = peak_bandwidth * step / 200
        num = den = 0.0
        for counts, seconds in rows:
            gemm, _, _ = terms(counts, gpu)
            rest = (seconds - gemm - counts.logit_bytes / bandwidth) / seconds
            weight = counts.launches / seconds
            num, den = num + weight * rest, den + weight * weight
        launch = max(1e-6, num / den if den else gpu.launch)
        trial = Gpu(gpu.name, dict(gpu.gemm_flops), bandwidth, launch, gpu.source)
        rms = (sum((sum(terms(c, trial)) / t - 1.0) ** 2 for c, t in rows) / len(rows)) ** 0.5
        if best is None or rms < best[0]:
            best = (rms, bandwidth, launch)
    if best is None:
        raise ValueError("fit needs at least one measured row")
    rms, bandwidth, launch = best
    return replace(gpu, bandwidth=bandwidth, launch=launch, source=f"fitted to {len(rows)} measured rows"), rms


def fit_host(rows: list[tuple[Counts, float, bool]], gpu: Gpu, bytecodes_per_op: float = BYTECODES_PER_OP) -> tuple[Gpu, float]:
    """``gpu`` with its host constants fitted to measured ``(counts, seconds, ours)`` rows of host-bound calls
    (small problems, whose device time is a small part): ``host_op`` (and ``host_bytecode``, its
    ``1 / bytecodes_per_op``) from the plain formula's rows (``ours`` False: code that does not change, so
    today's counts are the measured code's), then ``host_kernel`` from the rows with Triton launches; least
    squares on the relative error, each at least 0. Our rows without a Triton launch are predicted, not fitted
    (they show how far today's code is from the code measured). Returns the fitted GPU and the RMS relative
    error of the host time over all rows."""
    plain = [(c.launches + c.bytecodes / bytecodes_per_op, t) for c, t, ours in rows if not ours]
    launched = [(c, t) for c, t, _ in rows if kernels(c) > 0]
    if not plain or not launched:
        raise ValueError("fit_host needs rows of the plain formula (ours=False) and rows with Triton launches")
    # minimise sum ((n * op) / t - 1)^2: op = sum(n / t) / sum((n / t)^2)
    host_op = sum(n / t for n, t in plain) / sum((n / t) ** 2 for n, t in plain)
    per_bytecode = host_op / bytecodes_per_op
    # t - eager ops * host_op - bytecodes * per_bytecode = k * host_kernel, the same least squares in one unknown
    rest = [(kernels(c) / t, (t - (c.launches - kernels(c)) * host_op - c.bytecodes * per_bytecode) / t) for c, t in launched]
    kernel = sum(a * b for a, b in rest) / sum(a * a for a, _ in rest)
    fitted = replace(gpu, host_op=host_op, host_bytecode=per_bytecode, host_kernel=max(0.0, kernel))
    rms = (sum((host_time(c, fitted) / t - 1.0) ** 2 for c, t, _ in rows) / len(rows)) ** 0.5
    return fitted, rms


def fit_bytecodes(rows: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Seconds per eager op and per Python bytecode fitted to ``(launches, bytecodes, seconds)`` rows of
    calls timed on one CPU (small problems: their kernels cost little besides dispatch): least squares on
    the relative error of ``launches * op + bytecodes * bytecode``. Returns ``(op, bytecode, rms)``; their
    ratio is :data:`BYTECODES_PER_OP`."""
    if len(rows) < 2:
        raise ValueError("fit_bytecodes needs at least two timed calls")
    # minimise sum ((n op + b bc) / t - 1)^2: the 2 x 2 normal equations in (op, bc)
    snn = sum((n / t) ** 2 for n, _, t in rows)
    snb = sum(n * b / t / t for n, b, t in rows)
    sbb = sum((b / t) ** 2 for _, b, t in rows)
    rn = sum(n / t for n, _, t in rows)
    rb = sum(b / t for _, b, t in rows)
    det = snn * sbb - snb * snb
    if det <= 0:
        raise ValueError("fit_bytecodes needs calls whose bytecodes are not in proportion to their launches")
    op, bytecode = (rn * sbb - rb * snb) / det, (snn * rb - snb * rn) / det
    rms = (sum(((n * op + b * bytecode) / t - 1.0) ** 2 for n, b, t in rows) / len(rows)) ** 0.5
    return op, bytecode, rms


def fit_fused(rows: list[tuple[float, float]]) -> tuple[Fused, float]:
    """:class:`Fused` fitted to ``(GEMM FLOPs, seconds)`` rows: least squares on the relative error of
    ``flops / rate + overhead`` (linear in ``1 / rate`` and ``overhead``). Returns it and the RMS
    relative error."""
    if len(rows) < 2:
        raise ValueError("fit_fused needs at least two measured rows")
    # minimise sum_i ((f_i u + c) / t_i - 1)^2 over u = 1 / rate and c: the 2 x 2 normal equations
    sff = sum((f / t) ** 2 for f, t in rows)
    sf1 = sum(f / t / t for f, t in rows)
    s11 = sum(1 / t / t for _, t in rows)
    bf = sum(f / t for f, t in rows)
    b1 = sum(1 / t for _, t in rows)
    det = sff * s11 - sf1 * sf1
    if det == 0:
        raise ValueError("fit_fused needs rows of different sizes")
    u, c = (bf * s11 - b1 * sf1) / det, (sff * b1 - sf1 * bf) / det
    fitted = Fused(rate=1.0 / u, overhead=c, source=f"fitted to {len(rows)} measured rows")
    rms = (sum(((f * u + c) / t - 1.0) ** 2 for f, t in rows) / len(rows)) ** 0.5
    return fitted, rms


def predict_path(path: PathCost, backend: str, rows: int, cols: int, dim: int, dtype: str, tiles: int,
                 gpu: Gpu | str = "H100") -> float:
    """The model's time (seconds) of one call on ``backend`` with the counts ``path``, at ``rows x cols``
    logits of ``dim`` features in operand dtype ``dtype`` (``"bfloat16"``, ``"float32"``), ``tiles``
    tiles visited (1: one tile): the longer of the device's time and the host's -- a prediction, not a
    measurement."""
    return max(path_terms(path, backend, rows, cols, dim, dtype, tiles, gpu))


def path_terms(path: PathCost, backend: str, rows: int, cols: int, dim: int, dtype: str, tiles: int,
               gpu: Gpu | str = "H100") -> tuple[float, float]:
    """:func:`predict_path`'s two times (seconds, a prediction): ``(device, host)``."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    one = tiles <= 1
    flops = (path.gemms_one if one else path.gemms_strips) * 2.0 * rows * cols * dim
    passes = path.passes_one if one else path.passes_strips
    launches = path.launches + path.per_tile * max(0, tiles - 1)
    launched = path.kernels + path.kernels_per_tile * max(0, tiles - 1)
    bytecodes = path.bytecodes + path.bytecodes_per_tile * max(0, tiles - 1)
    if backend == "triton":
        fused = FUSED[g.name]
        gemm = flops / fused.rate + fused.overhead
    else:
        gemm = flops / g.gemm_flops[dtype]
    device = gemm + passes * 4.0 * rows * cols / g.bandwidth + launches * g.launch
    return device, (launches - launched) * g.host_op + bytecodes * g.host_bytecode + launched * g.host_kernel


#: The torch backend with half inputs widened to fp32 and multiplied in fp32 (no tensor cores:
#: ``TORCH_CONTRASTIVE_PRODUCTS=compute``), as :func:`predictions` names it beside the backends.
WIDE = "torch-fp32"

_HALF = (torch.float16, torch.bfloat16)


def _visited(rows: int, cols: int, tile: int, triangle: bool) -> int:
    """Square tiles of ``tile`` a walk visits: every one, or a square problem's upper triangle when ``triangle``."""
    per_side = math.ceil(rows / tile), math.ceil(cols / tile)
    return per_side[0] * (per_side[0] + 1) // 2 if triangle and per_side[0] == per_side[1] else per_side[0] * per_side[1]


def _bytes_per_logit(backend: str, half: bool) -> int:
    """The planner's scratch per logit of a GPU tile (two fp32 buffers, and the torch loops' two half copies of
    their gradient tile on tensor-core products), for the tile the plan would take."""
    return 8 + (4 if half and backend == "torch" else 0)


def predictions(rows: int, cols: int, dtype: torch.dtype, other_dtype: torch.dtype, chunk_size: int | None,
                traits: Traits, gpu: str = "H100") -> tuple[tuple[str, float], ...]:
    """The model's time (seconds, a prediction) of each backend that has counts for this soft-max or pair-term
    problem (:data:`PATHS`): ``(("torch", t), ("epilogue", t), ("triton", t))`` as available, and for half inputs
    the torch loops on widened fp32 products as :data:`WIDE` (not while TF32 may round fp32 GEMMs) -- the H100's constants for any CUDA device until
    others are measured. Offline only: the engine's policy (``engine/policy.py``) takes measured crossovers, and
    this proposes where a GPU run should look. fp64 is not priced."""
    if dtype in _HALF and other_dtype == dtype:
        operands, name = "half", "bfloat16"
    elif dtype == other_dtype == torch.float32:
        operands, name = "fp32", "float32"
    else:
        return ()
    kind = traits.pairs or ("columns" if traits.columns else "rows")
    candidates = [(b, b, operands, name) for b in ("torch", "epilogue", "triton")]
    if operands == "half" and not torch.backends.cuda.matmul.allow_tf32:  # widened products are exact only without TF32
        candidates.append((WIDE, "torch", "wide", "float32"))
    out = []
    for label, backend, counted, gemm_dtype in candidates:
        path = PATHS.get((kind, backend, counted))
        if path is None:
            continue
        per_logit = _bytes_per_logit(backend, counted == "half")
        walks_strips = backend == "epilogue" and (traits.pairs is not None or not traits.symmetric)
        strip = strip_rows(rows, cols, per_logit) if chunk_size is None and walks_strips else 0
        tile = resolve_tile(chunk_size, rows, cols, "cuda", per_logit)
        # a single set's triangle: the soft-max terms on every backend; the pair terms visit every tile (as counted)
        triangle = traits.symmetric and traits.pairs is None
        tiles = 1 if backend == "triton" else math.ceil(rows / strip) if strip else _visited(rows, cols, tile, triangle)
        out.append((label, predict_path(path, backend, rows, cols, traits.dim, gemm_dtype, tiles, gpu)))
    return tuple(out)
