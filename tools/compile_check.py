"""Every Triton kernel the launchers start, compiled by the real Triton compiler for the GPUs users have -- no GPU.

    python tools/compile_check.py record tools/triton_variants.json      # the variants the interpreter tests launch
    python tools/compile_check.py check tools/triton_variants.json --table docs/compile_table.md

The interpreter (``TRITON_INTERPRET=1``) checks what a kernel computes; only the compiler says whether it builds
for a GPU, how many registers it takes, whether it spills, how much shared memory it needs and whether its
products run on tensor cores. ``triton.compile`` of an ``ASTSource`` for a ``GPUTarget`` builds the cubin on a CPU,
and the ``cuobjdump`` inside triton's package reads it.

* ``record`` runs the interpreter tests of the kernels in this process with the interpreter's launch patched to
  note each top-level kernel's argument types (pointer dtypes, scalar widths, tuples, ``None``) and constexpr
  values, and writes the distinct variants: exactly what the launchers produce on the inputs the suite gives them.
* ``check`` compiles each variant with every config of its kernel's autotune list (the block constexprs, warps and
  stages replace the interpreter's), for sm_80 and sm_90, and reads registers, local memory (``STL``/``LDL``,
  the stack), shared memory and the matrix instructions (``HMMA``, ``HGMMA``). A row fails on a compile error,
  a spill, shared memory beyond the target's per-block limit, or a kernel with ``tl.dot`` that compiles without
  ``HGMMA`` on sm_90 -- unless the kernel's docstring states why (a line starting ``Compile check:``). Exit 1 when
  any row fails; ``--table`` writes the markdown table.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

#: The per-block shared memory a kernel may use (opt-in maximum), by compute capability.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}

#: The interpreter tests that launch the kernels (what ``record`` runs).
RECORD_TESTS = ["tests/engine/test_triton.py", "tests/engine/test_epilogue.py", "tests/engine/test_normalize_rows.py"]

_TORCH_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64", "int64": "i64",
                "int32": "i32", "bool": "i1", "int8": "i8", "uint8": "u8"}


def _type(value: Any) -> Any:
    """The compiler's type of a launch argument: ``*bf16`` for a tensor, ``i32``/``i64``/``fp32``/``i1`` for a
    scalar, a list for a tuple, None for ``None`` (a constexpr None to the compiler)."""
    if hasattr(value, "dtype") and hasattr(value, "data_ptr"):
        return "*" + _TORCH_TYPES[str(value.dtype).removeprefix("torch.")]
    if value is None:
        return None
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    if isinstance(value, tuple):
        return [_type(v) for v in value]
    raise TypeError(f"compile_check: a launch argument of type {type(value).__name__} has no compiler type")


def _constant(value: Any) -> Any:
    return value if isinstance(value, (int, float, bool, str, type(None))) else str(value)


def record(out: str, tests: list[str]) -> int:
    """Run ``tests`` under the interpreter, noting every kernel launch's variant; write them to ``out``."""
    os.environ["TRITON_INTERPRET"] = "1"
    import pytest
    import triton.language as tl
    from triton.runtime import interpreter

    seen: dict[str, set[str]] = {}
    launch = interpreter.InterpretedFunction.run

    def noting(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        sig = inspect.signature(self.fn)
        bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
        bound.apply_defaults()
        params = {}
        for name, p in sig.parameters.items():
            value = bound.arguments.get(name)
            if p.annotation is tl.constexpr or str(p.annotation).endswith("constexpr"):
                params[name] = ["constexpr", _constant(value)]
            else:
                params[name] = ["arg", _type(value)]
        if self.fn.__module__.startswith("torch_contrastive."):  # a test's own toy kernels are not launched by us
            seen.setdefault(f"{self.fn.__module__}:{self.fn.__name__}", set()).add(json.dumps(params, sort_keys=True))
        return launch(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = noting
    rc = pytest.main(["-q", "-p", "no:cacheprovider", *tests])
    variants = {k: [json.loads(r) for r in sorted(v)] for k, v in sorted(seen.items())}
    pathlib.Path(out).write_text(json.dumps(variants, indent=1) + "\n")
    print(f"{sum(map(len, variants.values()))} variants of {len(variants)} kernels -> {out}")
    return int(rc)


def _unwrap(kernel: Any) -> tuple[Any, list[Any] | None]:
    """The ``JITFunction`` under a kernel's autotune / heuristics wrappers, and its autotune configs."""
    import triton

    configs = None
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        if isinstance(kernel, triton.runtime.autotuner.Autotuner):
            configs = list(kernel.configs)
        kernel = kernel.fn
    return kernel, configs


def _source(jit: Any, variant: dict[str, list[Any]], blocks: dict[str, Any]) -> Any:
    """The ``ASTSource`` of one variant with ``blocks`` in place of the recorded block constexprs."""
    import triton.language as tl
    from triton.compiler import ASTSource

    signature: dict[str, Any] = {}
    constants: dict[tuple[int, ...], Any] = {}
    for i, name in enumerate(jit.arg_names):
        kind, value = variant[name]
        value = blocks.get(name, value)
        if kind == "constexpr" or value is None:
            signature[name] = "constexpr"
            constants[(i,)] = tl.dtype(value) if value in ("fp32", "fp64", "bf16", "fp16") else value
        elif isinstance(value, list):
            signature[name] = tuple(t or "constexpr" for t in value)
            constants.update({(i, j): None for j, t in enumerate(value) if t is None})
        else:
            signature[name] = value
    return ASTSource(jit, signature, constants)


def _stated(jit: Any) -> str:
    """The kernel docstring's ``Compile check:`` line (why a rule does not apply), or ''."""
    for line in (jit.fn.__doc__ or "").splitlines():
        if line.strip().startswith("Compile check:"):
            return line.strip()
    return ""


def compile_one(jit: Any, variant: dict[str, list[Any]], config: Any, arch: int) -> dict[str, Any]:
    """Compile one variant with one config for ``sm_{arch}``; its resources and the rules it breaks."""
    import triton
    from triton.backends.compiler import GPUTarget

    tools = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    blocks = dict(config.kwargs) if config is not None else {}
    options = {"num_warps": config.num_warps if config else 4, "num_stages": config.num_stages if config else 3}
    row: dict[str, Any] = {"kernel": jit.fn.__name__, "arch": arch, "blocks": blocks, **options}
    start = time.perf_counter()
    try:
        compiled = triton.compile(_source(jit, variant, blocks), target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as error:  # the compiler's own error, whatever its class: this row's finding
        row.update(error=(str(error).strip().splitlines() or [repr(error)])[-1][:160], failures=["compile"])
        return row
    with tempfile.TemporaryDirectory() as tmp:
        cubin = pathlib.Path(tmp, "k.cubin")
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))  # type: ignore[union-attr]
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))  # type: ignore[union-attr]
    spills = len(re.findall(r"\b(?:STL|LDL)\b", sass))
    row.update(registers=registers, stack=stack, spills=spills, shared=int(compiled.metadata.shared),
               hgmma=len(re.findall(r"\bHGMMA\b", sass)), hmma=len(re.findall(r"\bHMMA\b", sass)),
               secs=round(time.perf_counter() - start, 2))
    failures = []
    if spills or stack:
        failures.append("spill")
    if row["shared"] > SHARED_LIMIT[arch]:
        failures.append("shared")
    if arch >= 90 and "tl.dot(" in inspect.getsource(jit.fn) and not row["hgmma"]:
        failures.append("no HGMMA")
    stated = _stated(jit)
    row["failures"] = [] if stated else failures
    row["stated"] = stated if failures else ""
    return row


def check(path: str, archs: list[int], only: str | None = None) -> list[dict[str, Any]]:
    """Compile every recorded variant of ``path`` with every config for every target; the rows."""
    variants = json.loads(pathlib.Path(path).read_text())
    rows = []
    for key, recorded in variants.items():
        module, name = key.split(":")
        if only and only not in name:
            continue
        jit, configs = _unwrap(getattr(importlib.import_module(module), name))
        for variant in recorded:
            for config in configs or [None]:
                for arch in archs:
                    row = compile_one(jit, variant, config, arch)
                    row["dtypes"] = "/".join(sorted({t for kind, t in variant.values()
                                                     if kind == "arg" and isinstance(t, str) and t[:2] in ("*f", "*b")}))
                    rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the rows (one per kernel, dtypes, blocks, warps, stages and target)."""
    import triton

    lines = [f"Triton {triton.__version__}; `python tools/compile_check.py check`.", "",
             "| kernel | dtypes | blocks | warps/stages | sm | registers | shared KiB | spills (stack B) | HMMA/HGMMA | result |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    seen = set()
    for r in rows:
        blocks = ",".join(f"{k.removeprefix('BLOCK_') if k != 'BLOCK' else 'B'}{v}" for k, v in r["blocks"].items())
        key = (r["kernel"], r["dtypes"], blocks, r["num_warps"], r["num_stages"], r["arch"], r.get("registers"),
               r.get("shared"), r.get("spills"), tuple(r["failures"]))
        if key in seen:
            continue
        seen.add(key)
        result = ", ".join(r["failures"]) or ("ok (" + r["stated"] + ")" if r.get("stated") else "ok")
        if "error" in r:
            lines.append(f"| `{r['kernel']}` | {r['dtypes']} | {blocks} | {r['num_warps']}/{r['num_stages']} | {r['arch']} "
                         f"| | | | | compile: {r['error']} |")
            continue
        lines.append(f"| `{r['kernel']}` | {r['dtypes']} | {blocks} | {r['num_warps']}/{r['num_stages']} | {r['arch']} "
                     f"| {r['registers']} | {r['shared'] / 1024:.0f} | {r['spills']} ({r['stack']}) "
                     f"| {r['hmma']}/{r['hgmma']} | {result} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compile_check", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record the variants the interpreter tests launch")
    rec.add_argument("out")
    rec.add_argument("tests", nargs="*", default=RECORD_TESTS)
    chk = sub.add_parser("check", help="compile the recorded variants for sm_80 and sm_90")
    chk.add_argument("variants")
    chk.add_argument("--targets", default="80,90", help="compute capabilities, comma-separated")
    chk.add_argument("--only", default=None, help="only kernels whose name contains this")
    chk.add_argument("--table", default=None, help="write the markdown table here")
    chk.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    if args.command == "record":
        return record(args.out, args.tests)
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        archs = [int(a) for a in args.targets.split(",")]
    except ValueError:
        parser.error(f"--targets: expected compute capabilities like 80,90, got {args.targets!r}")
    unknown = [a for a in archs if a not in SHARED_LIMIT]
    if unknown:
        parser.error(f"--targets: expected some of {sorted(SHARED_LIMIT)}, got {unknown}")
    rows = check(args.variants, archs, args.only)
    if args.table:
        pathlib.Path(args.table).write_text(table(rows))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    failed = [r for r in rows if r["failures"]]
    print(f"{len(rows)} compiles, {len(failed)} failing: "
          + ", ".join(sorted({f"{r['kernel']} sm_{r['arch']} ({'/'.join(r['failures'])})" for r in failed})))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
