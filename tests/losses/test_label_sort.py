"""The label sort of the mask-in-tile losses (PML NT-Xent and NT-BXent by labels): its tile is the plan's, on every
device plan, so no tile that holds a positive is skipped and none indexes past the ranges.

The large calls run the CUDA plan of the torch loops on this machine (``planner.simulate``: its scratch budget, bf16 on
tensor cores as 12 bytes a logit; ``backend="torch"``, where the sort's tiles are read, and where a GPU without Triton
runs) and are compared with the float64 formulas over blocks of rows (:mod:`reference`), which are checked
against the naive loops first.
"""

from __future__ import annotations

import pytest
import torch

import torch_contrastive as tc
from reference import nt_bxent, nt_bxent_blocks, nt_xent_pml, nt_xent_pml_blocks
from torch_contrastive.engine import planner
from torch_contrastive.losses import _labelled

TAU = 0.5


def _both(x, labels, **kw):
    return (tc.nt_xent_loss(x, TAU, labels=labels, **kw).item(),
            tc.nt_bxent_loss(x, labels=labels, temperature=TAU, **kw).item())


def _references(x, labels):
    return nt_xent_pml_blocks(x, labels, TAU), nt_bxent_blocks(x, TAU, labels)


def test_the_block_references_equal_the_loops():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(30, 4, generator=g, dtype=torch.float64)
    for labels in (torch.randint(0, 4, (30,), generator=g), torch.zeros(30, dtype=torch.int64), torch.arange(30)):
        assert nt_xent_pml_blocks(x, labels, TAU, block=7) == pytest.approx(nt_xent_pml(x, labels, TAU).item(), rel=1e-12)
        assert nt_bxent_blocks(x, TAU, labels, block=7) == pytest.approx(nt_bxent(x, TAU, labels=labels).item(), rel=1e-12)


def test_the_reported_bf16_call_equals_float64(monkeypatch):
    """2,048 labelled bf16 rows under the CUDA plan at a 12 x 768² budget raised IndexError (the sort's tile came from
    8 bytes a logit, the plan's from 12): now the rows are sorted in blocks of the plan's 768."""
    steps = []
    asked = _labelled.label_sort_tile
    monkeypatch.setattr(_labelled, "label_sort_tile", lambda problem: steps.append(asked(problem)) or steps[-1])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=g).bfloat16()
    labels = torch.randint(0, 64, (2048,), generator=g)
    with planner.simulate("cuda", budget=12 * 768 * 768):
        got = _both(x, labels, backend="torch")
    assert steps == [768, 768]
    assert got == pytest.approx(_references(x, labels), rel=2e-5)


@pytest.mark.parametrize("step", [1, 3, 5, 8, 40])
def test_ranges_read_at_another_step_than_the_plans_tile_still_equal_float64(monkeypatch, step):
    """Whatever step the loss reads the label ranges at, the plan reads them at its own tile (4 here) and never skips a
    tile holding a positive: equal to the float64 formulas."""
    monkeypatch.setattr(_labelled, "label_sort_tile", lambda problem: step)
    g = torch.Generator().manual_seed(step)
    x = torch.randn(40, 5, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 6, (40,), generator=g)
    got = _both(x, labels, chunk_size=4)
    assert got == pytest.approx((nt_xent_pml(x, labels, TAU).item(), nt_bxent(x, TAU, labels=labels).item()), rel=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize(("rows", "losses"), [(8192, "both"), (12288, "both"), (20480, "both"), (32768, "nt_bxent")])
def test_labelled_bf16_calls_under_the_cuda_plan_equal_float64(rows, losses):
    """8k-32k labelled bf16 rows on the CUDA plan's default budget: one tile at 8,192, tiles the old sort read at the
    wrong size at 12,288 (a skipped positive) and 20,480 (past the ranges), several at 32,768 (NT-BXent alone there:
    the two losses share the sort, and each 32k call and its float64 reference take about a minute here)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 32, generator=g).bfloat16()
    labels = torch.randint(0, 64, (rows,), generator=g)
    with planner.simulate("cuda"):
        if losses == "both":
            got = _both(x, labels, backend="torch")
        else:
            got = (tc.nt_bxent_loss(x, labels=labels, temperature=TAU, backend="torch").item(),)
    want = _references(x, labels) if losses == "both" else (nt_bxent_blocks(x, TAU, labels),)
    assert got == pytest.approx(want, rel=2e-5)
