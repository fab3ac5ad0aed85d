"""The engine's products (engine/products.py): bf16 rows on tensor cores from split operands, on every tile of the
general executors, against the float64 formulas."""

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
def test_split_products_on_every_tile_equal_the_float64_formulas(monkeypatch, chunk):
    """bf16 rows on a GPU plan's tensor-core products (simulated), the torch backend: on strips of 16 rows the split
    products serve the general executors, one tile the lean executors (their own split) -- values to fp32
    round-off, gradients to bf16's rounding."""
    monkeypatch.setattr(planner, "PRODUCTS", "half")
    made = []
    real = products.SplitProducts.__init__

    def counted(self, *args):
        made.append(args[3])
        real(self, *args)
    monkeypatch.setattr(products.SplitProducts, "__init__", counted)
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
        assert (len(made) > before) == (chunk is not None), name  # (one tile: the lean executors' own split)
        wides = [t.double().requires_grad_(w) for t, w in zip((x, y), grads)]
        want = formula(*wides)
        want.backward()
        assert float(got.detach()) == pytest.approx(float(want.detach()), rel=2e-6), name
        for low, wide in zip((a, b), wides):
            if wide.grad is not None:
                err = float((low.grad.double().cpu() - wide.grad).abs().max() / wide.grad.abs().max())
                assert low.grad.dtype == torch.bfloat16 and err < 1e-2, (name, err)
    assert set(made) == ({torch.bfloat16} if chunk else set())


def test_a_learnable_temperature_keeps_the_factor_products(monkeypatch):
    """A tensor scale (a learnable temperature) keeps the factor scheme: its gradient needs the remainder product."""
    monkeypatch.setattr(planner, "PRODUCTS", "half")
    made = []
    monkeypatch.setattr(products.SplitProducts, "__init__", lambda self, *args: made.append(args))
    x = torch.randn(20, 8, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    tau = torch.tensor(0.1, device=DEVICE, requires_grad=True)
    with planner.simulate("cuda"):
        tc.image_text_contrastive_loss(x, x.detach().flip(0), tau, chunk_size=8).backward()
    assert made == [] and tau.grad is not None


def test_the_split_pays_below_the_features_the_cost_model_sets():
    """The split product trades two fp32 read-write passes of the logits for two more GEMM-equivalents: taken
    below ``4 * FLOP rate / bandwidth`` features (the cost model's H100: about 1,100), the factor scheme above;
    and only where the problem spans tiles (one tile, where the general executor serves it, is host-bound)."""
    from torch_contrastive.engine.cost import GPUS

    h100 = GPUS["H100"]
    assert products.SPLIT_FEATURES == int(4 * h100.gemm_flops["bfloat16"] / h100.bandwidth)
    for dim, split in ((products.SPLIT_FEATURES - 1, True), (products.SPLIT_FEATURES, False)):
        raw = torch.randn(4, dim, device=DEVICE).bfloat16()
        rows, norm = torch.nn.functional.normalize(raw.float(), dim=1), raw.float().norm(dim=1, keepdim=True)
        made = products.make_products(True, (raw, None), None, rows, rows, 10.0, [norm, norm], True, True)
        assert isinstance(made, products.SplitProducts) == split, dim
        assert isinstance(products.make_products(True, (raw, None), None, rows, rows, 10.0, [norm, norm], False, True),
                          products.HalfProducts)  # rows as given: the split's fp16 parts may leave their range
        assert isinstance(products.make_products(True, (raw, None), None, rows, rows, 10.0, [norm, norm], True, False),
                          products.HalfProducts)  # one tile: the split's launches are not paid back


@pytest.mark.parametrize("kind", ["split", "fp32", "fp64", "factors"])
def test_offset_logits_equal_the_offset_less_the_float64_logits(kind):
    """``o_i - S_ij`` from one GEMM of widened operands (products.offset_logits) -- the split products' fp16 parts of
    ``o`` to fp32 round-off of the logits' size, the compute-dtype products as exact as their GEMM, the factor
    products subtracting -- on an inner tile, a row's ``-inf`` (no negatives) kept as ``-inf``."""
    g = torch.Generator().manual_seed(4)
    a = torch.nn.functional.normalize(torch.randn(21, 24, generator=g, dtype=torch.float64), dim=1).to(DEVICE)
    b = torch.nn.functional.normalize(torch.randn(17, 24, generator=g, dtype=torch.float64), dim=1).to(DEVICE)
    offsets = torch.randn(21, generator=g, dtype=torch.float64).to(DEVICE) * 30
    offsets[5] = float("-inf")
    scale = 10.0
    if kind == "split":
        dtype = torch.float32
        prod = products.SplitProducts(a.float(), b.float(), scale, torch.bfloat16)
    elif kind == "factors":
        dtype = torch.float32
        raw_a, raw_b = a.to(torch.bfloat16), b.to(torch.bfloat16)
        a, b = raw_a.double(), raw_b.double()
        prod = products.HalfProducts(raw_a, raw_b, a.float(), None, None, scale)
    else:
        dtype = torch.float32 if kind == "fp32" else torch.float64
        prod = products.Products(None, a.to(dtype), b.to(dtype), scale)
    tile = products.offset_logits(prod, offsets.to(dtype))
    got = tile(3, 19, 2, 15, torch.empty(16, 13, dtype=dtype, device=DEVICE))
    want = offsets[3:19, None] - scale * a[3:19] @ b[2:15].T
    assert torch.isneginf(got[2]).all()
    finite = torch.ones(16, dtype=torch.bool, device=DEVICE)
    finite[2] = False
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got[finite].double(), want[finite], rtol=0, atol=tol)
