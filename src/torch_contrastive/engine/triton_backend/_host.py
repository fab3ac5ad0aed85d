"""Host-side helpers every kernel launcher shares: the device check and operands as the kernels
read them (:func:`launch_operands`), the constexprs derived from the arguments (:data:`DERIVED`,
through ``triton.heuristics``), and the exclusion rule's keyword arguments (:func:`exclusion`).

Optional inputs are passed as None -- no stand-in pointers -- and the kernels test them with
``is not None``, which Triton folds at compile time (a None argument is a constexpr)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from ...positives import KeyPositives, PartnerPositives

try:  # optional dependency
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised when triton is missing
    triton = None
    tl = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(x: Tensor) -> None:
    """Triton needs CUDA tensors, or the interpreter on CPU."""
    if triton is None:
        raise ValueError("backend='triton' needs triton: pip install 'torch-contrastive[gpu]'")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"backend='triton' runs on CUDA tensors (got {x.device}); on CPU set TRITON_INTERPRET=1 (slow, for tests)")


def fused() -> bool:
    """Whether the atomic (fused) kernels may run: not under ``torch.use_deterministic_algorithms``."""
    return not torch.are_deterministic_algorithms_enabled()


def gradient_factors(factors: Any, x: Tensor) -> int:
    """The gradient kernels' ``FACTORS`` switch: 0 for compute-dtype rows (no factors), 1 for the
    caller's half rows with fp32 factors, 2 for fp16 rows -- whose gradient tiles are also divided
    by each output row's largest magnitude before they are rounded to fp16 and multiplied back in
    fp32 after the product (fp16's smallest normal is 6e-5: a 1/N-weighted softmax gradient at
    N = 65,536 would lose most of its entries), as the torch backend scales its fp16 tiles."""
    if factors is None:
        return 0
    return 2 if x.dtype == torch.float16 else 1


#: Callbacks told ``(stand_in, dtype)`` for each fp32 tensor the interpreter gets in place of one of half ``dtype``
#: that a GPU would get (an operand widened, an output written wide and rounded by torch after): the compile
#: check's recorder notes a launch's GPU types through them. Empty unless a recorder listens.
WIDENING_LISTENERS: list[Callable[[Tensor, torch.dtype], None]] = []


def stand_in(wide: Tensor, dtype: torch.dtype) -> Tensor:
    """``wide``, an fp32 stand-in for a tensor of ``dtype`` on a GPU, told to :data:`WIDENING_LISTENERS`."""
    for listener in WIDENING_LISTENERS:
        listener(wide, dtype)
    return wide


def operand(x: Tensor) -> Tensor:
    """Operands as the kernels read them: contiguous; fp32 under the interpreter (numpy has no bf16, and the
    interpreter's half ``tl.dot`` is inexact)."""
    x = x.contiguous()
    return stand_in(x.float(), x.dtype) if interpreting() and x.dtype in (torch.float16, torch.bfloat16) else x


def acc_dtypes(x: Tensor) -> tuple[torch.dtype, Any]:
    """Accumulation dtype: fp64 for fp64 operands, fp32 otherwise (as the torch backend)."""
    return (torch.float64, tl.float64) if x.dtype == torch.float64 else (torch.float32, tl.float32)


def precision(x: Tensor) -> str:
    """``tl.dot``'s input precision: IEEE unless the user allowed TF32 for fp32 matmuls."""
    if x.dtype == torch.float32 and x.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


#: The exclusion rule's keyword arguments of every soft-max kernel (all default to None: a
#: plain call passes none of them, and the kernels test ``is not None`` at compile time).
EXCLUSION = ("rk0", "ck0", "rk1", "ck1", "partner", "g_rows", "g_cols", "threshold", "dg", "diagonal", "keep_diagonal")


def exclusion(exclude: Any) -> dict[str, Any]:
    """The kernels' view of an :class:`~torch_contrastive.positives.Exclusion` (or None): only the
    parts it has, by name -- id keys, a partner, a guide (contiguous rows, their width), the
    strided diagonal left out and the one kept."""
    check_exclusion(exclude)
    if exclude is None:
        return {}
    out: dict[str, Any] = {}
    relation = exclude.relation
    if isinstance(relation, KeyPositives):
        out.update(keys(relation.row_keys, relation.col_keys))
    elif isinstance(relation, PartnerPositives):
        out["partner"] = relation.partner.contiguous()
    if exclude.guide is not None:
        rows, cols, thr = exclude.guide
        out["g_rows"], out["g_cols"] = operand(rows), operand(cols)
        out.update(threshold=thr.to(out["g_rows"].dtype).contiguous(), dg=out["g_rows"].shape[1])
    if exclude.diagonal is not None:
        out["diagonal"] = exclude.diagonal
    if exclude.keep_diagonal is not None:
        out["keep_diagonal"] = exclude.keep_diagonal
    return out


#: The order of an exclusion's parts in the one tuple the kernels take (``excl``, :func:`packed`).
EXCLUSION_FIELDS = ("rk0", "ck0", "rk1", "ck1", "partner", "g_rows", "g_cols", "threshold", "dg", "diagonal",
                    "keep_diagonal")


def packed(parts: dict[str, Any]) -> tuple[Any, ...]:
    """An exclusion's parts by name (:func:`exclusion`) as the kernels' one ``excl`` argument, None where absent."""
    return tuple(parts.get(name) for name in EXCLUSION_FIELDS)


def keys(row_keys: tuple[Tensor, ...], col_keys: tuple[Tensor, ...]) -> dict[str, Tensor]:
    """One or two pairs of id keys as the kernels' ``rk0, ck0 (, rk1, ck1)``."""
    out = {"rk0": row_keys[0].contiguous(), "ck0": col_keys[0].contiguous()}
    if len(row_keys) > 1:
        out.update(rk1=row_keys[1].contiguous(), ck1=col_keys[1].contiguous())
    return out


def _acc(args: dict[str, Any]) -> Any:
    return tl.float64 if args["x_ptr"].dtype == torch.float64 else tl.float32


def _guide_acc(args: dict[str, Any]) -> Any:
    excl = args.get("excl")  # (a kernel without exclusions has no excl)
    guide = None if excl is None else excl[5]  # g_rows
    return tl.float64 if guide is not None and guide.dtype == torch.float64 else tl.float32


def _excludes(args: dict[str, Any]) -> bool:
    excl = args.get("excl")
    return excl is not None and any(excl[i] is not None for i in (0, 4, 5, 9))  # rk0, partner, g_rows, diagonal


#: The constexprs every kernel derives from its arguments (``triton.heuristics``): the
#: accumulation dtype and ``tl.dot`` precision from the operands.
DERIVED = {"ACC": _acc, "PRECISION": lambda args: precision(args["x_ptr"])}
#: The soft-max kernels' derivations: :data:`DERIVED` and whether any exclusion is given, with
#: the guide's accumulation dtype.
DERIVED_EXCLUSION = {**DERIVED, "EXCLUDE": _excludes, "GACC": _guide_acc}


def accumulates_as(name: str) -> Any:
    """A ``triton.heuristics`` rule: the accumulation dtype of the tensor argument ``name`` (fp64 stays fp64)."""
    return lambda args: tl.float64 if args[name].dtype == torch.float64 else tl.float32


#: The epilogue kernels' derivations (:mod:`.epilogue_sums`, :mod:`.epilogue_grad`): the statistics'
#: dtype from the logit tile ``s_ptr``, the exclusion switch, and the guide product's precision.
DERIVED_EPILOGUE = {"ACC": accumulates_as("s_ptr"), "PRECISION": lambda args: precision(args["s_ptr"]),
                    "EXCLUDE": _excludes, "GACC": _guide_acc}


#: Objects told of every kernel launch the host code announces (:func:`announced`): the cost
#: counter (:mod:`torch_contrastive.cli.traffic`) counts a launch and the logit bytes it declares,
#: and leaves out whatever torch does inside (the interpreter's own tensor work).
LAUNCH_LISTENERS: list[Any] = []


class announced:  # (lower case: it reads as the function it replaced, ``with announced(...)``)
    """A kernel launch as a cost count sees it: one launch of ``name`` reading ``reads`` and
    writing ``writes`` (the tensors it declares; a GPU's kernel touches each once). A class, not a generator
    context manager: every launch of a host-bound call pays its Python (about 45 bytecodes fewer a launch)."""

    __slots__ = ("name", "reads", "writes")

    def __init__(self, name: str, reads: tuple[Tensor, ...], writes: tuple[Tensor, ...]) -> None:
        self.name, self.reads, self.writes = name, reads, writes

    def __enter__(self) -> None:
        for listener in LAUNCH_LISTENERS:
            listener.launch_begins(self.name, self.reads, self.writes)

    def __exit__(self, *exc: object) -> None:
        for listener in LAUNCH_LISTENERS:
            listener.launch_ends()


@contextlib.contextmanager
def rounded_by_torch(rows: Tensor, low: Tensor | None, cols: Tensor | None) -> Iterator[tuple[Tensor, Tensor | None, Tensor | None]]:
    """The gradient tiles an epilogue kernel writes: ``(rows, low, cols)`` themselves on a GPU. The
    interpreter (the CPU tests) does not round fp32 to half to nearest even as a GPU does: there the
    kernel writes fp32 stand-ins (and no remainder), and torch rounds them into the tiles on exit --
    the remainder taken from the rounded row tile: the GPU's numbers."""
    if not (interpreting() and rows.dtype in (torch.float16, torch.bfloat16)):
        yield rows, low, cols
        return
    wide_rows = stand_in(torch.empty(rows.shape, device=rows.device), rows.dtype)
    wide_cols = None if cols is None else stand_in(torch.empty(cols.shape, device=cols.device), cols.dtype)
    yield wide_rows, None, wide_cols
    rows.copy_(wide_rows)
    if low is not None:
        low.copy_(wide_rows - rows.float())
    if cols is not None and wide_cols is not None:
        cols.copy_(wide_cols)


def launch(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, announced (:func:`announced`) as one launch of the
    kernel's name that reads and writes no logit-sized tensor: the fused kernels form their
    tiles in registers."""
    with announced(_name(kernel), (), ()):
        kernel[grid](*args, **kwargs)


def _name(kernel: Any) -> str:
    """A kernel's name without the decorators around it: ``_tile_sums_kernel`` -> ``tile_sums``."""
    inner = kernel
    while not hasattr(inner, "__name__") and hasattr(inner, "fn"):
        inner = inner.fn
    return str(getattr(inner, "__name__", "kernel")).strip("_").removesuffix("_kernel")


def launch_operands(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Every launcher's set-up: the device check, then the operands as the kernels read them
    (contiguous, so a row's stride is its width; fp32 under the interpreter)."""
    check_device(tensors[0])
    return tuple(operand(t) for t in tensors)


def per_index(t: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """A per-row (or per-column) vector, possibly a broadcast 0-dim coefficient, as the kernels read it."""
    return t.to(dtype).expand(n).contiguous()


def directions(row: tuple[Tensor, Tensor], col: tuple[Tensor, Tensor] | None, dtype: torch.dtype) -> list[Tensor | None]:
    """``[L, u, M, v]`` for the gradient kernels (``M, v`` None without a column term)."""
    n = row[1].shape[0]
    lse_r, u = per_index(row[1], n, dtype), per_index(row[0], n, dtype)
    if col is None:
        return [lse_r, u, None, None]
    m = col[1].shape[0]
    return [lse_r, u, per_index(col[1], m, dtype), per_index(col[0], m, dtype)]


def check_exclusion(exclude: Any) -> None:
    """A clear error, before any work, for an exclusion the kernels do not cover."""
    if exclude is None:
        return
    if exclude.keep is not None:
        raise ValueError("backend='triton' does not cover an exclusion with a kept relation; use backend='torch'")
    relation = exclude.relation
    if relation is not None and not isinstance(relation, (KeyPositives, PartnerPositives)):
        raise ValueError(f"backend='triton' does not cover exclusions by a {relation.kind!r} relation; use backend='torch'")
