"""Bad input (README, "Errors"): the right exception, naming the argument; inputs untouched."""

from __future__ import annotations

import pytest
import torch

import torch_contrastive as tc

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
