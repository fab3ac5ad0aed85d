"""The pair terms' per-tile arithmetic: PML NT-Xent's per-positive-pair terms (``"pair_softplus"``) and NT-BXent's
element-wise binary cross-entropy (``"binary"``), each a class of tile functions -- forward statistics per row, the
gradient tile, and the one kept tile's forms -- that the torch executor (:mod:`.pairwise`) and the lean one tile
(:mod:`.one_tile`) call. Neither is linear in the positive mask, so every tile reads its block of the relation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._tensors import clear_self_diagonal
from .tiling import Buffers, raise_max

__all__ = ["KERNELS"]


class PairKernel:
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



#: Each pair kernel by its name (:class:`~.problem.PairTerms`' ``kernel``).
KERNELS: dict[str, Any] = {"pair_softplus": PairKernel, "binary": _BinaryKernel}
