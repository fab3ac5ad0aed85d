"""Gradient caching: contrastive batches beyond activation memory, exact gradients (Gao et al. 2021, GradCache).

Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited
Setup". The contrastive loss couples every row with every other, so a batch cannot
simply be split into independent micro-batches; but the loss itself is cheap in memory
(the tiled engine: O(N)) and only the encoders' activations are large. So:

1. encode the batch micro-batch by micro-batch **without** a graph, keeping only the
   embeddings (and each micro-batch's RNG state);
2. compute the loss on the detached embeddings and back-propagate it: this gives the
   gradient of the loss with respect to every embedding (and to the loss's own
   parameters, such as a learnable temperature);
3. re-encode each micro-batch **with** a graph, RNG restored so dropout draws the same
   masks, and back-propagate its slice of the cached embedding gradient.

The parameter gradients are those of one full-batch step (with the same dropout masks);
peak activation memory is that of one micro-batch; the price is a second forward pass.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["RngSnapshot", "grad_cache"]

Batch = Tensor | Mapping[str, Tensor]


def _rows(batch: Batch, name: str) -> int:
    if isinstance(batch, Tensor):
        if batch.ndim == 0:
            raise ValueError(f"{name} must be batch-first (at least 1-D), got a 0-dim tensor")
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        sizes = {k: int(v.shape[0]) for k, v in batch.items() if isinstance(v, Tensor) and v.ndim > 0}
        if not sizes or len(sizes) != len(batch):
            raise TypeError(f"{name}: a dict input must hold only batch-first tensors, got {list(batch)}")
        if len(set(sizes.values())) != 1:
            raise ValueError(f"{name}: the tensors of a dict input must have the same batch size, got {sizes}")
        return next(iter(sizes.values()))
    raise TypeError(f"{name} must be a tensor or a dict of tensors, got {type(batch).__name__}")


def _slice(batch: Batch, start: int, stop: int) -> Batch:
    if isinstance(batch, Tensor):
        return batch[start:stop]
    return {k: v[start:stop] for k, v in batch.items()}


def _call(encoder: nn.Module, part: Batch) -> Tensor:
    out = encoder(**part) if isinstance(part, Mapping) else encoder(part)
    if not isinstance(out, Tensor) or out.ndim < 1:
        raise TypeError(f"an encoder must return a batch-first tensor, got {type(out).__name__}")
    return out


class RngSnapshot:
    """The CPU (and every initialised CUDA device's) random state at one moment: the replay
    context that gradient caching needs, public for callers who write their own cache.

    Take a snapshot before a forward pass without a graph; run the second pass inside
    :meth:`restored` and it draws the same random numbers (dropout masks), while the
    generators outside the block continue from where they were.

    Example:
        >>> snap = RngSnapshot()
        >>> with torch.no_grad():
        ...     first = encoder(x)
        >>> with snap.restored():
        ...     again = encoder(x)          # same dropout masks as ``first``

    Args:
        devices: CUDA device indices to record (default: every initialised device).
    """

    def __init__(self, devices: list[int] | None = None) -> None:
        if devices is not None:
            if isinstance(devices, (str, bytes)) or not all(isinstance(d, int) and not isinstance(d, bool) for d in devices):
                raise TypeError(f"devices must be None or a list of CUDA device indices (ints), got {devices!r}")
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if any(not 0 <= d < count for d in devices):
                raise ValueError(f"devices must be CUDA device indices below {count} (the visible devices), got {list(devices)}")
        self.devices = _cuda_devices() if devices is None else list(devices)
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices]

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Run with these states, then put back the states from before."""
        with torch.random.fork_rng(devices=self.devices):
            self.restore()
            yield

    def restore(self) -> None:
        """Set the generators to these states (no way back: see :meth:`restored`)."""
        torch.set_rng_state(self.cpu)
        for d, state in zip(self.devices, self.cuda):
            torch.cuda.set_rng_state(state, d)


def _cuda_devices() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() and torch.cuda.is_initialized() else []


def _warn_batch_norm(encoders: Sequence[nn.Module]) -> None:
    for encoder in encoders:
        for module in encoder.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
                warnings.warn(
                    f"grad_cache: {type(module).__name__} in train mode normalises each micro-batch with its own "
                    "statistics, so gradients differ from a full-batch step (use eval mode, GroupNorm/LayerNorm, "
                    "or accept per-micro-batch statistics)", UserWarning, stacklevel=3)
                return


def _paired(encoders: object, inputs: object, loss_fn: object, micro_batch: object) -> tuple[list[nn.Module], list[Batch]]:
    """:func:`grad_cache`'s arguments checked: one encoder per input (one encoder serves every input)."""
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch must be a positive int, got {micro_batch!r}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(encoders, (nn.Module, list, tuple)):
        raise TypeError(f"encoders must be an nn.Module or a sequence of nn.Modules, got {type(encoders).__name__}")
    if not isinstance(inputs, (Tensor, Mapping, list, tuple)):
        raise TypeError(f"inputs must be a tensor, a dict of tensors or a sequence of them, got {type(inputs).__name__}")
    batches = [inputs] if isinstance(inputs, (Tensor, Mapping)) else list(inputs)
    towers = [encoders] if isinstance(encoders, nn.Module) else list(encoders)
    if not all(isinstance(e, nn.Module) for e in towers):
        raise TypeError("encoders must be an nn.Module or a sequence of nn.Modules")
    if len(towers) == 1 and len(batches) > 1:
        towers = towers * len(batches)
    if len(towers) != len(batches) or not batches:
        raise ValueError(f"encoders and inputs must pair up: got {len(towers)} encoder(s) for {len(batches)} input(s)")
    return towers, batches


def grad_cache(
    encoders: nn.Module | Sequence[nn.Module],
    inputs: Batch | Sequence[Batch],
    loss_fn: Callable[..., Tensor],
    micro_batch: int,
    **loss_kwargs: Any,
) -> Tensor:
    """One training step's backward for a batch larger than activation memory allows.

    Computes ``loss_fn(*[encoder(x) for encoder, x in zip(encoders, inputs)], **loss_kwargs)``
    and back-propagates it into the encoders' (and the loss's) parameters, holding the
    activations of only one micro-batch at a time. Call ``optimizer.step()`` afterwards as
    usual; gradients accumulate into ``.grad`` like ``loss.backward()``.

    Args:
        encoders: one module, or one per input (CLIP: image and text towers). One module
            with several inputs encodes all of them (SimCLR's two views through one tower).
            ``DistributedDataParallel`` modules are fine: every micro-batch's backward but
            the module's last runs inside ``no_sync()``, so gradients are all-reduced once.
        inputs: a batch-first tensor, a dict of batch-first tensors (sliced along dim 0
            and passed as keyword arguments), or a sequence of these (one per encoder).
        loss_fn: any callable of the embeddings -- a loss of this package (with
            ``gather=True`` under DDP each rank caches its own rows), a module with a
            learnable temperature (its parameters get their gradients), or your own.
        micro_batch: rows encoded at once (> 0).
        **loss_kwargs: passed to ``loss_fn`` (labels, ids, ...).

    Returns:
        The loss, detached.

    Exactness: parameter gradients equal a full-batch step whose encoders draw the same
    random numbers (the RNG state of every micro-batch is recorded in the first pass and
    restored in the second, CPU and CUDA). Layers that couple rows of a batch -- BatchNorm
    in train mode -- see micro-batches instead (a warning says so).

    Memory: the embeddings and their gradients (O(N * D)) plus one micro-batch's
    activations; time: one extra forward pass of the encoders.
    """
    towers, batches = _paired(encoders, inputs, loss_fn, micro_batch)
    sizes = [_rows(b, f"inputs[{k}]") for k, b in enumerate(batches)]
    _warn_batch_norm(towers)
    devices = _cuda_devices()

    # pass 1: embeddings without a graph, one RNG state per micro-batch
    plans: list[list[tuple[int, int, RngSnapshot]]] = []
    embeddings: list[Tensor] = []
    with torch.no_grad():
        for tower, batch, n in zip(towers, batches, sizes):
            plan, outs = [], []
            for start in range(0, n, micro_batch):
                stop = min(start + micro_batch, n)
                plan.append((start, stop, RngSnapshot(devices)))
                outs.append(_call(tower, _slice(batch, start, stop)))
            plans.append(plan)
            embeddings.append(torch.cat(outs).requires_grad_())
    after_pass_one = RngSnapshot(devices)

    # the loss on detached leaves: embedding gradients (and the loss's own parameters)
    loss = loss_fn(*embeddings, **loss_kwargs)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    loss.backward()
    cached = [e.grad if e.grad is not None else torch.zeros_like(e) for e in embeddings]

    # pass 2: re-encode with a graph and push the cached gradient through
    last_use = {id(t): (k, len(plans[k]) - 1) for k, t in enumerate(towers)}
    for k, (tower, batch, plan) in enumerate(zip(towers, batches, plans)):
        for i, (start, stop, state) in enumerate(plan):
            final = last_use[id(tower)] == (k, i)
            no_sync = getattr(tower, "no_sync", None)  # DistributedDataParallel: all-reduce on the last backward only
            sync = no_sync() if callable(no_sync) and not final else contextlib.nullcontext()
            with sync, state.restored():
                out = _call(tower, _slice(batch, start, stop))
                out.backward(cached[k][start:stop].to(out.dtype))
    # leave the generators where a single full-batch forward would have left them
    after_pass_one.restore()
    return loss.detach()
