"""What the training command shows after a run: ``loss.png`` (the loss beside a held-out metric),
``embedding.png`` (the held-out split's embeddings, PCA to two axes) and the before/after table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ._paths import save_figure
from .data import Data
from .models import Vocabulary, embed

__all__ = ["plots", "table"]


def plots(out: Path, history: list[float], enc: nn.Module, data: Data, title: str,
           tracked: tuple[str, list[tuple[int, float]]] | None = None, pairs: tuple[nn.Module, Vocabulary] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 3.4))
    ax.plot(range(1, len(history) + 1), history, "-o", ms=3, color="tab:blue", label="training loss")
    ax.set(xlabel="epoch", ylabel="mean training loss", title=title)
    if tracked is not None and tracked[1]:
        name, points = tracked
        right = ax.twinx()  # the held-out metric beside the loss: is the loss buying anything?
        right.plot([e for e, _ in points], [100 * m for _, m in points], "-s", ms=3, color="tab:orange", label=f"test {name}")
        right.set_ylabel(f"test {name} (%)", color="tab:orange")
        right.tick_params(axis="y", colors="tab:orange")
        ax.legend(handles=ax.get_lines() + right.get_lines(), fontsize=7, loc="center right")
    fig.tight_layout()
    save_figure(fig, out / "loss.png")
    plt.close(fig)
    e = embed(enc, data.images[data.test_idx])
    centred = e - e.mean(0)
    _, _, v = torch.pca_lowrank(centred, q=2, center=False)
    xy = (centred @ v[:, :2]).numpy()
    fig, ax = plt.subplots(figsize=(5, 4.4))
    if data.labels is not None:
        # categorical colours with the class names in a legend (a colour bar suggests an order)
        labels = data.labels[data.test_idx].numpy()
        cmap = plt.get_cmap("tab10" if len(data.class_names) <= 10 else "tab20")
        for k, name in enumerate(data.class_names or [str(c) for c in sorted(set(labels.tolist()))]):
            keep = labels == k
            if keep.any():
                ax.scatter(xy[keep, 0], xy[keep, 1], s=8, color=cmap(k % cmap.N), label=name)
        if len(data.class_names) <= 20:
            ax.legend(fontsize=7, markerscale=2, loc="best", ncol=2 if len(data.class_names) > 10 else 1, title="class")
    else:
        ax.scatter(xy[:, 0], xy[:, 1], s=8, label="test images")
        if pairs is not None:
            join_pairs(ax, data, e.mean(0), v[:, :2], xy, *pairs)
    ax.set(title=f"{title}: test embeddings (PCA)", xticks=[], yticks=[])
    fig.tight_layout()
    save_figure(fig, out / "embedding.png")
    plt.close(fig)


def join_pairs(ax: Any, data: Data, mean: Tensor, basis: Tensor, xy: Any, text: nn.Module, vocab: Vocabulary,
                shown: int = 5) -> None:
    """A caption CSV's map: a few test images drawn as thumbnails, each joined to its caption's
    embedding (same projection) and labelled with the caption."""
    from matplotlib.offsetbox import AnnotationBbox, OffsetImage

    from .models import embed_text

    if data.row_image is None:
        return
    spread = torch.linspace(0, len(data.test_idx) - 1, min(shown, len(data.test_idx))).long().tolist()  # across the split
    for k in spread:
        image = int(data.test_idx[k])
        row = int((data.row_image == image).nonzero()[0, 0])
        caption = data.captions[row]
        t = ((embed_text(text, vocab, [caption]) - mean) @ basis).numpy()[0]
        ax.plot([xy[k, 0], t[0]], [xy[k, 1], t[1]], color="0.5", lw=0.8)
        ax.scatter([t[0]], [t[1]], marker="x", color="tab:red", s=20, label="caption" if k == spread[0] else None)
        ax.annotate(caption[:28], (t[0], t[1]), fontsize=6, color="tab:red", xytext=(3, 3), textcoords="offset points")
        thumb = data.images[image].permute(1, 2, 0).squeeze(-1).numpy()
        ax.add_artist(AnnotationBbox(OffsetImage(thumb, zoom=0.8, cmap="gray"), (xy[k, 0], xy[k, 1]), frameon=False))
    ax.legend(fontsize=7, loc="best")


def table(before: dict[str, float], after: dict[str, float]) -> str:
    lines = [f"{'metric (test split)':<28} {'untrained':>10} {'trained':>10}"]
    for key in after:
        lines.append(f"{key:<28} {before[key] * 100:>9.1f}% {after[key] * 100:>9.1f}%")
    return "\n".join(lines)
