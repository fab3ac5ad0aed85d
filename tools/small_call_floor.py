"""Where a small call's time goes: NT-Xent (halves) at 64 rows against the same ATen ops with no Python around them.

`torch-contrastive bench --small` gives ours / the plain formula. This splits ours: a hand-written
``autograd.Function`` that dispatches exactly the ops the engine dispatches for this call (the floor: what
the ops cost), the engine alone (``solve`` of the call's problem, built once), and the whole loss (checks,
the problem built, the one validation read). Forward + backward, and forward alone, interleaved in one
process; medians in microseconds::

    python tools/small_call_floor.py [--rows 64] [--dim 128] [--reps 1500]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch_contrastive as tc
import torch_contrastive.losses.nt_xent as nt_xent_module
from torch_contrastive.cli.bench import dense_nt_xent
from torch_contrastive.engine import solve

TAU, EPS = 0.1, 1e-12


def floor_function(n: int) -> type[torch.autograd.Function]:
    """The engine's one-tile NT-Xent (halves pairing, the positive kept apart, the mean inside) written out as
    one ``autograd.Function``: the same ATen ops, none of the engine's Python."""
    rows = torch.arange(n)
    partner = (rows + n // 2) % n
    positives, mirrored = rows * n + partner, partner * n + rows
    left_out = torch.cat([rows * (n + 1), positives])  # the self pairs and the positives
    zero = torch.zeros(())

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            norm = torch.linalg.vector_norm(x, dim=1, keepdim=True, dtype=torch.float64).to(x.dtype)
            denom = norm.clamp_min(EPS)
            z = x / denom
            tile = torch.addmm(zero, z, z.t(), beta=0, alpha=1.0 / TAU)
            pos = torch.take(tile, positives)
            e = tile.exp_()
            e.view(-1).index_fill_(0, left_out, 0.0)
            excess = e.sum(1)
            exp_pos = pos.exp()
            total = excess + exp_pos
            ctx.save_for_backward(z, denom, norm, e, total, excess)
            return torch.log1p(excess / exp_pos).mean()

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            z, denom, norm, e, total, excess = ctx.saved_tensors
            u = (g * (1.0 / n)) / total
            c = torch.addcmul(zero, u, excess, value=-1)  # the kept-apart positive's coefficient
            grad_tile = (u[:, None] + u).mul_(e)
            flat = grad_tile.view(-1)
            flat.index_add_(0, positives, c.expand(n))
            flat.index_add_(0, mirrored, c.expand(n))
            gz = grad_tile @ z
            radial = (gz * z).sum(1, keepdim=True).masked_fill_(norm <= EPS, 0.0)
            factor = torch.div(norm > 0, denom).mul_(1.0 / TAU)
            return torch.addcmul(gz, z, radial, value=-1).mul_(factor)

    return Floor


def calls(n: int, d: int) -> tuple[dict[str, Callable[[], torch.Tensor]], torch.Tensor]:
    """name -> a call returning the loss: the whole loss, the engine alone, the floor, the plain formula."""
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(n)).requires_grad_()
    built = {}

    def keep(problem):  # the call's problem, built once by the loss itself
        built["problem"] = problem
        return solve(problem)

    nt_xent_module.solve = keep
    try:
        tc.nt_xent_loss(x, TAU, pairing="halves")
    finally:
        nt_xent_module.solve = solve
    floor = floor_function(n)
    return {"loss": lambda: tc.nt_xent_loss(x, TAU, pairing="halves"),
            "engine (solve)": lambda: solve(built["problem"])[0],
            "floor (same ops)": lambda: floor.apply(x),
            "plain formula": lambda: dense_nt_xent(x, TAU)}, x


def medians(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median microseconds of each call, the calls interleaved (alternating order) in one process."""
    names = list(fns)
    for _ in range(100):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(reps):
        for name in names if i % 2 else names[::-1]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return {name: 1e6 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=1500)
    args = p.parse_args()
    fns, x = calls(args.rows, args.dim)

    def step(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            x.grad = None
            fn().backward()
        return run

    both = medians({name: step(fn) for name, fn in fns.items()}, args.reps)
    forward = medians(dict(fns), args.reps)
    plain = both["plain formula"]
    print(f"NT-Xent halves, {args.rows} x {args.dim}, fp32, {torch.get_num_threads()} threads; medians in microseconds")
    print(f"{'':<18} {'fwd+bwd':>8} {'/ plain':>8} {'forward':>8}")
    for name in fns:
        print(f"{name:<18} {both[name]:>8.1f} {both[name] / plain:>8.2f} {forward[name]:>8.1f}")


if __name__ == "__main__":
    main()
