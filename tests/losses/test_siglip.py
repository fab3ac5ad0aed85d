"""SigLIP: float64 reference, open_clip, stability, ids, tiles, module, bad input."""

from __future__ import annotations

import math

import pytest
import torch

import torch_contrastive as tc
from reference import siglip
from torch_contrastive.cli.bench import load_open_clip_loss

DTYPES = [
    (torch.float64, (1e-9, 1e-9)),
    (torch.float32, (1e-5, 1e-5)),
    (torch.float16, (2e-5, 2e-3)),
    (torch.bfloat16, (2e-5, 1e-2)),
]


def _rand(n, d=5, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("dtype,tols", DTYPES)
@pytest.mark.parametrize("chunk", [None, 4])
@pytest.mark.parametrize("n", [1, 7, 13])
@pytest.mark.parametrize("ids", ["none", "image", "both"])
def test_matches_float64_reference_values_and_gradients(dtype, tols, chunk, n, ids):
    g = torch.Generator().manual_seed(n)
    iid = torch.randint(0, max(1, n // 2), (n,), generator=g) if ids != "none" else None
    tid = torch.randint(0, max(1, n // 3), (n,), generator=g) if ids == "both" else None
    rtol, grad_tol = tols
    a, b = _rand(n, seed=n).to(dtype), _rand(n, seed=n + 50).to(dtype)
    ref_in = [a.double().clone().requires_grad_(), b.double().clone().requires_grad_()]
    ref_p = [torch.tensor(7.0, dtype=torch.float64, requires_grad=True), torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)]
    ref = siglip(*ref_in, *ref_p, iid, tid)
    ref.backward()
    pdtype = torch.float64 if dtype == torch.float64 else torch.float32
    our_in = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    our_p = [torch.tensor(7.0, dtype=pdtype, requires_grad=True), torch.tensor(-3.0, dtype=pdtype, requires_grad=True)]
    ours = tc.siglip_loss(*our_in, *our_p, iid, tid, chunk_size=chunk)
    ours.backward()
    assert ours.item() == pytest.approx(ref.item(), rel=rtol, abs=rtol)
    for got, want in zip(our_in, ref_in):
        assert got.grad.dtype == dtype
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=grad_tol, atol=grad_tol * max(1.0, want.grad.abs().max().item()))
    for got, want in zip(our_p, ref_p):
        assert got.grad.item() == pytest.approx(want.grad.item(), rel=10 * rtol, abs=10 * rtol)


def _open_clip_loss_module():
    """open_clip's loss.py loaded on its own (the package imports torchvision, which does not import here)."""
    try:
        return load_open_clip_loss()
    except ModuleNotFoundError:
        pytest.skip("open_clip_torch is not installed (make test installs it with --no-deps)")


@pytest.mark.parametrize("seed", range(8))
def test_equals_open_clip_siglip_loss(seed):
    peer = _open_clip_loss_module().SigLipLoss()
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 40, (1,), generator=g))
    img, txt = torch.randn(n, 16, generator=g), torch.randn(n, 16, generator=g)
    log_scale = torch.tensor(float(torch.rand((), generator=g)) * 4, requires_grad=True)
    bias = torch.tensor(float(torch.randn((), generator=g)) * 5, requires_grad=True)
    img_p, txt_p = img.clone().requires_grad_(), txt.clone().requires_grad_()
    ref = peer(torch.nn.functional.normalize(img_p, dim=1), torch.nn.functional.normalize(txt_p, dim=1), log_scale.exp(), bias)
    ref_grads = torch.autograd.grad(ref, [img_p, txt_p, log_scale, bias])
    ours_in = [img.clone().requires_grad_(), txt.clone().requires_grad_(), log_scale.detach().clone().requires_grad_(),
               bias.detach().clone().requires_grad_()]
    ours = tc.siglip_loss(ours_in[0], ours_in[1], ours_in[2].exp(), ours_in[3], chunk_size=7 if seed % 2 else None)
    grads = torch.autograd.grad(ours, ours_in)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bias", [-20.0, 20.0])
def test_stable_at_scale_100_and_large_bias(bias):
    # Confident model: positives aligned, negatives orthogonal. The per-pair terms are tiny
    # (e^-80) but not zero, and so are their gradients; log(sigmoid) or softplus(s) - s lose them.
    x = torch.eye(6, 6, dtype=torch.float64)[:, :6] + 0.01 * _rand(6, d=6, seed=3)
    ref_in = x.clone().requires_grad_()
    ref = siglip(ref_in, ref_in.detach(), 100.0, bias)
    ref.backward()
    ours_in = x.float().requires_grad_()
    ours = tc.siglip_loss(ours_in, x.float(), 100.0, bias)
    ours.backward()
    assert math.isfinite(ours.item()) and torch.isfinite(ours_in.grad).all()
    assert ours.item() == pytest.approx(ref.item(), rel=1e-4)
    torch.testing.assert_close(ours_in.grad.double(), ref_in.grad, rtol=1e-3, atol=1e-3 * ref_in.grad.abs().max().item())


def test_reductions():
    a, b = _rand(9, seed=1), _rand(9, seed=2)
    per = tc.siglip_loss(a, b, 10.0, -10.0, reduction="none")
    assert per.shape == (9,)
    assert tc.siglip_loss(a, b, 10.0, -10.0).item() == pytest.approx(per.sum().item() / 9, rel=1e-12)
    assert tc.siglip_loss(a, b, 10.0, -10.0, reduction="sum").item() == pytest.approx(per.sum().item(), rel=1e-12)


def test_module_owns_learnable_scale_and_bias():
    m = tc.SigLipLoss()
    assert m.logit_scale.item() == pytest.approx(math.log(10.0)) and m.logit_bias.item() == -10.0
    a, b = _rand(8, seed=3).float(), _rand(8, seed=4).float()
    m(a, b).backward()
    assert m.logit_scale.grad is not None and m.logit_scale.grad.abs() > 0
    assert m.logit_bias.grad is not None and m.logit_bias.grad.abs() > 0
    fixed = tc.SigLipLoss(5.0, 1.0, learnable=False)
    assert not list(fixed.parameters()) and "logit_scale" in dict(fixed.named_buffers())
    assert fixed(a, b).item() == pytest.approx(tc.siglip_loss(a, b, 5.0, 1.0).item(), rel=1e-6)
    assert "logit_bias" in repr(m)


@pytest.mark.parametrize("call,exc,words", [
    (lambda a, b: tc.siglip_loss(a, b, 0.0, -10.0), ValueError, "logit_scale"),
    (lambda a, b: tc.siglip_loss(a, b, float("inf"), -10.0), ValueError, "logit_scale"),
    (lambda a, b: tc.siglip_loss(a, b, torch.tensor(-1.0), -10.0), ValueError, "logit_scale"),
    (lambda a, b: tc.siglip_loss(a, b, 10.0, float("nan")), ValueError, "logit_bias"),
    (lambda a, b: tc.siglip_loss(a, b, 10.0, torch.tensor(float("inf"))), ValueError, "logit_bias"),
    (lambda a, b: tc.siglip_loss(a, b, 10.0, "x"), TypeError, "logit_bias"),
    (lambda a, b: tc.siglip_loss(a, b[:3], 10.0, -10.0), ValueError, "batch size"),
    (lambda a, b: tc.siglip_loss(a, b, 10.0, -10.0, image_id=torch.arange(3)), ValueError, "image_id"),
    (lambda a, b: tc.siglip_loss(a, b, 10.0, -10.0, reduction="avg"), ValueError, "reduction"),
    (lambda a, b: tc.SigLipLoss(init_logit_scale=-1.0), ValueError, "init_logit_scale"),
    (lambda a, b: tc.SigLipLoss(init_logit_bias=float("nan")), ValueError, "init_logit_bias"),
])
def test_bad_input(call, exc, words):
    a, b = _rand(5, seed=5), _rand(5, seed=6)
    before = (a.clone(), b.clone())
    with pytest.raises(exc, match=words):
        call(a, b)
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])


def test_tiled_never_holds_the_full_matrix():
    # Tiles of 16 rows on 64 rows: same value and gradients as one tile.
    a, b = _rand(64, d=8, seed=7), _rand(64, d=8, seed=8)
    ids = torch.arange(64) // 3
    for kwargs in ({}, {"image_id": ids}):
        results = []
        for chunk in (None, 16):
            x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
            loss = tc.siglip_loss(x, y, 12.0, -4.0, chunk_size=chunk, **kwargs)
            loss.backward()
            results.append((loss.detach(), x.grad, y.grad))
        for u, w in zip(*results):
            torch.testing.assert_close(u, w, rtol=1e-12, atol=1e-12)
