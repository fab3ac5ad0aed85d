"""MoCo v2 on scikit-learn's digits: a momentum key encoder, a queue of past keys, InfoNCE.

    python examples/moco_queue.py [--epochs 30] [--queue 1024] [--seed 0]

Each step encodes two augmentations of a batch: queries with the trained encoder, keys
with its exponential moving average (no gradient). The loss is InfoNCE of each query
against its key and the queue (``in_batch_negatives=False``, MoCo's form); then the keys
enter the queue (the first batch only fills it: an empty queue has no negative). Prints the
kNN accuracy (k = 5, cosine) of the untrained and the trained encoder on the test split;
about 15 s on 2 CPU cores. Seeds 0-3 measured here (2026-11-24): untrained 0.913 / 0.931 /
0.904 / 0.930, trained 0.956 / 0.961 / 0.944 / 0.967.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

import torch_contrastive as tc
from torch_contrastive.cli.models import ImageEncoder, augment, embed
from torch_contrastive.cli.train import load_digits_split


@torch.no_grad()
def momentum_update(key_encoder: torch.nn.Module, encoder: torch.nn.Module, momentum: float) -> None:
    for k, q in zip(key_encoder.parameters(), encoder.parameters()):
        k.mul_(momentum).add_(q.detach(), alpha=1 - momentum)


def knn_accuracy(encoder: torch.nn.Module, data: tuple[torch.Tensor, ...]) -> float:
    from sklearn.neighbors import KNeighborsClassifier

    x_tr, y_tr, x_te, y_te = data
    knn = KNeighborsClassifier(n_neighbors=5, metric="cosine").fit(embed(encoder, x_tr).numpy(), y_tr.numpy())
    return float(knn.score(embed(encoder, x_te).numpy(), y_te.numpy()))


def train(epochs: int = 30, queue_size: int = 1024, batch_size: int = 128, temperature: float = 0.1, momentum: float = 0.99,
          seed: int = 0) -> dict[str, float]:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    data = load_digits_split(seed)
    x_train = data[0]
    encoder = ImageEncoder(32)
    key_encoder = copy.deepcopy(encoder).requires_grad_(False)
    untrained = knn_accuracy(encoder, data)
    queue = tc.FeatureQueue(queue_size, 32)
    loss_fn = tc.InfoNCELoss(temperature, in_batch_negatives=False)
    opt = torch.optim.Adam(encoder.parameters(), lr=2e-3)
    losses = []
    for _ in range(epochs):
        order = torch.randperm(len(x_train), generator=gen)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            images = x_train[order[start : start + batch_size]]
            q = encoder(augment(images, gen))
            with torch.no_grad():
                k = key_encoder(augment(images, gen))
            if len(queue) == 0:  # an empty queue gives no negative (a ValueError): the first keys only fill it
                queue.push(k)
                continue
            loss = loss_fn(q, k, queue.features)
            opt.zero_grad()
            loss.backward()
            opt.step()
            momentum_update(key_encoder, encoder, momentum)
            queue.push(k)
            losses.append(loss.item())
    return {"knn_untrained": untrained, "knn_trained": knn_accuracy(encoder, data), "final_loss": losses[-1],
            "queue_rows": float(len(queue))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--queue", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(train(args.epochs, args.queue, seed=args.seed), indent=2))


if __name__ == "__main__":
    main()
