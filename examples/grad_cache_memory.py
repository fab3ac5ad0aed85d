"""Peak memory and time of one training step, full batch vs gradient caching (grad_cache).

    python examples/grad_cache_memory.py [--rows 16384] [--micro-batch 512] [--repeats 3]

A 256 -> 2048 -> 2048 -> 64 MLP encodes ``--rows`` rows (two views of rows/2 samples)
and NT-Xent (pairing="halves") is back-propagated into it, either in one piece
(``loss.backward()``) or with ``grad_cache(..., micro_batch)``. Each mode runs in a fresh
process with a fixed 1 MiB mmap threshold, so freed tensors go back to the OS and the peak
RSS growth over the step is the step's own peak memory (inputs, weights and their
gradients are allocated before the baseline is taken). Times are medians of ``--repeats``
steps, measured in the same process as an encoder-only forward+backward of the full batch,
so the ratio survives a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def worker(mode: str, rows: int, micro: int, repeats: int) -> dict[str, float]:
    import torch
    from torch import nn

    import torch_contrastive as tc

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 64))
    x = torch.randn(rows, 256)
    for p in model.parameters():  # the gradients' memory belongs to any training step: allocate it first
        p.grad = torch.zeros_like(p)

    def step() -> None:
        model.zero_grad(set_to_none=False)
        if mode == "full":
            tc.nt_xent_loss(model(x), 0.1, pairing="halves").backward()
        else:
            tc.grad_cache(model, x, tc.nt_xent_loss, micro, temperature=0.1, pairing="halves")

    def encoder_only() -> None:
        model.zero_grad(set_to_none=False)
        model(x).sum().backward()

    small = x[:512]
    tc.nt_xent_loss(model(small), 0.1, pairing="halves").backward()  # thread pools, BLAS workspaces
    base = _rss_bytes()
    step()
    peak = _rss_bytes() - base
    times, encoder_times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        encoder_only()
        encoder_times.append(time.perf_counter() - start)
    return {"peak_mib": peak / 2**20, "step_s": statistics.median(times), "encoder_s": statistics.median(encoder_times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--micro-batch", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.rows, args.micro_batch, args.repeats)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    results = {}
    for mode in ("full", "cached"):
        cmd = [sys.executable, __file__, "--worker", mode, "--rows", str(args.rows), "--micro-batch", str(args.micro_batch),
               "--repeats", str(args.repeats)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    full, cached = results["full"], results["cached"]
    print(f"one NT-Xent step, MLP 256-2048-2048-64, {args.rows} rows, fp32, {os.cpu_count()} cores")
    print(f"{'mode':<28} {'peak extra MiB':>15} {'step s':>8} {'step / encoder fwd+bwd':>24}")
    print(f"{'full batch':<28} {full['peak_mib']:>15.1f} {full['step_s']:>8.3f} {full['step_s'] / full['encoder_s']:>24.2f}")
    label = f"grad_cache, micro_batch={args.micro_batch}"
    print(f"{label:<28} {cached['peak_mib']:>15.1f} {cached['step_s']:>8.3f} {cached['step_s'] / cached['encoder_s']:>24.2f}")
    print(f"memory ratio cached / full: {cached['peak_mib'] / full['peak_mib']:.3f}; "
          f"time overhead: {cached['step_s'] / cached['encoder_s'] - full['step_s'] / full['encoder_s']:+.2f} encoder fwd+bwd")


if __name__ == "__main__":
    main()
