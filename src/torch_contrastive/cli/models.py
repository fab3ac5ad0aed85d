"""The training command's models and augmentation: a small CNN, a bag-of-words text
encoder, and image augmentations that work for any channel count and size."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TEMPLATES = ["a handwritten {name}", "the digit {name}", "a scan of the number {name}", "a {name} written by hand"]


def augment(x: Tensor, generator: torch.Generator) -> Tensor:
    """Random rotation (+-15 deg), shift (+-1/8 of the side), scale, Gaussian noise and a
    cut-out of 3/8 of the side on half of the views. ``x``: (n, C, H, H) in [0, 1]."""
    n, side = x.shape[0], x.shape[-1]
    angle = (torch.rand(n, generator=generator) - 0.5) * (math.pi / 6)
    scale = 1 + (torch.rand(n, generator=generator) - 0.5) * 0.2
    shift = (torch.rand(n, 2, generator=generator) - 0.5) * 0.5  # in [-1, 1] coordinates: +-1/8 of the side
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = F.grid_sample(x, grid, align_corners=False, padding_mode="zeros")
    out = out + 0.05 * torch.randn(out.shape, generator=generator)
    cut = max(1, round(3 * side / 8))
    corner = torch.randint(0, side - cut + 1, (n, 2), generator=generator)
    rows = torch.arange(side)
    keep = ~(((rows[None, :, None] >= corner[:, 0, None, None]) & (rows[None, :, None] < corner[:, 0, None, None] + cut))
             & ((rows[None, None, :] >= corner[:, 1, None, None]) & (rows[None, None, :] < corner[:, 1, None, None] + cut)))
    drop = torch.rand(n, generator=generator) < 0.5  # cut-out on half of the views
    keep = keep | ~drop[:, None, None]
    return (out * keep[:, None]).clamp(0, 1)


class ImageEncoder(nn.Module):
    """Small CNN with a projection head to ``dim``; adapts to ``channels`` and ``size``.

    Two 3x3 convolutions (a 2x2 max-pool between them from 16 pixels up), then a max-pool
    to 4x4: for the 8x8 digits exactly the network of earlier versions.
    """

    def __init__(self, dim: int, channels: int = 1, size: int = 8) -> None:
        super().__init__()
        between: list[nn.Module] = [nn.MaxPool2d(2)] if size >= 16 else []
        self.backbone = nn.Sequential(
            nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(), *between, nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.AdaptiveMaxPool2d(4), nn.Flatten(), nn.Linear(64 * 16, 128), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))


class Vocabulary:
    """Word list of a caption set; captions -> token ids for ``nn.EmbeddingBag``.

    Words are lower-cased whitespace tokens. A word the vocabulary has never seen (a new
    caption at ``embed`` time) is left out; a caption with no known word is an empty bag,
    which the text encoder maps to its bias alone.
    """

    def __init__(self, captions: list[str]) -> None:
        self.words = sorted({w for c in captions for w in c.lower().split()})
        self.index = {w: i for i, w in enumerate(self.words)}

    @classmethod
    def from_words(cls, words: list[str]) -> Vocabulary:
        """A saved vocabulary (its :attr:`words`)."""
        vocab = cls([])
        vocab.words = list(words)
        vocab.index = {w: i for i, w in enumerate(vocab.words)}
        return vocab

    @classmethod
    def digits(cls) -> Vocabulary:
        """The caption templates of the digits recipes (class-major in :attr:`class_captions`)."""
        return cls([t.format(name=name) for name in DIGIT_NAMES for t in TEMPLATES])

    @property
    def class_captions(self) -> list[str]:
        return [t.format(name=name) for name in DIGIT_NAMES for t in TEMPLATES]

    def encode(self, captions: list[str]) -> tuple[Tensor, Tensor]:
        """(flat token ids, offsets) for ``nn.EmbeddingBag``."""
        tokens = [[self.index[w] for w in c.lower().split() if w in self.index] for c in captions]
        offsets = torch.tensor([0] + [len(t) for t in tokens[:-1]], dtype=torch.int64).cumsum(0)
        return torch.tensor([i for t in tokens for i in t], dtype=torch.int64), offsets


class TextEncoder(nn.Module):
    """Bag of words over a fixed vocabulary."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab_size, 64, mode="mean")
        self.proj = nn.Sequential(nn.ReLU(), nn.Linear(64, dim))

    def forward(self, tokens: Tensor, offsets: Tensor) -> Tensor:
        return self.proj(self.bag(tokens, offsets))


@torch.no_grad()
def embed(enc: nn.Module, x: Tensor, batch: int = 1024) -> Tensor:
    """L2-normalised embeddings of images ``x`` in eval mode (in batches)."""
    enc.eval()
    device = next(enc.parameters()).device  # on the encoder's device; the result on the CPU
    out = torch.cat([F.normalize(enc(part.to(device)).float(), dim=1).cpu() for part in x.split(batch)]) if len(x) else torch.zeros(0)
    enc.train()
    return out


@torch.no_grad()
def embed_text(text: nn.Module, vocab: Vocabulary, captions: list[str]) -> Tensor:
    text.eval()
    tokens, offsets = vocab.encode(captions)
    device = next(text.parameters()).device
    out = F.normalize(text(tokens.to(device), offsets.to(device)).float(), dim=1).cpu()
    text.train()
    return out
