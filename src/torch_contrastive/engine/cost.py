"""GPU time as a sum of what a CPU can count: GEMM FLOPs, logit-sized memory traffic, launches.

Between the GEMMs a contrastive loss is memory-bound: every pass over the logit matrix (an
``exp``, a sum, a mask, the gradient tile) reads or writes ``rows * cols`` numbers, and each op
pays a launch. The model prices a call's counts (:class:`Counts`, measured on any machine by
:func:`torch_contrastive.cli.traffic.count`) on a named GPU:

    ``time = sum over GEMMs of FLOPs / rate(dtype) + logit bytes / bandwidth + launches * launch``

The constants of each GPU live in one table, :data:`GPUS`: a session on a GPU re-measures them
and changes numbers, not code (docs/gpu.md, "Counting GPU time on a CPU", says how well they fit
the measured rows). Every figure the model gives is a prediction, and is labelled as one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GPUS", "MEASURED", "PEAK_BANDWIDTH", "Counts", "Gpu", "Measured", "fit", "predict", "terms"]


@dataclass(frozen=True)
class Gpu:
    """One GPU's constants.

    Attributes:
        name: as reported by the device (``torch.cuda.get_device_name``), shortened.
        gemm_flops: sustained GEMM FLOP/s by operand dtype name (``"bfloat16"``, ``"float16"``,
            ``"float32"``): cuBLAS at large square shapes.
        bandwidth: sustained bytes/s of an elementwise pass over a large tensor.
        launch: seconds per op between GEMMs (launch, the tail of a small kernel, and what the
            byte count misses: a reduction that reads its input twice).
        source: where the numbers come from (a measurement, or the fit to measured rows).
    """

    name: str
    gemm_flops: dict[str, float]
    bandwidth: float
    launch: float
    source: str


#: The GPUs the model knows. H100 (SXM, 80 GB): bf16 GEMM 645 TFLOP/s as cuBLAS measured
#: (docs/gpu.md, 2026-11-23); fp32 without TF32 at the data sheet's non-tensor rate; bandwidth
#: and the per-op cost fitted to :data:`MEASURED` by :func:`fit` (``torch-contrastive bench
#: --traffic --calibrate`` prints the fit and each row's error; docs/gpu.md has the table).
GPUS: dict[str, Gpu] = {
    "H100": Gpu(
        name="H100",
        gemm_flops={"bfloat16": 645e12, "float16": 645e12, "float32": 51e12},
        bandwidth=2.61e12,
        launch=23.9e-6,
        source="bf16 GEMM rate measured 2026-11-23; bandwidth and per-op cost fitted 2026-11-24 to docs/gpu.md's rows "
               "(RMS relative error 12 %, worst -30 %)",
    ),
}


#: Data-sheet memory bandwidth (bytes/s): the ceiling of a fitted bandwidth.
PEAK_BANDWIDTH = {"H100": 3.35e12}


@dataclass(frozen=True)
class Measured:
    """One measured row the constants are fitted to: forward + backward of ``loss`` at ``n x n`` bf16
    logits of ``d`` features, ``impl`` ``"ours"`` (the default call's torch path) or ``"dense"`` (the
    eager formula it replaces), on ``gpu``."""

    gpu: str
    loss: str
    impl: str
    n: int
    d: int
    ms: float
    source: str


#: The measured rows (docs/gpu.md, "Where we stand on an H100", 2026-11-23, bf16, fwd+bwd). Ours
#: was measured at that day's commit; the fit compares today's counts with it (docs/gpu.md says so).
MEASURED: tuple[Measured, ...] = (
    Measured("H100", "clip", "dense", 8192, 512, 2.96, "docs/gpu.md 2026-11-23"),
    Measured("H100", "clip", "ours", 8192, 512, 4.03, "docs/gpu.md 2026-11-23"),
    Measured("H100", "clip", "dense", 65536, 768, 157.0, "docs/gpu.md 2026-11-23"),
    Measured("H100", "clip", "ours", 65536, 768, 226.0, "docs/gpu.md 2026-11-23"),
    Measured("H100", "nt_xent", "dense", 65536, 768, 91.1, "docs/gpu.md 2026-11-23"),
    Measured("H100", "nt_xent", "ours", 65536, 768, 123.0, "docs/gpu.md 2026-11-23"),
)


@dataclass(frozen=True)
class RelationForms:
    """What the two forms of a label relation cost a call beyond each other, counted on the GPU plan
    (``tests/cli/test_traffic.py`` re-counts them, so a change to either form shows).

    Attributes:
        dense_passes: fp32 passes over the logits that the dense 0/1 mask adds (built, converted,
            read by the positive sums and the gradient tile).
        grouped_launches: launches that the grouped form (keys sorted, per-class sums) adds.
    """

    dense_passes: float
    grouped_launches: int


#: SupCon with labels, 1,024 rows, bf16, the GPU plan, counted 2026-11-24.
RELATION_FORMS = RelationForms(dense_passes=11.6, grouped_launches=44)


def dense_relation_pays(rows: float, cols: float, gpu: Gpu | str = "H100") -> bool:
    """Whether the dense mask of an ``R x C`` label relation is predicted cheaper than the grouped form."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    return RELATION_FORMS.dense_passes * 4.0 * rows * cols / g.bandwidth < RELATION_FORMS.grouped_launches * g.launch


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
    """

    rows: int
    cols: int
    launches: int
    logit_bytes: int
    gemm_flops: dict[str, int]
    syncs: int
    ops: dict[str, int] = field(default_factory=dict, compare=False)

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
                      {k: round(v * f) for k, v in self.gemm_flops.items()}, self.syncs, dict(self.ops))


def predict(counts: Counts, gpu: Gpu | str = "H100") -> float:
    """The model's time (seconds) of ``counts`` on ``gpu``: a prediction, not a measurement."""
    return sum(terms(counts, gpu))


def terms(counts: Counts, gpu: Gpu | str = "H100") -> tuple[float, float, float]:
    """``(GEMM, traffic, launch)`` seconds of :func:`predict`, in that order."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    gemm = sum(flops / g.gemm_flops[dtype] for dtype, flops in counts.gemm_flops.items())
    return gemm, counts.logit_bytes / g.bandwidth, counts.launches * g.launch


def fit(rows: list[tuple[Counts, float]], gpu: Gpu, peak_bandwidth: float) -> tuple[Gpu, float]:
    """``gpu`` with its bandwidth and launch cost fitted to measured ``(counts, seconds)`` rows: least
    squares on the relative error, the bandwidth kept physical (at most ``peak_bandwidth``, the
    memory's data-sheet rate), the launch cost at least 1 µs; the GEMM rates stay as measured.
    Returns the fitted GPU and the root-mean-square relative error of the fit."""
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
        rms = (sum((predict(c, trial) / t - 1.0) ** 2 for c, t in rows) / len(rows)) ** 0.5
        if best is None or rms < best[0]:
            best = (rms, bandwidth, launch)
    if best is None:
        raise ValueError("fit needs at least one measured row")
    rms, bandwidth, launch = best
    return Gpu(gpu.name, dict(gpu.gemm_flops), bandwidth, launch, f"fitted to {len(rows)} measured rows"), rms
