"""The example scripts run and do what their docstrings say (ddp_simclr.py: see test_distributed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_moco_queue_beats_the_untrained_encoder():
    pytest.importorskip("sklearn")
    result = _load("moco_queue").train(seed=0)
    assert result["queue_rows"] == 1024
    assert result["knn_trained"] > result["knn_untrained"] + 0.02, result
