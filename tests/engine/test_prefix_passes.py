"""Matryoshka's prefix passes run through the engine's strategy interface (engine/prefix_passes.py): a prefix loss
builds a Problem of Prefixes, solve() plans it by the device's policy and the torch loops run its pass. The values
are the prefix losses' own tests' (tests/losses/test_matryoshka*.py against per-prefix float64 references); here:
that every pass is reached that way and only that way, and that its plan holds its strips."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import torch_contrastive as tc
from device import DEVICE
from torch_contrastive.engine import Options, Problem, planner
from torch_contrastive.engine.prefix_passes import FUNCTIONS, PREFIX_PASSES, PrefixPasses
from torch_contrastive.engine.problem import PREFIX_FORMS, Prefixes
from torch_contrastive.engine.problem_plan import plan
from torch_contrastive.engine.strategies import STRATEGIES
from torch_contrastive.engine.torch_loops import TORCH_LOOPS

SRC = Path(tc.__file__).parent


def _rows(n=24, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g).to(DEVICE).requires_grad_(),
            torch.randn(n, d, generator=g).to(DEVICE).requires_grad_())


def test_every_prefix_form_is_a_pass_of_the_torch_loops_and_no_kernel_strategys():
    """Each form a Prefixes statistic may name has its pass; the torch loops hold the passes; every other strategy
    refuses a prefix problem with its reason, and asking for one by name is a ValueError that says so."""
    assert set(FUNCTIONS) == set(PREFIX_FORMS)
    assert TORCH_LOOPS.forms[Prefixes, "torch"] is PREFIX_PASSES
    x, y = _rows()
    for name, strategy in STRATEGIES.items():
        problem = Problem(x, y, 10.0, Prefixes("softmax", (8, 32), (1.0, 1.0)), options=Options(True, 1e-12, None, name))
        why = strategy.serves(problem, planner.target(x.device))
        if name == "torch":
            assert why is None
        else:
            assert "no prefix passes" in str(why)
            with pytest.raises(ValueError, match=rf"backend={name!r} cannot run this call: .*no prefix passes"):
                plan(problem)


def test_no_module_applies_a_prefix_pass_beside_solve():
    """The prefix passes' autograd functions are applied in engine/prefix_passes.py alone: every other module of the
    package reaches them through solve() (the plan, the policy, explain)."""
    applies = re.compile(r"\b(" + "|".join(fn.__name__ for fn, _ in FUNCTIONS.values()) + r")\.apply\(")
    assert applies.search("loss = PrefixRowLSE.apply(q, keys, plan)")  # the check sees a direct call
    found = [str(path.relative_to(SRC)) for path in SRC.rglob("*.py") if applies.search(path.read_text())]
    assert found == []  # (prefix_passes.py applies them by its table, FUNCTIONS)


def _matryoshka_calls():
    """One Matryoshka call of each pass: (the pass it runs, the call)."""
    x, y = _rows()
    labels = torch.arange(24, device=DEVICE) % 4
    dims = [8, 16, 32]
    return {
        "softmax": lambda: tc.matryoshka_loss(tc.clip_loss, [x, y], dims, temperature=0.07),
        "row_lse": lambda: tc.matryoshka_loss(tc.supcon_loss, [x], dims, labels=labels),
        "pairs": lambda: tc.matryoshka_loss(tc.nt_xent_loss, [x], dims, labels=labels, temperature=0.1),
        "sigmoid": lambda: tc.matryoshka_loss(tc.siglip_loss, [x, y], dims, logit_scale=10.0, logit_bias=-10.0),
    }


@pytest.mark.parametrize("form", PREFIX_FORMS)
def test_a_matryoshka_call_is_planned_explained_and_run_as_its_pass(form, monkeypatch):
    """Each pass, reached from a Matryoshka loss: its problem is planned (explain lists a "prefixes" decision of the
    torch loops, by the policy's rule) and run by the prefix passes -- and the loss's gradient arrives."""
    ran = []
    real = PrefixPasses.run

    def counted(self, problem, chosen):
        ran.append((problem.statistic.form, chosen.prefix.strip, chosen.decision))
        return real(self, problem, chosen)

    monkeypatch.setattr(PrefixPasses, "run", counted)
    call = _matryoshka_calls()[form]
    decisions = tc.explain(call)
    assert decisions and all(d.kernel == "prefixes" and d.backend == "torch" and d.reason.startswith("policy: torch")
                             for d in decisions)
    ran.clear()
    loss = call()
    assert ran and {f for f, _, _ in ran} == {form}
    loss.backward()
    assert torch.isfinite(loss)


def test_the_prefix_strip_is_decided_in_the_plan():
    """The strip height is the plan's: the caller's chunk size, else as many rows as keep one strip near 64 MiB;
    one set's upper triangle in about eight strips; the decision's tile says the same (strips across every column)."""
    x, y = _rows(300, 16)
    chunked = plan(Problem(x, y, 10.0, Prefixes("softmax", (8, 16), (1.0, 1.0)), options=Options(True, 1e-12, 64)))
    assert chunked.prefix.strip == 64 and (chunked.decision.tile, chunked.decision.tile_cols) == (64, 300)
    assert "5 strips of 64x300" in str(chunked.decision)
    whole = plan(Problem(x, y, 10.0, Prefixes("softmax", (8, 16), (1.0, 1.0)), options=Options(True)))
    assert whole.prefix.strip == 300 and whole.decision.tile == 0
    upper = plan(Problem(x, x, 10.0, Prefixes("row_lse", (8, 16), (1.0, 1.0), upper=True), options=Options(True)))
    assert upper.prefix.strip == 128  # at least 128 rows, about 300 / 8 otherwise
    assert upper.prefix.cuts == (8, 16) and upper.prefix.which == (0, 1)


def test_a_prefix_problem_is_checked_when_built():
    x, y = _rows()
    with pytest.raises(ValueError, match=r"Prefixes\.form must be one of"):
        Prefixes("lse", (8,), (1.0,))
    with pytest.raises(ValueError, match="one weight per prefix end, got 2 ends and 1 weights"):
        Prefixes("softmax", (8, 16), (1.0,))
    with pytest.raises(TypeError, match="Prefixes needs a float scale"):
        plan(Problem(x, y, torch.tensor(10.0), Prefixes("softmax", (8,), (1.0,)), options=Options(True)))
    with pytest.raises(ValueError, match="matryoshka_dims cannot exceed the embedding size 32, got 64"):
        plan(Problem(x, y, 10.0, Prefixes("softmax", (64,), (1.0,)), options=Options(True)))


def test_a_single_sets_rows_reach_their_pass_once(monkeypatch):
    """One set's rows are handed to the soft-max and row log-sum-exp passes once (``candidates=None``: the pass
    returns both roles' gradient itself; an autograd function given one tensor twice is not traced by Dynamo), two
    sets' rows as two inputs."""
    seen = []

    class Recording:
        def __init__(self, function):
            self.function = function

        def apply(self, anchors, candidates, *rest):
            seen.append((self.function.__name__, candidates is None))
            return self.function.apply(anchors, candidates, *rest)

    for form, (function, one_set) in list(FUNCTIONS.items()):
        monkeypatch.setitem(FUNCTIONS, form, (Recording(function), one_set))
    x, y = _rows()
    labels = torch.arange(24, device=DEVICE) % 4
    tc.matryoshka_loss(tc.nt_xent_loss, [x], [8, 32], pairing="halves", temperature=0.1).backward()
    tc.matryoshka_loss(tc.supcon_loss, [x], [8, 32], labels=labels).backward()
    tc.matryoshka_loss(tc.clip_loss, [x, y], [8, 32], temperature=0.1).backward()
    assert seen == [("PrefixRowLSE", True), ("PrefixRowLSE", True), ("PrefixSoftmax", False)]  # (NT-Xent: the upper triangle)
