"""The lean one-tile executors for bf16 on a GPU (engine/one_tile_half.py): which calls they serve, the split
product's accuracy, the float64 formulas, deterministic mode, and the calls they hand on."""

from __future__ import annotations

import pytest
import torch

import reference as ref
import torch_contrastive as tc
from device import DEVICE
from helpers import count_applies
from torch_contrastive import positives as positives_module
from torch_contrastive.engine import one_tile_half, planner

LEAN = (one_tile_half.HalfOneTile, one_tile_half.HalfOneTileMask, one_tile_half.HalfOneTilePairs)


@pytest.fixture
def half_calls(monkeypatch):
    """Tensor-core products on this device (a CPU widens the bf16 operands: the same numbers), and how many
    calls the two bf16 one-tile functions served (a list with one counter)."""
    monkeypatch.setattr(planner, "PRODUCTS", "half")
    return count_applies(monkeypatch, LEAN)


def _labels(n):
    labels = torch.arange(n, device=DEVICE) % 3
    labels[-1] = 7  # one row without a positive
    return labels


def _cases(n):
    """(name, ours(a, b), the float64 formula(a, b), which inputs take a gradient)."""
    labels = _labels(n)
    return [
        ("clip", lambda a, b: tc.image_text_contrastive_loss(a, b, 0.07), lambda a, b: ref.image_text(a, b, 0.07), (True, True)),
        ("clip sum", lambda a, b: tc.image_text_contrastive_loss(a, b, 0.2, reduction="sum"),
         lambda a, b: ref.image_text(a, b, 0.2) * a.shape[0], (True, True)),
        ("clip constant texts", lambda a, b: tc.image_text_contrastive_loss(a, b, 0.1), lambda a, b: ref.image_text(a, b, 0.1),
         (True, False)),
        ("clip constant images", lambda a, b: tc.image_text_contrastive_loss(a, b, 0.1), lambda a, b: ref.image_text(a, b, 0.1),
         (False, True)),
        ("nt_xent halves", lambda a, b: tc.nt_xent_loss(a, 0.1, pairing="halves"),
         lambda a, b: ref.nt_xent(a, 0.1, pairing="halves"), (True, False)),
        ("nt_xent adjacent", lambda a, b: tc.nt_xent_loss(a, 0.5), lambda a, b: ref.nt_xent(a, 0.5), (True, False)),
        ("supcon labels", lambda a, b: tc.supcon_loss(a, labels, temperature=0.1), lambda a, b: ref.supcon(a, 0.1, labels=labels.cpu()),
         (True, False)),
        ("supcon views", lambda a, b: tc.supcon_loss(a.view(-1, 2, a.shape[1]), labels[::2], temperature=0.07),
         lambda a, b: ref.supcon(a.view(-1, 2, a.shape[1]), 0.07, labels=labels[::2].cpu()), (True, False)),
        # the pair conventions by labels (HalfOneTilePairs)
        ("pml labels", lambda a, b: tc.nt_xent_loss(a, 0.1, labels=labels), lambda a, b: ref.nt_xent_pml(a, labels.cpu(), 0.1),
         (True, False)),
        ("nt_bxent labels", lambda a, b: tc.nt_bxent_loss(a, temperature=0.2, labels=labels),
         lambda a, b: ref.nt_bxent(a, 0.2, labels=labels.cpu()), (True, False)),
    ]


def _rows(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g, dtype=torch.float64) * 3).bfloat16(), torch.randn(n, d, generator=g, dtype=torch.float64).bfloat16()


@pytest.mark.parametrize("n,d", [(12, 5), (38, 16)])
def test_bf16_one_tile_equals_the_float64_formulas(half_calls, n, d):
    """Values to fp32 round-off (the split product is fp32-accurate: no operand is rounded into the logits),
    gradients to bf16's rounding (the gradient tile and the rows it multiplies are rounded once each)."""
    x, y = _rows(n, d, n)
    for name, ours, formula, grads in _cases(n):
        before = half_calls[0]
        a, b = (t.to(DEVICE).clone().requires_grad_(g) for t, g in zip((x, y), grads))
        got = ours(a, b)
        got.backward()
        assert half_calls[0] == before + 1, f"{name}: not served by the bf16 one-tile executor"
        _agrees_with_float64(name, got, (a, b), (x, y), formula, grads)


def _agrees_with_float64(name, got, inputs, rows, formula, grads):
    """``got`` (its inputs' gradients filled) against ``formula`` in float64 on the same bf16 ``rows``: the value to
    fp32 round-off, each gradient (bf16, as the inputs) to 1 % of its largest entry."""
    wides = [t.double().detach().requires_grad_(g) for t, g in zip(rows, grads)]
    want = formula(*wides)
    want.backward()
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=2e-6, abs=1e-6), name
    for low, wide in zip(inputs, wides):
        assert (low.grad is None) == (wide.grad is None), name
        if wide.grad is not None:
            assert low.grad.dtype == torch.bfloat16
            err = float((low.grad.double().cpu() - wide.grad).abs().max()) / float(wide.grad.abs().max())
            assert err < 1e-2, (name, err)


def test_the_split_product_is_accurate_to_about_21_bits():
    """``[l | h | h] . [h | h | l] = x . x`` to about 2^-21 of ``|x|^2`` (fp16 parts) -- a bf16 product of the
    rounded rows errs by about 2^-8; the backward operand is ``x`` rounded to the input dtype."""
    g = torch.Generator().manual_seed(3)
    rows = torch.nn.functional.normalize(torch.randn(64, 96, generator=g, dtype=torch.float64), dim=1).float()
    x, low, u, v = one_tile_half.split_rows(rows, 14.0, torch.bfloat16)
    assert x.dtype == torch.float32 and low.dtype == torch.bfloat16 and u.dtype == v.dtype == torch.float16
    assert u.shape == v.shape == (64, 288) and torch.equal(low, x.bfloat16())
    want = rows.double() @ rows.double().t() * 14.0
    split = (u.double() @ v.double().t() - want).abs().max() / 14.0
    rounded = (low.double() @ low.double().t() - want).abs().max() / 14.0
    assert split < 2**-20 and rounded > 2**-11, (split, rounded)


def test_a_dense_mask_on_tensor_cores_multiplies_fp32_rows_to_fp32_accuracy(monkeypatch):
    """A dense 0/1 relation times fp32 rows on a GPU (simulated here): the bf16 mask against the rows split in
    three bf16 parts -- fp32-accurate, where one bf16 rounding of the rows would err by 2^-9."""
    monkeypatch.setattr(planner, "_SIMULATED", torch.device("cuda"))
    monkeypatch.setattr(positives_module, "_dense_pays", lambda rows, cols, device, reader=None: True)  # (a GPU's strips group)
    g = torch.Generator().manual_seed(5)
    labels = torch.randint(0, 4, (40,), generator=g)
    rel = tc.Positives.from_keys(labels, self_offset=0)
    assert rel.dense is not None
    x = torch.randn(40, 7, generator=g)
    mask = (labels[:, None] == labels[None, :]).double().fill_diagonal_(0)
    for got, want in ((rel.aggregate(x), mask @ x.double()), (rel.aggregate_transposed(x), mask.t() @ x.double())):
        assert got.dtype == torch.float32
        assert float((got.double() - want).abs().max()) <= 1e-6 * float(want.abs().max())
    assert positives_module._mask_on_tensor_cores(x) and not positives_module._mask_on_tensor_cores(x.double())


def test_fp16_a_tensor_temperature_and_a_non_positive_scale_keep_the_general_executor(half_calls):
    x, y = _rows(10, 4, 1)
    tc.image_text_contrastive_loss(x.half().to(DEVICE).requires_grad_(), y.half().to(DEVICE), 0.1).backward()
    tau = torch.tensor(0.1, device=DEVICE, requires_grad=True)
    tc.image_text_contrastive_loss(x.to(DEVICE).clone().requires_grad_(), y.to(DEVICE), tau).backward()
    assert tau.grad is not None
    assert half_calls[0] == 0
    labels = _labels(10)
    tc.nt_bxent_loss(x.half().to(DEVICE).requires_grad_(), temperature=0.2, labels=labels).backward()  # fp16 pairs too
    assert half_calls[0] == 0
    tc.nt_xent_loss(x.to(DEVICE).clone().requires_grad_(), 0.1).backward()
    assert half_calls[0] == 1
    # the engine takes any float scale; the split needs its square root: a negative one goes to the general executor
    from torch_contrastive.engine import Options, Problem, Softmax, solve

    a = x.to(DEVICE).clone().requires_grad_()
    problem = Problem(a, a, -5.0, Softmax(total=(0.1, 0.1)), positives=tc.Positives.from_keys(labels, self_offset=0),
                      self_offset=0, symmetric=True, bound=5.0, options=Options(normalize=True))
    out = solve(problem)[0]
    out.backward()
    assert half_calls[0] == 1 and torch.isfinite(out) and torch.isfinite(a.grad).all()


def test_bf16_one_tile_in_deterministic_mode_is_reproducible_and_leaves_the_inputs_alone(half_calls, monkeypatch):
    """Deterministic mode writes the positives' coefficients by an indexed add (put_ has no deterministic
    kernel): the same bits twice; the caller's rows are not modified."""
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    x, y = _rows(16, 6, 2)
    keep = x.clone()
    grads = []
    for _ in range(2):
        a = x.to(DEVICE).clone().requires_grad_()
        tc.nt_xent_loss(a, 0.1, pairing="halves").backward()
        b = y.to(DEVICE).clone().requires_grad_()
        tc.image_text_contrastive_loss(a.detach(), b, 0.1).backward()
        grads.append((a.grad, b.grad))
    assert half_calls[0] == 4
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert torch.equal(x, keep)


def test_an_unweighted_dense_relation_on_the_bf16_one_tile(half_calls):
    """A single set's dense label relation with unweighted rows (``sum_i LSE_i - sum_{p in P(i)} S_ip``; no SupCon
    weights): the relation's gradient in both roles of every pair without the extra product, against float64."""
    from torch_contrastive.engine import Options, Problem, Softmax, solve

    x, _ = _rows(14, 6, 9)
    labels = _labels(14)

    def formula(a):
        z = torch.nn.functional.normalize(a, dim=1)
        s = z @ z.t() / 0.1
        same = (labels.cpu()[:, None] == labels.cpu()[None, :]).fill_diagonal_(False)
        lse = torch.logsumexp(s.masked_fill(torch.eye(14, dtype=torch.bool), float("-inf")), dim=1)
        return (lse - (s * same).sum(1)).mean()

    a = x.to(DEVICE).clone().requires_grad_()
    problem = Problem(a, a, 10.0, Softmax(total=(1 / 14, 1 / 14)), positives=tc.Positives.from_keys(labels, self_offset=0),
                      self_offset=0, symmetric=True, bound=10.0, options=Options(normalize=True))
    got = solve(problem)[0]
    got.backward()
    assert half_calls[0] == 1
    a64 = x.double().requires_grad_()
    want = formula(a64)
    want.backward()
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=2e-6)
    err = float((a.grad.double().cpu() - a64.grad).abs().max()) / float(a64.grad.abs().max())
    assert err < 1e-2, err


@pytest.mark.parametrize("n,d", [(12, 5), (38, 16)])
def test_a_gpu_plans_widened_products_equal_the_float64_formulas(monkeypatch, n, d):
    """bf16 inputs on a GPU plan whose products the model widens (a host-bound call: fp32 GEMMs, fewer launches):
    every loss of the cases to fp32 round-off against float64, value and gradients -- SupCon's mask read by fp32
    GEMMs in the lean mask executor, the rest on the compute-dtype one tile -- with no tensor-core product."""
    monkeypatch.setattr(planner, "PRODUCTS", "auto")
    served = count_applies(monkeypatch, LEAN)
    x, y = _rows(n, d, n + 1)
    masks = 0
    for name, ours, formula, grads in _cases(n):
        a, b = (t.to(DEVICE).clone().requires_grad_(g) for t, g in zip((x, y), grads))
        with planner.simulate("cuda"):
            before = served[0]
            got = ours(a, b)
            got.backward()
            masks += served[0] - before
            decisions = tc.explain(ours, a.detach(), b.detach())
        assert decisions and not any(dec.half for dec in decisions), name  # widened, by the model
        _agrees_with_float64(name, got, (a, b), (x, y), formula, grads)
    assert masks == 2  # SupCon by labels and by views: the lean mask executor, widened


@pytest.mark.parametrize("products", ["half", "auto"])
@pytest.mark.parametrize("n,d", [(12, 5), (38, 16)])
def test_supcons_lean_tile_on_a_grouped_relation_equals_the_float64_formula(monkeypatch, products, n, d):
    """SupCon's lean executor on a relation grouped by key (the GPU plan's choice once the device is the longer:
    the positives summed per key, no mask and no relation GEMM) -- on the split tensor-core products and on the
    widened fp32 ones -- against float64, value and gradients, by labels and by views; no mask is ever built."""
    monkeypatch.setattr(planner, "PRODUCTS", products)
    monkeypatch.setattr(positives_module, "_dense_pays", lambda rows, cols, device, reader=None: False)
    served = count_applies(monkeypatch, (one_tile_half.HalfOneTileMask,))
    x, y = _rows(n, d, n + 2)
    for name, ours, formula, grads in _cases(n):
        if not name.startswith("supcon"):
            continue
        a, b = (t.to(DEVICE).clone().requires_grad_(g) for t, g in zip((x, y), grads))
        with planner.simulate("cuda"):
            before = served[0]
            got = ours(a, b)
            got.backward()
            assert served[0] == before + 1, f"{name}: not served by the lean mask executor"
            decisions = tc.explain(ours, a.detach(), b.detach())
        assert decisions and all(dec.half == (products == "half") for dec in decisions), name
        _agrees_with_float64(name, got, (a, b), (x, y), formula, grads)
