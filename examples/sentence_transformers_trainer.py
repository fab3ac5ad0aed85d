"""Train a SentenceTransformer with torch-contrastive's MultipleNegativesRankingLoss as
``loss=`` of sentence-transformers' own trainer (both directions, in-batch negatives), optionally
wrapped in our MatryoshkaLoss (every prefix of the embedding trained, all from one pass).

    python examples/sentence_transformers_trainer.py --steps 20
    python examples/sentence_transformers_trainer.py --steps 20 --matryoshka

Without ``--model`` a tiny random BERT is written to a temporary folder (offline).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run(steps: int = 20, model_path: str | None = None, batch_size: int = 16, seed: int = 0,
        matryoshka: bool = False) -> dict[str, float]:
    """Train ``steps`` steps; returns the loss on a held batch before and after (with ``matryoshka``: the
    loss summed over the prefixes of 32, 16 and 8 features of the tiny model's 32)."""
    import torch
    from _tiny_bert import sentence_pairs, write_tiny_bert
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    from torch_contrastive.integrations.sentence_transformers import MatryoshkaLoss, MultipleNegativesRankingLoss

    with tempfile.TemporaryDirectory() as tmp:
        path = model_path or str(write_tiny_bert(Path(tmp) / "bert", seed))
        model = SentenceTransformer(path, device="cpu")
        anchors, positives = sentence_pairs(steps * batch_size, seed)
        data = Dataset.from_dict({"anchor": anchors, "positive": positives})
        loss = MultipleNegativesRankingLoss(model, scale=20.0, directions=("query_to_doc", "doc_to_query"))
        dims = [32, 16, 8]
        train_loss = MatryoshkaLoss(model, loss, dims) if matryoshka else loss
        held_a, held_p = sentence_pairs(64, seed + 1)

        def held_loss() -> float:
            with torch.no_grad():
                held = [model.encode(held_a, convert_to_tensor=True), model.encode(held_p, convert_to_tensor=True)]
                if isinstance(train_loss, MatryoshkaLoss):
                    return float(train_loss.loss_from_embeddings(held, None, dims, [1.0] * len(dims)))
                return float(loss.compute_loss_from_embeddings(held))

        before = held_loss()
        args = SentenceTransformerTrainingArguments(output_dir=str(Path(tmp) / "out"), max_steps=steps,
                                                    per_device_train_batch_size=batch_size, learning_rate=1e-3,
                                                    report_to="none", save_strategy="no", logging_steps=max(1, steps // 4),
                                                    seed=seed, use_cpu=True, disable_tqdm=True)
        SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=train_loss).train()
        return {"held_loss_before": before, "held_loss_after": held_loss()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default=None, help="a SentenceTransformer path or hub name (default: a tiny random BERT)")
    parser.add_argument("--matryoshka", action="store_true", help="train every prefix (32, 16, 8 features) with MatryoshkaLoss")
    a = parser.parse_args()
    print(run(a.steps, a.model, matryoshka=a.matryoshka))
