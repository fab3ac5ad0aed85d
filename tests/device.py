"""The device the suite runs on: CUDA when this machine has a GPU, else the CPU.

Every test that can run on CUDA builds its tensors on :data:`DEVICE` (or takes the
``device`` fixture of ``conftest.py``), so a GPU session runs the same suite unchanged.
"""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
