"""Contrastive losses over every prefix of the features in one pass (Matryoshka representations).

A Matryoshka loss (Kusupati et al. 2022) sums a contrastive loss over prefixes of the embedding --
the first ``d_1 < d_2 < ... <= D`` features, each prefix normalised on its own. Each prefix's dot
products are partial sums of the full one: cut the features into bands at the prefix ends, multiply
band by band, and the running sum *is* the raw dot product of each prefix in turn. The products
then cost ``D`` per pair, not ``sum(d_p)`` (768 against 1,728 for 768/512/256/128/64), and each
prefix's logits are its running sum times its own inverse norms.

:class:`PrefixSoftmax` computes, for row ``i`` of anchors ``A`` against candidates ``C`` and every
prefix ``p`` (here row i's positive is candidate ``i``; :class:`Targets` also takes a partner column or
same-key positives, a single set's self left out, DCL's positives left out, CLIP's normalisation by the
positive pairs and its second direction from the same tiles)::

    loss_p(i) = logsumexp_j(s * A_p(i) . C_p(j)) - s * A_p(i) . C_p(i),   X_p = X[:, :d_p] / max(||X[:, :d_p]||, eps)

and returns ``sum_p w_p * mean_i loss_p(i)``. Rows are taken in strips of ``T``: forward keeps only
each prefix's per-row log-sum-exp; backward recomputes a strip's band products, forms each prefix's
gradient tile, folds the tiles of the prefixes that cover a band (a reverse running sum) and multiplies
once per band -- so backward's products cost ``D`` per pair too. Memory: O((N + M) D + T M P + N P).
:class:`~.prefix_sigmoid.PrefixSigmoid` is SigLIP's sigmoid pairs on the same passes, :class:`~.prefix_pairs.PrefixPairs` the label
conventions scored pair by pair (pytorch-metric-learning's NT-Xent, NT-BXent); :func:`prefix_backward` is
the backward they share (each supplies its gradient tile of a prefix's logits). The soft-max terms also take
a learnable (tensor) scale, whose gradient comes from the same tiles.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from .._tensors import refuse_transforms, save_for_backward

if TYPE_CHECKING:
    from ..positives import Exclusion


@dataclass(frozen=True)
class PrefixPlan:
    """What one call computes.

    Attributes:
        cuts: the distinct prefix ends, ascending (the bands are ``[cuts[k-1], cuts[k])``).
        which: for each prefix (in the caller's order), its index in ``cuts``.
        weights: each prefix's weight.
        scale: the inverse temperature ``s``.
        normalize: each prefix normalised on its own (cosine similarity); False: raw dot products.
        eps: the normalisation floor.
        strip: anchor rows per strip.
        mean: each prefix's loss is the mean over the counted anchors (False: their sum).
        rows: per-row values instead (``reduction="none"``): each anchor's weighted sum over the prefixes
            -- with CLIP's second direction, the mean of anchor ``i``'s and candidate ``i``'s, and by pairs
            times ``N / sum gt`` -- so that their mean is the mean loss.
    """

    cuts: tuple[int, ...]
    which: tuple[int, ...]
    weights: tuple[float, ...]
    scale: float
    normalize: bool
    eps: float
    strip: int
    mean: bool = True
    rows: bool = False


@dataclass(frozen=True)
class Targets:
    """Which candidates are an anchor's positives.

    Attributes:
        partner: (N,) the positive column of each anchor; None with no keys: column ``i`` (two sets,
            InfoNCE / CLIP).
        row_keys: (N,) with ``col_keys`` (M,): the positives of anchor ``i`` are the columns of its key
            (SupCon); an anchor without a positive is left out of the mean. A tuple of keys on each side:
            a column is a positive when any key matches (CLIP's image ids or text ids).
        col_keys: see ``row_keys``.
        exclude_self: a single set (candidates are the anchors): column ``i`` is anchor ``i`` itself,
            left out of the soft-max and of the positives.
        exclude_positive: DCL (one positive per anchor): the positive leaves the soft-max too; an anchor
            left without a candidate contributes 0.
        by_pairs: with keys, every positive pair weighs alike -- ``sum_ij gt_ij (LSE_i - S_ij) / sum gt``,
            CLIP's normalisation with ids -- instead of every anchor alike (SupCon's mean over anchors).
        columns: CLIP's second direction too (two sets of the same rows, a symmetric relation: one
            positive per row on the diagonal, or keys by pairs): each candidate's soft-max over the
            anchors, the loss the mean of both directions.
        sample_mask: (B, M) bool, the SupCon authors' ``mask`` over B samples (possibly asymmetric) spread over
            the M candidates: anchor ``i`` is sample ``i % B`` (view-major rows) and candidate ``j`` is one of
            its positives when ``sample_mask[i % B, j]``; the mean over anchors as with keys.
        offset: the anchors' first row among the candidates (``gather=True``: this rank's rows within the
            gathered batch): anchor ``i`` is candidate ``offset + i`` -- its own row in a single set, its
            positive in two sets without a partner or keys.
        smoothing: CLIP's label smoothing ``eps`` (two sets, nothing left out): per row
            ``((1 - eps) c_i + eps G / N) LSE_i - (1 - eps) sum_pos S_ij - eps G / N^2 sum_j S_ij`` with
            ``c_i`` the row's positives (1 without keys) and ``G`` all of them -- without ids exactly
            ``F.cross_entropy(S, arange(N), label_smoothing=eps)``.
        positive_weight: (N, prefixes) weight of each anchor's positive term per prefix, one positive per
            anchor (NT-Xent's DCLW): ``LSE_i - w_i S_ip``; constants (a weight's own gradient is the caller's).
        population: label smoothing's ``(G, N)`` when the anchors are one rank's share of the loss (``gather``):
            every rank's positive pairs and rows; None: this call's own.
        leave_out: InfoNCE's false negatives (one positive per anchor): ``(first column, end column, exclusion)`` per
            group of candidates (the keys, the pool), each :class:`~torch_contrastive.positives.Exclusion` in its
            group's own columns; the candidates it marks leave the anchor's soft-max (never its positive).
    """

    partner: Tensor | None = None
    row_keys: Tensor | tuple[Tensor, ...] | None = None
    col_keys: Tensor | tuple[Tensor, ...] | None = None
    exclude_self: bool = False
    exclude_positive: bool = False
    by_pairs: bool = False
    columns: bool = False
    smoothing: float = 0.0
    sample_mask: Tensor | None = None
    offset: int = 0
    positive_weight: Tensor | None = None
    population: tuple[Tensor, int] | None = None
    leave_out: tuple[tuple[int, int, Exclusion], ...] = ()

    def strip(self, start: int, stop: int, device: torch.device) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """Rows ``start:stop``: (the positive column of each row, None, None) or (None, the positive mask,
        the positives per row)."""
        if self.sample_mask is not None or (self.row_keys is not None and self.col_keys is not None):
            mask = self._mask(start, stop, device)
            if self.exclude_self:
                mask[torch.arange(stop - start, device=device), torch.arange(start, stop, device=device) + self.offset] = False
            return None, mask, mask.sum(1)
        if self.partner is not None:
            return self.partner[start:stop], None, None
        return torch.arange(start, stop, device=device) + self.offset, None, None

    def _mask(self, start: int, stop: int, device: torch.device) -> Tensor:
        """Rows ``start:stop`` of the positive relation, self pairs included."""
        if self.sample_mask is not None:
            return self.sample_mask[torch.arange(start, stop, device=device) % self.sample_mask.shape[0]]
        rows = self.row_keys if isinstance(self.row_keys, tuple) else (self.row_keys,)
        cols_k = self.col_keys if isinstance(self.col_keys, tuple) else (self.col_keys,)
        mask = cast(Tensor, rows[0])[start:stop, None] == cast(Tensor, cols_k[0])[None, :]
        for r, c in zip(rows[1:], cols_k[1:]):
            mask |= r[start:stop, None] == c[None, :]
        return mask

    def left_out(self, start: int, stop: int, m: int, device: torch.device) -> Tensor | None:
        """Rows ``start:stop``'s (rows, ``m``) bool mask of the candidates :attr:`leave_out` marks, or None."""
        out: Tensor | None = None
        for first, end, exclusion in self.leave_out:
            block = exclusion.tile(start, stop, 0, end - first)
            if block is not None:
                if out is None:
                    out = torch.zeros(stop - start, m, dtype=torch.bool, device=device)
                out[:, first:end] = block  # (a copy: a guide's verdict is a buffer the next tile reuses)
        return out

    def positives(self, n: int, strip: int, device: torch.device) -> Tensor | None:
        """The positives of each of the ``n`` anchors (taken ``strip`` rows at a time), or None when every
        anchor has exactly one (a partner, or column ``offset + i``)."""
        if self.row_keys is None and self.sample_mask is None:
            return None
        return torch.cat([cast(Tensor, self.strip(lo, min(lo + strip, n), device)[2]) for lo in range(0, n, strip)])


def inverse_norms(x: Tensor, cuts: tuple[int, ...] | list[int], eps: float) -> Tensor:
    """(..., len(cuts)): ``1 / max(||x[..., :cut]||, eps)`` for every cut, from band sums of squares (the floor
    ``F.normalize`` takes; autograd-ready for the callers that differentiate through it)."""
    return prefix_dots(x, x, cuts).sqrt().clamp_min(eps).reciprocal()


def prefix_dots(x: Tensor, y: Tensor, cuts: tuple[int, ...] | list[int]) -> Tensor:
    """(..., len(cuts)): the raw dot products ``x[..., :cut] . y[..., :cut]`` of every cut, row by row (``x`` and ``y``
    broadcast), from band sums: ``D`` multiplications per row for all cuts."""
    bands = [(x[..., lo:hi] * y[..., lo:hi]).sum(-1) for lo, hi in zip((0, *cuts[:-1]), cuts)]
    return torch.stack(bands, -1).cumsum(-1)


def prefix_products(a: Tensor, c: Tensor, cuts: tuple[int, ...]) -> Iterator[Tensor]:
    """The raw dot products ``a[:, :cut] @ c[:, :cut].T`` of each cut in turn, as one running sum over
    the bands accumulated in place by the GEMMs: each yielded tile is overwritten by the next band, so
    a caller uses it before asking for the next."""
    running = a.new_zeros(a.shape[0], c.shape[0])
    for lo, hi in zip((0, *cuts[:-1]), cuts):
        running.addmm_(a[:, lo:hi], c[:, lo:hi].T)
        yield running


class PrefixSoftmax(torch.autograd.Function):
    """Soft-max cross-entropy over every prefix (see the module docstring): ``(anchors, candidates, plan, targets)``.

    With ``targets.columns`` (two sets of the same rows, CLIP's both directions) each tile also feeds its
    columns' soft-max: their exp-sums accumulate over the strips under the fixed shift ``s`` (unit rows
    bound every logit by ``s``, so ``exp(S - s)`` neither overflows nor -- for ``s`` within
    :data:`COLUMN_SCALE_LIMIT` -- underflows to nothing), and the loss is the mean of both directions:
    one product pass for the two, forward and backward."""

    @staticmethod
    def forward(ctx: Any, anchors: Tensor, candidates: Tensor | None, plan: PrefixPlan, targets: Targets,  # type: ignore[override]
                scale: Tensor | None = None) -> Tensor:
        # candidates None: the anchors themselves (one set). Dynamo traces no apply that is given one tensor twice.
        ctx.single = candidates is None
        candidates = anchors if candidates is None else candidates
        if scale is not None and (plan.scale != 1.0 or targets.columns):
            raise ValueError("a tensor scale needs plan.scale 1 (the cosines are the engine's logits) and no column pass")
        a, c, inv_a, inv_c = operands(anchors, candidates, plan)
        s = None if scale is None else scale.detach().to(a.dtype)
        n, cuts = a.shape[0], plan.cuts
        lse = a.new_empty(n, len(cuts))
        smooth = _Smoothing.of(targets, a, plan.strip)
        columns = _Columns(c.shape[0], len(cuts), a, linear=smooth is not None) if targets.columns else None
        total = a.new_zeros(())
        per_anchor = a.new_zeros(n) if plan.rows else None
        counted = a.new_zeros(())  # anchors in the mean (those with a positive), or positive pairs
        for start in range(0, n, plan.strip):
            stop = min(start + plan.strip, n)
            cols, mask, count = targets.strip(start, stop, a.device)
            left = targets.left_out(start, stop, c.shape[0], a.device) if targets.leave_out else None
            counted = counted + (stop - start if count is None else count.sum() if targets.by_pairs else (count > 0).sum())
            for k, raw in enumerate(prefix_products(a[start:stop], c, cuts)):
                logits = scaled(raw, plan, inv_a, inv_c, k, start, stop)
                if s is not None:  # a learnable scale: the plan's logits are the cosines
                    logits.mul_(s)
                if left is not None:  # InfoNCE's false negatives leave the soft-max (the mask never holds the positive)
                    logits.masked_fill_(left, -torch.inf)
                per_row, positive = _row_terms(logits, lse, k, start, stop, targets, cols, mask, count)
                if smooth is not None:
                    per_row = smooth.terms(per_row, lse[start:stop, k], logits.sum(1))
                if per_anchor is not None:
                    per_anchor[start:stop] += weight_of(plan, k) * per_row
                else:
                    total = total + weight_of(plan, k) * per_row.sum()
                if columns is not None:
                    columns.add(logits, k, plan.scale, cols, positive, mask, first=k == 0, exclude=targets.exclude_positive)
        col_lse = col_count = a.new_empty(0)
        if columns is not None:
            col_lse, col_count, col_values = columns.finish(plan, targets, smooth)
            if per_anchor is not None:
                per_anchor = 0.5 * (per_anchor + col_values)
            else:
                total = 0.5 * (total + col_values.sum())
        save_for_backward(ctx, anchors, *(() if ctx.single else (candidates,)), lse, counted, col_lse, col_count,
                          *(() if scale is None else (scale,)))
        ctx.plan, ctx.targets, ctx.smooth = plan, targets, smooth
        if per_anchor is not None:  # by pairs (CLIP with ids): N / sum gt, so that the rows' mean is the loss
            value = per_anchor * (n / counted.clamp_min(1)) if targets.by_pairs else per_anchor
        else:
            value = total / counted.clamp_min(1) if plan.mean else total
        return value.to(torch.promote_types(anchors.dtype, torch.float32))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        anchors, *saved = ctx.saved_tensors
        candidates, lse, counted, col_lse, col_count, *given = (anchors, *saved) if ctx.single else saved
        plan: PrefixPlan = ctx.plan
        targets: Targets = ctx.targets
        smooth: _Smoothing | None = ctx.smooth
        device = anchors.device
        dtype = compute_dtype_of(anchors)
        learned = LearnedScale(given, dtype, device)
        strip = PerStrip(lambda start, stop: targets.strip(start, stop, device))
        left = PerStrip(lambda start, stop: targets.left_out(start, stop, candidates.shape[0], device) if targets.leave_out else None)

        def grad_tile(cos: Tensor, k: int, start: int, stop: int, weight: Tensor) -> Tensor:
            w = None if targets.positive_weight is None else targets.positive_weight[start:stop, k]
            tile, col_tile = _softmax_tiles(learned.logits(cos), start, targets, strip(start, stop), lse[start:stop, k],
                                            col_lse[:, k] if targets.columns else None, col_count, smooth, w, left(start, stop))
            if g_rows is not None:  # per-row values: each row's (and column's) own incoming gradient
                tile = _rows_weighted(tile, g_rows, g_cols, start, stop, col_tile)
            elif col_tile is not None:
                tile = tile.add_(col_tile).mul_(0.5)
            return learned.back(tile, cos, weight)

        g, g_rows, g_cols = _incoming(grad.to(dtype), plan, targets, counted.to(dtype), anchors.shape[0])
        da, dc = prefix_backward(anchors, candidates, plan, g, grad_tile)
        if ctx.single:  # both roles of the one set
            return ((da + dc).to(anchors.dtype) if ctx.needs_input_grad[0] else None, None, None, None,
                    learned.grad.to(given[0]) if given and ctx.needs_input_grad[4] else None)
        return (da.to(anchors.dtype) if ctx.needs_input_grad[0] else None,
                dc.to(candidates.dtype) if ctx.needs_input_grad[1] else None, None, None,
                learned.grad.to(given[0]) if given and ctx.needs_input_grad[4] else None)


def _softmax_tiles(logits: Tensor, start: int, targets: Targets, strip: tuple[Tensor | None, Tensor | None, Tensor | None],
                   row_lse: Tensor, col_lse: Tensor | None, col_count: Tensor, smooth: _Smoothing | None,
                   positive_weight: Tensor | None = None, left: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """A strip's gradient tiles of one prefix from its ``logits``: the rows' (soft-max minus the positive part,
    weighted by ``positive_weight``, the strip's rows' weights of this prefix) and, with CLIP's columns, the
    columns'. The left-out entries are set to ``-inf`` for the soft-max and put back after (the products read
    the logits again: they must stay finite, a DCL positive its value)."""
    cols, mask, count = strip
    rows = torch.arange(logits.shape[0], device=logits.device)
    apart = targets.exclude_positive and (mask is None or count is None)
    own = rows + (start + targets.offset)
    if targets.exclude_self:
        logits[rows, own] = -torch.inf
    positive = logits[rows, cols] if apart else None  # type: ignore[index]
    if apart:
        logits[rows, cols] = -torch.inf  # type: ignore[index]
    # DCL by keys: the positives leave both soft-maxes (a copy; the logits stay as they are)
    soft = logits.masked_fill(mask, -torch.inf) if targets.exclude_positive and mask is not None else logits
    if left is not None:  # InfoNCE's false negatives (a copy; never the positive, which the mask leaves in)
        soft = soft.masked_fill(left, -torch.inf)
    tile = soft.sub(row_lse[:, None]).exp_()
    col_tile = None if col_lse is None else soft.sub(col_lse[None, :]).exp_()
    row_soft = None if smooth is None else tile.clone()  # the soft-maxes as they are, for the smoothed coefficient
    col_soft = None if smooth is None or col_tile is None else col_tile.clone()
    if targets.exclude_self:
        logits[rows, own] = 0.0  # its tile entry is 0: keep the products that read it finite
    if positive is not None:
        logits[rows, cols] = positive  # type: ignore[index]  # its tile entry (-1) reads the logit back
    _positive_part(tile, rows, cols, mask, count, targets, row_lse, positive_weight)
    if smooth is not None and row_soft is not None:
        smooth.tile(tile, row_soft)
    if col_tile is not None and col_lse is not None:
        _column_positive_part(col_tile, rows, cols, mask, targets, col_lse, col_count)
        if smooth is not None and col_soft is not None:
            smooth.tile(col_tile, col_soft)
    return tile, col_tile


def _incoming(grad: Tensor, plan: PrefixPlan, targets: Targets, counted: Tensor,
              n: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The soft-max terms' incoming gradient: ``(g for every tile, per-row g, per-column g)``. A loss: its
    gradient over the counted anchors (or as it is for a sum). Per-row values: each row's own (times
    ``N / sum gt`` by pairs; halved per direction with CLIP's columns), every tile's g then 1."""
    if not plan.rows:
        return (grad / counted.clamp_min(1) if plan.mean else grad), None, None
    g_rows = grad * (n / counted.clamp_min(1)) if targets.by_pairs else grad
    g_cols = None
    if targets.columns:
        g_rows, g_cols = 0.5 * g_rows, 0.5 * g_rows
    return torch.ones((), dtype=grad.dtype, device=grad.device), g_rows, g_cols


def _rows_weighted(tile: Tensor, g_rows: Tensor, g_cols: Tensor | None, start: int, stop: int, col_tile: Tensor | None) -> Tensor:
    """A strip's gradient tile of per-row values: row ``i`` times its incoming gradient and, with the second
    direction, column ``j``'s part times column ``j``'s."""
    tile.mul_(g_rows[start:stop, None])
    if col_tile is not None and g_cols is not None:
        tile.add_(col_tile.mul_(g_cols[None, :]))
    return tile


#: The largest scale for which :class:`PrefixSoftmax` folds CLIP's column direction into the row pass (its
#: fixed shift: ``exp(S - s) >= exp(-2 s)`` stays a normal number), per compute dtype.
COLUMN_SCALE_LIMIT = {torch.float32: 40.0, torch.float64: 340.0}


def _row_terms(logits: Tensor, lse: Tensor, k: int, start: int, stop: int, targets: Targets, cols: Tensor | None,
               mask: Tensor | None, count: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Each row's term of one prefix (its log-sum-exp written into ``lse``) and, for one positive per row,
    the positives' logits. The left-out entries (self, DCL's positive) are left at ``-inf`` in ``logits``."""
    rows = torch.arange(stop - start, device=logits.device)
    if targets.exclude_self:
        logits[rows, rows + (start + targets.offset)] = -torch.inf
    if mask is None or count is None:
        positive = logits[rows, cols]  # type: ignore[index]  # a copy: DCL then leaves the entry out
        if targets.exclude_positive:
            logits[rows, cols] = -torch.inf  # type: ignore[index]
        lse[start:stop, k] = torch.logsumexp(logits, 1)
        weight = None if targets.positive_weight is None else targets.positive_weight[start:stop, k]
        per_row = lse[start:stop, k] - (positive if weight is None else weight * positive)
        if targets.exclude_positive:  # an anchor without a candidate left: 0
            per_row = torch.where(torch.isneginf(lse[start:stop, k]), 0.0, per_row)
        return per_row, positive
    if targets.by_pairs:  # |P(i)| LSE_i - sum of the positives' logits
        positive = torch.where(mask, logits, 0.0).sum(1)
        if not targets.exclude_positive:
            lse[start:stop, k] = torch.logsumexp(logits, 1)
            return count * lse[start:stop, k] - positive, None
        # DCL: every positive leaves the soft-max (a copy: the column pass reads the tile as it is)
        lse[start:stop, k] = torch.logsumexp(logits.masked_fill(mask, -torch.inf), 1)
        return torch.where(torch.isneginf(lse[start:stop, k]), 0.0, count * lse[start:stop, k] - positive), None
    lse[start:stop, k] = torch.logsumexp(logits, 1)
    # the mean of the positives' logits; an anchor without one is left out
    positive = torch.where(mask, logits, 0.0).sum(1) / count.clamp_min(1)
    return torch.where(count > 0, lse[start:stop, k] - positive, 0.0), None


def _positive_part(tile: Tensor, rows: Tensor, cols: Tensor | None, mask: Tensor | None, count: Tensor | None,
                   targets: Targets, row_lse: Tensor, weight: Tensor | None = None) -> None:
    """The row direction's gradient tile from its soft-max ``tile``, in place: minus the positive part (times
    each row's ``weight`` of its one positive)."""
    if mask is None or count is None:
        tile[rows, cols] -= 1.0 if weight is None else weight  # type: ignore[index]
        if targets.exclude_positive:  # an anchor left without a candidate contributed 0: no gradient (its tile is inf / NaN)
            tile.masked_fill_(torch.isneginf(row_lse)[:, None], 0.0)
    elif targets.by_pairs:
        tile.mul_(count[:, None].to(tile.dtype)).sub_(mask.to(tile.dtype))
        if targets.exclude_positive:  # an anchor left without a candidate contributed 0
            tile.masked_fill_(torch.isneginf(row_lse)[:, None], 0.0)
    else:
        tile.sub_(mask * count.clamp_min(1).to(tile.dtype).reciprocal()[:, None])  # 1 / |P| in the tile's dtype
        tile.masked_fill_((count == 0)[:, None], 0.0)


def _column_positive_part(tile: Tensor, rows: Tensor, cols: Tensor | None, mask: Tensor | None, targets: Targets,
                          col_lse: Tensor, col_count: Tensor) -> None:
    """The column direction's gradient tile from its soft-max ``tile`` (``exp(S_ij - LSE'_j)``), in place."""
    if mask is None:
        tile[rows, cols] -= 1.0  # type: ignore[index]  # column p(i)'s positive is row i
    else:  # by pairs: |P'(j)| softmax - P
        tile.mul_(col_count[None, :].to(tile.dtype)).sub_(mask.to(tile.dtype))
    if targets.exclude_positive:  # a column left without a candidate contributed 0
        tile.masked_fill_(torch.isneginf(col_lse)[None, :], 0.0)


class _Columns:
    """CLIP's column direction gathered over the strips of one pass: per column and prefix the exp-sum under
    the fixed shift, the positives' logits and (by pairs) the positives per column."""

    def __init__(self, m: int, prefixes: int, like: Tensor, *, linear: bool = False) -> None:
        self.sums = like.new_zeros(m, prefixes)
        self.positive = like.new_zeros(m, prefixes)
        self.count = like.new_zeros(m)
        # sum_i S_ij per column and prefix: label smoothing's uniform part
        self.linear = like.new_zeros(m, prefixes) if linear else None

    def add(self, logits: Tensor, k: int, scale: float, cols: Tensor | None, positive: Tensor | None,
            mask: Tensor | None, first: bool, exclude: bool = False) -> None:
        e = torch.exp(logits - scale)  # left-out entries are -inf: 0
        if mask is not None and exclude:  # DCL by keys: the positives leave the columns' soft-max too
            e.masked_fill_(mask, 0.0)
        self.sums[:, k] += e.sum(0)
        if self.linear is not None:
            self.linear[:, k] += logits.sum(0)
        if mask is None:
            if cols is None or positive is None:
                raise RuntimeError("internal: a partner relation without its positives")
            self.positive[:, k].index_add_(0, cols, positive)
        else:
            self.positive[:, k] += torch.where(mask, logits, 0.0).sum(0)
            if first:
                self.count += mask.sum(0).to(self.count.dtype)

    def finish(self, plan: PrefixPlan, targets: Targets, smooth: _Smoothing | None) -> tuple[Tensor, Tensor, Tensor]:
        """``(LSE' per column and prefix, positives per column, each column's term summed over the prefixes)``."""
        col_lse = self.sums.log() + plan.scale
        per_col = (self.count[:, None] * col_lse if targets.by_pairs else col_lse) - self.positive
        if smooth is not None and self.linear is not None:
            per_col = smooth.terms(per_col, col_lse, self.linear)
        if targets.exclude_positive:  # a column left without a candidate: 0
            per_col = torch.where(torch.isneginf(col_lse), 0.0, per_col)
        weights = torch.tensor([weight_of(plan, k) for k in range(len(plan.cuts))], dtype=per_col.dtype, device=per_col.device)
        return col_lse, self.count, per_col @ weights


class _Smoothing:
    """CLIP's label smoothing on the soft-max terms (:attr:`Targets.smoothing`): ``eps``, the positives of the
    whole problem ``G`` (N without keys) and the rows ``N``, so that a row's term is
    ``(1 - eps) term + eps G / N LSE - eps G / N^2 sum_j S_ij`` and its gradient tile
    ``(1 - eps) tile + eps G / N softmax - eps G / N^2``."""

    def __init__(self, eps: float, positives: Tensor, n: int) -> None:
        self.eps, self.lse_weight, self.linear_weight = eps, eps * positives / n, eps * positives / (n * n)

    @staticmethod
    def of(targets: Targets, a: Tensor, strip: int) -> _Smoothing | None:
        if not targets.smoothing:
            return None
        if targets.exclude_self or targets.exclude_positive or targets.leave_out:
            raise ValueError("label smoothing leaves nothing out of the soft-max (not with DCL, false negatives or a single set)")
        if targets.population is not None:  # one rank's share of a gathered loss: every rank's G and N
            return _Smoothing(targets.smoothing, targets.population[0].to(a.dtype), targets.population[1])
        n = a.shape[0]
        counts = targets.positives(n, strip, a.device)  # G: every positive pair, counted before the strips
        return _Smoothing(targets.smoothing, a.new_tensor(float(n)) if counts is None else counts.sum().to(a.dtype), n)

    def terms(self, term: Tensor, lse: Tensor, linear: Tensor) -> Tensor:
        """A row's (or column's) smoothed term from its plain one, its log-sum-exp and ``sum_j S_ij``."""
        return (1.0 - self.eps) * term + self.lse_weight * lse - self.linear_weight * linear

    def tile(self, tile: Tensor, softmax: Tensor) -> None:
        """The smoothed gradient tile from the plain one and the soft-max, in place."""
        tile.mul_(1.0 - self.eps).add_(softmax * self.lse_weight).sub_(self.linear_weight)


def prefix_backward(anchors: Tensor, candidates: Tensor, plan: PrefixPlan, g: Tensor,
                    grad_tile: Callable[[Tensor, int, int, int, Tensor], Tensor], upper: bool = False) -> tuple[Tensor, Tensor]:
    """The gradients of both inputs of a prefix statistic: each strip's band products recomputed, each
    prefix's logits (``s * raw * inv_a * inv_c``) handed to ``grad_tile(logits, prefix, start, stop, w g)``,
    which returns d value / d logits (it may write the logits, which must stay finite), then the
    normalisation's chain rule and the band fold, one product per band.

    ``upper``: one set (the anchors are the candidates) whose statistic is symmetric: strip ``start:stop`` meets
    the candidates from ``start`` on only (its tiles are ``(stop - start, M - start)``), and ``grad_tile`` returns
    the gradient of both entries ``(i, j)`` and ``(j, i)`` at ``(i, j)``, the strip's own square block halved (both
    of its entries are there): the products then cost half the square."""
    a, c, inv_a, inv_c = operands(anchors, candidates, plan)
    n, cuts = a.shape[0], plan.cuts
    da, dc = torch.zeros_like(a), torch.zeros_like(c)
    # d loss / d (inverse norm) of each row and cut, for the normalisation's chain rule at the end
    d_inv_a = a.new_zeros(n, len(cuts)) if plan.normalize else None
    d_inv_c = c.new_zeros(c.shape[0], len(cuts)) if plan.normalize else None
    bounds = list(zip((0, *cuts[:-1]), cuts))
    for start in range(0, n, plan.strip):
        stop = min(start + plan.strip, n)
        first = start if upper else 0  # the strip's first candidate
        cs, inv_cs = c[first:], (None if inv_c is None else inv_c[first:])
        d_raw = []
        for k, raw in enumerate(prefix_products(a[start:stop], cs, cuts)):
            weight = float(weight_of(plan, k)) * g
            coeff = weight * plan.scale  # d loss / d (raw * inverse norms), per tile entry
            logits = scaled(raw, plan, inv_a, inv_cs, k, start, stop)
            tile = grad_tile(logits, k, start, stop, weight)
            if inv_a is not None and inv_cs is not None and d_inv_a is not None and d_inv_c is not None:
                # d / d inv_a[i] = sum_j tile * s * raw * inv_c = sum_j tile * logits / inv_a[i] (and so for columns)
                weighted = logits.mul_(tile)  # the logits are spent: their buffer takes the product
                d_inv_a[start:stop, k] += weighted.sum(1) * coeff / (plan.scale * inv_a[start:stop, k])
                d_inv_c[first:, k] += weighted.sum(0) * coeff / (plan.scale * inv_cs[:, k])
                tile.mul_((coeff * inv_a[start:stop, k])[:, None]).mul_(inv_cs[None, :, k])
            else:
                tile.mul_(coeff)
            d_raw.append(tile)
        # band k is in every prefix from cut k on: fold those tiles from the widest down, one product per band
        folded = d_raw[-1]
        for k in range(len(cuts) - 1, -1, -1):
            if k < len(cuts) - 1:
                folded.add_(d_raw[k])
            lo, hi = bounds[k]
            da[start:stop, lo:hi].addmm_(folded, cs[:, lo:hi])
            dc[first:, lo:hi].addmm_(folded.T, a[start:stop, lo:hi])
    if inv_a is not None and inv_c is not None and d_inv_a is not None and d_inv_c is not None:
        _norm_chain(da, a, inv_a, d_inv_a, bounds, plan.eps)
        _norm_chain(dc, c, inv_c, d_inv_c, bounds, plan.eps)
    return da, dc


class LearnedScale:
    """A learnable (0-dim tensor) scale ``s`` that multiplies the cosines (the plan's scale is then 1) in a backward:
    a tile's logits from its cosines, and the chain rule back through them, ``d loss / d s`` summed over the tiles.
    Without ``s`` (``given`` empty) both are the identity."""

    def __init__(self, given: list[Tensor], dtype: torch.dtype, device: torch.device) -> None:
        self.s = given[0].to(dtype) if given else None
        self.grad = torch.zeros((), dtype=dtype, device=device)

    def logits(self, cos: Tensor) -> Tensor:
        return cos if self.s is None else cos * self.s

    def back(self, tile: Tensor, cos: Tensor, weight: Tensor) -> Tensor:
        """``d loss / d cos`` from ``d loss / d logits`` (``tile``, in place), adding its share of ``d loss / d s``."""
        if self.s is None:
            return tile
        self.grad = self.grad + weight * (tile * cos).sum()  # d loss / d s = sum dL/dS * cos
        return tile.mul_(self.s)


class PerStrip:
    """``build(start, stop)`` of the strip a backward is visiting, built once for all its prefixes (the prefixes of a
    strip come one after another)."""

    def __init__(self, build: Callable[[int, int], Any]) -> None:
        self.build, self.start, self.value = build, -1, None

    def __call__(self, start: int, stop: int) -> Any:
        if start != self.start:
            self.start, self.value = start, self.build(start, stop)
        return self.value


def compute_dtype_of(x: Tensor) -> torch.dtype:
    """Half inputs compute in fp32; fp32 and fp64 in their own precision."""
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def operands(anchors: Tensor, candidates: Tensor, plan: PrefixPlan) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Both inputs in the compute dtype and, when the plan normalises, their inverse norms at every cut."""
    a, c = anchors.to(compute_dtype_of(anchors)), candidates.to(compute_dtype_of(candidates))
    if not plan.normalize:
        return a, c, None, None
    return a, c, inverse_norms(a, plan.cuts, plan.eps), inverse_norms(c, plan.cuts, plan.eps)


def weight_of(plan: PrefixPlan, cut: int) -> float:
    """The summed weight of the prefixes ending at ``cut`` (a prefix listed twice counts twice)."""
    return sum(w for w, k in zip(plan.weights, plan.which) if k == cut)


def scaled(raw: Tensor, plan: PrefixPlan, inv_a: Tensor | None, inv_c: Tensor | None, k: int, start: int, stop: int) -> Tensor:
    """A new tile: the prefix's logits ``s * raw * inv_a[i] * inv_c[j]`` (raw is the running sum, kept)."""
    if inv_a is None or inv_c is None:
        return raw * plan.scale
    return torch.mul(raw, inv_c[None, :, k]).mul_((plan.scale * inv_a[start:stop, k])[:, None])


def _norm_chain(dx: Tensor, x: Tensor, inv: Tensor, d_inv: Tensor, bounds: list[tuple[int, int]], eps: float) -> None:
    """Add the inverse norms' gradient: ``d(1 / ||x_p||) / dx_p = -x_p / ||x_p||^3`` below the floor's
    reach (a floored norm is a constant), summed over the prefixes that cover each band."""
    live = inv < 1.0 / eps  # the floor max(||x||, eps) took the norm itself
    coeff = torch.where(live, -d_inv * inv.pow(3), torch.zeros_like(inv))  # (rows, cuts)
    covering = coeff.flip(1).cumsum(1).flip(1)  # band k: the prefixes from cut k on
    for k, (lo, hi) in enumerate(bounds):
        dx[:, lo:hi] += covering[:, k, None] * x[:, lo:hi]


def prefix_plan(dims: list[int], weights: list[float], width: int, scale: float, normalize: bool, eps: float,
                rows: int, cols: int, strip: int | None, mean: bool = True, per_row: bool = False) -> PrefixPlan:
    """The plan of one call: the distinct prefix ends and each prefix's place among them, and the strip
    height (``strip``, or as many rows as keep one strip's tiles -- a running sum, a tile per prefix --
    near 64 MiB); ``mean`` / ``per_row``: see :class:`PrefixPlan` (``mean`` and ``rows``)."""
    refuse_transforms()
    cuts = tuple(sorted(set(dims)))
    if cuts[-1] > width:
        raise ValueError(f"matryoshka_dims cannot exceed the embedding size {width}, got {cuts[-1]}")
    if strip is None:
        row_bytes = max(1, cols * 4 * (len(cuts) + 2))
        strip = int(max(1, min(rows, (64 << 20) // row_bytes)))
    return PrefixPlan(cuts, tuple(cuts.index(d) for d in dims), tuple(float(w) for w in weights), float(scale), normalize,
                      float(eps), strip, mean, per_row)
