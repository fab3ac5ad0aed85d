"""Train a tiny encoder with DDP + gathered NT-Xent on random data.

    torchrun --nproc_per_node=2 examples/ddp_simclr.py --steps 20 [--check]

Each rank draws its own slice of a shared random batch, encodes two noisy views,
and calls ``nt_xent_loss(..., gather=True)``: the loss is the global-batch loss and,
after DDP averages the gradients, the weights follow single-process training on the
concatenated batch. ``--check`` replays the run in one process on rank 0 and
compares the weights.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import torch_contrastive as tc


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).double()


def batch(step: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    base = torch.randn(total, 16, generator=g, dtype=torch.float64)
    return base + 0.1 * torch.randn(total, 16, generator=g, dtype=torch.float64), base + 0.1 * torch.randn(
        total, 16, generator=g, dtype=torch.float64)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--per-rank", type=int, default=8, help="images per rank per step")
    parser.add_argument("--check", action="store_true", help="compare with single-process training")
    args = parser.parse_args()
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    total = args.per_rank * world
    for step in range(args.steps):
        v1, v2 = batch(step, total)
        mine = slice(rank * args.per_rank, (rank + 1) * args.per_rank)
        z = model(torch.cat([v1[mine], v2[mine]]))  # this rank's (2n, D): halves pairing
        loss = tc.nt_xent_loss(z, 0.5, pairing="halves", gather=True)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step}: global loss {loss.item():.6f}")
    if args.check and rank == 0:
        ref = make_model()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(args.steps):
            v1, v2 = batch(step, total)
            # The global batch in rank order: each rank's [view1; view2] block, so
            # positives pair rows within a block (labels give exactly that).
            blocks = [torch.cat([v1[r * args.per_rank:(r + 1) * args.per_rank], v2[r * args.per_rank:(r + 1) * args.per_rank]])
                      for r in range(world)]
            keys = torch.cat([torch.arange(2 * args.per_rank) % args.per_rank + r * 2 * args.per_rank for r in range(world)])
            loss = tc.nt_xent_loss(ref(torch.cat(blocks)), 0.5, labels=keys)
            ref_opt.zero_grad()
            loss.backward()
            ref_opt.step()
        diff = max((a - b).abs().max().item() for a, b in zip(model.module.parameters(), ref.parameters()))
        status = "matches single-process" if diff < 1e-9 else "DIFFERS from single-process"
        print(f"max weight difference {diff:.3e}: {status}")
        if diff >= 1e-9:
            raise SystemExit(1)
    # Tear down together, then leave without interpreter finalisation: gloo worker threads
    # can still hold tensors at that point and abort the process ("terminate called without
    # an active exception", a known PyTorch/gloo teardown race) after everything succeeded.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
