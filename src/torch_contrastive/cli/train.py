"""``torch-contrastive train``: real contrastive training on bundled digits or your own images.

Without ``--data`` nothing is downloaded: the 1,797 8x8 handwritten digits ship with
scikit-learn. ``--data PATH`` trains on a folder of class subfolders (``nt_xent``,
``nt_bxent``, ``supcon``) or a caption CSV (``clip``, ``siglip``); see :mod:`.data`.
Seven recipes (``--loss``):

* ``clip`` (default): images <-> captions, a learned bag-of-words text encoder, a
  learnable temperature. On digits the captions are class templates such as "a
  handwritten seven", so many images in a batch share a caption; ``--dedupe-ids``
  (default) passes image and caption ids so duplicates are positives (CLIP's duplicate-id rule),
  ``--no-dedupe-ids`` treats them as negatives.
* ``siglip``: the same with the sigmoid loss (learnable logit scale and bias; scale
  initialised at 10 as in the SigLIP paper, bias at ``--logit-bias``, default -3).
* ``nt_xent``: SimCLR, two augmented views per image (``pairing="halves"``).
* ``nt_bxent``: four views per image, positives given as ``pos_indices``.
* ``supcon``: two views per image, class labels as positives.
* ``sogclr``: two views per image, the global contrastive loss (SogCLR): each image's normaliser is
  a moving average over the epochs (``--gamma``, ``--gamma-schedule``, ``--temperature-mode``), so a
  small batch trains like a large one; the dataset index of every image flows to the loss.
* ``fastclip``: images <-> captions with the bimodal global loss (FastCLIP; a learnable global
  temperature by default); one state per (image, caption) pair.

After training, the held-out split is scored, each metric also for the untrained
encoder: kNN accuracy (k = 5, cosine) and a linear probe for labelled data, zero-shot
accuracy for the digits image-text recipes, image<->text recall@1/5/10 for caption CSVs.
Files in ``--out``: ``metrics.json``, ``config.json``, ``checkpoint.pt`` (after every
epoch; ``--resume RUN_DIR`` continues it, see :mod:`.checkpoint`), ``loss.png``,
``embedding.png``.

With ``--distributed`` under ``torchrun`` each rank trains on its shard of every
batch with ``gather=True`` and DDP.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .. import losses
from ..grad_cache import grad_cache
from ..losses.global_contrastive import INDIVIDUAL_DEFAULTS, GlobalContrastiveLoss
from ..modules import ClipLoss, SigLipLoss
from . import checkpoint as ckpt
from .data import Data, DataError, load
from .device import autocast, resolve_device, resolve_precision
from .evaluate import caption_metrics, labelled_metrics, tracked_metric
from .models import TEMPLATES, ImageEncoder, TextEncoder, Vocabulary, augment
from .report import plots, table

RECIPES = ("clip", "siglip", "nt_xent", "nt_bxent", "supcon", "sogclr", "fastclip")
IMAGE_TEXT = ("clip", "siglip", "fastclip")
#: The recipes of the global contrastive loss (per-sample state carried across steps).
GLOBAL = ("sogclr", "fastclip")
CAPTIONS_PER_IMAGE = 2
#: Default temperature per recipe (clip: the initial value of its learnable temperature).
#: NT-BXent scores pairs with independent sigmoids and did best at 0.3 on this data.
#: siglip: 1 / the initial logit scale (the paper's t = 10; its bias starts at -10).
DEFAULT_TEMPERATURE = {"clip": 0.07, "siglip": 0.1, "nt_xent": 0.1, "nt_bxent": 0.3, "supcon": 0.1, "sogclr": 0.1,
                       "fastclip": 0.07}
#: Default images per step. CLIP is trained with large batches (and that is where duplicate
#: captions matter); NT-BXent's four views per image make its batches 4x longer already.
#: SigLIP scores every pair on its own, so the ~25 same-class images per class in a
#: 256-image batch (negatives unless their caption is identical) weigh on it more than on
#: CLIP's soft-max: 128 images (256 rows with two captions each) train it reliably.
DEFAULT_EPOCHS = 30
DEFAULT_BATCH_SIZE = {"clip": 256, "siglip": 128, "nt_xent": 128, "nt_bxent": 128, "supcon": 128, "sogclr": 128, "fastclip": 128}


class Diverged(Exception):
    """Training diverged (non-finite outputs or loss): a setting the user can change, said in one line."""


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
    data: str | None = None  # None: digits; a folder of class subfolders, or a caption CSV
    channels: int = 3  # 1 (grayscale) or 3 (RGB) for --data; digits are grayscale
    image_size: int = 32  # --data images are resized to this square; digits are 8x8
    micro_batch: int | None = None  # gradient caching: encode this many rows at a time (None: whole batch)
    device: str = "auto"  # auto (CUDA when present), cpu or cuda
    precision: str = "auto"  # autocast for the encoders: auto (bf16 on a GPU, fp32 on a CPU), fp32, bf16, fp16
    schedule: str = "onecycle"  # onecycle (length-dependent) or constant (warm-up epoch, then flat: extendable)
    prefetch: str = "auto"  # prepare the next batch on a background thread: auto (on a GPU), on, off
    gamma: float = 0.9  # sogclr, fastclip: the moving average's weight of a batch
    gamma_schedule: str = "constant"  # sogclr, fastclip: constant, or cosine from 1 to gamma
    gamma_decay_epochs: int | None = None  # the cosine schedule's length (default: half the epochs)
    temperature_mode: str = "auto"  # sogclr, fastclip: fixed, global (fastclip), individual; auto: fastclip global

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Config:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


def load_digits_split(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(train images, train labels, test images, test labels) of the digits; images (n, 1, 8, 8) in [0, 1]."""
    data = load(None, channels=1, size=8, seed=seed)
    if data.labels is None:
        raise RuntimeError("internal: digits have labels")
    return data.images[data.train_idx], data.labels[data.train_idx], data.images[data.test_idx], data.labels[data.test_idx]


def check_recipe_data(cfg: Config, data: Data) -> None:
    """Image-text recipes need captions; the view recipes need class folders (or digits)."""
    if cfg.loss in IMAGE_TEXT and data.source == "folder":
        raise DataError(f"--loss {cfg.loss} trains images against captions: pass a caption CSV (columns image, caption) as --data")
    if cfg.loss not in IMAGE_TEXT and data.source == "csv":
        raise DataError(f"--loss {cfg.loss} needs labelled images: pass a folder of class subfolders as --data (a CSV is for clip/siglip)")
    # every step the run takes needs two: a training batch (its negatives) and the held-out split
    # (its scores and the embedding plot's two principal axes)
    n_train, n_test = len(data.train_idx), len(data.test_idx)
    if n_train < 2 or n_test < 2:
        raise DataError(f"--data {cfg.data or 'digits'}: {len(data.images)} images split 70/30 into {n_train} for training and {n_test} "
                        "held out; training needs at least 2 (a batch needs negatives) and scoring at least 2 "
                        "(add images)")


# --------------------------------------------------------------------------- recipes
@dataclass
class Models:
    enc: nn.Module
    text: nn.Module | None
    loss: ClipLoss | SigLipLoss | GlobalContrastiveLoss | None
    vocab: Vocabulary | None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    precision: str = "fp32"


def recipe_step(cfg: Config, data: Data, batch: Tensor, models: Models, text_keys: Tensor | None, gen: torch.Generator,
                scaler: Any = None, parts: Any = None) -> Tensor:
    """Forward and backward of one batch; with ``cfg.micro_batch`` through :func:`grad_cache`
    (the same gradients, one micro-batch of activations at a time). Returns the loss.
    ``scaler``: fp16's gradient scaler (the loss is scaled before backward); ``parts``: the
    batch's :func:`recipe_parts`, when prepared ahead."""
    towers, inputs, loss_fn, kwargs = parts if parts is not None else recipe_parts(cfg, data, batch, models, text_keys, gen)
    if cfg.micro_batch is None:
        with autocast(models.device, models.precision):
            loss = loss_fn(*(_encode(t, x) for t, x in zip(towers, inputs)), **kwargs)
        (loss if scaler is None else scaler.scale(loss)).backward()
        return loss.detach()
    with autocast(models.device, models.precision):
        return grad_cache(towers, inputs, loss_fn, cfg.micro_batch, **kwargs)


def _on(device: torch.device, parts: tuple[list[nn.Module], list[Tensor], Any, dict[str, Any]]
        ) -> tuple[list[nn.Module], list[Tensor], Any, dict[str, Any]]:
    """The batch's inputs and tensor arguments on the training device (pinned, asynchronous copies)."""
    if device.type == "cpu":
        return parts
    towers, inputs, loss_fn, kwargs = parts

    def move(t: Any) -> Any:
        return t.pin_memory().to(device, non_blocking=True) if isinstance(t, Tensor) else t

    return towers, [move(x) for x in inputs], loss_fn, {k: move(val) for k, val in kwargs.items()}


def _encode(tower: nn.Module, x: Tensor) -> Tensor:
    return tower(x)


class PaddedText(nn.Module):
    """A bag-of-words text encoder fed batch-first: (B, L) token ids, -1 for padding
    (so :func:`grad_cache` can slice captions into micro-batches)."""

    def __init__(self, text: nn.Module) -> None:
        super().__init__()
        self.text = text

    @staticmethod
    def pad(tokens: Tensor, offsets: Tensor) -> Tensor:
        lengths = torch.diff(offsets, append=torch.tensor([len(tokens)]))
        out = torch.full((len(offsets), max(1, int(lengths.max()) if len(lengths) else 1)), -1, dtype=torch.int64)
        for row, (start, length) in enumerate(zip(offsets.tolist(), lengths.tolist())):
            out[row, :length] = tokens[start : start + length]
        return out

    def forward(self, padded: Tensor) -> Tensor:
        keep = padded >= 0
        lengths = keep.sum(1)
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
        return self.text(padded[keep], offsets)


def recipe_parts(cfg: Config, data: Data, batch: Tensor, models: Models, text_keys: Tensor | None,
                 gen: torch.Generator) -> tuple[list[nn.Module], list[Tensor], Any, dict[str, Any]]:
    """(encoders, their batch-first inputs, loss function, its keyword arguments) of one batch.

    Augmentations are drawn here, outside the encoders, so a gradient-cached step sees the
    same views as a plain one.
    """
    if cfg.loss in IMAGE_TEXT:
        return _on(models.device, _image_text_parts(cfg, data, batch, models, text_keys, gen))
    return _on(models.device, _view_parts(cfg, data, batch, models, gen))


def _view_parts(cfg: Config, data: Data, batch: Tensor, models: Models,
                gen: torch.Generator) -> tuple[list[nn.Module], list[Tensor], Any, dict[str, Any]]:
    gather = cfg.distributed
    enc = models.enc
    images = data.images[batch]
    labels = None if data.labels is None else data.labels[batch].to(models.device)
    if cfg.loss == "nt_xent":
        views = torch.cat([augment(images, gen), augment(images, gen)])
        return [enc], [views], losses.nt_xent_loss, dict(temperature=cfg.temperature, pairing="halves", chunk_size=cfg.chunk_size,
                                                         gather=gather)
    if cfg.loss == "sogclr":
        if models.loss is None:
            raise RuntimeError("internal: the sogclr recipe needs its loss module")
        index = batch.to(models.device)  # the images' positions in the data set: their state rows
        return [enc, enc], [augment(images, gen), augment(images, gen)], models.loss, dict(index=index)
    if cfg.loss == "supcon":
        first, second = augment(images, gen), augment(images, gen)

        def supcon(z1: Tensor, z2: Tensor) -> Tensor:
            return losses.supcon_loss(torch.stack([z1, z2], dim=1), labels, temperature=cfg.temperature, chunk_size=cfg.chunk_size,
                                      gather=gather)

        return [enc, enc], [first, second], supcon, {}
    # nt_bxent: 4 views per image, rows view-major; positives are all pairs of views of an image.
    n_images, n_views = int(images.shape[0]), 4
    views = torch.cat([augment(images, gen) for _ in range(n_views)])
    sample = torch.arange(n_images * n_views) % n_images
    pos = (sample[:, None] == sample[None, :]).nonzero()
    return [enc], [views], losses.nt_bxent_loss, dict(pos_indices=pos, temperature=cfg.temperature, chunk_size=cfg.chunk_size,
                                                      gather=gather)


def _image_text_parts(cfg: Config, data: Data, batch: Tensor, models: Models, text_keys: Tensor | None,
                      gen: torch.Generator) -> tuple[list[nn.Module], list[Tensor], Any, dict[str, Any]]:
    if models.text is None or models.loss is None or models.vocab is None:
        raise RuntimeError("the image-text recipes need a text encoder and a loss module")
    if data.row_image is not None and text_keys is not None:
        # a caption CSV: the batch is caption rows; rows of one image (and equal captions) are duplicates
        image_index, caption_index = data.row_image[batch], text_keys[batch]
        captions = [data.captions[int(r)] for r in batch]
    else:
        # digits: as in COCO an image comes with several captions: every image appears
        # CAPTIONS_PER_IMAGE times per batch, each time with its own augmentation and phrasing.
        # Without ids, those copies of one image (and the images sharing a caption) are negatives.
        if data.labels is None:
            raise RuntimeError("internal: digits have labels")
        image_index = batch.repeat(CAPTIONS_PER_IMAGE)
        labels = data.labels[image_index]
        caption_index = labels * len(TEMPLATES) + torch.randint(0, len(TEMPLATES), (len(labels),), generator=gen)
        captions = [models.vocab.class_captions[int(i)] for i in caption_index]
    tokens, offsets = models.vocab.encode(captions)
    views = augment(data.images[image_index], gen)
    kwargs = dict(image_id=image_index, text_id=caption_index) if cfg.dedupe_ids else {}
    if cfg.loss == "fastclip":  # one state per (image, caption) pair: a caption row, or a digit image's k-th caption
        kwargs = dict(index=batch if data.row_image is not None else
                      image_index * CAPTIONS_PER_IMAGE + torch.arange(CAPTIONS_PER_IMAGE).repeat_interleave(len(batch)))
    return [models.enc, PaddedText(models.text)], [views, PaddedText.pad(tokens, offsets)], models.loss, kwargs


def evaluate(cfg: Config, data: Data, models: Models) -> dict[str, float]:
    if data.source == "csv":
        if models.text is None or models.vocab is None:
            raise RuntimeError("internal: caption data needs the text encoder")
        return caption_metrics(models.enc, models.text, models.vocab, data)
    return labelled_metrics(models.enc, models.text, models.vocab, data)


# ---------------------------------------------------------------------------- driver
def _average_gradient(params: Any, world: int) -> None:
    """Average gradients over ranks, as DDP does for the modules it wraps."""
    import torch.distributed as dist

    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def _loss_module(cfg: Config, data: Data) -> ClipLoss | SigLipLoss | GlobalContrastiveLoss | None:
    """The loss module (with its learnable parameters or state) of a recipe, else None."""
    if cfg.loss in GLOBAL:
        mode = "unimodal" if cfg.loss == "sogclr" else "bimodal"
        samples = len(data.images) if mode == "unimodal" else \
            len(data.captions) if data.row_image is not None else CAPTIONS_PER_IMAGE * len(data.images)
        temperature_mode = cfg.temperature_mode if cfg.temperature_mode != "auto" else "global" if mode == "bimodal" else "fixed"
        decay = cfg.gamma_decay_epochs or max(1, cfg.epochs // 2)
        rule = INDIVIDUAL_DEFAULTS[mode] if temperature_mode == "individual" else None
        if rule is not None and not rule.tau_min <= cfg.temperature <= rule.tau_max:  # start inside the clamp
            rule = replace(rule, tau_min=min(rule.tau_min, cfg.temperature), tau_max=max(rule.tau_max, cfg.temperature))
        return GlobalContrastiveLoss(max(samples, 2), mode, cfg.temperature, cfg.gamma, temperature_mode=temperature_mode,
                                     rule=rule, gamma_schedule=cfg.gamma_schedule,
                                     gamma_decay_epochs=decay if cfg.gamma_schedule == "cosine" else None,
                                     chunk_size=cfg.chunk_size, gather=cfg.distributed)
    if cfg.loss == "clip":
        return ClipLoss(cfg.temperature, learnable_temperature=True, chunk_size=cfg.chunk_size, gather=cfg.distributed)
    if cfg.loss == "siglip":
        return SigLipLoss(1.0 / cfg.temperature, cfg.logit_bias, chunk_size=cfg.chunk_size, gather=cfg.distributed)
    return None


def _learned_loss_parameters(loss: nn.Module | None) -> dict[str, float]:
    if isinstance(loss, GlobalContrastiveLoss) and loss.temperature_mode == "global":
        return {"final_temperature": float(loss.tau.detach())}
    if isinstance(loss, ClipLoss):
        return {"final_temperature": float(torch.as_tensor(loss.temperature).detach())}
    if isinstance(loss, SigLipLoss):
        return {"final_logit_scale": float(loss.logit_scale.detach().exp()), "final_logit_bias": float(loss.logit_bias.detach())}
    return {}


def build_models(cfg: Config, data: Data, device: torch.device | None = None, precision: str = "fp32") -> Models:
    """Encoders (and the image-text loss module) for a recipe on ``data``, freshly initialised
    (on the CPU, so every device starts from the same weights) and moved to ``device``."""
    device = torch.device("cpu") if device is None else device
    vocab = None
    if cfg.loss in IMAGE_TEXT:
        vocab = Vocabulary(data.captions) if data.source == "csv" else Vocabulary.digits()
    enc = ImageEncoder(cfg.dim, data.channels, data.size).to(device)
    text = TextEncoder(len(vocab.words), cfg.dim).to(device) if vocab is not None else None
    loss = _loss_module(cfg, data)
    return Models(enc, text, None if loss is None else loss.to(device), vocab, device, precision)


SCHEDULES = ("onecycle", "constant")


def make_schedule(cfg: Config, opt: torch.optim.Optimizer, steps: int, per_epoch: int) -> Any:
    """``onecycle``: warm-up and cosine annealing over the whole run (its shape depends on
    the number of epochs). ``constant``: a linear warm-up over the first epoch, then the
    peak rate: the learning rate of a step never depends on the run's length, so a run
    extended with ``--resume RUN --epochs M`` equals an uninterrupted M-epoch run."""
    if cfg.schedule == "constant":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / per_epoch))
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=steps)


#: loss.png follows a held-out metric at about this many epochs (every epoch up to 10); its
#: cost (an embedding pass and a kNN) is kept off the training clock.
TRACKED_POINTS = 10

#: Fewer optimizer steps than this rarely move an encoder past its random initialisation.
FEW_STEPS = 100


def describe(data: Data, units: Tensor, cfg: Config, device: torch.device, precision: str, steps: int, world: int) -> str:
    """What was found and what will run, before any training (with a warning for short runs)."""
    what = {"digits": "digits (scikit-learn)", "folder": f"folder {cfg.data}", "csv": f"caption CSV {cfg.data}"}[data.source]
    lines = [f"data: {what}: {len(data.images)} images"
             + (f", {len(data.class_names)} classes" if data.class_names else "")
             + (f", {len(data.captions)} captions" if data.source == "csv" else "")
             + f"; split {len(data.train_idx)} train / {len(data.test_idx)} test images",
             f"training: {cfg.loss}, {cfg.epochs} epochs x {math.ceil(len(units) / cfg.batch_size)} batches of "
             f"{cfg.batch_size} = {steps} optimizer steps on {device} ({precision})" + (f", {world} ranks" if world > 1 else "")]
    if steps < FEW_STEPS:
        lines.append(f"warning: only {steps} optimizer steps (< {FEW_STEPS}): the trained encoder may not beat the untrained one; "
                     "raise --epochs or lower --batch-size")
    return "\n".join(lines)


def _training_units(data: Data) -> tuple[Tensor, Tensor | None]:
    """What one epoch permutes: training images, or a CSV's training caption rows (with
    an id per distinct caption string for the duplicate-aware loss)."""
    if data.source != "csv":
        return data.train_idx, None
    rows = data.rows_of(data.train_idx)
    ids: dict[str, int] = {}
    keys = torch.tensor([ids.setdefault(c, len(ids)) for c in data.captions], dtype=torch.int64)
    return rows, keys


def train(cfg: Config, progress: bool = True, resume: ckpt.State | None = None, data: Data | None = None) -> dict[str, Any]:
    """Train one recipe; returns the metrics dict (also written to ``cfg.out``).

    A checkpoint is written to ``cfg.out`` after every epoch; ``resume`` continues from
    one (same configuration), giving the results of an uninterrupted run.
    """
    from tqdm import tqdm

    device, precision, rank, world = _place(cfg)
    torch.manual_seed(cfg.seed)
    data = data if data is not None else load(cfg.data, channels=cfg.channels, size=cfg.image_size, seed=cfg.seed)
    check_recipe_data(cfg, data)
    models = build_models(cfg, data, device, precision)
    units, text_keys = _training_units(data)
    modules: list[nn.Module] = [m for m in (models.enc, models.text, models.loss) if m is not None]
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=1e-4)
    steps = cfg.epochs * math.ceil(len(units) / cfg.batch_size)
    sched = make_schedule(cfg, opt, steps, math.ceil(len(units) / cfg.batch_size))
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    if progress and rank == 0:
        print(describe(data, units, cfg, device, precision, steps, world), flush=True)
    gen = torch.Generator().manual_seed(cfg.seed + 1 + rank)
    order_gen = torch.Generator().manual_seed(cfg.seed + 2)  # same order on every rank
    out = Path(cfg.out)
    tracked: list[tuple[int, float]] = []
    every = max(1, math.ceil(cfg.epochs / TRACKED_POINTS))
    if resume is None:
        if progress and rank == 0:
            print("scoring the untrained encoder on the test split ...", flush=True)
        before = evaluate(cfg, data, models) if rank == 0 else {}
        history: list[float] = []
        first_epoch, elapsed = 0, 0.0
    else:
        first_epoch, history, before, elapsed = ckpt.restore(resume, data, modules, opt, sched, gen, order_gen)
        tracked = [(int(e), float(m)) for e, m in resume.values.get("tracked", [])]
    if rank == 0:  # (again when a resumed run is extended: its epochs changed)
        out.mkdir(parents=True, exist_ok=True)
        ckpt.write_atomically(out / "config.json", (json.dumps(asdict(cfg), indent=2) + "\n").encode())
    plain = models  # the unwrapped modules: evaluated, plotted, checkpointed
    if cfg.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        models = Models(DDP(models.enc, device_ids=ids), DDP(models.text, device_ids=ids) if models.text is not None else None,
                        models.loss, models.vocab, device, precision)
    start = time.perf_counter()
    for epoch in range(first_epoch, cfg.epochs):
        if isinstance(plain.loss, GlobalContrastiveLoss):
            plain.loss.set_epoch(epoch)  # gamma's schedule
        perm = units[torch.randperm(len(units), generator=order_gen)]
        batches = [perm[i : i + cfg.batch_size] for i in range(0, len(perm), cfg.batch_size)]
        show = None if progress and rank == 0 else True  # tqdm's None: shown only on a terminal
        bar = tqdm(batches, desc=f"{cfg.loss} epoch {epoch + 1}/{cfg.epochs}", leave=False, disable=show)
        history.append(_epoch(cfg, data, bar, models, text_keys, gen, opt, sched, rank, world, scaler))
        if rank == 0:
            paused = time.perf_counter()
            _track(tracked, epoch + 1, every, cfg.epochs, plain, data)
            start += time.perf_counter() - paused  # off the training clock
            ckpt.save(out, cfg, epoch + 1, history, before, elapsed + time.perf_counter() - start, data, modules, opt, sched,
                      gen, order_gen, models.vocab, tracked)
    seconds = elapsed + time.perf_counter() - start
    result: dict[str, Any] = {"config": asdict(cfg), "train_seconds": seconds, "loss_history": history}
    if rank == 0:
        _finish(result, cfg, data, plain, models.loss, before, history, tracked, f"{steps} steps on {device}, {precision}", progress)
    return result


def _place(cfg: Config) -> tuple[torch.device, str, int, int]:
    """(device, precision, rank, world size): the process group joined when distributed."""
    rank, world = 0, 1
    device = resolve_device(cfg.device, cfg.distributed)
    precision = resolve_precision(cfg.precision, device)
    if cfg.distributed:
        import torch.distributed as dist

        if not dist.is_initialized():
            # NCCL moves CUDA tensors only: the backend follows the training device
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device, precision, rank, world


def _finish(result: dict[str, Any], cfg: Config, data: Data, plain: Models, loss: nn.Module | None, before: dict[str, float],
            history: list[float], tracked: list[tuple[int, float]], where: str, progress: bool) -> None:
    """Score the trained encoder, write metrics.json and the plots, print the table (rank 0)."""
    out = Path(cfg.out)
    seconds = result["train_seconds"]
    if progress:
        print("scoring the trained encoder on the test split ...", flush=True)
    after = evaluate(cfg, data, plain)
    name = "image_to_text_recall@1" if data.labels is None else "knn_accuracy"
    result.update(untrained=before, trained=after, tracked={"metric": name, "points": tracked})
    result.update(_learned_loss_parameters(loss))
    start_point = [(0, before[name])] if name in before else []  # the untrained encoder, scored before training
    pairs = (plain.text, plain.vocab) if data.source == "csv" and plain.text is not None and plain.vocab is not None else None
    plots(out, history, plain.enc, data, cfg.loss, (name, start_point + tracked), pairs)
    # last: metrics.json says the run finished, so it lands only when everything else has
    ckpt.write_atomically(out / "metrics.json", (json.dumps(result, indent=2) + "\n").encode())
    if progress:
        print(f"\n{cfg.loss}: {cfg.epochs} epochs ({where}) in {seconds:.1f}s, loss {history[0]:.4f} -> {history[-1]:.4f}")
        print(table(before, after))
        print(f"wrote {out}/metrics.json, checkpoint.pt, loss.png, embedding.png, config.json")


def _track(tracked: list[tuple[int, float]], done: int, every: int, epochs: int, models: Models, data: Data) -> None:
    """Append the held-out metric after epoch ``done`` when it is due (eval mode, no random
    draw: the training that follows is unchanged)."""
    if done % every == 0 or done == epochs:
        tracked.append((done, tracked_metric(models.enc, models.text, models.vocab, data)[1]))


def _ahead(items: Any, make: Any, enabled: bool) -> Any:
    """``(item, make(item))`` in order. ``enabled``: ``make`` of the next item runs on a
    background thread while the caller uses the current one (augmentation, pinning and the
    host-to-GPU copy overlap the GPU step). One worker keeps the draws from the augmentation
    generator in the same order, so the training is the same bit for bit."""
    if not enabled:
        for item in items:
            yield item, make(item)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        for item in items:
            upcoming = (item, pool.submit(make, item))
            if pending is not None:
                yield pending[0], pending[1].result()
            pending = upcoming
        if pending is not None:
            yield pending[0], pending[1].result()


def _epoch(cfg: Config, data: Data, bar: Any, models: Models, text_keys: Tensor | None, gen: torch.Generator,
           opt: torch.optim.Optimizer, sched: Any, rank: int, world: int, scaler: Any = None) -> float:
    """One pass over the batches in ``bar``; returns the mean training loss."""
    total, count = 0.0, 0
    local = (idx.tensor_split(world)[rank] for idx in bar if len(idx) >= 2 * world)
    ahead = cfg.prefetch == "on" or (cfg.prefetch == "auto" and models.device.type == "cuda")
    for batch, parts in _ahead(local, lambda b: recipe_parts(cfg, data, b, models, text_keys, gen), ahead):
        opt.zero_grad()
        try:
            loss = recipe_step(cfg, data, batch, models, text_keys, gen, scaler, parts)
        except ValueError as err:  # the loss refuses non-finite embeddings: the weights diverged
            if "non-finite" not in str(err):
                raise
            raise Diverged(f"training diverged at step {count + 1} of the epoch (the encoder's outputs are no longer "
                           f"finite); lower --lr (now {cfg.lr:g})") from None
        if cfg.distributed and models.loss is not None:
            _average_gradient(models.loss.parameters(), world)  # logit_scale lives outside DDP
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        sched.step()
        value = loss.item()  # after the step's kernels are queued (the epoch's mean reads it anyway)
        if not math.isfinite(value):
            raise Diverged(f"training diverged at step {count + 1} of the epoch (the loss is {value}); lower --lr (now {cfg.lr:g})")
        total, count = total + value, count + 1
        bar.set_postfix(loss=f"{total / count:.4f}")
    return total / max(count, 1)
