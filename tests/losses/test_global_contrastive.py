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
from torch_contrastive.losses.global_contrastive import GlobalState, TemperatureRule

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
    loss, new = tc.global_contrastive_loss(x, y, GlobalState(log_u.to(DEVICE)), tau, 0.6, mode=mode, chunk_size=chunk)
    loss.backward()
    xr, yr = a.double().requires_grad_(), b.double().requires_grad_()
    estimate, surrogate, state = _reference(xr, yr, log_u, tau, 0.6, mode)
    surrogate.backward()
    tol = TOLS[dtype]
    assert torch.isfinite(loss) and torch.isfinite(new.log_u[:, 0]).all()
    torch.testing.assert_close(loss.double().cpu(), estimate.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(new.log_u.double().cpu(), state, rtol=tol, atol=tol)
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
                          (dict(num_samples=8, state_dtype=torch.float16), "state_dtype"),
                          (dict(num_samples=8, rho=float("nan")), "rho")):
        with pytest.raises((ValueError, TypeError), match=words):
            tc.GlobalContrastiveLoss(**kwargs)
    with pytest.raises(ValueError, match="at least 2 samples"):
        tc.global_contrastive_loss(a[:1], b[:1], GlobalState(torch.zeros(1, 2)))
    with pytest.raises(ValueError, match=r"state\.log_u"):
        tc.global_contrastive_loss(a, b, GlobalState(torch.zeros(3, 2)))
    with pytest.raises(TypeError, match=r"state\.tau"):
        tc.global_contrastive_loss(a, b, GlobalState(torch.zeros(4, 2)), temperature_mode="individual")
    with pytest.raises(TypeError, match="state must be a GlobalState"):
        tc.global_contrastive_loss(a, b, torch.zeros(4, 2))
    with pytest.raises(ValueError, match="tau_min, tau_max"):
        tc.GlobalContrastiveLoss(8, "bimodal", 0.1, temperature_mode="individual")


def test_half_inputs_keep_an_fp32_state():
    loss_fn = tc.GlobalContrastiveLoss(12, "bimodal", 0.05)
    a, b = torch.randn(6, 8).bfloat16(), torch.randn(6, 8).bfloat16()
    loss = loss_fn(a.requires_grad_(), b.requires_grad_(), torch.arange(6))
    loss.backward()
    assert loss.dtype == torch.float32 and loss_fn.log_u.dtype == torch.float32 and torch.isfinite(loss_fn.log_u[:6]).all()
    assert a.grad.dtype == torch.bfloat16 and torch.isfinite(a.grad.float()).all()


@pytest.mark.parametrize("mode", ["unimodal", "bimodal"])
def test_individual_temperatures_equal_libauc_isogclr(mode):
    """iSogCLR: each sample's tau stepped inside the loss (momentum, step, clamp) as LibAUC's
    ``enable_isogclr`` (GCLoss_v1) and ``individual_learnable`` (GCLoss_v2)."""
    lib = libauc_contrastive()
    rule = TemperatureRule(rho=0.4 if mode == "unimodal" else 5.0, lr=0.05, beta=0.7, tau_min=0.05, tau_max=0.6)
    common = dict(N=SAMPLES, tau=0.2, gamma=0.8, tau_min=rule.tau_min, tau_max=rule.tau_max, rho=rule.rho, eta=rule.lr,
                  beta=rule.beta)
    if mode == "unimodal":
        theirs = _quiet(lib.GCLoss_v1, device=torch.device("cpu"), enable_isogclr=True, **common)
        names = ("u", "learnable_tau", "grad_tau")
    else:
        theirs = _quiet(lib.GCLoss_v2, temperature_scheme="individual_learnable", **common)
        names = ("u1", "u2", "b1", "b2", "learnable_tau_img", "learnable_tau_txt", "grad_tau_img", "grad_tau_txt")
    for name in names:  # fp64 state (LibAUC starts its temperatures at fp32's 0.2)
        setattr(theirs, name, getattr(theirs, name).double().fill_(0.2) if "learnable" in name else getattr(theirs, name).double())
    ours = tc.GlobalContrastiveLoss(SAMPLES, mode, 0.2, 0.8, temperature_mode="individual", rule=rule, state_dtype=torch.float64)

    def same_state(index):
        if mode == "unimodal":
            torch.testing.assert_close(ours.tau_state[index, 0], theirs.learnable_tau[index, 0], rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(ours.tau_grad[index, 0], theirs.grad_tau[index, 0], rtol=1e-9, atol=1e-12)
        else:
            for col, (tau, grad) in enumerate(((theirs.learnable_tau_img, theirs.grad_tau_img),
                                               (theirs.learnable_tau_txt, theirs.grad_tau_txt))):
                torch.testing.assert_close(ours.tau_state[index, col], tau[index, 0], rtol=1e-9, atol=1e-12)
                torch.testing.assert_close(ours.tau_grad[index, col], grad[index, 0], rtol=1e-9, atol=1e-12)
        assert (ours.tau_state[index] != 0.2).any()  # the temperatures moved

    call = theirs if mode == "unimodal" else \
        (lambda x, y, i: theirs(F.normalize(x, dim=1), F.normalize(y, dim=1), i))
    _side_by_side(ours, theirs, 4, call, same_state)


def _learnable_tau_run(seed, n, mode, shift, gamma, rho, start, fresh=None):
    """Our loss with a learnable tau on seeded fp64 rows, backward done: ``(a, b, log_u, x, y, tau, loss, new state)``
    (unimodal: the state's unused column -inf; ``fresh``: a sample not visited yet)."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randn(n, 5, generator=g, dtype=torch.float64)
    log_u = torch.randn(n, 2, generator=g, dtype=torch.float64) + shift
    if mode == "unimodal":
        log_u[:, 1] = -math.inf
    if fresh is not None:
        log_u[fresh] = -math.inf
    tau = torch.tensor(start, dtype=torch.float64, requires_grad=True)
    x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
    loss, new = tc.global_contrastive_loss(x, y, GlobalState(log_u), tau, gamma, mode=mode, temperature_mode="global",
                                           rule=TemperatureRule(rho=rho))
    loss.backward()
    return a, b, log_u, x, y, tau, loss, new




def test_the_global_temperature_has_fastclip_v3s_gradient():
    """RGCL-g (FastCLIP-v3): ``tau_det mean(g^I / u^I + g^T / u^T) + tau (rho + mean(log u^I + log u^T) / 2)``,
    u detached: the features' and tau's gradients and the state, against float64 from that formula."""
    a, b, log_u, x, y, tau, loss, new = _learnable_tau_run(6, 7, "bimodal", 0.0, 0.6, 7.0, 0.07, fresh=3)
    xr, yr, tr = a.clone().requires_grad_(), b.clone().requires_grad_(), torch.tensor(0.07, dtype=torch.float64, requires_grad=True)
    img, txt = F.normalize(xr, dim=1), F.normalize(yr, dim=1)
    eye = torch.eye(7, dtype=torch.bool)
    total, logs = 0.0, []
    for p, q, col in ((img, txt, 0), (txt, img, 1)):
        logits = p @ q.T
        e = torch.where(eye, 0.0, ((logits - logits.diagonal()[:, None]) / tr).exp())
        g_i = e.sum(1) / 6
        old = log_u[:, col]
        u = torch.where(torch.isinf(old), g_i.detach(), 0.4 * old.exp() + 0.6 * g_i.detach())
        total = total + (g_i / u).mean()
        logs.append(u.log())
    reference = tr.detach() * total + tr * (7.0 + (logs[0].mean() + logs[1].mean()) / 2)
    reference.backward()
    torch.testing.assert_close(loss, reference.detach() - tr.detach() * total.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(new.log_u, torch.stack(logs, 1).detach(), rtol=1e-10, atol=1e-12)
    for got, want in ((x.grad, xr.grad), (y.grad, yr.grad), (tau.grad, tr.grad)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_the_global_temperature_is_a_parameter_the_optimizer_sees():
    loss_fn = tc.GlobalContrastiveLoss(12, "bimodal", 0.05, temperature_mode="global")
    assert [name for name, _ in loss_fn.named_parameters()] == ["tau"] and loss_fn.rule.rho == 8.0
    assert tc.GlobalContrastiveLoss(12, "bimodal", temperature_mode="global", rho=3.0).rule.rho == 3.0
    a, b = torch.randn(6, 4, requires_grad=True), torch.randn(6, 4, requires_grad=True)
    loss_fn(a, b, torch.arange(6)).backward()
    assert loss_fn.tau.grad is not None and torch.isfinite(loss_fn.tau.grad)


@pytest.mark.parametrize("mode", ["unimodal", "bimodal"])
def test_individual_temperatures_tiled_and_in_fp32_equal_one_fp64_tile(mode):
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(9, 6, generator=g, dtype=torch.float64), torch.randn(9, 6, generator=g, dtype=torch.float64)
    tau = 0.02 + 0.3 * torch.rand(9, 2, generator=g, dtype=torch.float64)
    state = GlobalState(torch.randn(9, 2, generator=g, dtype=torch.float64) * 2 + 5, tau,
                        torch.randn(9, 2, generator=g, dtype=torch.float64))
    rule = TemperatureRule(rho=1.0, lr=0.1, beta=0.5, tau_min=0.01, tau_max=0.5)

    def run(dtype, chunk):
        x = a.to(dtype=dtype, device=DEVICE).clone().requires_grad_()
        y = b.to(dtype=dtype, device=DEVICE).clone().requires_grad_()
        moved = GlobalState(*(t.to(dtype).to(DEVICE) for t in state))
        loss, new = tc.global_contrastive_loss(x, y, moved, 0.1, 0.7, mode=mode, temperature_mode="individual", rule=rule,
                                               chunk_size=chunk)
        loss.backward()
        return [loss.detach(), *(t[:, : 1 if mode == "unimodal" else 2] for t in new), x.grad, y.grad]

    want = run(torch.float64, None)
    for dtype, chunk, tol in ((torch.float64, 4, 1e-10), (torch.float32, None, 1e-4), (torch.float32, 4, 1e-4)):
        for got, ref in zip(run(dtype, chunk), want):
            torch.testing.assert_close(got.double().cpu(), ref.cpu(), rtol=tol, atol=tol * max(1.0, ref.abs().max().item()))


def _ranks_global(rank, world, sizes, mode, temperature_mode):
    """One rank of the gathered loss against the single-process loss on the concatenated batch, three
    steps with recurring indices: values, this rank's rows' gradients, and every rank's whole state."""
    import torch.distributed as dist

    total, lo = sum(sizes), sum(sizes[:rank])
    hi = lo + sizes[rank]
    index = torch.randperm(2 * total, generator=torch.Generator().manual_seed(5))[:total]
    kwargs = dict(temperature_mode=temperature_mode, state_dtype=torch.float64, grad_reduction="sum")
    start = 0.2 if temperature_mode != "individual" or mode == "unimodal" else 0.03
    single = tc.GlobalContrastiveLoss(2 * total, mode, start, 0.8, **kwargs)
    ranked = tc.GlobalContrastiveLoss(2 * total, mode, start, 0.8, gather=True, **kwargs)
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        a, b = torch.randn(total, 5, generator=g, dtype=torch.float64), torch.randn(total, 5, generator=g, dtype=torch.float64)
        full = [a.clone().requires_grad_(), b.clone().requires_grad_()]
        want = single(*full, index)
        want.backward()
        mine = [a[lo:hi].clone().requires_grad_(), b[lo:hi].clone().requires_grad_()]
        got = ranked(*mine, index[lo:hi])
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        for x, y in zip(mine, full):
            torch.testing.assert_close(x.grad, y.grad[lo:hi], rtol=1e-9, atol=1e-12)
        for buffer, reference in zip(ranked._state_buffers(), single._state_buffers()):
            torch.testing.assert_close(buffer, reference, rtol=1e-10, atol=1e-12, equal_nan=True)
        if temperature_mode == "global":
            summed = ranked.tau.grad.clone()
            dist.all_reduce(summed)  # DDP's job: the ranks' shares of tau's gradient add up
            torch.testing.assert_close(summed, single.tau.grad, rtol=1e-9, atol=1e-12)
            ranked.tau.grad = single.tau.grad = None


@pytest.mark.parametrize("world,mode,temperature_mode", [(2, "unimodal", "fixed"), (2, "bimodal", "global"),
                                                         (2, "unimodal", "individual"), (4, "bimodal", "individual"),
                                                         (4, "unimodal", "fixed")])
def test_gathered_ranks_equal_one_process_state_included(world, mode, temperature_mode):
    from dist_helpers import run_ranks

    run_ranks(_ranks_global, world, [3 + r for r in range(world)], mode, temperature_mode, timeout=300)


@pytest.mark.parametrize("mode", ["unimodal", "bimodal"])
def test_bf16_rows_against_the_float64_formulas(mode):
    """Half rows: an fp32 state and fp32 logits, within bf16's rounding of the inputs."""
    g = torch.Generator().manual_seed(12)
    a, b = torch.randn(8, 16, generator=g).bfloat16(), torch.randn(8, 16, generator=g).bfloat16()
    log_u = torch.randn(8, 2, generator=g) + (10.0 if mode == "unimodal" else 0.0)
    if mode == "unimodal":
        log_u[:, 1] = -math.inf
    x, y = a.clone().to(DEVICE).requires_grad_(), b.clone().to(DEVICE).requires_grad_()
    loss, new = tc.global_contrastive_loss(x, y, GlobalState(log_u.to(DEVICE)), 0.1, 0.6, mode=mode)
    loss.backward()
    xr, yr = a.double().requires_grad_(), b.double().requires_grad_()
    estimate, surrogate, state = _reference(xr, yr, log_u.double(), 0.1, 0.6, mode)
    surrogate.backward()
    assert loss.dtype == torch.float32 and new.log_u.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.double().cpu(), estimate.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new.log_u.double().cpu(), state, rtol=1e-5, atol=1e-5)
    for got, want in ((x.grad, xr.grad), (y.grad, yr.grad)):
        torch.testing.assert_close(got.double().cpu(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_libaucs_global_learnable_temperature_differs_on_purpose():
    """LibAUC's ``global_learnable`` keeps tau as a bare tensor (no optimizer sees it) whose gradient is
    ``rho + mean(u1 + u2) / 2`` of its *shifted* states (``u exp(-b)``): pinned here, so a change in the
    peer shows. Ours is FastCLIP-v3's (``rho + mean log u`` minus the negatives' term, see above), an
    ``nn.Parameter``; the features' state update is the same."""
    lib = libauc_contrastive()
    theirs = _quiet(lib.GCLoss_v2, N=SAMPLES, tau=0.1, gamma=0.7, temperature_scheme="global_learnable", rho=6.0)
    for name in ("u1", "u2", "b1", "b2"):
        setattr(theirs, name, getattr(theirs, name).double())
    theirs.tau = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    ours = tc.GlobalContrastiveLoss(SAMPLES, "bimodal", 0.1, 0.7, temperature_mode="global", rho=6.0, state_dtype=torch.float64)
    _, index, a, b = next(_batches(13, 1))
    x, y = F.normalize(a, dim=1), F.normalize(b, dim=1)
    loss, _ = theirs(x, y, index)
    loss.backward()
    shifted = (theirs.u1[index] + theirs.u2[index]).mean() / 2
    assert theirs.tau.grad == pytest.approx(6.0 + float(shifted), rel=1e-12)
    ours(a, b, index).backward()
    assert not ours.tau.grad == pytest.approx(float(theirs.tau.grad), rel=1e-3)
    torch.testing.assert_close(ours.log_u[index, 0], theirs.u1[index, 0].log() + theirs.b1[index, 0], rtol=1e-10, atol=1e-10)


def test_the_global_temperature_on_two_views_is_rgcl_g():
    """Two views with a learnable tau: ``sum_r tau_det g_r / u_r - <., pos> + tau (rho + log u_r)`` per
    view, u detached -- the features' gradient SogCLR's, tau's ``rho + log u - (g / u) E_softmax[S]``."""
    a, b, log_u, x, y, tau, _, new = _learnable_tau_run(14, 6, "unimodal", 8.0, 0.5, 0.7, 0.2)
    xr, yr, tr = a.clone().requires_grad_(), b.clone().requires_grad_(), torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    z = F.normalize(torch.cat([xr, yr]), dim=1)
    logits = z @ z.T
    pos = torch.cat([torch.arange(6, 12), torch.arange(6)])
    neg = ~torch.eye(12, dtype=torch.bool)
    neg[torch.arange(12), pos] = False
    g_r = torch.where(neg, (logits / tr).exp(), 0.0).sum(1) / 10
    u = 0.5 * torch.cat([log_u[:, 0], log_u[:, 0]]).exp() + 0.5 * g_r.detach()
    reference = (tr.detach() * g_r / u - logits[torch.arange(12), pos] + tr * (0.7 + u.log())).sum() / 6
    reference.backward()
    for got, want in ((x.grad, xr.grad), (y.grad, yr.grad), (tau.grad, tr.grad)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(new.log_u[:, 0], ((u[:6] + u[6:]) / 2).log().detach(), rtol=1e-10, atol=1e-12)


def test_fastclip_v1s_gradient_is_ours_times_a_constant():
    """FastCLIP-v1 (a fixed tau, ``mean_i(g^I_i / u^I_i + g^T_i / u^T_i)``, u detached) takes the same
    direction as LibAUC's GCLoss_v2, which we follow: its gradient is ours times ``2 / (tau (B - 1))``."""
    g = torch.Generator().manual_seed(15)
    a, b = torch.randn(7, 5, generator=g, dtype=torch.float64), torch.randn(7, 5, generator=g, dtype=torch.float64)
    log_u = torch.randn(7, 2, generator=g, dtype=torch.float64)
    x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
    tc.global_contrastive_loss(x, y, GlobalState(log_u), 0.1, 0.8, mode="bimodal")[0].backward()
    xr, yr = a.clone().requires_grad_(), b.clone().requires_grad_()
    img, txt = F.normalize(xr, dim=1), F.normalize(yr, dim=1)
    eye = torch.eye(7, dtype=torch.bool)
    total = 0.0
    for p, q, col in ((img, txt, 0), (txt, img, 1)):
        logits = p @ q.T
        g_i = torch.where(eye, 0.0, ((logits - logits.diagonal()[:, None]) / 0.1).exp()).sum(1) / 6
        u = 0.2 * log_u[:, col].exp() + 0.8 * g_i.detach()
        total = total + (g_i / u).mean()
    total.backward()
    factor = 2 / (0.1 * 6)
    torch.testing.assert_close(x.grad * factor, xr.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(y.grad * factor, yr.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mode,temperature_mode", [("unimodal", "fixed"), ("bimodal", "global"), ("unimodal", "individual")])
def test_no_host_sync_without_validation(mode, temperature_mode):
    from torch_contrastive.cli.synccount import count_host_syncs

    loss_fn = tc.GlobalContrastiveLoss(40, mode, 0.1, temperature_mode=temperature_mode, validate=False)
    a, b = torch.randn(8, 6, requires_grad=True), torch.randn(8, 6, requires_grad=True)
    index = torch.arange(8) * 3
    loss_fn(a, b, index).backward()  # the first call builds what later calls reuse
    assert count_host_syncs(lambda: loss_fn(a, b, index).backward()) == 0


@pytest.mark.parametrize("backend", ["epilogue", "triton"])
@pytest.mark.parametrize("mode,temperature_mode", [("unimodal", "individual"), ("bimodal", "global"), ("bimodal", "fixed")])
def test_the_kernel_backends_equal_the_torch_backend(backend, mode, temperature_mode):
    """The engine's GPU paths (through Triton's interpreter without CUDA) give the torch backend's values,
    gradients and states."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(16)
    a0, b0 = torch.randn(10, 8, generator=g), torch.randn(10, 8, generator=g)
    log_u = torch.randn(10, 2, generator=g) + (5.0 if mode == "unimodal" else 0.0)
    state = GlobalState(log_u, torch.full((10, 2), 0.1), torch.zeros(10, 2)) if temperature_mode == "individual" else GlobalState(log_u)
    out = {}
    for name in ("torch", backend):
        a, b = a0.clone().to(DEVICE).requires_grad_(), b0.clone().to(DEVICE).requires_grad_()
        tau = torch.tensor(0.1, device=DEVICE, requires_grad=True) if temperature_mode == "global" else 0.1
        rows = GlobalState(*(None if t is None else t.to(DEVICE) for t in state))
        loss, new = tc.global_contrastive_loss(a, b, rows, tau, 0.7, mode=mode, temperature_mode=temperature_mode, backend=name)
        loss.backward()
        out[name] = [loss.detach(), a.grad, b.grad, *(t for t in new if t is not None)]
    for got, want in zip(out[backend], out["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.nan_to_num().abs().max().item()), equal_nan=True)
