"""The global contrastive losses over every prefix of the embedding in one pass (Matryoshka: Kusupati et al. 2022).

A global contrastive loss keeps one normaliser ``u_i`` per sample for the embedding it is given, so a
Matryoshka model keeps one :class:`~.global_contrastive.GlobalContrastiveLoss` per prefix
(``tc.matryoshka_loss([GlobalContrastiveLoss(n) for _ in dims], [a, b], dims, index=index)``). Each
module reads the batch only through its rows' log-sum-exps over their negatives -- SogCLR's ``g_i``, FastCLIP's
``g^I_i`` and ``g^T_i`` -- and everything else of its step is per row. Those log-sum-exps of every prefix come
here from one pass over the feature bands (:class:`~torch_contrastive.engine.prefix_lse.PrefixRowLSE`): ``D``
products per pair instead of ``sum(d_p)``, both directions of the bimodal loss from the same tiles; then each
module takes its step on its own prefix with its rows handed in, its state and temperature its own. Individual
temperatures (iSogCLR) scale each anchor row by its sample's own ``1 / tau`` and also read each row's soft-max mean
of its logits, which the same pass gives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..distributed import is_active, make_scope
from ..engine.keywords import prefix_pass
from ..engine.prefixes import COLUMN_SCALE_LIMIT
from .global_contrastive import GlobalContrastiveLoss, RowStats
from .prefix_calls import shrink

__all__ = ["global_one_pass"]

#: The module options the one pass honours as the per-prefix calls do (the rows are normalised per prefix either way).
_ONE_PASS_BACKENDS = ("auto", "torch")


def _covered(losses: Sequence[Callable[..., Any]], tensors: list[Tensor], kwargs: dict[str, Any]) -> list[GlobalContrastiveLoss] | None:
    """The modules when the one pass computes exactly what their per-prefix calls would; None otherwise."""
    if len(tensors) != 2 or set(kwargs) != {"index"} or not losses:
        return None
    # the library's own module (a subclass may change its step), one mode and one kind of temperature
    modules = [m for m in losses if type(m) is GlobalContrastiveLoss]
    if len(modules) != len(losses) or len({(m.mode, m.temperature_mode) for m in modules}) != 1:
        return None
    first = modules[0].options
    if any(m.options["backend"] not in _ONE_PASS_BACKENDS or m.options["gather"] != first["gather"]
           or m.options["grad_reduction"] != first["grad_reduction"] for m in modules):
        return None
    a, b = tensors
    if a.ndim != 2 or b.shape != a.shape or a.shape[0] < 2 or b.device != a.device:
        return None  # let the modules say what is wrong
    return modules


class _Pass:
    """What one pass computes for every module: the prefixes, the scales (per prefix, or per anchor row and prefix
    with individual temperatures), the fixed shifts where they apply, the strip."""

    def __init__(self, modules: list[GlobalContrastiveLoss], a: Tensor, index: Tensor, dims: list[int]) -> None:
        self.width = a.shape[1]
        self.cuts = sorted(set(dims))
        self.which = tuple(self.cuts.index(d) for d in dims)
        dtype = a.dtype if a.dtype in (torch.float32, torch.float64) else torch.float32
        self.strip = modules[0].options["chunk_size"]
        self.individual = modules[0].temperature_mode == "individual"
        self.shifts: tuple[float, ...] | None = None
        self.scales: Tensor | None = None
        if self.individual:  # each sample's own 1 / tau per prefix, read as each module's step reads its state
            at = modules[0]._checked_index(index, a).to(modules[0].tau_state.device)
            taus = torch.stack([m.tau_state.index_select(0, at).to(a.device, dtype) for m in modules], 1)  # (B, P, 2)
            self.row_scales = (1.0 / taus[:, :, 0], 1.0 / taus[:, :, 1])
            return
        # a learnable one (temperature_mode="global") with its gradient
        self.scales = torch.stack([(1.0 / m.tau).to(dtype) if m.temperature_mode == "global"
                                   else torch.tensor(1.0 / m.fixed_temperature, dtype=dtype, device=a.device) for m in modules])
        # fixed temperatures within the bounded regime: each prefix's logits summed under its fixed shift (no maximum)
        fixed = tuple(1.0 / m.fixed_temperature for m in modules)
        if modules[0].temperature_mode == "fixed" and max(fixed) <= COLUMN_SCALE_LIMIT[dtype]:
            self.shifts = fixed

    def rows(self, anchors: Tensor, candidates: Tensor, leave_out: Tensor, scales: Tensor | None = None,
             upper: bool = False, columns: bool = False) -> tuple[Tensor, Tensor | None]:
        """``(log-sum-exps, soft-max means or None)`` of ``anchors``' rows (``scales``: their own, individual; ``columns``:
        the candidates' log-sum-exps after the rows', from the same tiles)."""
        ones = [1.0] * len(self.cuts)
        if scales is None and self.scales is not None:
            return prefix_pass("row_lse", anchors, candidates, self.cuts, ones, 1.0, self.which, leave_out, columns,
                               self.scales, self.shifts, upper, chunk_size=self.strip, upper=upper), None
        if scales is None:
            raise RuntimeError("internal: individual temperatures without their rows' scales")
        out = prefix_pass("row_lse", anchors, candidates, self.cuts, ones, 1.0, self.which, leave_out, False, scales, None,
                          False, True, chunk_size=self.strip, upper=upper)
        return out[:, : len(self.which)], out[:, len(self.which):].detach()


def global_one_pass(losses: Sequence[Callable[..., Any]], tensors: list[Tensor], kwargs: dict[str, Any], dims: list[int],
                    weights: list[float]) -> Tensor | None:
    """``sum_p w_p * losses[p](a[:, :d_p] normalised, b[:, :d_p] normalised, index)`` with every prefix's
    log-sum-exps from one pass, or None where the one pass does not apply (a kernel backend, modules that differ in
    mode, kind of temperature, ``gather`` or ``grad_reduction``, other losses): the caller then calls each loss on its
    prefix. Under ``gather=True`` among several ranks this rank's rows meet every rank's, gathered once."""
    modules = _covered(losses, tensors, kwargs)
    if modules is None:
        return None
    a, b = tensors[0], tensors[1].to(tensors[0].dtype)
    index = kwargs["index"]
    one = _Pass(modules, a, index, dims)
    stats = _gathered(a, b, modules[0], one) if modules[0].options["gather"] and is_active() else _local(a, b, modules[0], one)
    total: Tensor | None = None
    for p, (module, dim, weight) in enumerate(zip(modules, dims, weights)):
        value = weight * module._step(shrink(a, dim), shrink(b, dim), index, stats(p))
        total = value if total is None else total + value
    return total


Stats = Callable[[int], RowStats]


def _local(a: Tensor, b: Tensor, module: GlobalContrastiveLoss, one: _Pass) -> Stats:
    """This process's rows: unimodal both views as one set (self and the other view left out; under a fixed shift the
    upper triangle only, the statistic being symmetric); bimodal images against texts, the texts' direction from the
    same tiles (the pair (i, i) left out) -- or, with individual temperatures, each direction scaled by its own."""
    n = a.shape[0]
    rows = torch.arange(n, device=a.device)
    if module.mode == "unimodal":
        both = torch.cat([a, b])
        leave = torch.stack([torch.cat([rows, rows + n]), torch.cat([rows + n, rows])], 1)
        if one.individual:
            return _stats(n, *one.rows(both, both, leave, torch.cat([one.row_scales[0], one.row_scales[0]])))
        return _stats(n, one.rows(both, both, leave, upper=one.shifts is not None)[0])
    if one.individual:
        return _stats(n, *one.rows(a, b, rows[:, None], one.row_scales[0]), *one.rows(b, a, rows[:, None], one.row_scales[1]))
    lse = one.rows(a, b, rows[:, None], columns=True)[0]
    return _stats(n, lse[:n], None, lse[n:], None)


def _gathered(a: Tensor, b: Tensor, module: GlobalContrastiveLoss, one: _Pass) -> Stats:
    """``gather=True`` among several ranks: this rank's rows against every rank's (gathered once, at full width, with
    their gradients), every candidate of the anchor's own sample left out -- as each module's own call takes them."""
    scope = make_scope(True, module.options["grad_reduction"])
    every_a, every_b = scope.rows_of(a, b)
    n, total = a.shape[0], every_a.shape[0]
    own = scope.offset + torch.arange(n, device=a.device)
    if module.mode == "unimodal":  # both views of every sample are candidates; a sample's own two views left out
        mine = torch.cat([own, own])
        scales = torch.cat([one.row_scales[0], one.row_scales[0]]) if one.individual else None
        return _stats(total, *one.rows(torch.cat([a, b]), torch.cat([every_a, every_b]), torch.stack([mine, mine + total], 1),
                                       scales))
    img, txt = (one.row_scales[0], one.row_scales[1]) if one.individual else (None, None)
    return _stats(total, *one.rows(a, every_b, own[:, None], img), *one.rows(b, every_a, own[:, None], txt))


def _stats(samples: int, lse: Tensor, means: Tensor | None = None, lse_txt: Tensor | None = None,
           means_txt: Tensor | None = None) -> Stats:
    """Prefix ``p``'s row statistics as a module takes them: one tensor each (unimodal) or a pair (bimodal), and the
    samples among the candidates."""
    if lse_txt is None:
        return lambda p: RowStats(lse[:, p], samples, None if means is None else means[:, p])
    return lambda p: RowStats((lse[:, p], lse_txt[:, p]), samples,
                              None if means is None or means_txt is None else (means[:, p], means_txt[:, p]))
