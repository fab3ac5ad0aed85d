"""Measure what gather=True costs: collectives vs. local compute, per training step.

    torchrun --standalone --nproc_per_node=2 examples/gather_cost.py --per-rank 4096 --dim 128

Rank 0 prints, for the image-text loss: the time of the autograd all-gather of both
feature matrices (forward + backward), the time of the whole distributed loss
(forward + backward, each rank computing only its rows), and the single-process
time of the same global batch, all measured in this run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

import torch_contrastive as tc


def best_of(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per-rank", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # one core per rank on the 2-core machine
    g = torch.Generator().manual_seed(rank)
    img = torch.randn(args.per_rank, args.dim, generator=g, requires_grad=True)
    txt = torch.randn(args.per_rank, args.dim, generator=g, requires_grad=True)

    def gather_only() -> None:
        both = tc.all_gather_with_grad(img).sum() + tc.all_gather_with_grad(txt).sum()
        both.backward()

    def distributed_loss() -> None:
        tc.image_text_contrastive_loss(img, txt, 0.07, gather=True).backward()

    t_gather = best_of(gather_only, args.reps)
    t_loss = best_of(distributed_loss, args.reps)
    if rank == 0:
        full_img = torch.randn(args.per_rank * world, args.dim, requires_grad=True)
        full_txt = torch.randn(args.per_rank * world, args.dim, requires_grad=True)
        start = time.perf_counter()
        tc.image_text_contrastive_loss(full_img, full_txt, 0.07).backward()
        t_single = time.perf_counter() - start
        mib = args.per_rank * args.dim * 4 / 2**20
        print(f"world {world}, {args.per_rank} rows/rank, D={args.dim}, fp32, gloo on CPU, 1 thread per rank")
        print(f"features per rank per input: {mib:.1f} MiB; forward all_gather receives {(world - 1) * mib:.1f} MiB per input, "
              f"backward all_reduce moves {world * mib:.1f} MiB per input")
        print(f"all-gather fwd+bwd (2 inputs): {t_gather * 1e3:8.1f} ms")
        print(f"distributed loss fwd+bwd:      {t_loss * 1e3:8.1f} ms  (gather share {100 * t_gather / t_loss:.0f}%)")
        print(f"single process, global batch:  {t_single * 1e3:8.1f} ms  (1 thread)")
    dist.barrier()  # tear down together, and skip finalisation (see examples/ddp_simclr.py)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
