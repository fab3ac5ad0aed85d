"""tools/gpu_check.py, the GPU session's one command: its plan (dry mode, so it never rots on a CPU) and its report."""

from __future__ import annotations

import pytest

from helpers import ROOT, load_file


@pytest.fixture(scope="module")
def gpu_check():
    return load_file("gpu_check", ROOT / "tools" / "gpu_check.py")


def test_the_dry_run_names_every_stage_with_its_budget(gpu_check, tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path / "gc"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("  [")]
    assert [line.split(",")[0].strip(" [") for line in lines] == ["tests", "profile", "bench", "train", "train", "train"]
    assert sum(gpu_check.BUDGET.values()) <= 9 * 60  # the whole command inside about nine minutes
    tests = lines[0]
    assert "TORCH_CONTRASTIVE_AUTOTUNE=0" in tests and "-m pytest" in tests and "junit.xml" in tests and "--durations" in tests
    assert "bench --gpu --backend auto,epilogue,triton" in lines[2]
    assert "--device cuda --precision bf16" in lines[3] and "--device cpu" in lines[4]
    assert "torchrun" in lines[5] and "--distributed" in lines[5]
    assert not (tmp_path / "gc").exists()  # nothing written, nothing run


def test_stages_and_bench_sizes_narrow_the_plan_and_unknown_stages_are_refused(gpu_check, tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path), "--stages", "bench", "--bench-sizes", "65536", "--bench-backends", "auto",
                           "--dry-run"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  [")]
    assert len(lines) == 1 and lines[0].endswith("--sizes 65536") and "--backend auto " in lines[0]
    assert gpu_check.main(["--stages", "tests,gpu"]) == 2
    assert "--stages: unknown stage(s) gpu" in capsys.readouterr().err


def test_shards_split_the_test_files_without_overlap(gpu_check, tmp_path, capsys):
    everything = gpu_check.test_files()
    shards = [gpu_check.test_files((k, 3)) for k in (1, 2, 3)]
    assert sorted(f for shard in shards for f in shard) == everything and all(shards) and "tests/test_gpu_check.py" in everything
    assert gpu_check.main(["--out", str(tmp_path), "--stages", "tests", "--shard", "2/3", "--dry-run"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  [tests"))
    assert all(f in line for f in shards[1]) and not any(f in line.split() for f in shards[0])
    with pytest.raises(SystemExit):
        gpu_check.main(["--shard", "4/3"])


def test_the_junit_report_counts_and_lists_failures_and_skips(gpu_check, tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.a" name="test_ok"/>'
        '<testcase classname="tests.a" name="test_bad"><failure message="assert 1 == 2&#10;more">trace</failure></testcase>'
        '<testcase classname="tests.b" name="test_gpu_only"><skipped message="needs two GPUs"/></testcase>'
        '<testcase classname="tests.b" name="test_broken"><error message="fixture failed"/></testcase>'
        "</testsuite></testsuites>")
    counts, failed, skipped = gpu_check._test_report(junit)
    assert counts == "1 passed, 2 failed, 1 skipped"
    assert failed == ["tests.a::test_bad: assert 1 == 2", "tests.b::test_broken: fixture failed"]
    assert skipped == ["tests.b::test_gpu_only: needs two GPUs"]
    assert gpu_check._test_report(tmp_path / "missing.xml")[0].startswith("no junit file")
