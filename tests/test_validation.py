"""Bad input (README, "Errors"): the right exception, naming the argument; inputs untouched."""

from __future__ import annotations

import pytest
import torch

import torch_contrastive as tc
from device import DEVICE

X = torch.randn(8, 4)
Y = torch.randn(8, 4)
L = torch.tensor([0, 1, 0, 1, 2, 2, 3, 3])

CASES = [
    # (call, exception, words the message must contain)
    (lambda: tc.nt_xent_loss(X[0]), ValueError, "embeddings"),
    (lambda: tc.nt_xent_loss(X[None]), ValueError, "embeddings"),
    (lambda: tc.nt_xent_loss([[1.0, 2.0]]), TypeError, "embeddings"),
    (lambda: tc.nt_xent_loss(torch.ones(4, 2, dtype=torch.int64)), TypeError, "embeddings"),
    (lambda: tc.nt_xent_loss(X[:7]), ValueError, "even"),
    (lambda: tc.nt_xent_loss(X, labels=L[:7]), ValueError, "labels"),
    (lambda: tc.nt_xent_loss(X, labels=L.float()), TypeError, "labels"),
    (lambda: tc.nt_xent_loss(X, labels=L.tolist()), TypeError, "labels"),
    (lambda: tc.nt_xent_loss(X, pairing="neighbours"), ValueError, "pairing"),
    (lambda: tc.nt_xent_loss(X, 0.0), ValueError, "temperature"),
    (lambda: tc.nt_xent_loss(X, -1.0), ValueError, "temperature"),
    (lambda: tc.nt_xent_loss(X, float("nan")), ValueError, "temperature"),
    (lambda: tc.nt_xent_loss(X, float("inf")), ValueError, "temperature"),
    (lambda: tc.nt_xent_loss(X, torch.tensor([0.1, 0.2])), ValueError, "temperature"),
    (lambda: tc.nt_xent_loss(X, "0.1"), TypeError, "temperature"),
    (lambda: tc.nt_xent_loss(X, reduction="avg"), ValueError, "reduction"),
    (lambda: tc.nt_xent_loss(X, chunk_size=0), ValueError, "chunk_size"),
    (lambda: tc.nt_xent_loss(X, chunk_size=2.5), TypeError, "chunk_size"),
    (lambda: tc.nt_xent_loss(X, grad_reduction="avg"), ValueError, "grad_reduction"),
    (lambda: tc.nt_xent_loss(torch.full((4, 2), float("nan"))), ValueError, "embeddings"),
    (lambda: tc.nt_bxent_loss(X, torch.tensor([[0, 8]])), ValueError, "pos_indices"),
    (lambda: tc.nt_bxent_loss(X, torch.tensor([[-1, 2]])), ValueError, "pos_indices"),
    (lambda: tc.nt_bxent_loss(X, torch.tensor([0, 1, 2])), ValueError, "pos_indices"),
    (lambda: tc.nt_bxent_loss(X, torch.tensor([[0.0, 1.0]])), TypeError, "pos_indices"),
    (lambda: tc.nt_bxent_loss(X), ValueError, "pos_indices"),
    (lambda: tc.image_text_contrastive_loss(X, Y[:7]), ValueError, "batch size"),
    (lambda: tc.image_text_contrastive_loss(X, torch.randn(8, 5)), ValueError, "feature dimension"),
    (lambda: tc.image_text_contrastive_loss(X, Y.to("meta")), ValueError, "text_feat must be on the same device as image_feat"),
    (lambda: tc.info_nce_loss(X, Y.to("meta")), ValueError, "key must be on the same device as query"),
    (lambda: tc.supcon_loss(X, L, memory_emb=Y.to("meta"), memory_labels=L), ValueError, "memory_emb must be on the same device"),
    (lambda: tc.image_text_contrastive_loss(X, Y, image_id=L[:3]), ValueError, "image_id"),
    (lambda: tc.image_text_contrastive_loss(X, Y, text_id=L.double()), TypeError, "text_id"),
    (lambda: tc.supcon_loss(X), ValueError, "labels"),
    (lambda: tc.supcon_loss(X.reshape(4, 2, 4), L), ValueError, "labels"),
    (lambda: tc.supcon_loss(X.reshape(4, 2, 4), L[:4], torch.eye(4)), ValueError, "labels or mask"),
    (lambda: tc.supcon_loss(X.reshape(4, 2, 4), mask=torch.eye(3)), ValueError, "mask"),
    (lambda: tc.supcon_loss(X.reshape(4, 2, 4), contrast_mode="some"), ValueError, "contrast_mode"),
    (lambda: tc.supcon_loss(X, L, base_temperature=0), ValueError, "base_temperature"),
    (lambda: tc.NTXentLoss(temperature=-2), ValueError, "temperature"),
    (lambda: tc.SupConLoss(contrast_mode="x"), ValueError, "contrast_mode"),
]


@pytest.mark.parametrize("call,exc,words", CASES)
def test_bad_input_raises_clear_error(call, exc, words):
    before = (X.clone(), Y.clone(), L.clone())
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value)
    assert torch.equal(X, before[0]) and torch.equal(Y, before[1]) and torch.equal(L, before[2])


def test_non_finite_rows_are_counted():
    x = X.clone()
    x[2, 0] = float("nan")
    x[5, 1] = float("inf")
    with pytest.raises(ValueError, match=r"2 of 8 rows"):
        tc.nt_xent_loss(x)


# Losses whose mean is reduced inside the engine read that one value as the finite check of
# their embeddings (Checks.finish with covers=True); everything else reduces the inputs.
ANSWERED_BY_THE_LOSS = {
    "clip image": lambda bad, ok, t: tc.image_text_contrastive_loss(bad, ok, t),
    "clip text": lambda bad, ok, t: tc.image_text_contrastive_loss(ok, bad, t),
    "clip sum": lambda bad, ok, t: tc.image_text_contrastive_loss(bad, ok, t, reduction="sum"),
    "clip ids": lambda bad, ok, t: tc.image_text_contrastive_loss(bad, ok, t, image_id=torch.arange(bad.shape[0]) // 2),
    "nt_xent halves": lambda bad, ok, t: tc.nt_xent_loss(bad, t, pairing="halves"),
    "nt_xent adjacent": lambda bad, ok, t: tc.nt_xent_loss(bad, t, pairing="adjacent"),
    "supcon labels": lambda bad, ok, t: tc.supcon_loss(bad, torch.arange(bad.shape[0]) % 3, temperature=t),
    "supcon no positives": lambda bad, ok, t: tc.supcon_loss(bad, torch.arange(bad.shape[0]), temperature=t),
    "supcon views, one": lambda bad, ok, t: tc.supcon_loss(torch.stack([ok, bad], 1), temperature=t, contrast_mode="one"),
    "pml (inputs reduced)": lambda bad, ok, t: tc.nt_xent_loss(bad, t, labels=torch.arange(bad.shape[0])),
    "nt_bxent labels": lambda bad, ok, t: tc.nt_bxent_loss(bad, labels=torch.arange(bad.shape[0]) % 3, temperature=t),
    "nt_bxent one class": lambda bad, ok, t: tc.nt_bxent_loss(bad, labels=torch.zeros(bad.shape[0], dtype=torch.long), temperature=t),
    "nt_bxent no positives": lambda bad, ok, t: tc.nt_bxent_loss(bad, labels=torch.arange(bad.shape[0]), temperature=t,
                                                                reduction="sum"),
    "nt_bxent pairs": lambda bad, ok, t: tc.nt_bxent_loss(bad, torch.tensor([[0, 1], [2, 4]]), temperature=t),
}


@pytest.mark.parametrize("name", list(ANSWERED_BY_THE_LOSS))
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tensor_temperature", [False, True])
def test_a_non_finite_row_is_named_when_the_loss_value_answers_the_check(name, value, dtype, tensor_temperature):
    """A single bad entry anywhere: the call raises and names the argument (no silent NaN)."""
    ok = torch.randn(6, 5).to(dtype)
    for row in (0, 5):
        bad = torch.randn(6, 5).to(dtype)
        bad[row, 3] = value
        t = torch.tensor(0.1) if tensor_temperature else 0.1
        which = "features" if name.startswith("supcon") else "text_feat" if name == "clip text" else \
            "image_feat" if name.startswith("clip") else "embeddings"
        with pytest.raises(ValueError, match=f"{which} contains non-finite values"):
            ANSWERED_BY_THE_LOSS[name](bad, ok, t)


@pytest.mark.parametrize("tensor_temperature", [False, True])
@pytest.mark.parametrize("call", [
    lambda x, t: tc.nt_bxent_loss(x, labels=torch.zeros(1, dtype=torch.long, device=DEVICE), temperature=t),
    lambda x, t: tc.nt_bxent_loss(x, torch.zeros(0, 2, dtype=torch.long, device=DEVICE), temperature=t),
    lambda x, t: tc.supcon_loss(x, torch.zeros(1, dtype=torch.long, device=DEVICE), temperature=t),
], ids=["nt_bxent labels", "nt_bxent no pairs", "supcon"])
def test_a_one_row_batch_checks_its_input_itself(call, tensor_temperature):
    """One row has no pair to carry its NaN into the loss (the loss is 0): the input is checked on its own."""
    bad = torch.tensor([[float("nan"), 1.0, 2.0]], device=DEVICE)
    with pytest.raises(ValueError, match="contains non-finite values"):
        call(bad, torch.tensor(0.1, device=DEVICE) if tensor_temperature else 0.1)


@pytest.mark.parametrize("name", list(ANSWERED_BY_THE_LOSS))
def test_huge_finite_rows_pass_the_check_answered_by_the_loss(name):
    """Rows near the fp32 limit are finite input: no error, a finite loss and finite gradients."""
    bad = torch.randn(6, 5)
    bad[1] = 3e38
    bad[4, 0] = -3.4e38
    bad.requires_grad_()
    loss = ANSWERED_BY_THE_LOSS[name](bad, torch.randn(6, 5), 0.1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(bad.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_finite_check_whose_cheap_sum_overflows_is_cleared_by_the_exact_check(dtype):
    """The eager finite check sums the tensor: finite entries whose sum overflows must pass."""
    big = torch.finfo(dtype).max / 2
    x = torch.full((6, 4), big, dtype=dtype)
    x[::2] = -big / 3  # rows of both signs, every entry finite, the plain sum beyond the range
    query, key = x.clone(), x.flip(0).clone()
    loss = tc.info_nce_loss(query, key, temperature=0.1)
    assert torch.isfinite(loss)
    query[3, 1] = float("nan")
    with pytest.raises(ValueError, match="query contains non-finite values"):
        tc.info_nce_loss(query, key, temperature=0.1)


def test_non_finite_rows_are_named_when_the_loss_value_is_read_with_other_checks():
    """With other values to read in the same transfer, the loss value that answers the deferred finite
    checks is packed with them (not the one-value read of a plain call) and still names the argument."""
    from torch_contrastive._validation import Checks

    x = torch.randn(8, 4, device=DEVICE)
    x[3, 1] = float("nan")
    checks = Checks(True)
    checks.finite(x, "embeddings", deferred=True)
    checks.add(torch.tensor(1.0, device=DEVICE), lambda: "a flag that is fine", lambda got: got < 0)
    with pytest.raises(ValueError, match=r"embeddings contains non-finite values .* \(first bad row: 3\)"):
        checks.finish(x.sum(), covers=True, overflow=None)
    fine = Checks(True)
    fine.finite(x[:3], "embeddings", deferred=True)
    fine.add(torch.tensor(1.0, device=DEVICE), lambda: "a flag that is fine", lambda got: got < 0)
    fine.finish(x[:3].sum(), covers=True, overflow=None)  # no error: every value is fine
