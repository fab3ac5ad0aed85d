"""The offline cost model (cli/cost.py): what it prices a problem at, from the counts of cli/cost.PATHS and the
tiles the GPU plan would visit. The engine does not import it (checked here too)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from torch_contrastive.cli import cost
from torch_contrastive.engine.planner import Traits


def test_the_torch_loops_are_priced_over_the_tiles_they_walk():
    """16,384 rows in tiles of 4,096: a single set's soft-max terms walk the upper triangle (10 tiles), the pair
    terms every tile (16, as cli/cost.PATHS counts them) -- the model prices each over those tiles."""
    rows, tile = 16384, 4096
    for kind, traits, visited in (("rows", Traits(512, symmetric=True), 10),
                                  ("binary", Traits(512, symmetric=True, pairs="binary"), 16),
                                  ("pair_softplus", Traits(512, symmetric=True, pairs="pair_softplus"), 16)):
        priced = dict(cost.predictions(rows, rows, torch.bfloat16, torch.bfloat16, tile, traits))
        path = cost.PATHS[(kind, "torch", "half")]
        assert priced["torch"] == pytest.approx(cost.predict_path(path, "torch", rows, rows, 512, "bfloat16", visited)), kind
        assert priced["torch"] != pytest.approx(cost.predict_path(path, "torch", rows, rows, 512, "bfloat16", 26 - visited))


def test_a_call_takes_the_longer_of_its_device_and_its_host_time():
    """The device runs what the host issues, so a call's time is the longer of the two, computed here from the
    path's counts and the GPU's constants: a small call is its host's Python and launches, a large one its device's
    GEMMs and bytes."""
    path = cost.PATHS[("columns", "torch", "half")]
    g = cost.GPUS["H100"]
    for rows, bound in ((256, "host"), (65536, "device")):
        tiles = 1 if rows == 256 else 36
        flops = (path.gemms_one if tiles == 1 else path.gemms_strips) * 2.0 * rows * rows * 512
        passes = path.passes_one if tiles == 1 else path.passes_strips
        launches = path.launches + path.per_tile * (tiles - 1)
        kernels = path.kernels + path.kernels_per_tile * (tiles - 1)
        device = flops / g.gemm_flops["bfloat16"] + passes * 4.0 * rows * rows / g.bandwidth + launches * g.launch
        host = (launches - kernels) * g.host_op + (path.bytecodes + path.bytecodes_per_tile * (tiles - 1)) * g.host_bytecode \
            + kernels * g.host_kernel
        assert (host > device) == (bound == "host"), rows
        assert cost.predict_path(path, "torch", rows, rows, 512, "bfloat16", tiles) == pytest.approx(max(device, host))


def test_half_inputs_are_priced_on_every_counted_backend_and_fp64_not_at_all():
    """bf16: the torch loops, the epilogue, the fused kernels and the widened torch products (cost.WIDE) for the
    soft-max terms; fp32 without the fused kernels (not counted in fp32); fp64 is not priced."""
    traits = Traits(512, columns=True)
    half = dict(cost.predictions(8192, 8192, torch.bfloat16, torch.bfloat16, None, traits))
    assert set(half) == {"torch", "epilogue", "triton", cost.WIDE}
    assert all(t > 0 for t in half.values())
    assert set(dict(cost.predictions(8192, 8192, torch.float32, torch.float32, None, traits))) == {"torch", "epilogue"}
    assert cost.predictions(64, 64, torch.float64, torch.float64, None, traits) == ()


def test_the_engine_never_imports_the_cost_model():
    """The policy decides from measured rows; the model is an offline tool (``bench --traffic``): importing the
    library and running a loss leaves it unloaded."""
    code = ("import sys, torch, torch_contrastive as tc; "
            "tc.image_text_contrastive_loss(torch.randn(8, 4), torch.randn(8, 4), 0.1); "
            "tc.nt_bxent_loss(torch.randn(8, 4), labels=torch.arange(8) % 2); "
            "print('torch_contrastive.cli.cost' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
