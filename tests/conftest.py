"""Shared fixtures: the device (CUDA when present, else CPU; see ``device.py``)."""

from __future__ import annotations

import os

import pytest
import torch

# Without CUDA the Triton kernels run in Triton's interpreter. The switch must be set before
# anything imports triton.language (sentence-transformers' import chain does, at collection):
# triton decides at decoration time whether its own and our @triton.jit functions are interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from device import DEVICE

# one intra-op thread per xdist worker: two workers on two cores, not four threads fighting for them
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture
def device() -> torch.device:
    """The suite's device: a test taking it runs on the GPU when there is one."""
    return DEVICE
