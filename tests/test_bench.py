"""The benchmark command: a tiny grid runs, writes CSV + PNG, reports peers honestly."""

from __future__ import annotations

import csv

from torch_contrastive.cli import main
from torch_contrastive.cli.bench import plan, worker


def test_worker_measures_one_case():
    row = worker({"loss": "nt_xent", "impl": "ours", "n": 128, "d": 16, "tau": 0.1, "reps": 1})
    assert row["seconds"] > 0 and row["matmul_seconds"] > 0 and row["R"] > 0


def test_plan_limits_peers_to_sizes_they_can_hold():
    cases = plan(quick=False, sizes=[2048, 65536], dim=64, tau=0.07, include_large=False)
    big = [c for c in cases if c["n"] == 65536]
    assert big and all(c["impl"] == "ours" for c in big)
    assert not any(c["impl"] == "pml" and c["n"] > 4096 for c in cases)


def test_bench_command_writes_csv_and_plot(tmp_path, capsys):
    assert main(["bench", "--loss", "supcon", "--sizes", "96", "--dim", "8", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "bench.csv")))
    impls = {r["impl"]: r["status"] for r in rows}
    assert impls["ours"] == "ok" and impls["supcon-authors-formula"] == "ok"
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert "R" in capsys.readouterr().out
