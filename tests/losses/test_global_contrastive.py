"""The global contrastive losses (SPEC §17) against LibAUC 2.0.1's ``GCLoss_v1`` / ``GCLoss_v2``
(its ``losses/contrastive.py`` loaded alone) and an independent float64 formula: gradients and the
per-sample state over several steps with recurring indices, the log-domain state at tau = 0.01,
tiles, the module's state and its checks."""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch
import torch.nn.functional as F

import torch_contrastive as tc
from device import DEVICE
from peers import libauc_contrastive

B, D, SAMPLES = 6, 5, 18


def _batches(seed: int, steps: int, dtype: torch.dtype = torch.float64):
    """Two epochs over a fixed partition of SAMPLES indices into batches of B: every sample is
    first visited in epoch 0, then revisited."""
    g = torch.Generator().manual_seed(seed)
    parts = torch.randperm(SAMPLES, generator=g).reshape(-1, B)
    for step in range(steps):
        epoch, k = divmod(step, parts.shape[0])
        yield epoch, parts[k], torch.randn(B, D, generator=g, dtype=dtype), torch.randn(B, D, generator=g, dtype=dtype)


def _quiet(fn, *args, **kwargs):
    with contextlib.redirect_stdout(io.StringIO()):  # LibAUC prints its gamma
        return fn(*args, **kwargs)


def _grads(loss_fn, a, b, index):
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    out = loss_fn(a, b, index)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return a.grad, b.grad


def _side_by_side(ours, theirs, seed, call_theirs, same_state):
    """Two epochs of steps through both losses: the gradients equal at every step, then the state."""
    last = -1
    for epoch, index, a, b in _batches(seed, 6):
        if epoch != last:
            _quiet(theirs.adjust_gamma, epoch)
            ours.set_epoch(epoch)
            last = epoch
        for got, want in zip(_grads(ours, a, b, index), _grads(call_theirs, a, b, index)):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
        same_state(index)


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
@pytest.mark.parametrize("tau", [0.1, 0.5])
def test_unimodal_equals_libauc_gcloss_v1(schedule, tau):
    lib = libauc_contrastive()
    theirs = _quiet(lib.GCLoss_v1, N=SAMPLES, tau=tau, gamma=0.8, device=torch.device("cpu"), gamma_schedule=schedule,
                    gamma_decay_epochs=3)
    ours = tc.GlobalContrastiveLoss(SAMPLES, "unimodal", tau, 0.8, gamma_schedule=schedule, gamma_decay_epochs=3,
                                    state_dtype=torch.float64)
    theirs.u = theirs.u.double()

    def same_state(index):
        torch.testing.assert_close(ours.log_u[index, 0].exp(), theirs.u[index, 0], rtol=1e-10, atol=0)

    _side_by_side(ours, theirs, 0, theirs, same_state)
    assert torch.isinf(ours.log_u[:, 1]).all()  # the unimodal state's unused column


@pytest.mark.parametrize("tau", [0.1, 0.02])
def test_bimodal_equals_libauc_gcloss_v2(tau):
    lib = libauc_contrastive()
    theirs = _quiet(lib.GCLoss_v2, N=SAMPLES, tau=tau, gamma=0.7)
    for name in ("u1", "u2", "b1", "b2"):
        setattr(theirs, name, getattr(theirs, name).double())
    ours = tc.GlobalContrastiveLoss(SAMPLES, "bimodal", tau, 0.7, state_dtype=torch.float64)

    def same_state(index):
        # LibAUC keeps u shifted by its running maximum b: log u = log u' + b
        for col, (u, shift) in enumerate(((theirs.u1, theirs.b1), (theirs.u2, theirs.b2))):
            torch.testing.assert_close(ours.log_u[index, col], u[index, 0].log() + shift[index, 0], rtol=1e-10, atol=1e-10)

    # GCLoss_v2 takes normalised features (it does not normalise)
    _side_by_side(ours, theirs, 1, lambda x, y, i: theirs(F.normalize(x, dim=1), F.normalize(y, dim=1), i), same_state)


def _reference(a, b, log_u, tau, gamma, mode):
    """float64 from the formulas: (estimate, the surrogate whose gradient is the algorithm's, new state)."""
    a, b = F.normalize(a.double(), dim=1), F.normalize(b.double(), dim=1)
    n = a.shape[0]
    log_u = log_u.double()
    eye = torch.eye(n, dtype=torch.bool)

    def mix(old, g):
        new = (1 - gamma) * old.exp() + gamma * g
        return torch.where(torch.isinf(old), g, new)

    if mode == "bimodal":
        out = []
        for x, y, col in ((a, b, 0), (b, a, 1)):
            logits = x @ y.T
            h = (logits - logits.diagonal()[:, None]) / tau
            e = torch.where(eye, 0.0, h.exp())
            u = mix(log_u[:, col], e.sum(1) / (n - 1))
            surrogate = ((e / u[:, None]).detach() * (logits - logits.diagonal()[:, None])).sum(1).mean()
            out.append((tau * u.log().mean(), surrogate, u.log()))
        return (out[0][0] + out[1][0]) / 2, (out[0][1] + out[1][1]) / 2, torch.stack([out[0][2], out[1][2]], 1)
    z = torch.cat([a, b])
    logits = z @ z.T
    pos = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    neg = ~torch.eye(2 * n, dtype=torch.bool)
    neg[torch.arange(2 * n), pos] = False
    e = torch.where(neg, (logits / tau).exp(), 0.0)
    g = e.sum(1) / (2 * (n - 1))
    u = torch.cat([mix(log_u[:, 0], g[:n]), mix(log_u[:, 0], g[n:])])
    l_pos = logits[torch.arange(2 * n), pos]
    surrogate = (-l_pos + ((e / u[:, None]).detach() * logits).sum(1) / (2 * (n - 1))).sum() / n
    estimate = (tau * u.log() - l_pos).sum() / n
    state = ((u[:n] + u[n:]) / 2).log()
    return estimate, surrogate, torch.stack([state, torch.full_like(state, -math.inf)], 1)


TOLS = {torch.float64: 1e-10, torch.float32: 2e-5}


@pytest.mark.parametrize("mode", ["unimodal", "bimodal"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("tau", [0.01, 0.1])
@pytest.mark.parametrize("chunk", [None, 4])
def test_the_engine_path_equals_the_float64_formulas(mode, dtype, tau, chunk):
    """One tile and tiles, fp32 and fp64, tau = 0.01 (exp(h / tau) beyond fp32: the state is a log),
    a visited and a fresh sample in one batch."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(7, 9, generator=g, dtype=dtype)
    b = (a + 0.5 * torch.randn(7, 9, generator=g, dtype=dtype))
    log_u = torch.randn(7, 2, generator=g, dtype=dtype) * 3 + (1.0 / tau if mode == "unimodal" else 0.0)
    log_u[2] = -math.inf  # not visited yet
    if mode == "unimodal":
        log_u[:, 1] = -math.inf
    x, y = a.clone().to(DEVICE).requires_grad_(), b.clone().to(DEVICE).requires_grad_()
    loss, new = tc.global_contrastive_loss(x, y, log_u.to(DEVICE), tau, 0.6, mode=mode, chunk_size=chunk)
    loss.backward()
    xr, yr = a.double().requires_grad_(), b.double().requires_grad_()
    estimate, surrogate, state = _reference(xr, yr, log_u, tau, 0.6, mode)
    surrogate.backward()
    tol = TOLS[dtype]
    assert torch.isfinite(loss) and torch.isfinite(new[:, 0]).all()
    torch.testing.assert_close(loss.double().cpu(), estimate.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(new.double().cpu(), state, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double().cpu(), xr.grad, rtol=tol, atol=tol * max(1.0, xr.grad.abs().max().item()))
    torch.testing.assert_close(y.grad.double().cpu(), yr.grad, rtol=tol, atol=tol * max(1.0, yr.grad.abs().max().item()))


def test_the_module_state_survives_a_state_dict_round_trip():
    first = tc.GlobalContrastiveLoss(SAMPLES, "bimodal", 0.1, gamma_schedule="cosine", gamma_decay_epochs=4)
    steps = list(_batches(2, 5, torch.float32))
    for _, index, a, b in steps[:3]:
        first(a, b, index)
    first.set_epoch(2)
    second = tc.GlobalContrastiveLoss(SAMPLES, "bimodal", 0.1, gamma_schedule="cosine", gamma_decay_epochs=4)
    second.load_state_dict(first.state_dict())
    assert second.gamma == first.gamma == pytest.approx((1 - 0.9) * 0.5 * (1 + math.cos(math.pi * 2 / 4)) + 0.9)
    for _, index, a, b in steps[3:]:
        assert torch.equal(first(a, b, index), second(a, b, index))
    assert torch.equal(first.log_u, second.log_u)


def test_the_module_refuses_bad_indices_and_options():
    loss_fn = tc.GlobalContrastiveLoss(10, "unimodal")
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    for index, words in ((torch.tensor([0, 1, 2, 10]), "index must lie in"), (torch.tensor([0, 1, 1, 2]), "must not repeat"),
                         (torch.tensor([0, 1, 2]), "one entry per row"), (torch.tensor([0.0, 1, 2, 3]), "integer tensor"),
                         (torch.tensor([-1, 1, 2, 3]), "index must lie in")):
        with pytest.raises((ValueError, TypeError), match=words):
            loss_fn(a, b, index)
    assert torch.isinf(loss_fn.log_u).all()  # nothing was updated by a refused call
    with pytest.raises(ValueError, match="larger than the data set"):
        tc.GlobalContrastiveLoss(3)(torch.randn(4, 3), torch.randn(4, 3), torch.arange(4))
    for kwargs, words in ((dict(num_samples=1), "num_samples"), (dict(num_samples=8, mode="x"), "mode"),
                          (dict(num_samples=8, gamma=0.0), "gamma"), (dict(num_samples=8, temperature=-1.0), "temperature"),
                          (dict(num_samples=8, gamma_schedule="cosine"), "gamma_decay_epochs"),
                          (dict(num_samples=8, state_dtype=torch.float16), "state_dtype")):
        with pytest.raises((ValueError, TypeError), match=words):
            tc.GlobalContrastiveLoss(**kwargs)
    with pytest.raises(ValueError, match="at least 2 samples"):
        tc.global_contrastive_loss(a[:1], b[:1], torch.zeros(1, 2))
    with pytest.raises(ValueError, match="log_u"):
        tc.global_contrastive_loss(a, b, torch.zeros(3, 2))


def test_half_inputs_keep_an_fp32_state():
    loss_fn = tc.GlobalContrastiveLoss(12, "bimodal", 0.05)
    a, b = torch.randn(6, 8).bfloat16(), torch.randn(6, 8).bfloat16()
    loss = loss_fn(a.requires_grad_(), b.requires_grad_(), torch.arange(6))
    loss.backward()
    assert loss.dtype == torch.float32 and loss_fn.log_u.dtype == torch.float32 and torch.isfinite(loss_fn.log_u[:6]).all()
    assert a.grad.dtype == torch.bfloat16 and torch.isfinite(a.grad.float()).all()
