"""One command for a GPU session: the suite on CUDA, a profile of the default call, the GPU bench
table and training on the GPU, each stage with its own time budget, logs into one folder.

    PYTHONPATH=src python3 tools/gpu_check.py --out gpu-check          # on the GPU machine
    python tools/gpu_check.py --out gpu-check                          # here: says what it would run

GPU time comes in short windows (about half an hour, minutes of it start-up), so nothing here
installs anything: it uses the machine's torch, triton, pytest (with pytest-xdist and
pytest-timeout when present) and hypothesis, and runs this checkout through ``PYTHONPATH=src``.
Without CUDA it runs nothing and prints the plan (``--dry-run`` does the same on a GPU), so the
command is tested on every machine and does not rot.

Stages (``--stages`` picks some, in this order):

* ``tests``: the whole suite on the device fixture's CUDA, spread over the cores, with kernel
  autotuning off (``TORCH_CONTRASTIVE_AUTOTUNE=0``: values, not speed, are checked there), a junit
  file, and ``skipped.txt`` listing every test skipped on the GPU with its reason;
* ``profile``: the default call of every loss at 1k-8k rows against the eager dense formula --
  device time, host (enqueue) time and kernel launches per call -- and a ``torch.profiler`` table of
  CLIP at 8,192 rows (``profile.log``);
* ``bench``: ``torch-contrastive bench --gpu`` (ours per backend beside eager dense and
  ``torch.compile`` of it), its CSV and plot;
* ``train``: ``train --device cuda --precision bf16`` against ``--device cpu`` on the bundled
  digits, then one rank under ``torchrun --distributed``.

The summary (``summary.txt``, also printed) names the machine, the versions and each stage's result.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("tests", "profile", "bench", "train")
#: Seconds per stage (the whole command stays under about nine minutes).
BUDGET = {"tests": 240, "profile": 60, "bench": 150, "train": 90}


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1")
    env.setdefault("TORCH_CONTRASTIVE_AUTOTUNE", "1")
    return env


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _pytest_knows(option: str) -> bool:
    help_text = subprocess.run([sys.executable, "-m", "pytest", "--help"], capture_output=True, text=True, cwd=ROOT).stdout
    return option in help_text


def test_files(shard: tuple[int, int] = (1, 1)) -> list[str]:
    """The suite's test files, shard ``k`` of ``n`` (every n-th file from the k-th, in name order): a GPU
    session whose cold kernel compiles do not let the whole suite finish in one call runs it in shards."""
    k, n = shard
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))
    return files[k - 1::n]


def _shard(text: str) -> tuple[int, int]:
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise argparse.ArgumentTypeError(f"expected K/N with 1 <= K <= N, got {text!r}")
    return int(k), int(n)


def commands(out: Path, stages: list[str], budget: dict[str, int], bench_sizes: str | None,
             backends: str = "auto,epilogue,triton", shard: tuple[int, int] = (1, 1)) -> list[tuple[str, list[str], dict[str, str]]]:
    """(stage, argv, extra environment) of every run, in order."""
    py = sys.executable
    runs: list[tuple[str, list[str], dict[str, str]]] = []
    if "tests" in stages:
        argv = [py, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-rs", "--tb=short", "-v", "--durations", "30",
                "--junitxml", str(out / "junit.xml"), *test_files(shard)]
        if _has("xdist"):
            argv += ["-n", str(min(16, os.cpu_count() or 1))]
        if _has("pytest_timeout"):
            argv += ["--timeout", "120"]
            if _pytest_knows("--session-timeout"):  # pytest-timeout >= 2.3: ends the run with its report written
                argv += ["--session-timeout", str(budget["tests"] - 60)]  # a test may take a minute to compile
        runs.append(("tests", argv, {"TORCH_CONTRASTIVE_AUTOTUNE": "0"}))
    if "profile" in stages:
        runs.append(("profile", [py, str(ROOT / "tools" / "gpu_profile.py")], {}))
    if "bench" in stages:
        argv = [py, "-m", "torch_contrastive", "bench", "--gpu", "--backend", backends, "--timeout", "60",
                "--out", str(out / "bench")]
        if bench_sizes:
            argv += ["--sizes", bench_sizes]
        runs.append(("bench", argv, {}))
    if "train" in stages:
        train = [py, "-m", "torch_contrastive", "train", "--epochs", "4", "--quiet", "--overwrite"]
        runs.append(("train", [*train, "--device", "cuda", "--precision", "bf16", "--out", str(out / "train-cuda")], {}))
        runs.append(("train", [*train, "--device", "cpu", "--out", str(out / "train-cpu")], {}))
        torchrun = shutil.which("torchrun") or "torchrun"
        runs.append(("train", [torchrun, "--standalone", "--nproc-per-node", "1", "-m", "torch_contrastive", "train", "--distributed",
                               "--epochs", "2", "--quiet", "--overwrite", "--out", str(out / "train-torchrun")], {}))
    return runs


def _test_report(junit: Path) -> tuple[str, list[str], list[str]]:
    """Counts, the failures and the skips (with reasons) of a junit file."""
    if not junit.exists():
        return "no junit file (the run was cut off)", [], []
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed, skipped = [], []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            counts["failed"] += 1
            failed.append(f"{name}: {(bad.get('message') or '').splitlines()[0][:200] if bad.get('message') else ''}")
        elif skip is not None:
            counts["skipped"] += 1
            skipped.append(f"{name}: {skip.get('message')}")
        else:
            counts["passed"] += 1
    return ", ".join(f"{v} {k}" for k, v in counts.items()), failed, skipped


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu-check", help="the folder of logs, CSV and PNG (default gpu-check)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, from {','.join(STAGES)} (default all)")
    p.add_argument("--bench-sizes", default=None, help="only these N of the bench's GPU grid (comma-separated)")
    p.add_argument("--bench-backends", default="auto,epilogue,triton", help="ours' backends in the bench (default auto,epilogue,triton)")
    p.add_argument("--shard", type=_shard, default=(1, 1), help="tests stage: shard K/N of the test files (default 1/1)")
    p.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    args = p.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        print(f"error: --stages: unknown stage(s) {', '.join(unknown)}; expected some of {', '.join(STAGES)}", file=sys.stderr)
        return 2
    import torch

    out = Path(args.out)
    runs = commands(out, stages, BUDGET, args.bench_sizes, args.bench_backends, args.shard)
    if args.dry_run or not torch.cuda.is_available():
        why = "--dry-run" if args.dry_run else "no CUDA device here"
        print(f"gpu-check ({why}): would run, with PYTHONPATH={ROOT / 'src'}, into {out}/:")
        for stage, cmd, extra in runs:
            env = " ".join(f"{k}={v}" for k, v in extra.items())
            print(f"  [{stage}, {BUDGET[stage]} s] {env + ' ' if env else ''}{' '.join(cmd)}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    import triton

    lines = [f"gpu-check on {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
             f"python {sys.version.split()[0]}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"]
    print(lines[0], flush=True)
    spent: dict[str, float] = {}
    for stage, cmd, extra in runs:
        left = BUDGET[stage] - spent.get(stage, 0.0)
        start = time.perf_counter()
        with open(out / f"{stage}.log", "a") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            try:
                rc = subprocess.run(cmd, env={**_env(), **extra}, stdout=log, stderr=subprocess.STDOUT, timeout=max(left, 5),
                                    cwd=ROOT).returncode
            except subprocess.TimeoutExpired:
                rc = "timed out"
        took = time.perf_counter() - start
        spent[stage] = spent.get(stage, 0.0) + took
        lines.append(f"[{stage}] {' '.join(cmd[1:4])} ...: exit {rc} in {took:.0f} s")
        print(lines[-1], flush=True)
    if "tests" in stages:
        counts, failed, skipped = _test_report(out / "junit.xml")
        (out / "skipped.txt").write_text("\n".join(skipped) + "\n")
        lines += [f"tests: {counts}", *[f"  FAILED {f}" for f in failed[:60]]]
    summary = "\n".join(lines) + "\n"
    (out / "summary.txt").write_text(summary)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
