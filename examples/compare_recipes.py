"""Train every recipe (and clip with/without duplicate ids) over several seeds; print a table.

    python examples/compare_recipes.py --seeds 0 1 2

Each run is ``torch-contrastive train`` with default settings (16-d embeddings); the
table reports test-split accuracies of the untrained and trained encoders.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from torch_contrastive.cli.train import DEFAULT_BATCH_SIZE, DEFAULT_TEMPERATURE, Config, train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=None, help="override every recipe's default batch size")
    parser.add_argument("--recipes", nargs="+", default=["clip", "siglip", "nt_xent", "nt_bxent", "supcon"])
    args = parser.parse_args()
    variants = [(loss, dedupe) for loss in args.recipes for dedupe in ((True, False) if loss == "clip" else (True,))]
    print("| recipe | kNN untrained | kNN trained | linear probe | zero-shot | train s |")
    print("|---|---|---|---|---|---|")
    for loss, dedupe in variants:
        runs = []
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as out:
                cfg = Config(loss=loss, seed=seed, epochs=args.epochs, dedupe_ids=dedupe,
                             batch_size=args.batch_size or DEFAULT_BATCH_SIZE[loss], temperature=DEFAULT_TEMPERATURE[loss], out=out)
                runs.append(train(cfg, progress=False))

        def mean(part: str, key: str, runs: list = runs) -> str:
            values = [r[part][key] for r in runs if key in r[part]]
            return f"{100 * statistics.mean(values):.1f}%" if values else "-"

        name = loss + (" --dedupe-ids" if loss == "clip" and dedupe else " --no-dedupe-ids" if loss == "clip" else "")
        seconds = statistics.mean(r["train_seconds"] for r in runs)
        print(f"| {name} | {mean('untrained', 'knn_accuracy')} | {mean('trained', 'knn_accuracy')} | "
              f"{mean('trained', 'linear_probe_accuracy')} | {mean('trained', 'zero_shot_accuracy')} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
