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

from dataclasses import dataclass, field, replace

__all__ = [
    "BYTECODES_PER_OP",
    "FORMED_STRIPS",
    "FUSED",
    "GPUS",
    "MEASURED",
    "PAIR_FORMED",
    "PAIR_PER_ROW",
    "PAIR_RELATION_FORMS",
    "PATHS",
    "PEAK_BANDWIDTH",
    "RELATION_FORMS",
    "TILE_RELATION_FORMS",
    "Counts",
    "FormedStrips",
    "Fused",
    "Gpu",
    "Measured",
    "PathCost",
    "factoring_pays",
    "fit",
    "fit_bytecodes",
    "fit_fused",
    "fit_host",
    "formed",
    "host_time",
    "kernels",
    "pair_factoring_pays",
    "path_terms",
    "predict",
    "predict_path",
    "terms",
    "tile_mask_pays",
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
    (``tests/cli/test_traffic.py`` re-counts every entry of :data:`PATHS`, so a change to a path shows).

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
#: the pair terms ``"pair_softplus"`` (PML NT-Xent) and ``"binary"`` (NT-BXent) with labels;
#: operands ``"half"`` (bf16 on tensor cores), ``"wide"`` (bf16 inputs widened, fp32 products: the torch loops' choice
#: where the model prices them lower, :data:`~.planner.WIDE`) or ``"fp32"``. Counted 2026-11-24 (the torch rows again 2026-11-25:
#: two sets normalised as one stack, a strided tile's writes by ``put_``; the pair_softplus rows' launches again
#: the same day: PML's per-pair mean from one count of the relation; the columns' half row: the two sets stacked
#: on tensor-core products too; the pair terms' one tile again 2026-11-27: PML's masked parts kept, NT-BXent's
#: log1p / sigmoid off one exp and its H = G + G^T formed directly; once more the same day: no negative mask,
#: NT-BXent's zS in one op and its negative sum from the row's, PML's sigmoid in one op; the soft-max half rows' one tile
#: again 2026-11-28: the lean bf16 executor, engine/one_tile_half.py, its split product three GEMM-equivalents; the pair
#: terms' one tile the same day: their bf16 lean executor; every row again 2026-11-28 with its Python bytecodes, the plans
#: kept as on a GPU, and the "wide" rows added; the launches and bytecodes once more the same day: kept calls
#: (losses/_kept.py) -- a repeated one-tile call replayed without its set-up -- and the one-op fold of the
#: scale and of a single set's two roles; the torch rows' again the same day: the split product's operands as
#: two views of one buffer written by two ops (two launches fewer on tensor cores), the lean functions' apply
#: called in C, a label relation's form asked of its reader (engine/relation_form.py, dense_relation), the pair terms'
#: repeated one tile kept (a label call's relation rebuilt from its labels: losses/_kept.py), their counts from the
#: mask's bools in one op (the pair terms' epilogue rows' launches and bytecodes too); the epilogue's half rows
#: once more the same day: one tile keeps its fp32 unit rows for backward (no row kernel rebuilds them); the torch rows
#: again the same day: the normalisation backward in six ops (was eight), NT-BXent's two means stacked and combined in
#: two ops, PML's rows summed inside the kernel where only their total is read; again the same day: one key's groups
#: from a sort and a search (the kernel backends' relation grouped: the epilogue's pair rows), the pair terms' torch
#: strips priced by their own forms (:data:`PAIR_RELATION_FORMS`), a Triton launch announced by a class (not a
#: generator context), the kernels' package kept after its first import; the pair_softplus epilogue row 2026-11-29: PML's
#: forward in one launch per tile where a tile holds all its rows' columns (the strips' counts, 4 x 4 squares, unchanged);
#: the pair terms' bf16 one tile 2026-11-29 again: the products factored through the kept tiles (engine/pair_factored.py:
#: PML 19.0 passes, NT-BXent 14.8, for 7 GEMM-equivalents) and the widened one tile (the host-bound pick) keeping one
#: tile for backward's two GEMMs (PML 40 launches and 22.0 passes where 41 and 30.8, NT-BXent 37 and 18.3 where 43 and 30.8);
#: the torch loops' strips on tensor cores the same day from split operands (engine/products.py, SplitProducts: a logit
#: tile one write where three passes; 8 GEMM-equivalents with column terms where 5); the soft-max terms' torch strips
#: 2026-11-29 again with their backward factored (engine/factored_strips.py: CLIP 8.65 passes on tensor cores where
#: 16.15, 10.15 widened where 14.15; NT-Xent 4.95 and 5.76 where 9.26 and 8.26; the formed tile's counts beside them in
#: :data:`FORMED_STRIPS`, which the planner prices where factoring does not pay); NT-BXent's torch strips the same day
#: from one signed tile each, a label relation's triangle, backward factored through [sig ; Q] (engine/pair_strips.py:
#: 13.21 passes on tensor cores where 37.53, 15.15 widened where 35.53; its per-tile counts over the 10 tiles of the
#: triangle it now walks); PML NT-Xent's torch strips the same day in two sweeps of few passes, backward factored
#: through [E ; T] (engine/pml_strips.py: 26.54 passes on tensor cores where 54.51, 31.54 widened where 52.51; every
#: tile, as the pricing now assumes for PML), and again 2026-11-29 with a reduced value's products formed in forward
#: (three sweeps in all) and sweep 2's ``L_i - S`` written by its GEMM (products.offset_logits): 16.9 passes on
#: tensor cores, 20.32 widened; a per-row call's backward priced by :data:`PAIR_PER_ROW`;
#: Python 3.11.7,
#: the epilogue's kernels in Triton's interpreter, whose
#: host-side checks add bytecodes a GPU's compiled launch would not) at 256 rows, one tile and
#: 4 x 4 tiles (``bench --traffic`` counts any loss at any size; the fused kernels' own GEMMs are not
#: visible to the counter: their GEMM-equivalents are the kernels' design, 4 with column terms, 2 for a triangle).
PATHS: dict[tuple[str, str, str], PathCost] = {
    ("columns", "torch", "half"): PathCost(46, 17.8, 9.66, 8.65, 5.0, 10.0, 0, 0.0, 1605, 1078),
    ("columns", "torch", "wide"): PathCost(42, 14.9, 11.16, 10.15, 3.0, 6.0, 0, 0.0, 1292, 919),
    ("columns", "epilogue", "half"): PathCost(51, 9.2, 5.0, 6.0, 3.0, 4.0, 7, 3.13, 7199, 1179),
    ("columns", "triton", "half"): PathCost(48, 0.0, 0.0, 0.0, 4.0, 4.0, 8, 0.0, 7586, 0),
    ("rows", "torch", "half"): PathCost(35, 16.8, 8.04, 4.95, 4.0, 5.75, 0, 0.0, 1433, 1294),
    ("rows", "torch", "wide"): PathCost(30, 14.8, 9.04, 5.76, 2.0, 3.25, 0, 0.0, 1167, 1157),
    ("rows", "epilogue", "half"): PathCost(31, 8.2, 4.0, 3.5, 2.0, 2.25, 4, 2.78, 5995, 1105),
    ("rows", "triton", "half"): PathCost(36, 0.0, 0.0, 0.0, 2.0, 2.0, 5, 0.0, 6366, 0),
    ("columns", "torch", "fp32"): PathCost(40, 14.9, 11.16, 10.15, 3.0, 6.0, 0, 0.0, 1287, 918),
    ("columns", "epilogue", "fp32"): PathCost(44, 7.1, 6.0, 7.0, 3.0, 4.0, 7, 3.0, 6825, 903),
    ("rows", "torch", "fp32"): PathCost(28, 14.8, 9.04, 5.76, 2.0, 3.25, 0, 0.0, 1162, 1157),
    ("rows", "epilogue", "fp32"): PathCost(27, 6.4, 5.0, 4.12, 2.0, 2.25, 4, 2.67, 5718, 850),
    ("pair_softplus", "torch", "half"): PathCost(51, 28.9, 19.01, 16.9, 7.0, 10.92, 0, 0.0, 2493, 1094),
    ("pair_softplus", "torch", "wide"): PathCost(40, 28.6, 22.01, 20.32, 3.0, 6.42, 0, 0.0, 1956, 918),
    ("pair_softplus", "epilogue", "half"): PathCost(30, 10.7, 5.0, 8.0, 3.0, 5.0, 4, 3.13, 6227, 1413),
    ("binary", "torch", "half"): PathCost(49, 31.8, 14.78, 13.21, 7.0, 9.75, 0, 0.0, 2425, 1346),
    ("binary", "torch", "wide"): PathCost(37, 32.4, 18.26, 15.15, 3.0, 7.25, 0, 0.0, 1962, 1263),
    ("binary", "epilogue", "half"): PathCost(32, 8.1, 5.02, 6.02, 3.0, 4.0, 4, 2.07, 6275, 1012),
}


@dataclass(frozen=True)
class FormedStrips:
    """What the torch loops' bounded strips of the soft-max terms cost with the gradient tile formed
    (``G = (u_i + v_j) exp(S)``, then its two products) beyond the factored form that :data:`PATHS` counts
    (:mod:`~.factored_strips`: the products multiply ``exp(S)`` against operands twice as wide). Counted on the
    GPU plan with each form forced (``tests/cli/test_traffic.py`` re-counts them).

    Attributes:
        passes: fp32 passes over the logits the formed tile adds (strips).
        per_tile: launches it adds per further tile (as :attr:`PathCost.per_tile`: the call's own difference
            spread over the tiles counted).
        gemms: GEMM-equivalents it adds (negative: its products are half as wide).
        bytecodes_per_tile: Python bytecodes it adds per further tile.
    """

    passes: float
    per_tile: float
    gemms: float
    bytecodes_per_tile: float


#: Per (problem kind, operands) of :data:`PATHS`' torch rows: CLIP (``"columns"``) and NT-Xent (``"rows"``), 256
#: rows of 48 features, 4 x 4 tiles of 64, counted 2026-11-29. Tensor-core operands only in bf16 (fp16's ``exp(S)``
#: overflows past ``S = 11``: its strips keep the formed tile, priced by these entries added to the factored ones).
FORMED_STRIPS: dict[tuple[str, str], FormedStrips] = {
    ("columns", "half"): FormedStrips(7.5, 3.9, -2.0, 92),
    ("columns", "wide"): FormedStrips(4.0, 1.7, -2.0, 53),
    ("columns", "fp32"): FormedStrips(4.0, 1.7, -2.0, 53),
    ("rows", "half"): FormedStrips(4.31, 3.7, -1.0, 86),
    ("rows", "wide"): FormedStrips(2.5, 1.9, -1.0, 62),
    ("rows", "fp32"): FormedStrips(2.5, 1.9, -1.0, 62),
}


def formed(path: PathCost, extra: FormedStrips) -> PathCost:
    """``path`` (a torch row of :data:`PATHS`, the factored strips) with the gradient tile formed instead."""
    return replace(path, passes_strips=path.passes_strips + extra.passes, per_tile=path.per_tile + extra.per_tile,
                   gemms_strips=path.gemms_strips + extra.gemms,
                   bytecodes_per_tile=path.bytecodes_per_tile + extra.bytecodes_per_tile)


def factoring_pays(path: PathCost, extra: FormedStrips, rows: int, cols: int, dim: int, dtype: str, tiles: int,
                   gpu: Gpu | str = "H100") -> bool:
    """Whether the factored strips (``path``) are predicted no slower than the formed tile (``path`` plus
    ``extra``): their wider GEMMs against the formed tile's passes and launches; ``dtype`` the GEMMs' (a
    widened call's fp32 GEMMs price the width at the fp32 rate, so there it pays only at small ``dim``)."""
    return predict_path(path, "torch", rows, cols, dim, dtype, tiles, gpu) <= \
        predict_path(formed(path, extra), "torch", rows, cols, dim, dtype, tiles, gpu)


#: The pair terms' torch strips on the GPU plan, formed (the general loop, every tile) beyond factored, per (kernel,
#: operands), as :data:`FORMED_STRIPS` (launches and bytecodes per further tile spread over the tiles :data:`PATHS`
#: counts them over: NT-BXent's triangle 10, PML's 16), 1,024 rows counted at 256, 4 x 4 tiles, D 64, 2026-11-29.
#: NT-BXent (engine/pair_strips.py, a label relation's triangle): 37.53 and 35.53 passes for 8 and 4
#: GEMM-equivalents, factored 13.21 and 15.15 for 9.75 and 7.25. PML NT-Xent (engine/pml_strips.py, sweeps 1 and 3
#: over a label relation's triangle, a reduced value's products formed in forward): 54.51 and 52.51 for 11.0 and 5.0,
#: factored 16.9 and 20.32 for 10.92 and 6.42.
PAIR_FORMED: dict[tuple[str, str], FormedStrips] = {
    ("binary", "half"): FormedStrips(24.31, 24.8, -1.75, 708),
    ("binary", "wide"): FormedStrips(20.37, 17.7, -3.25, 502),
    ("pair_softplus", "half"): FormedStrips(37.61, 26.8, 0.125, 997),
    ("pair_softplus", "wide"): FormedStrips(32.19, 23.2, -1.375, 997),
}

#: PML NT-Xent's factored strips with per-row outputs (no ``combine``: a distributed call, ``reduction="none"``)
#: beyond a reduced value's, per operands: backward recomputes each tile and forms ``[E ; T]``
#: (:func:`~.pml_strips.softplus_backward`) where a reduced value formed its products in forward
#: (:func:`~.pml_strips.softplus_with_gradient`). Counted as :data:`PAIR_FORMED` (1,024 rows counted at 256, 4 x 4
#: tiles, D 64, 2026-11-29): 24.56 passes on tensor cores against 16.9, 29.54 widened against 20.32.
PAIR_PER_ROW: dict[tuple[str, str], FormedStrips] = {
    ("pair_softplus", "half"): FormedStrips(7.66, 0.4, 1.125, 46),
    ("pair_softplus", "wide"): FormedStrips(9.22, 0.3, 0.375, 82),
}


def pair_factoring_pays(operands: str, dim: int, gpu: Gpu | str = "H100", kernel: str = "binary",
                        per_row: bool = False) -> bool:
    """Whether the pair terms' factored strips (``kernel``: NT-BXent's ``"binary"``, PML's ``"pair_softplus"``) are
    predicted faster on the device than the formed tile at ``dim`` features: the formed tile's passes
    (:data:`PAIR_FORMED`) against the factored products' GEMM FLOPs, per logit, at the products' rate -- ``operands``
    ``"half"`` (tensor cores: NT-BXent up to about 7,800 features; PML's reduced value at any, its products formed
    in forward doing fewer FLOPs than the general loop, per-row outputs up to about 17,000) or ``"wide"`` (fp32 GEMMs,
    widened or fp32 inputs: NT-BXent below about 280; PML below about 1,050, per-row outputs about 590).
    ``per_row``: PML's outputs per row (:data:`PAIR_PER_ROW`). Per logit: the launches are the same order."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    extra = PAIR_FORMED[(kernel, operands)]
    kept = PAIR_PER_ROW.get((kernel, operands)) if per_row else None
    passes, gemms = (extra.passes, extra.gemms) if kept is None else (extra.passes - kept.passes, extra.gemms - kept.gemms)
    rate = g.gemm_flops["bfloat16" if operands == "half" else "float32"]
    return -gemms * 2.0 * dim / rate < passes * 4.0 / g.bandwidth


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
class RelationForms:
    """What the two forms of a label relation cost a call beyond each other, counted on the GPU plan
    (``tests/cli/test_traffic.py`` re-counts them, so a change to either form shows).

    Attributes:
        dense_passes: fp32 passes over the logits that the dense 0/1 mask adds (built, converted,
            read by the positive sums and the gradient tile).
        grouped_launches: launches that the grouped form (keys sorted, per-class sums) adds (negative: saves).
    """

    dense_passes: float
    grouped_launches: int


#: SupCon with labels, 1,024 rows, bf16, the GPU plan's strips (4 x 4 tiles), counted 2026-11-28; again the same day
#: after one key's groups came from a sort and a search (was 17 launches more: a lexicographic grouping): the grouped
#: form is now the cheaper on strips in both, so a GPU's strips group (a one-tile reader is priced apart:
#: :data:`TILE_RELATION_FORMS`).
RELATION_FORMS = RelationForms(dense_passes=2.75, grouped_launches=-4)


@dataclass(frozen=True)
class TileRelationForms:
    """What the two forms of a single set's label relation cost the torch backend's one tile beyond each other
    (SupCon's lean executor, ``engine/one_tile_half.py``), counted on the GPU plan (``tests/cli/test_traffic.py``
    re-counts them). The mask is read by GEMMs, ``P x`` forward and ``P (beta x)`` backward; the grouped form sums
    the rows per key instead (a sort, a search, index-adds: O(N D) work, more launches).

    Attributes:
        dense_passes: fp32 passes over the logits that the mask adds (built, counted, converted, read by the GEMMs).
        dense_gemms: GEMM-equivalents (``2 R C D`` FLOPs each) of the mask's products.
        grouped_launches: launches the grouped form adds.
        grouped_bytecodes: Python bytecodes the grouped form adds (negative: fewer).
    """

    dense_passes: float
    dense_gemms: float
    grouped_launches: int
    grouped_bytecodes: int


#: Per operands of the tile's products: ``"half"`` (bf16 rows split for fp16 tensor cores, the mask in fp16, its
#: GEMMs fp16), ``"wide"`` (bf16 inputs widened, fp32 products, :data:`~.planner.WIDE`). SupCon with labels on the
#: GPU plan, counted 2026-11-28 at 8,192 rows (half) and 1,024 (wide).
TILE_RELATION_FORMS = {
    "half": TileRelationForms(dense_passes=2.25, dense_gemms=3.0, grouped_launches=7, grouped_bytecodes=-17),
    "wide": TileRelationForms(dense_passes=3.75, dense_gemms=2.0, grouped_launches=9, grouped_bytecodes=114),
}


def tile_mask_pays(rows: float, cols: float, dim: int, operands: str, call: tuple[float, float], gpu: Gpu | str = "H100") -> bool:
    """Whether a single set's label relation is predicted cheaper as a dense mask than grouped by key on the torch
    backend's one tile (:data:`TILE_RELATION_FORMS`). ``call``: the ``(device, host)`` time of the one tile without
    the relation (:func:`path_terms`): the call takes the longer, so a host-bound call keeps the mask, whose passes
    and products the device hides, and a device-bound one groups, whose launches the host hides."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    f = TILE_RELATION_FORMS[operands]
    products = f.dense_gemms * 2.0 * rows * cols * dim / g.gemm_flops["float16" if operands == "half" else "float32"]
    mask = f.dense_passes * 4.0 * rows * cols / g.bandwidth + products
    device, host = call
    return max(device + mask, host) <= max(device + f.grouped_launches * g.launch,
                                            host + f.grouped_launches * g.host_op + f.grouped_bytecodes * g.host_bytecode)


#: The pair terms' on the torch loops' strips, per kernel, where the grouped form compares the keys of every tile
#: again: 1,024 rows, bf16, 4 x 4 tiles, D 500, counted 2026-11-29 with their strips factored (engine/pml_strips.py:
#: PML's three sweeps read the relation of 36 tiles, so the mask moves fewer bytes too; engine/pair_strips.py:
#: NT-BXent's triangle reads 20).
PAIR_RELATION_FORMS: dict[str, RelationForms] = {
    "pair_softplus": RelationForms(dense_passes=-0.06, grouped_launches=52),
    "binary": RelationForms(dense_passes=0.19, grouped_launches=31),
}


def dense_relation_pays(rows: float, cols: float, gpu: Gpu | str = "H100", call: tuple[float, float] | None = None,
                        forms: RelationForms = RELATION_FORMS) -> bool:
    """Whether the dense mask of an ``R x C`` label relation is predicted cheaper than the grouped form, for a
    reader whose two forms differ by ``forms`` (the soft-max terms' :data:`RELATION_FORMS`, a pair kernel's entry of
    :data:`PAIR_RELATION_FORMS`).

    Without ``call``, on the device alone: the mask's extra passes against the grouped form's extra launches.
    ``call``: the ``(device, host)`` time of the call that reads the relation, counted with the mask
    (:func:`path_terms` of a :data:`PATHS` entry): the call takes the longer of the two, so the mask's passes
    cost nothing while the device waits on the host, and the grouped form's launches cost the host too."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    mask = forms.dense_passes * 4.0 * rows * cols / g.bandwidth
    grouped = forms.grouped_launches * g.launch
    if call is None:
        return mask < grouped
    device, host = call
    return max(device, host) <= max(device - mask + grouped, host + forms.grouped_launches * g.host_op)


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
