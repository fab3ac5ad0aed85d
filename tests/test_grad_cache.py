"""grad_cache: parameter gradients of a full-batch step, one micro-batch of activations at a time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_contrastive as tc
from dist_helpers import run_ranks


def _mlp(d_in=6, d_out=4, dropout=0.0, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    layers = [nn.Linear(d_in, 16), nn.ReLU(), *([nn.Dropout(dropout)] if dropout else []), nn.Linear(16, d_out)]
    return nn.Sequential(*layers).to(dtype)


def _grads(*modules):
    return [p.grad.clone() for m in modules for p in m.parameters() if p.grad is not None]


def _assert_same(a, b, tol):
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol * max(1.0, y.abs().max().item()))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
@pytest.mark.parametrize("micro", [1, 5, 7, 22, 64])
def test_one_encoder_equals_the_full_batch_step(dtype, tol, micro):
    enc = _mlp(dtype=dtype)
    x = torch.randn(22, 6, dtype=dtype, generator=torch.Generator().manual_seed(1))
    loss = tc.grad_cache(enc, x, tc.nt_xent_loss, micro, temperature=0.2, pairing="halves")
    cached = _grads(enc)
    enc.zero_grad()
    full = tc.nt_xent_loss(enc(x), temperature=0.2, pairing="halves")
    full.backward()
    assert loss.item() == pytest.approx(full.item(), rel=tol) and not loss.requires_grad
    _assert_same(cached, _grads(enc), tol)


def test_dropout_draws_the_same_masks_in_both_passes_and_the_rng_continues_as_after_one_forward():
    enc = _mlp(dropout=0.4)
    x = torch.randn(20, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(7)
    loss = tc.grad_cache(enc, x, lambda z: tc.nt_xent_loss(z, 0.3), 6)
    cached, after = _grads(enc), torch.rand(3)
    enc.zero_grad()
    # the full-batch step with the same masks: the same micro-batches, drawn in the same order, one graph
    torch.manual_seed(7)
    full = tc.nt_xent_loss(torch.cat([enc(part) for part in x.split(6)]), 0.3)
    full.backward()
    assert loss.item() == pytest.approx(full.item(), rel=1e-12)
    _assert_same(cached, _grads(enc), 1e-9)
    assert torch.equal(after, torch.rand(3))  # the generator continues where the full-batch forward left it


@pytest.mark.parametrize("learnable", [False, True])
def test_two_towers_with_a_learnable_temperature(learnable):
    image, text = _mlp(seed=1), _mlp(d_in=3, seed=2)
    loss_fn = tc.ClipLoss(0.1, learnable_temperature=learnable).double()
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(17, 6, dtype=torch.float64, generator=g), torch.randn(17, 3, dtype=torch.float64, generator=g)
    ids = torch.arange(17) % 5
    loss = tc.grad_cache([image, text], [x, t], loss_fn, 4, image_id=ids)
    cached = _grads(image, text, loss_fn)
    for m in (image, text, loss_fn):
        m.zero_grad()
    full = loss_fn(image(x), text(t), image_id=ids)
    full.backward()
    assert loss.item() == pytest.approx(full.item(), rel=1e-12)
    _assert_same(cached, _grads(image, text, loss_fn), 1e-9)
    if learnable:
        assert loss_fn.logit_scale.grad is not None and loss_fn.logit_scale.grad != 0


def test_dict_inputs_are_sliced_and_passed_as_keywords():
    class Tower(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 3).double(), nn.Linear(2, 3).double()

        def forward(self, left, right):
            return self.a(left) + self.b(right)

    tower = Tower()
    g = torch.Generator().manual_seed(4)
    batch = {"left": torch.randn(10, 4, dtype=torch.float64, generator=g), "right": torch.randn(10, 2, dtype=torch.float64, generator=g)}
    tc.grad_cache(tower, batch, tc.nt_xent_loss, 3, temperature=0.5)
    cached = _grads(tower)
    tower.zero_grad()
    tc.nt_xent_loss(tower(**batch), temperature=0.5).backward()
    _assert_same(cached, _grads(tower), 1e-9)


def test_batch_norm_in_train_mode_warns():
    enc = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).double()
    x = torch.randn(12, 6, dtype=torch.float64)
    with pytest.warns(UserWarning, match="BatchNorm1d in train mode"):
        tc.grad_cache(enc, x, tc.nt_xent_loss, 4)
    enc.eval()
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")
        tc.grad_cache(enc, x, tc.nt_xent_loss, 4)


@pytest.mark.parametrize("call,exc,words", [
    (lambda e, x: tc.grad_cache(e, x, tc.nt_xent_loss, 0), ValueError, "micro_batch must be a positive int"),
    (lambda e, x: tc.grad_cache([e, e], [x, x, x], tc.nt_xent_loss, 2), ValueError, "pair up"),
    (lambda e, x: tc.grad_cache(e, x, lambda z: z.sum(1), 2), TypeError, "scalar tensor"),
    (lambda e, x: tc.grad_cache(e, x, "loss", 2), TypeError, "loss_fn must be callable"),
    (lambda e, x: tc.grad_cache(e, [1, 2], tc.nt_xent_loss, 2), TypeError, "tensor or a dict"),
    (lambda e, x: tc.grad_cache(e, {"a": x, "b": x[:3]}, tc.nt_xent_loss, 2), ValueError, "same batch size"),
    (lambda e, x: tc.grad_cache("net", x, tc.nt_xent_loss, 2), TypeError, "nn.Module"),
])
def test_bad_input(call, exc, words):
    with pytest.raises(exc, match=words):
        call(_mlp(), torch.randn(8, 6, dtype=torch.float64))


def _ddp_step(rank, world, sizes):
    from torch.nn.parallel import DistributedDataParallel as DDP

    enc = _mlp(seed=0)
    g = torch.Generator().manual_seed(11)
    x_all = torch.randn(sum(sizes), 6, dtype=torch.float64, generator=g)
    labels_all = torch.randint(0, 3, (sum(sizes),), generator=g)
    lo = sum(sizes[:rank])
    mine, labels = x_all[lo : lo + sizes[rank]], labels_all[lo : lo + sizes[rank]]
    model = DDP(enc)
    calls = []
    original = model.no_sync

    def counting_no_sync():
        calls.append(1)
        return original()

    model.no_sync = counting_no_sync
    loss = tc.grad_cache(model, mine, tc.supcon_loss, 3, labels=labels, temperature=0.2, gather=True)
    assert len(calls) == -(-sizes[rank] // 3) - 1  # every micro-batch but the last under no_sync
    ref = _mlp(seed=0)
    full = tc.supcon_loss(ref(x_all), labels_all, temperature=0.2)
    full.backward()
    assert loss.item() == pytest.approx(full.item(), rel=1e-12)
    _assert_same(_grads(enc), _grads(ref), 1e-9)  # DDP averaged the all-reduced gradients once


@pytest.mark.parametrize("sizes", [[7, 7], [5, 9]])
def test_ddp_with_gather_equals_single_process_full_batch(sizes):
    run_ranks(_ddp_step, 2, sizes)
