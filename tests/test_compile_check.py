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
    assert any(line.startswith("| `_dot_kernel` | *bf16/*fp32 |") and "| 90 |" in line and line.endswith("| ok |")
               for line in table), table


def test_a_clean_set_exits_zero_and_bad_targets_exit_two(tmp_path):
    rc, rows, log = _check(tmp_path, {"compile_toys:_dot_kernel": [_variant({"BLOCK": 64, "BLOCK_D": 64})]},
                           "--targets", "90")
    assert rc == 0 and len(rows) == 1 and rows[0]["hgmma"] > 0, log
    rc, _, log = _check(tmp_path, {}, "--targets", "75")
    assert rc == 2 and "--targets" in log


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
