"""GISTEmbed over Matryoshka prefixes in one pass (``gist_loss(..., prefixes=...)``): equal to the loss of each
prefix cut and normalised on its own, the guide's verdicts formed once at its full width (float64)."""

from __future__ import annotations

import pytest
import torch

import torch_contrastive.integrations.sentence_transformers  # noqa: F401 -- loads _gist after the pieces it uses
from device import DEVICE
from torch_contrastive.integrations._gist import gist_loss
from torch_contrastive.losses.prefix_calls import shrink


@pytest.mark.parametrize("negatives", [False, True])
@pytest.mark.parametrize("strategy,margin", [("absolute", 0.0), ("relative", 0.1), ("absolute", 0.05)])
@pytest.mark.parametrize("contrast", [(True, True), (False, True), (True, False)])
def test_gist_prefixes_in_one_pass_equal_the_loss_per_prefix(negatives, strategy, margin, contrast):
    g = torch.Generator().manual_seed(3)

    def rows(n, d=12):
        return torch.randn(n, d, generator=g, dtype=torch.float64).to(DEVICE)

    a, p = rows(7).requires_grad_(), rows(7).requires_grad_()
    # the guide rates some candidates above each row's positive: near copies of the anchors' guide rows
    ga = rows(7, 5)
    gp = ga + 0.3 * rows(7, 5)
    n, gn = (rows(4).requires_grad_(), rows(4, 5)) if negatives else (None, None)
    dims, weights = [12, 7, 3, 7], [1.0, 0.5, 2.0, 0.25]
    options = {"temperature": 0.1, "margin": margin, "margin_strategy": strategy, "contrast_anchors": contrast[0],
               "contrast_positives": contrast[1]}
    got = gist_loss(a, p, ga, gp, n, gn, prefixes=(dims, weights), chunk_size=3, **options)
    want = sum(w * gist_loss(shrink(a, d), shrink(p, d), ga, gp, None if n is None else shrink(n, d), gn, **options)
               for d, w in zip(dims, weights))
    torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)
    leaves = [a, p] + ([n] if n is not None else [])
    for x, y in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves)):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-11)
