"""Test-split metrics of the training command: kNN, linear probe, zero-shot, retrieval recall."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .data import Data
from .models import TEMPLATES, Vocabulary, embed, embed_text

RECALL_KS = (1, 5, 10)
#: Support images per class of the few-shot metric.
FEW_SHOTS = 3


@torch.no_grad()
def labelled_metrics(enc: nn.Module, text: nn.Module | None, vocab: Vocabulary | None, data: Data) -> dict[str, float]:
    """kNN (k=5, cosine), linear-probe and 3-shot 1-NN accuracy on the test split; zero-shot
    (nearest class caption) for the digits image-text recipes."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.neighbors import KNeighborsClassifier

    if data.labels is None:
        raise RuntimeError("internal: labelled metrics need labels")
    y_tr, y_te = data.labels[data.train_idx].numpy(), data.labels[data.test_idx].numpy()
    e_tr, e_te = embed(enc, data.images[data.train_idx]).numpy(), embed(enc, data.images[data.test_idx]).numpy()
    knn = KNeighborsClassifier(n_neighbors=min(5, len(y_tr)), metric="cosine").fit(e_tr, y_tr)
    probe = LogisticRegression(max_iter=2000).fit(e_tr, y_tr)
    metrics = {"knn_accuracy": float(knn.score(e_te, y_te)), "linear_probe_accuracy": float(probe.score(e_te, y_te)),
               "few_shot_accuracy": few_shot_accuracy(e_tr, y_tr, e_te, y_te)}
    if text is not None and vocab is not None:
        prototypes = embed_text(text, vocab, vocab.class_captions).reshape(10, len(TEMPLATES), -1).mean(1)
        pred = (torch.from_numpy(e_te) @ F.normalize(prototypes, dim=1).T).argmax(1)
        metrics["zero_shot_accuracy"] = float((pred == data.labels[data.test_idx]).float().mean())
    return metrics


def few_shot_accuracy(e_tr: Any, y_tr: Any, e_te: Any, y_te: Any, shots: int = FEW_SHOTS, draws: int = 20, seed: int = 0) -> float:
    """``shots``-shot 1-NN accuracy (cosine) on the test split, averaged over ``draws`` seeded draws of
    the support images per class: what an encoder gives with a handful of labels, where kNN on the
    whole training split (and a linear probe) also credit the labels themselves."""
    import numpy as np

    rng = np.random.default_rng(seed)
    train = e_tr / np.maximum(np.linalg.norm(e_tr, axis=1, keepdims=True), 1e-12)
    test = e_te / np.maximum(np.linalg.norm(e_te, axis=1, keepdims=True), 1e-12)
    scores = []
    for _ in range(draws):
        support = np.concatenate([rng.choice(np.flatnonzero(y_tr == c), size=min(shots, int((y_tr == c).sum())), replace=False)
                                  for c in np.unique(y_tr)])
        pred = y_tr[support][(test @ train[support].T).argmax(1)]
        scores.append(float((pred == y_te).mean()))
    return float(np.mean(scores))


def recall_at_k(image_emb: Tensor, text_emb: Tensor, row_image: Tensor, ks: tuple[int, ...] = RECALL_KS) -> dict[str, float]:
    """Image->text and text->image recall@k, COCO convention.

    ``row_image[c]`` is the image (row of ``image_emb``) of caption ``c``. An image is
    retrieved correctly at k when any of its captions is among its k most similar
    captions; a caption when its image is among its k most similar images. ``k`` is
    capped at the number of candidates.
    """
    sim = image_emb @ text_emb.T  # (images, captions)
    owns = row_image[None, :] == torch.arange(image_emb.shape[0])[:, None]  # (images, captions)
    metrics = {}
    for k in ks:
        top_text = sim.topk(min(k, sim.shape[1]), dim=1).indices
        metrics[f"image_to_text_recall@{k}"] = float(owns.gather(1, top_text).any(1).float().mean())
    for k in ks:
        top_image = sim.T.topk(min(k, sim.shape[0]), dim=1).indices  # (captions, k)
        metrics[f"text_to_image_recall@{k}"] = float((top_image == row_image[:, None]).any(1).float().mean())
    return metrics


@torch.no_grad()
def caption_metrics(enc: nn.Module, text: nn.Module, vocab: Vocabulary, data: Data) -> dict[str, float]:
    """Retrieval recall on the test split of a caption CSV (test images x their caption rows)."""
    if data.row_image is None:
        raise RuntimeError("internal: caption metrics need caption rows")
    rows = data.rows_of(data.test_idx)
    # test images renumbered 0..m-1 (test_idx is sorted), their caption rows mapped to them
    position = torch.full((len(data.images),), -1, dtype=torch.int64)
    position[data.test_idx] = torch.arange(len(data.test_idx))
    image_emb = embed(enc, data.images[data.test_idx])
    text_emb = embed_text(text, vocab, [data.captions[int(r)] for r in rows])
    return recall_at_k(image_emb, text_emb, position[data.row_image[rows]])


def tracked_metric(enc: nn.Module, text: nn.Module | None, vocab: Vocabulary | None, data: Data) -> tuple[str, float]:
    """The one cheap metric followed during training (``loss.png``): kNN accuracy (k = 5,
    cosine) on the test split for labelled data, image-to-text recall@1 for a caption CSV."""
    from sklearn.neighbors import KNeighborsClassifier

    if data.labels is None:
        if text is None or vocab is None:
            raise RuntimeError("internal: caption data needs the text encoder")
        return "image_to_text_recall@1", caption_metrics(enc, text, vocab, data)["image_to_text_recall@1"]
    y_tr, y_te = data.labels[data.train_idx].numpy(), data.labels[data.test_idx].numpy()
    e_tr, e_te = embed(enc, data.images[data.train_idx]).numpy(), embed(enc, data.images[data.test_idx]).numpy()
    knn = KNeighborsClassifier(n_neighbors=min(5, len(y_tr)), metric="cosine").fit(e_tr, y_tr)
    return "knn_accuracy", float(knn.score(e_te, y_te))
