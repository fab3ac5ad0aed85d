"""The confident regime (engine/confident.py): a loss near 0 keeps its digits.

Batches whose positives dominate (keys = queries + tiny noise, negatives at cosine ~0.3) at
small temperatures: the loss is 1e-6..1e-4. Our fp32 value and input gradients are
compared with the float64 formula and with ``F.cross_entropy`` on the fp32 logits a user
would compute: ours must be at least as accurate (and accurate in absolute terms).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_contrastive as tc
from device import DEVICE


def _confident(n: int, d: int = 64, noise: float = 2e-3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shared = F.normalize(torch.randn(1, d, generator=g, dtype=torch.float64), dim=1)
    query = 0.8 * F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1) + 0.5 * shared
    key = query + noise * torch.randn(n, d, generator=g, dtype=torch.float64)
    return query, key


def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """F.cross_entropy -- in float64, the same loss written without cancellation
    (``log1p`` of the other candidates relative to the target), as float64's own
    ``1 + x`` would round a loss below 1e-16 away."""
    if logits.dtype != torch.float64:
        return F.cross_entropy(logits, target)
    rows = torch.arange(logits.shape[0], device=logits.device)
    minus_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    relative = (logits - logits[rows, target][:, None]).index_put((rows, target), minus_inf)
    return torch.log1p(relative.exp().sum(1)).mean()


def _ce_info_nce(q, k, tau, negatives=None):
    cands = k if negatives is None else torch.cat([k, negatives])
    return _ce(F.normalize(q, dim=1) @ F.normalize(cands, dim=1).T / tau, torch.arange(q.shape[0], device=q.device))


def _ce_clip(img, txt, tau):
    logits = F.normalize(img, dim=1) @ F.normalize(txt, dim=1).T / tau
    target = torch.arange(img.shape[0], device=img.device)
    return (_ce(logits, target) + _ce(logits.T, target)) / 2


def _ce_nt_xent(z, tau, pairing):
    n = z.shape[0]
    zn = F.normalize(z, dim=1)
    logits = (zn @ zn.T / tau).masked_fill(torch.eye(n, dtype=torch.bool, device=z.device), float("-inf"))
    rows = torch.arange(n, device=z.device)
    partner = rows ^ 1 if pairing == "adjacent" else (rows + n // 2) % n
    return _ce(logits, partner)


def _errors(fn, inputs):
    """(relative value error, max relative gradient error) of fp32 against float64."""
    ref_in = [t.clone().requires_grad_() for t in inputs]
    ref = fn(*ref_in)
    ref.backward()
    low_in = [t.to(DEVICE, torch.float32).requires_grad_() for t in inputs]
    low = fn(*low_in)
    low.backward()
    value = abs(float(low.detach()) - float(ref.detach())) / abs(float(ref.detach()))
    grad = max(float((lo.grad.cpu().double() - r.grad).abs().max() / r.grad.abs().max()) for lo, r in zip(low_in, ref_in))
    return value, grad, float(ref.detach())


def _check(ours, peer, inputs, max_loss=1e-3):
    ours_value, ours_grad, loss = _errors(ours, inputs)
    peer_value, peer_grad, _ = _errors(peer, inputs)
    assert loss < max_loss  # the batch really is in the confident regime
    # at least as accurate as F.cross_entropy (a small floor: it can be lucky on one batch)
    assert ours_value <= max(peer_value, 2e-5), (ours_value, peer_value)
    assert ours_grad <= max(peer_grad, 2e-4), (ours_grad, peer_grad)
    assert ours_value < 2e-5 and ours_grad < 2e-4


CHUNKS = [None, 7]  # one tile, and ragged odd tiles (the strided positives cross tile edges)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("tau", [0.05, 0.02, 0.01])  # the bounded one-exp path and the online maximum
def test_info_nce_in_batch(tau, chunk):
    q, k = _confident(48)
    _check(lambda a, b: tc.info_nce_loss(a, b, temperature=tau, chunk_size=chunk),
           lambda a, b: _ce_info_nce(a, b, tau), [q, k])


@pytest.mark.parametrize("chunk", CHUNKS)
def test_info_nce_with_live_negatives(chunk):
    q, k = _confident(40)
    negs = _confident(24, seed=1)[0]  # candidates past the keys: a rectangular problem
    _check(lambda a, b, c: tc.info_nce_loss(a, b, c, temperature=0.02, chunk_size=chunk),
           lambda a, b, c: _ce_info_nce(a, b, 0.02, c), [q, k, negs])


@pytest.mark.parametrize("chunk", CHUNKS)
def test_info_nce_with_a_queue_and_a_guide(chunk):
    """The general path (keys and a constant pool as separate engine calls) with GIST-style
    guide masking at tau = 0.01: nothing is masked here (the guide is the model itself and
    every positive dominates), so the peer is plain cross-entropy."""
    q, k = _confident(40)
    queue = _confident(30, seed=2)[0]

    def ours(a, b):
        return tc.info_nce_loss(a, b, queue.to(a.device, a.dtype), temperature=0.01, chunk_size=chunk,
                                guide=(a.detach(), b.detach(), queue.to(a.device, a.dtype)))

    _check(ours, lambda a, b: _ce_info_nce(a, b, 0.01, queue.to(a.device, a.dtype)), [q, k])


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("tau", [0.02, 0.01])
def test_clip_rows_and_columns(tau, chunk):
    img, txt = _confident(48)
    _check(lambda a, b: tc.clip_loss(a, b, tau, chunk_size=chunk), lambda a, b: _ce_clip(a, b, tau), [img, txt])


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("pairing", ["halves", "adjacent"])
def test_nt_xent_pairing_rules(pairing, chunk):
    v1, v2 = _confident(24)
    z = torch.cat([v1, v2]) if pairing == "halves" else torch.stack([v1, v2], 1).reshape(-1, v1.shape[1])
    _check(lambda x: tc.nt_xent_loss(x, 0.02, pairing=pairing, chunk_size=chunk),
           lambda x: _ce_nt_xent(x, 0.02, pairing), [z])


def test_per_row_values_and_weights_away_from_the_regime_are_unchanged():
    """Ordinary batches: the kept-apart positive gives the same per-row values as the formula."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(33, 16, generator=g, dtype=torch.float64), torch.randn(33, 16, generator=g, dtype=torch.float64)
    for chunk in CHUNKS:
        ours = tc.info_nce_loss(q.to(DEVICE), k.to(DEVICE), temperature=0.1, reduction="none", chunk_size=chunk).cpu()
        logits = F.normalize(q, dim=1) @ F.normalize(k, dim=1).T / 0.1
        torch.testing.assert_close(ours, F.cross_entropy(logits, torch.arange(33), reduction="none"), rtol=1e-12, atol=1e-12)


def test_large_losses_keep_float64_digits():
    """The other end: a positive far below its negatives (loss > 20 per row) still matches
    float64 cross-entropy to rounding (a softplus that returns x past 20 would lose e^-x)."""
    q, k = _confident(16)
    logits = F.normalize(q, dim=1) @ F.normalize(-k, dim=1).T / 0.03
    expected = F.cross_entropy(logits, torch.arange(16), reduction="none")
    assert expected.min() > 20
    for chunk in CHUNKS:  # the one tile's sums and the tiled margins
        per_row = tc.info_nce_loss(q.to(DEVICE), (-k).to(DEVICE), temperature=0.03, reduction="none", chunk_size=chunk).cpu()
        torch.testing.assert_close(per_row, expected, rtol=1e-14, atol=0)
