"""Shared fixtures: the device (CUDA when present, else CPU; see ``device.py``)."""

from __future__ import annotations

import pytest
import torch

from device import DEVICE


@pytest.fixture
def device() -> torch.device:
    """The suite's device: a test taking it runs on the GPU when there is one."""
    return DEVICE
