"""Numerical robustness: precision grid, degenerate batches, properties, determinism.

Tolerances (documented in the README, "Numerical guarantees"): the reference is the
float64 computation on the *same* inputs (rounded to the tested dtype first), so the
difference is only the library's own arithmetic.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import reference as ref
import torch_contrastive as tc

TEMPERATURES = [0.01, 0.05, 0.1, 0.5, 1.0, 10.0, 100.0]
# dtype -> (loss relative tolerance, gradient tolerance relative to the largest gradient)
TOLERANCE = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (2e-5, 1e-2),  # computed in fp32; gradients rounded to bf16 (8-bit mantissa)
    torch.float16: (2e-5, 2e-3),  # computed in fp32; gradients rounded to fp16 (11-bit mantissa)
}


def _cases(n: int):
    g = torch.Generator().manual_seed(n)
    labels = torch.randint(0, 3, (n,), generator=g)
    pairs = torch.randint(0, n, (n, 2), generator=g)
    return {
        "nt_xent": lambda x, y, t, c: tc.nt_xent_loss(x, t, chunk_size=c),
        "nt_xent_halves": lambda x, y, t, c: tc.nt_xent_loss(x, t, pairing="halves", chunk_size=c),
        "nt_xent_pml": lambda x, y, t, c: tc.nt_xent_loss(x, t, labels=labels, chunk_size=c),
        "nt_bxent": lambda x, y, t, c: tc.nt_bxent_loss(x, pairs, t, chunk_size=c),
        "nt_bxent_labels": lambda x, y, t, c: tc.nt_bxent_loss(x, labels=labels, temperature=t, chunk_size=c),
        "clip": lambda x, y, t, c: tc.image_text_contrastive_loss(x, y, t, chunk_size=c),
        "clip_ids": lambda x, y, t, c: tc.image_text_contrastive_loss(x, y, t, labels, chunk_size=c),
        "supcon": lambda x, y, t, c: tc.supcon_loss(x, labels, temperature=t, chunk_size=c),
        "siglip": lambda x, y, t, c: tc.siglip_loss(x, y, 1 / t, -2.0, chunk_size=c),
        "siglip_ids": lambda x, y, t, c: tc.siglip_loss(x, y, 1 / t, 3.0, labels, chunk_size=c),
        "supcon_views": lambda x, y, t, c: tc.supcon_loss(x.reshape(n // 2, 2, -1), temperature=t, chunk_size=c),
    }


def _run(fn, x, y, tau, chunk):
    x = x.clone().requires_grad_()
    y = y.clone().requires_grad_()
    loss = fn(x, y, tau, chunk)
    loss.backward()
    gy = y.grad if y.grad is not None else torch.zeros_like(y)
    return loss.detach(), x.grad, gy


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("tau", TEMPERATURES)
@pytest.mark.parametrize("chunk", [None, 5])
def test_precision_grid(dtype, tau, chunk):
    n = 12
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g).to(dtype)
    y = torch.randn(n, 8, generator=g).to(dtype)
    loss_tol, grad_tol = TOLERANCE[dtype]
    for name, fn in _cases(n).items():
        loss, gx, gy = _run(fn, x, y, tau, chunk)
        ref, rx, ry = _run(fn, x.double(), y.double(), tau, None)
        assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), name
        assert gx.dtype == dtype and torch.isfinite(gx).all() and torch.isfinite(loss), name
        assert loss.item() == pytest.approx(ref.item(), rel=loss_tol, abs=loss_tol), f"{name} tau={tau}"
        floor = 6e-8 if dtype == torch.float16 else 0.0  # fp16 subnormal spacing
        for got, want in ((gx, rx), (gy, ry)):
            bound = grad_tol * want.abs().max().item() + floor + 1e-300
            assert (got.double() - want).abs().max().item() <= bound, f"{name} tau={tau} grad"


def test_autocast_bf16_on_cpu():
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 6)
    x = torch.randn(10, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        emb = layer(x)
        assert emb.dtype == torch.bfloat16
        loss = tc.nt_xent_loss(emb, 0.1)
    assert loss.dtype == torch.float32
    ref = tc.nt_xent_loss(emb.detach().double(), 0.1)
    assert loss.item() == pytest.approx(ref.item(), rel=2e-5)
    loss.backward()
    assert torch.isfinite(layer.weight.grad).all()


# ------------------------------------------------------------------ degenerate batches
def _all_losses_finite(x, labels, y=None):
    x = x.clone().requires_grad_()
    y = (x.detach().flip(0) if y is None else y).clone().requires_grad_()
    out = {
        "nt_xent": tc.nt_xent_loss(x, 0.1) if x.shape[0] % 2 == 0 else None,
        "nt_xent_pml": tc.nt_xent_loss(x, 0.1, labels=labels),
        "nt_bxent": tc.nt_bxent_loss(x, labels=labels, temperature=0.1),
        "clip": tc.image_text_contrastive_loss(x, y, 0.1, labels),
        "supcon": tc.supcon_loss(x, labels, temperature=0.1),
    }
    for name, loss in out.items():
        if loss is None:
            continue
        assert torch.isfinite(loss), name
        x.grad = None
        loss.backward(retain_graph=True)
        assert torch.isfinite(x.grad).all(), name
    return {k: (v.item() if v is not None else None) for k, v in out.items()}


def test_two_rows():
    vals = _all_losses_finite(torch.randn(2, 4), torch.tensor([0, 0]))
    assert vals["nt_xent"] == pytest.approx(0.0, abs=1e-6)  # the only candidate is the positive


def test_identical_embeddings_give_log_counts():
    x = torch.ones(8, 3)
    vals = _all_losses_finite(x, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), y=torch.ones(8, 3))
    assert vals["nt_xent"] == pytest.approx(math.log(7), rel=1e-6)
    assert vals["supcon"] == pytest.approx(math.log(7), rel=1e-6)


def test_zero_vectors_give_zero_gradient():
    x = torch.randn(6, 4)
    x[2] = 0
    xin = x.clone().requires_grad_()
    tc.nt_xent_loss(xin, 0.2).backward()
    assert torch.isfinite(xin.grad).all() and torch.equal(xin.grad[2], torch.zeros(4))
    vals = _all_losses_finite(torch.zeros(6, 4), torch.tensor([0, 0, 1, 1, 2, 2]))
    assert vals["nt_xent"] == pytest.approx(math.log(5), rel=1e-6)  # every logit is 0


def test_single_class_and_no_positives():
    x = torch.randn(6, 4)
    one = _all_losses_finite(x, torch.zeros(6, dtype=torch.int64))
    assert one["nt_xent_pml"] == pytest.approx(0.0, abs=1e-7)  # no negatives: every term is log 1
    none = _all_losses_finite(x, torch.arange(6))
    assert none["supcon"] == 0.0 and none["nt_xent_pml"] == 0.0


def test_huge_norms_are_scale_free():
    x = torch.randn(8, 4)
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    base = _all_losses_finite(x, labels)
    scaled = _all_losses_finite(x * 1e30, labels, y=x.flip(0) * 1e30)  # ||x||^2 overflows fp32: no matter
    for k in base:
        if base[k] is not None:
            assert scaled[k] == pytest.approx(base[k], rel=1e-5), k


def test_tiny_norms_count_as_zero_vectors():
    # Convention: a / max(||a||, eps) with eps = 1e-12, so a 1e-30 row is (almost) the zero vector:
    # every logit is ~0 and NT-Xent is log(2N - 1). A smaller eps keeps the direction.
    x = torch.randn(8, 4, dtype=torch.float64)
    vals = _all_losses_finite(x * 1e-30, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
    assert vals["nt_xent"] == pytest.approx(math.log(7), rel=1e-9)
    assert tc.nt_xent_loss(x * 1e-30, 0.1, eps=1e-40).item() == pytest.approx(tc.nt_xent_loss(x, 0.1).item(), rel=1e-9)


def test_one_dimensional_and_duplicates():
    x = torch.tensor([[1.0], [2.0], [-1.0], [3.0], [-0.5], [1.0]])
    _all_losses_finite(x, torch.tensor([0, 0, 1, 1, 2, 2]))
    dup = torch.randn(3, 4).repeat(2, 1)
    _all_losses_finite(dup, torch.tensor([0, 1, 2, 0, 1, 2]))


def test_raw_dot_overflow_is_a_clear_error():
    # rows 0 and 2 are one vector of norm 1e20: row 0's negative logit 1e40 / tau overflows float32 while
    # its positive (row 1, orthogonal) is 0, so the loss is infinite. (Random rows of that size sometimes give
    # every row a +inf positive and -inf negatives: then the loss is 0 in float64 too, rightly no error.)
    x = torch.tensor([[1e20, 0.0, 0.0], [0.0, 1e20, 0.0], [1e20, 0.0, 0.0], [0.0, 0.0, 1e20]])
    with pytest.raises(ValueError, match="normalize=False"):
        tc.nt_xent_loss(x, 0.1, normalize=False)


# ------------------------------------------------------------------ properties (hypothesis)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batches(draw):
    """A drawn batch: the float entries themselves, labels, temperature, tile and a permutation."""
    pairs = draw(st.integers(1, 6))
    d = draw(st.integers(1, 5))
    m = 2 * pairs
    values = draw(st.lists(st.floats(-4, 4, allow_nan=False, allow_infinity=False), min_size=m * d, max_size=m * d))
    x = torch.tensor(values, dtype=torch.float64).reshape(m, d)
    # Rows of (almost) zero norm have a gradient of 1/eps in the reference's formula; the
    # library's zero-vector rule is tested separately.
    assume(bool((x.norm(dim=1) > 0.05).all()))
    labels = torch.tensor(draw(st.lists(st.integers(0, 3), min_size=m, max_size=m)))
    tau = draw(st.sampled_from([0.03, 0.1, 0.5, 2.0]))
    chunk = draw(st.sampled_from([1, 3, 4, None]))
    perm = torch.tensor(draw(st.permutations(range(m))))
    return x, labels, tau, chunk, perm


def _value_and_grad(fn, *inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    loss = fn(*leaves)
    grads = torch.autograd.grad(loss, leaves)
    return loss.detach(), grads


@SETTINGS
@given(batches())
def test_drawn_batches_match_the_float64_reference(batch):
    x, labels, tau, chunk, _ = batch
    y = x.roll(1, 0).flip(1)
    cases = [
        (lambda a: tc.nt_xent_loss(a, tau, chunk_size=chunk), lambda a: ref.nt_xent(a, tau)),
        (lambda a: tc.nt_xent_loss(a, tau, pairing="halves", chunk_size=chunk), lambda a: ref.nt_xent(a, tau, "halves")),
        (lambda a: tc.nt_xent_loss(a, tau, labels=labels, chunk_size=chunk), lambda a: ref.nt_xent_pml(a, labels, tau)),
        (lambda a: tc.nt_bxent_loss(a, labels=labels, temperature=tau, chunk_size=chunk), lambda a: ref.nt_bxent(a, tau, labels=labels)),
        (lambda a: tc.supcon_loss(a, labels, temperature=tau, chunk_size=chunk), lambda a: ref.supcon(a, tau, labels)),
        (lambda a: tc.image_text_contrastive_loss(a, y, tau, labels, chunk_size=chunk), lambda a: ref.image_text(a, y, tau, labels)),
    ]
    for ours_fn, ref_fn in cases:
        ours, (g_ours,) = _value_and_grad(ours_fn, x)
        want, (g_want,) = _value_and_grad(ref_fn, x)
        assert ours.item() == pytest.approx(want.item(), rel=1e-9, abs=1e-9)
        torch.testing.assert_close(g_ours, g_want, rtol=1e-7, atol=1e-9 * max(1.0, g_want.abs().max().item()))


@SETTINGS
@given(batches())
def test_permutation_invariance(batch):
    x, labels, tau, chunk, perm = batch
    for fn in (lambda a, lab: tc.nt_xent_loss(a, tau, labels=lab, chunk_size=chunk),
               lambda a, lab: tc.supcon_loss(a, lab, temperature=tau, chunk_size=chunk),
               lambda a, lab: tc.nt_bxent_loss(a, labels=lab, temperature=tau, chunk_size=chunk),
               lambda a, lab: tc.image_text_contrastive_loss(a, a.roll(1, 1), tau, lab, chunk_size=chunk)):
        value, (grad,) = _value_and_grad(lambda a, f=fn, lab=labels: f(a, lab), x)
        value_p, (grad_p,) = _value_and_grad(lambda a, f=fn, lab=labels[perm]: f(a, lab), x[perm])
        assert value_p.item() == pytest.approx(value.item(), rel=1e-9, abs=1e-12)
        torch.testing.assert_close(grad_p, grad[perm], rtol=1e-7, atol=1e-10)
    # Pairing rules: permute whole pairs (and swap inside them) to keep the pairs.
    n = x.shape[0] // 2
    pair_perm = perm[perm < n]  # a permutation of 0..n-1 (perm holds every index once)
    order = torch.stack([2 * pair_perm + 1, 2 * pair_perm], 1).reshape(-1)
    assert tc.nt_xent_loss(x[order], tau).item() == pytest.approx(tc.nt_xent_loss(x, tau).item(), rel=1e-9)


@SETTINGS
@given(batches(), st.floats(1e-3, 1e3))
def test_positive_rescaling_invariance(batch, factor):
    x, labels, tau, chunk, perm = batch
    scales = torch.linspace(0.5, 2.0, x.shape[0], dtype=torch.float64)[perm, None] * factor
    for fn in (lambda a: tc.nt_xent_loss(a, tau, chunk_size=chunk), lambda a: tc.supcon_loss(a, labels, temperature=tau),
               lambda a: tc.image_text_contrastive_loss(a, a.flip(0), tau, chunk_size=chunk)):
        assert fn(x * scales).item() == pytest.approx(fn(x).item(), rel=1e-9, abs=1e-12)


@SETTINGS
@given(batches())
def test_tiled_equals_dense_and_bounds(batch):
    x, labels, tau, chunk, _ = batch
    m = x.shape[0]
    for fn in (lambda a, c: tc.nt_xent_loss(a, tau, chunk_size=c), lambda a, c: tc.supcon_loss(a, labels, temperature=tau, chunk_size=c),
               lambda a, c: tc.nt_xent_loss(a, tau, labels=labels, chunk_size=c),
               lambda a, c: tc.nt_bxent_loss(a, labels=labels, temperature=tau, chunk_size=c),
               lambda a, c: tc.image_text_contrastive_loss(a, a.flip(0), tau, chunk_size=c)):
        dense, (g_dense,) = _value_and_grad(lambda a, f=fn: f(a, None), x)
        tiled, (g_tiled,) = _value_and_grad(lambda a, f=fn: f(a, chunk), x)
        assert torch.isfinite(dense) and tiled.item() == pytest.approx(dense.item(), rel=1e-9, abs=1e-12)
        torch.testing.assert_close(g_tiled, g_dense, rtol=1e-7, atol=1e-10)
    # Analytic lower bounds on L2-normalised inputs (every logit lies in [-1/tau, 1/tau]):
    nt = tc.nt_xent_loss(x, tau).item()
    assert nt >= math.log1p((m - 2) * math.exp(-2 / tau)) - 1e-12
    clip = tc.image_text_contrastive_loss(x, x.flip(0), tau).item()
    assert clip >= math.log1p((m - 1) * math.exp(-2 / tau)) - 1e-12
    # SupCon: loss_i >= log |P(i)| by Jensen, so every per-anchor value is >= 0.
    per = tc.supcon_loss(x, labels, temperature=tau, reduction="none")
    counts = torch.tensor([(labels == labels[i]).sum().item() - 1 for i in range(m)])
    has = counts > 0
    assert (per[has] >= counts[has].double().log() - 1e-9).all()


def test_determinism_bit_identical():
    torch.manual_seed(0)
    x = torch.randn(40, 16)
    y = torch.randn(40, 16)
    labels = torch.randint(0, 5, (40,))
    for fn in _cases(40).values():
        a = _run(fn, x, y, 0.1, 7)
        b = _run(fn, x, y, 0.1, 7)
        for u, w in zip(a, b):
            assert torch.equal(u, w)
    del labels


def test_nt_bxent_keeps_tiny_terms_at_large_logits():
    # Two nearly parallel positives at tau = 0.01: -log sigmoid(s) ~ exp(-s) is tiny but not 0,
    # and so is its gradient; 1 - sigmoid(s) or softplus(s) - s would round both to 0.
    x = torch.tensor([[1.0, 0.0], [1.0, 0.02], [-1.0, 0.0], [-1.0, -0.02]], requires_grad=True)
    pos = torch.tensor([[0, 1], [1, 0], [2, 3], [3, 2]])
    loss = tc.nt_bxent_loss(x, pos, 0.05)
    ref = tc.nt_bxent_loss(x.detach().double(), pos, 0.05)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    loss.backward()
    xd = x.detach().double().requires_grad_()
    tc.nt_bxent_loss(xd, pos, 0.05).backward()
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-4, atol=1e-12)


@SETTINGS
@given(batches(), st.sampled_from(["plain", "ids", "guide", "decoupled", "smoothing"]), st.booleans())
def test_drawn_candidates_beyond_the_batch_match_the_float64_reference(batch, rule, in_batch):
    """info_nce with a drawn pool and a drawn false-negative rule vs the -inf-masking float64 loop
    (label smoothing vs F.cross_entropy on the dense logits)."""
    x, labels, tau, chunk, perm = batch
    key = x.roll(1, 0).flip(1) + 0.3 * x
    pool = x[perm] * 0.7 - key
    kw: dict = {}
    ref_kw: dict = {}
    if rule == "ids":
        kw = ref_kw = dict(key_ids=labels, negative_ids=labels[perm])
    elif rule == "guide":
        guide = (x.cos(), key.sin(), pool.cos())
        kw = dict(guide=guide, guide_margin=0.05)
        ref_kw = dict(guide=guide, margin=0.05)
    elif rule == "decoupled":
        kw = ref_kw = dict(decoupled=True)
    if rule == "smoothing":
        def reference(q, k, p):
            qn, kn, pn = (torch.nn.functional.normalize(t, dim=1) for t in (q, k, p))
            logits = torch.cat([qn @ kn.T if in_batch else (qn * kn).sum(1, keepdim=True), qn @ pn.T], 1) / tau
            target = torch.arange(q.shape[0]) if in_batch else torch.zeros(q.shape[0], dtype=torch.long)
            return torch.nn.functional.cross_entropy(logits, target, label_smoothing=0.2)
        kw = dict(label_smoothing=0.2)
    else:
        def reference(q, k, p):
            return ref.info_nce_masked(q, k, p, tau, "unpaired", in_batch, **ref_kw)
    ours, grads = _value_and_grad(lambda q, k, p: tc.info_nce_loss(q, k, p, tau, in_batch_negatives=in_batch, chunk_size=chunk,
                                                                   **kw), x, key, pool)
    want, want_grads = _value_and_grad(reference, x, key, pool)
    assert ours.item() == pytest.approx(want.item(), rel=1e-9, abs=1e-9)
    for g_ours, g_want in zip(grads, want_grads):
        torch.testing.assert_close(g_ours, g_want, rtol=1e-7, atol=1e-9 * max(1.0, g_want.abs().max().item()))
