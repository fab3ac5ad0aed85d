"""Device-agnostic code: on CUDA the losses match the CPU numbers (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

import torch_contrastive as tc

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@cuda
@pytest.mark.parametrize("chunk", [None, 16])
def test_cuda_matches_cpu(chunk):
    torch.manual_seed(0)
    x, y = torch.randn(40, 8), torch.randn(40, 8)
    labels = torch.randint(0, 5, (40,))
    pairs = torch.randint(0, 40, (30, 2))
    calls = [
        lambda a, b, lab, p: tc.nt_xent_loss(a, 0.1, chunk_size=chunk),
        lambda a, b, lab, p: tc.nt_xent_loss(a, 0.1, labels=lab, chunk_size=chunk),
        lambda a, b, lab, p: tc.nt_bxent_loss(a, p, 0.1, chunk_size=chunk),
        lambda a, b, lab, p: tc.image_text_contrastive_loss(a, b, 0.07, lab, chunk_size=chunk),
        lambda a, b, lab, p: tc.supcon_loss(a, lab, temperature=0.1, chunk_size=chunk),
    ]
    for fn in calls:
        xc, yc = x.clone().requires_grad_(), y.clone().requires_grad_()
        xg, yg = x.cuda().requires_grad_(), y.cuda().requires_grad_()
        ref = fn(xc, yc, labels, pairs)
        got = fn(xg, yg, labels.cuda(), pairs.cuda())
        ref.backward()
        got.backward()
        assert got.device.type == "cuda"
        torch.testing.assert_close(got.cpu(), ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(xg.grad.cpu(), xc.grad, rtol=1e-4, atol=1e-5)


def test_cpu_inputs_stay_on_cpu():
    x = torch.randn(6, 3)
    loss = tc.nt_xent_loss(x)
    assert loss.device.type == "cpu"
