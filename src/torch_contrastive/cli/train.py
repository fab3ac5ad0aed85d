"""``torch-contrastive train``: real contrastive training on scikit-learn's digits.

Nothing is downloaded: the 1,797 8x8 handwritten digits ship with scikit-learn. Five
recipes (``--loss``):

* ``clip`` (default): images <-> captions such as "a handwritten seven", a learned
  bag-of-words text encoder, a learnable temperature. Many images in a batch share a
  caption; ``--dedupe-ids`` (default) passes image and caption ids so duplicates are
  positives (seed 002), ``--no-dedupe-ids`` treats them as negatives.
* ``siglip``: the same images and captions with the sigmoid loss (learnable logit scale
  and bias; scale initialised at 10 as in the SigLIP paper, bias at ``--logit-bias``,
  default -3: the paper's -10 balances 32k negatives per positive, a 512-row batch of
  ten classes needs far less; ids as for ``clip``).
* ``nt_xent``: SimCLR, two augmented views per image (``pairing="halves"``).
* ``nt_bxent``: four views per image, positives as seed 000's ``pos_indices``.
* ``supcon``: two views per image, class labels as positives.

After training, the held-out split is embedded and scored: kNN accuracy (k = 5,
cosine), a linear probe (logistic regression), and for ``clip``/``siglip`` zero-shot accuracy
(nearest class caption), each also for the untrained encoder. Files in ``--out``:
``metrics.json``, ``config.json``, ``loss.png``, ``embedding.png``.

With ``--distributed`` under ``torchrun`` each rank trains on its shard of every
batch with ``gather=True`` and DDP.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import losses
from ..modules import ClipLoss, SigLipLoss
from ._argtypes import positive_float, positive_int

DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TEMPLATES = ["a handwritten {name}", "the digit {name}", "a scan of the number {name}", "a {name} written by hand"]
RECIPES = ("clip", "siglip", "nt_xent", "nt_bxent", "supcon")
IMAGE_TEXT = ("clip", "siglip")
CAPTIONS_PER_IMAGE = 2
#: Default temperature per recipe (clip: the initial value of its learnable temperature).
#: NT-BXent scores pairs with independent sigmoids and did best at 0.3 on this data.
#: siglip: 1 / the initial logit scale (the paper's t = 10; its bias starts at -10).
DEFAULT_TEMPERATURE = {"clip": 0.07, "siglip": 0.1, "nt_xent": 0.1, "nt_bxent": 0.3, "supcon": 0.1}
#: Default images per step. CLIP is trained with large batches (and that is where duplicate
#: captions matter); NT-BXent's four views per image make its batches 4x longer already.
#: SigLIP scores every pair on its own, so the ~25 same-class images per class in a
#: 256-image batch (negatives unless their caption is identical) weigh on it more than on
#: CLIP's soft-max: 128 images (256 rows with two captions each) train it reliably.
DEFAULT_BATCH_SIZE = {"clip": 256, "siglip": 128, "nt_xent": 128, "nt_bxent": 128, "supcon": 128}


@dataclass
class Config:
    loss: str = "clip"
    epochs: int = 30
    batch_size: int = 128
    dim: int = 16
    lr: float = 2e-3
    temperature: float = 0.1
    seed: int = 0
    dedupe_ids: bool = True
    logit_bias: float = -3.0
    chunk_size: int | None = None
    distributed: bool = False
    out: str = ""


# ----------------------------------------------------------------------------- data
def load_digits_split(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(train images, train labels, test images, test labels); images (n, 1, 8, 8) in [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(torch.arange(len(y)).numpy(), test_size=0.3, random_state=seed, stratify=y.numpy())
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


def augment(x: Tensor, generator: torch.Generator) -> Tensor:
    """Random rotation (+-15 deg), shift (+-1 px), scale, Gaussian noise and a 3x3 cut-out."""
    n = x.shape[0]
    angle = (torch.rand(n, generator=generator) - 0.5) * (math.pi / 6)
    scale = 1 + (torch.rand(n, generator=generator) - 0.5) * 0.2
    shift = (torch.rand(n, 2, generator=generator) - 0.5) * 0.5  # in [-1, 1] coordinates: +-1 px of 8
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = F.grid_sample(x, grid, align_corners=False, padding_mode="zeros")
    out = out + 0.05 * torch.randn(out.shape, generator=generator)
    corner = torch.randint(0, 6, (n, 2), generator=generator)
    rows = torch.arange(8)
    keep = ~(((rows[None, :, None] >= corner[:, 0, None, None]) & (rows[None, :, None] < corner[:, 0, None, None] + 3))
             & ((rows[None, None, :] >= corner[:, 1, None, None]) & (rows[None, None, :] < corner[:, 1, None, None] + 3)))
    drop = torch.rand(n, generator=generator) < 0.5  # cut-out on half of the views
    keep = keep | ~drop[:, None, None]
    return (out * keep[:, None]).clamp(0, 1)


class Vocabulary:
    """The fixed word list of the caption templates; captions -> token ids."""

    def __init__(self) -> None:
        words = sorted({w for t in TEMPLATES for name in DIGIT_NAMES for w in t.format(name=name).split()})
        self.index = {w: i for i, w in enumerate(words)}
        self.captions = [t.format(name=name) for name in DIGIT_NAMES for t in TEMPLATES]  # class-major

    def encode(self, captions: list[str]) -> tuple[Tensor, Tensor]:
        """(flat token ids, offsets) for ``nn.EmbeddingBag``."""
        tokens = [[self.index[w] for w in c.split()] for c in captions]
        offsets = torch.tensor([0] + [len(t) for t in tokens[:-1]]).cumsum(0)
        return torch.tensor([i for t in tokens for i in t]), offsets


# ---------------------------------------------------------------------------- models
class ImageEncoder(nn.Module):
    """Small CNN for 8x8 digits with a projection head to ``dim``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 16, 128), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))


class TextEncoder(nn.Module):
    """Bag of words over the fixed caption vocabulary."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab_size, 64, mode="mean")
        self.proj = nn.Sequential(nn.ReLU(), nn.Linear(64, dim))

    def forward(self, tokens: Tensor, offsets: Tensor) -> Tensor:
        return self.proj(self.bag(tokens, offsets))


# --------------------------------------------------------------------------- recipes
def recipe_loss(cfg: Config, images: Tensor, labels: Tensor, index: Tensor, enc: nn.Module, text: nn.Module | None,
                clip_loss: ClipLoss | SigLipLoss | None, vocab: Vocabulary, gen: torch.Generator) -> Tensor:
    """The loss of one (local) batch under the chosen recipe."""
    gather = cfg.distributed
    if cfg.loss in IMAGE_TEXT:
        if text is None or clip_loss is None:
            raise RuntimeError("the image-text recipes need a text encoder and a loss module")
        # As in COCO (seed 002), an image comes with several captions: every image appears
        # CAPTIONS_PER_IMAGE times per batch, each time with its own augmentation and phrasing.
        # Without ids, those copies of one image (and the images sharing a caption) are negatives.
        images = images.repeat(CAPTIONS_PER_IMAGE, 1, 1, 1)
        labels, index = labels.repeat(CAPTIONS_PER_IMAGE), index.repeat(CAPTIONS_PER_IMAGE)
        choice = torch.randint(0, len(TEMPLATES), (len(labels),), generator=gen)
        caption_idx = labels * len(TEMPLATES) + choice
        tokens, offsets = vocab.encode([vocab.captions[int(i)] for i in caption_idx])
        img = enc(augment(images, gen))
        txt = text(tokens, offsets)
        if cfg.dedupe_ids:
            return clip_loss(img, txt, image_id=index, text_id=caption_idx)
        return clip_loss(img, txt)
    if cfg.loss == "nt_xent":
        z = enc(torch.cat([augment(images, gen), augment(images, gen)]))
        return losses.nt_xent_loss(z, cfg.temperature, pairing="halves", chunk_size=cfg.chunk_size, gather=gather)
    if cfg.loss == "supcon":
        two_views = torch.stack([enc(augment(images, gen)), enc(augment(images, gen))], dim=1)
        return losses.supcon_loss(two_views, labels, temperature=cfg.temperature, chunk_size=cfg.chunk_size, gather=gather)
    # nt_bxent: 4 views per image, rows view-major; positives are all pairs of views of an image.
    n_images, n_views = int(images.shape[0]), 4
    z = enc(torch.cat([augment(images, gen) for _ in range(n_views)]))
    sample = torch.arange(n_images * n_views) % n_images
    pos = (sample[:, None] == sample[None, :]).nonzero()
    return losses.nt_bxent_loss(z, pos, cfg.temperature, chunk_size=cfg.chunk_size, gather=gather)


# ------------------------------------------------------------------------ evaluation
@torch.no_grad()
def embed(enc: nn.Module, x: Tensor) -> Tensor:
    enc.eval()
    out = F.normalize(enc(x), dim=1)
    enc.train()
    return out


@torch.no_grad()
def evaluate(enc: nn.Module, text: nn.Module | None, vocab: Vocabulary, data: tuple[Tensor, Tensor, Tensor, Tensor]) -> dict[str, float]:
    """kNN (k=5, cosine) and linear-probe accuracy on the test split; zero-shot for clip."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.neighbors import KNeighborsClassifier

    x_tr, y_tr, x_te, y_te = data
    e_tr, e_te = embed(enc, x_tr).numpy(), embed(enc, x_te).numpy()
    knn = KNeighborsClassifier(n_neighbors=5, metric="cosine").fit(e_tr, y_tr.numpy())
    probe = LogisticRegression(max_iter=2000).fit(e_tr, y_tr.numpy())
    metrics = {"knn_accuracy": float(knn.score(e_te, y_te.numpy())), "linear_probe_accuracy": float(probe.score(e_te, y_te.numpy()))}
    if text is not None:
        text.eval()
        tokens, offsets = vocab.encode(vocab.captions)
        prototypes = F.normalize(text(tokens, offsets), dim=1).reshape(10, len(TEMPLATES), -1).mean(1)
        text.train()
        pred = (torch.from_numpy(e_te) @ F.normalize(prototypes, dim=1).T).argmax(1)
        metrics["zero_shot_accuracy"] = float((pred == y_te).float().mean())
    return metrics


# ------------------------------------------------------------------------ reporting
def _plots(out: Path, history: list[float], enc: nn.Module, x_te: Tensor, y_te: Tensor, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(range(1, len(history) + 1), history, "-o", ms=3)
    ax.set(xlabel="epoch", ylabel="mean training loss", title=title)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)
    e = embed(enc, x_te)
    centred = e - e.mean(0)
    _, _, v = torch.pca_lowrank(centred, q=2, center=False)
    xy = (centred @ v[:, :2]).numpy()
    fig, ax = plt.subplots(figsize=(5, 4.4))
    points = ax.scatter(xy[:, 0], xy[:, 1], c=y_te.numpy(), cmap="tab10", s=8)
    fig.colorbar(points, ax=ax, ticks=range(10), label="digit")
    ax.set(title=f"{title}: test embeddings (PCA)", xticks=[], yticks=[])
    fig.tight_layout()
    fig.savefig(out / "embedding.png", dpi=110)
    plt.close(fig)


def _table(before: dict[str, float], after: dict[str, float]) -> str:
    lines = [f"{'metric (test split)':<24} {'untrained':>10} {'trained':>10}"]
    for key in after:
        lines.append(f"{key:<24} {before[key] * 100:>9.1f}% {after[key] * 100:>9.1f}%")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- driver
def _average_gradient(params: Any, world: int) -> None:
    """Average gradients over ranks, as DDP does for the modules it wraps."""
    import torch.distributed as dist

    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def _image_text_loss(cfg: Config) -> ClipLoss | SigLipLoss | None:
    """The loss module (with its learnable parameters) of an image-text recipe, else None."""
    if cfg.loss == "clip":
        return ClipLoss(cfg.temperature, learnable_temperature=True, chunk_size=cfg.chunk_size, gather=cfg.distributed)
    if cfg.loss == "siglip":
        return SigLipLoss(1.0 / cfg.temperature, cfg.logit_bias, chunk_size=cfg.chunk_size, gather=cfg.distributed)
    return None


def _learned_loss_parameters(loss: nn.Module | None) -> dict[str, float]:
    if isinstance(loss, ClipLoss):
        return {"final_temperature": float(torch.as_tensor(loss.temperature).detach())}
    if isinstance(loss, SigLipLoss):
        return {"final_logit_scale": float(loss.logit_scale.detach().exp()), "final_logit_bias": float(loss.logit_bias.detach())}
    return {}


def train(cfg: Config, progress: bool = True) -> dict[str, Any]:
    """Train one recipe; returns the metrics dict (also written to ``cfg.out``)."""
    from tqdm import tqdm

    rank, world = 0, 1
    if cfg.distributed:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed)
    data = load_digits_split(cfg.seed)
    x_tr, y_tr, x_te, y_te = data
    vocab = Vocabulary()
    enc = ImageEncoder(cfg.dim)
    text = TextEncoder(len(vocab.index), cfg.dim) if cfg.loss in IMAGE_TEXT else None
    clip = _image_text_loss(cfg)
    before = evaluate(enc, text, vocab, data) if rank == 0 else {}
    modules: list[nn.Module] = [m for m in (enc, text, clip) if m is not None]
    params = [p for m in modules for p in m.parameters()]
    if cfg.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        enc_ddp: nn.Module = DDP(enc)
        text_ddp: nn.Module | None = DDP(text) if text is not None else None
    else:
        enc_ddp, text_ddp = enc, text
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.epochs * math.ceil(len(y_tr) / cfg.batch_size))
    gen = torch.Generator().manual_seed(cfg.seed + 1 + rank)
    order_gen = torch.Generator().manual_seed(cfg.seed + 2)  # same order on every rank
    history: list[float] = []
    start = time.perf_counter()
    for epoch in range(cfg.epochs):
        perm = torch.randperm(len(y_tr), generator=order_gen)
        batches = [perm[i : i + cfg.batch_size] for i in range(0, len(perm), cfg.batch_size)]
        show = None if progress and rank == 0 else True  # tqdm's None: shown only on a terminal
        bar = tqdm(batches, desc=f"{cfg.loss} epoch {epoch + 1}/{cfg.epochs}", leave=False, disable=show)
        total, count = 0.0, 0
        for idx in bar:
            if len(idx) < 2 * world:
                continue
            mine = idx.tensor_split(world)[rank]
            loss = recipe_loss(cfg, x_tr[mine], y_tr[mine], mine, enc_ddp, text_ddp, clip, vocab, gen)
            opt.zero_grad()
            loss.backward()
            if cfg.distributed and clip is not None:
                _average_gradient(clip.parameters(), world)  # logit_scale lives outside DDP
            opt.step()
            sched.step()
            total, count = total + loss.item(), count + 1
            bar.set_postfix(loss=f"{total / count:.4f}")
        history.append(total / max(count, 1))
    seconds = time.perf_counter() - start
    result: dict[str, Any] = {"config": asdict(cfg), "train_seconds": seconds, "loss_history": history}
    if rank == 0:
        after = evaluate(enc, text, vocab, data)
        result.update(untrained=before, trained=after)
        result.update(_learned_loss_parameters(clip))
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
        (out / "metrics.json").write_text(json.dumps(result, indent=2) + "\n")
        _plots(out, history, enc, x_te, y_te, cfg.loss)
        if progress:
            print(f"\n{cfg.loss}: {cfg.epochs} epochs in {seconds:.1f}s, loss {history[0]:.4f} -> {history[-1]:.4f}")
            print(_table(before, after))
            print(f"wrote {out}/metrics.json, loss.png, embedding.png, config.json")
    return result


def run(args: argparse.Namespace) -> int:
    cfg = Config(loss=args.loss, epochs=args.epochs, batch_size=args.batch_size or DEFAULT_BATCH_SIZE[args.loss], dim=args.dim, lr=args.lr,
                 temperature=args.temperature if args.temperature is not None else DEFAULT_TEMPERATURE[args.loss],
                 seed=args.seed, dedupe_ids=args.dedupe_ids, logit_bias=args.logit_bias, chunk_size=args.chunk_size,
                 distributed=args.distributed,
                 out=args.out or os.path.join("runs", f"{args.loss}-{time.strftime('%Y%m%d-%H%M%S')}"))
    if cfg.distributed and "RANK" not in os.environ:
        print("error: --distributed must run under torchrun, e.g. "
              "torchrun --nproc_per_node=2 -m torch_contrastive train --distributed", file=sys.stderr)
        return 2
    train(cfg, progress=not args.quiet)
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


def add_train_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="train a contrastive model on scikit-learn's bundled digits and evaluate it")
    p.add_argument("--loss", choices=RECIPES, default="clip", help="recipe (default clip)")
    p.add_argument("--epochs", type=positive_int, default=30)
    p.add_argument("--batch-size", type=positive_int, default=None, help="images per step (default: clip 256, others 128)")
    p.add_argument("--dim", type=positive_int, default=16, help="embedding size (default 16)")
    p.add_argument("--lr", type=positive_float, default=2e-3)
    p.add_argument("--temperature", type=positive_float, default=None,
                   help="tau (default: clip 0.07, its learnable initial value; nt_xent 0.1; nt_bxent 0.3; supcon 0.1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dedupe-ids", action=argparse.BooleanOptionalAction, default=True,
                   help="clip, siglip: pass image/caption ids so duplicate captions are positives (default on)")
    p.add_argument("--logit-bias", type=float, default=-3.0, help="siglip: initial logit bias (default -3; the paper's -10 is for 32k batches)")
    p.add_argument("--chunk-size", type=positive_int, default=None, help="tile rows for the loss (default automatic)")
    p.add_argument("--distributed", action="store_true", help="run under torchrun with gather=True and DDP")
    p.add_argument("--out", default=None, help="output folder (default runs/<loss>-<timestamp>)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or table")
    p.set_defaults(func=run)
