"""NT-BXent's strips on a GPU plan (engine/pair_strips.py): one signed tile per pair of row and column blocks, the
backward products factored through ``[sig ; Q]`` -- against the float64 formula, for a label relation's triangle
(label-sorted or not) and listed index pairs' full walk, in the compute dtype and on tensor-core products."""

from __future__ import annotations

import pytest
import torch

import reference as ref
import torch_contrastive as tc
from device import DEVICE
from torch_contrastive.engine import pair_strips, pairwise, planner
from torch_contrastive.engine.cost import pair_factoring_pays


def _spied(monkeypatch):
    walks = []
    real = pair_strips.binary_backward

    def spy(prod, a, b, grads, plan):
        walks.append((plan.symmetric, prod.half))
        return real(prod, a, b, grads, plan)
    monkeypatch.setattr(pairwise.pair_strips, "binary_backward", spy)
    return walks


@pytest.mark.parametrize("products", ["compute", "half"])
@pytest.mark.parametrize("relation", ["labels", "sorted labels", "index pairs", "labels, rows as given"])
def test_the_strips_equal_the_float64_formula(relation, products, monkeypatch):
    """Strips of 8 rows on the simulated GPU plan: float64 rows to 1e-10, bf16 rows on tensor cores to bf16's
    rounding; a label relation walks its triangle (sorted by label: the all-negative tiles without the relation),
    listed pairs -- directional, so not symmetric -- every tile; rows as given too (where the normalisation's
    backward would not hide a gradient along a row's own direction, such as the self pair's)."""
    monkeypatch.setattr(planner, "PRODUCTS", products)
    walks = _spied(monkeypatch)
    n = 29
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64) * (0.3 if relation.endswith("given") else 2)
    normalize = not relation.endswith("given")  # (rows as given: the self pair's gradient would show)
    labels = torch.arange(n) % 5
    pairs = torch.tensor([[0, 3], [3, 0], [4, 9], [10, 2], [17, 28], [28, 17], [20, 21]])
    dtype = torch.float64 if products == "compute" else torch.bfloat16
    kwargs = {"pos_indices": pairs.to(DEVICE)} if relation == "index pairs" else {"labels": labels.to(DEVICE)}
    ours = x.to(dtype).to(DEVICE).requires_grad_()
    with planner.simulate("cuda"):
        got = tc.nt_bxent_loss(ours, temperature=0.2, chunk_size=8, backend="torch", validate=relation == "sorted labels",
                               normalize=normalize, **kwargs)
        got.backward()
    assert walks == [(relation != "index pairs", products == "half")]
    wide = x.to(dtype).double().requires_grad_()
    want = ref.nt_bxent(wide, 0.2, normalize=normalize, **({"pos_indices": pairs} if relation == "index pairs" else {"labels": labels}))
    want.backward()
    tol = 1e-10 if dtype == torch.float64 else 2e-6
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=tol)
    err = float((ours.grad.double().cpu() - wide.grad).abs().max() / wide.grad.abs().max())
    assert err < (1e-10 if dtype == torch.float64 else 1e-2), err


def test_the_cpu_plan_keeps_the_formed_tile(monkeypatch):
    """A CPU's strips form the gradient tile (in cache, passes cost less than the factored form's wider products)."""
    walks = _spied(monkeypatch)
    x = torch.randn(20, 6, dtype=torch.float64, device=DEVICE if DEVICE.type == "cpu" else "cpu", requires_grad=True)
    tc.nt_bxent_loss(x, temperature=0.2, labels=torch.arange(20, device=x.device) % 3, chunk_size=8, backend="torch").backward()
    assert walks == []


@pytest.mark.parametrize("relation", ["labels", "index pairs"])
def test_a_learnable_temperature_takes_the_gradient_of_the_formula(relation, monkeypatch):
    """A tensor temperature's gradient from the strips' products (a triangle's ``H @ A`` counts every pair twice) --
    against float64."""
    walks = _spied(monkeypatch)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(26, 5, generator=g, dtype=torch.float64)
    labels = torch.arange(26) % 4
    pairs = torch.tensor([[0, 5], [5, 0], [7, 19], [25, 1]])
    kwargs = {"pos_indices": pairs.to(DEVICE)} if relation == "index pairs" else {"labels": labels.to(DEVICE)}
    tau = torch.tensor(0.3, dtype=torch.float64, device=DEVICE, requires_grad=True)
    with planner.simulate("cuda"):
        tc.nt_bxent_loss(x.to(DEVICE), temperature=tau, chunk_size=8, backend="torch", validate=False, **kwargs).backward()
    assert walks == [(relation == "labels", False)]
    want_tau = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    ref.nt_bxent(x, want_tau, **({"pos_indices": pairs} if relation == "index pairs" else {"labels": labels})).backward()
    assert float(tau.grad) == pytest.approx(float(want_tau.grad), rel=1e-9)


def test_the_fp32_rate_keeps_the_formed_tile_past_the_features_the_model_sets(monkeypatch):
    """The factored products add GEMM FLOPs for the formed tile's passes (cost.PAIR_FORMED): on tensor cores they pay
    up to thousands of features, at the fp32 rate (widened or fp32 inputs) below about 280 -- past it the general
    loop forms the tile over every tile, and still equals the float64 formula."""
    assert pair_factoring_pays("half", 4096) and not pair_factoring_pays("half", 16384)
    assert pair_factoring_pays("wide", 256) and not pair_factoring_pays("wide", 320)
    monkeypatch.setattr(planner, "PRODUCTS", "compute")
    walks = _spied(monkeypatch)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(24, 320, generator=g, dtype=torch.float64)
    labels = torch.arange(24) % 3
    ours = x.to(DEVICE).clone().requires_grad_()
    with planner.simulate("cuda"):
        got = tc.nt_bxent_loss(ours, temperature=0.2, labels=labels.to(DEVICE), chunk_size=8, backend="torch", validate=False)
        got.backward()
    assert walks == []
    wide = x.clone().requires_grad_()
    want = ref.nt_bxent(wide, 0.2, labels=labels)
    want.backward()
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-10)
    assert float((ours.grad.cpu() - wide.grad).abs().max() / wide.grad.abs().max()) < 1e-10
