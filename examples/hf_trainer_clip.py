"""A Hugging Face ``Trainer`` whose ``compute_loss`` is torch-contrastive's InfoNCE: a text
encoder (tiny random BERT, mean pooling) trained on (anchor, positive) pairs.

    python examples/hf_trainer_clip.py --steps 20
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch_contrastive as tc


def _mean_pool(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


def run(steps: int = 20, batch_size: int = 16, seed: int = 0) -> dict[str, float]:
    """Train ``steps`` steps; returns the loss on held pairs before and after."""
    from _tiny_bert import sentence_pairs, write_tiny_bert
    from transformers import AutoModel, AutoTokenizer, Trainer, TrainingArguments

    class ContrastiveTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            query = _mean_pool(model, inputs["anchor_ids"], inputs["anchor_mask"])
            key = _mean_pool(model, inputs["positive_ids"], inputs["positive_mask"])
            loss = tc.info_nce_loss(query, key, temperature=0.05)
            return (loss, {"query": query}) if return_outputs else loss

    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_bert(Path(tmp) / "bert", seed)
        tokenizer, model = AutoTokenizer.from_pretrained(str(path)), AutoModel.from_pretrained(str(path))
        anchors, positives = sentence_pairs(steps * batch_size, seed)

        def encode(a: list[str], p: list[str]) -> dict[str, torch.Tensor]:
            ta, tp = tokenizer(a, padding="max_length", max_length=8, return_tensors="pt"), tokenizer(
                p, padding="max_length", max_length=8, return_tensors="pt")
            return {"anchor_ids": ta["input_ids"], "anchor_mask": ta["attention_mask"],
                    "positive_ids": tp["input_ids"], "positive_mask": tp["attention_mask"]}

        train = encode(anchors, positives)
        rows = [{k: v[i] for k, v in train.items()} for i in range(len(anchors))]
        held = encode(*sentence_pairs(64, seed + 1))

        def held_loss() -> float:
            model.eval()
            with torch.no_grad():
                q = _mean_pool(model, held["anchor_ids"], held["anchor_mask"])
                return float(tc.info_nce_loss(q, _mean_pool(model, held["positive_ids"], held["positive_mask"]), temperature=0.05))

        before = held_loss()
        args = TrainingArguments(output_dir=str(Path(tmp) / "out"), max_steps=steps, per_device_train_batch_size=batch_size,
                                 learning_rate=1e-3, report_to="none", save_strategy="no", seed=seed, use_cpu=True,
                                 remove_unused_columns=False, disable_tqdm=True, logging_steps=max(1, steps // 4))
        ContrastiveTrainer(model=model, args=args, train_dataset=rows).train()
        return {"held_loss_before": before, "held_loss_after": held_loss()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    print(run(parser.parse_args().steps))
