"""The shared options: one frozen set of values, checked the first time it is seen."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import torch_contrastive as tc
from device import DEVICE
from torch_contrastive import _validation, options


def test_a_set_of_options_is_checked_once(monkeypatch):
    calls = []
    real = _validation.check_options
    monkeypatch.setattr(_validation, "check_options", lambda **kw: (calls.append(kw), real(**kw))[1])
    monkeypatch.setattr(options, "_KNOWN", {})
    x = torch.randn(6, 4, device=DEVICE)
    for _ in range(3):
        tc.clip_loss(x, x.flip(0), 0.1, chunk_size=5)
    assert len(calls) == 1  # three calls, one check
    module = tc.ImageTextContrastiveLoss(0.1, chunk_size=5, reduction="sum")
    module(x, x.flip(0))
    module(x, x.flip(0))
    assert len(calls) == 2  # the module's set, checked at construction, is not checked again per call


def test_shared_options_are_frozen_and_typed():
    got = options.shared(eps=1, normalize=False)
    assert got.eps == 1.0 and isinstance(got.eps, float) and got.normalize is False
    with pytest.raises(TypeError, match="normalize must be a bool, got int"):  # a flag is a bool, not 0/1 or "no"
        options.shared(normalize=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.reduction = "sum"  # type: ignore[misc]
    assert options.shared(eps=1) is options.shared(eps=1)


@pytest.mark.parametrize("bad, message", [
    (dict(chunk_size=True), "chunk_size must be None or a positive int, got bool"),  # True == 1 as a key: not the same option
    (dict(eps=True), "eps must be a positive float, got True"),
    (dict(reduction=["mean"]), r"reduction must be one of \['mean', 'sum', 'none'\], got \['mean'\]"),  # unhashable
    (dict(backend="cuda"), "backend must be one of"),
])
def test_bad_options_are_refused_even_after_good_ones(bad, message):
    options.shared(chunk_size=1)  # the equal-looking good values are known first, each on its own
    options.shared(eps=1.0)
    with pytest.raises((ValueError, TypeError), match=message):
        options.shared(**bad)
    with pytest.raises((ValueError, TypeError), match=message):
        tc.clip_loss(torch.randn(4, 3, device=DEVICE), torch.randn(4, 3, device=DEVICE), 0.1, **bad)
