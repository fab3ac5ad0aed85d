"""Peer libraries loaded for comparison: lightly and open_clip import torchvision at package
import, so their loss files are loaded on their own; a tiny random BERT stands in for a
sentence-transformers model (no hub download)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import load_file


def _root(package: str, hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed ({hint})")
    return Path(next(iter(spec.submodule_search_locations)))


@contextlib.contextmanager
def lightly_files() -> Iterator[dict[str, types.ModuleType]]:
    """lightly 1.6's ``dcl_loss``, ``ntx_ent_loss`` and ``memory_bank`` modules, with stub
    packages around them (``lightly.models.utils`` needs torchvision; the memory bank only
    uses it when gathering)."""
    root = _root("lightly", "pip install --no-deps lightly==1.6.0")
    names = ("lightly", "lightly.utils", "lightly.utils.dist", "lightly.models", "lightly.models.utils",
             "lightly.models.modules", "lightly.models.modules.memory_bank")
    saved = {k: sys.modules.get(k) for k in names}
    try:
        for name in names[:2] + names[3:4] + names[5:6]:
            package = types.ModuleType(name)
            package.__path__ = []
            sys.modules[name] = package
        sys.modules["lightly.models.utils"] = types.ModuleType("lightly.models.utils")
        sys.modules["lightly.models"].utils = sys.modules["lightly.models.utils"]  # type: ignore[attr-defined]
        sys.modules["lightly.utils"].dist = load_file("lightly.utils.dist", root / "utils" / "dist.py")  # type: ignore[attr-defined]
        bank = load_file("lightly.models.modules.memory_bank", root / "models" / "modules" / "memory_bank.py")
        yield {"memory_bank": bank, "dcl_loss": load_file("lightly_dcl_loss_only", root / "loss" / "dcl_loss.py"),
               "ntx_ent_loss": load_file("lightly_ntx_ent_loss_only", root / "loss" / "ntx_ent_loss.py")}
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def open_clip_loss() -> types.ModuleType:
    """open_clip 3.3's ``loss.py`` alone."""
    root = _root("open_clip", "pip install --no-deps open_clip_torch==3.3.0")
    return load_file("open_clip_loss_only", root / "loss.py")


def tiny_sentence_transformer(folder: Path, seed: int = 0, hidden: int = 16):
    """A SentenceTransformer over a random one-layer BERT written to ``folder`` (mean pooling,
    no dropout), and its tokenizer's vocabulary words."""
    pytest.importorskip("sentence_transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import BertConfig, BertModel, BertTokenizer

    words = [f"w{i}" for i in range(40)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    BertTokenizer(str(folder / "vocab.txt")).save_pretrained(str(folder))
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=45, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
                        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    BertModel(config).save_pretrained(str(folder))
    return SentenceTransformer(str(folder), device="cpu"), words


def tiny_st_pair(tmp_path_factory: Any) -> tuple[Any, Any, list[str]]:
    """A tiny SentenceTransformer, a second one as a guide, both float64 (the comparisons are exact to
    rounding), and their vocabulary words."""
    model, words = tiny_sentence_transformer(tmp_path_factory.mktemp("bert_model"), seed=0)
    guide, _ = tiny_sentence_transformer(tmp_path_factory.mktemp("bert_guide"), seed=1)
    return model.double(), guide.double(), words


def st_features(model: Any, words: list[str], rows: int, columns: int, seed: int) -> tuple[list[list[str]], list[Any]]:
    """``columns`` columns of ``rows`` random texts of 1 to 6 words, and their features for ``model``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    texts = [[" ".join(words[j] for j in torch.randint(0, len(words), (int(torch.randint(1, 7, (1,), generator=gen)),),
                                                       generator=gen).tolist()) for _ in range(rows)] for _ in range(columns)]
    prepare = getattr(model, "preprocess", None) or model.tokenize
    return texts, [prepare(t) for t in texts]


def param_grads(model: Any) -> list[Any]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def libauc_contrastive() -> types.ModuleType:
    """LibAUC 2.0.1's ``losses/contrastive.py`` alone (``GCLoss_v1``, ``GCLoss_v2``): the package's
    ``__init__`` imports its whole stack; this file needs torch and numpy only."""
    root = _root("libauc", "pip install --no-deps libauc==2.0.1")
    return load_file("libauc_contrastive_only", root / "losses" / "contrastive.py")
