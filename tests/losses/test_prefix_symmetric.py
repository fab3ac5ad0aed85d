"""losses/prefix_symmetric.py: one set's Matryoshka soft-max losses from the upper triangle (NT-Xent's pairings and
DCL, SupCon by labels and by views) against the library's own loss called once per prefix in float64 -- every
reduction, strips, a key with one row (an anchor without a positive) -- plus its counts: half the products, no
host read without validation."""

from __future__ import annotations

import pytest
import torch

import torch_contrastive as tc
import torch_contrastive.losses.prefix_symmetric as symmetric
from device import DEVICE
from torch_contrastive.cli.synccount import count_host_syncs

DIMS, WEIGHTS = [16, 9, 4, 9], [1.0, 0.5, 2.0, 0.25]


def _forms(g):
    x = torch.randn(12, 16, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 0, 1, 0, 3, 1, 0, 2, 1, 4])  # keys 3 and 4 have one row: no positive
    views = torch.randn(6, 2, 16, generator=g, dtype=torch.float64)
    return {"nt_xent halves": (tc.nt_xent_loss, x, {"pairing": "halves"}),
            "nt_xent adjacent": (tc.nt_xent_loss, x, {"pairing": "adjacent"}),
            "nt_xent decoupled": (tc.nt_xent_loss, x, {"pairing": "halves", "decoupled": True}),
            "supcon labels": (tc.supcon_loss, x, {"labels": labels}),
            "supcon views": (tc.supcon_loss, views, {})}


@pytest.mark.parametrize("form", ["nt_xent halves", "nt_xent adjacent", "nt_xent decoupled", "supcon labels", "supcon views"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk", [None, 5])
def test_the_upper_triangle_equals_one_call_per_prefix(form, reduction, chunk, monkeypatch):
    fn, x, kwargs = _forms(torch.Generator().manual_seed(7))[form]
    seen = []
    original = symmetric.upper_softmax
    monkeypatch.setattr(symmetric, "upper_softmax", lambda *a, **k: seen.append(1) or original(*a, **k))
    x = x.to(DEVICE).requires_grad_()
    kwargs = {k: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for k, t in kwargs.items()}
    opts = {"temperature": 0.1, "reduction": reduction, "chunk_size": chunk, **kwargs}
    got = tc.matryoshka_loss(fn, [x], DIMS, WEIGHTS, **opts)
    want = tc.matryoshka_loss(fn, [x], DIMS, WEIGHTS, one_pass=False, **opts)
    assert seen, "the one pass did not take the upper triangle"
    torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)
    up = torch.randn(got.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(DEVICE)
    (mine,), (ref,) = torch.autograd.grad(got, x, up), torch.autograd.grad(want, x, up)
    torch.testing.assert_close(mine, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-5)])
def test_half_and_single_rows_keep_the_compute_precision(dtype, tol):
    """fp32 and bf16 rows: the one pass against the per-prefix loss on the same rounded rows, computed in fp32."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 16, generator=g).to(DEVICE, dtype).requires_grad_()
    labels = torch.randint(0, 5, (40,), generator=g).to(DEVICE)
    got = tc.matryoshka_loss(tc.supcon_loss, [x], DIMS, labels=labels, temperature=0.05)
    want = tc.matryoshka_loss(tc.supcon_loss, [x.double()], DIMS, labels=labels, temperature=0.05, one_pass=False)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_a_scale_past_the_bounded_regime_or_a_learnable_one_keeps_the_square(monkeypatch):
    """tau 0.01 in fp32 (a fixed shift would lose the far rows) and a learnable temperature take the square's pass."""
    seen = []
    original = symmetric.upper_softmax
    monkeypatch.setattr(symmetric, "upper_softmax", lambda *a, **k: seen.append(1) or original(*a, **k))
    x = torch.randn(8, 16, device=DEVICE)
    tc.matryoshka_loss(tc.nt_xent_loss, [x], DIMS, temperature=0.01)
    tc.matryoshka_loss(tc.nt_xent_loss, [x], DIMS, temperature=torch.tensor(0.1, device=DEVICE))
    assert not seen
    tc.matryoshka_loss(tc.nt_xent_loss, [x], DIMS, temperature=0.1)
    assert seen


def test_half_the_products_and_no_host_read_without_validation():
    from torch_contrastive.cli.traffic import count

    x = torch.randn(32, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 4, (32,))

    def flops(one_pass):
        return sum(count(lambda: tc.matryoshka_loss(tc.supcon_loss, [x], [16, 8], labels=labels, chunk_size=8, one_pass=one_pass),
                         32, 32, 16, simulate_device=None).gemm_flops.values())

    # strips of 8 rows against the columns from the strip on: 32 + 24 + 16 + 8 = 80 of 128 columns, four passes (forward,
    # backward's recomputed one, the two gradient products), D = 16 per pair
    assert flops(True) == 4 * 2 * 8 * 80 * 16
    assert flops(False) > 2 * flops(True)  # one call per prefix, in the same strips: sum(d_p) = 24 per pair
    assert count_host_syncs(lambda: tc.matryoshka_loss(tc.supcon_loss, [x], [16, 8], labels=labels, validate=False).backward()) == 0
