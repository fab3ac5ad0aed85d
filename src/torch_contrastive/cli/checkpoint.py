"""Checkpoints of the training command: written atomically after every epoch, resumed exactly.

``RUN_DIR/checkpoint.pt`` holds everything the rest of a run depends on: the encoders and
the loss module (a learnable temperature, SigLIP's scale and bias), the optimizer and
learning-rate schedule, the completed epochs and loss history, the untrained metrics,
the data split, the caption vocabulary, and every random state the loop draws from (the
global torch RNG, the augmentation and batch-order generators, CUDA's when present). The
recipes keep no queue. A run resumed from it draws the same batches and augmentations
as an uninterrupted run, so on CPU its loss history and trained metrics are bit-identical.

The file is written to a temporary name in the run directory and moved over the old one
with ``os.replace``: a kill at any moment leaves either the previous or the new checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._paths import write_atomically

if TYPE_CHECKING:
    from .data import Data
    from .models import Vocabulary
    from .train import Config

CHECKPOINT = "checkpoint.pt"
FORMAT = 1


class ResumeError(Exception):
    """A run directory that cannot be resumed (the message says why)."""


@dataclass
class State:
    """A loaded checkpoint."""

    values: dict[str, Any]


def save(out: Path, cfg: Config, epochs_done: int, history: list[float], untrained: dict[str, float], seconds: float,
         data: Data, modules: list[nn.Module], opt: torch.optim.Optimizer, sched: Any, gen: torch.Generator,
         order_gen: torch.Generator, vocab: Vocabulary | None, tracked: list[tuple[int, float]] | None = None) -> None:
    """Write ``out/checkpoint.pt`` (atomically) after ``epochs_done`` epochs."""
    import io

    state = {
        "format": FORMAT,
        "config": asdict(cfg),
        "epochs_done": epochs_done,
        "loss_history": list(history),
        "untrained": dict(untrained),
        "train_seconds": seconds,
        "modules": [m.state_dict() for m in modules],  # the plain modules, never their DDP wrappers
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "augment": gen.get_state(), "order": order_gen.get_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        "split": {"train": data.train_idx.clone(), "test": data.test_idx.clone(), "images": len(data.images)},
        "vocabulary": None if vocab is None else vocab.words,
        "queue": None,  # no recipe keeps a feature queue
        "tracked": list(tracked or []),  # (epoch, held-out metric) points for loss.png
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_atomically(out / CHECKPOINT, buffer.getvalue())


def load_state(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise ResumeError(f"{path} does not exist: nothing to resume (is {run_dir} a training run directory?)")
    try:
        values: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # a foreign or damaged file
        raise ResumeError(f"cannot read {path}: {err}") from None
    if not isinstance(values, dict) or values.get("format") != FORMAT:
        raise ResumeError(f"{path} is not a torch-contrastive training checkpoint")
    lacking = [key for key in _KEYS if key not in values]
    if lacking or not isinstance(values["config"], dict) or not isinstance(values["split"], dict):
        raise ResumeError(f"{path} is not a checkpoint this program wrote (it lacks {', '.join(lacking) or 'a config'})")
    return values


#: what every checkpoint this program writes holds (:func:`save`)
_KEYS = ("config", "epochs_done", "loss_history", "untrained", "train_seconds", "modules", "optimizer", "scheduler", "rng",
         "split")


def open_run(run_dir: str, epochs: int | None = None) -> tuple[Config, State | None]:
    """The configuration of ``run_dir`` and its checkpoint, or None when the run finished.

    ``epochs``: extend the run to this many epochs (a finished or stopped run). Only a
    schedule that does not depend on the run's length (``--schedule constant``) gives the
    results of an uninterrupted run of that length; a one-cycle run is refused.
    """
    from .train import Config

    values = load_state(run_dir)
    try:
        cfg = Config.from_dict(values["config"])
    except (TypeError, ValueError) as err:
        raise ResumeError(f"{run_dir}: its checkpoint's config cannot be read ({err})") from None
    cfg.out = str(run_dir)
    if cfg.distributed:
        raise ResumeError(f"{run_dir} was trained with --distributed; resuming is supported for single-process runs")
    if epochs is not None and epochs != cfg.epochs:
        if epochs < values["epochs_done"]:
            raise ResumeError(f"--epochs {epochs}: {run_dir} has already trained {values['epochs_done']} epochs")
        if cfg.schedule != "constant":
            raise ResumeError(f"--epochs {epochs}: {run_dir} used the one-cycle schedule, whose shape depends on its "
                              f"{cfg.epochs} epochs; only runs trained with --schedule constant can be extended exactly")
        cfg.epochs = epochs
        values["config"]["epochs"] = epochs
        return cfg, State(values)
    if values["epochs_done"] >= cfg.epochs and (Path(run_dir) / "metrics.json").is_file():
        return cfg, None
    return cfg, State(values)


def check_split(state: State, data: Data) -> None:
    """Refuse to resume on data other than the run's (other images, or another split of them)."""
    values = state.values
    split = values["split"]
    if split["images"] != len(data.images) or not torch.equal(split["train"], data.train_idx):
        raise ResumeError("the data changed since the checkpoint was written (different images or split); "
                          f"the run was trained on {json.dumps(values['config'].get('data'))}")


def restore(state: State, data: Data, modules: list[nn.Module], opt: torch.optim.Optimizer, sched: Any,
            gen: torch.Generator, order_gen: torch.Generator) -> tuple[int, list[float], dict[str, float], float]:
    """Load a checkpoint into freshly built objects: ``(next epoch, history, untrained metrics, seconds so far)``."""
    check_split(state, data)
    values = state.values
    for module, saved in zip(modules, values["modules"]):
        module.load_state_dict(saved)
    opt.load_state_dict(values["optimizer"])
    sched.load_state_dict(values["scheduler"])
    rng = values["rng"]
    torch.set_rng_state(rng["torch"])
    gen.set_state(rng["augment"])
    order_gen.set_state(rng["order"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return int(values["epochs_done"]), list(values["loss_history"]), dict(values["untrained"]), float(values["train_seconds"])
