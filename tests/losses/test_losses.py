"""Values and gradients of every loss against the float64 references and the seeds."""

from __future__ import annotations

import pytest
import torch

import torch_contrastive as tc
from helpers import DTYPES, compare, rand_rows
from reference import (
    LOG_FLOAT32_TINY,
    SEED000_POS,
    SEED004_A,
    SEED004_B,
    SEED004_C,
    image_text,
    nt_bxent,
    nt_xent,
    nt_xent_pml,
    seed000_x,
    supcon,
)

TEMPS = (0.01, 0.1, 1.0, 10.0, 20.0)


# ----------------------------------------------------------------- seed vectors (README, "Seed numbers reproduced")
@pytest.mark.parametrize("tau,expected", list(zip(TEMPS, (167.33397, 16.916988, 2.8555007, 2.0152008, 1.9799404))))
def test_seed000_nt_xent(tau, expected):
    x = seed000_x()
    assert tc.nt_xent_loss(x.double(), tau).item() == pytest.approx(expected, rel=1e-6)
    assert tc.nt_xent_loss(x, tau).item() == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("tau,expected", list(zip(TEMPS, (48.286442, 4.851107, 1.0727110, 0.9827174, 0.9820991))))
def test_seed000_nt_bxent(tau, expected):
    x = seed000_x()
    assert tc.nt_bxent_loss(x.double(), SEED000_POS, tau).item() == pytest.approx(expected, rel=1e-6)
    # float32 too: the seed's 62.8988 at tau=0.01 is a sigmoid-saturation artefact (README, "Seed numbers reproduced").
    assert tc.nt_bxent_loss(x, SEED000_POS, tau).item() == pytest.approx(expected, rel=1e-4)


def test_seed004_numbers():
    l2 = torch.tensor([0, 1, 0, 1])
    assert tc.supcon_loss(SEED004_A, l2, temperature=1).item() == pytest.approx(1.5018, abs=5e-4)
    assert tc.nt_xent_loss(SEED004_A, 1.0, labels=l2).item() == pytest.approx(1.5018, abs=5e-4)
    l3 = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2])
    assert tc.supcon_loss(SEED004_B, l3, temperature=1).item() == pytest.approx(2.1960, abs=5e-4)
    assert tc.nt_xent_loss(SEED004_B, 1.0, labels=l3).item() == pytest.approx(2.0615, abs=5e-4)
    l4 = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])
    assert tc.supcon_loss(SEED004_C, l4, temperature=1).item() == pytest.approx(1.8374, abs=5e-4)
    assert tc.nt_xent_loss(SEED004_C, 1.0, labels=l4).item() == pytest.approx(1.4141, abs=5e-4)
    # The authors' form: (bsz, n_views, D), views only -> SimCLR NT-Xent (1.7731).
    feats = torch.stack(torch.split(SEED004_C, [4, 4]), dim=1)
    assert tc.supcon_loss(feats, temperature=1, base_temperature=1).item() == pytest.approx(1.7731, abs=5e-4)
    assert tc.nt_xent_loss(SEED004_C, 1.0, pairing="halves").item() == pytest.approx(1.7731, abs=5e-4)
    # and with labels in the authors' form it is the same SupCon as the flat form.
    assert tc.supcon_loss(feats, torch.tensor([0, 1, 0, 1]) * 0 + torch.tensor([0, 0, 1, 1]), temperature=1).item() == \
        pytest.approx(1.8374, abs=5e-4)


# ----------------------------------------------------------------- references, values + grads
@pytest.mark.parametrize("dtype,tols", DTYPES)
@pytest.mark.parametrize("n", [2, 8, 14])
@pytest.mark.parametrize("pairing", ["adjacent", "halves"])
@pytest.mark.parametrize("tau", [0.1, 0.5, 2.0])
@pytest.mark.parametrize("chunk", [None, 4])
def test_nt_xent_reference(chunk, dtype, tols, n, pairing, tau):
    compare(lambda x, t: tc.nt_xent_loss(x, t, pairing=pairing, chunk_size=chunk),
             lambda x, t: nt_xent(x, t, pairing), [rand_rows(n, seed=n)], tau, dtype, tols)


@pytest.mark.parametrize("dtype,tols", DTYPES)
@pytest.mark.parametrize("n,classes", [(7, 3), (13, 4), (1, 1), (9, 9), (6, 1)])
@pytest.mark.parametrize("tau", [0.1, 1.0])
@pytest.mark.parametrize("chunk", [None, 4])
def test_nt_xent_labels_reference(chunk, dtype, tols, n, classes, tau):
    labels = torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(n))
    compare(lambda x, t: tc.nt_xent_loss(x, t, labels=labels, chunk_size=chunk),
             lambda x, t: nt_xent_pml(x, labels, t), [rand_rows(n, seed=n + 1)], tau, dtype, tols)


@pytest.mark.parametrize("dtype,tols", DTYPES)
@pytest.mark.parametrize("tau", [0.01, 0.1, 1.0])
@pytest.mark.parametrize("chunk", [None, 4])
def test_nt_bxent_reference(chunk, dtype, tols, tau):
    x = seed000_x().double()
    compare(lambda z, t: tc.nt_bxent_loss(z, SEED000_POS, t, chunk_size=chunk),
             lambda z, t: nt_bxent(z, t, pos_indices=SEED000_POS), [x], tau, dtype, tols)


@pytest.mark.parametrize("dtype,tols", DTYPES)
@pytest.mark.parametrize("n,classes", [(7, 2), (13, 5), (1, 1), (6, 1)])
@pytest.mark.parametrize("chunk", [None, 4])
def test_nt_bxent_labels_reference(chunk, dtype, tols, n, classes):
    labels = torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(3 * n))
    compare(lambda z, t: tc.nt_bxent_loss(z, labels=labels, temperature=t, chunk_size=chunk),
             lambda z, t: nt_bxent(z, t, labels=labels), [rand_rows(n, seed=n)], 0.3, dtype, tols)


@pytest.mark.parametrize("dtype,tols", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 13])
@pytest.mark.parametrize("ids", ["none", "image", "text", "both", "all_same"])
@pytest.mark.parametrize("chunk", [None, 4])
def test_image_text_reference(chunk, dtype, tols, n, ids):
    g = torch.Generator().manual_seed(n)
    iid = torch.randint(0, max(1, n // 2), (n,), generator=g) if ids in ("image", "both") else None
    if ids == "all_same":  # every pair is a positive
        iid = torch.zeros(n, dtype=torch.int64)
    tid = torch.randint(0, max(1, n // 3), (n,), generator=g) if ids in ("text", "both") else None
    compare(lambda a, b, t: tc.image_text_contrastive_loss(a, b, t, iid, tid, chunk_size=chunk),
             lambda a, b, t: image_text(a, b, t, iid, tid), [rand_rows(n, seed=n), rand_rows(n, seed=n + 100)], 0.07, dtype, tols)


@pytest.mark.parametrize("dtype,tols", DTYPES)
@pytest.mark.parametrize("bsz,views", [(4, 2), (7, 3), (1, 2), (5, 1)])
@pytest.mark.parametrize("mode", ["all", "one"])
@pytest.mark.parametrize("kind", ["labels", "mask", "views", "one_class"])
@pytest.mark.parametrize("chunk", [None, 4])
def test_supcon_reference(chunk, dtype, tols, bsz, views, mode, kind):
    g = torch.Generator().manual_seed(bsz * 10 + views)
    feats = torch.randn(bsz, views, 6, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 3, (bsz,), generator=g) if kind == "labels" else None
    if kind == "one_class":
        labels = torch.zeros(bsz, dtype=torch.int64)
    mask = (torch.rand(bsz, bsz, generator=g) > 0.5).float() if kind == "mask" else None  # asymmetric
    compare(lambda f, t: tc.supcon_loss(f, labels, mask, t, base_temperature=0.07, contrast_mode=mode, chunk_size=chunk),
             lambda f, t: supcon(f, t, labels, mask, 0.07, mode), [feats], 0.2, dtype, tols)


def test_supcon_flat_equals_pml_form():
    x = rand_rows(10, seed=4)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 5])  # the last anchor has no positive
    ours = tc.supcon_loss(x, labels, temperature=0.3)
    assert ours.item() == pytest.approx(supcon(x, 0.3, labels).item(), rel=1e-12)


# ----------------------------------------------------------------- gradcheck (custom autograd)
@pytest.mark.parametrize("chunk", [None, 2])
def test_gradcheck_all_losses(chunk):
    torch.manual_seed(0)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    tau = torch.tensor(0.4, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 1, 0, 2, 1, 1])
    checks = [
        (lambda a, t: tc.nt_xent_loss(a, t, chunk_size=chunk), (x, tau)),
        (lambda a, t: tc.nt_xent_loss(a, t, labels=labels, chunk_size=chunk), (x, tau)),
        (lambda a, t: tc.nt_bxent_loss(a, torch.tensor([[0, 1], [2, 5], [4, 3]]), t, chunk_size=chunk), (x, tau)),
        (lambda a, t: tc.nt_bxent_loss(a, labels=labels, temperature=t, chunk_size=chunk), (x, tau)),
        (lambda a, b, t: tc.image_text_contrastive_loss(a, b, t, labels, chunk_size=chunk), (x, y, tau)),
        (lambda a, t: tc.supcon_loss(a.reshape(3, 2, 3), labels[:3], temperature=t, chunk_size=chunk), (x, tau)),
        (lambda a, t: tc.nt_xent_loss(a, t, normalize=False, chunk_size=chunk), (x, tau)),
    ]
    for fn, inputs in checks:
        assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


# ----------------------------------------------------------------- peer library
@pytest.fixture
def pml_losses():
    """pytorch-metric-learning's losses; only the tests that use the peer skip without it."""
    return pytest.importorskip("pytorch_metric_learning.losses")


@pytest.mark.parametrize("tau", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("seed", range(20))
def test_matches_pytorch_metric_learning(pml_losses, tau, seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(6, 40, (1,), generator=g))
    x = torch.randn(n, 16, generator=g)
    labels = torch.randint(0, max(2, n // 3), (n,), generator=g)
    labels[-1] = 10_000  # an anchor without positives
    ref = pml_losses.NTXentLoss(temperature=tau)(x, labels)
    assert tc.nt_xent_loss(x, tau, labels=labels).item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    ref = pml_losses.SupConLoss(temperature=tau)(x, labels)
    assert tc.supcon_loss(x, labels, temperature=tau).item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    assert tc.SupConLoss(tau)(x, labels).item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)


def test_small_temperature_exact_where_pml_clamps(pml_losses):
    # Rows 0 and 1 share a label but point in opposite directions, and each has a negative
    # pointing its own way: at tau = 0.01 the pair's term is about 200, far above the
    # -log(float32 tiny) = 87.3 at which pytorch-metric-learning clamps it (and stops its gradient).
    x = torch.tensor([[1.0, 0.0, 0.0], [-1.0, 0.05, 0.0], [0.99, 0.1, 0.0], [-0.99, 0.0, 0.1],
                      [0.0, 1.0, 0.0], [0.0, 0.9, 0.3]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 2, 3, 3])
    ref_in = x.clone().requires_grad_()
    ref = nt_xent_pml(ref_in, labels, 0.01)
    ref.backward()
    assert ref.item() > LOG_FLOAT32_TINY / 2  # the mean over 4 pairs, two of them ~200
    ours_in = x.float().requires_grad_()
    ours = tc.nt_xent_loss(ours_in, 0.01, labels=labels)
    ours.backward()
    assert ours.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(ours_in.grad.double(), ref_in.grad, rtol=1e-4, atol=1e-4 * ref_in.grad.abs().max().item())
    pml_in = x.float().requires_grad_()
    pml = pml_losses.NTXentLoss(temperature=0.01)(pml_in, labels)
    pml.backward()
    # PML's clamp changes the value (documented difference) and zeroes the clamped terms' gradient.
    assert pml.item() < ref.item() - 50
    assert pml_in.grad[0].abs().sum() < 0.5 * ours_in.grad[0].abs().sum()


# ----------------------------------------------------------------- reductions, modules, misc
def test_reductions_are_consistent():
    x = rand_rows(12, seed=5).float()
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 0, 1, 2, 3, 3, 9])
    for fn in (lambda r: tc.nt_xent_loss(x, reduction=r), lambda r: tc.nt_bxent_loss(x, labels=labels, reduction=r)):
        assert fn("none").shape == (12,)
        assert fn("mean").item() == pytest.approx(fn("none").mean().item(), rel=1e-6)
        assert fn("sum").item() == pytest.approx(fn("none").sum().item(), rel=1e-6)
    pml = tc.nt_xent_loss(x, labels=labels, reduction="none")
    n_pairs = sum(int((labels == labels[i]).sum()) - 1 for i in range(12))
    assert tc.nt_xent_loss(x, labels=labels).item() == pytest.approx(pml.sum().item() / n_pairs, rel=1e-6)
    y = rand_rows(12, seed=6).float()
    e = tc.image_text_contrastive_loss(x, y, image_id=labels, reduction="none")
    assert tc.image_text_contrastive_loss(x, y, image_id=labels).item() == pytest.approx(e.mean().item(), rel=1e-6)
    assert tc.image_text_contrastive_loss(x, y, image_id=labels, reduction="sum").item() == pytest.approx(e.sum().item(), rel=1e-6)
    s = tc.supcon_loss(x, labels, reduction="none")
    has = torch.tensor([(labels == labels[i]).sum() > 1 for i in range(12)])
    assert tc.supcon_loss(x, labels).item() == pytest.approx(s[has].mean().item(), rel=1e-6)
    assert s[~has].abs().sum() == 0


def test_image_text_without_ids_is_clip():
    x, y = rand_rows(9, seed=1), rand_rows(9, seed=2)
    logits = torch.nn.functional.normalize(x) @ torch.nn.functional.normalize(y).T / 0.07
    target = torch.arange(9)
    clip = (torch.nn.functional.cross_entropy(logits, target) + torch.nn.functional.cross_entropy(logits.T, target)) / 2
    assert tc.clip_loss(x, y).item() == pytest.approx(clip.item(), rel=1e-12)
    assert tc.ClipLoss()(x, y).item() == pytest.approx(clip.item(), rel=1e-12)


def test_text_ids_deduplicate_strings():
    ids = tc.text_ids(["a seven", "a two", "a seven"])
    assert ids[0] == ids[2] and ids[0] != ids[1]


def test_half_inputs_compute_in_float32():
    x = rand_rows(10, seed=7)
    for dtype in (torch.float16, torch.bfloat16):
        xin = x.to(dtype).requires_grad_()
        loss = tc.nt_xent_loss(xin, 0.1)
        assert loss.dtype == torch.float32
        loss.backward()
        assert xin.grad.dtype == dtype
        ref = nt_xent(x.to(dtype).double(), 0.1)
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5)


def test_inputs_not_modified_and_zero_vectors_finite():
    x = rand_rows(8, seed=8).float()
    x[3] = 0
    before = x.clone()
    xin = x.clone().requires_grad_()
    for loss in (tc.nt_xent_loss(xin), tc.nt_bxent_loss(xin, labels=torch.arange(8) % 3),
                 tc.supcon_loss(xin, torch.arange(8) % 3), tc.image_text_contrastive_loss(xin, xin.flip(0))):
        assert torch.isfinite(loss)
        loss.backward()
    assert torch.isfinite(xin.grad).all()
    assert torch.equal(x, before)


def test_no_positive_anywhere_is_zero_with_zero_grad():
    x = rand_rows(6, seed=9).requires_grad_()
    loss = tc.supcon_loss(x, torch.arange(6))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    loss = tc.nt_xent_loss(x, labels=torch.arange(6))
    assert loss.item() == 0.0


def test_learnable_temperature_module_gets_gradient():
    m = tc.ClipLoss(learnable_temperature=True)
    assert m.logit_scale.item() == pytest.approx(2.6592600, rel=1e-6)  # ln(1/0.07)
    x, y = rand_rows(8, seed=10).float(), rand_rows(8, seed=11).float()
    m(x, y).backward()
    assert m.logit_scale.grad is not None and m.logit_scale.grad.abs() > 0
    with torch.no_grad():
        m.logit_scale.fill_(10.0)
    assert float(torch.as_tensor(m.temperature).detach()) == pytest.approx(0.01, rel=1e-6)  # clamped at scale 100
    for cls in (tc.NTXentLoss, tc.NTBXentLoss, tc.SupConLoss):
        assert "temperature" in repr(cls(0.3)) or "logit_scale" in repr(cls(0.3))


@pytest.mark.parametrize("chunk", [None, 5])
def test_sorted_key_grouping_equals_dense_relation(chunk, monkeypatch):
    """Small key relations are held densely, large ones grouped by a sort: both give the same loss."""
    import torch_contrastive.positives as positives_module

    g = torch.Generator().manual_seed(11)
    x = torch.randn(14, 5, generator=g, dtype=torch.float64)
    y = torch.randn(14, 5, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 4, (14,), generator=g)
    ids = torch.randint(0, 6, (14,), generator=g)
    fns = [
        lambda a, b: tc.nt_xent_loss(a, 0.2, labels=labels, chunk_size=chunk),
        lambda a, b: tc.nt_bxent_loss(a, labels=labels, temperature=0.2, chunk_size=chunk),
        lambda a, b: tc.supcon_loss(a, labels, temperature=0.2, chunk_size=chunk),
        lambda a, b: tc.image_text_contrastive_loss(a, b, 0.2, labels, ids, chunk_size=chunk),
    ]

    def run(fn):
        a, b = x.clone().requires_grad_(), y.clone().requires_grad_()
        loss = fn(a, b)
        loss.backward()
        return loss.detach(), a.grad, b.grad

    dense = [run(fn) for fn in fns]
    monkeypatch.setattr(positives_module, "DENSE_KEYS_LIMIT", 0)
    for fn, want in zip(fns, dense):
        for got, ref in zip(run(fn), want):
            if ref is not None:
                torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["unsorted", "sorted", "one_class", "all_distinct", "uneven"])
@pytest.mark.parametrize("validate", [True, False])
def test_label_sorted_tiles_equal_the_reference(kind, validate):
    """Tiled labelled losses (PML NT-Xent, NT-BXent): rows sorted by label skip the mask in
    all-negative tiles (validate=True reads the tile plan); both paths equal the float64 loops."""
    g = torch.Generator().manual_seed(21)
    n = 26
    labels = {
        "unsorted": torch.randint(0, 4, (n,), generator=g),
        "sorted": torch.sort(torch.randint(0, 4, (n,), generator=g)).values,
        "one_class": torch.zeros(n, dtype=torch.int64),
        "all_distinct": torch.randperm(n, generator=g),
        "uneven": torch.tensor([0] * 15 + [1] * 2 + [2] * 6 + [3] * 3)[torch.randperm(n, generator=g)],
    }[kind]
    x = torch.randn(n, 5, generator=g, dtype=torch.float64)
    for ours_fn, ref_fn in (
        (lambda a, t: tc.nt_xent_loss(a, t, labels=labels, chunk_size=4, validate=validate), lambda a, t: nt_xent_pml(a, labels, t)),
        (lambda a, t: tc.nt_bxent_loss(a, labels=labels, temperature=t, chunk_size=4, validate=validate),
         lambda a, t: nt_bxent(a, t, labels=labels)),
    ):
        compare(ours_fn, ref_fn, [x], 0.2, torch.float64, (1e-9, 1e-9))


def test_label_sorted_path_skips_the_mask_in_negative_tiles(monkeypatch):
    import torch_contrastive.engine.pair_kernels as pair_kernels

    calls = {"negatives": 0}
    for kernel in (pair_kernels.PairKernel, pair_kernels._BinaryKernel):
        for method in ("visit_negatives", "visit_negatives_both"):  # tiled / symmetric (upper-triangle) path
            original = getattr(kernel, method)

            def counting(self, *args, _original=original):
                calls["negatives"] += 1
                return _original(self, *args)

            monkeypatch.setattr(kernel, method, counting)
    x = torch.randn(40, 4, dtype=torch.float64)
    labels = torch.arange(40) % 10
    tc.nt_xent_loss(x, 0.2, labels=labels, chunk_size=4, validate=False)
    tc.nt_bxent_loss(x, labels=labels, temperature=0.2, chunk_size=4, validate=False)
    assert calls["negatives"] == 0  # no plan without the validation read: every tile masked
    tc.nt_xent_loss(x, 0.2, labels=labels, chunk_size=4)
    tc.nt_bxent_loss(x, labels=labels, temperature=0.2, chunk_size=4)
    # 10 x 10 tiles of 4 rows, one class each: 90 all-negative tiles, 45 of them above the diagonal
    # (the symmetric path visits those once for both blocks)
    assert calls["negatives"] >= 90


def test_label_sorted_path_keeps_reduction_none_order():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(30, 4, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 5, (30,), generator=g)
    for fn in (lambda c, v: tc.nt_xent_loss(x, 0.3, labels=labels, reduction="none", chunk_size=c, validate=v),
               lambda c, v: tc.nt_bxent_loss(x, labels=labels, temperature=0.3, reduction="none", chunk_size=c, validate=v)):
        torch.testing.assert_close(fn(4, True), fn(None, False), rtol=1e-12, atol=1e-12)
