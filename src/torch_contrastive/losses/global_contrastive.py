"""Global contrastive losses: a per-sample moving average instead of the in-batch normaliser
(SogCLR, Yuan et al. 2022; FastCLIP / GCL bimodal, Wei et al. 2024). SPEC §17.

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
from typing import Any

import torch
from torch import Tensor, nn

from .. import _validation as v
from .._normalize import prepare
from ..engine import Options, Problem, Softmax, compute_dtype, solve
from ..positives import Exclusion
from ._pairing import image_text_positives
from ._prologue import begin, finish_checks
from .nt_xent import nt_xent_loss

__all__ = ["GlobalContrastiveLoss", "global_contrastive_loss"]

MODES = ("unimodal", "bimodal")
GAMMA_SCHEDULES = ("constant", "cosine")


def global_contrastive_loss(
    a: Tensor,
    b: Tensor,
    log_u: Tensor,
    temperature: float = 0.1,
    gamma: float = 0.9,
    *,
    mode: str = "unimodal",
    normalize: bool = True,
    chunk_size: int | None = None,
    eps: float = 1e-12,
    validate: bool = True,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """The global contrastive loss of one batch, and the batch's new state (see the module docstring).

    Args:
        a: (B, D) first view (unimodal) or image features (bimodal).
        b: (B, D) second view, or text features; row i pairs with ``a[i]``.
        log_u: (B, 2) the batch's state rows ``log u`` in fp32 (fp64 for fp64 inputs): column 0 the
            unimodal sample state (column 1 unused, kept ``-inf``), or the bimodal image and text
            states; ``-inf`` where a sample was not visited yet (then ``gamma`` is 1 for it).
        temperature: tau > 0 (a float: the fixed temperature).
        gamma: the moving average's weight of the batch, in (0, 1].
        mode: ``"unimodal"`` (SogCLR) or ``"bimodal"`` (FastCLIP's GCL).

    The shared options ``normalize``, ``chunk_size``, ``eps``, ``validate``, ``backend`` are documented once
    in :mod:`torch_contrastive.options`.

    Returns:
        ``(loss, new_log_u)``: the 0-dim estimate of the global objective with the algorithm's
        gradient, and the (B, 2) updated state rows (new tensors: ``log_u`` is not modified).

    Memory: O(B·D + tile²); one engine call (about four B x B x D products, unimodal over 2B rows).
    """
    v.check_embeddings(a, "a")
    v.check_embeddings(b, "b")
    v.check_same_rows(a, "a", b, "b")
    v.check_choice(mode, "mode", MODES)
    if a.shape[0] < 2:
        raise ValueError(f"a global contrastive loss needs a batch of at least 2 samples (negatives), got {a.shape[0]}")
    _check_state_rows(log_u, a.shape[0], compute_dtype(a.dtype))
    gamma = _check_gamma(gamma)
    tau = _check_temperature(temperature)
    if mode == "unimodal":
        return _unimodal(a, b, log_u, tau, gamma, normalize, chunk_size, eps, validate, backend)
    return _bimodal(a, b, log_u, tau, gamma, normalize, chunk_size, eps, validate, backend)


def _mixed(old: Tensor, log_g: Tensor, gamma: float) -> Tensor:
    """``log((1 - gamma) u + gamma g)``; ``log g`` where the sample was not visited (``old = -inf``)."""
    if gamma >= 1.0:
        return log_g
    fresh = torch.logaddexp(old + math.log1p(-gamma), log_g + math.log(gamma))
    return torch.where(torch.isneginf(old), log_g, fresh)


def _straight(estimate: Tensor, surrogate: Tensor) -> Tensor:
    """``estimate``'s value with ``surrogate``'s gradient."""
    return estimate.detach() + (surrogate - surrogate.detach())


def _unimodal(a: Tensor, b: Tensor, log_u: Tensor, tau: float, gamma: float, normalize: bool, chunk_size: int | None,
              eps: float, validate: bool, backend: str) -> tuple[Tensor, Tensor]:
    n = a.shape[0]
    z = torch.cat([a, b.to(a.dtype)])
    # d_r = LSE_r - S_r,pos over the 2B - 2 negatives of row r (DCL: self and positive left out), S = <., .> / tau
    d = nt_xent_loss(z, tau, pairing="halves", decoupled=True, reduction="none", normalize=normalize, chunk_size=chunk_size,
                     eps=eps, validate=validate, backend=backend)
    rows = prepare(z, normalize, eps)
    s_pos = (rows[:n] * rows[n:]).sum(1) / tau  # S of each sample's positive pair (both views: the same number)
    s_pos = torch.cat([s_pos, s_pos])
    lse = d.detach() + s_pos.detach()  # log sum over the negatives of exp(S)
    log_g = lse - math.log(2 * (n - 1))
    old = log_u[:, 0].to(lse.dtype)
    log_u1, log_u2 = _mixed(old, log_g[:n], gamma), _mixed(old, log_g[n:], gamma)
    log_ur = torch.cat([log_u1, log_u2])
    # gradient: -grad <., pos> + tau * (g / u) * grad LSE per row, summed over both views, mean over samples
    c = torch.exp(log_g - log_ur)
    surrogate = tau * (c * d + (c - 1.0) * s_pos).sum() / n
    estimate = (tau * (log_ur - s_pos)).sum() / n
    new = torch.stack([torch.logaddexp(log_u1, log_u2) - math.log(2.0), torch.full_like(log_u1, -math.inf)], 1)
    return _straight(estimate, surrogate), new.to(log_u.dtype)


def _bimodal(a: Tensor, b: Tensor, log_u: Tensor, tau: float, gamma: float, normalize: bool, chunk_size: int | None,
             eps: float, validate: bool, backend: str) -> tuple[Tensor, Tensor]:
    n = a.shape[0]
    scope, checks = begin(reduction="none", chunk_size=chunk_size, grad_reduction="mean", eps=eps, backend=backend,
                          gather=False, validate=validate)
    checks.finite(a, "a", deferred=True)
    checks.finite(b, "b", deferred=True)
    pos = image_text_positives(None, None, n, n, scope, a.device)
    # d^I_i = LSE_{j != i} S_ij - S_ii and d^T_i likewise over the columns: log of (B - 1) g_i
    statistic = Softmax(columns=True, columns_share_alpha=True, exclude=Exclusion(relation=pos, symmetric=True))
    d_img, d_txt = solve(Problem(a, b.to(a.dtype), 1.0 / tau, statistic, positives=pos, bound=1.0 / tau if normalize else None,
                                 options=Options(normalize, eps, chunk_size, backend)))
    if d_txt is None:
        raise RuntimeError("internal: columns=True returns the column terms")
    finish_checks((d_img, d_txt), checks, v.output_needs_check(normalize, 1.0 / tau))
    log_norm = math.log(n - 1)
    log_u_img = _mixed(log_u[:, 0].to(d_img.dtype), d_img.detach() - log_norm, gamma)
    log_u_txt = _mixed(log_u[:, 1].to(d_txt.dtype), d_txt.detach() - log_norm, gamma)
    # LibAUC's gradient: sum_j exp(h_ij / tau) / u_i grad h_ij = tau exp(d_i) / u_i grad d_i, mean over i and directions
    w_img, w_txt = torch.exp(d_img.detach() - log_u_img), torch.exp(d_txt.detach() - log_u_txt)
    surrogate = tau * ((w_img * d_img).mean() + (w_txt * d_txt).mean()) / 2
    estimate = tau * (log_u_img.mean() + log_u_txt.mean()) / 2
    return _straight(estimate, surrogate), torch.stack([log_u_img, log_u_txt], 1).to(log_u.dtype)


def _check_temperature(temperature: object) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a positive finite float, got {temperature!r}")
    return float(temperature)


def _check_gamma(gamma: object) -> float:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 < gamma <= 1:
        raise ValueError(f"gamma must be a float in (0, 1], got {gamma!r}")
    return float(gamma)


def _check_state_rows(log_u: object, n: int, dtype: torch.dtype) -> None:
    if not isinstance(log_u, Tensor):
        raise TypeError(f"log_u must be a torch.Tensor, got {type(log_u).__name__}")
    if log_u.shape != (n, 2):
        raise ValueError(f"log_u must hold the batch's state rows, shape ({n}, 2), got {tuple(log_u.shape)}")
    if log_u.dtype != dtype:
        raise TypeError(f"log_u must be {dtype} for {dtype} rows (the state's precision), got {log_u.dtype}")


class GlobalContrastiveLoss(nn.Module):
    """Global contrastive loss with its per-sample state (SogCLR / FastCLIP's GCL; SPEC §17).

    Called as ``loss_fn(a, b, index)`` with ``index`` (B,) the batch's dataset indices (from the
    data loader); it refreshes the visited samples' states and returns the running estimate of the
    global objective, whose gradient is the algorithm's (see :mod:`.global_contrastive`). Call
    :meth:`set_epoch` at the start of every epoch for the ``gamma`` schedule.

    Args:
        num_samples: the data set's size (indices lie in ``[0, num_samples)``).
        mode: ``"unimodal"`` (two views of each sample, SogCLR) or ``"bimodal"`` (image-text).
        temperature: the fixed tau (default 0.1).
        gamma: the moving average's weight of a batch (default 0.9); 1 on a sample's first visit.
        gamma_schedule: ``"constant"`` or ``"cosine"`` (from 1 at epoch 0 to ``gamma`` at
            ``gamma_decay_epochs``, FastCLIP's and LibAUC's formula).
        gamma_decay_epochs: the cosine schedule's length in epochs.
        state_dtype: the state's dtype, fp32 (default) or fp64 (for fp64 inputs).
        device: where the state lives (default CPU: two floats per sample).

    The shared options ``normalize``, ``chunk_size``, ``eps``, ``validate``, ``backend`` are documented once
    in :mod:`torch_contrastive.options`.

    The state is two buffers, ``log_u`` (num_samples, 2) and ``epoch``: saved and restored with the
    module's ``state_dict``. A batch's indices must be distinct and inside ``[0, num_samples)``
    (checked with ``validate=True``, in the call's one host read).
    """

    log_u: Tensor
    epoch: Tensor

    def __init__(self, num_samples: int, mode: str = "unimodal", temperature: float = 0.1, gamma: float = 0.9, *,
                 gamma_schedule: str = "constant", gamma_decay_epochs: int | None = None,
                 state_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 normalize: bool = True, chunk_size: int | None = None, eps: float = 1e-12, validate: bool = True,
                 backend: str = "auto") -> None:
        super().__init__()
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 2:
            raise ValueError(f"num_samples must be an int >= 2, got {num_samples!r}")
        v.check_choice(mode, "mode", MODES)
        v.check_choice(gamma_schedule, "gamma_schedule", GAMMA_SCHEDULES)
        if gamma_schedule == "cosine" and (isinstance(gamma_decay_epochs, bool) or not isinstance(gamma_decay_epochs, int)
                                           or gamma_decay_epochs < 1):
            raise ValueError(f"gamma_decay_epochs must be a positive int with gamma_schedule='cosine', got {gamma_decay_epochs!r}")
        if state_dtype not in (torch.float32, torch.float64):
            raise TypeError(f"state_dtype must be torch.float32 or torch.float64, got {state_dtype}")
        v.check_options(reduction="mean", chunk_size=chunk_size, grad_reduction="mean", eps=eps, backend=backend)
        self.num_samples, self.mode = num_samples, mode
        self.temperature, self.gamma_min = _check_temperature(temperature), _check_gamma(gamma)
        self.gamma_schedule, self.gamma_decay_epochs = gamma_schedule, gamma_decay_epochs
        self.options: dict[str, Any] = {"normalize": v.check_flag(normalize, "normalize"), "chunk_size": chunk_size,
                                        "eps": float(eps), "validate": v.check_flag(validate, "validate"), "backend": backend}
        self.register_buffer("log_u", torch.full((num_samples, 2), -math.inf, dtype=state_dtype, device=device))
        self.register_buffer("epoch", torch.zeros((), dtype=torch.int64))

    @property
    def gamma(self) -> float:
        """This epoch's gamma: constant, or cosine from 1 (epoch 0) to ``gamma`` at ``gamma_decay_epochs``.
        A sample's first visit uses 1 whatever the schedule."""
        epoch = int(self.epoch)
        if self.gamma_schedule == "constant" or epoch >= (self.gamma_decay_epochs or 0):
            return self.gamma_min
        return (1 - self.gamma_min) * 0.5 * (1 + math.cos(math.pi * epoch / (self.gamma_decay_epochs or 1))) + self.gamma_min

    def set_epoch(self, epoch: int) -> None:
        """The epoch about to start (0-based): sets the ``gamma`` schedule's value."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self.epoch.fill_(epoch)

    def forward(self, a: Tensor, b: Tensor, index: Tensor) -> Tensor:
        v.check_embeddings(a, "a")
        v.check_embeddings(b, "b")
        index = self._checked_index(index, a)
        rows = self.log_u.index_select(0, index.to(self.log_u.device)).to(a.device)
        if rows.dtype != compute_dtype(a.dtype):
            rows = rows.to(compute_dtype(a.dtype))
        loss, new = global_contrastive_loss(a, b, rows, self.temperature, self.gamma, mode=self.mode, **self.options)
        with torch.no_grad():
            self.log_u.index_copy_(0, index.to(self.log_u.device), new.to(self.log_u.device, self.log_u.dtype))
        return loss

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
        if self.options["validate"] and index.numel():
            # one host read: every index inside the data set, none repeated (two updates of one state would collide)
            ordered = index.sort().values
            low, high, repeats = torch.stack([ordered[0], ordered[-1], (ordered[1:] == ordered[:-1]).sum()]).tolist()
            if low < 0 or high >= self.num_samples:
                raise ValueError(f"index must lie in [0, {self.num_samples}) (num_samples), got values in [{low}, {high}]")
            if repeats:
                raise ValueError("index must not repeat within a batch (one state update per sample and step)")
        return index

    def extra_repr(self) -> str:
        return (f"num_samples={self.num_samples}, mode={self.mode!r}, temperature={self.temperature}, gamma={self.gamma_min}, "
                f"gamma_schedule={self.gamma_schedule!r}")
