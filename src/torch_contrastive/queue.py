"""A FIFO queue of past embeddings: MoCo's negatives, a memory bank, a cross-batch memory."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from . import _validation as v
from .distributed import gather_padded, gather_sizes, is_active

__all__ = ["FeatureQueue"]


class FeatureQueue(nn.Module):
    """A ring buffer of the last ``size`` embeddings (and optionally their labels or ids).

    The rows live in registered buffers, so the queue is saved by ``state_dict`` and moved
    by ``.to()`` with the model that owns it. Pushed rows are detached copies: a queue
    holds constants, and losses skip the gradient work for them.

    Use it as the unpaired negatives of :func:`~torch_contrastive.info_nce_loss` (MoCo,
    lightly's memory bank) or as ``memory_emb``/``memory_labels`` of
    :func:`~torch_contrastive.supcon_loss` and :func:`~torch_contrastive.nt_xent_loss`
    (pytorch-metric-learning's ``CrossBatchMemory``). Compute the loss first, then push
    the batch, so a batch is never its own negative.

    Example:
        >>> queue = FeatureQueue(4096)
        >>> loss = info_nce_loss(q, k, queue.features, in_batch_negatives=False)
        >>> queue.push(k)

    Args:
        size: capacity in rows (> 0).
        dim: feature size; ``None`` (default) takes it from the first push.
        dtype: storage dtype; ``None`` takes the first push's dtype (fp32 when ``dim``
            is given).
        device: storage device when ``dim`` is given (else the first push's device).
        fill: ``"empty"`` (default: the queue grows from 0 rows) or ``"random"``: it starts
            full of ``size`` random unit vectors (standard normal rows, L2-normalised), as
            lightly's ``MemoryBankModule``; needs ``dim``.
        overflow: what a push that passes the end of the buffer does: ``"wrap"``
            (default: the rest continues at the start, the newest rows always kept) or
            ``"drop"`` (lightly: the rows that do not fit before the end are dropped and
            the next push starts at row 0).
        generator: the ``torch.Generator`` for ``fill="random"`` (default: the global one).

    lightly's memory bank is ``FeatureQueue(M, dim, fill="random", overflow="drop")`` used
    as above; pytorch-metric-learning's ``CrossBatchMemory(memory_size=M)`` counts the
    current batch among its M rows, so it equals ``FeatureQueue(M - B)`` with batches of B.

    Memory: ``size * dim`` elements (plus ``size`` int64 labels when given).
    """

    queue_features: Tensor | None
    queue_labels: Tensor | None

    def __init__(self, size: int, dim: int | None = None, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, fill: str = "empty", overflow: str = "wrap",
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if fill not in ("empty", "random"):
            raise ValueError(f"fill must be 'empty' or 'random', got {fill!r}")
        if overflow not in ("wrap", "drop"):
            raise ValueError(f"overflow must be 'wrap' or 'drop', got {overflow!r}")
        if fill == "random" and dim is None:
            raise ValueError("fill='random' needs dim (the feature size of the random rows)")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 1):
            raise ValueError(f"dim must be None or a positive int, got {dim!r}")
        if dtype is not None and not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating dtype, got {dtype}")
        self.size = size
        self._ptr = 0  # next row to write
        self._count = 0  # valid rows (host-side: no device read to know the length)
        self._has_labels: bool | None = None  # fixed by the first push
        self.overflow = overflow
        features = None if dim is None else torch.zeros(size, dim, dtype=dtype or torch.float32, device=device)
        if fill == "random" and features is not None and dim is not None:
            noise = torch.randn(size, dim, generator=generator, dtype=torch.float32, device=generator.device if generator else None)
            features.copy_(torch.nn.functional.normalize(noise, dim=-1))
            self._count = size
        self.register_buffer("queue_features", features)
        self.register_buffer("queue_labels", None)

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return self._count

    @property
    def dim(self) -> int | None:
        """Feature size, or None before the first push (when not given)."""
        return None if self.queue_features is None else int(self.queue_features.shape[1])

    @property
    def features(self) -> Tensor:
        """The valid rows, (len(queue), dim), in storage order (not chronological: the
        losses do not depend on the order). A view of the buffer: do not modify it."""
        if self.queue_features is None:
            raise RuntimeError("the queue has no rows and no feature size yet: push a batch first or pass dim=")
        return self.queue_features if self._count == self.size else self.queue_features[: self._count]

    @property
    def labels(self) -> Tensor | None:
        """The valid rows' labels (or ids), aligned with :attr:`features`; None when the
        queue was filled without labels."""
        if self.queue_labels is None:
            return None
        return self.queue_labels if self._count == self.size else self.queue_labels[: self._count]

    # ------------------------------------------------------------------ writing
    @torch.no_grad()
    def push(self, features: Tensor, labels: Tensor | None = None, *, gather: bool = False) -> None:
        """Append rows, overwriting the oldest once full.

        Args:
            features: (B, D) rows; stored detached, in the queue's dtype and device.
            labels: optional (B,) integer labels or ids. Give them on every push or never.
            gather: under ``torch.distributed``, push the rows of every rank (rank
                order), so all ranks keep identical queues; sizes may differ per rank.
        """
        v.check_embeddings(features, "features")
        if self.dim is not None and features.shape[1] != self.dim:
            raise ValueError(f"features must have {self.dim} columns (the queue's feature size), got {features.shape[1]}")
        given = labels is not None
        if self._has_labels is not None and given != self._has_labels:
            state = "with" if self._has_labels else "without"
            raise ValueError(f"labels: this queue was filled {state} labels; pass them on every push or never")
        if labels is not None:
            labels = v.check_labels(labels, "labels", features.shape[0], features.device)
        rows = features.detach()
        if gather and is_active():
            sizes = gather_sizes(rows.shape[0], rows.device)
            rows = gather_padded(rows, sizes)
            labels = None if labels is None else gather_padded(labels, sizes)
        self._allocate(rows, given)
        self._write(rows, labels)

    def reset(self) -> None:
        """Forget every row (the buffers are kept)."""
        self._ptr = 0
        self._count = 0

    def _allocate(self, rows: Tensor, given: bool) -> None:
        if self.queue_features is None:
            self.queue_features = torch.zeros(self.size, rows.shape[1], dtype=rows.dtype, device=rows.device)
        if given and self.queue_labels is None:
            self.queue_labels = torch.zeros(self.size, dtype=torch.int64, device=self.queue_features.device)
        self._has_labels = given

    def _write(self, rows: Tensor, labels: Tensor | None) -> None:
        if self.overflow == "drop" and self._ptr + rows.shape[0] > self.size:  # lightly: keep what fits, restart at 0
            rows = rows[: self.size - self._ptr]
            labels = None if labels is None else labels[: self.size - self._ptr]
        if rows.shape[0] > self.size:  # only the newest rows fit
            rows = rows[-self.size :]
            labels = None if labels is None else labels[-self.size :]
        b = rows.shape[0]
        first = min(b, self.size - self._ptr)
        targets = [(self._ptr, 0, first), (0, first, b - first)]
        buffer = self.queue_features
        if buffer is None:
            raise RuntimeError("internal: the queue's buffer is allocated before writing")
        for start, src, count in targets:
            if count == 0:
                continue
            buffer[start : start + count].copy_(rows[src : src + count])
            if labels is not None and self.queue_labels is not None:
                self.queue_labels[start : start + count].copy_(labels[src : src + count])
        self._ptr = (self._ptr + b) % self.size
        self._count = min(self._count + b, self.size)

    # ------------------------------------------------------------------ state
    def get_extra_state(self) -> dict[str, Any]:
        return {"ptr": self._ptr, "count": self._count, "has_labels": self._has_labels, "size": self.size,
                "overflow": self.overflow}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        if state.get("size") != self.size:
            raise ValueError(f"state_dict holds a queue of size {state.get('size')}, this queue has size {self.size}")
        self._ptr, self._count, self._has_labels = int(state["ptr"]), int(state["count"]), state["has_labels"]
        self.overflow = state.get("overflow", self.overflow)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # A queue created without dim has no buffers until its first push: make room for
        # the saved ones so load_state_dict restores them.
        for name in ("queue_features", "queue_labels"):
            saved = state_dict.get(prefix + name)
            if saved is not None and getattr(self, name) is None:
                device = self.queue_features.device if self.queue_features is not None else saved.device
                self._buffers[name] = torch.empty_like(saved, device=device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"size={self.size}, dim={self.dim}, len={self._count}, labels={bool(self._has_labels)}, overflow={self.overflow}"
