"""False negatives and variants (SPEC §12): id and guide masking, DCL/DCLW, label smoothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_contrastive as tc
from device import DEVICE
from helpers import DTYPES, compare
from peers import lightly_files
from reference import info_nce_masked


def _case(n, m, k, seed, paired, dg=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, 5, generator=g, dtype=torch.float64)
    key = q + 0.8 * torch.randn(n, 5, generator=g, dtype=torch.float64)
    neg = torch.randn(n, k, 5, generator=g, dtype=torch.float64) if paired else torch.randn(m, 5, generator=g, dtype=torch.float64)
    key_ids = torch.randint(0, max(1, n // 2), (n,), generator=g)
    neg_ids = torch.randint(0, max(1, n // 2), (n, k) if paired else (m,), generator=g)
    gq = torch.randn(n, 3, generator=g, dtype=torch.float64)
    gk = gq + 0.5 * torch.randn(n, 3, generator=g, dtype=torch.float64)
    gn = torch.randn(n, k, 3, generator=g, dtype=torch.float64) if paired else torch.randn(m, 3, generator=g, dtype=torch.float64)
    return q, key, neg, key_ids, neg_ids, (gq, gk, gn)


MODES = [("none", True), ("unpaired", True), ("unpaired", False), ("paired", True), ("paired", False)]


@pytest.mark.parametrize("dtype,tols", DTYPES[:2])
@pytest.mark.parametrize("mode,in_batch", MODES)
@pytest.mark.parametrize("n", [1, 7, 13])
@pytest.mark.parametrize("chunk", [None, 4])
@pytest.mark.parametrize("rule", ["ids", "guide_absolute", "guide_relative", "decoupled", "ids_decoupled"])
def test_masked_info_nce_equals_the_minus_inf_reference(rule, chunk, n, mode, in_batch, dtype, tols):
    if mode == "none" and not in_batch:
        return
    q, key, neg, key_ids, neg_ids, guide = _case(n, 9, 3, seed=n + len(rule), paired=mode == "paired")
    negs = None if mode == "none" else neg
    neg_mode = "unpaired" if mode == "none" else mode
    kw = {}
    ref_kw = {}
    if rule.startswith("ids"):
        kw = dict(key_ids=key_ids.to(DEVICE), negative_ids=None if negs is None else neg_ids.to(DEVICE))
        ref_kw = dict(key_ids=key_ids, negative_ids=None if negs is None else neg_ids)
    if rule.startswith("guide"):
        margin_mode = rule.split("_")[1]
        g = guide if negs is not None else guide[:2]
        kw = dict(guide=tuple(x.to(DEVICE) for x in g), guide_margin=0.1, guide_margin_mode=margin_mode)
        ref_kw = dict(guide=guide, margin=0.1, margin_mode=margin_mode)
    if rule.endswith("decoupled"):
        kw["decoupled"] = True
        ref_kw["decoupled"] = True

    def ours(a, b, *rest):
        *c, t = rest
        return tc.info_nce_loss(a, b, c[0] if c else None, t, negative_mode=neg_mode, in_batch_negatives=in_batch,
                                chunk_size=chunk, **kw)

    def ref(a, b, *rest):
        *c, t = rest
        return info_nce_masked(a, b, c[0] if c else None, t, neg_mode, in_batch, **ref_kw)

    compare(ours, ref, [q, key] + ([] if negs is None else [negs]), 0.2, dtype, tols)


def test_every_candidate_excluded_gives_zero_and_a_zero_gradient():
    q, key, _, _, _, _ = _case(6, 0, 0, seed=1, paired=False)
    q.requires_grad_()
    same = torch.zeros(6, dtype=torch.long)  # every key is a duplicate of every positive
    loss = tc.info_nce_loss(q, key, None, 0.1, key_ids=same, decoupled=True, chunk_size=4)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(q.grad).all() and q.grad.abs().max() == 0
    # without decoupling the positive stays: the loss is -s_ii + log exp(s_ii) = 0 as well
    assert tc.info_nce_loss(q, key, None, 0.1, key_ids=same).item() == pytest.approx(0.0, abs=1e-12)


def test_guide_margin_zero_keeps_candidates_less_similar_than_the_positive():
    q, key, neg, _, _, _guide = _case(8, 6, 0, seed=2, paired=False)
    # a guide equal to the student: with margin 0 the candidates above the positive leave
    gq, gk, gn = q.clone(), key.clone(), neg.clone()
    out = tc.info_nce_loss(q, key, neg, 0.1, guide=(gq, gk, gn), reduction="none")
    ref = torch.stack([info_nce_masked(q[i : i + 1], key[i : i + 1], torch.cat([key[:i], key[i + 1 :], neg]), 0.1, in_batch=False,
                                       guide=(gq[i : i + 1], gk[i : i + 1], torch.cat([gk[:i], gk[i + 1 :], gn]))) for i in range(8)])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    # every remaining negative scores below the positive in the guide
    plain = tc.info_nce_loss(q, key, neg, 0.1, reduction="none")
    assert (out <= plain + 1e-12).all() and (out < plain).any()


@pytest.mark.parametrize("mode", ["none", "unpaired", "paired"])
@pytest.mark.parametrize("in_batch", [True, False])
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.5])
def test_label_smoothing_equals_pytorch_cross_entropy(mode, in_batch, eps):
    if mode == "none" and not in_batch:
        return
    q, key, neg, *_ = _case(7, 5, 3, seed=3, paired=mode == "paired")
    leaves = [t.clone().requires_grad_() for t in (q, key, neg)]
    qn, kn, nn_ = (F.normalize(t, dim=-1) for t in leaves)
    pos = (qn * kn).sum(1, keepdim=True)
    parts = [qn @ kn.T] if in_batch else [pos]
    if mode == "unpaired":
        parts.append(qn @ nn_.T)
    if mode == "paired":
        parts.append(torch.bmm(nn_, qn[:, :, None])[:, :, 0])
    logits = torch.cat(parts, 1) / 0.2
    target = torch.arange(7) if in_batch else torch.zeros(7, dtype=torch.long)
    ref = F.cross_entropy(logits, target, label_smoothing=eps)
    ref_grads = torch.autograd.grad(ref, leaves[:2] + ([leaves[2]] if mode != "none" else []))
    ours_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    ours = tc.info_nce_loss(ours_leaves[0], ours_leaves[1], None if mode == "none" else ours_leaves[2], 0.2,
                            negative_mode="unpaired" if mode == "none" else mode, in_batch_negatives=in_batch, label_smoothing=eps,
                            chunk_size=3)
    grads = torch.autograd.grad(ours, ours_leaves[:2] + ([ours_leaves[2]] if mode != "none" else []))
    assert ours.item() == pytest.approx(ref.item(), rel=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("call,exc,words", [
    (lambda q, k, n, ki, ni, g: tc.info_nce_loss(q, k, n, negative_ids=ni), ValueError, "negative_ids needs key_ids"),
    (lambda q, k, n, ki, ni, g: tc.info_nce_loss(q, k, n, key_ids=ki[:3]), ValueError, "key_ids must have shape"),
    (lambda q, k, n, ki, ni, g: tc.info_nce_loss(q, k, n, key_ids=ki, negative_ids=ni[:2]), ValueError, "negative_ids must have shape"),
    (lambda q, k, n, ki, ni, g: tc.info_nce_loss(q, k, n, guide=g[:2]), ValueError, "g_negatives"),
    (lambda q, k, n, ki, ni, g: tc.info_nce_loss(q, k, n, guide=(g[0][:2], g[1], g[2])), ValueError, "guide[0] (g_query) must have"),
    (lambda q, k, n, ki, ni, g: tc.info_nce_loss(q, k, n, guide=g, guide_margin=-1.0), ValueError, "guide_margin"),
    (lambda q, k, n, ki, ni, g: tc.info_nce_loss(q, k, n, guide=g, guide_margin_mode="ratio"), ValueError, "guide_margin_mode"),
    (lambda q, k, n, ki, ni, g: tc.info_nce_loss(q, k, n, label_smoothing=1.0), ValueError, "label_smoothing"),
    (lambda q, k, n, ki, ni, g: tc.info_nce_loss(q, k, n, label_smoothing=0.1, decoupled=True), ValueError, "not combined"),
    (lambda q, k, n, ki, ni, g: tc.info_nce_loss(q, k, n, decoupled=1), TypeError, "decoupled must be a bool"),
])
def test_bad_input(call, exc, words):
    q, key, neg, ki, ni, g = _case(6, 4, 0, seed=0, paired=False)
    with pytest.raises(exc, match=__import__("re").escape(words)):
        call(q, key, neg, ki, ni, g)


# ----------------------------------------------------------------- DCL / DCLW, image-text variants
from reference import image_text_variant, nt_xent_decoupled  # noqa: E402


@pytest.mark.parametrize("dtype,tols", DTYPES)
@pytest.mark.parametrize("n", [2, 8, 14])
@pytest.mark.parametrize("pairing", ["adjacent", "halves"])
@pytest.mark.parametrize("chunk", [None, 4])
@pytest.mark.parametrize("tau", [0.01, 0.3])
def test_nt_xent_decoupled_reference(tau, chunk, pairing, n, dtype, tols):
    x = torch.randn(n, 5, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    compare(lambda a, t: tc.nt_xent_loss(a, t, pairing=pairing, decoupled=True, chunk_size=chunk),
             lambda a, t: nt_xent_decoupled(a, t, pairing), [x], tau, dtype, tols)


def test_nt_xent_positive_weight_reference():
    x = torch.randn(10, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    w = torch.linspace(0.5, 1.5, 10, dtype=torch.float64)
    for chunk in (None, 3):
        compare(lambda a, t, chunk=chunk: tc.nt_xent_loss(a, t, pairing="halves", decoupled=True, positive_weight=w, chunk_size=chunk),
                 lambda a, t: nt_xent_decoupled(a, t, "halves", w), [x], 0.2, torch.float64, (1e-9, 1e-9))


@pytest.mark.parametrize("dtype,tols", DTYPES[:2])
@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("pairing", ["adjacent", "halves"])
def test_nt_xent_learnable_positive_weight_gets_its_gradient(pairing, chunk, dtype, tols):
    """A positive_weight that requires grad gets d loss / d w_i = -s_ip / rows (the float64
    reference differentiates through w), not a silent zero."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(10, 5, generator=g, dtype=torch.float64)
    w = torch.rand(10, generator=g, dtype=torch.float64) + 0.5
    compare(lambda a, wt, t: tc.nt_xent_loss(a, t, pairing=pairing, decoupled=True, positive_weight=wt, chunk_size=chunk),
             lambda a, wt, t: nt_xent_decoupled(a, t, pairing, wt), [x, w], 0.2, dtype, tols)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("decoupled", [False, True])
def test_positive_weight_gradient_under_every_reduction(reduction, decoupled):
    """Against the dense float64 formula ``-w_i s_ip + LSE_i`` (LSE without the positive for DCL),
    weight, embeddings and temperature alike, through the reduction the engine applies inside."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(8, 4, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    w = (torch.rand(8, generator=g, dtype=torch.float64) + 0.5).to(DEVICE).requires_grad_()
    upstream = torch.randn(8, generator=g, dtype=torch.float64).to(DEVICE)
    z = torch.nn.functional.normalize(x, dim=1)
    s = z @ z.T / 0.3
    partner = (torch.arange(8, device=DEVICE) + 4) % 8
    left_out = torch.eye(8, dtype=torch.bool, device=DEVICE) | (torch.nn.functional.one_hot(partner, 8).bool() if decoupled else False)
    per_row = -w * s[torch.arange(8), partner] + torch.logsumexp(s.masked_fill(left_out, float("-inf")), 1)
    ref = {"mean": per_row.mean(), "sum": per_row.sum(), "none": (per_row * upstream).sum()}[reduction]
    ref_grads = torch.autograd.grad(ref, (x, w))
    got = tc.nt_xent_loss(x, 0.3, pairing="halves", decoupled=decoupled, positive_weight=w, reduction=reduction)
    got = (got * upstream).sum() if reduction == "none" else got
    assert got.item() == pytest.approx(ref.item(), rel=1e-10)
    for ours, theirs in zip(torch.autograd.grad(got, (x, w)), ref_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-10)


def test_engine_refuses_weights_that_require_grad():
    """The engine's weights are constants: one that requires grad is an error, never dropped."""
    from torch_contrastive.engine import PairTerms, Problem, Softmax

    x = torch.randn(4, 3, device=DEVICE)
    w = torch.ones(4, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match="require grad"):
        Problem(x, x, 1.0, Softmax(row_weights=(None, w)), self_offset=0)
    with pytest.raises(ValueError, match="require grad"):
        Problem(x, x, 1.0, Softmax(col_weights=(w, None), columns=True))
    pos = tc.positives.Positives.from_keys(torch.arange(4, device=DEVICE) % 2, self_offset=0)
    with pytest.raises(ValueError, match="require grad"):
        Problem(x, x, 1.0, PairTerms("binary", combine=((w, w), 1.0)), positives=pos, self_offset=0)


@pytest.mark.parametrize("dtype,tols", DTYPES[:2])
@pytest.mark.parametrize("ids", ["none", "image", "both"])
@pytest.mark.parametrize("variant", [dict(decoupled=True), dict(smoothing=0.1), dict(smoothing=0.4)])
@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("n", [1, 7])
def test_image_text_variants_reference(n, chunk, variant, ids, dtype, tols):
    g = torch.Generator().manual_seed(n)
    img, txt = torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randn(n, 5, generator=g, dtype=torch.float64)
    image_id = None if ids == "none" else torch.randint(0, 3, (n,), generator=g)
    text_id = torch.randint(0, 3, (n,), generator=g) if ids == "both" else None
    kw = dict(decoupled=variant.get("decoupled", False), label_smoothing=variant.get("smoothing", 0.0))
    compare(lambda a, b, t: tc.image_text_contrastive_loss(a, b, t, image_id, text_id, chunk_size=chunk, **kw),
             lambda a, b, t: image_text_variant(a, b, t, image_id, text_id, kw["decoupled"], kw["label_smoothing"]),
             [img, txt], 0.2, dtype, tols)


def test_image_text_smoothing_without_ids_is_pytorch_cross_entropy():
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(9, 6, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2)]
    logits = F.normalize(leaves[0], dim=1) @ F.normalize(leaves[1], dim=1).T / 0.07
    target = torch.arange(9)
    ref = (F.cross_entropy(logits, target, label_smoothing=0.2) + F.cross_entropy(logits.T, target, label_smoothing=0.2)) / 2
    ours = tc.ClipLoss(0.07)  # the module passes the options through
    value = tc.image_text_contrastive_loss(*leaves, 0.07, label_smoothing=0.2, chunk_size=4)
    torch.testing.assert_close(value, ref, rtol=1e-12, atol=1e-12)
    assert ours(*leaves).item() != pytest.approx(value.item())  # smoothing changes the value


@pytest.fixture
def lightly_dcl():
    """lightly 1.6's dcl_loss.py loaded on its own (the package imports torchvision at import time)."""
    with lightly_files() as files:
        yield files["dcl_loss"]


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("weighted", [False, True])
def test_dcl_and_dclw_equal_lightly(lightly_dcl, weighted, seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 30, (1,), generator=g))
    out0, out1 = torch.randn(n, 12, generator=g), torch.randn(n, 12, generator=g)
    peer = lightly_dcl.DCLWLoss(0.1, sigma=0.5) if weighted else lightly_dcl.DCLLoss(0.1)
    ours = tc.DCLWLoss(0.1, sigma=0.5) if weighted else tc.DCLLoss(0.1)
    leaves = [t.clone().requires_grad_() for t in (out0, out1)]
    ref = peer(*leaves)
    ref_grads = torch.autograd.grad(ref, leaves)
    mine = [t.clone().requires_grad_() for t in (out0, out1)]
    value = ours(*mine)
    assert value.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    for a, b in zip(torch.autograd.grad(value, mine), ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("mode", ["none", "unpaired"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_guide_tiles_that_exclude_nothing_are_skipped_in_backward_exactly(validate, mode, dtype, monkeypatch):
    """With validate=True and a float temperature the guide's tiles learn in forward which of them
    exclude anything (read with the call's one transfer); backward skips the others and zeroes
    those whose rows exclude one candidate at most by a scatter. Values and gradients still equal
    the float64 reference, and tiles of all three kinds occur here."""
    n, m = 24, 16
    q, key, neg, _, _, (gq, gk, gn) = _case(n, m, 0, seed=11, paired=False)
    gq[3], gq[10], gq[22] = gq[9], gq[2], gq[14]  # near-duplicates: one exclusion in their rows
    gk = gq.clone()
    gk[5] = -gq[5]  # a few rows whose positive scores low in the guide: their tiles exclude many candidates
    gk[17] = -gq[17]
    learned = []
    real_learn_from = tc.positives.Exclusion.learn_from

    def spy(self, values):
        real_learn_from(self, values)
        learned.append(self)

    monkeypatch.setattr(tc.positives.Exclusion, "learn_from", spy)
    negs = None if mode == "none" else neg
    guide = (gq, gk) if negs is None else (gq, gk, gn)
    inputs = [x.to(dtype).requires_grad_() for x in ([q, key] if negs is None else [q, key, negs])]
    loss = tc.info_nce_loss(*inputs[:2], inputs[2] if negs is not None else None, 0.2, guide=guide, guide_margin=0.05,
                            chunk_size=4, validate=validate)
    loss.backward()
    ref_in = [x.detach().double().requires_grad_() for x in inputs]
    ref = info_nce_masked(ref_in[0], ref_in[1], ref_in[2] if negs is not None else None, torch.tensor(0.2, dtype=torch.float64),
                          "unpaired", True, guide=(gq, gk, gn), margin=0.05, margin_mode="absolute")
    ref.backward()
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    assert loss.item() == pytest.approx(ref.item(), rel=tol)
    for a, b in zip(inputs, ref_in):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=tol, atol=tol * b.grad.abs().max().item())
    if validate:  # skipped, scattered and masked-again tiles all occurred
        clear = set().union(*(e.record.clear for e in learned))
        single = set().union(*(set(e.record.firsts) for e in learned))  # tiles zeroed by a scatter
        assert len(clear) > 1 and single and len(clear | single) - 1 < 36 + 24 * (negs is not None)
    else:
        assert not learned
