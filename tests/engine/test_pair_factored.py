"""The pair terms' one tile on a GPU plan (engine/pair_factored.py): on tensor cores the products factored through
the kept bf16 tiles, widened one tile kept for two GEMMs -- against the float64 formulas (float64 rows to round-off,
bf16 rows to bf16's rounding), and the forms' pieces in float64 against naive loops (to round-off)."""

from __future__ import annotations

import math

import pytest
import torch

import reference as ref
import torch_contrastive as tc
from device import DEVICE
from torch_contrastive.engine import pair_factored, planner

CASES = {
    "pml": ("pair_softplus", lambda x, labels, reduction: tc.nt_xent_loss(x, 0.2, labels=labels, reduction=reduction),
            lambda x, labels: ref.nt_xent_pml(x, labels, 0.2)),
    "nt_bxent": ("binary", lambda x, labels, reduction: tc.nt_bxent_loss(x, temperature=0.3, labels=labels, reduction=reduction),
                 lambda x, labels: ref.nt_bxent(x, 0.3, labels=labels)),
}


def _labels(n, kind):
    labels = torch.arange(n) % 4
    labels[:3] = 9  # rows with other positives; the last row alone: no positive
    labels[-1] = 11
    if kind == "one class":  # no row has a negative
        labels[:] = 1
    return labels


@pytest.fixture
def forms_run(monkeypatch):
    """How many forward and backward calls the device forms served (kernel name -> [forward, backward])."""
    runs = {name: [0, 0] for name in pair_factored.FORMS}
    for name, (forward, rows) in list(pair_factored.FORMS.items()):
        def counted_forward(*args, _f=forward, _n=name):
            runs[_n][0] += 1
            return _f(*args)

        def counted_rows(*args, _f=rows, _n=name):
            runs[_n][1] += 1
            return _f(*args)
        monkeypatch.setitem(pair_factored.FORMS, name, (counted_forward, counted_rows))
    return runs


@pytest.mark.parametrize("kind", ["mixed", "one class"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_factored_one_tile_on_bf16_rows(monkeypatch, forms_run, name, kind):
    """bf16 rows on the GPU plan's tensor-core products (simulated): the split product's fp32 logits, the kept tiles
    and the scaled rows in bf16 -- the value to fp32 round-off against float64 on the same rows, the gradient to
    bf16's rounding (1 % of its largest entry); rows with no positive, and (one class) with no negative, included."""
    monkeypatch.setattr(planner, "PRODUCTS", "half")
    kernel, ours, formula = CASES[name]
    n = 40
    labels = _labels(n, kind).to(DEVICE)
    x = (torch.randn(n, 16, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()
    got_x = x.to(DEVICE).clone().requires_grad_()
    with planner.simulate("cuda"):
        half = [d.half for d in tc.explain(lambda t: ours(t, labels, "mean"), got_x.detach())]
        before = list(forms_run[kernel])
        got = ours(got_x, labels, "sum" if name == "nt_bxent" else "mean")
        got.backward()
    assert [r - b for r, b in zip(forms_run[kernel], before)] == [1, 1] and half == [True], (forms_run, half)
    want_x = x.double().requires_grad_()
    want = formula(want_x, labels.cpu()) * (n if name == "nt_bxent" else 1)
    want.backward()
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=2e-6, abs=1e-7)
    assert got_x.grad.dtype == torch.bfloat16
    # (PML with one class has no negative: every term, and the gradient, is 0)
    err = float((got_x.grad.double().cpu() - want_x.grad).abs().max() / want_x.grad.abs().max().clamp_min(1e-30))
    assert err < 1e-2, err


@pytest.fixture
def one_kept_run(monkeypatch):
    """How many forward calls the widened one tile's one-kept forms served (kernel name -> count)."""
    runs = {name: 0 for name in pair_factored.ONE_KEPT}
    for name, (forward, sign, serves) in list(pair_factored.ONE_KEPT.items()):
        def counted(*args, _f=forward, _n=name):
            runs[_n] += 1
            return _f(*args)
        monkeypatch.setitem(pair_factored.ONE_KEPT, name, (counted, sign, serves))
    return runs


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", ["mixed", "one class"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_widened_one_kept_tile_equals_the_float64_formula(one_kept_run, name, kind, reduction):
    """A GPU plan's products in the compute dtype (float64 here; fp32 where the model widens bf16 rows): one tile kept
    from forward (``K``, the positives' and negatives' parts in one) and backward two GEMMs -- value and gradients
    the formula's to round-off, rows with no positive and (one class) with no negative included."""
    kernel, ours, formula = CASES[name]
    n = 22
    labels = _labels(n, kind).to(DEVICE)
    x = torch.randn(n, 7, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    want_x = x.clone().requires_grad_()
    count = n if reduction == "sum" and name == "nt_bxent" else 1  # (PML's sum: over pairs, their count below)
    want = formula(want_x, labels.cpu())
    if reduction == "sum" and name == "pml":
        count = int((labels[:, None] == labels[None, :]).sum()) - n
    (want * count).backward()
    got_x = x.to(DEVICE).clone().requires_grad_()
    with planner.simulate("cuda"):
        got = ours(got_x, labels, reduction)
        got.backward()
    assert one_kept_run[kernel] == 1, one_kept_run
    assert float(got.detach()) == pytest.approx(float(want.detach()) * count, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(got_x.grad.cpu(), want_x.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_the_widened_one_kept_tile_on_bf16_rows(monkeypatch, one_kept_run, forms_run, name):
    """bf16 rows where the model widens the products (a host-bound call): fp32 throughout, the one-kept form (not
    the tensor-core form) -- the value to fp32 round-off, the gradient to its one rounding to bf16."""
    monkeypatch.setattr(planner, "PRODUCTS", "auto")
    kernel, ours, formula = CASES[name]
    labels = _labels(40, "mixed")
    x = (torch.randn(40, 16, generator=torch.Generator().manual_seed(6)) * 3).bfloat16()
    got_x = x.to(DEVICE).clone().requires_grad_()
    with planner.simulate("cuda"):
        assert [d.half for d in tc.explain(lambda t: ours(t, labels.to(DEVICE), "mean"), got_x.detach())] == [False]
        got = ours(got_x, labels.to(DEVICE), "mean")
        got.backward()
    assert one_kept_run[kernel] == 2 and forms_run[kernel] == [0, 0], (one_kept_run, forms_run)  # (explain ran once)
    want_x = x.double().requires_grad_()
    want = formula(want_x, labels)
    want.backward()
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=2e-6)
    err = float((got_x.grad.double().cpu() - want_x.grad).abs().max() / want_x.grad.abs().max())
    assert got_x.grad.dtype == torch.bfloat16 and err < 4e-3, err


def _on(*tensors):
    """Copies of ``tensors`` on the test device (the forms run there; the loops read the CPU originals)."""
    return tuple(x.to(DEVICE, copy=True) for x in tensors)


def _tile(n, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.nn.functional.normalize(torch.randn(n, 5, generator=g, dtype=torch.float64), dim=1)
    labels = torch.randint(0, 3, (n,), generator=g)
    pos = labels[:, None] == labels[None, :]
    pos.fill_diagonal_(False)
    return z, z @ z.t() * 4.0, pos


def _pml_loops(s, pos, g):
    """PML's per-row terms ``softplus(log N_i - S_ip)`` and its gradient tile ``G`` (``r_i e^{S_ij}`` on negatives,
    ``-g_i sigmoid(log N_i - S_ij)`` on positives) by loops over the pairs, for per-row coefficients ``g``."""
    n = s.shape[0]
    rows, grad = torch.zeros(n, dtype=torch.float64), torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        negs = [j for j in range(n) if j != i and not pos[i, j]]
        big_n = sum(math.exp(s[i, j]) for j in negs)
        w = 0.0
        for p in (j for j in range(n) if pos[i, j]):
            d = math.log(big_n) - float(s[i, p])
            rows[i] += math.log1p(math.exp(d))
            w += 1 / (1 + math.exp(-d))
            grad[i, p] = -g[i] / (1 + math.exp(-d))
        for j in negs:
            grad[i, j] = g[i] * w * math.exp(s[i, j]) / big_n
    return rows, grad


def test_the_softplus_forms_per_row_terms_and_products_follow_naive_loops():
    """``softplus_forward`` per row (not summed) and ``softplus_rows``'s ``(G + G^T) x`` against loops over the
    pairs: ``G_ij = r_i e^{S_ij}`` on negatives, ``-g_i sigmoid(log N_i - S_ij)`` on positives."""
    n = 9
    z, s, pos = _tile(n, 1)
    (per_row,), kept = pair_factored.softplus_forward(*_on(s, pos), False, torch.float64)
    g = torch.linspace(0.5, 1.5, n, dtype=torch.float64)
    hx = pair_factored.softplus_rows(kept, _on(g), *_on(z, z), torch.mm).cpu()
    per_row = per_row.cpu()
    want_rows, grad = _pml_loops(s, pos, g)
    torch.testing.assert_close(per_row, want_rows, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(hx, (grad + grad.t()) @ z, rtol=1e-12, atol=1e-14)


def test_the_binary_forms_sums_and_products_follow_naive_loops():
    """``binary_forward``'s positive and negative sums per row and ``binary_rows``'s ``(G + G^T) x`` against loops:
    ``softplus(-S)`` and ``-a_i sigmoid(-S)`` on positives, ``softplus(S)`` and ``b_i sigmoid(S)`` on negatives."""
    n = 9
    z, s, pos = _tile(n, 2)
    (pos_sum, neg_sum), kept = pair_factored.binary_forward(*_on(s, pos), torch.float64)
    a = torch.linspace(0.2, 1.0, n, dtype=torch.float64)
    b = torch.linspace(1.5, 0.1, n, dtype=torch.float64)
    hx = pair_factored.binary_rows(kept, _on(a, b), *_on(z, z), torch.mm).cpu()
    want = torch.zeros(2, n, dtype=torch.float64)
    grad = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            sign = -1.0 if pos[i, j] else 1.0
            want[0 if pos[i, j] else 1, i] += math.log1p(math.exp(sign * float(s[i, j])))
            grad[i, j] = (-a[i] if pos[i, j] else b[i]) / (1 + math.exp(-sign * float(s[i, j])))
    torch.testing.assert_close(torch.stack((pos_sum, neg_sum)).cpu(), want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(hx, (grad + grad.t()) @ z, rtol=1e-12, atol=1e-14)


def test_the_one_kept_tiles_follow_naive_loops():
    """The widened forms' values and ``H @ x`` against loops over the pairs, for weighted rows and a total."""
    n = 9
    z, s, pos = _tile(n, 3)
    g = torch.tensor(0.7, dtype=torch.float64)
    (value, kept) = pair_factored.softplus_one_kept(*_on(s, pos), (pair_factored.UNIT, 0.25))
    hx = pair_factored.one_kept_rows(kept, *_on(g), 0.25, -1.0, *_on(z)).cpu()
    rows, grad = _pml_loops(s, pos, (0.25 * g).expand(n))
    assert float(value) == pytest.approx(0.25 * float(rows.sum()), rel=1e-12)
    torch.testing.assert_close(hx, (grad + grad.t()) @ z, rtol=1e-12, atol=1e-14)

    weights = torch.stack((torch.linspace(0.2, 1.0, n, dtype=torch.float64), torch.linspace(1.5, 0.1, n, dtype=torch.float64)))
    total = torch.tensor(0.5, dtype=torch.float64)
    (value, kept) = pair_factored.binary_one_kept(*_on(s, pos), tuple(_on(weights, total)))
    hx = pair_factored.one_kept_rows(kept, *_on(g), *_on(total), 1.0, *_on(z)).cpu()
    want, grad = 0.0, torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in (j for j in range(n) if j != i):
            sign, w = (-1.0, weights[0, i]) if pos[i, j] else (1.0, weights[1, i])
            want += 0.5 * w * math.log1p(math.exp(sign * float(s[i, j])))
            grad[i, j] = 0.5 * g * sign * w / (1 + math.exp(-sign * float(s[i, j])))
    assert float(value) == pytest.approx(float(want), rel=1e-12)
    torch.testing.assert_close(hx, (grad + grad.t()) @ z, rtol=1e-12, atol=1e-14)
