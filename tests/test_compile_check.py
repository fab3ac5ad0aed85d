"""tools/compile_check.py: the real Triton compiler, no GPU, finds what the interpreter cannot -- a kernel that does
not compile, a tile beyond shared memory -- and reads a clean tensor-core tile as one (HGMMA on sm_90, HMMA on
sm_80, no spills). Also the recorded variants file names only kernels the library has."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT

pytest.importorskip("triton")

TOOL = ROOT / "tools" / "compile_check.py"


def _variant(blocks: dict[str, int], dtype: str = "*bf16", with_d: bool = True) -> dict[str, list]:
    v = {"x_ptr": ["arg", dtype], "out_ptr": ["arg", "*fp32"]}
    if with_d:
        v.update(y_ptr=["arg", dtype], d=["arg", "i32"])
    v.update({k: ["constexpr", b] for k, b in blocks.items()})
    return v


def _check(tmp_path, variants: dict, *args: str) -> tuple[int, list[dict], str]:
    path = tmp_path / "variants.json"
    path.write_text(json.dumps(variants))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(TOOL), "check", str(path), "--json", str(out), "--table",
                           str(tmp_path / "table.md"), *args], capture_output=True, text=True, env=env, timeout=600)
    return done.returncode, json.loads(out.read_text()) if out.exists() else [], done.stdout + done.stderr


def test_a_tensor_core_tile_passes_and_broken_kernels_fail(tmp_path):
    variants = {
        "compile_toys:_dot_kernel": [_variant({"BLOCK": 64, "BLOCK_D": 64}), _variant({"BLOCK": 256, "BLOCK_D": 512})],
        "compile_toys:_unsupported_kernel": [_variant({"BLOCK": 4}, "*fp32", with_d=False)],
    }
    rc, rows, log = _check(tmp_path, variants)
    assert rc == 1, log
    by = {(r["kernel"] if r["kernel"] != "_dot_kernel" or r["failures"] == [] else "_huge", r["arch"]): r
          for r in rows}
    for arch, instruction in ((90, "hgmma"), (80, "hmma")):
        clean = by[("_dot_kernel", arch)]
        assert clean["failures"] == [] and clean[instruction] > 0 and clean["spills"] == 0, clean
        assert 0 < clean["shared"] <= 227 * 1024 and 0 < clean["registers"] <= 255
        assert by[("_unsupported_kernel", arch)]["failures"] == ["compile"]
        assert "shared" in by[("_huge", arch)]["failures"]
    assert "_unsupported_kernel sm_90 (compile)" in log
    table = (tmp_path / "table.md").read_text().splitlines()
    assert any("| `_dot_kernel` | bf16 |" in line and "| 90 |" in line and line.endswith("| ok |")
               for line in table), table


def test_a_clean_set_exits_zero_and_bad_targets_exit_two(tmp_path):
    rc, rows, log = _check(tmp_path, {"compile_toys:_dot_kernel": [_variant({"BLOCK": 64, "BLOCK_D": 64})]},
                           "--targets", "90")
    assert rc == 0 and len(rows) == 1 and rows[0]["hgmma"] > 0, log
    rc, _, log = _check(tmp_path, {}, "--targets", "75")
    assert rc == 2 and "--targets" in log


def test_the_check_compiles_a_large_calls_specialisation_whose_k_loop_is_pipelined(tmp_path):
    """By default the pointers are 16-byte aligned and the sizes multiples of 16, as a GPU launches a large call: the
    K loop's operands are staged through shared memory in its three stages (3 x 64 x 64 x 2 bf16 operands = 48 KiB);
    ``--unaligned`` proves nothing to the compiler, which pipelines nothing (one stage's 16 KiB or less)."""
    variants = {"compile_toys:_dot_kernel": [_variant({"BLOCK": 64, "BLOCK_D": 64})]}
    rc, (aligned,), log = _check(tmp_path, variants, "--targets", "90")
    assert rc == 0 and aligned["aligned"] and aligned["shared"] >= 3 * 64 * 64 * 2 * 2, (aligned, log)
    rc, (unaligned,), log = _check(tmp_path, variants, "--targets", "90", "--unaligned")
    assert rc == 0 and not unaligned["aligned"] and unaligned["shared"] <= 64 * 64 * 2 * 2, (unaligned, log)


def test_the_recorded_variants_name_the_library_s_kernels():
    """Every key of tools/triton_variants.json is a kernel the library defines, with every argument recorded."""
    variants = json.loads((ROOT / "tools" / "triton_variants.json").read_text())
    assert len(variants) >= 15
    for key, recorded in variants.items():
        module, name = key.split(":")
        kernel = getattr(importlib.import_module(module), name)
        while not hasattr(kernel, "arg_names"):
            kernel = kernel.fn
        assert recorded and all(set(v) == set(kernel.arg_names) for v in recorded), key


def _launched_kernels() -> dict[str, str]:
    """Every kernel a launcher of the Triton backend starts -- each autotuned kernel object of its modules -- as
    ``module:jit name`` -> the object's own name."""
    import pkgutil

    import triton

    from torch_contrastive.engine import triton_backend

    found = {}
    for info in pkgutil.iter_modules(triton_backend.__path__):
        module = importlib.import_module(f"{triton_backend.__name__}.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.autotuner.Autotuner):
                inner = value
                while isinstance(inner, (triton.runtime.autotuner.Autotuner, triton.runtime.autotuner.Heuristics)):
                    inner = inner.fn
                found[f"{module.__name__}:{inner.fn.__name__}"] = name
    return found


def test_every_launched_kernel_is_recorded():
    """tools/triton_variants.json holds a variant of every kernel the launchers start (a new kernel is checked by
    being launched in an interpreter test and recorded), in half operands where a launcher passes them."""
    variants = json.loads((ROOT / "tools" / "triton_variants.json").read_text())
    launched = _launched_kernels()
    assert len(launched) >= 15
    missing = sorted(set(launched) - set(variants))
    assert not missing, f"re-record (python tools/compile_check.py record tools/triton_variants.json): {missing}"
    halves = {key for key, recorded in variants.items()
              if any(t in ("*bf16", "*fp16") for v in recorded for kind, t in v.values() if kind == "arg")}
    assert {"torch_contrastive.engine.triton_backend.row_lse:_row_lse_kernel",
            "torch_contrastive.engine.triton_backend.tile_grad:_tile_grad_kernel",
            "torch_contrastive.engine.triton_backend.epilogue_grad:_epilogue_grad_kernel"} <= halves


def test_every_launched_kernel_compiles_clean_for_sm80_and_sm90(tmp_path):
    """The library's kernels through the real compiler: each recorded kernel in its half operand classes (bf16, fp16)
    for sm_80 and sm_90 and in fp32 for sm_90 (``--sample``), every config its pruning offers that dtype -- no compile
    error, no spill, shared memory within the limit, HGMMA on sm_90 wherever the products take half operands. (fp64
    and fp32 on sm_80 are in ``make compile-check``: the suite's budget holds about half of the sample's compiles.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    # two shards at once: the suite's longest test, so it does not leave one core idle at the end
    shards = [subprocess.Popen([sys.executable, str(TOOL), "check", str(ROOT / "tools" / "triton_variants.json"),
                                "--sample", "--classes", "bf16,fp16,fp32", "--wide-targets", "90", "--shard", f"{k}/2",
                                "--json", str(tmp_path / f"rows{k}.json")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for k in range(2)]
    logs = [shard.communicate(timeout=1500)[0] for shard in shards]
    rows = [r for k in range(2) for r in json.loads((tmp_path / f"rows{k}.json").read_text())]
    failing = sorted({(r["kernel"], r["operands"], r["arch"], str(r["blocks"]), r["num_warps"], tuple(r["failures"]))
                      for r in rows if r["failures"]})
    assert all(shard.returncode == 0 for shard in shards) and not failing, (failing, [log[-1000:] for log in logs])
    variants = json.loads((ROOT / "tools" / "triton_variants.json").read_text())
    assert {r["kernel"] for r in rows} == {key.split(":")[1] for key in variants}
    assert {(r["operands"], r["arch"]) for r in rows} == {("bf16", 80), ("bf16", 90), ("fp16", 80), ("fp16", 90),
                                                         ("fp32", 90)}
    dots = [r for r in rows if r["operands"] in ("bf16", "fp16") and r["arch"] == 90 and r["kernel"] in DOT_KERNELS]
    assert dots and all(r["hgmma"] > 0 for r in dots)


#: The kernels whose products are ``tl.dot`` loops (the rest are element-wise epilogues and row passes).
DOT_KERNELS = {"_tile_sums_kernel", "_tile_grad_kernel", "_row_lse_kernel", "_grad_rows_kernel", "_pair_sums",
               "_pair_grad_kernel", "_pair_grad_owned", "_sigmoid_sums", "_sigmoid_grad_kernel", "_sigmoid_grad_owned"}


def test_a_narrow_half_tile_compiles_without_hgmma_and_fails_on_sm90(tmp_path):
    """A 32-row bf16 tile's product is mma.sync (HMMA) on every target: clean on sm_80, "no HGMMA" on sm_90 -- the
    rule reads the products in the IR, not the kernel's words."""
    rc, rows, log = _check(tmp_path, {"compile_toys:_dot_kernel": [_variant({"BLOCK": 32, "BLOCK_D": 32})]})
    by = {r["arch"]: r for r in rows}
    assert rc == 1 and by[80]["failures"] == [] and by[80]["hmma"] > 0, log
    assert by[90]["failures"] == ["no HGMMA"] and by[90]["hgmma"] == 0


def test_the_recorder_writes_the_half_types_a_gpu_launch_has(tmp_path):
    """Under the interpreter a bf16 call's rows reach the kernel as fp32 stand-ins; the recorder writes ``*bf16`` for
    them (the type a GPU's launch has) and ``*fp32`` for an fp32 call."""
    out = tmp_path / "variants.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    test = str(ROOT / "tests" / "engine" / "test_normalize_rows.py") + "::test_normalize_rows_is_the_formula"
    done = subprocess.run([sys.executable, str(TOOL), "record", str(out), test], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    recorded = json.loads(out.read_text())["torch_contrastive.engine.triton_backend.normalize_rows:_normalize_rows_kernel"]
    assert {v["x_ptr"][1] for v in recorded} == {"*bf16", "*fp32"}
    assert {v["y_ptr"][1] for v in recorded} == {"*fp32"}  # the unit rows are fp32 on a GPU too


def test_the_configs_checked_are_those_the_kernels_autotuners_offer_each_dtype():
    """A jitted body launched by two autotuners is checked with both lists; each dtype with what pruning keeps (in a
    process without the interpreter, whose kernels are defined with the GPU's lists)."""
    code = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch, compile_check
from torch_contrastive.engine.triton_backend import _configs, pair_terms
jit, tuners = compile_check.kernel_of(pair_terms, "_pair_sums")
out = {"name": jit.fn.__name__, "tuners": len(tuners)}
for dtype, torch_dtype in (("*bf16", torch.bfloat16), ("*fp32", torch.float32), ("*fp64", torch.float64)):
    got = compile_check.configs_of(tuners, {"x_ptr": ["arg", dtype], "bucket": ["arg", "i32"]})
    want = [c for c in _configs.square_sums() if torch_dtype in c.dtypes]
    out[dtype] = [[str(c) for c in got], [str(c) for c in want]]
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code, str(ROOT / "tools")], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["name"] == "_pair_sums" and out["tuners"] == 2
    for dtype in ("*bf16", "*fp32", "*fp64"):
        got, want = out[dtype]
        assert got == want and got, dtype
