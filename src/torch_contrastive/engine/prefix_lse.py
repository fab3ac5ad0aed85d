"""Each row's (and column's) log-sum-exp over its negatives, for every prefix of the features, in one pass.

The global contrastive losses (SogCLR, FastCLIP: :mod:`torch_contrastive.losses.global_contrastive`) read a
batch only through ``LSE_i = log sum_{j in N(i)} exp(s * cos(x_i, c_j))`` over each anchor's negatives
``N(i)``; the rest of their step (the moving average, the weights ``g / u``) is per row. So a Matryoshka
form of them needs, per prefix ``p``, the row statistics ``LSE_p(i)`` and their gradient for any incoming
``dL / dLSE_p(i)`` -- which is what :class:`PrefixRowLSE` computes on the prefix engine's band products
(:mod:`.prefixes`): ``D`` products per pair for every prefix, forward and backward, and each prefix's
logits its running sum times its own inverse norms.

Left out of every soft-max: the listed pairs ``(i, leave_out[i, e])`` -- a single set's self pair and an
anchor's positive, or two sets' diagonal. With ``columns`` (two sets, image-text) each candidate's
log-sum-exp over the anchors comes from the same tiles, the pairs left out of both directions.

Two regimes, as the engine's: with fixed scales within :data:`~.prefixes.COLUMN_SCALE_LIMIT` the unit rows
bound every logit by its scale ``s``, so ``exp(s cos - s)`` is summed as it is (one ``exp`` per logit, no
maximum; backward's tile is that exponential times a row and a column factor); otherwise (a learnable scale,
whose value the host does not read, or a larger one) an online maximum per row and column keeps any scale exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .._tensors import save_for_backward
from .prefixes import PerStrip, PrefixPlan, operands, prefix_backward, prefix_products, scaled

if TYPE_CHECKING:
    from ..positives import Exclusion

__all__ = ["PrefixRowLSE", "upper_strip"]

#: The upper triangle saves products only across strips (one strip is the whole square): it cuts the batch into about
#: this many strips (``(S + 1) / (2 S)`` of the square's products), of no fewer than :data:`UPPER_MIN_ROWS` rows. On this
#: project's 2-core CPU (2026-11-28, NT-Xent and SupCon Matryoshka over 768/512/256/128/64, fwd+bwd) 4 to 8 strips ran
#: fastest at 1,024 and 2,048 rows; a GPU session may retune these two numbers.
UPPER_STRIPS = 8
UPPER_MIN_ROWS = 128


def upper_strip(n: int, budget_strip: int, chunk: int | None) -> int:
    """The strip height of one set's upper triangle: the caller's ``chunk``, else about ``n / UPPER_STRIPS`` rows within
    the scratch budget's strip."""
    if chunk is not None:
        return chunk
    return max(1, min(budget_strip, max(UPPER_MIN_ROWS, -(-n // UPPER_STRIPS))))


class PrefixRowLSE(torch.autograd.Function):
    """``(anchors (N, D), candidates (M, D), plan, which, leave_out (N, E), columns, scales (P,) or (N, P), shifts, upper,
    expected)`` -> ``(N, P)`` row log-sum-exps (``(N + M, P)`` with ``columns``: the candidates' after the anchors';
    ``(N, 2 P)`` with ``expected``: each row's soft-max mean of its logits over its negatives after its log-sum-exps,
    a value without a gradient -- iSogCLR's temperature step reads it).

    ``plan`` carries the distinct prefix ends (``plan.cuts``), normalisation, ``eps`` and strip, with scale 1:
    the logits of listed prefix ``p`` are ``scales[p] * cos_p`` over the cut ``plan.cuts[which[p]]`` (a
    prefix listed twice -- or two temperatures of one width -- is two columns of the output). ``scales`` gets
    its gradient when it requires one (a learnable temperature); ``(N, P)`` scales are each anchor row's own (individual
    temperatures: the online maximum, no columns). ``shifts``: the scales as floats when they
    are fixed and within the bounded regime (each prefix's logits summed under the fixed shift ``s_p``), else
    None (an online maximum). ``upper``: one set's symmetric statistic from the upper triangle (a fixed shift; the
    self pair first in ``leave_out``). ``exclude``: an :class:`~torch_contrastive.positives.Exclusion` over the
    candidates (InfoNCE's false negatives; rows only) -- the pairs it marks leave the soft-max too, and a row it
    leaves without a candidate gets ``-inf`` and no gradient. Otherwise every row must keep one candidate at least.

    Memory: O((N + M) D + T M (cuts + 2) + (N + M) P) for strips of ``T`` rows; nothing of size ``N M``.
    """

    @staticmethod
    def forward(ctx: Any, anchors: Tensor, candidates: Tensor | None, plan: PrefixPlan, which: tuple[int, ...],  # type: ignore[override]
                leave_out: Tensor, columns: bool, scales: Tensor, shifts: tuple[float, ...] | None = None,
                upper: bool = False, expected: bool = False, exclude: Exclusion | None = None) -> Tensor:
        # candidates None: the anchors themselves (one set). Dynamo traces no apply that is given one tensor twice.
        ctx.single = candidates is None
        candidates = anchors if candidates is None else candidates
        if plan.scale != 1.0 or (not plan.normalize and shifts is not None):
            raise ValueError("internal: PrefixRowLSE takes its scales per prefix (plan.scale 1), a fixed shift unit rows")
        if upper and (shifts is None or columns or anchors is not candidates):
            raise ValueError("internal: the upper triangle is one set's fixed-shift statistic")
        if (scales.ndim == 2 and (shifts is not None or columns or upper)) or ((expected or exclude) and (columns or upper)):
            raise ValueError("internal: per-row scales take the online maximum, rows only; the soft-max means and an "
                             "exclusion rows only")
        a, c, inv_a, inv_c = operands(anchors, candidates, plan)
        sums = _Sums(a.shape[0], c.shape[0], len(which), a, columns or upper, shifts, scales.detach().to(a.dtype), expected)
        at_cut = _prefixes_at(plan, which)
        for start in range(0, a.shape[0], plan.strip):
            stop = min(start + plan.strip, a.shape[0])
            first = start if upper else 0
            rows, left = _left_out(leave_out, start, stop, first)
            mask = None if exclude is None else exclude.tile(start, stop, 0, c.shape[0])  # rows only: first is 0
            for k, raw in enumerate(prefix_products(a[start:stop], c[first:], plan.cuts)):
                if not at_cut[k]:
                    continue
                cos = scaled(raw, plan, inv_a, None if inv_c is None else inv_c[first:], k, start, stop)
                for p in at_cut[k]:
                    sums.add(cos, p, start, stop, rows, left, upper, mask)
        out = sums.finish(upper)
        save_for_backward(ctx, anchors, *(() if ctx.single else (candidates,)), leave_out, scales, out)
        ctx.plan, ctx.which, ctx.columns, ctx.shifts, ctx.upper, ctx.exclude = plan, which, columns, shifts, upper, exclude
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        anchors, *saved = ctx.saved_tensors
        candidates, leave_out, scales, out = (anchors, *saved) if ctx.single else saved
        plan: PrefixPlan = ctx.plan
        shifts: tuple[float, ...] | None = ctx.shifts
        prefixes = len(ctx.which)
        n, dtype = anchors.shape[0], out.dtype
        out, grad = out[:, :prefixes], grad[:, :prefixes]  # the soft-max means carry no gradient
        s, g = scales.detach().to(dtype), grad.to(dtype)

        def scale(p: int, start: int, stop: int) -> Tensor:
            return s[p] if s.ndim == 1 else s[start:stop, p, None]

        # d L / d logit_ij = g_row(i) softmax_row(i, j) + g_col(j) softmax_col(i, j) = exp(logit_ij) (a_i + b_j),
        # a = g_row exp(-LSE_row), b = g_col exp(-LSE_col) (under a fixed shift: both times exp(s), the tile exp(logit - s))
        # the fixed shift's factors (the online path exponentiates against each LSE itself)
        factor = g if shifts is None else g * torch.exp(torch.tensor(shifts, dtype=dtype, device=out.device) - out)
        upper: bool = ctx.upper
        exclude: Exclusion | None = ctx.exclude
        row_factor, col_factor = factor[:n], (factor[n:] if ctx.columns else None)
        at_cut = _prefixes_at(plan, ctx.which)
        learned = ctx.needs_input_grad[6]
        d_scales = torch.zeros_like(s)
        # a strip's left-out pairs and exclusion mask, built once for all its cuts (a guide's verdict is a product)
        strip = PerStrip(lambda start, stop: (*_left_out(leave_out, start, stop, start if upper else 0),
                                              None if exclude is None else exclude.tile(start, stop, 0, candidates.shape[0])))

        def grad_tile(cos: Tensor, k: int, start: int, stop: int, weight: Tensor) -> Tensor:
            tile: Tensor | None = None
            first = start if upper else 0
            rows, left, mask = strip(start, stop)
            for p in at_cut[k]:
                # the exponentiated logits (less the fixed shift, or each row's LSE on the online path)
                sp = scale(p, start, stop)
                e = cos.mul(sp).sub_(shifts[p] if shifts is not None else out[start:stop, p, None]).exp_()
                if upper:  # entries (i, j) and (j, i) at once: row i's soft-max and row j's; the own block's both there
                    part = e.mul_(torch.add(row_factor[start:stop, p, None], row_factor[None, first:, p]))
                    part[:, : stop - start].mul_(0.5)
                elif col_factor is None:
                    part = e.mul_(row_factor[start:stop, p, None])
                elif shifts is None:  # two different shifts per entry (the row's LSE, the column's): two exps
                    e.mul_(row_factor[start:stop, p, None])
                    part = e.add_(cos.mul(sp).sub_(out[None, n:, p]).exp_().mul_(col_factor[None, :, p]))
                else:
                    part = e.mul_(torch.add(row_factor[start:stop, p, None], col_factor[None, :, p]))
                part[rows, left] = 0.0
                if mask is not None:  # after the factors: a row left without a candidate has an infinite one
                    part.masked_fill_(mask, 0.0)
                if learned and s.ndim == 1:
                    d_scales[p] += (part * cos).sum()
                elif learned:
                    d_scales[start:stop, p] += (part * cos).sum(1)
                tile = part.mul_(sp) if tile is None else tile.add_(part.mul_(sp))
            if tile is None:
                raise RuntimeError("internal: a cut without a prefix")
            return tile

        da, dc = prefix_backward(anchors, candidates, plan, torch.ones((), dtype=dtype, device=out.device), grad_tile, upper)
        if ctx.single:  # both roles of the one set
            return ((da + dc).to(anchors.dtype) if ctx.needs_input_grad[0] else None, None, None, None, None, None,
                    d_scales.to(scales.dtype) if learned else None, None, None, None, None)
        return (da.to(anchors.dtype) if ctx.needs_input_grad[0] else None,
                dc.to(candidates.dtype) if ctx.needs_input_grad[1] else None, None, None, None, None,
                d_scales.to(scales.dtype) if learned else None, None, None, None, None)


def _left_out(leave_out: Tensor, start: int, stop: int, first: int) -> tuple[Tensor, Tensor]:
    """The strip's rows (a column) and their left-out columns within its tile, whose first column is candidate
    ``first``: a pair left of the tile (the upper triangle's strips) points at the row's own column instead, which
    a single set leaves out anyway (``leave_out[:, 0]`` is the row itself there)."""
    rows = torch.arange(stop - start, device=leave_out.device)[:, None]
    if not first:
        return rows, leave_out[start:stop]
    left = leave_out[start:stop] - first
    return rows, torch.where(left < 0, rows + (start - first), left)


def _prefixes_at(plan: PrefixPlan, which: tuple[int, ...]) -> list[list[int]]:
    """The listed prefixes ending at each cut (empty for a cut no prefix ends at)."""
    return [[p for p, k in enumerate(which) if k == cut] for cut in range(len(plan.cuts))]


class _Sums:
    """The rows' (and columns') exp-sums over the strips, per listed prefix: under each prefix's fixed shift,
    or with an online maximum (a column's rescaled when a strip raises it)."""

    def __init__(self, n: int, m: int, prefixes: int, like: Tensor, columns: bool, shifts: tuple[float, ...] | None,
                 scales: Tensor, expected: bool = False) -> None:
        self.shifts, self.scales = shifts, scales
        self.expected = like.new_zeros(n, prefixes) if expected else None
        self.rows = like.new_zeros(n, prefixes)
        self.row_max = like.new_zeros(n, prefixes) if shifts is None else None
        self.cols = like.new_zeros(m, prefixes) if columns else None
        self.col_max = like.new_full((m, prefixes), -torch.inf) if columns and shifts is None else None

    def add(self, cos: Tensor, p: int, start: int, stop: int, rows: Tensor, leave_out: Tensor, upper: bool = False,
            mask: Tensor | None = None) -> None:
        scale = self.scales[p] if self.scales.ndim == 1 else self.scales[start:stop, p, None]
        logits = cos.mul(scale)
        if self.shifts is not None:  # unit rows: every logit <= s, and exp(logit - s) stays a normal number
            e = logits.sub_(self.shifts[p]).exp_()
            e[rows, leave_out] = 0.0
            if mask is not None:
                e.masked_fill_(mask, 0.0)
            self.rows[start:stop, p] = e.sum(1)
            self._mean(e, cos, scale, p, start, stop)
            if self.cols is not None:  # the upper triangle: the columns right of the strip's own block are rows too
                at = stop if upper else 0
                self.cols[at:, p] += e[:, at - (start if upper else 0):].sum(0)
            return
        logits[rows, leave_out] = -torch.inf
        if mask is not None:
            logits.masked_fill_(mask, -torch.inf)
        if self.row_max is None:
            raise RuntimeError("internal: the online path without its maxima")
        if self.cols is not None and self.col_max is not None:  # each column under its own running maximum
            new = torch.maximum(self.col_max[:, p], logits.max(0).values)
            safe = torch.where(torch.isneginf(new), 0.0, new)  # a column with nothing yet adds nothing
            strip = logits.sub(safe[None, :]).exp_().sum(0)
            self.cols[:, p] = self.cols[:, p] * torch.exp(self.col_max[:, p] - safe) + strip
            self.col_max[:, p] = new
        top = logits.max(1).values
        if mask is not None:  # a row whose every candidate is excluded: its sum 0, its log-sum-exp -inf
            top = torch.where(torch.isneginf(top), 0.0, top)
        self.row_max[start:stop, p] = top
        e = logits.sub_(top[:, None]).exp_()
        self.rows[start:stop, p] = e.sum(1)
        self._mean(e, cos, scale, p, start, stop)

    def _mean(self, e: Tensor, cos: Tensor, scale: Tensor, p: int, start: int, stop: int) -> None:
        """Each row's soft-max mean of its logits, ``s sum_j e_j cos_j / sum_j e_j`` (the left-out entries' ``e`` is 0)."""
        if self.expected is not None:
            weighted = (e * cos).sum(1, keepdim=True).mul_(scale).squeeze(1)
            self.expected[start:stop, p] = weighted / self.rows[start:stop, p]

    def finish(self, upper: bool = False) -> Tensor:
        """The log-sum-exps, rows then (with columns) columns; ``upper``: each row's two parts added."""
        shift: Tensor | float = 0.0 if self.shifts is None else torch.tensor(self.shifts, dtype=self.rows.dtype,
                                                                              device=self.rows.device)
        if upper and self.cols is not None:
            return (self.rows + self.cols).log() + shift
        rows = self.rows.log() + (self.row_max if self.row_max is not None else shift)
        if self.expected is not None:
            return torch.cat([rows, self.expected], 1)
        if self.cols is None:
            return rows
        return torch.cat([rows, self.cols.log() + (self.col_max if self.col_max is not None else shift)])
