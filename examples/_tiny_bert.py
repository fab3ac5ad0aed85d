"""A tiny random BERT written to a folder (vocabulary of 40 words): stands in for a hub model
so the integration examples run offline and in seconds."""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = [f"w{i}" for i in range(40)]


def write_tiny_bert(folder: Path, seed: int = 0) -> Path:
    from transformers import BertConfig, BertModel, BertTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    BertTokenizer(str(folder / "vocab.txt")).save_pretrained(str(folder))
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=48, max_position_embeddings=32)
    BertModel(config).save_pretrained(str(folder))
    return folder


def sentence_pairs(rows: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """(anchor, positive) texts: the positive shares the anchor's words in another order."""
    gen = torch.Generator().manual_seed(seed)
    anchors, positives = [], []
    for _ in range(rows):
        ids = torch.randperm(len(WORDS), generator=gen)[:4].tolist()
        anchors.append(" ".join(WORDS[i] for i in ids))
        positives.append(" ".join(WORDS[i] for i in reversed(ids)))
    return anchors, positives
