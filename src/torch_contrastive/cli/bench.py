"""``torch-contrastive bench``: forward+backward time and peak memory vs. peers.

Every case runs in a fresh subprocess so that peak memory is the case's own: the
worker allocates its inputs, records the peak RSS (``ru_maxrss``; on CUDA
``max_memory_allocated``), runs the loss forward+backward, and reports the growth of
the peak. It then times, in the same process, the three plain matrix multiplies of
the same shape (``S = A @ B.T``, ``G @ B``, ``G.T @ A``), alternating loss and
reference runs: ``R`` is the median of the per-pair ratios ``loss time / matmul time``,
measured on one machine in one process, so it survives a noisy, shared machine better
than seconds do.

Peers: pytorch-metric-learning (always installed with the ``dev`` extra), open_clip's
``ClipLoss`` and ``SigLipLoss`` (its ``loss.py`` loaded alone, when installed) and
lightly's ``NTXentLoss`` when importable; and a dense PyTorch baseline of the same
formula, labelled ``dense-baseline``, and the same formula under ``torch.compile`` (``dense-compiled``:
what a careful user writes in one line, the anchor on a GPU). ``--gpu`` runs the GPU table of the docs
(CLIP at 8,192 x 512 and 65,536 x 768, NT-Xent at 65,536 x 768, bf16) with the GEMM-equivalent
TFLOP/s of every row and the device's measured bf16 matmul peak.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ._argtypes import batch_sizes, int_list, positive_float, positive_int
from ._paths import cannot_write, save_figure

#: Above this many rows the matmul reference (two N x N fp32 matrices) is not run.
MAX_REFERENCE_ROWS = 16384

# (loss, implementation) pairs understood by the worker.
IMPLEMENTATIONS = {
    # infcl-formula: Inf-CL's schedule (two one-direction losses, logits recomputed twice in backward)
    "clip": ["ours", "ours-dense", "open_clip", "dense-baseline", "dense-compiled", "infcl-formula"],
    "siglip": ["ours", "ours-dense", "open_clip", "dense-baseline"],
    "nt_xent": ["ours", "ours-dense", "lightly", "pml", "dense-baseline", "dense-compiled"],
    "supcon": ["ours", "ours-dense", "pml", "supcon-authors-formula", "dense-compiled"],
    # labelled mask-in-tile losses (only with --loss and --classes; their dense forms need several N x N matrices)
    "nt_xent_pml": ["ours"],
    "nt_bxent": ["ours"],
    # N queries against their keys plus a queue of Q negatives (only with --loss info_nce_queue):
    # in-batch keys + queue (N x (N + Q) logits), and MoCo's form (key + queue) against info-nce-pytorch
    "info_nce_queue": ["ours", "dense-baseline", "ours-moco", "info_nce"],
    # in-batch InfoNCE whose false negatives a guide model removes (GISTEmbed), guide size D / 2
    "info_nce_guide": ["ours", "dense-baseline"],
    # MNRL over five embedding prefixes (768, 512, 256, 128, 64 up to D): ours in one pass, the peer's per prefix
    "matryoshka": ["ours", "sentence-transformers"],
}

#: The engine backend of "ours" in this worker process (one case per process).
_BACKEND = ["auto"]
#: Losses whose "ours" runs on backend="triton" too (every loss the kernels cover).
TRITON_LOSSES = ("clip", "siglip", "nt_xent", "supcon", "nt_xent_pml", "nt_bxent", "info_nce_queue")
#: The losses the epilogue kernels run (``--backend epilogue``): the soft-max family.
EPILOGUE_LOSSES = ("clip", "nt_xent", "supcon", "info_nce_queue", "info_nce_guide")
#: The losses each kernel backend covers (the others run everything).
COVERED = {"triton": TRITON_LOSSES, "epilogue": EPILOGUE_LOSSES}

#: Cases run only with --loss NAME --sizes N.
ON_REQUEST = ("nt_xent_pml", "nt_bxent", "info_nce_queue", "info_nce_guide", "matryoshka")

#: Queue rows of the info_nce_queue case unless --queue.
DEFAULT_QUEUE = 65536


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def dense_clip(img: torch.Tensor, txt: torch.Tensor, tau: float) -> torch.Tensor:
    img = torch.nn.functional.normalize(img, dim=1)
    txt = torch.nn.functional.normalize(txt, dim=1)
    logits = img @ txt.T / tau
    target = torch.arange(img.shape[0], device=img.device)
    return (torch.nn.functional.cross_entropy(logits, target) + torch.nn.functional.cross_entropy(logits.T, target)) / 2


def dense_nt_xent(z: torch.Tensor, tau: float) -> torch.Tensor:
    """Dense NT-Xent with halves pairing, as lightly computes it (N x N logits)."""
    n = z.shape[0] // 2
    z = torch.nn.functional.normalize(z, dim=1)
    logits = z @ z.T / tau
    logits = logits.masked_fill(torch.eye(2 * n, dtype=torch.bool, device=z.device), float("-inf"))
    target = (torch.arange(2 * n, device=z.device) + n) % (2 * n)
    return torch.nn.functional.cross_entropy(logits, target)


def _dense_supcon(z: torch.Tensor, labels: torch.Tensor, tau: float) -> torch.Tensor:
    """The SupCon authors' formula written densely (mask, max-shift, log-prob, mean)."""
    z = torch.nn.functional.normalize(z, dim=1)
    logits = z @ z.T / tau
    logits = logits - logits.max(dim=1, keepdim=True).values.detach()
    same = (labels[:, None] == labels[None, :]).float()
    not_self = 1 - torch.eye(z.shape[0], device=z.device)
    same = same * not_self
    log_prob = logits - torch.log((torch.exp(logits) * not_self).sum(1, keepdim=True))
    mean_pos = (same * log_prob).sum(1) / same.sum(1).clamp_min(1)
    return -mean_pos.mean()


def load_open_clip_loss() -> Any:
    """open_clip's ``loss.py`` loaded on its own: the package imports torchvision at import
    time (which does not import beside a CPU torch wheel), the loss module does not."""
    import importlib.util

    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("open_clip_torch is not installed (pip install --no-deps open_clip_torch)")
    path = Path(next(iter(spec.submodule_search_locations))) / "loss.py"
    module_spec = importlib.util.spec_from_file_location("open_clip_loss_only", path)
    if module_spec is None or module_spec.loader is None:
        raise ModuleNotFoundError(f"cannot load {path}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _dense_siglip(img: torch.Tensor, txt: torch.Tensor, scale: float, bias: float) -> torch.Tensor:
    """open_clip's SigLipLoss formula (world size 1) in plain PyTorch: N x N logits and labels."""
    img = torch.nn.functional.normalize(img, dim=1)
    txt = torch.nn.functional.normalize(txt, dim=1)
    logits = scale * img @ txt.T + bias
    labels = 2 * torch.eye(img.shape[0], device=img.device) - 1
    return -torch.nn.functional.logsigmoid(labels * logits).sum() / img.shape[0]


def _infcl_kernels(x: torch.Tensor, y: torch.Tensor, tau: float) -> Any:
    """The Inf-CL package's own kernels (``cal_flash_loss``, one call per direction, as its
    README's CLIP example), on normalised rows: needs ``pip install inf_cl`` and a CUDA device."""
    from inf_cl import cal_flash_loss

    labels = torch.arange(x.shape[0], device=x.device)
    normalize = torch.nn.functional.normalize

    def loss() -> torch.Tensor:
        xn, yn = normalize(x, dim=1), normalize(y, dim=1)
        return (cal_flash_loss(xn, yn, labels, 1 / tau).mean() + cal_flash_loss(yn, xn, labels, 1 / tau).mean()) / 2

    return loss


def _build_image_text(loss: str, impl: str, x: torch.Tensor, y: torch.Tensor, tau: float, dense_chunk: int) -> Any:
    """The closure of an image-text case. SigLIP: tau is 1 / logit_scale; the bias is the paper's init, -10."""
    import torch_contrastive as tc

    normalize = torch.nn.functional.normalize
    chunk = dense_chunk if impl == "ours-dense" else None
    if loss == "clip":
        if impl in ("ours", "ours-dense"):
            return lambda: tc.image_text_contrastive_loss(x, y, tau, chunk_size=chunk, backend=_BACKEND[0])
        if impl == "infcl-formula":
            from .infcl_formula import infcl_clip_loss

            return lambda: infcl_clip_loss(x, y, tau)
        if impl == "inf_cl":
            return _infcl_kernels(x, y, tau)
        if impl == "open_clip":
            peer = load_open_clip_loss().ClipLoss()
            return lambda: peer(normalize(x, dim=1), normalize(y, dim=1), 1 / tau)
        if impl == "dense-compiled":
            compiled = torch.compile(dense_clip, dynamic=False)
            return lambda: compiled(x, y, tau)
        return lambda: dense_clip(x, y, tau)
    if impl in ("ours", "ours-dense"):
        return lambda: tc.siglip_loss(x, y, 1 / tau, -10.0, chunk_size=chunk, backend=_BACKEND[0])
    if impl == "open_clip":
        siglip_peer = load_open_clip_loss().SigLipLoss()
        return lambda: siglip_peer(normalize(x, dim=1), normalize(y, dim=1), 1 / tau, -10.0)
    return lambda: _dense_siglip(x, y, 1 / tau, -10.0)


def dense_info_nce(q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor, tau: float) -> torch.Tensor:
    """In-batch keys plus a queue, densely: N x (N + Q) logits and a cross-entropy."""
    normalize = torch.nn.functional.normalize
    q = normalize(q, dim=1)
    logits = q @ torch.cat([normalize(k, dim=1), normalize(queue, dim=1)]).T / tau
    return torch.nn.functional.cross_entropy(logits, torch.arange(q.shape[0], device=q.device))


def _build_queue(impl: str, x: torch.Tensor, gen: torch.Generator, queue_rows: int, tau: float) -> tuple[Any, list[torch.Tensor]]:
    """The info_nce_queue case: queries x, keys and a constant queue (no gradient)."""
    import torch_contrastive as tc

    k = torch.randn(x.shape, generator=gen).to(x).requires_grad_()
    queue = torch.randn(queue_rows, x.shape[1], generator=gen).to(x)
    if impl == "ours":
        return (lambda: tc.info_nce_loss(x, k, queue, tau, backend=_BACKEND[0])), [x, k]
    if impl == "ours-moco":
        return (lambda: tc.info_nce_loss(x, k, queue, tau, in_batch_negatives=False)), [x, k]
    if impl == "info_nce":
        from info_nce import info_nce  # type: ignore[import-not-found]

        return (lambda: info_nce(x, k, queue, temperature=tau)), [x, k]
    return (lambda: dense_info_nce(x, k, queue, tau)), [x, k]


def dense_guided_info_nce(q: torch.Tensor, k: torch.Tensor, g_q: torch.Tensor, g_k: torch.Tensor, tau: float) -> torch.Tensor:
    """GISTEmbed's filter densely: N x N guide cosines, candidates above the positive's masked with -inf."""
    normalize = torch.nn.functional.normalize
    logits = normalize(q, dim=1) @ normalize(k, dim=1).T / tau
    guide = normalize(g_q, dim=1) @ normalize(g_k, dim=1).T
    eye = torch.eye(q.shape[0], dtype=torch.bool, device=q.device)
    logits = logits.masked_fill((guide > guide.diagonal()[:, None]) & ~eye, float("-inf"))
    return torch.nn.functional.cross_entropy(logits, torch.arange(q.shape[0], device=q.device))


def _build_guide(impl: str, x: torch.Tensor, gen: torch.Generator, tau: float) -> tuple[Any, list[torch.Tensor]]:
    """The info_nce_guide case: queries x, keys, and a guide model's (detached) embeddings of both."""
    import torch_contrastive as tc

    n, d = x.shape
    k = torch.randn(n, d, generator=gen).to(x).requires_grad_()
    g_q = torch.randn(n, d // 2, generator=gen).to(x)
    g_k = (g_q + torch.randn(n, d // 2, generator=gen).to(x))
    if impl == "ours":
        return (lambda: tc.info_nce_loss(x, k, None, tau, guide=(g_q, g_k))), [x, k]
    return (lambda: dense_guided_info_nce(x, k, g_q, g_k, tau)), [x, k]


def _build_nt_xent(impl: str, x: torch.Tensor, tau: float, dense_chunk: int) -> tuple[Any, list[torch.Tensor]]:
    """The closure of an NT-Xent (halves pairing) case."""
    import torch_contrastive as tc

    n, device = x.shape[0], x.device
    if impl in ("ours", "ours-dense"):
        chunk = dense_chunk if impl == "ours-dense" else None
        return (lambda: tc.nt_xent_loss(x, tau, pairing="halves", chunk_size=chunk, backend=_BACKEND[0])), [x]
    if impl == "lightly":
        from lightly.loss import NTXentLoss  # type: ignore[import-not-found]

        peer = NTXentLoss(temperature=tau)
        return (lambda: peer(x[: n // 2], x[n // 2 :])), [x]
    if impl == "pml":
        from pytorch_metric_learning.losses import NTXentLoss as PMLNTXent

        pml = PMLNTXent(temperature=tau)
        pair_labels = torch.arange(n, device=device) % (n // 2)
        return (lambda: pml(x, pair_labels)), [x]
    if impl == "dense-compiled":
        compiled_nt = torch.compile(dense_nt_xent, dynamic=False)
        return (lambda: compiled_nt(x, tau)), [x]
    return (lambda: dense_nt_xent(x, tau)), [x]


def _build(loss: str, impl: str, n: int, d: int, tau: float, device: torch.device,
           spec_classes: int = 100, queue_rows: int = DEFAULT_QUEUE,
           dtype: torch.dtype = torch.float32) -> tuple[Any, list[torch.Tensor]]:
    """A closure computing the loss, and the leaf tensors it differentiates."""
    import torch_contrastive as tc

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=gen).to(device, dtype).requires_grad_()
    dense_chunk = n  # one tile: the "dense" path of the same engine
    if loss == "info_nce_queue":
        return _build_queue(impl, x, gen, queue_rows, tau)
    if loss == "info_nce_guide":
        return _build_guide(impl, x, gen, tau)
    if loss == "matryoshka":
        from .bench_matryoshka import build

        return build(impl, x, gen)
    if loss in ("clip", "siglip"):
        y = torch.randn(n, d, generator=gen).to(device, dtype).requires_grad_()
        return _build_image_text(loss, impl, x, y, tau, dense_chunk), [x, y]
    labels = torch.randint(0, max(2, n // 64), (n,), generator=gen).to(device)
    if loss in ("nt_xent_pml", "nt_bxent"):
        classes = torch.randint(0, int(spec_classes), (n,), generator=gen).to(device)
        if loss == "nt_xent_pml":
            return (lambda: tc.nt_xent_loss(x, tau, labels=classes, backend=_BACKEND[0])), [x]
        return (lambda: tc.nt_bxent_loss(x, labels=classes, temperature=tau, backend=_BACKEND[0])), [x]
    if loss == "nt_xent":
        return _build_nt_xent(impl, x, tau, dense_chunk)
    if impl in ("ours", "ours-dense"):
        chunk = dense_chunk if impl == "ours-dense" else None
        return (lambda: tc.supcon_loss(x, labels, temperature=tau, chunk_size=chunk, backend=_BACKEND[0])), [x]
    if impl == "pml":
        from pytorch_metric_learning.losses import SupConLoss as PMLSupCon

        pml_supcon = PMLSupCon(temperature=tau)
        return (lambda: pml_supcon(x, labels)), [x]
    if impl == "dense-compiled":
        compiled_sc = torch.compile(_dense_supcon, dynamic=False)
        return (lambda: compiled_sc(x, labels, tau)), [x]
    return (lambda: _dense_supcon(x, labels, tau)), [x]


def _time(fn: Any, reps: int, warm: bool = True) -> float:
    """Best of ``reps`` wall-clock runs (after one warm-up run unless ``warm=False``)."""
    if warm:
        fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _gemm_equivalent(loss: str, n: int, d: int) -> float:
    """FLOP of the GEMM-equivalent work of a forward+backward: 2 N^2 D per product, 4 products for
    two sets (logits, their recomputation, G @ B, G.T @ A), 2 for one set (a symmetric matrix)."""
    return (8.0 if loss in ("clip", "siglip") else 4.0) * n * n * d


def matmul_peak(device: torch.device, dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float:
    """The device's measured matmul rate (TFLOP/s) on random ``n x n`` operands: median of ten."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2.0 * n**3 / statistics.median(times) / 1e12


#: The GPU table (the anchors of the GPU issues): (loss, N, D). Dense forms run up to
#: GPU_DENSE_MAX rows (65,536 x 768 needs 64 GiB eager, 16 GiB compiled); beyond, ours and Inf-CL.
GPU_GRID = [("clip", 4096, 512), ("clip", 8192, 512), ("clip", 16384, 768), ("clip", 32768, 768), ("clip", 65536, 768),
            ("nt_xent", 65536, 768), ("clip", 262144, 768)]
GPU_DENSE_MAX = 65536


def infcl_installed() -> bool:
    """Whether the Inf-CL package (``inf_cl``, its Triton kernels) can be imported."""
    import importlib.util

    return importlib.util.find_spec("inf_cl") is not None


def gpu_plan(backends: list[str], sizes: list[int] | None = None) -> list[dict[str, Any]]:
    """The ``--gpu`` cases, bf16: ours per backend beside dense-compiled (the anchor) and dense,
    and Inf-CL's kernels for CLIP when the package is installed; only the rows of ``sizes`` if given."""
    cases = []
    for loss, n, d in GPU_GRID:
        if sizes and n not in sizes:
            continue
        peers = ["dense-compiled", "dense-baseline"] if n <= GPU_DENSE_MAX else []
        if loss == "clip" and infcl_installed():
            peers.append("inf_cl")
        for impl in peers:
            cases.append({"loss": loss, "impl": impl, "n": n, "d": d, "tau": 0.07, "reps": 5, "backend": "torch"})
        for backend in backends:
            if backend not in COVERED or loss in COVERED[backend]:
                cases.append({"loss": loss, "impl": "ours", "n": n, "d": d, "tau": 0.07, "reps": 5, "backend": backend})
    return cases


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one case (called in a fresh process). Returns the measured row."""
    device = torch.device(spec.get("device", "cpu"))
    _BACKEND[0] = spec.get("backend", "auto")
    n, d, tau, reps = spec["n"], spec["d"], spec["tau"], spec["reps"]
    # Warm up on a small batch first: thread pools and BLAS workspaces are allocated
    # once per process and are not the loss's memory.
    queue_rows = int(spec.get("queue", DEFAULT_QUEUE))
    dtype = getattr(torch, spec.get("dtype", "float32"))
    small_fn, small_leaves = _build(spec["loss"], spec["impl"], 256, d, tau, device, spec.get("classes", 100), min(queue_rows, 256),
                                    dtype)
    small_fn().backward()
    del small_fn, small_leaves
    fn, leaves = _build(spec["loss"], spec["impl"], n, d, tau, device, spec.get("classes", 100), queue_rows, dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = _peak_bytes(device)

    values: list[torch.Tensor] = []

    def step() -> None:
        for leaf in leaves:
            leaf.grad = None
        loss = fn()
        loss.backward()
        values.append(loss.detach())
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    first = _time(step, 1, warm=False)
    peak = _peak_bytes(device) - base
    # The loss value, so that a reader (and the tests) can see every implementation computed the same thing.
    row = {**spec, "value": float(values[0]), "seconds": float("nan"), "matmul_seconds": float("nan"), "R": float("nan"),
           "extra_mib": peak / 2**20}
    if n > MAX_REFERENCE_ROWS or device.type == "cuda":
        # The reference's own N x N matrices would not fit (2 x 16 GiB at 65,536); on a GPU
        # absolute times are reported (beside the anchors of the same run) instead of R.
        seconds = _time(step, reps)
        return {**row, "seconds": seconds, "tflops_geq": _gemm_equivalent(spec["loss"], n, d) / seconds / 1e12}
    # The reference: three matmuls of the same shape, allocated after the loss's peak was
    # taken. Loss and reference runs alternate, and R is the median of the per-pair
    # ratios, so a slow spell of the shared machine hits both sides of a ratio alike.
    # With a queue the shape is N x (N + Q) (the in-batch keys plus the queue).
    cols = n + queue_rows if spec["loss"] == "info_nce_queue" else n
    a = torch.randn(n, d, device=device, dtype=dtype)
    b = torch.randn(cols, d, device=device, dtype=dtype)
    g = torch.randn(n, cols, device=device, dtype=dtype)

    def reference() -> None:
        a @ b.T, g @ b, g.T @ a
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    reference()
    count = 3 if first > 2.0 else max(3, 2 * reps + 1)  # slow peers: three pairs are enough
    pairs = [(_time(step, 1, warm=False), _time(reference, 1, warm=False)) for _ in range(count)]
    return {**row, "seconds": statistics.median(p[0] for p in pairs), "matmul_seconds": statistics.median(p[1] for p in pairs),
            "R": statistics.median(p[0] / p[1] for p in pairs)}


def _run_case(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "torch_contrastive.cli.bench", "--worker", json.dumps(spec)]
    # A fixed mmap threshold makes glibc return every freed tensor of >= 1 MiB to the OS,
    # so peak RSS is the peak of live memory (the default dynamic threshold keeps freed
    # blocks of up to 32 MiB in the heap). The same setting applies to every implementation.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**spec, "status": f"timeout > {timeout:.0f}s"}
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["failed"])[-1]
        if "ModuleNotFoundError" in out.stderr:
            status = "not installed"
        elif out.returncode < 0 or "alloc" in out.stderr or "out of memory" in out.stderr:
            status = "out of memory"
        else:
            status = last[:80]
        return {**spec, "status": status}
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "status": "ok"}


def plan(quick: bool, sizes: list[int] | None, dim: int | list[int], tau: float, include_large: bool) -> list[dict[str, Any]]:
    """The list of cases (every size x every dim). Peers with N x N memory only run at sizes they can hold."""
    cases = []
    reps = 1 if quick else 3
    dims = [dim] if isinstance(dim, int) else list(dim)
    grid = [(n, d) for n in (sizes or []) for d in dims]
    for loss in ("clip", "siglip", "nt_xent", "supcon", *ON_REQUEST):
        if loss in ON_REQUEST and not sizes:
            continue  # on request only: --loss nt_xent_pml|nt_bxent|info_nce_queue --sizes N [--classes C] [--queue Q]
        default = [2048, 8192] if loss in ("clip", "siglip") else [4096, 16384]
        loss_grid = grid or [(n, d) for n in (default if quick else [1024, 4096, 8192, 16384]) for d in dims]
        for n, d in loss_grid:
            for impl in IMPLEMENTATIONS[loss]:
                if impl == "pml" and n > 4096:
                    continue  # pytorch-metric-learning builds several N x N float tensors
                if quick and impl not in ("ours",) and n > 8192:
                    continue
                if impl == "ours-dense" and n > 8192:
                    continue
                if loss == "info_nce_queue" and not impl.startswith("ours") and n > 4096:
                    continue  # dense N x (N + Q) logits
                if not impl.startswith("ours") and impl != "infcl-formula" and n > 16384:
                    continue  # the dense peers need several N x N matrices (16 GiB each at 65,536)
                cases.append({"loss": loss, "impl": impl, "n": n, "d": d, "tau": tau, "reps": reps})
    if include_large:
        for impl in ("ours", "infcl-formula"):
            cases.append({"loss": "clip", "impl": impl, "n": 65536, "d": dims[0], "tau": tau, "reps": 1})
    return cases


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ok = [r for r in rows if r.get("status") == "ok"]
    main_d = max({r["d"] for r in ok}, key=lambda d: sum(r["d"] == d for r in ok)) if ok else 0
    ok = [r for r in ok if r["d"] == main_d]  # the plot is against N at the most common D
    for loss in sorted({r["loss"] for r in ok}):
        for impl in sorted({r["impl"] for r in ok if r["loss"] == loss}):
            pts = sorted((r["n"], r["R"], r["extra_mib"]) for r in ok if r["loss"] == loss and r["impl"] == impl)
            style = "-o" if impl.startswith("ours") else "--x"
            timed = [p for p in pts if p[1] == p[1]]  # R is NaN where no matmul reference was run
            axes[0].plot([p[0] for p in timed], [p[1] for p in timed], style, label=f"{loss}/{impl}")
            axes[1].plot([p[0] for p in pts], [max(p[2], 0.1) for p in pts], style, label=f"{loss}/{impl}")
    any_ratio = any(r["R"] == r["R"] for r in ok)
    axes[0].set(xscale="log", yscale="log" if any_ratio else "linear", xlabel="N (rows)",
                ylabel="R = time / 3 matmuls", title="forward+backward time ratio")
    axes[1].set(xscale="log", yscale="log", xlabel="N (rows)", ylabel="extra peak memory (MiB)", title="memory")
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    save_figure(fig, Path(path))
    plt.close(fig)


def _backends(args: argparse.Namespace) -> tuple[list[str], str]:
    """The requested engine backends, and what is wrong with the request ("" if nothing)."""
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    if any(b not in ("auto", "torch", "triton", "epilogue") for b in backends) or not backends:
        return backends, f"--backend takes auto, torch, triton and/or epilogue, got {args.backend!r}"
    for kernels in ("triton", "epilogue"):
        if kernels in backends and args.device != "cuda":
            return backends, f"--backend {kernels} needs --device cuda (on CPU the kernels only run in Triton's slow interpreter)"
    if args.device == "cuda" and not torch.cuda.is_available():
        return backends, "--device cuda: no CUDA device here"
    return backends, ""


def _per_backend(cases: list[dict[str, Any]], backends: list[str]) -> list[dict[str, Any]]:
    """Every "ours" case once per requested backend (a kernel backend only for the losses it covers)."""
    def covers(backend: str, loss: str) -> bool:
        return backend not in COVERED or loss in COVERED[backend]

    extra = [{**c, "impl": "ours", "backend": b} for b in backends[1:] for c in cases
             if c["impl"] == "ours" and covers(b, c["loss"])]
    for c in cases:
        if c["impl"] == "ours":
            c["backend"] = backends[0]
    return [c for c in cases if c["impl"] != "ours" or covers(backends[0], c["loss"])] + extra


def _machine(device: str) -> str:
    """The machine in words; on a GPU with its name and measured bf16 matmul peak."""
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {platform.python_version()}"
    if device == "cuda":
        peak = matmul_peak(torch.device("cuda"))
        machine += f", {torch.cuda.get_device_name()} (bf16 matmul peak measured {peak:.0f} TFLOP/s)"
    return machine


def _counted_or_small(args: argparse.Namespace, out_dir: Path) -> int:
    """``--traffic`` (counted on this machine) and ``--small`` (timed here): no case grid."""
    machine = _machine("cpu")
    if args.traffic:
        from .traffic import run_host, run_traffic

        if args.host:
            return run_host()
        return run_traffic(args.sizes, args.dim, args.calibrate, out_dir, machine)
    from .bench_small import run_small

    return run_small(args.sizes, args.dim, 0.1 if args.temperature == 0.07 else args.temperature, out_dir, machine)


def _grid(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str | None]:
    """The timed cases the options ask for, or why there are none."""
    if args.gpu:
        args.device, args.dtype = "cuda", "bfloat16"
    cases = plan(args.quick, args.sizes, args.dims or [args.dim], args.temperature, args.large)
    backends, problem = _backends(args)
    if problem:
        return [], problem
    cases = gpu_plan(backends, args.sizes) if args.gpu else _per_backend(cases, backends)
    for case in cases:
        case["device"] = args.device
        case["dtype"] = args.dtype
        case.setdefault("backend", "auto")
    if args.loss != "all":
        cases = [c for c in cases if c["loss"] == args.loss]
    else:
        cases = [c for c in cases if c["loss"] not in ON_REQUEST]
    for case in cases:
        case["classes"] = args.classes
        if case["loss"] == "info_nce_queue":
            case["queue"] = args.queue
    return cases, None


def run(args: argparse.Namespace) -> int:
    for flag in ("calibrate", "host"):
        if getattr(args, flag) and not args.traffic:  # before anything is written
            print(f"error: --{flag} goes with --traffic", file=sys.stderr)
            return 2
    unwritable = cannot_write(args.out, "--out", folder=True)
    if unwritable:
        print(f"error: {unwritable}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    if args.calibrate or args.traffic or args.small:
        out_dir.mkdir(parents=True, exist_ok=True)
        return _counted_or_small(args, out_dir)
    cases, problem = _grid(args)
    if problem:  # before the output folder is made
        print(f"error: {problem}", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = _machine(args.device)
    print(f"torch-contrastive bench ({'gpu' if args.gpu else 'quick' if args.quick else 'full'}): {len(cases)} cases on {machine}")
    print(f"{'loss':<8} {'impl':<24} {'N':>6} {'D':>4} {'time s':>8} {'R':>6} {'extra MiB':>10}  status")
    rows = []
    for spec in cases:
        row = _run_case(spec, args.timeout)
        rows.append(row)
        row["impl"] = row["impl"] if row.get("backend", "auto") == "auto" else f"{row['impl']}[{row['backend']}]"
        if row["status"] == "ok":
            rate = f"  {row['tflops_geq']:.0f} TFLOP/s (GEMM-eq)" if "tflops_geq" in row else ""
            print(f"{row['loss']:<8} {row['impl']:<24} {row['n']:>6} {row['d']:>4} {row['seconds']:>8.4f} {row['R']:>6.2f} "
                  f"{row['extra_mib']:>10.1f}  ok{rate}", flush=True)
        else:
            print(f"{row['loss']:<8} {row['impl']:<24} {row['n']:>6} {row['d']:>4} {'':>8} {'':>6} {'':>10}  {row['status']}",
                  flush=True)
    fields = ["loss", "impl", "backend", "device", "dtype", "n", "d", "tau", "classes", "queue", "reps", "value", "seconds", "matmul_seconds",
              "R", "extra_mib", "tflops_geq", "status"]
    with open(out_dir / "bench.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (out_dir / "machine.txt").write_text(machine + "\n")
    if not any(r.get("status") == "ok" for r in rows):
        print(f"wrote {out_dir / 'bench.csv'} (no successful case to plot)")
        return 1
    try:
        _plot(rows, out_dir / "bench.png")
        print(f"wrote {out_dir / 'bench.csv'} and {out_dir / 'bench.png'}")
    except ImportError:
        print(f"wrote {out_dir / 'bench.csv'} (install the 'cli' extra for the plot)")
    return 0


def add_bench_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="time and memory of every loss vs. peers (CSV + PNG)")
    p.add_argument("--quick", action="store_true", help="a reduced grid (about 2-3 minutes on 2 cores)")
    p.add_argument("--small", action="store_true",
                   help="small batches (N = 64, 256, 1024 unless --sizes): every loss vs the plain PyTorch formula, "
                        "time ratio and host syncs per call (tau 0.1 unless --temperature)")
    p.add_argument("--traffic", action="store_true",
                   help="count what the GPU plan costs, on this machine: launches, logit-sized bytes, GEMM FLOPs, host syncs "
                        "per loss beside the dense formula's, and the cost model's predicted H100 time (N = 1024 unless --sizes)")
    p.add_argument("--calibrate", action="store_true", help="with --traffic: fit the model to the measured H100 rows")
    p.add_argument("--host", action="store_true",
                   help="with --traffic: time small calls on this CPU and fit a Python bytecode's host cost against an eager op's")
    p.add_argument("--loss", choices=["all", "clip", "siglip", "nt_xent", "supcon", *ON_REQUEST],
                   default="all", help="nt_xent_pml (labels, pytorch-metric-learning convention), nt_bxent (labels), "
                                       "info_nce_queue (N queries, their keys and a queue of --queue negatives), "
                                       "info_nce_guide (guide-model masking, guide size D/2) and matryoshka (MNRL over the "
                                       "prefixes 768/512/256/128/64 up to D, ours vs sentence-transformers') need --sizes")
    p.add_argument("--queue", type=positive_int, default=DEFAULT_QUEUE,
                   help=f"queue rows of info_nce_queue (default {DEFAULT_QUEUE})")
    p.add_argument("--classes", type=positive_int, default=100, help="random classes for nt_xent_pml / nt_bxent (default 100)")
    p.add_argument("--sizes", type=batch_sizes, default=None, help="comma-separated N values (rows; even, >= 2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="input dtype of every case (default float32; the reference matmuls use it too)")
    p.add_argument("--dim", type=positive_int, default=128, help="embedding size D (default 128)")
    p.add_argument("--dims", type=int_list, default=None, help="comma-separated D values (a D sweep; overrides --dim)")
    p.add_argument("--temperature", type=positive_float, default=0.07, help="tau (default 0.07; 0.01 exercises the online maximum)")
    p.add_argument("--large", action="store_true", help="add the image-text loss at N = 65,536 (ours only)")
    p.add_argument("--timeout", type=positive_float, default=600.0, help="seconds per case")
    p.add_argument("--out", default="bench-results", help="output folder (CSV, PNG)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where every case runs (default cpu)")
    p.add_argument("--backend", default="auto",
                   help="engine backend(s) of 'ours', comma-separated: auto (default), torch, triton, epilogue (the last two "
                        "need --device cuda)")
    p.add_argument("--gpu", action="store_true",
                   help="the GPU table (GPU_GRID): CLIP 4,096 to 262,144 rows, NT-Xent 65,536 x 768, bf16, ours per --backend "
                        "beside dense-compiled and dense (up to 65,536 rows) and Inf-CL's kernels when installed "
                        "(implies --device cuda --dtype bfloat16)")
    p.set_defaults(func=run)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))))
    else:
        sys.exit("use: torch-contrastive bench")
