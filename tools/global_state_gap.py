#!/usr/bin/env python3
"""How far a trained global loss's per-sample state is from the full-data normaliser.

For a finished ``torch-contrastive train --loss sogclr`` run: the trained encoder embeds every
training image (no augmentation), and each image's full-data normaliser is
``g_i = mean over the other training images j of exp(<e_i, e_j> / tau)`` -- what the state
``u_i`` estimates from one batch per visit. Prints the distribution of ``|log u_i - log g_i|``
and the rank correlation of ``u`` with ``g`` over the training images.

Usage::

    python tools/global_state_gap.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import math

import torch


def gap(run_dir: str) -> dict[str, float]:
    from torch_contrastive.cli import checkpoint as ckpt
    from torch_contrastive.cli.data import load
    from torch_contrastive.cli.models import embed
    from torch_contrastive.cli.train import Config, build_models

    values = ckpt.load_state(run_dir)
    cfg = Config.from_dict(values["config"])
    if cfg.loss != "sogclr":
        raise SystemExit(f"{run_dir}: a --loss sogclr run is needed, got {cfg.loss}")
    data = load(cfg.data, channels=cfg.channels, size=cfg.image_size, seed=cfg.seed)
    models = build_models(cfg, data)
    models.enc.load_state_dict(values["modules"][0])
    loss_state = values["modules"][-1]
    tau = cfg.temperature
    train = data.train_idx
    emb = embed(models.enc, data.images[train]).double()
    logits = emb @ emb.T / tau
    logits.fill_diagonal_(-math.inf)
    log_g = torch.logsumexp(logits, dim=1) - math.log(len(train) - 1)
    log_u = loss_state["log_u"][train, 0].double()
    diff = (log_u - log_g).abs()

    def ranks(x: torch.Tensor) -> torch.Tensor:
        return x.argsort().argsort().double()

    ru, rg = ranks(log_u), ranks(log_g)
    spearman = float(((ru - ru.mean()) * (rg - rg.mean())).sum() / ((ru - ru.mean()).norm() * (rg - rg.mean()).norm()))
    return {"median": float(diff.median()), "p90": float(diff.quantile(0.9)), "spearman": spearman,
            "mean_log_u": float(log_u.mean()), "mean_log_g": float(log_g.mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    args = parser.parse_args()
    print("run | median abs(log u - log g) | 90th percentile | Spearman(u, g) | mean log u | mean log g")
    for run in args.runs:
        r = gap(run)
        print(f"{run} | {r['median']:.3f} | {r['p90']:.3f} | {r['spearman']:.3f} | {r['mean_log_u']:.3f} | {r['mean_log_g']:.3f}")


if __name__ == "__main__":
    main()
