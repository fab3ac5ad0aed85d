"""Matryoshka MNRL, ours in one pass against the per-prefix computation, alternated in one process.

    python tools/matryoshka_ratio.py --n 4096 --d 768 --pairs 5

Both sides are ``bench --loss matryoshka``'s closures (forward + backward, prefixes 768/512/256/128/64 up
to D); each pair times ours then the peer's, and the median of the per-pair ratios is printed, so a slow
spell of a shared machine touches both sides of a ratio alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from torch_contrastive.cli.bench_matryoshka import build


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--pairs", type=int, default=5)
    args = p.parse_args()
    steps = {}
    for impl in ("ours", "sentence-transformers"):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(args.n, args.d, generator=gen).requires_grad_()
        fn, leaves = build(impl, x, gen)

        def step(fn=fn, leaves=leaves) -> None:
            for leaf in leaves:
                leaf.grad = None
            fn().backward()

        step()  # warm-up
        steps[impl] = step
    ratios = []
    for _ in range(args.pairs):
        t0 = time.perf_counter()
        steps["ours"]()
        t1 = time.perf_counter()
        steps["sentence-transformers"]()
        t2 = time.perf_counter()
        ratios.append((t1 - t0) / (t2 - t1))
        print(f"ours {t1 - t0:.3f} s, per prefix {t2 - t1:.3f} s, ratio {ratios[-1]:.3f}", flush=True)
    print(f"median ratio ours / per prefix: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
