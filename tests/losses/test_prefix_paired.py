"""losses/prefix_paired.py: InfoNCE with paired negatives over every prefix in one pass, against the library's loss
called once per prefix in float64 (and info-nce-pytorch's convention, in_batch_negatives=False)."""

from __future__ import annotations

import pytest
import torch

import torch_contrastive as tc
from device import DEVICE
from torch_contrastive.losses import matryoshka

DIMS, WEIGHTS = [12, 7, 3, 7], [1.0, 0.5, 2.0, 0.25]


def _one_pass_equals_per_prefix(q, key, negs, temperature, kwargs, learnable):
    """The one pass (asserted taken) against one call per prefix: the value, and the gradients of the inputs and a
    learnable temperature under an uneven upstream gradient (each row's own, for per-row values)."""
    assert matryoshka._one_pass(tc.info_nce_loss, [q, key, negs], kwargs) is not None
    got = tc.matryoshka_loss(tc.info_nce_loss, [q, key, negs], DIMS, WEIGHTS, **kwargs)
    want = tc.matryoshka_loss(tc.info_nce_loss, [q, key, negs], DIMS, WEIGHTS, one_pass=False, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)
    inputs = [q, key, negs] + ([temperature] if learnable else [])
    up = torch.linspace(0.5, 2.0, got.numel(), dtype=torch.float64, device=DEVICE).reshape(got.shape)
    for mine, ref in zip(torch.autograd.grad(got, inputs, up, allow_unused=True), torch.autograd.grad(want, inputs, up, allow_unused=True)):
        if ref is None:
            assert mine is None or not mine.abs().any()
        else:
            assert torch.isfinite(mine).all()
            torch.testing.assert_close(mine, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("in_batch", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("tau", [0.1, 0.01, "learnable"])
@pytest.mark.parametrize("k", [4, 1])
def test_paired_negatives_equal_one_call_per_prefix(in_batch, reduction, tau, k):
    g = torch.Generator().manual_seed(11)
    q, key = (torch.randn(9, 12, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_() for _ in range(2))
    negs = torch.randn(9, k, 12, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    temperature = torch.tensor(0.2, dtype=torch.float64, device=DEVICE, requires_grad=True) if tau == "learnable" else tau
    kwargs = {"negative_mode": "paired", "in_batch_negatives": in_batch, "temperature": temperature, "reduction": reduction,
              "chunk_size": 4}
    _one_pass_equals_per_prefix(q, key, negs, temperature, kwargs, tau == "learnable")


def test_paired_negatives_keep_their_checks():
    q, key = torch.randn(6, 8, device=DEVICE), torch.randn(6, 8, device=DEVICE)
    bad = torch.randn(6, 3, 8, device=DEVICE)
    bad[2, 1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"embeddings\[2\] has non-finite"):
        tc.matryoshka_loss(tc.info_nce_loss, [q, key, bad], [8, 4], negative_mode="paired")
    with pytest.raises(ValueError, match="negatives"):  # the wrong rows: the loss itself refuses (per prefix)
        tc.matryoshka_loss(tc.info_nce_loss, [q, key, torch.randn(5, 3, 8, device=DEVICE)], [8, 4], negative_mode="paired")


def _rule_cases(n, k, g):
    """name -> the false-negative rules' arguments: duplicate ids (keys and paired negatives), a guide (with the paired
    negatives' guide rows), DCL, and every key left out of some query's soft-max."""
    ids = torch.randint(0, 3, (n,), generator=g).to(DEVICE)
    guide = tuple(torch.randn(*shape, 5, generator=g, dtype=torch.float64).to(DEVICE) for shape in ((n,), (n,), (n, k)))
    return {
        "ids": {"key_ids": ids, "negative_ids": torch.randint(0, 3, (n, k), generator=g).to(DEVICE)},
        "guide": {"guide": guide, "guide_margin": 0.05},
        "guide relative dcl": {"guide": guide, "guide_margin": 0.1, "guide_margin_mode": "relative", "decoupled": True},
        "ids dcl": {"key_ids": ids, "decoupled": True},
        "dcl": {"decoupled": True},
        # one id for every key and negative: under DCL a query keeps no key and no negative (its term 0)
        "all out dcl": {"key_ids": torch.zeros(n, dtype=torch.long, device=DEVICE),
                        "negative_ids": torch.zeros(n, k, dtype=torch.long, device=DEVICE), "decoupled": True},
    }


@pytest.mark.parametrize("in_batch", [True, False])
@pytest.mark.parametrize("tau", [0.1, 0.01, "learnable"])
@pytest.mark.parametrize("rule", ["ids", "guide", "guide relative dcl", "ids dcl", "dcl", "all out dcl"])
def test_paired_negatives_with_false_negative_rules_equal_one_call_per_prefix(in_batch, tau, rule):
    """The rules leave as the loss leaves them: marked keys out of the keys' log-sum-exp (in its tiles), marked paired
    negatives out of their query's part, a query without any candidate 0 -- one pass, equal to one call per prefix."""
    g = torch.Generator().manual_seed(12)
    n, k = 9, 3
    q, key = (torch.randn(n, 12, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_() for _ in range(2))
    negs = torch.randn(n, k, 12, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    temperature = torch.tensor(0.2, dtype=torch.float64, device=DEVICE, requires_grad=True) if tau == "learnable" else tau
    kwargs = {"negative_mode": "paired", "in_batch_negatives": in_batch, "temperature": temperature, "reduction": "sum",
              "chunk_size": 4, **_rule_cases(n, k, g)[rule]}
    _one_pass_equals_per_prefix(q, key, negs, temperature, kwargs, tau == "learnable")


@pytest.mark.parametrize("in_batch", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("tau", [0.1, "learnable"])
def test_paired_negatives_with_label_smoothing_equal_one_call_per_prefix(in_batch, reduction, tau):
    """Label smoothing over every candidate of a query -- the keys (or, without in-batch negatives, the positive
    alone) and its own negatives -- as the loss smooths, in one pass."""
    g = torch.Generator().manual_seed(13)
    q, key = (torch.randn(9, 12, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_() for _ in range(2))
    negs = torch.randn(9, 3, 12, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    temperature = torch.tensor(0.2, dtype=torch.float64, device=DEVICE, requires_grad=True) if tau == "learnable" else tau
    kwargs = {"negative_mode": "paired", "in_batch_negatives": in_batch, "temperature": temperature, "reduction": reduction,
              "label_smoothing": 0.2, "chunk_size": 4}
    _one_pass_equals_per_prefix(q, key, negs, temperature, kwargs, tau == "learnable")
    # with the false-negative rules the loss refuses smoothing: per prefix, where it says why
    assert matryoshka._one_pass(tc.info_nce_loss, [q, key, negs], {**kwargs, "decoupled": True}) is None
