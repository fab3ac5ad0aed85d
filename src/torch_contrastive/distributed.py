"""Distributed helpers: gather across ranks with exact gradients (README, "Distributed training").

The problem (Wang's image-text write-up): a contrastive loss needs every rank's embeddings, a
plain ``all_gather`` drops their gradient, and DDP averages gradients over ranks. Here

* :func:`all_gather_with_grad` gathers rows from every rank (uneven batch sizes
  allowed); its backward gives each rank the *sum over ranks* of the gradients for its
  own rows, so every rank's loss contributes to every rank's encoder;
* each rank then computes only its own anchor rows against the gathered candidates
  (:class:`Scope`), so the work is split, not repeated;
* :meth:`Scope.finish` returns the *global* loss value on every rank, while the
  gradient it carries is scaled so that, after DDP's averaging (``grad_reduction=
  "mean"``, the default) or a framework's plain sum (``"sum"``), parameter gradients
  equal single-process training on the concatenated batch.

Only ``torch.distributed`` collectives are used (gloo on CPU, NCCL on GPU). Without an
initialised process group, or with world size 1, everything is local and no
collective is called.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Scope", "all_gather_with_grad", "gather_padded", "gather_sizes", "is_active", "make_scope"]


#: torch built with distributed support (a property of the build, asked once, not on every loss call).
_DIST_BUILT = dist.is_available()


def is_active() -> bool:
    """Whether a process group of more than one rank is running."""
    return _DIST_BUILT and dist.is_initialized() and dist.get_world_size() > 1


#: One collective into (or out of) one tensor: the names torch 2.13 prefers, the earlier ones before them.
_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SCATTER_OUT = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _counts_everywhere(counts: tuple[int, ...], device: torch.device) -> list[list[int]]:
    """Every rank's ``counts`` (one row count per tensor a call gathers), one list per tensor: one all-gather of
    ``len(counts)`` integers per rank into one tensor, read on the host once -- a gathered call's one
    synchronisation (ranks may hold different numbers of rows, and the gathers' shapes follow from them). The
    integers are written on the device (``torch.full``: a host list copied there would synchronise too)."""
    dtype = torch.int64
    mine = torch.full((1,), counts[0], dtype=dtype, device=device) if len(counts) == 1 else \
        torch.cat([torch.full((1,), c, dtype=dtype, device=device) for c in counts])
    everywhere = mine.new_empty(dist.get_world_size() * len(counts))
    _GATHER_INTO(everywhere, mine)
    table = everywhere.tolist()
    return [table[i :: len(counts)] for i in range(len(counts))]


def gather_sizes(n: int, device: torch.device) -> list[int]:
    """Every rank's row count (one all-gather of one integer, read on the host once)."""
    return _counts_everywhere((n,), device)[0]


def gather_padded(x: Tensor, sizes: list[int]) -> Tensor:
    """Concatenate ``x`` from every rank; ranks may hold different numbers of rows. Equal sizes (every step but
    an epoch's last, short batch): one collective straight into the result; else each rank's rows padded to
    the longest, gathered into one tensor, and the padding left out."""
    longest = max(sizes)
    if min(sizes) == longest:
        out = x.new_empty((len(sizes) * longest, *x.shape[1:]))
        _GATHER_INTO(out, x.contiguous())
        return out
    padded = x.new_zeros((longest, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = padded.new_empty((len(sizes) * longest, *x.shape[1:]))
    _GATHER_INTO(parts, padded)
    return torch.cat([parts[r * longest : r * longest + n] for r, n in enumerate(sizes)], dim=0)


class _AllGatherGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, sizes: list[int], rank: int):  # type: ignore[override]
        ctx.sizes, ctx.rank = sizes, rank
        return gather_padded(x.detach(), sizes)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        # Every rank holds a gradient for every gathered row; this rank's rows need the
        # sum over ranks: a reduce-scatter. NCCL has one (moves 1/W of the data of an
        # all_reduce); gloo does not, so there the whole gradient is all-reduced.
        # Half-precision rows' gradients are summed in fp32: each rank's share was rounded once to
        # the rows' dtype, and W shares summed in that dtype would round at every step.
        grad = grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad
        sizes, rank = ctx.sizes, ctx.rank
        if dist.get_backend() == "nccl":
            longest = max(sizes)
            if min(sizes) == longest:  # equal sizes: the gathered gradient is already in rank order, unpadded
                mine = grad.new_empty((longest, *grad.shape[1:]))
                _SCATTER_OUT(mine, grad.contiguous(), op=dist.ReduceOp.SUM)
                return mine, None, None
            padded = grad.new_zeros((len(sizes) * longest, *grad.shape[1:]))
            start = 0
            for r, n in enumerate(sizes):
                padded[r * longest : r * longest + n] = grad[start : start + n]
                start += n
            mine = grad.new_empty((longest, *grad.shape[1:]))
            _SCATTER_OUT(mine, padded, op=dist.ReduceOp.SUM)
            return mine[: sizes[rank]], None, None
        total = grad.contiguous().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        start = sum(sizes[:rank])
        return total[start : start + sizes[rank]], None, None


def all_gather_with_grad(x: Tensor) -> Tensor:
    """Gather ``x`` (rows may differ per rank) from every rank, keeping the gradient.

    Forward: the rank-ordered concatenation. Backward: each rank receives the sum over
    all ranks of the gradients for its own rows. Cost: two ``all_gather`` calls
    forward (sizes, data) and one ``all_reduce`` of the gathered gradient backward.
    Without an active process group it returns ``x`` unchanged.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim == 0:
        raise ValueError("x must have at least 1 dimension (its rows are gathered), got a 0-dim tensor")
    if not is_active():
        return x
    sizes = gather_sizes(x.shape[0], x.device)
    return _AllGatherGrad.apply(x, sizes, dist.get_rank())


@dataclass
class Scope:
    """Where a loss runs: this rank's rows within the global batch.

    Attributes:
        rank, world_size: of the process group (0 and 1 when local).
        sizes: number of rows on every rank (of the tensor first passed to :meth:`rows`).
        grad_reduction: ``"mean"`` (DDP averages gradients; the local gradient is
            multiplied by the world size) or ``"sum"`` (the framework sums them).
    """

    rank: int = 0
    world_size: int = 1
    grad_reduction: str = "mean"
    sizes: tuple[int, ...] = ()

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def offset(self) -> int:
        """Global index of this rank's first row (0 when local); known once :meth:`rows` ran."""
        if not self.distributed:
            return 0
        if not self.sizes:
            raise RuntimeError("internal: Scope.offset read before Scope.rows() gathered the batch sizes")
        return sum(self.sizes[: self.rank])

    def rows(self, x: Tensor) -> Tensor:
        """The global batch of ``x`` (autograd-aware gather); ``x`` itself when local."""
        if not self.distributed:
            return x
        return self.rows_of(x)[0]

    def rows_of(self, *xs: Tensor) -> tuple[Tensor, ...]:
        """The global batch of each of ``xs`` (autograd-aware gathers; ``xs`` themselves when local): their row
        counts gathered in one collective and read once, whatever their number (a call's one host
        synchronisation where it gathers its inputs together)."""
        if not self.distributed:
            return xs
        per = _counts_everywhere(tuple(x.shape[0] for x in xs), xs[0].device)
        for sizes in per:
            if not self.sizes:
                self.sizes = tuple(sizes)
            elif tuple(sizes) != self.sizes:  # every rank read the same counts: every rank raises
                raise ValueError(f"inputs of one loss must have the same batch size on each rank, got {sizes} vs {list(self.sizes)}")
        return tuple(_AllGatherGrad.apply(x, sizes, self.rank) for x, sizes in zip(xs, per))

    def ints(self, x: Tensor) -> Tensor:
        """The global batch of an integer tensor (labels, ids); no gradient."""
        if not self.distributed:
            return x
        return gather_padded(x, list(self.sizes) or gather_sizes(x.shape[0], x.device))

    def total(self, x: Tensor) -> Tensor:
        """Sum of a (detached) tensor over ranks."""
        if not self.distributed:
            return x
        out = x.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def all_sum(self, x: Tensor) -> None:
        """In-place sum over ranks (used by the engine for column statistics)."""
        if self.distributed:
            dist.all_reduce(x, op=dist.ReduceOp.SUM)

    def all_max(self, x: Tensor) -> None:
        """In-place maximum over ranks."""
        if self.distributed:
            dist.all_reduce(x, op=dist.ReduceOp.MAX)

    def agree(self, what: str, values: list[float]) -> None:
        """Raise the same clear error on every rank if ranks disagree on ``values``."""
        if not self.distributed:
            return
        mine = torch.tensor(values, dtype=torch.float64)
        if dist.get_backend() == "nccl":
            mine = mine.cuda()
        lo, hi = mine.clone(), mine.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        if not torch.equal(lo, hi):
            raise ValueError(f"ranks disagree on {what}: this rank has {values}, others range {lo.tolist()} .. {hi.tolist()}")

    def finish(self, local_sum: Tensor, normaliser: Tensor | float) -> Tensor:
        """``global_sum / global_normaliser`` on every rank, with the right gradient.

        ``local_sum`` is this rank's differentiable share; ``normaliser`` its share of
        the (gradient-free) denominator. The value is the global loss; the gradient is
        ``world_size * d(local_sum)/global_normaliser`` for ``grad_reduction="mean"``
        (undoing DDP's average), ``d(local_sum)/global_normaliser`` for ``"sum"``.
        """
        if not self.distributed:
            return local_sum / normaliser
        # both sums in one all-reduce; a float normaliser written on the device (a host value copied there syncs)
        norm = normaliser.to(local_sum.dtype) if isinstance(normaliser, Tensor) else \
            torch.full((), float(normaliser), dtype=local_sum.dtype, device=local_sum.device)
        both = torch.stack([local_sum.detach(), norm])
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
        value, total_norm = both[0] / both[1], both[1]
        factor = self.world_size if self.grad_reduction == "mean" else 1
        local = local_sum * factor / total_norm
        return local + (value - local).detach()


_warned_local = False
#: The local scope of each grad_reduction: built once (a local scope is never changed: ``rows`` and ``ints``
#: return their inputs), so a loss call on one process builds none.
_LOCAL: dict[str, Scope] = {}


def make_scope(gather: bool, grad_reduction: str = "mean", stacklevel: int = 3) -> Scope:
    """The :class:`Scope` of a loss call: distributed when ``gather`` and a group is active.

    A loss called with ``gather=False`` while a process group of several ranks is active
    warns once per process: each rank then contrasts its rows only with its own batch
    (a silent default that has cost users of other libraries their negatives).
    """
    global _warned_local
    if is_active():
        if gather:
            return Scope(rank=dist.get_rank(), world_size=dist.get_world_size(), grad_reduction=grad_reduction)
        if not _warned_local:
            _warned_local = True
            warnings.warn(f"a contrastive loss was called with gather=False under a process group of {dist.get_world_size()} "
                          "ranks: each rank only sees its local negatives. Pass gather=True for the global batch "
                          "(this warning is shown once).", UserWarning, stacklevel=stacklevel)
    local = _LOCAL.get(grad_reduction)
    if local is None:
        local = _LOCAL[grad_reduction] = Scope(grad_reduction=grad_reduction)
    return local
