"""matryoshka_info_nce_loss: every prefix's InfoNCE from one pass, against the float64 loop over prefixes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_contrastive as tc
from device import DEVICE
from helpers import DTYPES


def per_prefix_reference(q, k, neg, dims, weights, tau, symmetric=False):
    """The definition: each prefix cut, normalised on its own, InfoNCE over the keys and negatives."""
    total = 0.0
    for d, w in zip(dims, weights):
        qd, kd = F.normalize(q[:, :d], dim=1), F.normalize(k[:, :d], dim=1)
        cand = kd if neg is None else torch.cat([kd, F.normalize(neg[:, :d], dim=1)])
        loss = F.cross_entropy(qd @ cand.T / tau, torch.arange(q.shape[0]))
        if symmetric:
            loss = 0.5 * (loss + F.cross_entropy(kd @ qd.T / tau, torch.arange(q.shape[0])))
        total = total + w * loss
    return total


@pytest.mark.parametrize("dtype,tols", DTYPES)
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("negatives", [0, 5])
def test_every_prefix_equals_the_float64_loop(dtype, tols, symmetric, chunk, negatives):
    """Odd sizes, a repeated prefix (counted twice), weights, hard negatives, strips: value and gradients."""
    rtol, grad_tol = tols
    g = torch.Generator().manual_seed(negatives + 7 * symmetric)
    q, k = torch.randn(11, 13, generator=g, dtype=torch.float64), torch.randn(11, 13, generator=g, dtype=torch.float64)
    neg = torch.randn(negatives, 13, generator=g, dtype=torch.float64) if negatives else None
    dims, weights = [13, 8, 3, 8, 1], [1.0, 0.5, 2.0, 1.0, 0.25]
    rounded = [t.to(dtype).double().requires_grad_() for t in (q, k, *([neg] if neg is not None else []))]
    want = per_prefix_reference(rounded[0], rounded[1], rounded[2] if neg is not None else None, dims, weights, 0.1, symmetric)
    want_grads = torch.autograd.grad(want, rounded)
    ours_in = [t.detach().to(DEVICE, dtype).requires_grad_() for t in rounded]
    got = tc.matryoshka_info_nce_loss(ours_in[0], ours_in[1], dims, weights, 0.1, negatives=ours_in[2] if neg is not None else None,
                                      symmetric=symmetric, chunk_size=chunk)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=max(rtol, 1e-6 if dtype != torch.float64 else rtol))
    for a, b in zip(torch.autograd.grad(got, ours_in), want_grads):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double().cpu(), b, rtol=grad_tol, atol=grad_tol * max(1.0, float(b.abs().max())))


def test_gradcheck_through_bands_strips_and_norms():
    """float64 gradcheck through the bands, the strips and each prefix's own norms."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: tc.matryoshka_info_nce_loss(a, b, [5, 2, 3], [1, 0.3, 2], 0.5, chunk_size=4),
                                    (q, k))


def test_a_row_whose_prefix_is_zero_sits_on_the_floor_as_in_f_normalize():
    """A prefix of zeros is divided by eps, not by its norm (a constant there), as F.normalize does."""
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randn(6, 5, generator=g, dtype=torch.float64)
    q[2, :2] = 0.0
    q.requires_grad_()
    k.requires_grad_()
    got = torch.autograd.grad(tc.matryoshka_info_nce_loss(q, k, [5, 2], [1.0, 0.5], 0.5), (q, k))
    want = torch.autograd.grad(per_prefix_reference(q, k, None, [5, 2], [1.0, 0.5], 0.5), (q, k))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_one_prefix_is_info_nce():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(9, 6, generator=g, dtype=torch.float64), torch.randn(9, 6, generator=g, dtype=torch.float64)
    neg = torch.randn(4, 6, generator=g, dtype=torch.float64)
    got = tc.matryoshka_info_nce_loss(q, k, [6], None, 0.2, negatives=neg)
    assert float(got) == pytest.approx(float(tc.info_nce_loss(q, k, neg, 0.2)), rel=1e-12)


@pytest.mark.parametrize(("kwargs", "exc", "words"), [
    ({"matryoshka_dims": []}, ValueError, "matryoshka_dims"),
    ({"matryoshka_dims": [4, 9]}, ValueError, "cannot exceed the embedding size 8"),
    ({"matryoshka_dims": [4, 2.5]}, ValueError, "positive ints"),
    ({"matryoshka_weights": [1.0]}, ValueError, "one number per dim"),
    ({"temperature": 0.0}, ValueError, "temperature"),
    ({"symmetric": "yes"}, TypeError, "symmetric"),
    ({"negatives": torch.randn(3, 5)}, ValueError, "negatives must have feature size 8"),
    ({"chunk_size": 0}, ValueError, "chunk_size"),
    ({"key": torch.randn(5, 8)}, ValueError, "batch size"),
])
def test_bad_input_is_refused_by_name(kwargs, exc, words):
    args = {"query": torch.randn(6, 8), "key": torch.randn(6, 8), "matryoshka_dims": [8, 4], **kwargs}
    with pytest.raises(exc, match=words):
        tc.matryoshka_info_nce_loss(**args)


def test_a_non_finite_input_is_named():
    q = torch.randn(6, 8)
    q[3, 1] = float("nan")
    with pytest.raises(ValueError, match="query has non-finite"):
        tc.matryoshka_info_nce_loss(q, torch.randn(6, 8), [8, 4])
    assert torch.isnan(tc.matryoshka_info_nce_loss(q, torch.randn(6, 8), [8, 4], validate=False))


def test_the_per_prefix_wrapper_equals_the_loop_and_clip_equals_the_one_pass_form():
    """matryoshka_loss around CLIP, SupCon (views in a middle dimension) and NT-Xent equals the loop over
    prefixes; around CLIP it equals the one-pass symmetric form."""
    g = torch.Generator().manual_seed(3)
    img, txt = torch.randn(10, 12, generator=g, dtype=torch.float64), torch.randn(10, 12, generator=g, dtype=torch.float64)
    views = torch.randn(5, 2, 12, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 1, 0, 2, 1])
    dims, weights = [12, 6, 3], [1.0, 0.5, 2.0]
    clip = tc.matryoshka_loss(tc.clip_loss, [img, txt], dims, weights, temperature=0.1)
    one_pass = tc.matryoshka_info_nce_loss(img, txt, dims, weights, 0.1, symmetric=True)
    assert float(clip) == pytest.approx(float(one_pass), rel=1e-12)
    loop = sum(w * tc.supcon_loss(F.normalize(views[..., :d], dim=-1), labels, temperature=0.2) for d, w in zip(dims, weights))
    assert float(tc.matryoshka_loss(tc.supcon_loss, [views], dims, weights, labels=labels, temperature=0.2)) == pytest.approx(
        float(loop), rel=1e-12)
    loop = sum(w * tc.nt_xent_loss(F.normalize(img[:, :d], dim=-1), 0.3) for d, w in zip(dims, weights))
    assert float(tc.matryoshka_loss(tc.nt_xent_loss, [img], dims, weights, temperature=0.3)) == pytest.approx(float(loop), rel=1e-12)
    with pytest.raises(TypeError, match="embeddings"):
        tc.matryoshka_loss(tc.nt_xent_loss, img, dims)
    with pytest.raises(ValueError, match="share their last dimension"):
        tc.matryoshka_loss(tc.clip_loss, [img, txt[:, :8]], [8])
    with pytest.raises(TypeError, match="loss_fn"):
        tc.matryoshka_loss("clip", [img], [8])


def _rows(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


ONE_PASS = {
    # InfoNCE's false negatives (ids, a guide at its full width, MoCo's in_batch_negatives=False, DCL) and smoothing
    "info_nce_ids": (tc.info_nce_loss, lambda g: [torch.randn(n, 12, generator=g, dtype=torch.float64) for n in (8, 8, 5)],
                     {"key_ids": torch.tensor([0, 1, 0, 2, 3, 1, 4, 5]), "negative_ids": torch.tensor([2, 9, 0, 7, 1]),
                      "temperature": 0.2, "chunk_size": 3}),
    "info_nce_guide": (tc.info_nce_loss, lambda g: [torch.randn(n, 12, generator=g, dtype=torch.float64) for n in (8, 8, 5)],
                       {"guide": (_rows(8, 6, seed=1), _rows(8, 6, seed=1) + 0.4 * _rows(8, 6, seed=2), _rows(5, 6, seed=3)),
                        "guide_margin": 0.05, "guide_margin_mode": "relative", "reduction": "none"}),
    "info_nce_moco": (tc.info_nce_loss, lambda g: [torch.randn(n, 12, generator=g, dtype=torch.float64) for n in (8, 8, 6)],
                      {"in_batch_negatives": False, "temperature": 0.1, "reduction": "sum"}),
    "info_nce_moco_dcl": (tc.info_nce_loss, lambda g: [torch.randn(n, 12, generator=g, dtype=torch.float64) for n in (8, 8, 6)],
                          {"in_batch_negatives": False, "decoupled": True}),
    "info_nce_ids_dcl": (tc.info_nce_loss, lambda g: [torch.randn(n, 12, generator=g, dtype=torch.float64) for n in (8, 8)],
                         {"key_ids": torch.tensor([0, 1, 0, 2, 3, 1, 4, 5]), "decoupled": True, "temperature": 0.3}),
    "info_nce_smoothing": (tc.info_nce_loss, lambda g: [torch.randn(n, 12, generator=g, dtype=torch.float64) for n in (8, 8)],
                           {"label_smoothing": 0.1, "temperature": 0.2}),
    # SupCon's value rules: the authors' tau / tau_base scale, and single_class="zero" (0 for a batch of one class)
    "supcon_base_temperature": (tc.supcon_loss, lambda g: [torch.randn(5, 2, 12, generator=g, dtype=torch.float64)],
                                {"labels": torch.tensor([0, 1, 0, 2, 1]), "temperature": 0.1, "base_temperature": 0.07}),
    "supcon_single_class_zero": (tc.supcon_loss, lambda g: [torch.randn(6, 12, generator=g, dtype=torch.float64)],
                                 {"labels": torch.tensor([0, 1, 0, 2, 1, 1]), "single_class": "zero", "reduction": "none"}),
    "supcon_one_class_zero": (tc.supcon_loss, lambda g: [torch.randn(6, 12, generator=g, dtype=torch.float64)],
                              {"labels": torch.full((6,), 3), "single_class": "zero", "base_temperature": 0.2}),
    "clip": (tc.clip_loss, lambda g: [torch.randn(9, 12, generator=g, dtype=torch.float64) for _ in range(2)], {"temperature": 0.1}),
    "info_nce_negatives": (tc.info_nce_loss, lambda g: [torch.randn(n, 12, generator=g, dtype=torch.float64) for n in (9, 9, 4)], {}),
    "nt_xent_adjacent": (tc.nt_xent_loss, lambda g: [torch.randn(10, 12, generator=g, dtype=torch.float64)], {"temperature": 0.3}),
    "nt_xent_halves": (tc.nt_xent_loss, lambda g: [torch.randn(10, 12, generator=g, dtype=torch.float64)], {"pairing": "halves"}),
    "supcon_labels": (tc.supcon_loss, lambda g: [torch.randn(11, 12, generator=g, dtype=torch.float64)],
                      {"labels": torch.tensor([0, 1, 0, 2, 1, 3, 0, 2, 2, 4, 1]), "temperature": 0.2}),  # class 3 and 4: no positive
    "supcon_views": (tc.supcon_loss, lambda g: [torch.randn(5, 3, 12, generator=g, dtype=torch.float64)], {}),
    "supcon_views_labels": (tc.supcon_loss, lambda g: [torch.randn(5, 2, 12, generator=g, dtype=torch.float64)],
                            {"labels": torch.tensor([0, 1, 0, 2, 1])}),
    # the options the one pass honours: sums, strips, a floor, validate off, normalize (a no-op on unit prefixes)
    "supcon_sum_strips": (tc.supcon_loss, lambda g: [torch.randn(11, 12, generator=g, dtype=torch.float64)],
                          {"labels": torch.tensor([0, 1, 0, 2, 1, 3, 0, 2, 2, 4, 1]), "reduction": "sum", "chunk_size": 4}),
    "nt_xent_options": (tc.nt_xent_loss, lambda g: [torch.randn(10, 12, generator=g, dtype=torch.float64)],
                        {"reduction": "sum", "chunk_size": 3, "eps": 1e-8, "normalize": False, "validate": False, "backend": "torch"}),
    "info_nce_sum": (tc.info_nce_loss, lambda g: [torch.randn(n, 12, generator=g, dtype=torch.float64) for n in (9, 9, 4)],
                     {"reduction": "sum"}),
    # DCL: the positive leaves the soft-max (one pair alone in its batch: no candidate left, 0)
    "nt_xent_decoupled": (tc.nt_xent_loss, lambda g: [torch.randn(10, 12, generator=g, dtype=torch.float64)],
                          {"decoupled": True, "pairing": "halves", "temperature": 0.2}),
    "nt_xent_decoupled_alone": (tc.nt_xent_loss, lambda g: [torch.randn(2, 12, generator=g, dtype=torch.float64)],
                                {"decoupled": True}),
    "clip_decoupled": (tc.clip_loss, lambda g: [torch.randn(9, 12, generator=g, dtype=torch.float64) for _ in range(2)],
                       {"decoupled": True, "temperature": 0.1}),
    # CLIP's duplicates by ids, normalised by the positive pairs; one id tensor, both, and "sum" (N times the mean)
    "clip_ids": (tc.clip_loss, lambda g: [torch.randn(9, 12, generator=g, dtype=torch.float64) for _ in range(2)],
                 {"image_id": torch.tensor([0, 1, 0, 2, 3, 3, 4, 5, 0]), "text_id": torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 1])}),
    "clip_image_ids_sum": (tc.clip_loss, lambda g: [torch.randn(9, 12, generator=g, dtype=torch.float64) for _ in range(2)],
                           {"image_id": torch.tensor([0, 1, 0, 2, 3, 3, 4, 5, 0]), "reduction": "sum", "chunk_size": 2}),
    # the label conventions scored pair by pair: PML's NT-Xent (a class alone: no pair; one class: no negative) and NT-BXent
    "nt_xent_pml": (tc.nt_xent_loss, lambda g: [torch.randn(11, 12, generator=g, dtype=torch.float64)],
                    {"labels": torch.tensor([0, 1, 0, 2, 1, 3, 0, 2, 2, 4, 1]), "temperature": 0.2}),
    "nt_xent_pml_sum_strips": (tc.nt_xent_loss, lambda g: [torch.randn(11, 12, generator=g, dtype=torch.float64)],
                               {"labels": torch.tensor([0, 1, 0, 2, 1, 3, 0, 2, 2, 4, 1]), "reduction": "sum", "chunk_size": 4}),
    "nt_xent_pml_one_class": (tc.nt_xent_loss, lambda g: [torch.randn(6, 12, generator=g, dtype=torch.float64)],
                              {"labels": torch.tensor([1, 1, 1, 0, 1, 1])}),
    "nt_bxent": (tc.nt_bxent_loss, lambda g: [torch.randn(11, 12, generator=g, dtype=torch.float64)],
                 {"labels": torch.tensor([0, 1, 0, 2, 1, 3, 0, 2, 2, 4, 1]), "temperature": 0.3}),
    "nt_bxent_sum_strips": (tc.nt_bxent_loss, lambda g: [torch.randn(7, 12, generator=g, dtype=torch.float64)],
                            {"labels": torch.tensor([2, 2, 2, 2, 2, 2, 2]), "reduction": "sum", "chunk_size": 3}),
    # beyond the column pass's fixed shift (1 / tau > 340 in fp64): the two directions as two passes
    "clip_ids_cold": (tc.clip_loss, lambda g: [torch.randn(9, 12, generator=g, dtype=torch.float64) for _ in range(2)],
                      {"image_id": torch.tensor([0, 1, 0, 2, 3, 3, 4, 5, 0]), "temperature": 0.002}),
    "clip_decoupled_one_row": (tc.clip_loss, lambda g: [torch.randn(1, 12, generator=g, dtype=torch.float64) for _ in range(2)],
                               {"decoupled": True}),
    # DCL with ids: every duplicate leaves both soft-maxes (an image whose every text is a positive: 0)
    "clip_ids_decoupled": (tc.clip_loss, lambda g: [torch.randn(9, 12, generator=g, dtype=torch.float64) for _ in range(2)],
                           {"image_id": torch.tensor([0, 1, 0, 2, 3, 3, 4, 5, 0]), "text_id": torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 1]),
                            "decoupled": True, "chunk_size": 4}),
    "clip_ids_decoupled_one_class": (tc.clip_loss, lambda g: [torch.randn(4, 12, generator=g, dtype=torch.float64) for _ in range(2)],
                                     {"image_id": torch.tensor([2, 2, 2, 2]), "decoupled": True}),
    # reduction="none": each row's value, summed over the prefixes (CLIP: both directions' mean, by pairs N / sum gt)
    "nt_xent_none": (tc.nt_xent_loss, lambda g: [torch.randn(10, 12, generator=g, dtype=torch.float64)],
                     {"reduction": "none", "decoupled": True, "chunk_size": 3}),
    "supcon_none": (tc.supcon_loss, lambda g: [torch.randn(11, 12, generator=g, dtype=torch.float64)],
                    {"labels": torch.tensor([0, 1, 0, 2, 1, 3, 0, 2, 2, 4, 1]), "reduction": "none"}),
    "info_nce_none": (tc.info_nce_loss, lambda g: [torch.randn(n, 12, generator=g, dtype=torch.float64) for n in (9, 9, 4)],
                      {"reduction": "none"}),
    "clip_none": (tc.clip_loss, lambda g: [torch.randn(9, 12, generator=g, dtype=torch.float64) for _ in range(2)],
                  {"reduction": "none", "chunk_size": 4}),
    "clip_ids_none": (tc.clip_loss, lambda g: [torch.randn(9, 12, generator=g, dtype=torch.float64) for _ in range(2)],
                      {"image_id": torch.tensor([0, 1, 0, 2, 3, 3, 4, 5, 0]), "reduction": "none", "decoupled": True}),
    "clip_ids_none_cold": (tc.clip_loss, lambda g: [torch.randn(9, 12, generator=g, dtype=torch.float64) for _ in range(2)],
                           {"text_id": torch.tensor([0, 1, 0, 2, 3, 3, 4, 5, 0]), "reduction": "none", "temperature": 0.002}),
    "nt_xent_pml_none": (tc.nt_xent_loss, lambda g: [torch.randn(11, 12, generator=g, dtype=torch.float64)],
                         {"labels": torch.tensor([0, 1, 0, 2, 1, 3, 0, 2, 2, 4, 1]), "reduction": "none", "chunk_size": 4}),
    "nt_bxent_none": (tc.nt_bxent_loss, lambda g: [torch.randn(11, 12, generator=g, dtype=torch.float64)],
                      {"labels": torch.tensor([0, 1, 0, 2, 1, 3, 0, 2, 2, 4, 1]), "reduction": "none"}),
    # CLIP's label smoothing: without ids F.cross_entropy's; with ids the smoothed weights over the positive pairs
    "clip_smoothing": (tc.clip_loss, lambda g: [torch.randn(9, 12, generator=g, dtype=torch.float64) for _ in range(2)],
                       {"label_smoothing": 0.1, "chunk_size": 4}),
    "clip_ids_smoothing_none": (tc.clip_loss, lambda g: [torch.randn(9, 12, generator=g, dtype=torch.float64) for _ in range(2)],
                                {"image_id": torch.tensor([0, 1, 0, 2, 3, 3, 4, 5, 0]), "label_smoothing": 0.2, "reduction": "none"}),
    "clip_ids_smoothing_cold": (tc.clip_loss, lambda g: [torch.randn(9, 12, generator=g, dtype=torch.float64) for _ in range(2)],
                                {"text_id": torch.tensor([0, 1, 0, 2, 3, 3, 4, 5, 0]), "label_smoothing": 0.3, "temperature": 0.002}),
    "clip_sum": (tc.clip_loss, lambda g: [torch.randn(9, 12, generator=g, dtype=torch.float64) for _ in range(2)],
                 {"reduction": "sum", "label_smoothing": 0.0}),
    # SupCon with the authors' mask over samples (asymmetric; sample 3 marks only itself: its views still pair)
    "supcon_mask_views": (tc.supcon_loss, lambda g: [torch.randn(5, 3, 12, generator=g, dtype=torch.float64)],
                          {"mask": torch.tensor([[1, 1, 0, 0, 0], [0, 1, 0, 0, 1], [1, 0, 1, 0, 0], [0, 0, 0, 1, 0],
                                                 [0, 0, 1, 1, 1]], dtype=torch.bool), "temperature": 0.2}),
    "supcon_mask_float_sum": (tc.supcon_loss, lambda g: [torch.randn(7, 12, generator=g, dtype=torch.float64)],
                              {"mask": (torch.arange(7)[:, None] % 3 == torch.arange(7)[None, :] % 2).double(),
                               "reduction": "sum", "chunk_size": 3}),
    # NT-BXent by listed pairs: directional, one listed twice, one on the diagonal, a row with none
    "nt_bxent_pairs": (tc.nt_bxent_loss, lambda g: [torch.randn(7, 12, generator=g, dtype=torch.float64)],
                       {"pos_indices": torch.tensor([[0, 1], [1, 0], [2, 5], [2, 5], [3, 3], [4, 0], [4, 6], [6, 2]]),
                        "temperature": 0.3}),
    "nt_bxent_pairs_sum_strips": (tc.nt_bxent_loss, lambda g: [torch.randn(7, 12, generator=g, dtype=torch.float64)],
                                  {"pos_indices": torch.tensor([[0, 1], [2, 5], [5, 2], [4, 6], [6, 4], [1, 0]]),
                                   "reduction": "sum", "chunk_size": 3}),
    "nt_bxent_pairs_none": (tc.nt_bxent_loss, lambda g: [torch.randn(7, 12, generator=g, dtype=torch.float64)],
                            {"pos_indices": torch.tensor([[0, 1], [2, 5], [6, 4]]), "reduction": "none", "chunk_size": 2}),
    # SupCon with a memory (extra candidates after the batch, positives by label; an empty queue too) or a
    # reference set (the only candidates, no self pair): their rows cut to each prefix like the embeddings
    "supcon_memory": (tc.supcon_loss, lambda g: [torch.randn(8, 12, generator=g, dtype=torch.float64)],
                      {"labels": torch.tensor([0, 1, 0, 2, 1, 3, 0, 2]), "memory_emb": torch.randn(5, 12, dtype=torch.float64),
                       "memory_labels": torch.tensor([3, 4, 0, 1, 4]), "chunk_size": 3}),
    "supcon_views_memory": (tc.supcon_loss, lambda g: [torch.randn(4, 2, 12, generator=g, dtype=torch.float64)],
                            {"labels": torch.tensor([0, 1, 0, 2]), "memory_emb": torch.randn(3, 12, dtype=torch.float64),
                             "memory_labels": torch.tensor([2, 5, 1]), "reduction": "sum"}),
    "supcon_empty_memory": (tc.supcon_loss, lambda g: [torch.randn(6, 12, generator=g, dtype=torch.float64)],
                            {"labels": torch.tensor([0, 1, 0, 2, 1, 3]), "memory_emb": torch.zeros(0, 12, dtype=torch.float64),
                             "memory_labels": torch.zeros(0, dtype=torch.int64)}),
    "supcon_reference": (tc.supcon_loss, lambda g: [torch.randn(7, 12, generator=g, dtype=torch.float64)],
                         {"labels": torch.tensor([0, 1, 0, 2, 1, 3, 5]), "ref_emb": torch.randn(6, 12, dtype=torch.float64),
                          "ref_labels": torch.tensor([0, 0, 1, 2, 4, 3]), "reduction": "none"}),
    # PML's NT-Xent with a memory (its rows extra candidates, pairs by label) or a reference set (no self pair)
    "nt_xent_pml_memory": (tc.nt_xent_loss, lambda g: [torch.randn(8, 12, generator=g, dtype=torch.float64)],
                           {"labels": torch.tensor([0, 1, 0, 2, 1, 3, 0, 2]), "memory_emb": torch.randn(5, 12, dtype=torch.float64),
                            "memory_labels": torch.tensor([3, 4, 0, 1, 4]), "chunk_size": 3, "temperature": 0.2}),
    "nt_xent_pml_memory_none": (tc.nt_xent_loss, lambda g: [torch.randn(6, 12, generator=g, dtype=torch.float64)],
                                {"labels": torch.tensor([0, 1, 0, 2, 1, 3]), "memory_emb": torch.randn(4, 12, dtype=torch.float64),
                                 "memory_labels": torch.tensor([3, 5, 0, 2]), "reduction": "none"}),
    "nt_xent_pml_reference": (tc.nt_xent_loss, lambda g: [torch.randn(7, 12, generator=g, dtype=torch.float64)],
                              {"labels": torch.tensor([0, 1, 0, 2, 1, 3, 5]), "ref_emb": torch.randn(6, 12, dtype=torch.float64),
                               "ref_labels": torch.tensor([0, 0, 1, 2, 4, 3]), "reduction": "sum"}),
    "supcon_mask_none": (tc.supcon_loss, lambda g: [torch.randn(4, 2, 12, generator=g, dtype=torch.float64)],
                         {"mask": torch.eye(4, dtype=torch.bool).roll(1, 1), "reduction": "none"}),
    # SupCon's contrast_mode="one": the first view's rows as anchors against every view (labels, or views only)
    "supcon_one_labels": (tc.supcon_loss, lambda g: [torch.randn(5, 3, 12, generator=g, dtype=torch.float64)],
                          {"labels": torch.tensor([0, 1, 0, 2, 1]), "contrast_mode": "one", "chunk_size": 2}),
    "supcon_one_views_none": (tc.supcon_loss, lambda g: [torch.randn(4, 2, 12, generator=g, dtype=torch.float64)],
                              {"contrast_mode": "one", "reduction": "none", "temperature": 0.2}),
    # the authors' mask with contrast_mode="one" (asymmetric; sample 3 marks only itself)
    "supcon_one_mask": (tc.supcon_loss, lambda g: [torch.randn(5, 3, 12, generator=g, dtype=torch.float64)],
                        {"mask": torch.tensor([[1, 1, 0, 0, 0], [0, 1, 0, 0, 1], [1, 0, 1, 0, 0], [0, 0, 0, 1, 0],
                                               [0, 1, 0, 1, 1]]), "contrast_mode": "one", "chunk_size": 2}),
    "supcon_one_mask_none": (tc.supcon_loss, lambda g: [torch.randn(4, 2, 12, generator=g, dtype=torch.float64)],
                             {"mask": torch.eye(4, dtype=torch.bool).roll(1, 1), "contrast_mode": "one", "reduction": "none"}),
}


@pytest.mark.parametrize("name", list(ONE_PASS))
def test_the_one_pass_forms_equal_one_call_per_prefix(name):
    """Each loss the prefix engine covers: the one pass equals the wrapper's own per-prefix calls of the
    library's loss (value and gradients, float64), and it is the one pass that ran."""
    from torch_contrastive.losses.matryoshka import _one_pass

    fn, make, kwargs = ONE_PASS[name]
    inputs = [t.to(DEVICE).requires_grad_() for t in make(torch.Generator().manual_seed(len(name)))]
    kwargs = {k: (a.to(DEVICE) if isinstance(a, torch.Tensor) else tuple(t.to(DEVICE) for t in a) if isinstance(a, tuple) else a)
              for k, a in kwargs.items()}
    dims, weights = [12, 7, 3, 7], [1.0, 0.5, 2.0, 0.25]
    assert _one_pass(fn, inputs, kwargs) is not None
    got = tc.matryoshka_loss(fn, inputs, dims, weights, **kwargs)
    want = tc.matryoshka_loss(fn, inputs, dims, weights, one_pass=False, **kwargs)
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-11, atol=1e-13)
    for a, b in zip(torch.autograd.grad(_uneven(got), inputs), torch.autograd.grad(_uneven(want), inputs)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def _uneven(out):
    """A loss, or per-row values weighted unevenly (each row's own gradient is then checked, not only their sum)."""
    return out if out.ndim == 0 else (out * torch.linspace(0.5, 2.0, out.numel(), dtype=out.dtype, device=out.device)).sum()


def test_pos_indices_out_of_range_are_refused_in_the_one_pass():
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"pos_indices must lie in \[0, 4\)"):
        tc.matryoshka_loss(tc.nt_bxent_loss, [x], [6, 3], pos_indices=torch.tensor([[0, 1], [2, 4]]))


def test_a_memory_that_requires_grad_gets_its_gradient_in_one_pass_and_other_losses_cut_it_per_prefix():
    """A memory is cut to each prefix like the embeddings: in one pass (SupCon, PML's NT-Xent) its gradient equals
    one call per prefix's, and one call per prefix (``one_pass=False``) runs at every prefix size."""
    from torch_contrastive.losses.matryoshka import _one_pass

    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 12, generator=g, dtype=torch.float64, device=DEVICE).requires_grad_()
    memory = torch.randn(5, 12, generator=g, dtype=torch.float64, device=DEVICE).requires_grad_()
    labels, memory_labels = torch.tensor([0, 1, 0, 2, 1, 3, 0, 2], device=DEVICE), torch.tensor([3, 4, 0, 1, 4], device=DEVICE)
    args = {"labels": labels, "memory_emb": memory, "memory_labels": memory_labels, "temperature": 0.2}
    for fn in (tc.supcon_loss, tc.nt_xent_loss):
        assert _one_pass(fn, [x], args) is not None
        got = tc.matryoshka_loss(fn, [x], [12, 5], [1.0, 0.5], **args)
        per_prefix = tc.matryoshka_loss(fn, [x], [12, 5], [1.0, 0.5], one_pass=False, **args)
        torch.testing.assert_close(got, per_prefix, rtol=1e-11, atol=1e-13)
        want = sum(w * fn(F.normalize(x[:, :d], dim=1), labels=labels, memory_emb=F.normalize(memory[:, :d], dim=1),
                          memory_labels=memory_labels, temperature=0.2) for d, w in ((12, 1.0), (5, 0.5)))
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-13)
        for a, b in zip(torch.autograd.grad(got, [x, memory]), torch.autograd.grad(want, [x, memory])):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_a_supcon_mask_of_other_values_is_refused_in_the_one_pass():
    x = torch.randn(4, 2, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="mask must contain only 0 and 1"):
        tc.matryoshka_loss(tc.supcon_loss, [x], [6, 3], mask=torch.full((4, 4), 0.5))


def test_validate_false_keeps_the_one_pass_and_reads_nothing_on_the_host():
    """validate=False: the one pass still runs (it is not a reason to fall back) and a NaN input gives a
    NaN loss instead of a host read and an error; validate=True names the input."""
    from torch_contrastive.losses.matryoshka import _one_pass

    x = torch.randn(8, 6, dtype=torch.float64, device=DEVICE)
    x[3, 2] = float("nan")
    assert _one_pass(tc.nt_xent_loss, [x], {"validate": False, "temperature": 0.2}) is not None
    assert torch.isnan(tc.matryoshka_loss(tc.nt_xent_loss, [x], [6, 3], temperature=0.2, validate=False))
    with pytest.raises(ValueError, match=r"embeddings\[0\] has non-finite"):
        tc.matryoshka_loss(tc.nt_xent_loss, [x], [6, 3], temperature=0.2)


def test_calls_the_one_pass_does_not_cover_go_per_prefix():
    from torch_contrastive.losses.matryoshka import _one_pass

    x = torch.randn(8, 6, dtype=torch.float64)
    labels = torch.tensor([0, 1, 0, 1, 2, 2, 3, 3])
    for fn, tensors, kwargs in ((tc.nt_xent_loss, [x], {"positive_weight": torch.ones(8, dtype=torch.float64), "labels": labels}),
                                (tc.supcon_loss, [x], {"labels": labels, "single_class": "drop"}),
                                (tc.info_nce_loss, [x, x, x.view(8, 1, 6)], {"negative_mode": "paired", "label_smoothing": 0.1,
                                                                            "key_ids": labels}),
                                (tc.info_nce_loss, [x, x, x], {"label_smoothing": 0.1}),
                                (tc.info_nce_loss, [x, x, x], {"gather_negatives": "yes"}),
                                (tc.nt_bxent_loss, [x, torch.tensor([[0, 1], [1, 0]])], {}),
                                (tc.siglip_loss, [x, x], {}), (tc.siglip_loss, [x, x], {"logit_scale": 2.0, "logit_bias": 0.0,
                                                                                        "reduction": "none"}),
                                (tc.supcon_loss, [x], {}),
                                (tc.supcon_loss, [x.view(4, 2, 6)], {"mask": torch.eye(4, dtype=torch.bool), "contrast_mode": "one",
                                                                     "memory_emb": x, "memory_labels": labels}),
                                (tc.nt_xent_loss, [x], {"backend": "triton"}),
                                (tc.clip_loss, [x, x], {"label_smoothing": 0.1, "decoupled": True}),
                                (tc.nt_xent_loss, [x], {"eps": 2.0})):
        assert _one_pass(fn, tensors, kwargs) is None, (fn.__name__, kwargs)
    got = tc.matryoshka_loss(tc.supcon_loss, [x], [6, 3], labels=labels, temperature=0.2, one_pass=False)  # per prefix
    want = sum(tc.supcon_loss(F.normalize(x[:, :d], dim=-1), labels, temperature=0.2) for d in (6, 3))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


SIGLIP_IDS = {"none": {}, "image": {"image_id": torch.tensor([0, 1, 0, 2, 3, 3, 4, 5, 0])},
              "both": {"image_id": torch.tensor([0, 1, 0, 2, 3, 3, 4, 5, 0]), "text_id": torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 1])},
              "text": {"text_id": torch.tensor([7, 7, 7, 1, 2, 3, 4, 5, 6])}}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("learnable", [False, True])
def test_siglip_negative_only_in_one_pass_equals_one_call_per_prefix(learnable, reduction):
    """``negative_only=True`` (open_clip's exchanged blocks: every pair a negative) keeps the one pass."""
    from torch_contrastive.losses.matryoshka import _one_pass

    g = torch.Generator().manual_seed(23)
    x, y = (torch.randn(9, 8, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_() for _ in range(2))
    scale = torch.tensor(3.0, dtype=torch.float64, device=DEVICE, requires_grad=True) if learnable else 3.0
    bias = torch.tensor(-1.0, dtype=torch.float64, device=DEVICE, requires_grad=True) if learnable else -1.0
    kwargs = {"logit_scale": scale, "logit_bias": bias, "negative_only": True, "reduction": reduction}
    assert _one_pass(tc.siglip_loss, [x, y], kwargs) is not None
    got = tc.matryoshka_loss(tc.siglip_loss, [x, y], [8, 5, 2], [1.0, 0.5, 2.0], **kwargs)
    want = tc.matryoshka_loss(tc.siglip_loss, [x, y], [8, 5, 2], [1.0, 0.5, 2.0], one_pass=False, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    inputs = [x, y] + ([scale, bias] if learnable else [])
    for mine, ref in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(want, inputs)):
        torch.testing.assert_close(mine, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("ids", list(SIGLIP_IDS))
@pytest.mark.parametrize("learnable", [False, True])
def test_siglip_in_one_pass_equals_one_call_per_prefix(learnable, ids):
    """The sigmoid pairs over every prefix, the diagonal or the pairs whose ids match as positives: value and
    the gradients of both inputs, and of a learnable logit scale and bias, equal to one siglip_loss call per
    prefix (float64)."""
    from torch_contrastive.losses.matryoshka import _one_pass

    g = torch.Generator().manual_seed(5)
    img, txt = (torch.randn(9, 12, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_() for _ in range(2))
    t = torch.tensor(4.0, dtype=torch.float64, device=DEVICE, requires_grad=learnable)
    b = torch.tensor(-2.0, dtype=torch.float64, device=DEVICE, requires_grad=learnable)
    scale, bias = (t, b) if learnable else (4.0, -2.0)
    dims, weights = [12, 7, 3, 7], [1.0, 0.5, 2.0, 0.25]
    given = {name: i.to(DEVICE) for name, i in SIGLIP_IDS[ids].items()}
    assert _one_pass(tc.siglip_loss, [img, txt], {"logit_scale": scale, "logit_bias": bias, **given}) is not None
    leaves = [img, txt, *([t, b] if learnable else [])]
    got = tc.matryoshka_loss(tc.siglip_loss, [img, txt], dims, weights, logit_scale=scale, logit_bias=bias, **given)
    want = tc.matryoshka_loss(tc.siglip_loss, [img, txt], dims, weights, one_pass=False, logit_scale=scale, logit_bias=bias, **given)
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-11)
    for x, y in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves)):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-11)
    # negative_only with ids: the loss refuses it (per prefix, where it says why)
    assert _one_pass(tc.siglip_loss, [img, txt], {"logit_scale": scale, "logit_bias": bias, "negative_only": True,
                                                  "image_id": torch.arange(9, device=DEVICE)}) is None
    assert _one_pass(tc.siglip_loss, [img, txt], {"logit_scale": scale, "logit_bias": bias, "reduction": "none"}) is None


def test_siglip_sum_and_the_shared_options_keep_the_one_pass():
    from torch_contrastive.losses.matryoshka import _one_pass

    g = torch.Generator().manual_seed(8)
    img, txt = (torch.randn(9, 12, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_() for _ in range(2))
    args = {"logit_scale": 3.0, "logit_bias": -1.0, "reduction": "sum", "chunk_size": 4, "eps": 1e-8, "validate": False,
            "image_id": torch.tensor([0, 1, 0, 2, 3, 3, 4, 5, 0], device=DEVICE)}
    assert _one_pass(tc.siglip_loss, [img, txt], args) is not None
    got = tc.matryoshka_loss(tc.siglip_loss, [img, txt], [12, 7, 3], **args)
    want = tc.matryoshka_loss(tc.siglip_loss, [img, txt], [12, 7, 3], one_pass=False, **args)
    torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, [img, txt]), torch.autograd.grad(want, [img, txt])):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", ["clip", "clip_ids", "clip_ids_decoupled", "clip_smoothing", "info_nce_negatives", "nt_xent_decoupled",
                                  "supcon_labels", "supcon_base_temperature", "nt_xent_pml", "nt_xent_pml_none", "nt_bxent_sum_strips",
                                  "nt_bxent_pairs"])
def test_a_learnable_temperature_gets_its_gradient_in_one_pass(name):
    """A 0-dim temperature that requires grad (``1 / logit_scale.exp()``) keeps the one pass: the value and the
    gradients of the inputs and of the temperature equal one call per prefix (float64); CLIP's directions
    then run as two passes (the column pass's fixed shift needs the scale on the host). The pair conventions
    (PML's NT-Xent, NT-BXent) too."""
    from torch_contrastive.losses.matryoshka import _one_pass

    fn, make, kwargs = ONE_PASS[name]
    inputs = [t.to(DEVICE).requires_grad_() for t in make(torch.Generator().manual_seed(11))]
    log_scale = torch.tensor(2.3, dtype=torch.float64, device=DEVICE, requires_grad=True)
    args = {**kwargs, "temperature": 1.0 / log_scale.exp()}
    dims, weights = [12, 7, 3, 7], [1.0, 0.5, 2.0, 0.25]
    assert _one_pass(fn, inputs, args) is not None
    got = tc.matryoshka_loss(fn, inputs, dims, weights, **args)
    want = tc.matryoshka_loss(fn, inputs, dims, weights, one_pass=False, **args)
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-11, atol=1e-13)
    for a, b in zip(torch.autograd.grad(_uneven(got), [*inputs, log_scale], retain_graph=True),
                    torch.autograd.grad(_uneven(want), [*inputs, log_scale])):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_a_bad_learnable_temperature_is_named_in_the_one_read():
    x, y = (torch.randn(6, 8, dtype=torch.float64, device=DEVICE) for _ in range(2))
    with pytest.raises(ValueError, match="temperature must be positive and finite"):
        tc.matryoshka_loss(tc.clip_loss, [x, y], [8, 4], temperature=torch.tensor(-0.1, dtype=torch.float64, device=DEVICE))
    loss = tc.matryoshka_loss(tc.clip_loss, [x, y], [8, 4], temperature=torch.tensor(-0.1, dtype=torch.float64, device=DEVICE),
                              validate=False)  # no read: the value as computed
    assert loss.shape == ()


@pytest.mark.parametrize("mode", ["unimodal", "bimodal"])
@pytest.mark.parametrize("temperature_mode,chunk", [("fixed", None), ("fixed", 3), ("global", None), ("individual", None)])
def test_one_global_loss_per_prefix_gets_its_own_prefix_and_state(mode, temperature_mode, chunk):
    """A loss with a state per embedding width (one GlobalContrastiveLoss per prefix): each module sees its
    own normalised prefix, weighted, over two steps (the second reads the states the first wrote); equal
    in value, gradients (a learnable temperature's too) and states to the modules called by hand. A fixed or
    global temperature takes the one pass (every prefix's log-sum-exps from one pass over the bands; a prefix
    listed twice, temperatures differing per module, strips); individual temperatures too (each row its own scale, and
    its soft-max mean from the same pass), their temperatures and moving gradients compared as well."""
    from torch_contrastive.losses import prefix_global

    g = torch.Generator().manual_seed(3)
    a = torch.randn(8, 12, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    b = torch.randn(8, 12, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    dims, weights, taus = [12, 6, 3, 6], [1.0, 0.5, 0.25, 2.0], [0.1, 0.2, 0.05, 0.3]
    start = (lambda tau: 0.2 if mode == "unimodal" else 0.03) if temperature_mode == "individual" else (lambda tau: tau)

    def make():
        return [tc.GlobalContrastiveLoss(20, mode, start(tau), temperature_mode=temperature_mode, chunk_size=chunk,
                                         state_dtype=torch.float64, device=DEVICE) for tau in taus]

    ours = torch.nn.ModuleList(make())  # as a model holds them
    theirs = make()
    for step in range(2):
        index = torch.arange(8, device=DEVICE) + 4 * step
        assert prefix_global._covered(list(ours), [a, b], {"index": index}) is not None  # the one pass, not its fallback
        got = tc.matryoshka_loss(ours, [a, b], dims, weights, index=index)
        inputs = (a, b, *(m.tau for m in ours)) if temperature_mode == "global" else (a, b)
        grads = torch.autograd.grad(got, inputs)
        want = sum(w * m(F.normalize(a[:, :d], dim=-1), F.normalize(b[:, :d], dim=-1), index)
                   for m, d, w in zip(theirs, dims, weights))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        ref_inputs = (a, b, *(m.tau for m in theirs)) if temperature_mode == "global" else (a, b)
        for mine, ref in zip(grads, torch.autograd.grad(want, ref_inputs)):
            torch.testing.assert_close(mine, ref, rtol=1e-10, atol=1e-12)
    for mine, ref in zip(ours, theirs):
        for name in ("log_u", *(("tau_state", "tau_grad") if temperature_mode == "individual" else ())):
            torch.testing.assert_close(getattr(mine, name), getattr(ref, name), rtol=1e-12, atol=1e-12)
    assert not torch.equal(ours[0].log_u, ours[1].log_u)  # each prefix's normalisers are its own


@pytest.mark.parametrize("mode", ["unimodal", "bimodal"])
def test_the_global_one_pass_in_fp32_and_its_checks(mode):
    """fp32 rows at tau 0.02 (logits up to 50) and tau 0.01 with every negative far away: the one pass equals one call
    per prefix within fp32's rounding; a bad index and a non-finite row are still refused by the modules, by name."""
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randn(10, 16, generator=g).to(DEVICE).requires_grad_() for _ in range(2))
    dims, index = [16, 8, 4], torch.arange(10, device=DEVICE)

    def run(one_pass):
        losses = [tc.GlobalContrastiveLoss(12, mode, 0.02, device=DEVICE) for _ in dims]
        loss = tc.matryoshka_loss(losses, [a, b], dims, index=index, one_pass=one_pass)
        return loss, torch.autograd.grad(loss, (a, b)), [m.log_u for m in losses]

    (got, got_grads, got_state), (want, want_grads, want_state) = run(True), run(False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for mine, ref in zip(got_grads, want_grads):
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-5)
    for mine, ref in zip(got_state, want_state):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
    # tau 0.01 with every negative far away (cosines near -1: logits near -100, exp(S - 1 / tau) below fp32's range):
    # the online maximum, not the fixed shift, keeps the log-sum-exps finite and exact
    direction = torch.randn(16, generator=g)
    far = direction + 0.05 * torch.randn(10, 16, generator=g)
    a, b = far.to(DEVICE).requires_grad_(), (-far).to(DEVICE).requires_grad_()
    losses = [tc.GlobalContrastiveLoss(12, mode, 0.01, device=DEVICE) for _ in dims]
    got = tc.matryoshka_loss(losses, [a, b], dims, index=index)
    want = sum(tc.GlobalContrastiveLoss(12, mode, 0.01, device=DEVICE)(F.normalize(a[:, :d], dim=-1), F.normalize(b[:, :d], dim=-1),
                                                                      index) for d in dims)
    assert torch.isfinite(got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    losses = [tc.GlobalContrastiveLoss(12, mode, device=DEVICE) for _ in dims]
    with pytest.raises(ValueError, match=r"index must lie in \[0, 12\)"):
        tc.matryoshka_loss(losses, [a, b], dims, index=index + 5)
    bad = a.detach().clone()
    bad[3, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        tc.matryoshka_loss(losses, [bad, b], dims, index=index)


@pytest.mark.parametrize("mode", ["unimodal", "bimodal"])
def test_the_global_one_pass_with_individual_temperatures_refuses_a_bad_index_by_name(mode):
    """Individual temperatures read each module's state rows before the pass: a bad index is still the module's own
    ValueError / TypeError (not an indexing error), and the states stay untouched."""
    a, b = torch.randn(6, 8, device=DEVICE), torch.randn(6, 8, device=DEVICE)
    start = 0.2 if mode == "unimodal" else 0.03
    losses = [tc.GlobalContrastiveLoss(10, mode, start, temperature_mode="individual", device=DEVICE) for _ in range(2)]
    for index, error, message in ((torch.arange(6) + 7, ValueError, r"index must lie in \[0, 10\)"),
                                  (torch.tensor([0, 0, 1, 2, 3, 4]), ValueError, "index must not repeat"),
                                  (torch.arange(6.0), TypeError, "index must be a 1-D integer tensor")):
        with pytest.raises(error, match=message):
            tc.matryoshka_loss(losses, [a, b], [8, 4], index=index.to(DEVICE))
    assert all(torch.isneginf(m.log_u).all() for m in losses)


def test_the_global_one_pass_makes_d_products_per_pair():
    """The one pass's GEMM FLOPs: ``D`` per pair for every prefix and both directions, forward and backward, against
    ``sum(d_p)`` for one call per prefix (counted, not timed)."""
    from torch_contrastive.cli.traffic import count

    a = torch.randn(16, 32, dtype=torch.float64, requires_grad=True)
    b = torch.randn(16, 32, dtype=torch.float64, requires_grad=True)
    dims, index = [32, 16, 8], torch.arange(16)

    def flops(one_pass):
        losses = [tc.GlobalContrastiveLoss(16, "bimodal", state_dtype=torch.float64) for _ in dims]
        counts = count(lambda: tc.matryoshka_loss(losses, [a, b], dims, index=index, one_pass=one_pass), 16, 16, 32,
                       simulate_device=None)
        return sum(counts.gemm_flops.values())

    one, per_prefix = flops(True), flops(False)
    # forward one product pass over the bands (2 N^2 D); backward recomputes it, then the anchors' and the candidates'
    # gradients: every pass D per pair for all three prefixes
    assert one == 4 * 2 * 16 * 16 * 32
    # one call per prefix: its one tile keeps the forward's logits (three passes), each of sum(d_p) per pair
    assert per_prefix == 3 * 2 * 16 * 16 * sum(dims)


def test_a_global_loss_shared_by_the_prefixes_or_a_wrong_list_is_refused():
    a, b = torch.randn(6, 8, device=DEVICE), torch.randn(6, 8, device=DEVICE)
    index = torch.arange(6, device=DEVICE)
    with pytest.raises(ValueError, match="one GlobalContrastiveLoss per prefix"):
        tc.matryoshka_loss(tc.GlobalContrastiveLoss(10, device=DEVICE), [a, b], [8, 4], index=index)
    state = tc.losses.global_contrastive.GlobalState(torch.full((6, 2), float("-inf"), device=DEVICE))
    with pytest.raises(ValueError, match="one GlobalContrastiveLoss per prefix"):
        tc.matryoshka_loss(tc.global_contrastive_loss, [a, b], [8, 4], state=state)
    with pytest.raises(ValueError, match="2 losses for 3 matryoshka_dims"):
        tc.matryoshka_loss([tc.nt_xent_loss, tc.nt_xent_loss], [a], [8, 4, 2])
    with pytest.raises(TypeError, match=r"loss_fn\[1\] must be callable"):
        tc.matryoshka_loss([tc.nt_xent_loss, 3], [a], [8, 4])
    with pytest.raises(TypeError, match="must return the loss as a tensor, got tuple"):
        tc.matryoshka_loss(lambda x: (x.sum(), x), [a], [8, 4])


def _modules(g):
    """(module, inputs, keyword arguments) of each loss module called in one of its forms, float64."""
    def rows(n, *lead):
        return torch.randn(*lead, n, 12, generator=g, dtype=torch.float64) if lead else torch.randn(n, 12, generator=g, dtype=torch.float64)

    labels = torch.tensor([0, 1, 0, 2, 1, 3, 0, 2])
    return {
        "nt_xent_halves": (tc.NTXentLoss(0.2, pairing="halves"), [rows(8)], {}),
        "nt_xent_decoupled_learnable": (tc.NTXentLoss(0.3, decoupled=True, learnable_temperature=True), [rows(8)], {}),
        "nt_xent_labels": (tc.NTXentLoss(0.25), [rows(8)], {"labels": labels}),
        "nt_bxent_labels": (tc.NTBXentLoss(0.2, reduction="sum"), [rows(8)], {"labels": labels}),
        "supcon_views": (tc.SupConLoss(0.1, learnable_temperature=True), [rows(2, 4)],
                         {"labels": labels[:4]}),
        "supcon_one": (tc.SupConLoss(0.2, contrast_mode="one"), [rows(3, 4)], {}),
        "clip_ids": (tc.ClipLoss(learnable_temperature=True), [rows(8), rows(8)], {"text_id": labels}),
        "clip_smoothing": (tc.ClipLoss(0.1, label_smoothing=0.1, chunk_size=3), [rows(8), rows(8)], {}),
        "info_nce_negatives": (tc.InfoNCELoss(0.1), [rows(6), rows(6), rows(5)], {}),
        "dcl": (tc.DCLLoss(0.2), [rows(6), rows(6)], {}),
        "dclw": (tc.DCLWLoss(0.2, sigma=0.3, reduction="sum"), [rows(6), rows(6)], {}),
        # lightly's weight_fn: the weights read off the outputs, with their own gradient (the outputs' too)
        "dcl_weight_fn": (tc.DCLLoss(0.25, weight_fn=lambda a, b: 1.5 - (a * b).sum(1)), [rows(6), rows(6)], {}),
        "siglip": (tc.SigLipLoss(), [rows(6), rows(6)], {}),
    }


@pytest.mark.parametrize("name", list(_modules(torch.Generator())))
def test_the_loss_modules_run_in_one_pass_like_their_functions(name):
    """A module of ours is run as the one functional call its forward makes (its temperature -- a learnable one
    with its gradient --, its options): in one pass, equal to one module call per prefix (values, the inputs'
    and the module's parameters' gradients, float64)."""
    from torch_contrastive.losses.matryoshka import _as_function, _one_pass

    module, inputs, kwargs = _modules(torch.Generator().manual_seed(len(name)))[name]
    module = module.to(DEVICE, torch.float64)  # a learnable temperature in float64 too
    inputs = [t.to(DEVICE).requires_grad_() for t in inputs]
    kwargs = {k: a.to(DEVICE) for k, a in kwargs.items()}
    assert _one_pass(*_as_function(module, inputs, kwargs)) is not None
    dims, weights = [12, 7, 3], [1.0, 0.5, 2.0]
    got = tc.matryoshka_loss(module, inputs, dims, weights, **kwargs)
    want = tc.matryoshka_loss(module, inputs, dims, weights, one_pass=False, **kwargs)
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-11, atol=1e-13)
    leaves = inputs + [p for p in module.parameters() if p.requires_grad]
    for a, b in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_a_module_subclass_that_rewrites_forward_goes_per_prefix():
    """A subclass that rewrites forward is not read for its call: one call per prefix, each equal to the module
    on that prefix."""
    from torch_contrastive.losses.matryoshka import _as_function, _one_pass

    class Halved(tc.NTXentLoss):
        def forward(self, embeddings, labels=None, memory_emb=None, memory_labels=None, positive_weight=None,
                    ref_emb=None, ref_labels=None):
            return 0.5 * super().forward(embeddings, labels)

    g = torch.Generator().manual_seed(5)
    out0, out1 = (torch.randn(6, 8, generator=g, dtype=torch.float64).to(DEVICE) for _ in range(2))
    for module in (Halved(0.2, pairing="halves"),):
        inputs = [torch.cat([out0, out1])]
        assert _one_pass(*_as_function(module, inputs, {})) is None
        got = tc.matryoshka_loss(module, inputs, [8, 3])
        want = sum(module(*[F.normalize(t[:, :d], dim=1) for t in inputs]) for d in (8, 3))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_a_positive_weight_keeps_the_one_pass_and_gets_its_gradient(decoupled, reduction):
    """NT-Xent's ``positive_weight`` (one tensor, every prefix's): in one pass equal to one call per prefix, the
    weight's own gradient included (float64); chunked strips and a learnable temperature too."""
    from torch_contrastive.losses.matryoshka import _one_pass

    g = torch.Generator().manual_seed(11)
    x = torch.randn(10, 12, generator=g, dtype=torch.float64, device=DEVICE).requires_grad_()
    w = (torch.rand(10, generator=g, dtype=torch.float64) + 0.5).to(DEVICE).requires_grad_()
    tau = torch.tensor(0.3, dtype=torch.float64, device=DEVICE, requires_grad=True)
    args = {"positive_weight": w, "decoupled": decoupled, "pairing": "halves", "reduction": reduction, "chunk_size": 4,
            "temperature": tau}
    assert _one_pass(tc.nt_xent_loss, [x], args) is not None
    dims, weights = [12, 5, 2, 5], [1.0, 0.5, 2.0, 0.25]  # out of order, one twice: a weight column per prefix end
    got = tc.matryoshka_loss(tc.nt_xent_loss, [x], dims, weights, **args)
    want = tc.matryoshka_loss(tc.nt_xent_loss, [x], dims, weights, one_pass=False, **args)
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-11, atol=1e-13)
    for a, b in zip(torch.autograd.grad(_uneven(got), [x, w, tau]), torch.autograd.grad(_uneven(want), [x, w, tau])):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_a_bad_positive_weight_is_refused_as_the_loss_refuses_it():
    x = torch.randn(6, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"positive_weight must have shape \(6,\)"):
        tc.matryoshka_loss(tc.nt_xent_loss, [x], [8, 4], positive_weight=torch.ones(5, dtype=torch.float64))
    with pytest.raises(TypeError, match="positive_weight must be a floating-point tensor"):
        tc.matryoshka_loss(tc.nt_xent_loss, [x], [8, 4], positive_weight=torch.ones(6, dtype=torch.long))
    with pytest.raises(ValueError, match=r"weight_fn must return a \(3,\) tensor"):
        tc.matryoshka_loss(tc.DCLLoss(weight_fn=lambda a, b: a.sum()), [x[:3], x[3:]], [8, 4])


def test_nt_bxent_one_pass_keeps_a_confident_models_digits():
    """fp32, tau 0.05, positives near cosine 1 and negatives near -1 (terms around e^-20 to e^-40): every term and
    gradient entry is a softplus or sigmoid of the signed logit, so the one pass keeps them to fp32's relative digits
    against the float64 definition per prefix (a ``1 - sigmoid`` form would round the small positives' gradients away)."""
    g = torch.Generator().manual_seed(9)
    centres = F.normalize(torch.randn(2, 16, generator=g, dtype=torch.float64), dim=1)
    centres[1] = -centres[0]
    labels = torch.tensor([0, 1] * 6)
    x = (centres[labels] + 1e-3 * torch.randn(12, 16, generator=g, dtype=torch.float64)).float().to(DEVICE)
    dims = [16, 8]
    ours = x.clone().requires_grad_()
    got = tc.matryoshka_loss(tc.nt_bxent_loss, [ours], dims, labels=labels.to(DEVICE), temperature=0.05)
    ref = x.double().requires_grad_()
    want = tc.matryoshka_loss(tc.nt_bxent_loss, [ref], dims, labels=labels.to(DEVICE), temperature=0.05, one_pass=False)
    assert want.item() < 1e-6  # a confident model's loss: small terms only
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=0)
    (mine,), (exact,) = torch.autograd.grad(got, ours), torch.autograd.grad(want, ref)
    torch.testing.assert_close(mine.double(), exact, rtol=1e-3, atol=1e-3 * exact.abs().max().item())
