"""Row strips under activation checkpointing: exact per-row losses in O(N) memory.

Some peer losses build each anchor's softmax from several similarity blocks that do not
share one anchor vector (sentence-transformers' MNRL with ``doc_to_query`` rows, GIST's
positive-positive block) or add a detached hardness term to some logits. The engine's
single anchor-by-candidate form does not describe them, so the adapters compute them strip
by strip: a strip of rows against every candidate, reduced to one loss per row at once,
and recomputed in backward (``torch.utils.checkpoint``). Peak memory is one strip's
logits, ``rows_per_strip x columns`` fp32 values, never the N x N matrices.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["per_row_losses", "strip_rows"]

# fp32 logits of one strip (x a few temporaries): 4M values ~ 16 MiB on CPU and GPU alike.
_STRIP_VALUES = 1 << 22


def strip_rows(n_rows: int, n_columns: int, chunk_size: int | None) -> int:
    """Rows per strip: ``chunk_size`` when given, else as many as ``_STRIP_VALUES`` logits allow."""
    if chunk_size is not None:
        return max(1, min(chunk_size, n_rows))
    return max(1, min(n_rows, _STRIP_VALUES // max(1, n_columns)))


def per_row_losses(row_loss: Callable[..., Tensor], n_rows: int, n_columns: int, tensors: tuple[Tensor, ...],
                   chunk_size: int | None = None) -> Tensor:
    """``cat([row_loss(start, stop, *tensors) for each strip])``, each strip checkpointed.

    Args:
        row_loss: ``(start, stop, *tensors) -> (stop - start,)`` losses of rows
            ``start..stop-1``; it must be a pure function of its arguments (it runs again in
            backward).
        n_rows: rows to cover.
        n_columns: logits per row (sizes the strip).
        tensors: the inputs ``row_loss`` reads; gradients flow to those that require them.
        chunk_size: rows per strip (None: automatic).

    Returns:
        (n_rows,) losses.
    """
    step = strip_rows(n_rows, n_columns, chunk_size)
    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    parts = []
    for start in range(0, n_rows, step):
        stop = min(start + step, n_rows)
        if recompute:
            parts.append(checkpoint(row_loss, start, stop, *tensors, use_reentrant=False))
        else:
            parts.append(row_loss(start, stop, *tensors))
    return torch.cat(parts) if parts else tensors[0].new_zeros(0, dtype=torch.float32)
