"""Host-side helpers every kernel launcher shares: the device check, operands as the kernels
read them, accumulation dtype and ``tl.dot`` precision, and the exclusion rule's arguments."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

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


def operand(x: Tensor) -> Tensor:
    """Operands as the kernels read them: contiguous; fp32 under the interpreter."""
    x = x.contiguous()
    return x.float() if interpreting() and x.dtype in (torch.float16, torch.bfloat16) else x


def acc_dtypes(x: Tensor) -> tuple[torch.dtype, Any]:
    """Accumulation dtype: fp64 for fp64 operands, fp32 otherwise (as the torch backend)."""
    return (torch.float64, tl.float64) if x.dtype == torch.float64 else (torch.float32, tl.float32)


def precision(x: Tensor) -> str:
    """``tl.dot``'s input precision: IEEE unless the user allowed TF32 for fp32 matmuls."""
    if x.dtype == torch.float32 and x.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def exclusion_args(exclude: Any, anchor: Tensor) -> tuple[list[Any], dict[str, Any]]:
    """The kernels' view of an :class:`~torch_contrastive.positives.Exclusion` (or None):
    positional tensors/ints after ``self_offset`` and the constexpr switches."""
    dummy = anchor
    keys: list[Tensor] = [dummy, dummy, dummy, dummy]
    partner: Tensor = dummy
    g_rows = g_cols = threshold = dummy
    dg = stride_gr = stride_gc = 0
    flags: dict[str, Any] = dict(EXCLUDE=exclude is not None, N_KEYS=0, PARTNER=False, GUIDE=False, DIAGONAL=False,
                                 KEEP_DIAGONAL=False, GACC=tl.float32)
    diagonal = keep_diagonal = 0
    if exclude is not None:
        if exclude.keep is not None:
            raise ValueError("backend='triton' does not cover an exclusion with a kept relation; use backend='torch'")
        relation = exclude.relation
        if relation is not None:
            if relation.kind == "keys":
                rk, ck = relation.row_keys, relation.col_keys
                keys = [rk[0].contiguous(), ck[0].contiguous()]
                keys += [rk[1].contiguous(), ck[1].contiguous()] if len(rk) > 1 else [dummy, dummy]
                flags["N_KEYS"] = len(rk)
            elif relation.kind == "partner":
                partner = relation.partner.contiguous()
                flags["PARTNER"] = True
            else:
                raise ValueError(f"backend='triton' does not cover exclusions by a {relation.kind!r} relation; use backend='torch'")
        if exclude.guide is not None:
            rows, cols, thr = exclude.guide
            g_rows, g_cols = operand(rows), operand(cols)
            threshold = thr.to(g_rows.dtype).contiguous()
            dg, stride_gr, stride_gc = g_rows.shape[1], g_rows.stride(0), g_cols.stride(0)
            flags.update(GUIDE=True, GACC=tl.float64 if g_rows.dtype == torch.float64 else tl.float32)
        if exclude.diagonal is not None:
            diagonal = exclude.diagonal
            flags["DIAGONAL"] = True
        if exclude.keep_diagonal is not None:
            keep_diagonal = exclude.keep_diagonal
            flags["KEEP_DIAGONAL"] = True
    args = [*keys, partner, g_rows, g_cols, threshold, dg, stride_gr, stride_gc, diagonal, keep_diagonal]
    return args, flags


def per_index(t: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """A per-row (or per-column) vector, possibly a broadcast 0-dim coefficient, as the kernels read it."""
    return t.to(dtype).expand(n).contiguous()


def directions(row: tuple[Tensor, Tensor], col: tuple[Tensor, Tensor] | None, dtype: torch.dtype) -> list[Tensor]:
    """``[L, u, M, v]`` for the gradient kernels (the row pair again when there is no column term)."""
    n = row[1].shape[0]
    lse_r, u = per_index(row[1], n, dtype), per_index(row[0], n, dtype)
    if col is None:
        return [lse_r, u, lse_r, u]
    m = col[1].shape[0]
    return [lse_r, u, per_index(col[1], m, dtype), per_index(col[0], m, dtype)]


def check_exclusion(exclude: Any) -> None:
    """A clear error, before any work, for an exclusion the kernels do not cover."""
    if exclude is not None:
        exclusion_args(exclude, torch.empty(0))
