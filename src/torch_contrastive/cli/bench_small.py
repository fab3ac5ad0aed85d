"""``torch-contrastive bench --small``: the common case, 64 to 1,024 rows per call.

At these sizes per-call overhead, kernel launches and host synchronisations decide the
time, not FLOPs. Every loss/convention runs against the plain dense PyTorch formula it
replaces (open_clip's CLIP loss and lightly's NT-Xent -- the large-N bench's dense baselines -- a dense SupCon, a dense
pytorch-metric-learning NT-Xent, a dense NT-BXent), forward + backward, in one process:
loss and formula runs alternate and the ratio is the median of per-pair ratios, so a
slow spell of a shared machine hits both sides alike. The host synchronisations per
call are counted too (``validate=True`` and ``False``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import torch_contrastive as tc

from ._paths import save_figure
from .bench import dense_clip, dense_nt_xent
from .synccount import count_host_syncs

SIZES = (64, 256, 1024)
CLASSES = 10  # labelled cases: CIFAR-10-like classes


def plain_supcon(z: Tensor, labels: Tensor, tau: float) -> Tensor:
    """Dense SupCon (pytorch-metric-learning convention: anchors without positives left out)."""
    z = F.normalize(z, dim=1)
    eye = torch.eye(z.shape[0], dtype=torch.bool, device=z.device)
    log_prob = F.log_softmax((z @ z.T / tau).masked_fill(eye, float("-inf")), dim=1)
    pos = (labels[:, None] == labels[None, :]) & ~eye
    count = pos.sum(1)
    per = -torch.where(pos, log_prob, 0.0).sum(1) / count.clamp_min(1)
    has = count > 0
    return (per * has).sum() / has.sum().clamp_min(1)


def plain_nt_xent_pml(z: Tensor, labels: Tensor, tau: float) -> Tensor:
    """Dense pytorch-metric-learning NT-Xent: one term per positive pair, exact (no clamp)."""
    z = F.normalize(z, dim=1)
    s = z @ z.T / tau
    eye = torch.eye(z.shape[0], dtype=torch.bool, device=z.device)
    same = labels[:, None] == labels[None, :]
    neg_lse = torch.logsumexp(s.masked_fill(same, float("-inf")), dim=1, keepdim=True)
    pos = same & ~eye
    terms = torch.where(pos, F.softplus(neg_lse - s), 0.0)
    return terms.sum() / pos.sum().clamp_min(1)


def plain_nt_bxent(z: Tensor, labels: Tensor, tau: float) -> Tensor:
    """Dense NT-BXent with same-label positives (diagonal counted, not scored)."""
    z = F.normalize(z, dim=1)
    s = z @ z.T / tau
    eye = torch.eye(z.shape[0], dtype=torch.bool, device=z.device)
    same = labels[:, None] == labels[None, :]
    n_pos = same.sum(1)
    n_neg = z.shape[0] - n_pos
    pos_term = torch.where(same & ~eye, F.softplus(-s), 0.0).sum(1) / n_pos
    neg_term = torch.where(same, 0.0, F.softplus(s)).sum(1) / n_neg.clamp_min(1)
    return (pos_term + neg_term).mean()


def cases(n: int, d: int, tau: float, generator: torch.Generator) -> dict[str, tuple[Callable[[bool], Tensor], Callable[[], Tensor], list[Tensor]]]:
    """name -> (ours(validate), plain formula, leaves)."""
    x = torch.randn(n, d, generator=generator).requires_grad_()
    y = torch.randn(n, d, generator=generator).requires_grad_()
    labels = torch.randint(0, CLASSES, (n,), generator=generator)
    return {
        "clip": (lambda val: tc.image_text_contrastive_loss(x, y, tau, validate=val), lambda: dense_clip(x, y, tau), [x, y]),
        "nt_xent halves": (lambda val: tc.nt_xent_loss(x, tau, pairing="halves", validate=val), lambda: dense_nt_xent(x, tau), [x]),
        "supcon labels": (lambda val: tc.supcon_loss(x, labels, temperature=tau, validate=val), lambda: plain_supcon(x, labels, tau), [x]),
        "nt_xent labels (PML)": (lambda val: tc.nt_xent_loss(x, tau, labels=labels, validate=val),
                                 lambda: plain_nt_xent_pml(x, labels, tau), [x]),
        "nt_bxent labels": (lambda val: tc.nt_bxent_loss(x, labels=labels, temperature=tau, validate=val),
                            lambda: plain_nt_bxent(x, labels, tau), [x]),
    }


def _step(fn: Callable[[], Tensor], leaves: list[Tensor]) -> float:
    for leaf in leaves:
        leaf.grad = None
    start = time.perf_counter()
    fn().backward()
    return time.perf_counter() - start


def measure(n: int, d: int = 128, tau: float = 0.1, pairs: int | None = None, validate: bool = True) -> list[dict[str, Any]]:
    """One row per loss/convention at batch size ``n``: median ratio ours / plain, syncs."""
    generator = torch.Generator().manual_seed(n)
    rows = []
    for name, (ours, plain, leaves) in cases(n, d, tau, generator).items():
        value, want = float(ours(validate).detach()), float(plain().detach())
        count = pairs or (200 if n <= 256 else 60)
        def run_ours(o: Callable[[bool], Tensor] = ours) -> Tensor:
            return o(validate)

        for _ in range(5):  # warm-up: allocator, thread pools
            _step(run_ours, leaves)
            _step(plain, leaves)
        ratios, ours_t, plain_t = [], [], []
        for _ in range(count):
            a = _step(run_ours, leaves)
            b = _step(plain, leaves)
            ratios.append(a / b)
            ours_t.append(a)
            plain_t.append(b)
        syncs = {flag: count_host_syncs(lambda o=ours, f=flag: o(f).backward()) for flag in (True, False)}  # type: ignore[misc]
        rows.append({"loss": name, "n": n, "d": d, "tau": tau, "validate": validate, "value": value, "plain_value": want,
                     "ours_ms": 1e3 * statistics.median(ours_t), "plain_ms": 1e3 * statistics.median(plain_t),
                     "ratio": statistics.median(ratios), "syncs_validate": syncs[True], "syncs_no_validate": syncs[False]})
    return rows


def _plot(rows: list[dict[str, Any]], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name in dict.fromkeys(r["loss"] for r in rows):
        pts = sorted((r["n"], r["ratio"]) for r in rows if r["loss"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xscale="log", xlabel="N (rows per call)", ylabel="ours / plain formula (fwd+bwd)",
           title="small batches: time ratio to the plain PyTorch formula")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, Path(path))
    plt.close(fig)


def run_small(sizes: list[int] | None, dim: int, tau: float, out_dir: Any, machine: str) -> int:
    """``torch-contrastive bench --small``: table, ``bench-small.csv`` and ``bench-small.png``."""
    import csv

    sizes = sizes or list(SIZES)
    print(f"torch-contrastive bench --small: N = {sizes}, D = {dim}, tau = {tau}, fp32, on {machine}")
    print("ratio = median over interleaved pairs of (ours fwd+bwd) / (plain formula fwd+bwd), one process")
    print(f"{'loss':<22} {'N':>5} {'ours ms':>8} {'plain ms':>9} {'ratio':>6} {'syncs (validate / not)':>23}")
    rows = []
    for n in sizes:
        for row in measure(n, dim, tau):
            rows.append(row)
            print(f"{row['loss']:<22} {n:>5} {row['ours_ms']:>8.3f} {row['plain_ms']:>9.3f} {row['ratio']:>6.2f} "
                  f"{row['syncs_validate']:>14d} / {row['syncs_no_validate']:d}", flush=True)
    fields = ["loss", "n", "d", "tau", "value", "plain_value", "ours_ms", "plain_ms", "ratio", "syncs_validate", "syncs_no_validate"]
    with open(out_dir / "bench-small.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (out_dir / "machine.txt").write_text(machine + "\n")
    try:
        _plot(rows, out_dir / "bench-small.png")
        print(f"wrote {out_dir / 'bench-small.csv'} and {out_dir / 'bench-small.png'}")
    except ImportError:
        print(f"wrote {out_dir / 'bench-small.csv'} (install the 'cli' extra for the plot)")
    return 0
