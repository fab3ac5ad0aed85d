"""Global contrastive losses: a per-sample moving average instead of the in-batch normaliser
(SogCLR, Yuan et al. 2022; FastCLIP / GCL bimodal, Wei et al. 2024). docs/losses.md states the options.

An in-batch loss normalises anchor ``i`` by its batch's negatives, so its quality follows the batch
size. The global loss keeps, for every sample of the data set and every direction, an estimate
``u_i`` of the normaliser over the *whole* data set, refreshed from each batch that visits the
sample, ``u_i <- (1 - gamma) u_i + gamma g_i`` (``gamma = 1`` on a sample's first visit), and the
gradient weighs each negative by ``exp(h / tau) / u_i``:

* **bimodal** (image-text, FastCLIP / LibAUC ``GCLoss_v2``): ``h^I_ij = <x_i, t_j> - <x_i, t_i>``,
  ``g^I_i = mean_{j != i} exp(h^I_ij / tau)`` over the batch's other texts; text anchors likewise.
  The gradient is LibAUC's: ``mean_i sum_{j != i} exp(h_ij / tau) / u_i * grad h_ij``, averaged over
  the two directions.
* **unimodal** (two views ``a``, ``b`` of B samples, SogCLR / ``GCLoss_v1``): anchor ``a_i``'s
  negatives are ``b_j`` and ``a_j``, ``j != i`` (2B - 2 of them), ``g^a_i`` their mean of
  ``exp(<a_i, c> / tau)``; one state per sample shared by both views (``u1``, ``u2`` from each view,
  stored ``(u1 + u2) / 2``, as LibAUC). Per sample the gradient is that of
  ``-<a_i, b_i> - <b_i, a_i> + sum over the negatives of exp(<., c> / tau) / u <., c> / (2B - 2)``.

**Numerics.** The state is ``log u`` (``-inf``: not visited yet), so nothing overflows at
``tau = 0.01`` where ``exp(h / tau)`` leaves fp32's range (LibAUC keeps a running maximum per
sample for that): each batch's ``log g_i`` is a log-sum-exp from the engine's tiles, and the
mixing is a ``logaddexp``. The state is fp32 (fp64 for fp64 inputs).

**Value.** The loss returned is the running estimate of the global objective -- bimodal
``mean_i tau (log u^I_i + log u^T_i) / 2``, unimodal ``mean_i (tau log u1_i - <a_i, b_i> + tau log
u2_i - <b_i, a_i>)`` -- on the states just updated; its gradient is the algorithm's update direction
above (the estimate itself is not differentiated: its ``u`` mixes in earlier batches).

**Cost.** One engine call per batch (the per-row log-sum-exps over the negatives, the positive
left out of the denominators as in DCL), O(N·D + tile²) memory, no host read with
``validate=False``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .. import _validation as v
from .._normalize import prepare
from ..distributed import Scope, gather_padded, gather_sizes, is_active
from ..engine import Options, Problem, Softmax, compute_dtype, solve
from ..positives import Exclusion, Positives
from ._pairing import partner_positives
from ._prologue import begin, finish_checks

__all__ = ["GlobalContrastiveLoss", "GlobalState", "TemperatureRule", "global_contrastive_loss"]

MODES = ("unimodal", "bimodal")
TEMPERATURE_MODES = ("fixed", "global", "individual")
GAMMA_SCHEDULES = ("constant", "cosine")


class GlobalState(NamedTuple):
    """A batch's rows of the per-sample state (B rows, one column per direction: the unimodal state in
    column 0, column 1 unused and ``-inf``; bimodal image anchors in column 0, text anchors in 1).

    Attributes:
        log_u: (B, 2) ``log u``; ``-inf`` where a sample was not visited yet (then ``gamma`` is 1).
        tau: (B, 2) the individual temperatures (``temperature_mode="individual"``), else None.
        tau_grad: (B, 2) their moving gradients (iSogCLR's ``beta`` average), else None.
    """

    log_u: Tensor
    tau: Tensor | None = None
    tau_grad: Tensor | None = None


@dataclass(frozen=True)
class TemperatureRule:
    """iSogCLR's per-sample temperature step (LibAUC's ``individual_learnable``): ``m <- (1 - beta) m +
    beta * grad``, ``tau <- clamp(tau - lr * m, tau_min, tau_max)`` with ``grad = log u + rho - T`` and
    ``T`` the negatives' ``exp(h / tau) / u * h / tau`` averaged (see :func:`global_contrastive_loss`)."""

    rho: float
    lr: float = 0.01
    beta: float = 0.9
    tau_min: float = 0.05
    tau_max: float = 0.7


#: LibAUC's defaults per mode: GCLoss_v1 (unimodal) and GCLoss_v2 (bimodal).
INDIVIDUAL_DEFAULTS = {"unimodal": TemperatureRule(rho=0.3, tau_min=0.05, tau_max=0.7),
                       "bimodal": TemperatureRule(rho=6.0, tau_min=0.005, tau_max=0.05)}
#: FastCLIP-v3's rho for the learnable global temperature.
GLOBAL_RHO = 8.0


def default_rule(mode: str, temperature_mode: str) -> TemperatureRule:
    """The temperatures' rule when none is given: LibAUC's per mode for individual temperatures,
    FastCLIP-v3's rho otherwise."""
    return INDIVIDUAL_DEFAULTS[mode] if temperature_mode == "individual" else TemperatureRule(rho=GLOBAL_RHO)


def global_contrastive_loss(
    a: Tensor,
    b: Tensor,
    state: GlobalState,
    temperature: float | Tensor = 0.1,
    gamma: float = 0.9,
    *,
    mode: str = "unimodal",
    temperature_mode: str = "fixed",
    rule: TemperatureRule | None = None,
    normalize: bool = True,
    chunk_size: int | None = None,
    gather: bool = False,
    grad_reduction: str = "mean",
    eps: float = 1e-12,
    validate: bool = True,
    backend: str = "auto",
) -> tuple[Tensor, GlobalState]:
    """The global contrastive loss of one batch, and the batch's new state (see the module docstring).

    Args:
        a: (B, D) first view (unimodal) or image features (bimodal).
        b: (B, D) second view, or text features; row i pairs with ``a[i]``.
        state: the batch's state rows (:class:`GlobalState`), fp32 (fp64 for fp64 inputs).
        temperature: ``"fixed"``: tau > 0; ``"global"``: the learnable 0-dim tau tensor (bimodal:
            FastCLIP-v3's RGCL-g, whose objective ``tau (mean log u + rho)`` gives tau FastCLIP's
            gradient); ``"individual"``: unused (the temperatures are ``state.tau``).
        gamma: the moving average's weight of the batch, in (0, 1].
        mode: ``"unimodal"`` (SogCLR) or ``"bimodal"`` (FastCLIP's GCL).
        temperature_mode: ``"fixed"``, ``"global"`` (RGCL-g) or ``"individual"`` (iSogCLR: each
            sample's tau updated here by ``rule``, one more engine pass per call).
        rule: the individual temperatures' step and rho (default :data:`INDIVIDUAL_DEFAULTS` of the
            mode), or ``TemperatureRule(rho=...)`` whose ``rho`` the global mode reads (default 8).

    The shared options ``normalize``, ``chunk_size``, ``gather``, ``grad_reduction``, ``eps``, ``validate``,
    ``backend`` are documented once in :mod:`torch_contrastive.options`. With ``gather=True`` each rank's
    rows meet every rank's samples as negatives (gathered with their gradient); ``state`` and the
    result are this rank's rows (:class:`GlobalContrastiveLoss` shares them with every rank).

    Returns:
        ``(loss, new_state)``: the 0-dim estimate of the global objective with the algorithm's
        gradient, and the batch's updated state rows (new tensors: ``state`` is not modified).

    Memory: O(B·D + tile²); one engine call (two with individual temperatures, three bimodal).
    """
    return _global_loss(a, b, state, temperature, gamma, mode, temperature_mode, rule, None, normalize=normalize,
                        chunk_size=chunk_size, gather=gather, grad_reduction=grad_reduction, eps=eps, validate=validate,
                        backend=backend)


class RowStats(NamedTuple):
    """Each row's statistics over its negatives, computed by the caller (the Matryoshka one pass,
    :mod:`.prefix_global`; this rank's rows against every rank's under ``gather=True``).

    Attributes:
        lse: the log-sum-exps: unimodal ``(2B,)`` (both views' rows), bimodal ``(image rows, text rows)``.
        samples: the samples among the candidates (this batch's, or every rank's): the loss then builds no
            negatives of its own (under ``gather=True``, no gather of its own).
        expected: the soft-max means of the logits, laid out as ``lse`` (individual temperatures), else None.
    """

    lse: Tensor | tuple[Tensor, Tensor]
    samples: int
    expected: Tensor | tuple[Tensor, Tensor] | None = None


Given = RowStats | None


def _global_loss(a: Tensor, b: Tensor, state: GlobalState, temperature: float | Tensor, gamma: float, mode: str,
                 temperature_mode: str, rule: TemperatureRule | None, given: Given, *, normalize: bool, chunk_size: int | None,
                 gather: bool, grad_reduction: str, eps: float, validate: bool, backend: str) -> tuple[Tensor, GlobalState]:
    """:func:`global_contrastive_loss`, its rows' statistics taken from ``given`` where given (under ``gather=True``
    this rank's rows against every rank's): the loss then builds no negatives and calls no engine."""
    v.check_embeddings(a, "a")
    v.check_embeddings(b, "b")
    v.check_same_rows(a, "a", b, "b")
    v.check_choice(mode, "mode", MODES)
    v.check_choice(temperature_mode, "temperature_mode", TEMPERATURE_MODES)
    _check_state(state, a.shape[0], compute_dtype(a.dtype), temperature_mode == "individual")
    gamma = _check_gamma(gamma)
    rule = rule if rule is not None else default_rule(mode, temperature_mode)
    tau: float | Tensor | None = None
    if temperature_mode == "global":
        if not isinstance(temperature, Tensor) or temperature.ndim != 0 or not temperature.is_floating_point():
            raise TypeError("temperature must be a 0-dim floating tensor (the learnable tau) with temperature_mode='global'")
        tau = temperature
    elif temperature_mode == "fixed":
        tau = v.check_positive(temperature, "temperature")
    scope, checks = begin(normalize=normalize, reduction="mean", chunk_size=chunk_size, grad_reduction=grad_reduction, eps=eps, backend=backend,
                          gather=gather, validate=validate)
    if a.shape[0] < 2 and not scope.distributed:
        raise ValueError(f"a global contrastive loss needs a batch of at least 2 samples (negatives), got {a.shape[0]}")
    checks.finite(a, "a", deferred=True)
    checks.finite(b, "b", deferred=True)
    if isinstance(tau, Tensor):  # a learnable tau an optimiser step may have driven to 0 or below
        learned = tau.detach()
        checks.add(learned, lambda: f"temperature must be positive and finite, got {float(learned)} (the learnable tau of "
                   "temperature_mode='global')", v.not_positive, what="temperature must be positive and finite")
    call = _Call(gamma, rule, Options(False, eps, chunk_size, backend), scope)
    img, txt = prepare(a, normalize, eps), prepare(b.to(a.dtype), normalize, eps)
    if given is not None and tau is None and given.expected is None:
        raise RuntimeError("internal: individual temperatures read the rows' soft-max means too")
    if mode == "unimodal":
        (estimate, surrogate, count), new = _unimodal(img, txt, state, tau, call, given)
    else:
        (estimate, surrogate, count), new = _bimodal(img, txt, state, tau, call, given)
    loss = _straight(scope.finish(estimate, count), scope.finish(surrogate, count))
    # normalised rows: a non-finite input makes the loss non-finite, and its value answers the finite checks
    finish_checks(loss, checks, not normalize, covers=normalize)
    return loss, new


@dataclass(frozen=True)
class _Call:
    gamma: float
    rule: TemperatureRule
    options: Options  # the engine's: the rows come normalised
    scope: Scope


def _mixed(old: Tensor, log_g: Tensor, gamma: float) -> Tensor:
    """``log((1 - gamma) u + gamma g)``; ``log g`` where the sample was not visited (``old = -inf``)."""
    if gamma >= 1.0:
        return log_g
    fresh = torch.logaddexp(old + math.log1p(-gamma), log_g + math.log(gamma))
    return torch.where(torch.isneginf(old), log_g, fresh)


def _straight(estimate: Tensor, surrogate: Tensor) -> Tensor:
    """``estimate``'s value with ``surrogate``'s gradient."""
    return estimate.detach() + (surrogate - surrogate.detach())


class _Negatives(NamedTuple):
    """Who row r's negatives are: the candidates, and the relation (self and positive) left out."""

    candidates: Tensor
    relation: Positives
    self_offset: int | None
    symmetric: bool = False  # one set on one process: the engine visits the upper triangle only


def _lse(anchors: Tensor, negatives: _Negatives, scale: float | Tensor, options: Options, bound: float | None = None,
         columns: bool = False) -> tuple[Tensor, Tensor | None]:
    """Row r's ``log sum exp(S)`` over its negatives, ``S = scale <anchor_r, candidate>`` (and the columns')."""
    statistic = Softmax(columns=columns, columns_share_alpha=columns, exclude=Exclusion(relation=negatives.relation,
                                                                                          symmetric=True))
    return solve(Problem(anchors, negatives.candidates, scale, statistic, self_offset=negatives.self_offset,
                         symmetric=negatives.symmetric, bound=bound, options=options))


def _expected(anchors: Tensor, negatives: _Negatives, options: Options) -> Tensor:
    """Row r's soft-max mean of ``S = <x_r, c>`` over its negatives, as ``<x_r, d LSE_r / d x_r>``
    (rows ``x`` already scaled): one more engine pass, detached from the caller's graph."""
    with torch.enable_grad():
        x = anchors.detach().requires_grad_()
        lse = _lse(x, negatives._replace(candidates=negatives.candidates.detach(), symmetric=False), 1.0, options)[0]
        (grad,) = torch.autograd.grad(lse.sum(), x)
    return (x.detach() * grad).sum(1)


def _stepped(state_tau: Tensor, state_grad: Tensor, grad: Tensor, rule: TemperatureRule) -> tuple[Tensor, Tensor]:
    """iSogCLR's (LibAUC's) step of the individual temperatures: new ``(tau, moving gradient)``."""
    moving = (1.0 - rule.beta) * state_grad + rule.beta * grad
    return (state_tau - rule.lr * moving).clamp(rule.tau_min, rule.tau_max), moving


def _negatives_by_sample(rows_from: Tensor, candidates: Tensor, repeats: int, scope: Scope) -> _Negatives:
    """Negatives gathered from every rank: every candidate but the anchor's own sample's (self and positive),
    told apart by the sample's position in the global batch (``repeats`` views per sample)."""
    n, total = rows_from.shape[0], candidates.shape[0] // repeats
    own = scope.offset + torch.arange(n, device=rows_from.device)
    every = torch.arange(total, device=rows_from.device)
    return _Negatives(candidates, Positives.from_keys(own.repeat(repeats), every.repeat(repeats), self_offset=None), None)


Parts = tuple[Tensor, Tensor, float]  # (this rank's estimate sum, surrogate sum, its samples)


def _one(stat: Tensor | tuple[Tensor, Tensor] | None) -> Tensor:
    if not isinstance(stat, Tensor):
        raise RuntimeError("internal: a unimodal statistic is one tensor")
    return stat


def _two(stat: Tensor | tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
    if not isinstance(stat, tuple):
        raise RuntimeError("internal: a bimodal statistic is a pair (image rows, text rows)")
    return stat


def _built(negatives: _Negatives | None) -> _Negatives:
    if negatives is None:
        raise RuntimeError("internal: the engine's negatives are built when no statistics are given")
    return negatives


def _unimodal(a: Tensor, b: Tensor, state: GlobalState, tau: float | Tensor | None, call: _Call,
              given: RowStats | None = None) -> tuple[Parts, GlobalState]:
    n, opts, scope = a.shape[0], call.options, call.scope
    rows = torch.cat([a, b])
    l_pos = (a * b).sum(1)
    l_pos = torch.cat([l_pos, l_pos])  # each sample's positive similarity, both views
    negatives: _Negatives | None = None  # given statistics: none built (no gather of the loss's own)
    if given is None and scope.distributed:
        negatives = _negatives_by_sample(a, torch.cat(scope.rows_of(a, b)), 2, scope)
    elif given is None:
        negatives = _Negatives(rows, partner_positives(2 * n, "halves", 0, rows.device, 2 * n, 0, "halves"), 0, tau is not None)
    total = given.samples if given is not None else _built(negatives).candidates.shape[0] // 2
    if total < 2:
        raise ValueError(f"a global contrastive loss needs a batch of at least 2 samples (negatives), got {total}")
    if tau is not None:  # S = <., .> / tau (a learnable tau: the engine's scale gets its gradient)
        taus: float | Tensor = tau.detach() if isinstance(tau, Tensor) else tau
        lse = _one(given.lse) if given is not None else \
            _lse(rows, _built(negatives), 1.0 / tau, opts, bound=None if isinstance(tau, Tensor) else 1.0 / tau)[0]
    else:  # every sample its own tau (both views): the rows scaled, the candidates as they are
        if state.tau is None:
            raise RuntimeError("internal: individual temperatures without their state")
        taus = torch.cat([state.tau[:, 0], state.tau[:, 0]]).to(rows.dtype)
        scaled = rows / taus[:, None]
        lse = _one(given.lse) if given is not None else _lse(scaled, _built(negatives)._replace(symmetric=False), 1.0, opts)[0]
    log_g = lse.detach() - math.log(2 * (total - 1))
    old = state.log_u[:, 0].to(lse.dtype)
    log_u1, log_u2 = _mixed(old, log_g[:n], call.gamma), _mixed(old, log_g[n:], call.gamma)
    log_ur = torch.cat([log_u1, log_u2])
    c = torch.exp(log_g - log_ur)  # g / u per row
    # gradient: -grad <., pos> + tau (g / u) grad LSE per row, both views summed, the mean over samples
    surrogate = (taus * c * lse).sum() - l_pos.sum()
    new_log_u = torch.stack([torch.logaddexp(log_u1, log_u2) - math.log(2.0), torch.full_like(log_u1, -math.inf)], 1)
    if isinstance(tau, Tensor):  # RGCL-g on two views: tau's gradient sum_r (rho + log u_r - (g / u) E_softmax[S]_r)
        objective = tau * (call.rule.rho + log_ur).sum() - l_pos.detach().sum()
        return (objective, surrogate + objective, float(n)), GlobalState(new_log_u.to(state.log_u.dtype))
    if tau is not None:
        return ((tau * log_ur - l_pos).sum(), surrogate, float(n)), GlobalState(new_log_u.to(state.log_u.dtype))
    assert isinstance(taus, Tensor) and state.tau is not None and state.tau_grad is not None
    expected = _one(given.expected) if given is not None else _expected(scaled, _built(negatives), opts)  # soft-max mean of S
    grad = log_ur + call.rule.rho - c * expected
    new_tau, moving = _stepped(state.tau[:, 0], state.tau_grad[:, 0], (grad[:n] + grad[n:]) / 2, call.rule)
    estimate = (taus.detach() * (log_ur + call.rule.rho) - l_pos).sum()
    blank = torch.full_like(new_tau, math.nan)
    return (estimate, surrogate, float(n)), GlobalState(new_log_u.to(state.log_u.dtype), torch.stack([new_tau, blank], 1),
                                                        torch.stack([moving, blank], 1))


def _bimodal(img: Tensor, txt: Tensor, state: GlobalState, tau: float | Tensor | None, call: _Call,
             given: RowStats | None = None) -> tuple[Parts, GlobalState]:
    n, opts, scope = img.shape[0], call.options, call.scope
    l_pos = (img * txt).sum(1)
    by_img = by_txt = None  # given statistics: none built (no gather of the loss's own)
    if given is None and scope.distributed:
        every_txt, every_img = scope.rows_of(txt, img)
        by_img = _negatives_by_sample(img, every_txt, 1, scope)
        by_txt = _negatives_by_sample(txt, every_img, 1, scope)
    elif given is None:
        pos = Positives.from_partner(torch.arange(n, device=img.device), n, self_offset=None)
        by_img, by_txt = _Negatives(txt, pos, None), _Negatives(img, pos, None)
    total = given.samples if given is not None else _built(by_img).candidates.shape[0]
    if total < 2:
        raise ValueError(f"a global contrastive loss needs a batch of at least 2 samples (negatives), got {total}")
    if tau is None:  # individual temperatures: each direction's rows scaled by their own 1 / tau
        if state.tau is None or state.tau_grad is None:
            raise RuntimeError("internal: individual temperatures without their state")
        taus = state.tau.to(img.dtype)
        t_img: float | Tensor = taus[:, 0]
        t_txt: float | Tensor = taus[:, 1]
        img_s, txt_s = img / taus[:, :1], txt / taus[:, 1:]
        lse_img, lse_txt = _two(given.lse) if given is not None else \
            (_lse(img_s, _built(by_img), 1.0, opts)[0], _lse(txt_s, _built(by_txt), 1.0, opts)[0])
    else:
        scale = 1.0 / tau
        bound = scale if isinstance(scale, float) else None
        t_img = t_txt = tau.detach() if isinstance(tau, Tensor) else tau
        if given is not None:
            lse_img, lse_txt = _two(given.lse)
        elif scope.distributed:
            lse_img, lse_txt = _lse(img, _built(by_img), scale, opts, bound)[0], _lse(txt, _built(by_txt), scale, opts, bound)[0]
        else:  # both directions in one call: the texts' log-sum-exps are the column statistics
            both = _lse(img, _built(by_img), scale, opts, bound, columns=True)
            if both[1] is None:
                raise RuntimeError("internal: columns=True returns the column terms")
            lse_img, lse_txt = both[0], both[1]
    # d_i = log sum_{j != i} exp(h_ij / tau) = log (B - 1) g_i, with h_ij = <x_i, t_j> - <x_i, t_i>
    s_img, s_txt = (l_pos / t_img, l_pos / t_txt) if tau is None else (l_pos * (1.0 / tau),) * 2
    d_img, d_txt = lse_img - s_img, lse_txt - s_txt
    log_norm = math.log(total - 1)
    log_u_img = _mixed(state.log_u[:, 0].to(d_img.dtype), d_img.detach() - log_norm, call.gamma)
    log_u_txt = _mixed(state.log_u[:, 1].to(d_txt.dtype), d_txt.detach() - log_norm, call.gamma)
    new_log_u = torch.stack([log_u_img, log_u_txt], 1).to(state.log_u.dtype)
    w_img, w_txt = torch.exp(d_img.detach() - log_u_img), torch.exp(d_txt.detach() - log_u_txt)
    if isinstance(tau, Tensor):  # FastCLIP-v3 (RGCL-g): tau_det mean(g^I / u^I + g^T / u^T) + tau (rho + mean log u)
        # g / u = exp(d - log u) / (B - 1), differentiable in d (features and tau): w exp(d - d_det), value w
        surrogate = t_img * ((w_img * torch.exp(d_img - d_img.detach())).sum() + (w_txt * torch.exp(d_txt - d_txt.detach())).sum()) \
            / (total - 1)
        objective = tau * (call.rule.rho * n + (log_u_img.sum() + log_u_txt.sum()) / 2)
        return (objective, surrogate + objective, float(n)), GlobalState(new_log_u)
    # LibAUC's gradient: sum_j exp(h_ij / tau) / u_i grad h_ij = tau exp(d_i) / u_i grad d_i, mean over i and directions
    surrogate = ((t_img * w_img * d_img).sum() + (t_txt * w_txt * d_txt).sum()) / 2
    if tau is not None:
        return (tau * (log_u_img.sum() + log_u_txt.sum()) / 2, surrogate, float(n)), GlobalState(new_log_u)
    assert isinstance(t_img, Tensor) and isinstance(t_txt, Tensor) and state.tau is not None and state.tau_grad is not None
    # the soft-max mean of h / tau over the negatives: of S, less S_ii
    means = _two(given.expected) if given is not None else \
        (_expected(img_s, _built(by_img), opts), _expected(txt_s, _built(by_txt), opts))
    e_img, e_txt = means[0] - s_img.detach(), means[1] - s_txt.detach()
    new_img, m_img = _stepped(state.tau[:, 0], state.tau_grad[:, 0], log_u_img + call.rule.rho - w_img / (total - 1) * e_img,
                              call.rule)
    new_txt, m_txt = _stepped(state.tau[:, 1], state.tau_grad[:, 1], log_u_txt + call.rule.rho - w_txt / (total - 1) * e_txt,
                              call.rule)
    estimate = ((t_img * (log_u_img + call.rule.rho)).sum() + (t_txt * (log_u_txt + call.rule.rho)).sum()) / 2
    return (estimate, surrogate, float(n)), GlobalState(new_log_u, torch.stack([new_img, new_txt], 1),
                                                        torch.stack([m_img, m_txt], 1))


def _check_gamma(gamma: object) -> float:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 < gamma <= 1:
        raise ValueError(f"gamma must be a float in (0, 1], got {gamma!r}")
    return float(gamma)


def _check_state(state: object, n: int, dtype: torch.dtype, individual: bool) -> None:
    if not isinstance(state, GlobalState):
        raise TypeError(f"state must be a GlobalState (the batch's state rows), got {type(state).__name__}")
    fields = ("log_u", "tau", "tau_grad") if individual else ("log_u",)
    for name in fields:
        rows = getattr(state, name)
        if not isinstance(rows, Tensor):
            raise TypeError(f"state.{name} must be a torch.Tensor (temperature_mode='individual' needs tau and tau_grad), "
                            f"got {type(rows).__name__}")
        if rows.shape != (n, 2):
            raise ValueError(f"state.{name} must hold the batch's state rows, shape ({n}, 2), got {tuple(rows.shape)}")
        if rows.dtype != dtype:
            raise TypeError(f"state.{name} must be {dtype} for {dtype} rows (the state's precision), got {rows.dtype}")


class GlobalContrastiveLoss(nn.Module):
    """Global contrastive loss with its per-sample state (SogCLR, Yuan et al. 2022; iSogCLR, Qiu et al. 2023; FastCLIP, Wei et al. 2024).

    Called as ``loss_fn(a, b, index)`` with ``index`` (B,) the batch's dataset indices (from the
    data loader); it refreshes the visited samples' states and returns the running estimate of the
    global objective, whose gradient is the algorithm's (see :mod:`.global_contrastive`). Call
    :meth:`set_epoch` at the start of every epoch for the ``gamma`` schedule.

    Args:
        num_samples: the data set's size (indices lie in ``[0, num_samples)``).
        mode: ``"unimodal"`` (two views of each sample, SogCLR) or ``"bimodal"`` (image-text).
        temperature: tau (default 0.1): the fixed one, the learnable one's start (``"global"``) or
            every sample's start (``"individual"``).
        gamma: the moving average's weight of a batch (default 0.9); 1 on a sample's first visit.
        temperature_mode: ``"fixed"``; ``"global"``: ``self.tau`` is an ``nn.Parameter`` the
            optimizer sees, with RGCL-g's gradient (bimodal: FastCLIP-v3's); ``"individual"``: iSogCLR's per-sample
            temperatures, buffers updated inside the loss by ``rule``.
        rho: the robust objective's rho (individual temperatures: LibAUC's 0.3 unimodal, 6 bimodal by
            default; global: FastCLIP-v3's 8); overrides ``rule.rho``.
        rule: the individual temperatures' step, clamp and rho (:class:`TemperatureRule`; default
            LibAUC's for the mode).
        gamma_schedule: ``"constant"`` or ``"cosine"`` (from 1 at epoch 0 to ``gamma`` at
            ``gamma_decay_epochs``, FastCLIP's and LibAUC's formula).
        gamma_decay_epochs: the cosine schedule's length in epochs.
        state_dtype: the state's dtype, fp32 (default) or fp64 (for fp64 inputs).
        device: where the state lives (default CPU: two floats per sample, four more with
            individual temperatures).

    The shared options ``normalize``, ``chunk_size``, ``eps``, ``validate``, ``backend`` are documented once
    in :mod:`torch_contrastive.options`.

    The state is in buffers (``log_u`` (num_samples, 2), ``epoch``, and with individual temperatures
    ``tau_state`` and ``tau_grad``): saved and restored with the module's ``state_dict``. A batch's
    indices must be distinct and inside ``[0, num_samples)`` (checked with ``validate=True``, in one
    host read).
    """

    log_u: Tensor
    epoch: Tensor
    tau_state: Tensor
    tau_grad: Tensor

    def __init__(self, num_samples: int, mode: str = "unimodal", temperature: float = 0.1, gamma: float = 0.9, *,
                 temperature_mode: str = "fixed", rho: float | None = None, rule: TemperatureRule | None = None,
                 gamma_schedule: str = "constant",
                 gamma_decay_epochs: int | None = None, state_dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, normalize: bool = True, chunk_size: int | None = None,
                 gather: bool = False, grad_reduction: str = "mean", eps: float = 1e-12, validate: bool = True,
                 backend: str = "auto") -> None:
        super().__init__()
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 2:
            raise ValueError(f"num_samples must be an int >= 2, got {num_samples!r}")
        v.check_choice(mode, "mode", MODES)
        v.check_choice(temperature_mode, "temperature_mode", TEMPERATURE_MODES)
        v.check_choice(gamma_schedule, "gamma_schedule", GAMMA_SCHEDULES)
        if gamma_schedule == "cosine" and (isinstance(gamma_decay_epochs, bool) or not isinstance(gamma_decay_epochs, int)
                                           or gamma_decay_epochs < 1):
            raise ValueError(f"gamma_decay_epochs must be a positive int with gamma_schedule='cosine', got {gamma_decay_epochs!r}")
        if state_dtype not in (torch.float32, torch.float64):
            raise TypeError(f"state_dtype must be torch.float32 or torch.float64, got {state_dtype}")
        if rule is not None and not isinstance(rule, TemperatureRule):
            raise TypeError(f"rule must be a TemperatureRule, got {type(rule).__name__}")
        v.check_options(reduction="mean", chunk_size=chunk_size, grad_reduction=grad_reduction, eps=eps, backend=backend)
        self.num_samples, self.mode, self.temperature_mode = num_samples, mode, temperature_mode
        self.gamma_min = _check_gamma(gamma)
        self.gamma_schedule, self.gamma_decay_epochs = gamma_schedule, gamma_decay_epochs
        self.rule = rule if rule is not None else default_rule(mode, temperature_mode)
        if rho is not None:
            if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not math.isfinite(rho):
                raise ValueError(f"rho must be a finite float, got {rho!r}")
            self.rule = replace(self.rule, rho=float(rho))
        start = v.check_positive(temperature, "temperature")
        if temperature_mode == "individual" and not self.rule.tau_min <= start <= self.rule.tau_max:
            raise ValueError(f"temperature must start inside [tau_min, tau_max] = [{self.rule.tau_min}, {self.rule.tau_max}] "
                             f"with temperature_mode='individual', got {start}")
        self.options: dict[str, Any] = {"normalize": v.check_flag(normalize, "normalize"), "chunk_size": chunk_size,
                                        "gather": v.check_flag(gather, "gather"), "grad_reduction": grad_reduction,
                                        "eps": float(eps), "validate": v.check_flag(validate, "validate"), "backend": backend}
        self.register_buffer("log_u", torch.full((num_samples, 2), -math.inf, dtype=state_dtype, device=device))
        self.register_buffer("epoch", torch.zeros((), dtype=torch.int64))
        self._epoch = 0
        self.register_load_state_dict_post_hook(self._reload_epoch)
        self.fixed_temperature = start
        if temperature_mode == "global":
            self.tau = nn.Parameter(torch.tensor(start, dtype=state_dtype, device=device))
        if temperature_mode == "individual":
            self.register_buffer("tau_state", torch.full((num_samples, 2), start, dtype=state_dtype, device=device))
            self.register_buffer("tau_grad", torch.zeros((num_samples, 2), dtype=state_dtype, device=device))

    @property
    def gamma(self) -> float:
        """This epoch's gamma: constant, or cosine from 1 (epoch 0) to ``gamma`` at ``gamma_decay_epochs``.
        A sample's first visit uses 1 whatever the schedule."""
        epoch = self._epoch  # a host copy of the buffer: reading the buffer in every call would be a sync
        if self.gamma_schedule == "constant" or epoch >= (self.gamma_decay_epochs or 0):
            return self.gamma_min
        return (1 - self.gamma_min) * 0.5 * (1 + math.cos(math.pi * epoch / (self.gamma_decay_epochs or 1))) + self.gamma_min

    def set_epoch(self, epoch: int) -> None:
        """The epoch about to start (0-based): sets the ``gamma`` schedule's value."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self.epoch.fill_(epoch)
        self._epoch = epoch

    def _reload_epoch(self, module: nn.Module, incompatible: Any) -> None:
        """After ``load_state_dict``: the host copy of the restored epoch."""
        self._epoch = int(self.epoch)

    def forward(self, a: Tensor, b: Tensor, index: Tensor) -> Tensor:
        return self._step(a, b, index, None)

    def _step(self, a: Tensor, b: Tensor, index: Tensor, given: Given) -> Tensor:
        """One batch: the loss, the visited samples' states refreshed (``given``: see :func:`_global_loss`)."""
        v.check_embeddings(a, "a")
        v.check_embeddings(b, "b")
        index = self._checked_index(index, a)
        at = index.to(self.log_u.device)
        cdtype = compute_dtype(a.dtype)
        individual = self.temperature_mode == "individual"

        def rows(t: Tensor) -> Tensor:
            return t.index_select(0, at).to(a.device, cdtype)

        state = GlobalState(rows(self.log_u), rows(self.tau_state) if individual else None,
                            rows(self.tau_grad) if individual else None)
        temperature: float | Tensor = self.tau if self.temperature_mode == "global" else self.fixed_temperature
        loss, new = _global_loss(a, b, state, temperature, self.gamma, self.mode, self.temperature_mode, self.rule, given,
                                 **self.options)
        with torch.no_grad():
            parts = [new.log_u] + ([new.tau, new.tau_grad] if individual else [])
            if self.options["gather"] and is_active():
                # every rank keeps the whole state: each writes every rank's samples (the same values everywhere)
                sizes = gather_sizes(index.shape[0], a.device)
                at = gather_padded(index.to(a.device), sizes).to(self.log_u.device)
                if self.options["validate"] and torch.unique(at).numel() != at.numel():
                    raise ValueError("index must not repeat across ranks within a step (one state update per sample)")
                parts = [gather_padded(t.contiguous(), sizes) for t in parts if t is not None]
            kept = slice(0, 1) if self.mode == "unimodal" else slice(0, 2)  # unimodal: column 1 stays unused
            for buffer, rows_new in zip(self._state_buffers(), parts):
                if rows_new is not None:
                    buffer[:, kept].index_copy_(0, at, rows_new[:, kept].to(buffer.device, buffer.dtype))
        return loss

    def _state_buffers(self) -> list[Tensor]:
        return [self.log_u, self.tau_state, self.tau_grad] if self.temperature_mode == "individual" else [self.log_u]

    def _checked_index(self, index: object, a: object) -> Tensor:
        if not isinstance(index, Tensor) or index.dtype not in v.INDEX_DTYPES or index.ndim != 1:
            what = f"{tuple(index.shape)} {index.dtype}" if isinstance(index, Tensor) else type(index).__name__
            raise TypeError(f"index must be a 1-D integer tensor of dataset indices, got {what}")
        rows = a.shape[0] if isinstance(a, Tensor) and a.ndim >= 1 else None
        if rows is not None and index.shape[0] != rows:
            raise ValueError(f"index must have one entry per row of a ({rows}), got {index.shape[0]}")
        if index.shape[0] > self.num_samples:
            raise ValueError(f"a batch of {index.shape[0]} samples is larger than the data set (num_samples={self.num_samples})")
        index = index.long()
        if self.options["validate"] and index.numel() and torch.compiler.is_compiling():  # asserted in the graph: no read
            ordered = index.sort().values
            torch._assert_async((ordered[0] >= 0) & (ordered[-1] < self.num_samples),
                                f"torch-contrastive (validate=True, compiled): index must lie in [0, {self.num_samples}) (num_samples)")
            torch._assert_async((ordered[1:] != ordered[:-1]).all(),
                                "torch-contrastive (validate=True, compiled): index must not repeat within a batch")
        elif self.options["validate"] and index.numel():
            # one host read: every index inside the data set, none repeated (two updates of one state would collide)
            ordered = index.sort().values
            low, high, repeats = torch.stack([ordered[0], ordered[-1], (ordered[1:] == ordered[:-1]).sum()]).tolist()
            if low < 0 or high >= self.num_samples:
                raise ValueError(f"index must lie in [0, {self.num_samples}) (num_samples), got values in [{low}, {high}]")
            if repeats:
                raise ValueError("index must not repeat within a batch (one state update per sample and step)")
        return index

    def extra_repr(self) -> str:
        return (f"num_samples={self.num_samples}, mode={self.mode!r}, temperature_mode={self.temperature_mode!r}, "
                f"temperature={self.fixed_temperature}, gamma={self.gamma_min}, gamma_schedule={self.gamma_schedule!r}")
