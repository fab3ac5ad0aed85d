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
  stages replace the interpreter's; the list as the kernel's own pruning narrows it for the variant's dtypes),
  for sm_80 and sm_90, and reads registers, local memory (``STL``/``LDL``, the stack), shared memory and the
  matrix instructions (``HMMA``, ``HGMMA``). A row fails on a compile error, a spill, shared memory beyond the
  target's per-block limit, or a kernel with products (``tt.dot`` in its IR, helpers included) on half operands (or TF32) without ``HGMMA``
  on sm_90 -- unless the kernel's docstring states why (a line starting ``Compile check:``). Exit 1 when any row
  fails; ``--table`` writes the markdown table.

The interpreter gets fp32 stand-ins for half tensors (numpy has no bf16); the launchers tell each stand-in to
``_host.WIDENING_LISTENERS``, so ``record`` writes the half types a GPU's launch has.
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
RECORD_TESTS = ["tests/engine/test_triton.py", "tests/engine/test_epilogue.py", "tests/engine/test_normalize_rows.py",
                "tests/engine/test_gemm.py"]

_TORCH_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64", "int64": "i64",
                "int32": "i32", "bool": "i1", "int8": "i8", "uint8": "u8"}


#: id -> (a weak reference, the GPU's dtype) of each fp32 stand-in the interpreter gets for a half tensor
#: (``_host.WIDENING_LISTENERS``): such a launch is recorded with the half type a GPU's launch has.
_STAND_INS: dict[int, tuple[Any, str]] = {}


def _note_stand_in(wide: Any, dtype: Any) -> None:
    import weakref

    _STAND_INS[id(wide)] = (weakref.ref(wide), _TORCH_TYPES[str(dtype).removeprefix("torch.")])


def _type(value: Any) -> Any:
    """The compiler's type of a launch argument: ``*bf16`` for a tensor (the half type a GPU's launch has for the
    interpreter's fp32 stand-in of a half tensor), ``i32``/``i64``/``fp32``/``i1`` for a scalar, a list for a tuple,
    None for ``None`` (a constexpr None to the compiler)."""
    if hasattr(value, "dtype") and hasattr(value, "data_ptr"):
        ref, gpu = _STAND_INS.get(id(value), (None, None))
        if ref is not None and ref() is value:
            return "*" + gpu
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
    from torch_contrastive.engine.triton_backend import _host

    _host.WIDENING_LISTENERS.append(_note_stand_in)
    rc = pytest.main(["-q", "-p", "no:cacheprovider", *tests])
    variants = {k: [json.loads(r) for r in sorted(v)] for k, v in sorted(seen.items())}
    pathlib.Path(out).write_text(json.dumps(variants, indent=1) + "\n")
    print(f"{sum(map(len, variants.values()))} variants of {len(variants)} kernels -> {out}")
    return int(rc)


def _unwrap(kernel: Any) -> tuple[Any, Any]:
    """The ``JITFunction`` under a kernel's autotune / heuristics wrappers, and its autotuner (None: none)."""
    import triton

    tuner = None
    while isinstance(kernel, (triton.runtime.autotuner.Autotuner, triton.runtime.autotuner.Heuristics)):
        if isinstance(kernel, triton.runtime.autotuner.Autotuner):
            tuner = kernel
        kernel = kernel.fn
    return kernel, tuner  # a JITFunction (an InterpretedFunction under TRITON_INTERPRET=1)


class _Typed:
    """A stand-in launch argument for the autotuner's pruning: a tensor's dtype, nothing else."""

    def __init__(self, type_name: str) -> None:
        import torch

        names = {v: k for k, v in _TORCH_TYPES.items()}
        self.dtype = getattr(torch, names[type_name.removeprefix("*")])


#: The size bucket the configs are pruned at: every config's tile fits (a large call's list).
_LARGE_BUCKET = 1 << 16


def kernel_of(module: Any, name: str) -> tuple[Any, list[Any]]:
    """The ``JITFunction`` recorded as ``name`` in ``module`` and every autotuner of the module that launches it (one
    jitted body may have several, each timing its own list: ``pair_terms._pair_sums``)."""
    jit, tuner = _unwrap(getattr(module, name))
    tuners = [tuner] if tuner is not None else []
    for value in vars(module).values():
        if value is not getattr(module, name) and hasattr(value, "fn"):
            inner, other = _unwrap(value)
            if inner is jit and other is not None and other not in tuners:
                tuners.append(other)
    return jit, tuners


def configs_of(tuners: list[Any], variant: dict[str, list[Any]]) -> list[Any]:
    """The configs a launch of ``variant`` may time: each autotuner's list as the kernel's own pruning narrows it
    for the variant's dtypes at a large size (fp64 operands get the small tiles only), each config once; ``[None]``
    for a kernel launched without autotuning (its recorded constexprs)."""
    if not tuners:
        return [None]
    named = {name: _Typed(t) if kind == "arg" and isinstance(t, str) and t.startswith("*") else t
             for name, (kind, t) in variant.items()}
    named["bucket"] = _LARGE_BUCKET
    chosen: dict[str, Any] = {}
    for tuner in tuners:
        prune = getattr(tuner, "early_config_prune", None)
        for config in prune(list(tuner.configs), named) if prune else tuner.configs:
            chosen.setdefault(str(config), config)
    return list(chosen.values())


#: The specialisation a GPU's launch gives an argument (triton's ``tt.divisibility``): a pointer 16-byte aligned, an
#: integer a multiple of 16.
_DIVISIBLE = [["tt.divisibility", 16]]


def _source(jit: Any, variant: dict[str, list[Any]], blocks: dict[str, Any], aligned: bool = True) -> Any:
    """The ``ASTSource`` of one variant with ``blocks`` in place of the recorded block constexprs. ``aligned``: as a
    GPU launches a large call -- every pointer 16-byte aligned (torch's CUDA allocations are; the launchers pass
    contiguous rows) and every integer argument (sizes, D, offsets) a multiple of 16, which is what lets the compiler
    vectorise the loads and pipeline the K loops through shared memory (``num_stages``); without it the compiler
    proves nothing and pipelines nothing (``--unaligned``: a ragged call's code)."""
    import triton.language as tl
    from triton.compiler import ASTSource

    signature: dict[str, Any] = {}
    constants: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], Any] = {}
    for i, name in enumerate(jit.arg_names):
        kind, value = variant[name]
        value = blocks.get(name, value)
        if kind == "constexpr" or value is None:
            signature[name] = "constexpr"
            constants[(i,)] = tl.dtype(value) if value in ("fp32", "fp64", "bf16", "fp16") else value
        elif isinstance(value, list):
            signature[name] = tuple(t or "constexpr" for t in value)
            constants.update({(i, j): None for j, t in enumerate(value) if t is None})
            attrs.update({(i, j): _DIVISIBLE for j, t in enumerate(value) if aligned and _divisible(t)})
        else:
            signature[name] = value
            if aligned and _divisible(value):
                attrs[(i,)] = _DIVISIBLE
    return ASTSource(jit, signature, constants, attrs)


def _divisible(type_name: Any) -> bool:
    """Whether a GPU's launch of a large call specialises an argument of this type as divisible by 16."""
    return isinstance(type_name, str) and (type_name.startswith("*") or type_name in ("i32", "i64"))


def _stated(jit: Any) -> str:
    """The kernel docstring's ``Compile check:`` line (why a rule does not apply), or ''."""
    for line in (jit.fn.__doc__ or "").splitlines():
        if line.strip().startswith("Compile check:"):
            return line.strip()
    return ""


def tensor_core_operands(variant: dict[str, list[Any]]) -> bool:
    """Whether a variant's products may run on tensor cores: half operands, or fp32 ones with TF32 allowed
    (``PRECISION="tf32"``). fp32 products in IEEE precision and fp64 ones are FMA loops on every GPU (the torch
    backend's fp32 matmuls are IEEE too unless ``allow_tf32``), so no HGMMA is asked of them."""
    return operand_class(variant) in ("bf16", "fp16") or variant.get("PRECISION", [None, None])[1] == "tf32"


def compile_one(jit: Any, variant: dict[str, list[Any]], config: Any, arch: int, aligned: bool = True) -> dict[str, Any]:
    """Compile one variant with one config for ``sm_{arch}`` (``aligned``: :func:`_source`); its resources and the
    rules it breaks."""
    import triton
    from triton.backends.compiler import GPUTarget

    tools = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    blocks = dict(config.kwargs) if config is not None else {}
    options = {"num_warps": config.num_warps if config else 4, "num_stages": config.num_stages if config else 3}
    row: dict[str, Any] = {"kernel": jit.fn.__name__, "arch": arch, "blocks": blocks, "triton": triton.__version__,
                           "aligned": aligned, **options}
    start = time.perf_counter()
    try:
        compiled = triton.compile(_source(jit, variant, blocks, aligned), target=GPUTarget("cuda", arch, 32),
                                  options=options)
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
    if arch >= 90 and "tt.dot" in compiled.asm["ttir"] and tensor_core_operands(variant) and not row["hgmma"]:
        failures.append("no HGMMA")
    stated = _stated(jit)
    row["failures"] = [] if stated else failures
    row["stated"] = stated if failures else ""
    return row


def operand_class(variant: dict[str, list[Any]]) -> str:
    """A variant's operand dtype class: ``bf16`` / ``fp16`` when it has half tensors, else ``fp64`` or ``fp32``."""
    types = {t for kind, t in variant.values() if kind == "arg" and isinstance(t, str)}
    return next((c for c in ("bf16", "fp16", "fp64") if "*" + c in types), "fp32")


def sampled(recorded: list[dict[str, list[Any]]]) -> list[dict[str, list[Any]]]:
    """The first recorded variant of each operand class (what the suite compiles: each kernel's code for each
    dtype, every config; the full list differs in the exclusion, relation and factor constexprs)."""
    first: dict[str, dict[str, list[Any]]] = {}
    for variant in recorded:
        first.setdefault(operand_class(variant), variant)
    return list(first.values())


def check(path: str, archs: list[int], only: str | None = None, sample: bool = False,
          shard: tuple[int, int] = (0, 1), classes: tuple[str, ...] = (),
          wide_archs: list[int] | None = None, aligned: bool = True) -> list[dict[str, Any]]:
    """Compile the recorded variants of ``path`` (``sample``: one per kernel and operand class; ``shard`` ``(k, n)``:
    the kernels whose place in the file is ``k`` modulo ``n``; ``classes``: only these operand classes, all when
    empty) with every config for every target of ``archs`` (fp32 / fp64 variants: of ``wide_archs`` when given),
    specialised as a GPU launches a large call unless ``aligned`` is False (:func:`_source`); the rows."""
    variants = json.loads(pathlib.Path(path).read_text())
    rows = []
    for place, (key, recorded) in enumerate(variants.items()):
        module, name = key.split(":")
        if (only and only not in name) or place % shard[1] != shard[0]:
            continue
        jit, tuners = kernel_of(importlib.import_module(module), name)
        for variant in sampled(recorded) if sample else recorded:
            operands = operand_class(variant)
            if classes and operands not in classes:
                continue
            dtypes = "/".join(sorted({t for kind, t in variant.values()
                                      if kind == "arg" and isinstance(t, str) and t[:2] in ("*f", "*b")}))
            for config in configs_of(tuners, variant):
                for arch in archs if operands in ("bf16", "fp16") else wide_archs or archs:
                    rows.append({**compile_one(jit, variant, config, arch, aligned), "dtypes": dtypes, "operands": operands})
    return rows


def _blocks(blocks: dict[str, Any]) -> str:
    return ",".join(f"{k.removeprefix('BLOCK_') if k != 'BLOCK' else 'B'}{v}" for k, v in blocks.items())


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the rows: one line per Triton version, kernel, operand class, config and target."""
    versions = ", ".join(sorted({r.get("triton", "") for r in rows}))
    lines = ["# Compile table", "", f"Written by `make compile-check` (`tools/compile_check.py table`): every row compiled "
             f"for its target by the real Triton compiler ({versions}) on a machine without a GPU; docs/gpu.md, "
             "\"Compile check\", says what the rules are.", "",
             "| triton | kernel | operands | blocks | warps/stages | sm | registers | shared KiB | spills (stack B) "
             "| HMMA/HGMMA | result |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    seen = set()
    for r in sorted(rows, key=lambda r: (r.get("triton", ""), r["kernel"], r.get("operands", ""), _blocks(r["blocks"]),
                                          r["num_warps"], r["num_stages"], r["arch"])):
        head = (f"| {r.get('triton', '')} | `{r['kernel']}` | {r.get('operands', '')} | {_blocks(r['blocks'])} "
                f"| {r['num_warps']}/{r['num_stages']} | {r['arch']} ")
        result = ", ".join(r["failures"]) or ("ok (" + r["stated"] + ")" if r.get("stated") else "ok")
        if "error" in r:
            line = head + f"| | | | | compile: {r['error']} |"
        else:
            line = head + (f"| {r['registers']} | {r['shared'] / 1024:.0f} | {r['spills']} ({r['stack']}) "
                           f"| {r['hmma']}/{r['hgmma']} | {result} |")
        if line not in seen:  # variants differing only in constexprs the row does not show
            seen.add(line)
            lines.append(line)
    return "\n".join(lines) + "\n"


def summary(rows: list[dict[str, Any]]) -> str:
    """One line per kernel and operand class, one column per Triton version and target: the most registers and
    shared memory over the configs, the fewest matrix instructions (HMMA / HGMMA: every config's products on
    tensor cores when above 0), and how many configs fail a rule."""
    columns = sorted({(r.get("triton", ""), r["arch"]) for r in rows})
    groups: dict[tuple[str, str], dict[tuple[str, int], list[dict[str, Any]]]] = {}
    for r in rows:
        groups.setdefault((r["kernel"], r.get("operands", "")), {}).setdefault((r.get("triton", ""), r["arch"]), []).append(r)
    lines = ["| kernel | operands | configs | " + " | ".join(f"triton {v}, sm_{a}" for v, a in columns) + " |",
             "|---|---|---|" + "---|" * len(columns)]
    for (kernel, operands), by_column in sorted(groups.items()):
        configs = {(_blocks(r["blocks"]), r["num_warps"], r["num_stages"]) for group in by_column.values() for r in group}
        cells = []
        for column in columns:
            group = by_column.get(column, [])
            built = [r for r in group if "error" not in r]
            if not group:
                cells.append("")
                continue
            failing = len({(_blocks(r["blocks"]), r["num_warps"], r["num_stages"]) for r in group if r["failures"]})
            cell = (f"{max((r['registers'] for r in built), default=0)} reg, "
                    f"{max((r['shared'] for r in built), default=0) / 1024:.0f} KiB, "
                    f"{min((r['hmma'] for r in built), default=0)}/{min((r['hgmma'] for r in built), default=0)}")
            cells.append(cell + (f", **{failing} failing**" if failing else ""))
        lines.append(f"| `{kernel}` | {operands} | {len(configs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: The markers of the block :func:`replace_block` rewrites (docs/gpu.md, "Compile check").
MARKERS = ("<!-- compile-table: written by tools/compile_check.py table -->", "<!-- /compile-table -->")


def replace_block(path: pathlib.Path, block: str) -> None:
    """Put ``block`` between the :data:`MARKERS` of the markdown file ``path`` (which must hold them once)."""
    text = path.read_text()
    start, end = text.find(MARKERS[0]), text.find(MARKERS[1])
    if start < 0 or end < start:
        raise SystemExit(f"compile_check: {path} has no {MARKERS[0]!r} ... {MARKERS[1]!r} block")
    path.write_text(text[: start + len(MARKERS[0])] + "\n" + block + text[end:])


def _check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Any, ...]:
    """``check``'s targets, shard, operand classes and wide targets, or a usage error (exit 2) naming the option."""
    try:
        archs = [int(a) for a in args.targets.split(",")]
    except ValueError:
        parser.error(f"--targets: expected compute capabilities like 80,90, got {args.targets!r}")
    unknown = [a for a in archs if a not in SHARED_LIMIT]
    if unknown:
        parser.error(f"--targets: expected some of {sorted(SHARED_LIMIT)}, got {unknown}")
    try:
        k, n = (int(part) for part in args.shard.split("/"))
        if not 0 <= k < n:
            raise ValueError
    except ValueError:
        parser.error(f"--shard: expected K/N with 0 <= K < N, got {args.shard!r}")
    classes = tuple(c for c in args.classes.split(",") if c)
    if set(classes) - {"bf16", "fp16", "fp32", "fp64"}:
        parser.error(f"--classes: expected some of bf16,fp16,fp32,fp64, got {args.classes!r}")
    try:
        wide = None if args.wide_targets is None else [int(a) for a in args.wide_targets.split(",")]
    except ValueError:
        parser.error(f"--wide-targets: expected compute capabilities like 90, got {args.wide_targets!r}")
    if wide is not None and set(wide) - set(SHARED_LIMIT):
        parser.error(f"--wide-targets: expected some of {sorted(SHARED_LIMIT)}, got {wide}")
    return archs, (k, n), classes, wide


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
    chk.add_argument("--sample", action="store_true", help="one variant per kernel and operand dtype class")
    chk.add_argument("--shard", default="0/1", help="K/N: the kernels at places K modulo N (parallel runs)")
    chk.add_argument("--classes", default="", help="only these operand classes, comma-separated (bf16,fp16,fp32,fp64)")
    chk.add_argument("--wide-targets", default=None, help="the targets of fp32 / fp64 variants (default: --targets)")
    chk.add_argument("--unaligned", action="store_true",
                     help="no pointer alignment or size divisibility given to the compiler (a ragged call's code)")
    tab = sub.add_parser("table", help="write the tables of one or more --json outputs (several Triton versions)")
    tab.add_argument("rows", nargs="+")
    tab.add_argument("--out", required=True, help="the full table (markdown)")
    tab.add_argument("--summary", default=None,
                     help="a markdown file whose block between the compile-table markers gets the summary table")
    args = parser.parse_args(argv)
    if args.command == "record":
        return record(args.out, args.tests)
    if args.command == "table":
        merged = [r for path in args.rows for r in json.loads(pathlib.Path(path).read_text())]
        pathlib.Path(args.out).write_text(table(merged))
        if args.summary:
            replace_block(pathlib.Path(args.summary), summary(merged))
        return 1 if any(r["failures"] for r in merged) else 0
    os.environ.pop("TRITON_INTERPRET", None)
    archs, (k, n), classes, wide = _check_options(parser, args)
    rows = check(args.variants, archs, args.only, args.sample, (k, n), classes, wide, not args.unaligned)
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
