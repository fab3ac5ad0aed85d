"""The pair terms' executor: statistics that need the positive mask inside each tile.

The per-positive-pair NT-Xent of pytorch-metric-learning (``kernel="pair_softplus"``)
and NT-BXent's element-wise binary cross-entropy (``kernel="binary"``) are not linear in
the positive mask, so each tile asks :meth:`~torch_contrastive.positives.Positives.tile`
for its block of the mask. Forward keeps O(N) statistics, backward recomputes each tile
(a single tile -- the small-batch case -- is kept from forward instead). The kernels' tile
arithmetic is in :mod:`.pair_kernels`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from .._tensors import as_dtype, clear_self_diagonal
from ..positives import KeyPositives
from .driver import Gradients, Operands, Saved, run
from .pair_kernels import KERNELS, PairKernel
from .precision import zero
from .problem import PairTerms, Problem
from .products import AnyProducts, make_products
from .tiling import Buffers, GradTile, gradient_sweep, sweep

if TYPE_CHECKING:
    from ..positives import Positives
    from .plans import PairPlan


def _masks(positives: Positives, r0: int, r1: int, c0: int, c1: int, plan: PairPlan | None = None,
           bufs: Buffers | None = None) -> tuple[Tensor, Tensor]:
    """(positive, negative) masks of a tile; the self pair is in neither.

    Bool masks for ``torch.where``; 0/1 float masks (written straight from the label
    comparison into reused buffers) when :func:`_float_masks` allows: multiplying by them is
    several times cheaper than ``where`` and, in fixed mode, every masked value is finite.
    """
    labels = _float_masks(plan, positives) if plan is not None and bufs is not None else None
    if labels is not None and bufs is not None:
        rk, ck = labels.row_keys[0][r0:r1, None], labels.col_keys[0][None, c0:c1]
        pos_f = torch.eq(rk, ck, out=bufs.get(r1 - r0, c1 - c0, 2))
        neg_f = torch.ne(rk, ck, out=bufs.get(r1 - r0, c1 - c0, 3))  # the self pair has its own label: never a negative
        clear_self_diagonal(pos_f, positives.self_offset, r0, c0)
        return pos_f, neg_f
    pos = positives.tile(r0, r1, c0, c1)
    neg = ~pos
    clear_self_diagonal(neg, positives.self_offset, r0, c0)
    return pos, neg


def _scratch(bufs: Buffers, rows: int, cols: int, slot: int) -> tuple[Tensor, Tensor]:
    """Two reused (rows, cols) temporaries for a gradient tile (slots ``slot``, ``slot + 1``)."""
    return bufs.get(rows, cols, slot), bufs.get(rows, cols, slot + 1)


def _float_masks(plan: PairPlan, positives: Positives) -> KeyPositives | None:
    """The label relation when PML NT-Xent runs in fixed mode on one key: every exp, softplus
    and sigmoid of a tile is finite (``|S| <= 40``), so masks can multiply instead of select."""
    if isinstance(positives, KeyPositives) and len(positives.row_keys) == 1 and plan.fixed and plan.kernel == "pair_softplus":
        return positives
    return None


class PairExecutor:
    """The pair terms as an executor of the engine's driver (:mod:`.driver`). This class owns the
    statistic's combination (the caller's per-row weights and reduction, ``combine``, its one
    extra input) and a backend supplies :meth:`terms` and :meth:`gradients`."""

    def run(self, problem: Problem, plan: PairPlan) -> tuple[Tensor, ...]:
        """Run a :class:`~.problem.PairTerms` problem as ``plan`` says (see :func:`pairwise_rows`)."""
        stat = problem.statistic
        if not isinstance(stat, PairTerms):
            raise TypeError(f"the pair executor runs PairTerms problems, got {type(stat).__name__}")
        return tuple(run(self, plan, problem.anchors, None if problem.single else problem.candidates, problem.scale,
                         stat.combine))

    def terms(self, plan: PairPlan, ops: Operands, total_only: bool = False) -> tuple[tuple[Tensor, ...], dict[str, Any]]:
        """The kernel's per-row outputs and what backward keeps. ``total_only``: the combination reads only the rows'
        total (:func:`total_only`): a backend may return it as one 0-dim output (the torch loops' one tile does).
"""
        raise NotImplementedError

    def gradients(self, ctx: Any, plan: PairPlan, saved: Saved, grads: tuple[Tensor, ...]) -> Gradients:
        raise NotImplementedError

    def forward(self, ctx: Any, plan: PairPlan, ops: Operands, extras: tuple[Any, ...]) -> tuple[Any, dict[str, Any]]:
        (combine,) = extras
        outputs, keep = self.terms(plan, ops, total_only(combine))
        # tensor-core products multiply the caller's half rows as given, in backward too
        keep["raw"] = () if not plan.half else (ops.a,) if ops.b is None else (ops.a, ops.b)
        ctx.combine = combine
        if combine is not None:  # the caller's per-row weights and reduction, here: one autograd node per loss
            if not outputs:
                raise RuntimeError("internal: combine without outputs")
            outputs = (combined(outputs, combine),)
        return tuple(outputs), keep

    def backward(self, ctx: Any, plan: PairPlan, saved: Saved, grads: tuple[Tensor | None, ...]) -> Gradients:
        a = saved.a
        if ctx.combine is not None:  # d loss / d out_k,i = total * w_k,i
            return self.gradients(ctx, plan, saved, combined_grads(cast(Tensor, grads[0]), ctx.combine, a.shape[0], a.dtype))
        return self.gradients(ctx, plan, saved, tuple(as_dtype(g, a.dtype) for g in grads))  # type: ignore[arg-type]


def _unit(w: object) -> bool:
    """A float weight of exactly 1 (multiplying by it would be an op that changes nothing; a tensor
    is never compared: that would read it on the host)."""
    return isinstance(w, float) and w == 1.0


def combined(outputs: tuple[Tensor, ...], combine: Any) -> Tensor:
    """The reduced value ``total * sum_k w_k . outputs_k`` (``combine = (weights, total)``; a weight of 1.0 -- PML's
    mean over pairs -- costs no op). Weights stacked as the rows of one (K, N) tensor (NT-BXent's two means) take
    one dot product and one fused matrix-vector product per further output, a float ``total`` folded into it:
    two ops for two outputs where separate weights take five."""
    weights, total = combine
    if weights is UNIT and outputs[0].dim() == 0:  # the kernel summed the rows itself (total_only)
        return outputs[0] if type(total) is float and total == 1.0 else outputs[0] * total
    if isinstance(weights, Tensor):
        value = torch.dot(weights[0], outputs[0])
        if len(outputs) == 1:
            return value if _unit(total) else value * total
        folded = isinstance(total, float)
        last = len(outputs) - 1
        for k in range(1, len(outputs)):
            factor = total if folded and k == last else 1.0
            value = torch.addmv(value.view(1), weights[k : k + 1], outputs[k], beta=factor, alpha=factor).view(())
        return value if folded or _unit(total) else value * total
    # plain loops, no comprehension or cast(), the weight-of-1 test written out: each Python call is paid by a small
    # call (a test counts them)
    per_row = outputs[0] if type(weights[0]) is float and weights[0] == 1.0 else weights[0] * outputs[0]
    for w, out in zip(weights[1:], outputs[1:]):
        per_row = per_row + (out if _unit(w) else w * out)
    summed = per_row.sum()
    return summed if type(total) is float and total == 1.0 else summed * total


#: The weights of a combination that weighs its one output 1 everywhere (PML's mean over pairs): the engine then
#: reads only the rows' total, summed inside the kernel (:func:`total_only`; recognised by identity, no compare).
UNIT: tuple[float] = (1.0,)


def total_only(combine: Any) -> bool:
    """Whether a combination reads only the rows' total: its weights are :data:`UNIT` (PML's mean over pairs)."""
    return combine is not None and combine[0] is UNIT


def single_fixed(kernel: Any, s: Tensor, pos: Tensor, combine: Any) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """A lean one tile's ``kernel.single_fixed`` (the self pair on the diagonal), summed over the rows inside the
    kernel when :func:`combined` reads only their total (:func:`total_only`, written out: a small call pays each
    Python call), as the torch loops' one tile does."""
    if combine[0] is UNIT and kernel is PairKernel:
        return kernel.single_fixed(s, pos, 0, True)
    return kernel.single_fixed(s, pos, 0)  # type: ignore[no-any-return]


def combined_grads(g: Tensor, combine: Any, rows: int, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """``d value / d outputs_k`` of :func:`combined` per row, ``total * w_k`` times the incoming ``g`` (stacked
    weights: every output's in one op)."""
    weights, total = combine
    if isinstance(weights, Tensor):
        scaled = torch.addcmul(zero(weights), weights, g, value=total) if isinstance(total, float) else weights * (g * total)
        stacked = as_dtype(scaled, dtype)
        return tuple(stacked.unbind())
    g = g if type(total) is float and total == 1.0 else g * total
    grads = []
    for w in weights:
        grads.append(as_dtype((g if type(w) is float and w == 1.0 else g * w).expand(rows), dtype))
    return tuple(grads)


class TorchPairs(PairExecutor):
    """The pair terms on torch: one kept tile, or tile passes (the upper triangle for a
    label-sorted single set, all-negative tiles without masks)."""

    def terms(self, plan: PairPlan, ops: Operands, total_only: bool = False) -> tuple[tuple[Tensor, ...], dict[str, Any]]:
        a_c, b_c, scale_c = ops.a_c, ops.b_c, ops.scale
        R, C = a_c.shape[0], b_c.shape[0]
        kernel_cls = KERNELS[plan.kernel]
        prod = make_products(plan.half, (ops.a, ops.b), None, a_c, b_c, scale_c, ops.norms, plan.normalize)
        if plan.single_tile:
            # One tile: compute it once and keep what backward needs instead of recomputing it.
            s = prod.logits(0, R, 0, C)
            if plan.fixed:  # finite values: 0/1 float masks multiply, several times cheaper than where
                pos_f = plan.positives.tile_values(0, R, 0, C, a_c.dtype)  # every other pair but the self pair: negative
                # the rows' total summed inside the kernel where only it is read: the lean one tile's arithmetic
                outputs, kept = kernel_cls.single_fixed(s, pos_f, plan.positives.self_offset, True) \
                    if total_only and kernel_cls is PairKernel else kernel_cls.single_fixed(s, pos_f, plan.positives.self_offset)
            else:
                pos, neg = _masks(plan.positives, 0, R, 0, C)
                outputs, kept = kernel_cls.single(s, pos, neg)
            return outputs, {"kernel": (), "kept": kept}
        kernel = kernel_cls(R, a_c.dtype, a_c.device, plan.fixed)
        if plan.symmetric:
            _symmetric_forward(kernel, prod, R, plan)
        for p in range(0 if plan.symmetric else kernel.passes):
            def visit(s: Tensor, r0: int, r1: int, c0: int, c1: int, bufs: Buffers, p: int = p) -> None:
                if not plan.is_mixed(r0, c0):  # all negatives: no mask, and no positive terms
                    kernel.visit_negatives(p, s, r0, r1)
                    return
                pos, neg = _masks(plan.positives, r0, r1, c0, c1, plan, bufs)
                kernel.visit(p, s, pos, neg, r0, r1)

            # PML's second pass has nothing to do on an all-negative tile: not even its logits are formed
            quiet = p > 0 and plan.kernel != "binary"
            sweep(prod, R, C, plan.tile, False, visit, skip=(lambda r0, c0: not plan.is_mixed(r0, c0)) if quiet else None)
        return kernel.outputs(), {"kernel": kernel.saved(), "kept": ()}

    def gradients(self, ctx: Any, plan: PairPlan, saved: Saved, grads: tuple[Tensor, ...]) -> Gradients:
        a, b, scale = saved.a, saved.b, saved.scale
        kernel_saved, kept = saved.keep["kernel"], saved.keep["kept"]
        kernel = KERNELS[plan.kernel]
        raw = (*saved.keep["raw"], None, None)  # a single set's candidates are its anchors
        prod = make_products(plan.half, (raw[0], raw[1]), None, a, a if plan.symmetric else b,
                             scale, saved.norms, plan.normalize)
        if kept:
            if ctx.single and plan.fixed and isinstance(plan.positives, KeyPositives):  # a symmetric relation
                return Gradients(prod.row_product(kernel.single_grad_fixed_both(tuple(kept), grads)), None, True)
            g = (kernel.single_grad_fixed if plan.fixed else kernel.single_grad)(tuple(kept), grads)
            if ctx.single:  # one set: both roles of every row in one product, (G + G.T) @ A counts every pair twice
                return Gradients(prod.row_product(g + g.t()), None, True)
            return Gradients(prod.row_product(g), prod.column_product(g))

        def grad_tile(s: Tensor, r0: int, r1: int, c0: int, c1: int, bufs: Buffers) -> Tensor:
            if not plan.is_mixed(r0, c0):
                return kernel.grad_negatives(s, r0, r1, kernel_saved, grads, plan.fixed)
            pos, neg = _masks(plan.positives, r0, r1, c0, c1, plan, bufs)
            return kernel.grad_tile(s, pos, neg, r0, r1, kernel_saved, grads, _scratch(bufs, r1 - r0, c1 - c0, 4))

        if plan.symmetric:
            gb, _ = gradient_sweep(prod, a, a, plan.tile, True, _symmetric_grad_tile(kernel, plan, kernel_saved, grads))
            return Gradients(gb, None, True)
        gb, ga = gradient_sweep(prod, a, b, plan.tile, False, grad_tile)
        return Gradients(gb, ga)


#: The torch pair executor (a form of the torch loops: :mod:`.torch_loops`).
TORCH = TorchPairs()


def _symmetric_forward(kernel: Any, prod: AnyProducts, n: int, plan: PairPlan) -> None:
    """Both passes over the upper-triangle tiles of a symmetric S (rows = columns, sorted by label).

    A mixed tile off the diagonal is visited twice, as rows of its row block and, transposed,
    as rows of its column block (the relation is symmetric); an all-negative tile feeds
    both blocks from one exp (PML, fixed mode) or one softplus (NT-BXent).
    """
    for p in range(kernel.passes):
        def visit(s: Tensor, r0: int, r1: int, c0: int, c1: int, bufs: Buffers, p: int = p) -> None:
            if not plan.is_mixed(r0, c0):
                kernel.visit_negatives_both(s, r0, r1, c0, c1)
                return
            pos, neg = _masks(plan.positives, r0, r1, c0, c1, plan, bufs)
            kernel.visit(p, s, pos, neg, r0, r1)
            if c0 != r0:
                kernel.visit(p, s.t(), pos.t(), neg.t(), c0, c1)

        # an all-negative tile has no per-positive terms: not even its logits are needed after pass 0
        sweep(prod, n, n, plan.tile, True, visit, skip=(lambda r0, c0: not plan.is_mixed(r0, c0)) if p > 0 else None)


def _symmetric_grad_tile(kernel: Any, plan: PairPlan, saved: tuple[Tensor, ...], grads: tuple[Tensor, ...]) -> GradTile:
    """The gradient tile of a symmetric S's upper triangle: ``H = G + G'^T`` (both blocks' tiles)."""

    def grad_tile(s: Tensor, r0: int, r1: int, c0: int, c1: int, bufs: Buffers) -> Tensor:
        if not plan.is_mixed(r0, c0):
            return kernel.grad_negatives_both(s, r0, r1, c0, c1, saved, grads, bufs.get(r1 - r0, c1 - c0, 1))
        pos, neg = _masks(plan.positives, r0, r1, c0, c1, plan, bufs)
        h = kernel.grad_tile(s, pos, neg, r0, r1, saved, grads, _scratch(bufs, r1 - r0, c1 - c0, 4))
        if c0 == r0:
            return torch.add(h, h.t(), out=bufs.get(r1 - r0, c1 - c0, 8))
        return h.add_(kernel.grad_tile(s.t(), pos.t(), neg.t(), c0, c1, saved, grads, _scratch(bufs, c1 - c0, r1 - r0, 6)).t())

    return grad_tile


def tile_label_bounds(sorted_labels: Tensor, tile: int) -> Tensor:
    """(2 * n_tiles,) the first and last label of every ``tile``-row block of sorted labels.

    A device tensor: the caller reads it on the host together with its other checks
    (one transfer) and passes the pairs, with ``tile`` as their step, as ``label_ranges``
    (:class:`~.problem.LabelRanges`) to :func:`pairwise_rows`.
    """
    n = sorted_labels.shape[0]
    starts = torch.arange(0, n, tile, device=sorted_labels.device)
    ends = (starts + tile).clamp(max=n) - 1
    return torch.stack([sorted_labels[starts], sorted_labels[ends]], 1).reshape(-1)
