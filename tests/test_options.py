"""The shared options: one frozen set of values, checked the first time it is seen."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import torch_contrastive as tc
from device import DEVICE
from torch_contrastive import _validation, environment, options


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


@pytest.mark.parametrize("variable", ["TORCH_CONTRASTIVE_TILE", "TORCH_CONTRASTIVE_DENSE_BUDGET", "TORCH_CONTRASTIVE_GPU_BUDGET"])
@pytest.mark.parametrize("given", ["-5", "0", "abc", "2.5"])
def test_a_bad_size_in_the_environment_is_refused_by_name(variable, given):
    """Each environment variable is checked where it is read (``torch_contrastive.environment``): ``-5`` once made every
    tiled call return 0 with zero gradients, ``abc`` failed at import with a bare ``int()`` error."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(variable, given)
        with pytest.raises(ValueError, match=variable):
            environment.positive_int(variable, 1024)


def test_good_sizes_switches_and_choices_in_the_environment(monkeypatch):
    monkeypatch.setenv("TORCH_CONTRASTIVE_TILE", "2048")
    assert environment.positive_int("TORCH_CONTRASTIVE_TILE", 1024) == 2048
    monkeypatch.setenv("TORCH_CONTRASTIVE_TILE", "1e3")
    assert environment.positive_int("TORCH_CONTRASTIVE_TILE", 1024) == 1000
    monkeypatch.delenv("TORCH_CONTRASTIVE_TILE")
    assert environment.positive_int("TORCH_CONTRASTIVE_TILE", 1024) == 1024
    monkeypatch.setenv("TORCH_CONTRASTIVE_AUTOTUNE", "yes")
    with pytest.raises(ValueError, match="TORCH_CONTRASTIVE_AUTOTUNE"):
        environment.switch("TORCH_CONTRASTIVE_AUTOTUNE", True)
    monkeypatch.setenv("TORCH_CONTRASTIVE_PRODUCTS", "fast")
    with pytest.raises(ValueError, match="TORCH_CONTRASTIVE_PRODUCTS"):
        environment.choice("TORCH_CONTRASTIVE_PRODUCTS", "auto", ("auto", "half", "compute"))


def test_the_library_refuses_a_bad_tile_at_import():
    import subprocess
    import sys

    env = {**os.environ, "TORCH_CONTRASTIVE_TILE": "-5"}
    done = subprocess.run([sys.executable, "-c", "import torch_contrastive"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "TORCH_CONTRASTIVE_TILE must be a positive integer, got '-5'" in done.stderr
