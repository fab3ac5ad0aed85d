"""Soft-max terms per row (and per column): log-sum-exp plus the linear positive part.

For ``S = scale * A @ B.T`` (A, B optionally L2-normalised inside) this computes

    ``row_out_i = alpha_i * log sum_{j != self(i)} exp(S_ij) - beta_i * sum_j P_ij S_ij``

and, for two-set losses, the same per column (``log sum_i exp(S_ij)`` and
``sum_i P_ij S_ij``). NT-Xent (pairing rules), SupCon and the image-text loss are all
of this form; the positive part is linear in S, so it costs O(N * D) through
:meth:`~torch_contrastive.positives.Positives.aggregate`, not a tile pass.

Everything happens inside one node of the engine's autograd driver (:mod:`.driver`):
normalisation, logits, the positive part and their backward, so a loss call adds only a
handful of autograd nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from .._tensors import as_dtype
from .confident import coefficient, coefficient_from_sums, margin
from .driver import Gradients, Operands, Saved, run
from .left_out import Direction
from .problem import Problem, Softmax
from .products import AnyProducts, Products, make_products
from .softmax_tiles import backward_fixed, backward_online, forward_fixed, forward_online, single_backward, single_forward

if TYPE_CHECKING:
    from ..positives import Positives
    from .plans import SoftmaxPlan


def weighted_grad(g: Tensor, weight: Tensor | None) -> Tensor:
    return g if weight is None else g * weight


class Statistics(NamedTuple):
    """A backend's forward pass: its products, the row (and column) log-sum-exps and what the
    one kept tile gives besides (its positive sums, the tile itself, the sums to divide by)."""

    prod: AnyProducts
    row_lse: Tensor
    col_lse: Tensor | None
    row_pos: Tensor | None = None
    col_pos: Tensor | None = None
    kept: Tensor | None = None
    sums: tuple[Any, ...] | None = None  # (total, total') to divide by; six entries from single_apart
    logits: Tensor | None = None  # the one logit tile as the GEMM wrote it, for a backward that reads it again


class SoftmaxExecutor:
    """The soft-max terms as an executor of the engine's driver (:mod:`.driver`). This class owns
    the statistic -- weights, positive part, kept-apart margins, the reduction, the coefficients
    of backward -- and a backend supplies its two passes: :meth:`statistics` (the log-sum-exps)
    and :meth:`tile_gradients` (``G @ B`` and ``G.T @ A`` of the soft-max part). The driver's
    extra input is one tuple ``(row_alpha, row_beta, col_alpha, col_beta, total)``, all without gradient."""

    def run(self, problem: Problem, plan: SoftmaxPlan) -> tuple[Tensor, Tensor | None]:
        """Run a :class:`~.problem.Softmax` problem as ``plan`` says: ``(row_out, col_out or None)``."""
        stat = problem.statistic
        if not isinstance(stat, Softmax):
            raise TypeError(f"the soft-max executor runs Softmax problems, got {type(stat).__name__}")
        row_weights, col_weights = stat.row_weights, stat.col_weights
        # the weights and the reduction's coefficients never need a gradient (Problem refuses weights
        # that require one): one plain argument, which the autograd node neither inspects nor answers
        row_out, col_out = run(self, plan, problem.anchors, None if problem.single else problem.candidates, problem.scale,
                               (*row_weights, None if plan.shared_alpha else col_weights[0], col_weights[1], stat.total))
        return row_out, (col_out if plan.columns and stat.total is None else None)

    def statistics(self, plan: SoftmaxPlan, ops: Operands, raw: tuple[Tensor | None, ...]) -> Statistics:
        raise NotImplementedError

    def tile_gradients(self, plan: SoftmaxPlan, saved: Saved, raw: tuple[Tensor | None, ...], row: Direction,
                       col: Direction | None, folded: tuple[Tensor | None, Tensor | None],
                       by_sums: bool) -> tuple[Tensor, Tensor | None]:
        raise NotImplementedError

    def forward(self, ctx: Any, plan: SoftmaxPlan, ops: Operands, extras: tuple[Any, ...]) -> tuple[Any, dict[str, Any]]:
        row_alpha, row_beta, col_alpha, col_beta, total = extras[0]
        a_c, b_c, scale_c = ops.a_c, ops.b_c, ops.scale
        raw = (ops.a, ops.b) if plan.half or plan.operand_dtype is not None else ()
        prod, row_lse, col_lse, row_pos, col_pos, kept, sums, logits = self.statistics(plan, ops, raw)
        if plan.positives is not None and not plan.tile_positives:
            # scale * A, formed once (a small tile's addmm never forms it; half products never do)
            a_s = prod.a_s if isinstance(prod, Products) else a_c * scale_c
            row_pos = (a_s * plan.positives.aggregate(b_c)).sum(1)
            if plan.column_positives:
                col_pos = (b_c * plan.positives.aggregate_transposed(a_s)).sum(1)
        if plan.shared_alpha:
            col_alpha = row_alpha
        given = sums is not None and len(sums) == 6  # (total, total', d, d', excess, excess') of single_apart
        row_out, col_out, row_lse, col_lse, margins = _outputs(plan, row_lse, col_lse, row_pos, col_pos, row_alpha, row_beta,
                                                               col_alpha, col_beta, given)
        if given and sums is not None:
            margins = (sums[4],) if sums[5] is None else (sums[4], sums[5])  # backward's coefficient reads the excesses
            sums = (sums[0], sums[1])
        ctx.apart_sums = given
        ctx.total = total
        ctx.set_materialize_grads(False)  # an output the caller drops (the empty column slot) costs no zeros
        if total is not None:  # the caller's reduction, done here: no autograd nodes after the engine
            row_out = scalar_total(row_out, col_out if col_lse is not None else None, total)
            col_out = None  # no empty placeholder: an autograd output may be None
        ctx.by_sums = sums is not None
        row_stat, col_stat = (row_lse, col_lse) if sums is None else sums  # what backward divides by
        # one tensor (or None) per name: the driver saves them as they are, no tuple to take apart
        margin_row, margin_col = (*margins, None, None)[:2]
        raw_a, raw_b = (*raw, None, None)[:2]
        keep = {"row_stat": row_stat, "col_stat": col_stat, "margin_row": margin_row, "margin_col": margin_col,
                "row_alpha": row_alpha, "row_beta": row_beta, "col_alpha": None if plan.shared_alpha else col_alpha,
                "col_beta": col_beta, "kept": kept, "logits": logits, "raw_a": raw_a, "raw_b": raw_b}
        return (row_out, col_out), keep

    def backward(self, ctx: Any, plan: SoftmaxPlan, saved: Saved, grads: tuple[Tensor | None, ...]) -> Gradients:
        a, b, keep = saved.a, saved.b, saved.keep
        g_row, g_col = grads
        raw: tuple[Tensor | None, ...] = (keep["raw_a"], keep["raw_b"])  # a single set's candidates are its anchors
        kept, margin_row, margin_col = keep["kept"], keep["margin_row"], keep["margin_col"]
        margins = () if margin_row is None else (margin_row,) if margin_col is None else (margin_row, margin_col)
        row_lse, col_lse = keep["row_stat"], keep["col_stat"]
        row_alpha, row_beta, col_alpha, col_beta = keep["row_alpha"], keep["row_beta"], keep["col_alpha"], keep["col_beta"]
        if plan.shared_alpha:
            col_alpha = row_alpha
        g_row, g_col, uniform_row, uniform_col = _incoming(ctx, g_row, g_col, a, b, plan)
        col: Direction | None = None
        g_col_c = None
        if plan.columns and g_col is not None:
            g_col_c = as_dtype(g_col, a.dtype)
            if plan.column_comm is not None:
                # Every rank's tiles touch every column: they all need the full column gradient.
                g_col_c = g_col_c.clone()
                plan.column_comm.all_sum(g_col_c)
            col = (weighted_grad(g_col_c, col_alpha), col_lse)
        u = weighted_grad(g_row, row_alpha)
        # The one tile's sums: every later use reads the soft-max weight u / total, formed once here
        # (the tile gradient's rows, and the positive coefficient -w * excess).
        w_row = u / row_lse if ctx.by_sums else None
        w_col = col[0] / col[1] if ctx.by_sums and col is not None else None
        has_pos = plan.positives is not None
        how = coefficient_from_sums if ctx.apart_sums else coefficient
        c_row = _positive_coefficient(how, u, g_row, uniform_row, row_beta, margins[:1], _alike(row_alpha, row_beta), w_row) \
            if has_pos else None
        c_col = None
        if has_pos and g_col_c is not None and col is not None and plan.column_positives:
            c_col = _positive_coefficient(how, col[0], g_col_c, uniform_col, col_beta, margins[1:2] if c_row is not None else (),
                                          _alike(col_alpha, col_beta), w_col)
        if not plan.symmetric and not ctx.operands_need_grad[1 if not ctx.single else 0]:
            plan = replace(plan, grad_columns=0)
        if plan.symmetric and kept is None:
            col = (u, row_lse)  # a single set's columns are its rows
        folded = (c_row, c_col) if plan.fold_positives else (None, None)
        row: Direction = (u, row_lse) if w_row is None else (w_row, row_lse)
        if w_col is not None and col is not None:
            col = (w_col, col[1])
        gb_acc, ga_acc = self.tile_gradients(plan, saved, raw, row, col, folded, ctx.by_sums)
        if plan.positives is not None and c_row is not None and not plan.fold_positives:
            gb_acc, ga_acc = _positive_gradients(plan.positives, a, b, gb_acc, ga_acc, c_row.expand(a.shape[0]),
                                                 None if c_col is None else c_col.expand(b.shape[0]), plan.symmetric)
        return Gradients(gb_acc, ga_acc, plan.symmetric)


class TorchSoftmax(SoftmaxExecutor):
    """The soft-max terms on torch: one kept tile (:func:`~.softmax_tiles.single_forward`), or
    the bounded / online-maximum tile loops of :mod:`.softmax_tiles`."""

    def statistics(self, plan: SoftmaxPlan, ops: Operands, raw: tuple[Tensor | None, ...]) -> Statistics:
        a_c, b_c = ops.a_c, ops.b_c
        prod = make_products(plan.half, raw, None, a_c, b_c, ops.scale, ops.norms, plan.normalize)
        if plan.single_tile:
            return Statistics(prod, *single_forward(prod, a_c.shape[0], b_c.shape[0], plan))
        return Statistics(prod, *(forward_fixed if plan.fixed else forward_online)(prod, a_c, b_c.shape[0], plan))

    def tile_gradients(self, plan: SoftmaxPlan, saved: Saved, raw: tuple[Tensor | None, ...], row: Direction,
                       col: Direction | None, folded: tuple[Tensor | None, Tensor | None],
                       by_sums: bool) -> tuple[Tensor, Tensor | None]:
        a, b, kept = saved.a, saved.b, saved.keep["kept"]
        prod = make_products(plan.half, raw if plan.half else (), None, a, b, saved.scale, saved.norms, plan.normalize)
        if kept is not None:
            return single_backward(kept, prod, b, row, col, *folded, plan, by_sums)
        return (backward_fixed if plan.fixed else backward_online)(prod, a, b, row, col, plan)


#: The torch soft-max executor (a form of the torch loops: :mod:`.torch_loops`).
TORCH = TorchSoftmax()


def scalar_total(row_out: Tensor, col_out: Tensor | None, total: tuple[Any, Any]) -> Tensor:
    """``c * sum_i row_out_i + c' * sum_j col_out_j``; one sum when both directions share the
    coefficient and the shape (CLIP's mean: three ops instead of five)."""
    if col_out is None:
        # a mean over the rows is one op, not a sum and a multiply
        # (a tensor coefficient is never compared: that would read it on the host)
        mean = isinstance(total[0], float) and total[0] == 1.0 / max(row_out.numel(), 1)
        return row_out.mean() if mean else row_out.sum() * total[0]
    if total[0] is total[1] and isinstance(total[0], float) and total[0] == 1.0 / max(row_out.numel() + col_out.numel(), 1):
        return torch.cat([row_out, col_out]).mean()  # CLIP's mean over both directions: two ops, not three
    if total[0] is total[1] and row_out.shape == col_out.shape:
        return (row_out + col_out).sum() * total[0]
    return row_out.sum() * total[0] + col_out.sum() * total[1]


def _positive_coefficient(how: Any, u: Tensor, g: Tensor, uniform: Tensor | None, beta: Tensor | None,
                          margins: Sequence[Tensor], alike: bool, w: Tensor | None) -> Tensor:
    """The positive part's coefficient ``c = -beta * g`` per row (0-dim when a reduced loss gives
    every row the same, without beta weights); where the positive entries were left out of the
    tiles (``margins``), their exact coefficient ``u exp(-d) + c`` -- which never reads ``c`` when
    the loss weighs both parts alike (so it is not formed)."""
    if margins and alike:
        return how(u, None, margins[0], True, w)
    c = -uniform if uniform is not None and beta is None else -weighted_grad(g, beta)
    return how(u, c, margins[0], False, w) if margins else c


def _outputs(plan: SoftmaxPlan, row_lse: Tensor, col_lse: Tensor | None, row_pos: Tensor | None, col_pos: Tensor | None,
             row_alpha: Tensor | None, row_beta: Tensor | None, col_alpha: Tensor | None, col_beta: Tensor | None,
             given: bool = False) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None, tuple[Tensor, ...]]:
    """``alpha * LSE - beta * pos`` per row (and column), the full log-sum-exps and, when the
    positives were kept apart, the margins ``LSE - pos`` that backward needs."""
    margins: tuple[Tensor, ...] = ()
    if given:  # the one bounded tile computed the margins itself (single_apart): lse hold them
        # (its positive logits are None only for an unweighted plan, whose outputs are the margins)
        row_out = _apart_out(row_lse, row_pos, row_alpha, row_beta)
        col_out = None
        if col_lse is not None:
            col_out = _apart_out(col_lse, col_pos, col_alpha, col_beta)
        return row_out, col_out, row_lse, col_lse, ()
    if plan.apart is not None and row_pos is not None and (col_lse is None or col_pos is not None):
        # the tile passes summed the excess over the positive
        row_out, row_lse, d_row = _apart_terms(row_lse, row_pos, row_alpha, row_beta)
        margins = (d_row,)
        if col_lse is not None and col_pos is not None:
            col_out, col_lse, d_col = _apart_terms(col_lse, col_pos, col_alpha, col_beta)
            margins = (d_row, d_col)
    else:
        row_out = weighted_grad(row_lse, row_alpha)
        if row_pos is not None:
            row_out = row_out - weighted_grad(row_pos, row_beta)
        if col_lse is not None:
            col_out = weighted_grad(col_lse, col_alpha)
            if col_pos is not None:
                col_out = col_out - weighted_grad(col_pos, col_beta)
    if col_lse is None:
        col_out = None
    return row_out, col_out, row_lse, col_lse, margins


def _alike(alpha: Tensor | None, beta: Tensor | None) -> bool:
    """The soft-max and the positive part weigh every row alike (no weights: both 1), so the
    loss is ``alpha * d`` and the positive's coefficient cancels exactly."""
    return alpha is None and beta is None


def _apart_terms(log_excess: Tensor, pos: Tensor, alpha: Tensor | None, beta: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, LSE, d)`` with ``d = LSE - pos`` computed from the excess (confident.py):
    ``out = alpha * d`` when both weights are alike, so a near-zero loss keeps its digits."""
    d = margin(log_excess, pos)
    return _apart_out(d, pos, alpha, beta), pos + d, d


def _apart_out(d: Tensor, pos: Tensor | None, alpha: Tensor | None, beta: Tensor | None) -> Tensor:
    """``alpha * (pos + d) - beta * pos``, as ``alpha * d`` when both weights are the same (then
    ``pos`` may be None: an unweighted plan does not read the positive logits)."""
    if _alike(alpha, beta):
        return d
    if pos is None:
        raise RuntimeError("internal: weighted outputs need the positive logits")
    return weighted_grad(pos + d, alpha) - weighted_grad(pos, beta)


def _incoming(ctx: Any, g_row: Tensor | None, g_col: Tensor | None, a: Tensor, b: Tensor,
              plan: SoftmaxPlan) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The upstream gradients per row and column in the compute dtype, and -- for a loss
    reduced inside (``total``) -- the 0-dim coefficients every row / column shares."""
    if g_row is None:  # only the column terms were used
        g_row = a.new_zeros(() if ctx.total is not None else a.shape[0])
    if g_col is None and plan.columns and ctx.total is None:
        g_col = b.new_zeros(b.shape[0])
    uniform_row = uniform_col = None
    if ctx.total is not None:  # d total / d row_out_i = total[0] (and total[1] per column)
        uniform_row = as_dtype(g_row * ctx.total[0], a.dtype)
        uniform_col = None if not plan.columns else uniform_row if ctx.total[1] is ctx.total[0] \
            else as_dtype(g_row * ctx.total[1], a.dtype)  # one coefficient for both directions (CLIP's mean): one op
        # 0-dim: the fixed single tile divides by its sums, which broadcasts; the rest index rows
        g_row = uniform_row if ctx.by_sums else uniform_row.expand(a.shape[0])
        if uniform_col is not None:
            g_col = uniform_col if ctx.by_sums else uniform_col.expand(b.shape[0])
    return as_dtype(g_row, a.dtype), g_col, uniform_row, uniform_col


def _positive_gradients(pos: Positives, a: Tensor, b: Tensor, gb_acc: Tensor, ga_acc: Tensor | None,
                        c_row: Tensor, c_col: Tensor | None, symmetric: bool) -> tuple[Tensor, Tensor | None]:
    """Add the positive part ``G_ij += P_ij (c_row_i + c_col_j)`` to ``G @ B`` and ``G.T @ A``."""
    gb_acc = gb_acc + c_row[:, None] * pos.aggregate(b)
    if c_col is not None:
        gb_acc = gb_acc + pos.aggregate(c_col[:, None] * b)
    if symmetric:  # the columns are the rows, so both roles land in one accumulator
        return gb_acc + pos.aggregate_transposed(c_row[:, None] * a), None
    if ga_acc is None:  # no candidate needs a gradient
        return gb_acc, None
    ga_acc = ga_acc + pos.aggregate_transposed(c_row[:, None] * a)
    if c_col is not None:
        ga_acc = ga_acc + c_col[:, None] * pos.aggregate_transposed(a)
    return gb_acc, ga_acc
