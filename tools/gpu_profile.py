"""Where a default call's time goes on a GPU: device time, host time and launches per call, beside
the eager dense formula, and one ``torch.profiler`` table (run by ``tools/gpu_check.py``).

Per loss and size (bf16, D 512, tau 0.07, forward+backward to the inputs):

* ``device ms``: CUDA-event time per call over 20 calls queued back to back (one sync at the end);
* ``host ms``: wall time to queue one call with no sync -- when it is close to the device time the
  call is bound by Python and launch overhead, not by the GPU;
* ``launches``: CUDA kernels per call, counted by the profiler.
"""

from __future__ import annotations

import sys
import time

import torch

sys.path.insert(0, "src")
from torch_contrastive.cli import bench

CASES = [("clip", 1024), ("clip", 4096), ("clip", 8192), ("nt_xent", 4096), ("nt_xent", 8192), ("supcon", 8192),
         ("nt_xent_pml", 8192), ("nt_bxent", 8192), ("siglip", 8192)]


def _step(fn, leaves):
    def step() -> None:
        for leaf in leaves:
            leaf.grad = None
        fn().backward()

    return step


def measure(step, reps: int = 20) -> tuple[float, float, int]:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = []
    start.record()
    for _ in range(reps):
        t = time.perf_counter()
        step()
        host.append(time.perf_counter() - t)
    end.record()
    end.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    launches = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return start.elapsed_time(end) / reps, 1e3 * sorted(host)[len(host) // 2], launches


def main() -> None:
    import torch_contrastive as tc

    device = torch.device("cuda")
    print(f"{'loss':<12} {'N':>6} {'impl':<16} {'device ms':>10} {'host ms':>8} {'launches':>8}")
    for loss, n in CASES:
        for impl, backend in (("dense-baseline", "torch"), ("ours", "auto"), ("ours", "epilogue"), ("ours", "torch")):
            if backend == "epilogue" and loss not in bench.EPILOGUE_LOSSES:
                continue
            if impl == "dense-baseline" and loss in ("nt_xent_pml", "nt_bxent"):
                continue
            bench._BACKEND[0] = backend
            try:
                fn, leaves = bench._build(loss, impl, n, 512, 0.07, device, 100, 65536, torch.bfloat16)
                dev, host, launches = measure(_step(fn, leaves))
                print(f"{loss:<12} {n:>6} {impl + '[' + backend + ']':<16} {dev:>10.3f} {host:>8.3f} {launches:>8}", flush=True)
            except Exception as err:  # a failing case is reported, the others still run
                print(f"{loss:<12} {n:>6} {impl + '[' + backend + ']':<16} FAILED {type(err).__name__}: {str(err)[:300]}", flush=True)
    x = torch.randn(8192, 512, device=device, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randn(8192, 512, device=device, dtype=torch.bfloat16, requires_grad=True)
    print(tc.explain(tc.clip_loss, x, y, 0.07)[0])
    step = _step(lambda: tc.clip_loss(x, y, 0.07), [x, y])
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    try:
        print(averages.table(sort_by="self_device_time_total", row_limit=30))
    except (AttributeError, KeyError, ValueError):
        print(averages.table(sort_by="self_cuda_time_total", row_limit=30))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
