"""Kernels that need the positive mask inside each tile.

The per-positive-pair NT-Xent of pytorch-metric-learning (``kernel="pair_softplus"``)
and NT-BXent's element-wise binary cross-entropy (``kernel="binary"``) are not linear in
the positive mask, so each tile asks :meth:`~torch_contrastive.positives.Positives.tile`
for its block of the mask. Forward keeps O(N) statistics, backward recomputes each tile
(a single tile -- the small-batch case -- is kept from forward instead).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from .._tensors import as_dtype, clear_self_diagonal
from ..positives import KeyPositives
from . import pair_strips
from .driver import Gradients, Operands, Saved, run
from .precision import Scale, zero
from .problem import Combine, Options, PairTerms, Problem
from .products import AnyProducts, make_products
from .tiling import Buffers, GradTile, gradient_sweep, raise_max, sweep

if TYPE_CHECKING:
    from ..positives import Positives
    from .plans import PairPlan


class _PairKernel:
    """Per-positive-pair NT-Xent (pytorch-metric-learning's convention).

    Pass 1: ``L_i = log sum_{n in N(i)} exp(S_in)`` over the negatives of row i.
    Pass 2: ``out_i = sum_{p in P(i)} softplus(L_i - S_ip)`` (= ``-log(e^S_ip /
    (e^S_ip + sum_n e^S_in))``) and ``w_i = sum_p sigmoid(L_i - S_ip)`` for backward.
    Rows without negatives contribute exactly 0 (and get no gradient).
    """

    passes = 2

    def __init__(self, rows: int, dtype: torch.dtype, device: torch.device, fixed: bool = False) -> None:
        low = torch.finfo(dtype).min
        self.low = low
        # fixed: every |S| is small enough for plain exp (see engine.fixed_scale_applies): the
        # running maximum stays 0 and no tile needs a max or a rescale.
        self.fixed = fixed
        self.neg_max = torch.full((rows,), 0.0 if fixed else low, dtype=dtype, device=device)
        self.neg_sum = torch.zeros(rows, dtype=dtype, device=device)
        self.out = torch.zeros(rows, dtype=dtype, device=device)
        self.weight = torch.zeros(rows, dtype=dtype, device=device)
        self.scratch = Buffers(dtype, device)  # tile temporaries of the float-mask path, reused

    def visit(self, p: int, s: Tensor, pos: Tensor, neg: Tensor, r0: int, r1: int) -> None:
        if p == 0 and self.fixed:
            if neg.dtype == torch.bool:
                self.neg_sum[r0:r1] += torch.where(neg, s.exp(), 0.0).sum(1)
            else:  # 0/1 float masks (fixed mode: finite values)
                self.neg_sum[r0:r1] += torch.exp(s, out=self.scratch.get(*s.shape)).mul_(neg).sum(1)
            return
        if p == 0:
            masked = s.masked_fill(~neg, self.low)
            new_max = raise_max(self.neg_max, self.neg_sum, r0, r1, masked.amax(1))
            self.neg_sum[r0:r1] += torch.where(neg, torch.exp(masked - new_max[:, None]), 0.0).sum(1)
            return
        has_neg = self.neg_sum[r0:r1] > 0
        lse = self.neg_lse_rows(r0, r1)
        diff = lse[:, None] - s
        if pos.dtype == torch.bool:
            term = torch.where(pos, torch.nn.functional.softplus(diff), 0.0).sum(1)
            weight = torch.where(pos, torch.sigmoid(diff), 0.0).sum(1)
        else:
            term = torch.nn.functional.softplus(diff).mul_(pos).sum(1)
            weight = torch.sigmoid(diff, out=self.scratch.get(*s.shape)).mul_(pos).sum(1)
        self.out[r0:r1] += torch.where(has_neg, term, 0.0)
        self.weight[r0:r1] += torch.where(has_neg, weight, 0.0)

    def visit_negatives(self, p: int, s: Tensor, r0: int, r1: int) -> None:
        """A tile without any positive or self pair: every entry is a negative, no mask."""
        if p == 0 and self.fixed:
            self.neg_sum[r0:r1] += s.exp_().sum(1)  # s is a scratch tile buffer
        elif p == 0:
            new_max = raise_max(self.neg_max, self.neg_sum, r0, r1, s.amax(1))
            self.neg_sum[r0:r1] += torch.exp(s - new_max[:, None]).sum(1)
        # pass 1 (the per-positive terms) has nothing to do here

    def visit_negatives_both(self, s: Tensor, r0: int, r1: int, c0: int, c1: int) -> None:
        """Pass 1 of an all-negative tile of a symmetric S (fixed mode): one exp feeds the
        negatives' sums of its row block and, transposed, of its column block."""
        e = s.exp_()
        self.neg_sum[r0:r1] += e.sum(1)
        self.neg_sum[c0:c1] += e.sum(0)

    @staticmethod
    def grad_negatives_both(s: Tensor, r0: int, r1: int, c0: int, c1: int, saved: tuple[Tensor, ...],
                            grads: tuple[Tensor, ...], work: Tensor | None = None) -> Tensor:
        """``H = G + G'^T`` of an all-negative tile of a symmetric S (fixed mode):
        ``e^{S_ij} (c_i + c_j)`` with ``c_i = e^{-L_i} w_i g_i`` (the outer sum into ``work``)."""
        neg_lse, weight, has_neg = saved
        c = weight * grads[0] * has_neg * torch.exp(-neg_lse)
        return s.exp_().mul_(torch.add(c[r0:r1, None], c[None, c0:c1], out=work))

    @staticmethod
    def grad_negatives(s: Tensor, r0: int, r1: int, saved: tuple[Tensor, ...], grads: tuple[Tensor, ...], fixed: bool) -> Tensor:
        """Gradient tile of an all-negative tile: a row-scaled exp, ``e^{S_in - L_i} w_i g_i``
        (fixed: ``e^{S_in}`` times the row factor ``e^{-L_i} w_i g_i``, one exp, in place)."""
        neg_lse, weight, has_neg = (t[r0:r1] for t in saved)
        scale = weight * grads[0][r0:r1] * has_neg
        if fixed:
            return s.exp_().mul_((scale * torch.exp(-neg_lse))[:, None])
        return torch.exp(s - neg_lse[:, None]).mul_(scale[:, None])

    def neg_lse_rows(self, r0: int, r1: int) -> Tensor:
        s = self.neg_sum[r0:r1]
        return torch.where(s > 0, s.log() + self.neg_max[r0:r1], torch.zeros_like(s))

    def outputs(self) -> tuple[Tensor, ...]:
        return (self.out,)

    def saved(self) -> tuple[Tensor, ...]:
        return (self.neg_lse_rows(0, self.neg_sum.shape[0]), self.weight, (self.neg_sum > 0))

    @staticmethod
    def single(s: Tensor, pos: Tensor, neg: Tensor) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """The whole problem as one tile: ``(outputs, kept for single_grad)``.

        ``L_i = -inf`` for a row without negatives makes every one of its terms and
        gradients exactly 0 (``softplus(-inf) = sigmoid(-inf) = 0``), so no row mask is needed.
        """
        neg_lse = torch.logsumexp(s.masked_fill(~neg, float("-inf")), dim=1, keepdim=True)
        diff = neg_lse - s
        out = torch.where(pos, torch.nn.functional.softplus(diff), 0.0).sum(1)
        sig = torch.sigmoid(diff)
        weight = torch.where(pos, sig, 0.0).sum(1, keepdim=True)
        return (out,), (diff, sig, weight, pos, neg)

    @staticmethod
    def single_fixed(s: Tensor, pos: Tensor, self_offset: int | None,
                     summed: bool = False) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """:meth:`single` in fixed mode on the 0/1 float mask of the positives (the self pair, at
        ``self_offset`` as in :func:`~torch_contrastive._tensors.self_diagonal`, is 0 there); every other
        pair is a negative. ``|S| <= 40``, so ``exp(S)`` needs no shift and masks multiply (every value is
        finite). ``N_i = sum_n e^{S_in}``, the negatives' exponentials taken as ``e - e * pos`` with the self
        pair cleared (no negative mask is built). The term is a softplus of ``d = log N_i - S_ip``, which
        keeps its digits when the positive dominates (``log(e^S + N) - S`` would cancel them: a confident
        model's loss), its gradient ``sigmoid(d)`` one op on the same ``d`` (fewer dispatches than
        ``N_i / (e^S + N_i)``, and no slower on a CPU). ``summed``: only the rows' total is read (every row
        weighted 1: PML's mean over pairs), returned as a 0-dim output -- one dot product over the whole tile
        where the rows' sums and their sum are three ops."""
        e = torch.exp(s)
        e_neg = torch.addcmul(e, e, pos, value=-1)  # the negatives' exponentials, kept: backward's negative part
        if self_offset == 0:  # the lean one tile's square: the main diagonal (no helper call: a small call pays it)
            e_neg.diagonal().zero_()
        else:
            clear_self_diagonal(e_neg, self_offset)
        neg_sum = e_neg.sum(1)
        diff = torch.sub(neg_sum.log()[:, None], s)
        terms = torch.nn.functional.softplus(diff)
        out = torch.dot(terms.view(-1), pos.reshape(-1)) if summed else torch.linalg.vecdot(terms, pos)
        # the positives' sigmoids, kept masked (backward reads them only there); 0 on a row without negatives
        sig_pos = torch.sigmoid_(diff).mul_(pos)
        weight = sig_pos.sum(1)
        return (out,), (e_neg, sig_pos, weight, neg_sum)

    @staticmethod
    def single_grad_fixed(kept: tuple[Tensor, ...], grads: tuple[Tensor, ...]) -> Tensor:
        """``G = e^{S_in} w_i g_i / N_i`` on negatives, ``-sigmoid(L_i - S_ip) g_i`` on positives.
        A row without negatives has ``w_i = 0`` (every sigmoid is of -inf): its factor is 0."""
        e_neg, sig_pos, weight, neg_sum = kept
        g = grads[0]
        row = weight * g / neg_sum.clamp_min(torch.finfo(neg_sum.dtype).tiny)
        return torch.mul(e_neg, row[:, None]).addcmul_(sig_pos, g[:, None], value=-1)

    @classmethod
    def single_grad_fixed_both(cls, kept: tuple[Tensor, ...], grads: tuple[Tensor, ...]) -> Tensor:
        """``H = G + G^T`` of one set's symmetric relation (both roles of every pair, one product):
        each row's coefficients differ (``N_i``, ``w_i``), so G is formed and added to its transpose."""
        g = cls.single_grad_fixed(kept, grads)
        return g + g.t()

    @staticmethod
    def single_grad(kept: tuple[Tensor, ...], grads: tuple[Tensor, ...]) -> Tensor:
        diff, sig, weight, pos, neg = kept
        # negatives: exp(S_in - L_i) * w_i; positives: -sigmoid(L_i - S_ip)
        d_neg = torch.where(neg, torch.exp(-diff) * weight, 0.0)
        return torch.where(pos, -sig, d_neg).mul_(grads[0][:, None])

    @staticmethod
    def grad_tile(s: Tensor, pos: Tensor, neg: Tensor, r0: int, r1: int, saved: tuple[Tensor, ...], grads: tuple[Tensor, ...],
                  scratch: tuple[Tensor, Tensor] | None = None) -> Tensor:
        neg_lse, weight, has_neg = (t[r0:r1] for t in saved)
        g = grads[0][r0:r1] * has_neg
        if neg.dtype != torch.bool:
            # float masks come only in fixed mode, where |S| <= 40 and L_i >= -40: every exp is
            # finite, so the masks multiply (no inf * 0); temporaries go to reused buffers
            first, second = scratch if scratch is not None else (None, None)
            d_neg = torch.sub(s, neg_lse[:, None], out=first).exp_().mul_((weight * g)[:, None]).mul_(neg)
            d_pos = torch.sub(neg_lse[:, None], s, out=second).sigmoid_().mul_(g[:, None]).mul_(pos)
            return d_neg.sub_(d_pos)
        # where(), not products with masks: exp() of a positive entry may overflow (inf * 0 is NaN),
        # and bool-to-float mask products cost a copy each.
        d_neg = torch.where(neg, torch.exp(s - neg_lse[:, None]) * weight[:, None], 0.0)
        return torch.where(pos, -torch.sigmoid(neg_lse[:, None] - s), d_neg).mul_(g[:, None])


class _BinaryKernel:
    """NT-BXent: ``out = (sum_pos softplus(-S), sum_neg softplus(S))`` per row.

    Computed with softplus (= -log-sigmoid), never ``log(sigmoid(.))``, so it stays
    exact at tau = 0.01 where the seed's float32 code saturates.
    """

    passes = 1

    def __init__(self, rows: int, dtype: torch.dtype, device: torch.device, fixed: bool = False) -> None:
        self.pos = torch.zeros(rows, dtype=dtype, device=device)
        self.neg = torch.zeros(rows, dtype=dtype, device=device)

    def visit(self, p: int, s: Tensor, pos: Tensor, neg: Tensor, r0: int, r1: int) -> None:
        # Two softplus calls on purpose: softplus(-s) = softplus(s) - s cancels catastrophically
        # for large s (the very regime where the seed's sigmoid-then-log code fails).
        self.pos[r0:r1] += torch.where(pos, torch.nn.functional.softplus(-s), 0.0).sum(1)
        self.neg[r0:r1] += torch.where(neg, torch.nn.functional.softplus(s), 0.0).sum(1)

    def outputs(self) -> tuple[Tensor, ...]:
        return (self.pos, self.neg)

    def saved(self) -> tuple[Tensor, ...]:
        return ()

    def visit_negatives(self, p: int, s: Tensor, r0: int, r1: int) -> None:
        """A tile without any positive or self pair: one softplus per entry, no mask."""
        self.neg[r0:r1] += torch.nn.functional.softplus(s).sum(1)

    @staticmethod
    def grad_negatives(s: Tensor, r0: int, r1: int, saved: tuple[Tensor, ...], grads: tuple[Tensor, ...], fixed: bool) -> Tensor:
        return torch.sigmoid_(s).mul_(grads[1][r0:r1, None])  # s is a scratch tile buffer

    def visit_negatives_both(self, s: Tensor, r0: int, r1: int, c0: int, c1: int) -> None:
        """An all-negative tile of a symmetric S: one softplus per entry feeds both blocks."""
        loss = torch.nn.functional.softplus(s)
        self.neg[r0:r1] += loss.sum(1)
        self.neg[c0:c1] += loss.sum(0)

    @staticmethod
    def grad_negatives_both(s: Tensor, r0: int, r1: int, c0: int, c1: int, saved: tuple[Tensor, ...],
                            grads: tuple[Tensor, ...], work: Tensor | None = None) -> Tensor:
        """``H = sigmoid(S) (g_i + g_j)`` of an all-negative tile of a symmetric S."""
        return torch.sigmoid_(s).mul_(torch.add(grads[1][r0:r1, None], grads[1][None, c0:c1], out=work))

    @staticmethod
    def single(s: Tensor, pos: Tensor, neg: Tensor) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """The whole problem as one tile. Every pair's loss is ``softplus(-z S)`` with
        ``z = +1`` for positives and -1 for negatives: one exact softplus per element."""
        signed = torch.where(pos, -s, s)
        loss = torch.nn.functional.softplus(signed)
        return (torch.where(pos, loss, 0.0).sum(1), torch.where(neg, loss, 0.0).sum(1)), (signed, pos, neg)

    @staticmethod
    def single_fixed(s: Tensor, pos: Tensor, self_offset: int | None) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """:meth:`single` in fixed mode (``|S| <= 40``: every ``exp`` finite) on the 0/1 float mask of the
        positives; every other pair but the self pair (at ``self_offset``, 0 in ``pos``) is a negative. ``s``
        is overwritten. ``z S = S - 2 pos S`` (one op, no negative mask), ``u = e^{z S}`` (at most ``e^40``)
        with the self pair's ``u`` set to 0 (its term ``log1p(0)`` and its sigmoid are then 0), and
        ``softplus(z S) = log1p(u)``, ``sigmoid(z S) = u / (1 + u)`` from the one exponentiated tile (softplus
        and sigmoid take slow paths on a CPU); ``log1p`` keeps a small term's digits (a confident model's
        loss). The negatives' sum is the row's sum less the positives' (no second masked pass): it carries an
        absolute error of a rounding of the row's whole sum ``P_i + N_i``, small beside the row's loss
        ``a_i P_i + b_i N_i`` unless its negatives are weighted far above its positives (``b_i >> a_i``)."""
        u = s.addcmul_(s, pos, value=-2).exp_()
        if self_offset == 0:  # the lean one tile's square: the main diagonal (no helper call: a small call pays it)
            u.diagonal().zero_()
        else:
            clear_self_diagonal(u, self_offset)
        loss = torch.log1p(u)
        sig = u.div_(torch.add(u, 1.0))  # saved for backward; 0 at the self pair
        pos_sum = torch.linalg.vecdot(loss, pos)
        return (pos_sum, loss.sum(1).sub_(pos_sum)), (sig, pos)

    @staticmethod
    def single_grad_fixed(kept: tuple[Tensor, ...], grads: tuple[Tensor, ...]) -> Tensor:
        """``G = sigmoid(z S) (b_i - pos (a + b)_i)`` (``-a_i`` on positives, ``b_i`` on negatives, 0 at the
        self pair, whose sigmoid was kept as 0) for the positive and negative coefficients ``a, b``."""
        sig, pos = kept
        a, b = grads
        return torch.addcmul(b[:, None], pos, (a + b)[:, None], value=-1).mul_(sig)

    @staticmethod
    def single_grad_fixed_both(kept: tuple[Tensor, ...], grads: tuple[Tensor, ...]) -> Tensor:
        """``H = G + G^T`` of one set's symmetric relation (the mask and ``sigmoid(z S)`` symmetric):
        ``sigmoid(z_ij S_ij) ((b_i + b_j) - pos_ij ((a + b)_i + (a + b)_j))``, so no transposed tile is read;
        the self pair's kept sigmoid is 0."""
        sig, pos = kept
        a, b = grads
        both = a + b
        h = torch.add(b[:, None], b[None, :])
        h.addcmul_(pos, torch.add(both[:, None], both[None, :]), value=-1)
        return h.mul_(sig)

    @staticmethod
    def single_grad(kept: tuple[Tensor, ...], grads: tuple[Tensor, ...]) -> Tensor:
        signed, pos, neg = kept
        # d softplus(-z S) / dS = -z sigmoid(-z S); the self pair is neither positive nor negative.
        coef = torch.where(pos, -grads[0][:, None], torch.where(neg, grads[1][:, None], 0.0))
        return torch.sigmoid(signed).mul_(coef)

    @staticmethod
    def grad_tile(s: Tensor, pos: Tensor, neg: Tensor, r0: int, r1: int, saved: tuple[Tensor, ...], grads: tuple[Tensor, ...],
                  scratch: tuple[Tensor, Tensor] | None = None) -> Tensor:
        g_pos, g_neg = grads[0][r0:r1, None], grads[1][r0:r1, None]
        # sigmoid(-s), not 1 - sigmoid(s), which rounds tiny gradients to 0 for large s.
        return torch.where(pos, -torch.sigmoid(-s) * g_pos, torch.where(neg, torch.sigmoid(s) * g_neg, 0.0))



_KERNELS: dict[str, Any] = {"pair_softplus": _PairKernel, "binary": _BinaryKernel}


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
        total (:func:`total_only`): a backend may return it as one 0-dim output (the torch loops' one tile does)."""
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
    if combine[0] is UNIT and kernel is _PairKernel:
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
        kernel_cls = _KERNELS[plan.kernel]
        prod = make_products(plan.half, (ops.a, ops.b), None, a_c, b_c, scale_c, ops.norms, plan.normalize, not plan.single_tile)
        if plan.single_tile:
            # One tile: compute it once and keep what backward needs instead of recomputing it.
            s = prod.logits(0, R, 0, C)
            if plan.fixed:  # finite values: 0/1 float masks multiply, several times cheaper than where
                pos_f = plan.positives.tile_values(0, R, 0, C, a_c.dtype)  # every other pair but the self pair: negative
                # the rows' total summed inside the kernel where only it is read: the lean one tile's arithmetic
                outputs, kept = kernel_cls.single_fixed(s, pos_f, plan.positives.self_offset, True) \
                    if total_only and kernel_cls is _PairKernel else kernel_cls.single_fixed(s, pos_f, plan.positives.self_offset)
            else:
                pos, neg = _masks(plan.positives, 0, R, 0, C)
                outputs, kept = kernel_cls.single(s, pos, neg)
            return outputs, {"kernel": (), "kept": kept}
        if pair_strips.serves(plan):  # NT-BXent's strips on a GPU plan: one signed tile each, backward factored
            return pair_strips.binary_forward(prod, R, C, plan), {"kernel": (), "kept": ()}
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
        kernel = _KERNELS[plan.kernel]
        raw = (*saved.keep["raw"], None, None)  # a single set's candidates are its anchors
        prod = make_products(plan.half, (raw[0], raw[1]), None, a, a if plan.symmetric else b,
                             scale, saved.norms, plan.normalize, not plan.single_tile)
        if kept:
            if ctx.single and plan.fixed and isinstance(plan.positives, KeyPositives):  # a symmetric relation
                return Gradients(prod.row_product(kernel.single_grad_fixed_both(tuple(kept), grads)), None, True)
            g = (kernel.single_grad_fixed if plan.fixed else kernel.single_grad)(tuple(kept), grads)
            if ctx.single:  # one set: both roles of every row in one product, (G + G.T) @ A counts every pair twice
                return Gradients(prod.row_product(g + g.t()), None, True)
            return Gradients(prod.row_product(g), prod.column_product(g))
        if pair_strips.serves(plan):  # a triangle's rows hold H @ A, H = G + G^T: both roles of every pair
            rows, cols = pair_strips.binary_backward(prod, a, b, grads, plan, columns=True)
            return Gradients(rows, cols, plan.symmetric)

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


#: The torch pair executor (the engine's registry, :data:`~.solve.EXECUTORS`).
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


def pairwise_rows(
    anchors: Tensor,
    candidates: Tensor,
    scale: Scale,
    positives: Positives,
    *,
    kernel: str,
    normalize: bool = False,
    eps: float = 1e-12,
    chunk_size: int | None = None,
    label_ranges: tuple[list[tuple[float, float]], list[tuple[float, float]]] | None = None,
    fixed: bool = False,
    bound: float | None = None,
    combine: Combine | None = None,
    backend: str = "auto",
) -> tuple[Tensor, ...]:
    """Per-row statistics that need the positive mask in every tile.

    Args:
        anchors: (R, D); candidates: (C, D) (``anchors`` itself for a single set);
            scale: ``1 / temperature``, float or 0-dim tensor.
        positives: a :class:`~torch_contrastive.positives.Positives` for R x C.
        kernel: ``"pair_softplus"`` (returns ``(sum_p softplus(L_i - S_ip),)``, the
            pytorch-metric-learning NT-Xent numerators) or ``"binary"`` (returns
            ``(sum_pos softplus(-S_ij), sum_neg softplus(S_ij))``, NT-BXent).
        normalize, eps: L2-normalise both inputs inside the function.
        chunk_size: tile edge (see :func:`resolve_tile`).
        label_ranges: for rows and columns sorted by label (a key relation), the (lowest,
            highest) label of every row tile and every column tile (see :func:`tile_label_bounds`).
            A tile whose two ranges do not overlap holds only negatives and takes the fast
            path: no mask, no per-positive work (PML NT-Xent skips it in its second pass).
        fixed: force the bounded mode (every ``|S|`` small enough for plain ``exp``): PML
            NT-Xent then needs no running maximum.
        bound: the caller's promise that every ``|S| <= bound``; the planner picks the bounded
            mode where it is exact (:func:`~torch_contrastive.engine.fixed_scale_applies`).
        combine: ``(weights, total)``: return ``(total * sum_i sum_k weights[k]_i out_k,i,)``
            instead -- a loss's per-row combination and reduction inside the autograd function.
            ``weights`` holds one (R,) tensor (or float) per output, ``total`` a float or 0-dim
            tensor; none of them gets a gradient.
        backend: ``"torch"``, ``"triton"`` (fused pair kernels, :mod:`.triton_backend.pair_terms`:
            positives by ids or a partner; ``label_ranges`` are not needed there) or ``"auto"`` --
            the torch backend until the kernels are measured faster on a GPU.

    Memory: O((R + C) * D) plus a few tile-sized temporaries.
    """
    problem = Problem(anchors, candidates, scale, PairTerms(kernel, label_ranges, combine, fixed), positives=positives,
                      self_offset=positives.self_offset, bound=bound, options=Options(normalize, float(eps), chunk_size, backend))
    from .solve import solve  # the keyword form builds a Problem; solve imports this module

    return solve(problem)


def tile_label_bounds(sorted_labels: Tensor, tile: int) -> Tensor:
    """(2 * n_tiles,) the first and last label of every ``tile``-row block of sorted labels.

    A device tensor: the caller reads it on the host together with its other checks
    (one transfer) and passes the pairs as ``label_ranges`` to :func:`pairwise_rows`.
    """
    n = sorted_labels.shape[0]
    starts = torch.arange(0, n, tile, device=sorted_labels.device)
    ends = (starts + tile).clamp(max=n) - 1
    return torch.stack([sorted_labels[starts], sorted_labels[ends]], 1).reshape(-1)
