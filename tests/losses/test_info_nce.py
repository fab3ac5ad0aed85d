"""info_nce_loss: hard negatives (paired, unpaired), queues; vs float64 loops and info-nce-pytorch."""

from __future__ import annotations

import pytest
import torch

import torch_contrastive as tc
from helpers import DTYPES, compare, rand_rows
from reference import info_nce, mnrl


def _inputs(n, m, k, seed, paired):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, 5, generator=g, dtype=torch.float64)
    key = q + 0.7 * torch.randn(n, 5, generator=g, dtype=torch.float64)
    neg = torch.randn(n, k, 5, generator=g, dtype=torch.float64) if paired else torch.randn(m, 5, generator=g, dtype=torch.float64)
    return q, key, neg


@pytest.mark.parametrize("dtype,tols", DTYPES)
@pytest.mark.parametrize("mode,in_batch", [("none", True), ("unpaired", True), ("unpaired", False), ("paired", True), ("paired", False)])
@pytest.mark.parametrize("n", [1, 7, 13])
@pytest.mark.parametrize("chunk", [None, 4])
def test_info_nce_reference(chunk, n, mode, in_batch, dtype, tols):
    """Values and gradients (query, key, negatives, tau) of every mode equal the float64 loop."""
    q, key, neg = _inputs(n, 9, 3, seed=n, paired=mode == "paired")
    if mode == "none":
        compare(lambda a, b, t: tc.info_nce_loss(a, b, temperature=t, chunk_size=chunk),
                 lambda a, b, t: info_nce(a, b, None, t), [q, key], 0.2, dtype, tols)
        return
    neg_mode = mode
    compare(lambda a, b, c, t: tc.info_nce_loss(a, b, c, t, negative_mode=neg_mode, in_batch_negatives=in_batch, chunk_size=chunk),
             lambda a, b, c, t: info_nce(a, b, c, t, neg_mode, in_batch), [q, key, neg], 0.2, dtype, tols)


@pytest.mark.parametrize("tau", [0.01, 0.07, 1.0])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("in_batch", [True, False])
def test_info_nce_online_and_raw_dot_products(tau, normalize, in_batch):
    """tau below the fixed-shift range (0.01) and raw dot products take the online maximum path."""
    q, key, neg = _inputs(9, 11, 2, seed=3, paired=False)
    compare(lambda a, b, c, t: tc.info_nce_loss(a, b, c, t, in_batch_negatives=in_batch, normalize=normalize, chunk_size=4),
             lambda a, b, c, t: info_nce(a, b, c, t, "unpaired", in_batch, normalize), [q, key, neg], tau,
             torch.float64, (1e-9, 1e-9))


def test_info_nce_matches_mnrl_form():
    """MultipleNegativesRankingLoss: scale 20 (tau = 0.05), in-batch positives + the batch's hard negatives as a pool."""
    q, key, hard = _inputs(8, 8, 0, seed=5, paired=False)
    compare(lambda a, b, c, t: tc.info_nce_loss(a, b, c, t, chunk_size=4),
             lambda a, b, c, t: mnrl(a, b, c, 1.0 / t), [q, key, hard], 0.05, torch.float64, (1e-9, 1e-9))


@pytest.fixture
def info_nce_peer():
    return pytest.importorskip("info_nce")


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("mode", ["none", "unpaired", "paired"])
def test_matches_info_nce_pytorch(info_nce_peer, mode, seed):
    """info-nce-pytorch 0.1.4: values and gradients for query, key and negatives (fp32)."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 20, (1,), generator=g))
    q, key = torch.randn(n, 16, generator=g), torch.randn(n, 16, generator=g)
    neg = None if mode == "none" else torch.randn(n, 4, 16, generator=g) if mode == "paired" else torch.randn(23, 16, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, key, *(() if neg is None else (neg,)))]
    ref = info_nce_peer.info_nce(*leaves, temperature=0.1, negative_mode="unpaired" if mode == "none" else mode)
    ref_grads = torch.autograd.grad(ref, leaves)
    ours_leaves = [t.clone().requires_grad_() for t in leaves]
    ours = tc.InfoNCELoss(0.1, negative_mode="unpaired" if mode == "none" else mode,
                          in_batch_negatives=mode == "none")(*ours_leaves)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    for a, b in zip(torch.autograd.grad(ours, ours_leaves), ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for reduction in ("sum", "none"):
        peer = info_nce_peer.info_nce(*leaves, temperature=0.1, reduction=reduction, negative_mode="unpaired" if mode == "none" else mode)
        torch.testing.assert_close(tc.info_nce_loss(*leaves[:2], None if neg is None else leaves[2], 0.1, reduction=reduction,
                                                    negative_mode="unpaired" if mode == "none" else mode,
                                                    in_batch_negatives=mode == "none").detach(), peer.detach(), rtol=1e-5, atol=1e-6)


def test_tiled_equals_one_tile_with_a_queue_and_skips_its_gradient():
    """A detached pool (a queue) behind live keys: same value and gradients as a live copy,
    tiled or not, and the queue gets none."""
    q, key, _ = _inputs(20, 0, 0, seed=1, paired=False)
    queue = torch.randn(37, 5, dtype=torch.float64)
    results = []
    for chunk in (None, 8, 7):
        for live in (False, True):
            leaves = [q.clone().requires_grad_(), key.clone().requires_grad_()]
            pool = queue.clone().requires_grad_() if live else queue
            loss = tc.info_nce_loss(*leaves, pool, 0.1, chunk_size=chunk)
            loss.backward()
            results.append((loss.detach(), *(t.grad for t in leaves)))
            if live:
                assert pool.grad is not None and pool.grad.abs().sum() > 0
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_empty_queue_and_learnable_temperature():
    q, key, _neg = _inputs(6, 0, 0, seed=2, paired=False)
    q.requires_grad_()
    empty = torch.zeros(0, 5, dtype=torch.float64)
    # an empty pool as the only negatives: no loss to compute -- said as for negatives=None
    for pool in (empty, None):
        with pytest.raises(ValueError, match=r"in_batch_negatives=False .*identically 0"):
            tc.info_nce_loss(q, key, pool, 0.1, in_batch_negatives=False)
    with pytest.raises(ValueError, match="empty negatives pool"):
        tc.InfoNCELoss(0.1, in_batch_negatives=False)(q, key, tc.FeatureQueue(8, 5).features.double())
    # in-batch with an empty pool: the plain in-batch loss
    assert tc.info_nce_loss(q, key, empty, 0.1).item() == pytest.approx(tc.info_nce_loss(q, key, None, 0.1).item(), rel=1e-12)
    module = tc.InfoNCELoss(0.1, learnable_temperature=True, in_batch_negatives=False).double()
    module(q, key, rand_rows(9, seed=4)).backward()
    assert module.logit_scale.grad is not None and module.logit_scale.grad != 0


def test_reductions_and_none_order():
    q, key, neg = _inputs(7, 5, 0, seed=6, paired=False)
    per = tc.info_nce_loss(q, key, neg, 0.2, reduction="none")
    assert per.shape == (7,)
    assert per.mean().item() == pytest.approx(tc.info_nce_loss(q, key, neg, 0.2).item(), rel=1e-12)
    assert per.sum().item() == pytest.approx(tc.info_nce_loss(q, key, neg, 0.2, reduction="sum").item(), rel=1e-12)
    # row 3 alone, by the formula
    one = info_nce(q[3:4], key[3:4], torch.cat([key[:3], key[4:], neg]), 0.2, "unpaired", in_batch=False)
    assert per[3].item() == pytest.approx(one.item(), rel=1e-10)


@pytest.mark.parametrize("call,exc,words", [
    (lambda q, k, n: tc.info_nce_loss(q, k, n[:, None].expand(-1, 2, -1)[:3], negative_mode="paired"), ValueError, "(N, K, D)"),
    (lambda q, k, n: tc.info_nce_loss(q, k, n[:, :3]), ValueError, "negatives must have feature size"),
    (lambda q, k, n: tc.info_nce_loss(q, k, n[:, None], negative_mode="unpaired"), ValueError, "negatives must have 2"),
    (lambda q, k, n: tc.info_nce_loss(q, k, n, negative_mode="paired"), ValueError, "negatives must have 3"),
    (lambda q, k, n: tc.info_nce_loss(q, k[:5], n), ValueError, "same batch size"),
    (lambda q, k, n: tc.info_nce_loss(q, k, None, in_batch_negatives=False), ValueError, "needs negatives"),
    (lambda q, k, n: tc.info_nce_loss(q, k, n, negative_mode="pool"), ValueError, "negative_mode"),
    (lambda q, k, n: tc.info_nce_loss(q, k, n, in_batch_negatives=1), TypeError, "in_batch_negatives"),
    (lambda q, k, n: tc.info_nce_loss(q, k, n.long()), TypeError, "negatives"),
    (lambda q, k, n: tc.info_nce_loss(q, k, n * float("nan")), ValueError, "negatives contains non-finite"),
    (lambda q, k, n: tc.info_nce_loss(q, k, n, 0.0), ValueError, "temperature"),
    (lambda q, k, n: tc.InfoNCELoss(negative_mode="x"), ValueError, "negative_mode"),
])
def test_bad_input(call, exc, words):
    q, key, neg = _inputs(6, 4, 0, seed=0, paired=False)
    with pytest.raises(exc, match=__import__("re").escape(words)):
        call(q, key, neg)


def test_inputs_not_modified():
    q, key, neg = _inputs(6, 4, 2, seed=0, paired=True)
    copies = [t.clone() for t in (q, key, neg)]
    tc.info_nce_loss(q, key, neg, 0.1, negative_mode="paired")
    for a, b in zip((q, key, neg), copies):
        assert torch.equal(a, b)
