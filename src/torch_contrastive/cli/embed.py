"""``torch-contrastive embed``: a trained run's encoder applied to a data set, saved as NumPy.

Writes ``--out`` (an ``.npy`` of L2-normalised image embeddings, one row per image) and
beside it ``labels.npy`` (class index per row) and ``classes.json`` for labelled data,
or ``captions.json`` (one entry per caption row: image index, image file, caption) and
``text_emb.npy`` (the caption rows' embeddings) for a caption CSV.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from . import checkpoint as ckpt
from ._paths import cannot_write, save_npy, write_atomically
from .data import DataError, load
from .device import DEVICES, DeviceError, resolve_device
from .models import ImageEncoder, TextEncoder, Vocabulary, embed, embed_text


def run(args: argparse.Namespace) -> int:

    from .train import Config

    unwritable = cannot_write(args.out, "--out", folder=False)
    if unwritable:
        print(f"error: {unwritable}", file=sys.stderr)
        return 2
    try:
        values = ckpt.load_state(args.run)
    except ckpt.ResumeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    cfg = Config.from_dict(values["config"])
    try:
        device = resolve_device(args.device)
    except DeviceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    source = args.data if args.data is not None else cfg.data
    try:
        data = load(source, channels=cfg.channels, size=cfg.image_size, seed=cfg.seed)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    enc = ImageEncoder(cfg.dim, data.channels, data.size)
    try:
        enc.load_state_dict(values["modules"][0])
    except RuntimeError:  # the encoder's first and last layers are sized by the images it was trained on
        print(f"error: --run {args.run}'s encoder does not take --data {source}'s images ({data.channels} channel(s), "
              f"{data.size}x{data.size} px); embed data like the run's training data ({cfg.data or 'digits'})", file=sys.stderr)
        return 2
    enc.to(device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_npy(out, embed(enc, data.images).numpy())  # each output lands whole (a temporary name, then renamed)
    written = [str(out)]
    if data.labels is not None:
        save_npy(out.parent / "labels.npy", data.labels.numpy())
        write_atomically(out.parent / "classes.json", (json.dumps(data.class_names, indent=2) + "\n").encode())
        written += ["labels.npy", "classes.json"]
    if data.row_image is not None:
        rows = [{"image_index": int(i), "image": data.paths[int(i)], "caption": c} for i, c in zip(data.row_image, data.captions)]
        write_atomically(out.parent / "captions.json", (json.dumps(rows, indent=2) + "\n").encode())
        written.append("captions.json")
        if values.get("vocabulary") is not None:
            vocab = Vocabulary.from_words(values["vocabulary"])
            text = TextEncoder(len(vocab.words), cfg.dim)
            text.load_state_dict(values["modules"][1])
            text.to(device)
            save_npy(out.parent / "text_emb.npy", embed_text(text, vocab, data.captions).numpy())
            written.append("text_emb.npy")
    print(f"embedded {len(data.images)} images with {args.run}'s encoder ({cfg.dim}-d, on {device}); wrote {', '.join(written)}")
    return 0


def add_embed_parser(sub: Any) -> None:
    p = sub.add_parser("embed", help="write a trained run's embeddings of a data set (.npy)")
    p.add_argument("--run", required=True, metavar="RUN_DIR", help="a training run directory (its checkpoint.pt)")
    p.add_argument("--data", default=None, help="image folder or caption CSV (default: the data the run was trained on)")
    p.add_argument("--out", default="emb.npy", help="output .npy (default emb.npy); labels/captions are written beside it")
    p.add_argument("--device", choices=DEVICES, default="auto", help="auto: CUDA when a GPU is visible (default auto)")
    p.set_defaults(func=run)
