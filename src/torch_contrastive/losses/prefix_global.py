"""The global contrastive losses over every prefix of the embedding in one pass (Matryoshka, SPEC §17).

A global contrastive loss keeps one normaliser ``u_i`` per sample for the embedding it is given, so a
Matryoshka model keeps one :class:`~.global_contrastive.GlobalContrastiveLoss` per prefix
(``tc.matryoshka_loss([GlobalContrastiveLoss(n) for _ in dims], [a, b], dims, index=index)``). Each
module reads the batch only through its rows' log-sum-exps over their negatives -- SogCLR's ``g_i``, FastCLIP's
``g^I_i`` and ``g^T_i`` -- and everything else of its step is per row. Those log-sum-exps of every prefix come
here from one pass over the feature bands (:class:`~torch_contrastive.engine.prefix_lse.PrefixRowLSE`): ``D``
products per pair instead of ``sum(d_p)``, both directions of the bimodal loss from the same tiles; then each
module takes its step on its own prefix with its rows handed in, its state and temperature its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..distributed import is_active, make_scope
from ..engine.prefix_lse import PrefixRowLSE
from ..engine.prefixes import COLUMN_SCALE_LIMIT, prefix_plan
from .global_contrastive import GlobalContrastiveLoss
from .prefix_calls import shrink

__all__ = ["global_one_pass"]

#: The module options the one pass honours as the per-prefix calls do (the rows are normalised per prefix either way).
_ONE_PASS_BACKENDS = ("auto", "torch")


def _covered(losses: Sequence[Callable[..., Any]], tensors: list[Tensor], kwargs: dict[str, Any]) -> list[GlobalContrastiveLoss] | None:
    """The modules when the one pass computes exactly what their per-prefix calls would; None otherwise."""
    if len(tensors) != 2 or set(kwargs) != {"index"} or not losses:
        return None
    # the library's own module (a subclass may change its step), a temperature the engine's scale carries
    modules = [m for m in losses if type(m) is GlobalContrastiveLoss and m.temperature_mode != "individual"]
    if len(modules) != len(losses) or len({m.mode for m in modules}) != 1:
        return None
    first = modules[0].options
    if any(m.options["backend"] not in _ONE_PASS_BACKENDS or m.options["gather"] != first["gather"]
           or m.options["grad_reduction"] != first["grad_reduction"] for m in modules):
        return None
    a, b = tensors
    if a.ndim != 2 or b.shape != a.shape or a.shape[0] < 2 or b.device != a.device:
        return None  # let the modules say what is wrong
    return modules


def global_one_pass(losses: Sequence[Callable[..., Any]], tensors: list[Tensor], kwargs: dict[str, Any], dims: list[int],
                    weights: list[float]) -> Tensor | None:
    """``sum_p w_p * losses[p](a[:, :d_p] normalised, b[:, :d_p] normalised, index)`` with every prefix's
    log-sum-exps from one pass, or None where the one pass does not apply (individual temperatures, a kernel
    backend, modules that differ in ``gather`` or ``grad_reduction``, other losses): the caller then calls each loss on
    its prefix. Under ``gather=True`` among several ranks this rank's rows meet every rank's, gathered once."""
    modules = _covered(losses, tensors, kwargs)
    if modules is None:
        return None
    a, b = tensors[0], tensors[1].to(tensors[0].dtype)
    n, width = a.shape
    cuts = sorted(set(dims))
    which = tuple(cuts.index(d) for d in dims)
    dtype = a.dtype if a.dtype in (torch.float32, torch.float64) else torch.float32
    # each module's inverse temperature: a learnable one (temperature_mode="global") with its gradient
    scales = torch.stack([(1.0 / m.tau).to(dtype) if m.temperature_mode == "global"
                          else torch.tensor(1.0 / m.fixed_temperature, dtype=dtype, device=a.device) for m in modules])
    # fixed temperatures within the bounded regime: each prefix's logits summed under its fixed shift (no maximum)
    fixed = tuple(1.0 / m.fixed_temperature for m in modules)
    shifts = fixed if all(m.temperature_mode == "fixed" for m in modules) and max(fixed) <= COLUMN_SCALE_LIMIT[dtype] else None
    strip = modules[0].options["chunk_size"]
    rows = torch.arange(n, device=a.device)
    if modules[0].options["gather"] and is_active():
        given = _gathered(a, b, modules[0], cuts, which, width, scales, shifts, strip)
    elif modules[0].mode == "unimodal":  # both views as one set: self and the other view left out
        both = torch.cat([a, b])
        plan = prefix_plan(cuts, [1.0] * len(cuts), width, 1.0, True, 1e-12, 2 * n, 2 * n, strip)
        pair = torch.cat([rows + n, rows])
        # a fixed shift visits the upper triangle only (the statistic is symmetric): half the products
        lse = PrefixRowLSE.apply(both, both, plan, which, torch.stack([torch.cat([rows, rows + n]), pair], 1), False, scales,
                                 shifts, shifts is not None)
        given = _columns(lse)
    else:  # images against texts, the texts' direction from the same tiles: the pair (i, i) left out
        plan = prefix_plan(cuts, [1.0] * len(cuts), width, 1.0, True, 1e-12, n, n, strip)
        lse = PrefixRowLSE.apply(a, b, plan, which, rows[:, None], True, scales, shifts)
        given = _columns(lse[:n], lse[n:])
    index = kwargs["index"]
    total: Tensor | None = None
    for p, (module, dim, weight) in enumerate(zip(modules, dims, weights)):
        value = weight * module._step(shrink(a, dim), shrink(b, dim), index, given(p))
        total = value if total is None else total + value
    return total


def _columns(*lse: Tensor) -> Callable[[int], Any]:
    """Prefix ``p``'s log-sum-exps as a module takes them: one column (unimodal) or a pair (bimodal)."""
    if len(lse) == 1:
        return lambda p: lse[0][:, p]
    return lambda p: (lse[0][:, p], lse[1][:, p])


def _gathered(a: Tensor, b: Tensor, module: GlobalContrastiveLoss, cuts: list[int], which: tuple[int, ...], width: int,
              scales: Tensor, shifts: tuple[float, ...] | None, strip: int | None) -> Callable[[int], Any]:
    """``gather=True`` among several ranks: this rank's rows against every rank's (gathered once, at full width, with
    their gradients), every candidate of the anchor's own sample left out -- as each module's own call takes them."""
    scope = make_scope(True, module.options["grad_reduction"])
    every_a, every_b = scope.rows(a), scope.rows(b)
    n, total = a.shape[0], every_a.shape[0]
    own = scope.offset + torch.arange(n, device=a.device)
    if module.mode == "unimodal":  # both views of every sample are candidates; a sample's own two views left out
        anchors, candidates = torch.cat([a, b]), torch.cat([every_a, every_b])
        plan = prefix_plan(cuts, [1.0] * len(cuts), width, 1.0, True, 1e-12, 2 * n, 2 * total, strip)
        mine = torch.cat([own, own])
        return _columns(PrefixRowLSE.apply(anchors, candidates, plan, which, torch.stack([mine, mine + total], 1), False, scales,
                                           shifts))
    plan = prefix_plan(cuts, [1.0] * len(cuts), width, 1.0, True, 1e-12, n, total, strip)
    return _columns(PrefixRowLSE.apply(a, every_b, plan, which, own[:, None], False, scales, shifts),
                    PrefixRowLSE.apply(b, every_a, plan, which, own[:, None], False, scales, shifts))
