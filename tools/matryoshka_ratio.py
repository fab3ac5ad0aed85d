"""Matryoshka in one pass against the per-prefix computation, alternated in one process.

    python tools/matryoshka_ratio.py --n 4096 --d 768 --pairs 5
    python tools/matryoshka_ratio.py --wrapped --n 1024 --d 768

Default: MNRL, both sides ``bench --loss matryoshka``'s closures (ours against sentence-transformers'
``MatryoshkaLoss``). ``--wrapped``: every loss form ``tc.matryoshka_loss`` runs in one pass (CLIP plain and
with image ids, InfoNCE, NT-Xent's DCL, SupCon, PML's NT-Xent and NT-BXent with 100 classes, the global contrastive
losses with one module per prefix), one pass
against ``one_pass=False``. Forward + backward, prefixes 768/512/256/128/64 up to D; each pair times both
sides in turn and the median of the per-pair ratios is printed, so a slow spell of a shared machine touches
both sides of a ratio alike.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import torch_contrastive as tc
from torch_contrastive.cli.bench_matryoshka import build


def _median_ratio(ours: Callable[[], None], theirs: Callable[[], None], pairs: int, verbose: bool) -> float:
    ours()  # warm-up
    theirs()
    ratios = []
    for _ in range(pairs):
        t0 = time.perf_counter()
        ours()
        t1 = time.perf_counter()
        theirs()
        t2 = time.perf_counter()
        ratios.append((t1 - t0) / (t2 - t1))
        if verbose:
            print(f"ours {t1 - t0:.3f} s, per prefix {t2 - t1:.3f} s, ratio {ratios[-1]:.3f}", flush=True)
    return statistics.median(ratios)


def _mnrl(n: int, d: int, pairs: int) -> None:
    steps = {}
    for impl in ("ours", "sentence-transformers"):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(n, d, generator=gen).requires_grad_()
        fn, leaves = build(impl, x, gen)

        def step(fn=fn, leaves=leaves) -> None:
            for leaf in leaves:
                leaf.grad = None
            fn().backward()

        steps[impl] = step
    print(f"median ratio ours / per prefix: {_median_ratio(steps['ours'], steps['sentence-transformers'], pairs, True):.3f}")


def _wrapped(n: int, d: int, pairs: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(n, d, generator=gen).requires_grad_() for _ in range(2))
    labels, ids = torch.randint(0, 100, (n,), generator=gen), torch.randint(0, (7 * n) // 10, (n,), generator=gen)
    dims = [p for p in (768, 512, 256, 128, 64) if p <= d]
    memory, memory_labels = torch.randn(n // 4, d, generator=gen), torch.randint(0, 100, (n // 4,), generator=gen)
    pairs_ = torch.stack([torch.arange(n), (torch.arange(n) + n // 2) % n], 1)  # each row's partner, both ways
    forms: dict[str, tuple[Any, list[torch.Tensor], dict[str, Any]]] = {"clip": (tc.clip_loss, [x, y], {"temperature": 0.07}),
             "clip image_id": (tc.clip_loss, [x, y], {"image_id": ids, "temperature": 0.07}),
             "info_nce": (tc.info_nce_loss, [x, y], {}),
             "nt_xent decoupled": (tc.nt_xent_loss, [x], {"decoupled": True, "temperature": 0.1}),
             "supcon labels": (tc.supcon_loss, [x], {"labels": labels}),
             "nt_xent labels (PML)": (tc.nt_xent_loss, [x], {"labels": labels, "temperature": 0.1}),
             "nt_bxent labels": (tc.nt_bxent_loss, [x], {"labels": labels, "temperature": 0.1}),
             "supcon mask": (tc.supcon_loss, [x], {"mask": labels[:, None] == labels[None, :]}),
             "supcon memory": (tc.supcon_loss, [x], {"labels": labels, "memory_emb": memory, "memory_labels": memory_labels}),
             "nt_xent memory (PML)": (tc.nt_xent_loss, [x], {"labels": labels, "memory_emb": memory,
                                                             "memory_labels": memory_labels, "temperature": 0.1}),
             "nt_bxent pos_indices": (tc.nt_bxent_loss, [x], {"pos_indices": pairs_, "temperature": 0.1}),
             "siglip image_id": (tc.siglip_loss, [x, y], {"logit_scale": 10.0, "logit_bias": -10.0, "image_id": ids})}
    index = torch.arange(n)
    for mode in ("unimodal", "bimodal"):  # one GlobalContrastiveLoss per prefix, each its own state
        forms[f"global {mode}"] = ([tc.GlobalContrastiveLoss(n, mode) for _ in dims], [x, y], {"index": index})
    for name, (fn, tensors, kwargs) in forms.items():
        def run(one: bool, fn=fn, tensors=tensors, kwargs=kwargs) -> None:
            x.grad = y.grad = None
            tc.matryoshka_loss(fn, tensors, dims, one_pass=one, **kwargs).backward()

        ratio = _median_ratio(lambda run=run: run(True), lambda run=run: run(False), pairs, False)
        print(f"{name:<22} one pass / per prefix: {ratio:.2f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--wrapped", action="store_true", help="every one-pass form of tc.matryoshka_loss against one_pass=False")
    args = p.parse_args()
    (_wrapped if args.wrapped else _mnrl)(args.n, args.d, args.pairs)


if __name__ == "__main__":
    main()
