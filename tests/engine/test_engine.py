"""The tiled engine: every tile size gives the one-tile numbers; memory stays O(N)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch

import torch_contrastive as tc
from device import DEVICE
from torch_contrastive.engine import resolve_tile, softmax_terms


def _losses(n: int):
    """(name, fn(x, y, tau, chunk)) for every loss and convention."""
    g = torch.Generator().manual_seed(n)
    labels = torch.randint(0, max(1, n // 3), (n,), generator=g)
    ids = torch.randint(0, max(1, n // 2), (n,), generator=g)
    pairs = torch.randint(0, n, (2 * n, 2), generator=g)
    half = n - n % 2
    return [
        ("nt_xent_adjacent", lambda x, y, t, c: tc.nt_xent_loss(x[:half], t, chunk_size=c)),
        ("nt_xent_halves", lambda x, y, t, c: tc.nt_xent_loss(x[:half], t, pairing="halves", chunk_size=c)),
        ("nt_xent_raw_dot", lambda x, y, t, c: tc.nt_xent_loss(x[:half], t, normalize=False, chunk_size=c)),
        ("nt_xent_pml", lambda x, y, t, c: tc.nt_xent_loss(x, t, labels=labels, chunk_size=c)),
        ("nt_bxent_pairs", lambda x, y, t, c: tc.nt_bxent_loss(x, pairs, t, chunk_size=c)),
        ("nt_bxent_labels", lambda x, y, t, c: tc.nt_bxent_loss(x, labels=labels, temperature=t, chunk_size=c)),
        ("clip", lambda x, y, t, c: tc.image_text_contrastive_loss(x, y, t, chunk_size=c)),
        ("clip_ids", lambda x, y, t, c: tc.image_text_contrastive_loss(x, y, t, ids, labels, chunk_size=c)),
        ("clip_raw_dot", lambda x, y, t, c: tc.image_text_contrastive_loss(x, y, t, normalize=False, chunk_size=c)),
        ("supcon_labels", lambda x, y, t, c: tc.supcon_loss(x, labels, temperature=t, chunk_size=c)),
        ("supcon_one", lambda x, y, t, c: tc.supcon_loss(x[: n - n % 3].reshape(-1, 3, x.shape[1]),
                                                         labels[: n // 3], temperature=t, contrast_mode="one", chunk_size=c)),
        ("supcon_mask", lambda x, y, t, c: tc.supcon_loss(x, mask=(labels[:, None] <= labels[None, :]), temperature=t, chunk_size=c)),
    ]


def _value_and_grads(fn, x, y, tau, chunk):
    x = x.clone().requires_grad_()
    y = y.clone().requires_grad_()
    t = torch.tensor(tau, dtype=x.dtype, requires_grad=True)
    loss = fn(x, y, t, chunk)
    loss.backward()
    return loss.detach(), x.grad, y.grad if y.grad is not None else torch.zeros_like(y), t.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
@pytest.mark.parametrize("n", [13, 30])
@pytest.mark.parametrize("tau", [0.01, 0.2])  # 0.01: online maximum; 0.2: fixed shift
def test_tiled_equals_one_tile(dtype, tol, n, tau):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 6, generator=g, dtype=dtype)
    y = torch.randn(n, 6, generator=g, dtype=dtype)
    for name, fn in _losses(n):
        # Raw dot products at tau = 0.01 give logits of a few hundred: fp32 round-off of the
        # logits alone is then ~1e-4 relative, whatever the summation order.
        tol_here = tol * 10 if ("raw_dot" in name and dtype == torch.float32 and tau < 0.1) else tol
        ref = _value_and_grads(fn, x, y, tau, n + 5)
        for chunk in (1, 7, 64):
            got = _value_and_grads(fn, x, y, tau, chunk)
            for a, b, what in zip(got, ref, ("value", "dx", "dy", "dtau")):
                scale = max(1.0, b.abs().max().item())
                torch.testing.assert_close(a, b, rtol=tol_here, atol=tol_here * scale, msg=f"{name} chunk={chunk} {what}")


def test_auto_tile_choice():
    assert resolve_tile(None, 100, 100) == 100  # small: one tile
    assert resolve_tile(None, 100_000, 100_000) < 100_000
    assert resolve_tile(3, 100, 100) == 3


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_gradcheck_engine_directly(chunk):
    torch.manual_seed(0)
    a = torch.randn(9, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    s = torch.tensor(1.7, dtype=torch.float64, requires_grad=True)

    def rows_and_cols(a, b, s):
        r, c = softmax_terms(a, b, s, self_offset=None, columns=True, chunk_size=chunk)
        return r.sum() + (c * torch.linspace(0.5, 1.5, 7, dtype=torch.float64)).sum()

    def single_set(a, s):
        r, _ = softmax_terms(a, a, s, self_offset=0, chunk_size=chunk)
        return (r * torch.linspace(-1, 2, 9, dtype=torch.float64)).sum()

    def offset_rows(a, b, s):
        r, _ = softmax_terms(a[2:5], a, s, self_offset=2, chunk_size=chunk)
        return (r * torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)).sum()

    assert torch.autograd.gradcheck(rows_and_cols, (a, b, s))
    assert torch.autograd.gradcheck(single_set, (a, s))
    assert torch.autograd.gradcheck(offset_rows, (a, b, s))


@pytest.mark.parametrize("chunk", [None, 3])
def test_gradcheck_positives_kept_apart(chunk):
    """The confident-regime path (engine/confident.py): positives left out of the tile sums
    and added back, with unequal row weights (alpha != beta) and column terms."""
    from torch_contrastive.positives import Positives

    torch.manual_seed(2)
    a = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    s = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)
    alpha, beta = torch.linspace(0.5, 1.5, 6, dtype=torch.float64), torch.linspace(1.2, 0.7, 6, dtype=torch.float64)
    pos = Positives.from_partner(torch.arange(6), 6, self_offset=None, layout="identity")
    halves = Positives.from_partner((torch.arange(6) + 3) % 6, 6, self_offset=0, layout="halves")

    def two_sets(a, b, s):
        r, c = softmax_terms(a, b, s, self_offset=None, positives=pos, row_weights=(alpha, beta), col_weights=(beta, None),
                             columns=True, chunk_size=chunk)
        assert r.shape == (6,)
        return r.sum() + (c * torch.linspace(0.5, 1.5, 6, dtype=torch.float64)).sum()

    def one_set(a, s):
        r, _ = softmax_terms(a, a, s, self_offset=0, positives=halves, symmetric=True, chunk_size=chunk)
        return (r * torch.linspace(-1, 2, 6, dtype=torch.float64)).sum()

    assert torch.autograd.gradcheck(two_sets, (a, b, s))
    assert torch.autograd.gradcheck(one_set, (a, s))
    # and the value: alpha * LSE - beta * S_ii per row
    r, c = softmax_terms(a, b, s, self_offset=None, positives=pos, row_weights=(alpha, beta), columns=True, chunk_size=chunk)
    dense = (a @ b.T * s).detach()
    torch.testing.assert_close(r, alpha * dense.logsumexp(1) - beta * dense.diagonal())
    torch.testing.assert_close(c, dense.logsumexp(0) - dense.diagonal())


def test_engine_matches_dense_logsumexp():
    torch.manual_seed(1)
    a = torch.randn(11, 4, dtype=torch.float64)
    b = torch.randn(5, 4, dtype=torch.float64)
    scale = torch.tensor(3.0, dtype=torch.float64)
    r, c = softmax_terms(a, b, scale, self_offset=None, columns=True, chunk_size=3)
    dense = a @ b.T * 3.0
    torch.testing.assert_close(r, dense.logsumexp(1))
    torch.testing.assert_close(c, dense.logsumexp(0))
    r, _ = softmax_terms(a, a, scale, self_offset=0, chunk_size=4)
    full = (a @ a.T * 3.0).masked_fill(torch.eye(11, dtype=torch.bool), float("-inf"))
    torch.testing.assert_close(r, full.logsumexp(1))


_MEMORY_SCRIPT = r"""
import json, resource, sys, torch
import torch_contrastive as tc
torch.manual_seed(0)
n, d, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
x = torch.randn(n, d, requires_grad=True)
y = torch.randn(n, d, requires_grad=True)
labels = torch.randint(0, 100, (n,))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if kind == "nt_xent":
    loss = tc.nt_xent_loss(x, 0.1, chunk_size=512)
elif kind == "supcon":
    loss = tc.supcon_loss(x, labels, temperature=0.1, chunk_size=512)
else:
    loss = tc.image_text_contrastive_loss(x, y, 0.07, chunk_size=512)
loss.backward()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth_mib": (after - before) / 1024, "finite": bool(torch.isfinite(x.grad).all())}))
"""


@pytest.mark.parametrize("kind", ["nt_xent", "supcon", "clip"])
def test_tiled_memory_has_no_n_squared_allocation(kind):
    # One fp32 16,384 x 16,384 matrix is 1 GiB; the tiled path must stay far below it.
    # Peak RSS growth is measured in a fresh process (not time: that would be flaky).
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, "16384", "64", kind],
                         capture_output=True, text=True, timeout=600, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["finite"]
    assert report["growth_mib"] < 128, report


def _relation(kind: str, rows: int, cols: int, self_offset, g):
    """(Positives, dense bool mask) for an engine-level test, self pairs excluded."""
    from torch_contrastive.positives import Positives

    if kind == "partner":
        partner = torch.randperm(cols, generator=g)[:rows]
        if self_offset is not None:  # never the self column
            partner = torch.where(partner == torch.arange(rows) + self_offset, (partner + 1) % cols, partner)
        pos = Positives.from_partner(partner, cols, self_offset=self_offset)
        dense = torch.zeros(rows, cols, dtype=torch.bool)
        dense[torch.arange(rows), partner] = True
    elif kind == "keys":
        keys = torch.randint(0, 3, (cols,), generator=g)
        row_keys = keys[:rows] if self_offset is not None else torch.randint(0, 3, (rows,), generator=g)
        pos = Positives.from_keys(row_keys, keys, self_offset=self_offset)
        dense = row_keys[:, None] == keys[None, :]
    elif kind == "pairs":
        pairs = torch.randint(0, min(rows, cols), (10, 2), generator=g)
        pos = Positives.from_pairs(pairs, rows, cols, self_offset=self_offset)
        dense = torch.zeros(rows, cols, dtype=torch.bool)
        dense[pairs[:, 0], pairs[:, 1]] = True
    else:
        bsz = cols // 2
        mask = torch.rand(bsz, bsz, generator=g) > 0.5
        pos = Positives.from_sample_mask(mask, torch.arange(rows) % bsz, cols)
        dense = mask[torch.arange(rows) % bsz][:, torch.arange(cols) % bsz]
        dense[torch.arange(rows), torch.arange(rows)] = False  # a sample mask never relates a row to itself
    if self_offset is not None:
        dense[torch.arange(rows), torch.arange(rows) + self_offset] = False
    return pos, dense


@pytest.mark.parametrize("kind", ["partner", "keys", "pairs", "mask"])
@pytest.mark.parametrize("single_set", [False, True])
@pytest.mark.parametrize("fixed", [True, False])
@pytest.mark.parametrize("chunk", [None, 3])
def test_softmax_terms_against_the_dense_formula(kind, single_set, fixed, chunk):
    from torch_contrastive.engine import softmax_terms

    g = torch.Generator().manual_seed(5)
    rows = cols = 8
    if single_set:
        a0 = torch.randn(rows, 4, generator=g, dtype=torch.float64)
        b0 = a0
    else:
        a0, b0 = torch.randn(rows, 4, generator=g, dtype=torch.float64), torch.randn(cols, 4, generator=g, dtype=torch.float64)
    self_offset = 0 if single_set else None
    pos, dense = _relation(kind, rows, cols, self_offset, g)
    weights = [torch.rand(rows, generator=g, dtype=torch.float64) + 0.5 for _ in range(4)]
    w_row, w_col = torch.randn(rows, generator=g, dtype=torch.float64), torch.randn(cols, generator=g, dtype=torch.float64)

    def ours(a, b, scale):
        row, col = softmax_terms(a, a if single_set else b, scale, self_offset=self_offset, positives=pos,
                                 row_weights=(weights[0], weights[1]), col_weights=(weights[2], weights[3]),
                                 symmetric=single_set, columns=not single_set, fixed=fixed, normalize=True, chunk_size=chunk)
        return (row * w_row).sum() + (0 if col is None else (col * w_col).sum())

    def reference(a, b, scale):
        an = a / a.norm(dim=1, keepdim=True)
        bn = an if single_set else b / b.norm(dim=1, keepdim=True)
        s = scale * an @ bn.T
        masked = s if self_offset is None else s.masked_fill(torch.eye(rows, dtype=torch.bool), float("-inf"))
        pos_s = torch.where(dense, s, 0.0)
        row = weights[0] * torch.logsumexp(masked, 1) - weights[1] * pos_s.sum(1)
        total = (row * w_row).sum()
        if not single_set:
            col = weights[2] * torch.logsumexp(s, 0) - weights[3] * pos_s.sum(0)
            total = total + (col * w_col).sum()
        return total

    results = []
    for fn in (ours, reference):
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        scale = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
        value = fn(a, b, scale)
        grads = torch.autograd.grad(value, [a, scale] if single_set else [a, b, scale])
        results.append((value.detach(), *grads))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_row_norms_of_large_inputs_go_through_blocks_with_the_same_result():
    """Above 2**19 elements the fp64 norm accumulation runs per row block (bounded copy): same norms."""
    from torch_contrastive.engine.normalization import _NORM_BLOCK, l2_normalize

    x = torch.randn(_NORM_BLOCK // 128 * 2 + 37, 128) * torch.logspace(-30, 30, _NORM_BLOCK // 128 * 2 + 37)[:, None]
    y, _, norm = l2_normalize(x, 1e-12)
    ref = torch.linalg.vector_norm(x.double(), dim=1, keepdim=True)
    torch.testing.assert_close(norm.double(), ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(y.double(), x.double() / ref.clamp_min(1e-12), rtol=1e-6, atol=1e-7)


def test_symmetric_tiles_need_a_symmetric_exclusion():
    """One mask serves a tile and its transpose on the symmetric path: a one-sided exclusion is refused."""
    from torch_contrastive.engine import softmax_terms
    from torch_contrastive.positives import Exclusion, Positives

    z = torch.randn(6, 3)
    one_sided = Exclusion(relation=Positives.from_pairs(torch.tensor([[0, 3]]), 6, 6))
    with pytest.raises(ValueError, match="symmetric exclusion"):
        softmax_terms(z, z, 2.0, self_offset=0, symmetric=True, exclude=one_sided)
    softmax_terms(z, z, 2.0, self_offset=0, symmetric=False, exclude=one_sided)  # the full tile walk is fine


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("kind", ["nt_xent", "clip", "supcon", "pml"])
def test_rows_below_the_normalisation_floor_get_the_floor_gradient(kind, chunk):
    """``x / max(||x||, eps)``: a row with 0 < ||x|| <= eps is divided by eps, so its gradient is
    ``g / eps`` without the radial projection; an all-zero row gets 0. Against float64 autograd."""
    eps = 0.5
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 5, generator=g, dtype=torch.float64)
    x[1] *= 0.3 / x[1].norm()  # below the floor
    x[6] = 0.0  # all zero
    y = torch.randn(8, 5, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 1, 0, 1, 2, 2, 3, 3])

    def run(a: torch.Tensor, b: torch.Tensor, ours: bool) -> torch.Tensor:
        if not ours:  # plain float64 formula, normalised by hand
            a = a / a.norm(dim=1, keepdim=True).clamp_min(eps)
            b = b / b.norm(dim=1, keepdim=True).clamp_min(eps)
            s = a @ (a if kind != "clip" else b).T / 0.2
            if kind == "clip":
                t = torch.arange(8)
                return (torch.nn.functional.cross_entropy(s, t) + torch.nn.functional.cross_entropy(s.T, t)) / 2
            eye = torch.eye(8, dtype=torch.bool)
            same = (labels[:, None] == labels[None, :]) if kind != "nt_xent" else torch.roll(eye, 4, 1)
            if kind == "pml":
                neg = torch.logsumexp(s.masked_fill(same | eye, float("-inf")), 1, keepdim=True)
                pos = same & ~eye
                return torch.where(pos, torch.nn.functional.softplus(neg - s), 0.0).sum() / pos.sum()
            log_prob = torch.log_softmax(s.masked_fill(eye, float("-inf")), 1)
            pos = same & ~eye
            return (-torch.where(pos, log_prob, 0.0).sum(1) / pos.sum(1)).mean()
        if kind == "clip":
            return tc.image_text_contrastive_loss(a, b, 0.2, eps=eps, chunk_size=chunk)
        if kind == "nt_xent":
            return tc.nt_xent_loss(a, 0.2, pairing="halves", eps=eps, chunk_size=chunk)
        if kind == "supcon":
            return tc.supcon_loss(a, labels, temperature=0.2, eps=eps, chunk_size=chunk)
        return tc.nt_xent_loss(a, 0.2, labels=labels, eps=eps, chunk_size=chunk)

    grads = []
    for ours in (True, False):
        a, b = x.clone().requires_grad_(), y.clone().requires_grad_()
        loss = run(a, b, ours)
        loss.backward()
        grads.append((loss.detach(), a.grad, b.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-10, atol=1e-12)
    live = torch.arange(8) != 6  # the zero row: 0 by the library's rule (autograd's subgradient gives g / eps)
    torch.testing.assert_close(grads[0][1][live], grads[1][1][live], rtol=1e-9, atol=1e-11)
    assert torch.equal(grads[0][1][6], torch.zeros(5, dtype=torch.float64))
    if kind == "clip":
        torch.testing.assert_close(grads[0][2], grads[1][2], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("scale", [1.0, 2.5, "tensor"])
@pytest.mark.parametrize("gpu_plan", [False, True])
def test_the_normalisation_backward_is_the_formula(gpu_plan, scale):
    """``l2_normalize_backward`` (the row dot product as a multiply and a sum, masked; one form on every device plan,
    ``planner.simulate`` included) -- rows above the floor, one below it (``g / eps``, no radial part) and an all-zero
    row (0) -- against float64 autograd of ``x / max(||x||, eps)``, times a float or a tensor scale."""
    from torch_contrastive.engine import planner
    from torch_contrastive.engine.normalization import l2_normalize, l2_normalize_backward

    eps = 0.5
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 6, generator=gen, dtype=torch.float64)
    x[2] *= 0.3 / x[2].norm()  # below the floor
    x[5] = 0.0  # all zero
    g = torch.randn(7, 6, generator=gen, dtype=torch.float64)
    factor = torch.tensor(1.7, dtype=torch.float64) if scale == "tensor" else scale
    ref_x = x.clone().requires_grad_()
    (ref_x / ref_x.norm(dim=1, keepdim=True).clamp_min(eps)).backward(g * float(factor))
    want = ref_x.grad.clone()
    want[5] = 0.0  # the library's rule for an all-zero row (autograd's subgradient gives g / eps)
    y, denom, norm = l2_normalize(x, eps)
    with planner.simulate("cuda") if gpu_plan else contextlib.nullcontext():
        got = l2_normalize_backward(g, y, denom, norm, eps, factor)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_new_statistic_needs_only_its_tile_functions():
    """The engine's contract from the outside: a toy statistic (per-row sums of exp(S)) written as
    an executor with one forward and one backward tile function runs under the driver and the two
    tile loops, tiled and untiled, and matches float64 autograd of the dense formula."""
    from torch_contrastive.engine.driver import Gradients, run
    from torch_contrastive.engine.products import Products
    from torch_contrastive.engine.tiling import gradient_sweep, sweep

    class RowExpSums:
        def forward(self, ctx, plan, ops, extras):
            out = ops.a_c.new_zeros(ops.a_c.shape[0])
            sweep(Products(None, ops.a_c, ops.b_c, ops.scale), ops.a_c.shape[0], ops.b_c.shape[0], plan.tile, False,
                  lambda s, r0, r1, c0, c1, bufs: out[r0:r1].add_(s.exp_().sum(1)))
            return out, {}

        def backward(self, ctx, plan, saved, grads):
            g = grads[0]
            prod = Products(None, saved.a, saved.b, saved.scale)
            rows, cols = gradient_sweep(prod, saved.a, saved.b, plan.tile, False,
                                        lambda s, r0, r1, c0, c1, bufs: s.exp_().mul_(g[r0:r1, None]))
            return Gradients(rows, cols)

    class Plan(NamedTuple):
        tile: int
        normalize: bool = True
        eps: float = 1e-12
        backend: str = "torch"  # a plan names the strategy that runs it; the driver asks it who normalises

    a = torch.randn(11, 5, dtype=torch.float64, device=DEVICE, requires_grad=True)
    b = torch.randn(7, 5, dtype=torch.float64, device=DEVICE, requires_grad=True)
    scale = torch.tensor(3.0, dtype=torch.float64, device=DEVICE, requires_grad=True)
    weights = torch.randn(11, dtype=torch.float64, device=DEVICE)
    an, bn = torch.nn.functional.normalize(a, dim=1), torch.nn.functional.normalize(b, dim=1)
    expected = torch.autograd.grad((torch.exp(scale * an @ bn.t()).sum(1) * weights).sum(), (a, b, scale))
    for tile in (3, 4, 11):
        got = run(RowExpSums(), Plan(tile), a, b, scale)
        assert torch.allclose(got, torch.exp(scale * an @ bn.t()).sum(1).detach(), rtol=1e-12)
        for g, e in zip(torch.autograd.grad((got * weights).sum(), (a, b, scale)), expected):
            assert torch.allclose(g, e, rtol=1e-10, atol=1e-12), tile


def test_a_second_derivative_is_refused_not_silently_wrong():
    """The engine's backward is first order. Under ``create_graph=True`` the gradient would come back
    without a graph of its own, so a gradient penalty through the loss would silently miss it: refused."""
    x = torch.randn(8, 5, dtype=torch.float64, device=DEVICE, requires_grad=True)
    w = torch.randn(8, 5, dtype=torch.float64, device=DEVICE, requires_grad=True)
    (first,) = torch.autograd.grad(tc.nt_xent_loss(x, 0.3), x)
    assert first.abs().sum() > 0
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(tc.nt_xent_loss(x * w, 0.3), x, create_graph=True)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(tc.image_text_contrastive_loss(x, w, 0.3), (x, w), create_graph=True)
