"""The engine's products (engine/products.py): bf16 rows on tensor cores (the factor scheme, simulated on a CPU with
widened operands: the same numbers) on the tiles of the general executors and on one tile, against the float64
formulas."""

from __future__ import annotations

import pytest
import torch

import reference as ref
import torch_contrastive as tc
from device import DEVICE
from helpers import softmax_cases
from torch_contrastive.engine import planner, products


def _cases(labels):
    return [
        *softmax_cases(labels),
        ("pml", lambda a, b, chunk: tc.nt_xent_loss(a, 0.1, labels=labels, chunk_size=chunk, backend="torch"),
         lambda a, b: ref.nt_xent_pml(a, labels.cpu(), 0.1), (True, False)),
        ("nt_bxent", lambda a, b, chunk: tc.nt_bxent_loss(a, temperature=0.2, labels=labels, chunk_size=chunk, backend="torch"),
         lambda a, b: ref.nt_bxent(a, 0.2, labels=labels.cpu()), (True, False)),
    ]


@pytest.mark.parametrize("chunk", [16, None])
def test_tensor_core_products_on_tiles_and_one_tile_equal_the_float64_formulas(monkeypatch, chunk):
    """bf16 rows on a GPU plan's tensor-core products (simulated), the torch backend: on strips of 16 rows the
    general executors multiply the caller's bf16 rows with fp32 factors (HalfProducts) -- values to fp32 round-off,
    gradients to bf16's rounding."""
    monkeypatch.setattr(planner, "PRODUCTS", "half")
    made = []
    real = products.HalfProducts.__init__

    def counted(self, *args):
        made.append(args[0].dtype)
        real(self, *args)
    monkeypatch.setattr(products.HalfProducts, "__init__", counted)
    n = 38
    labels = torch.arange(n, device=DEVICE) % 5
    g = torch.Generator().manual_seed(8)
    x, y = ((torch.randn(n, 12, generator=g, dtype=torch.float64) * 2).bfloat16() for _ in range(2))
    for name, ours, formula, grads in _cases(labels):
        a, b = (t.to(DEVICE).clone().requires_grad_(w) for t, w in zip((x, y), grads))
        before = len(made)
        with planner.simulate("cuda"):
            got = ours(a, b, chunk)
            got.backward()
        if chunk is not None:  # the tiles take the general executors' tensor-core products
            assert len(made) > before, name
        wides = [t.double().requires_grad_(w) for t, w in zip((x, y), grads)]
        want = formula(*wides)
        want.backward()
        assert float(got.detach()) == pytest.approx(float(want.detach()), rel=2e-6), name
        for low, wide in zip((a, b), wides):
            if wide.grad is not None:
                err = float((low.grad.double().cpu() - wide.grad).abs().max() / wide.grad.abs().max())
                assert low.grad.dtype == torch.bfloat16 and err < 1e-2, (name, err)
    assert set(made) <= {torch.bfloat16}


def test_a_learnable_temperature_on_tensor_core_products_gets_the_float64_gradient(monkeypatch):
    """A tensor scale (a learnable temperature) on tensor-core tiles: its gradient needs the rounding remainder's
    product (HalfProducts.split_rows), checked against float64."""
    monkeypatch.setattr(planner, "PRODUCTS", "half")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 8, generator=g).bfloat16().to(DEVICE).requires_grad_()
    y = x.detach().flip(0)
    tau = torch.tensor(0.1, device=DEVICE, requires_grad=True)
    with planner.simulate("cuda"):
        tc.image_text_contrastive_loss(x, y, tau, chunk_size=8).backward()
    tau64 = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    ref.image_text(x.detach().double().cpu(), y.double().cpu(), tau64).backward()
    assert float(tau.grad) == pytest.approx(float(tau64.grad), rel=1e-4)
