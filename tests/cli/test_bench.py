"""The benchmark command: a tiny grid runs, writes CSV + PNG, and every implementation computes the same loss."""

from __future__ import annotations

import csv
import math

import pytest

from torch_contrastive.cli import main
from torch_contrastive.cli.bench import plan, worker


def test_worker_measures_one_case():
    row = worker({"loss": "nt_xent", "impl": "ours", "n": 128, "d": 16, "tau": 0.1, "reps": 1})
    dense = worker({"loss": "nt_xent", "impl": "dense-baseline", "n": 128, "d": 16, "tau": 0.1, "reps": 1})
    assert row["value"] == pytest.approx(dense["value"], rel=1e-5)
    # R is the ratio of the two medians' pairs: it must lie between the extreme ratios it was built from.
    assert math.isfinite(row["R"]) and row["seconds"] > 0 and row["matmul_seconds"] > 0
    assert row["R"] == pytest.approx(row["seconds"] / row["matmul_seconds"], rel=1.0)


def test_plan_limits_peers_to_sizes_they_can_hold():
    cases = plan(quick=False, sizes=[2048, 65536], dim=64, tau=0.07, include_large=False)
    big = [c for c in cases if c["n"] == 65536]
    assert big and all(c["impl"] in ("ours", "ours-moco", "infcl-formula") for c in big)  # O(N) memory only
    assert not any(c["impl"] == "pml" and c["n"] > 4096 for c in cases)
    small = {(c["loss"], c["impl"]) for c in cases if c["n"] == 2048}
    assert ("clip", "dense-baseline") in small and ("supcon", "pml") in small


def test_bench_command_writes_csv_and_plot(tmp_path, capsys):
    assert main(["bench", "--loss", "supcon", "--sizes", "96", "--dim", "8", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "bench.csv") as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames is not None and {"loss", "impl", "n", "d", "value", "seconds", "R", "extra_mib", "status"} <= set(reader.fieldnames)
        rows = list(reader)
    by_impl = {r["impl"]: r for r in rows}
    assert set(by_impl) == {"ours", "ours-dense", "pml", "supcon-authors-formula", "dense-compiled"}
    assert all(r["loss"] == "supcon" and r["n"] == "96" and r["d"] == "8" and r["status"] == "ok" for r in rows)
    reference = float(by_impl["supcon-authors-formula"]["value"])
    for impl in ("ours", "ours-dense", "pml", "dense-compiled"):
        assert float(by_impl[impl]["value"]) == pytest.approx(reference, rel=1e-5), impl
        assert float(by_impl[impl]["R"]) > 0 and float(by_impl[impl]["extra_mib"]) >= 0
    assert (tmp_path / "bench.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "supcon-authors-formula" in printed and "wrote" in printed


def test_queue_case_values_agree_and_reference_has_the_queue_shape():
    """info_nce_queue: in-batch + queue equals the dense formula; MoCo's form equals info-nce-pytorch."""
    pytest.importorskip("info_nce")
    spec = {"loss": "info_nce_queue", "n": 64, "d": 16, "tau": 0.1, "reps": 1, "queue": 300}
    rows = {impl: worker({**spec, "impl": impl}) for impl in ("ours", "dense-baseline", "ours-moco", "info_nce")}
    assert rows["ours"]["value"] == pytest.approx(rows["dense-baseline"]["value"], rel=1e-5)
    assert rows["ours-moco"]["value"] == pytest.approx(rows["info_nce"]["value"], rel=1e-5)
    assert rows["ours"]["value"] != pytest.approx(rows["ours-moco"]["value"], rel=1e-3)  # two different forms
    assert all(math.isfinite(r["R"]) for r in rows.values())


def test_matryoshka_case_values_agree_over_the_five_prefixes():
    """matryoshka: ours in one pass equals the peer's per-prefix computation (768/512/256/128/64 up to D)."""
    pytest.importorskip("sentence_transformers")
    from torch_contrastive.cli.bench_matryoshka import prefixes

    assert prefixes(768) == [768, 512, 256, 128, 64] and prefixes(96) == [96, 64]
    spec = {"loss": "matryoshka", "n": 64, "d": 768, "tau": 0.05, "reps": 1}
    rows = {impl: worker({**spec, "impl": impl}) for impl in ("ours", "sentence-transformers")}
    assert rows["ours"]["value"] == pytest.approx(rows["sentence-transformers"]["value"], rel=1e-5)
    assert all(math.isfinite(r["R"]) for r in rows.values())


def test_backend_and_device_options_are_checked(capsys):
    assert main(["bench", "--loss", "clip", "--sizes", "64", "--backend", "triton"]) == 2
    assert "needs --device cuda" in capsys.readouterr().err
    assert main(["bench", "--loss", "clip", "--sizes", "64", "--backend", "jax"]) == 2
    assert "--backend takes auto, torch, triton and/or epilogue" in capsys.readouterr().err


def test_infcl_formula_peer_is_the_clip_loss():
    """The Inf-CL schedule peer (several tiles, its own backward) equals the dense CLIP loss in float64."""
    import torch

    from torch_contrastive.cli.bench import dense_clip
    from torch_contrastive.cli.infcl_formula import infcl_clip_loss

    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(13, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    value = infcl_clip_loss(x, y, 0.3, tile=4)
    ref = dense_clip(x, y, 0.3)
    assert value.item() == pytest.approx(ref.item(), rel=1e-12)
    for a, b in zip(torch.autograd.grad(value, (x, y)), torch.autograd.grad(ref, (x, y))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_bench_dtype_option_reaches_the_cases(tmp_path):
    row = worker({"loss": "clip", "impl": "infcl-formula", "n": 64, "d": 16, "tau": 0.1, "reps": 1, "dtype": "bfloat16"})
    dense = worker({"loss": "clip", "impl": "dense-baseline", "n": 64, "d": 16, "tau": 0.1, "reps": 1, "dtype": "bfloat16"})
    fp32 = worker({"loss": "clip", "impl": "dense-baseline", "n": 64, "d": 16, "tau": 0.1, "reps": 1})
    assert row["value"] == pytest.approx(dense["value"], rel=3e-2) and dense["value"] != fp32["value"]
    assert main(["bench", "--loss", "clip", "--sizes", "64", "--dim", "8", "--dtype", "float16", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "bench.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["dtype"] for r in rows} == {"float16"} and "infcl-formula" in {r["impl"] for r in rows}


def test_gpu_preset_holds_the_anchor_at_every_size_dense_can_hold(monkeypatch):
    """``--gpu``: beside ours (per backend) the compiled dense formula -- the anchor -- and eager dense
    at every size up to 65,536 rows, ours alone beyond, Inf-CL's kernels only when the package is installed."""
    from torch_contrastive.cli import bench

    monkeypatch.setattr(bench, "infcl_installed", lambda: False)
    cases = bench.gpu_plan(["auto", "triton"])
    by_size: dict = {}
    for c in cases:
        by_size.setdefault((c["loss"], c["n"], c["d"]), []).append(c["impl"] if c["impl"] != "ours" else f"ours[{c['backend']}]")
    assert ("clip", 4096, 512) in by_size and ("clip", 65536, 768) in by_size and ("nt_xent", 65536, 768) in by_size
    for (loss, n, _), impls in by_size.items():
        expected = ["dense-compiled", "dense-baseline"] if n <= bench.GPU_DENSE_MAX else []
        assert impls == [*expected, "ours[auto]", "ours[triton]"], (loss, n)
    assert max(n for _, n, _ in by_size) == 262144
    monkeypatch.setattr(bench, "infcl_installed", lambda: True)
    with_infcl = [c for c in bench.gpu_plan(["auto"]) if c["impl"] == "inf_cl"]
    assert {c["n"] for c in with_infcl} == {n for loss, n, _ in bench.GPU_GRID if loss == "clip"}
