"""``torch-contrastive train``'s command line: the arguments, their checks before any work (paths,
device, options), and the run (see :mod:`.train` for the recipes and the training loop)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ..losses.global_contrastive import GAMMA_SCHEDULES, TEMPERATURE_MODES
from . import checkpoint as ckpt
from . import train as training
from ._argtypes import batch_size, finite_float, non_negative_int, positive_float, positive_int, unit_fraction
from ._paths import cannot_write
from .data import DataError, load
from .device import DEVICES, PRECISIONS, DeviceError, resolve_device, resolve_precision
from .train import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_EPOCHS,
    DEFAULT_TEMPERATURE,
    GLOBAL,
    RECIPES,
    SCHEDULES,
    Config,
    check_recipe_data,
)

__all__ = ["add_train_parser", "run"]


def _config_from_args(args: argparse.Namespace) -> Config:
    channels = args.channels if args.channels is not None else (3 if args.data else 1)
    return Config(loss=args.loss, epochs=args.epochs or DEFAULT_EPOCHS, batch_size=args.batch_size or DEFAULT_BATCH_SIZE[args.loss], dim=args.dim,
                  lr=args.lr, temperature=args.temperature if args.temperature is not None else DEFAULT_TEMPERATURE[args.loss],
                  seed=args.seed, dedupe_ids=args.dedupe_ids, logit_bias=args.logit_bias, chunk_size=args.chunk_size,
                  distributed=args.distributed, data=args.data, channels=channels, image_size=args.image_size,
                  micro_batch=args.micro_batch, device=args.device, precision=args.precision, schedule=args.schedule,
                  prefetch=args.prefetch, gamma=args.gamma, gamma_schedule=args.gamma_schedule,
                  gamma_decay_epochs=args.gamma_decay_epochs, temperature_mode=args.temperature_mode,
                  out=args.out or os.path.join("runs", f"{args.loss}-{time.strftime('%Y%m%d-%H%M%S')}"))


def run(args: argparse.Namespace) -> int:
    resume = None
    if args.resume is not None:
        try:
            cfg, resume = ckpt.open_run(args.resume, args.epochs)
        except ckpt.ResumeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        if resume is None:
            print(f"{args.resume}: this run already finished ({cfg.epochs} epochs; metrics.json is there); nothing to resume "
                  "(--epochs M extends a --schedule constant run)")
            return 0
    else:
        cfg = _config_from_args(args)
    problem = _check_run(cfg, args, resume is not None)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    unset = [name for name in _RENDEZVOUS if name not in os.environ] if cfg.distributed else []
    if unset:
        print(f"error: --distributed must run under torchrun ({', '.join(unset)} not set), e.g. "
              "torchrun --nproc_per_node=2 -m torch_contrastive train --distributed", file=sys.stderr)
        return 2
    try:
        # read and check the data before anything is written
        data = load(cfg.data, channels=cfg.channels, size=cfg.image_size, seed=cfg.seed)
        check_recipe_data(cfg, data)
        if resume is not None:
            ckpt.check_split(resume, data)
    except (DataError, ckpt.ResumeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(cfg.out)
    created = not out.exists()
    # --overwrite: the earlier run's files move aside first, so a failure of this one never leaves its config beside
    # the earlier checkpoint and metrics (a --resume would call that run finished); they go once this run finishes
    aside = _move_aside(out) if resume is None and getattr(args, "overwrite", False) else None
    try:
        training.train(cfg, progress=not args.quiet, resume=resume, data=data)  # through the module: tests may stand in for it
    except training.Diverged as err:
        _after_failure(out, created, aside)
        print(f"error: {err}", file=sys.stderr)
        return 2
    except BaseException:
        _after_failure(out, created, aside)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    if cfg.distributed:
        import torch.distributed as dist

        # Tear down together, then skip interpreter finalisation: gloo worker threads can still
        # hold tensors then and abort the process (a known PyTorch/gloo teardown race).
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


RUN_FILES = ("metrics.json", "checkpoint.pt", "config.json")
#: what torchrun sets for each process (the env:// rendezvous reads all four)
_RENDEZVOUS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: everything a run writes into its folder
RUN_OUTPUTS = (*RUN_FILES, "loss.png", "embedding.png")


def _move_aside(out: Path) -> Path | None:
    """The earlier run's files in ``out`` moved into a sibling folder (said in one line), or None when there are none."""
    found = [out / name for name in RUN_OUTPUTS if (out / name).exists()]
    if not found:
        return None
    aside = out.with_name(f"{out.name}.replaced")
    stamp = 1
    while aside.exists():
        stamp += 1
        aside = out.with_name(f"{out.name}.replaced-{stamp}")
    aside.mkdir()
    for path in found:
        os.replace(path, aside / path.name)
    print(f"--overwrite: moved the earlier run's {', '.join(p.name for p in found)} to {aside} until this run finishes",
          file=sys.stderr)
    return aside


def _after_failure(out: Path, created: bool, aside: Path | None) -> None:
    """What a failed run leaves: a folder it created without a finished epoch goes (nothing in it was finished); a
    checkpoint of finished epochs stays, to resume; an earlier run moved aside by --overwrite stays where it was moved."""
    finished = (out / ckpt.CHECKPOINT).exists()
    if created and not finished:
        shutil.rmtree(out, ignore_errors=True)
    elif finished:
        print(f"this run failed; {out} keeps the checkpoint of its finished epochs (--resume {out} continues it)", file=sys.stderr)
    if aside is not None:
        print(f"this run failed; the earlier run {out} held is kept in {aside}", file=sys.stderr)


def _check_run(cfg: Config, args: argparse.Namespace, resuming: bool) -> str | None:
    """Why this run cannot start (one line), or None: the output folder, device and precision."""
    out = Path(cfg.out)
    unwritable = cannot_write(out, "--resume" if resuming else "--out", folder=True)
    if unwritable:
        return unwritable
    if not resuming:
        found = [f for f in RUN_FILES if (out / f).exists()]
        if found and not getattr(args, "overwrite", False):
            return f"--out {out} already holds a run ({', '.join(found)}); pass --overwrite to replace it, or choose another --out"
    if cfg.loss not in GLOBAL and (cfg.temperature_mode != "auto" or cfg.gamma_schedule != "constant"):
        return f"--temperature-mode and --gamma-schedule apply to --loss sogclr and fastclip, not {cfg.loss}"
    try:
        device = resolve_device(cfg.device, cfg.distributed)
        precision = resolve_precision(cfg.precision, device)
    except DeviceError as err:
        return str(err)
    if precision == "fp16" and cfg.micro_batch is not None:
        return "--precision fp16 does not combine with --micro-batch (the cached gradients are not loss-scaled); use bf16 or fp32"
    return None


def add_train_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="train a contrastive model (bundled digits, or --data: your images) and evaluate it",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--loss", choices=RECIPES, default="clip", help="recipe (default clip)")
    p.add_argument("--data", default=None,
                   help="a folder of class subfolders (nt_xent, nt_bxent, supcon) or a CSV with columns image, caption "
                        "[, image_id] (clip, siglip); default: scikit-learn's digits")
    p.add_argument("--channels", type=int, choices=(1, 3), default=None, help="--data: 1 grayscale or 3 RGB (default 3)")
    p.add_argument("--image-size", type=positive_int, default=32, help="--data: images are resized to this square (default 32)")
    p.add_argument("--epochs", type=positive_int, default=None,
                   help=f"passes over the training split (default {DEFAULT_EPOCHS}); with --resume: extend the run to this many")
    p.add_argument("--schedule", choices=SCHEDULES, default="onecycle",
                   help="learning rate: onecycle, or constant after a warm-up epoch (a constant run can be extended exactly)")
    p.add_argument("--batch-size", type=batch_size, default=None, help="images per step (default: clip 256, others 128)")
    p.add_argument("--dim", type=positive_int, default=16, help="embedding size (default 16)")
    p.add_argument("--lr", type=positive_float, default=2e-3, help="peak learning rate (AdamW, one-cycle schedule)")
    p.add_argument("--temperature", type=positive_float, default=None,
                   help="tau (default: clip 0.07, its learnable initial value; nt_xent 0.1; nt_bxent 0.3; supcon 0.1)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the split, initialisation and augmentations")
    p.add_argument("--dedupe-ids", action=argparse.BooleanOptionalAction, default=True,
                   help="clip, siglip: pass image/caption ids so duplicate captions are positives (default on)")
    p.add_argument("--logit-bias", type=finite_float, default=-3.0, help="siglip: initial logit bias (the paper's -10 is for 32k batches)")
    p.add_argument("--gamma", type=unit_fraction, default=0.9, help="sogclr, fastclip: a batch's weight in each sample's moving "
                   "average (0, 1] (default 0.9)")
    p.add_argument("--gamma-schedule", choices=GAMMA_SCHEDULES, default="constant",
                   help="sogclr, fastclip: constant, or cosine from 1 to --gamma over --gamma-decay-epochs")
    p.add_argument("--gamma-decay-epochs", type=positive_int, default=None, help="the cosine schedule's length (default: half the epochs)")
    p.add_argument("--temperature-mode", choices=("auto", *TEMPERATURE_MODES), default="auto",
                   help="sogclr, fastclip: fixed, global (a learnable tau, RGCL-g), individual (iSogCLR); auto: fastclip global, "
                        "sogclr fixed")
    p.add_argument("--chunk-size", type=positive_int, default=None, help="tile rows for the loss (default automatic)")
    p.add_argument("--distributed", action="store_true", help="run under torchrun with gather=True and DDP")
    p.add_argument("--micro-batch", type=positive_int, default=None,
                   help="gradient caching: encode this many rows at a time (same gradients, less activation memory)")
    p.add_argument("--out", default=None, help="output folder (default runs/<loss>-<timestamp>); an existing run is refused")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    p.add_argument("--prefetch", choices=("auto", "on", "off"), default="auto",
                   help="augment, pin and copy the next batch on a background thread while the GPU trains (auto: on a GPU)")
    p.add_argument("--device", choices=DEVICES, default="auto", help="auto: CUDA when a GPU is visible (each torchrun rank its own)")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="autocast of the encoders: auto = bf16 on a GPU, fp32 on a CPU; the loss accumulates in fp32")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue an interrupted run from RUN_DIR/checkpoint.pt (its config.json; other options but --epochs are "
                        "ignored)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or table")
    p.set_defaults(func=run)
