"""The lean one-tile executor (engine/one_tile.py): which plans it serves, the same bits as the general
executor, the float64 formulas, and fewer Python calls per call."""

from __future__ import annotations

import sys

import pytest
import torch

import reference as ref
import torch_contrastive as tc
from device import DEVICE
from helpers import count_applies
from torch_contrastive.engine import one_tile, pairwise, softmax
from torch_contrastive.engine.torch_loops import TORCH_LOOPS

LEAN_FUNCTIONS = (one_tile.OneTileFunction, one_tile._OneTileMask, one_tile.OneTilePairsFunction)


@pytest.fixture
def lean_calls(monkeypatch):
    """How many calls the one-tile functions served, all three together (a list with one counter)."""
    return count_applies(monkeypatch, LEAN_FUNCTIONS)


def _general(monkeypatch):
    """Send every one-tile plan to the general torch executors (what ran before the one-tile executors)."""
    monkeypatch.setitem(TORCH_LOOPS.forms, (tc.engine.Softmax, "one_tile"), softmax.TORCH)
    monkeypatch.setitem(TORCH_LOOPS.forms, (tc.engine.PairTerms, "one_tile"), pairwise.TORCH)


def _rows(n, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype).to(DEVICE),
            torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype).to(DEVICE))


def _lean_cases(x, y):
    """(name, loss(x, y), which inputs take a gradient) of every call the one-tile executor serves."""
    return [
        ("clip", lambda a, b: tc.image_text_contrastive_loss(a, b, 0.1), (True, True)),
        ("clip sum", lambda a, b: tc.image_text_contrastive_loss(a, b, 0.2, reduction="sum"), (True, True)),
        ("clip constant texts", lambda a, b: tc.image_text_contrastive_loss(a, b, 0.1), (True, False)),
        ("clip constant images", lambda a, b: tc.image_text_contrastive_loss(a, b, 0.1), (False, True)),
        ("clip module", lambda a, b: tc.ClipLoss(temperature=0.07)(a, b), (True, True)),
        ("nt_xent halves", lambda a, b: tc.nt_xent_loss(a, 0.1, pairing="halves"), (True, False)),
        ("nt_xent adjacent sum", lambda a, b: tc.nt_xent_loss(a, 0.5, reduction="sum"), (True, False)),
        ("nt_xent module", lambda a, b: tc.NTXentLoss(temperature=0.2)(a), (True, False)),
        # a single set's label relation read off the tile (_OneTileMask; _OneTilePairs for the pair conventions)
        ("supcon labels", lambda a, b: tc.supcon_loss(a, _labels(a), temperature=0.1), (True, False)),
        ("supcon views", lambda a, b: tc.supcon_loss(a.view(-1, 2, a.shape[1]), _labels(a)[::2], temperature=0.2),
         (True, False)),
        ("supcon views without labels", lambda a, b: tc.supcon_loss(a.view(-1, 2, a.shape[1]), temperature=0.1),
         (True, False)),
        ("supcon base temperature sum", lambda a, b: tc.supcon_loss(a, _labels(a), temperature=0.1, base_temperature=0.07,
                                                                  reduction="sum"), (True, False)),
        ("supcon unique labels", lambda a, b: tc.supcon_loss(a, torch.arange(a.shape[0], device=a.device) // 2 * 2 + 1,
                                                              temperature=0.1), (True, False)),
        ("supcon module", lambda a, b: tc.SupConLoss(temperature=0.1)(a, _labels(a)), (True, False)),
        ("pml labels", lambda a, b: tc.nt_xent_loss(a, 0.1, labels=_labels(a)), (True, False)),
        ("pml labels sum", lambda a, b: tc.nt_xent_loss(a, 0.2, labels=_labels(a), reduction="sum"), (True, False)),
        ("nt_bxent labels", lambda a, b: tc.nt_bxent_loss(a, temperature=0.1, labels=_labels(a)), (True, False)),
        ("nt_bxent labels sum", lambda a, b: tc.nt_bxent_loss(a, temperature=0.3, labels=_labels(a), reduction="sum"),
         (True, False)),
    ]


def _labels(a):
    """Three classes, unevenly sized, and one label held by a single row (no positive: SupCon leaves it out)."""
    n = a.shape[0]
    labels = torch.arange(n, device=a.device) % 3
    labels[-1] = 7
    return labels


def _run(fn, x, y, grads):
    a = x.clone().requires_grad_(grads[0])
    b = y.clone().requires_grad_(grads[1])
    loss = fn(a, b)
    loss.backward()
    return loss.detach(), a.grad, b.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [2, 6, 37 * 2])
def test_one_tile_is_the_general_executor_bit_for_bit(monkeypatch, lean_calls, dtype, n):
    x, y = _rows(n, 5, dtype, n)
    for name, fn, grads in _lean_cases(x, y):
        before = lean_calls[0]
        got = _run(fn, x, y, grads)
        assert lean_calls[0] == before + 1, f"{name}: not served by the one-tile executor"
        with monkeypatch.context() as m:
            _general(m)
            want = _run(fn, x, y, grads)
        assert lean_calls[0] == before + 1
        for g, w in zip(got, want):
            assert (g is None) == (w is None), name
            if g is not None:
                assert g.dtype == w.dtype and torch.equal(g, w), f"{name}: differs from the general executor"


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_one_tile_equals_the_float64_formulas(lean_calls, dtype, tol):
    x, y = _rows(10, 4, dtype, 3)
    tau = 0.1
    refs = {
        "clip": lambda a, b: ref.image_text(a, b, tau),
        "nt_xent halves": lambda a, b: ref.nt_xent(a, tau, pairing="halves"),
        "nt_xent adjacent": lambda a, b: ref.nt_xent(a, tau),
        "supcon labels": lambda a, b: ref.supcon(a, tau, labels=_labels(a)),
        "supcon views": lambda a, b: ref.supcon(a.view(5, 2, 4), tau, labels=_labels(a)[:5]),
        "pml labels": lambda a, b: ref.nt_xent_pml(a, _labels(a), tau),
        "nt_bxent labels": lambda a, b: ref.nt_bxent(a, tau, labels=_labels(a)),
    }
    ours = {
        "clip": lambda a, b: tc.image_text_contrastive_loss(a, b, tau),
        "nt_xent halves": lambda a, b: tc.nt_xent_loss(a, tau, pairing="halves"),
        "nt_xent adjacent": lambda a, b: tc.nt_xent_loss(a, tau),
        "supcon labels": lambda a, b: tc.supcon_loss(a, _labels(a), temperature=tau),
        "supcon views": lambda a, b: tc.supcon_loss(a.view(5, 2, 4), _labels(a)[:5], temperature=tau),
        "pml labels": lambda a, b: tc.nt_xent_loss(a, tau, labels=_labels(a)),
        "nt_bxent labels": lambda a, b: tc.nt_bxent_loss(a, temperature=tau, labels=_labels(a)),
    }
    for name, fn in ours.items():
        before = lean_calls[0]
        value, ga, gb = _run(fn, x, y, (True, name == "clip"))
        assert lean_calls[0] == before + 1
        a64, b64 = (t.detach().double().cpu().clone().requires_grad_() for t in (x, y))
        want = refs[name](a64, b64)
        want.backward()
        assert value.item() == pytest.approx(want.item(), rel=tol, abs=tol), name
        torch.testing.assert_close(ga.double().cpu(), a64.grad, rtol=tol * 10, atol=tol * 10)
        if name == "clip":
            torch.testing.assert_close(gb.double().cpu(), b64.grad, rtol=tol * 10, atol=tol * 10)


def test_one_tile_gradcheck():
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: tc.image_text_contrastive_loss(a, b, 0.3), (x, y))
    assert torch.autograd.gradcheck(lambda a: tc.nt_xent_loss(a, 0.3, pairing="halves"), (x,))
    labels = torch.tensor([0, 1, 0, 2, 1, 0])
    assert torch.autograd.gradcheck(lambda a: tc.supcon_loss(a, labels, temperature=0.3), (x,))
    assert torch.autograd.gradcheck(lambda a: tc.nt_xent_loss(a, 0.3, labels=labels), (x,))
    assert torch.autograd.gradcheck(lambda a: tc.nt_bxent_loss(a, temperature=0.3, labels=labels), (x,))


def test_calls_the_one_tile_executor_does_not_serve_go_to_the_general_one(lean_calls):
    x, y = _rows(12, 4, torch.float32, 1)
    tau = torch.tensor(0.1, requires_grad=True, device=DEVICE)
    others = [
        lambda: tc.image_text_contrastive_loss(x, y, tau),  # a learnable temperature (its gradient)
        lambda: tc.image_text_contrastive_loss(x, y, 0.1, reduction="none")[0],  # per-row values
        lambda: tc.image_text_contrastive_loss(x, y, 0.1, chunk_size=5),  # several tiles
        lambda: tc.image_text_contrastive_loss(x, y, 0.01),  # the online maximum (|S| may overflow exp)
        lambda: tc.image_text_contrastive_loss(x, y, 0.1, normalize=False),
        lambda: tc.image_text_contrastive_loss(x, y, 0.1, torch.arange(12, device=DEVICE) // 2),  # ids: a key relation
        lambda: tc.nt_xent_loss(x, 0.1, decoupled=True),  # an exclusion
        lambda: tc.nt_xent_loss(x, 0.1, positive_weight=torch.rand(12, device=DEVICE)),  # weights
        lambda: tc.supcon_loss(x, torch.arange(12, device=DEVICE) % 3, temperature=0.1, reduction="none")[0],
        lambda: tc.supcon_loss(x.view(6, 2, 4), torch.arange(6, device=DEVICE) % 3, temperature=0.1, contrast_mode="one"),
        lambda: tc.supcon_loss(x, mask=torch.ones(12, 12, device=DEVICE), temperature=0.1),  # a mask over samples
        lambda: tc.supcon_loss(x, torch.arange(12, device=DEVICE) % 3, temperature=0.01),
        lambda: tc.supcon_loss(x, torch.arange(12, device=DEVICE) % 3, temperature=0.1, memory_emb=y[:4],
                               memory_labels=torch.arange(4, device=DEVICE) % 3),
        lambda: tc.nt_xent_loss(x, 0.1, labels=torch.arange(12, device=DEVICE) % 3, reduction="none")[0],
        lambda: tc.nt_xent_loss(x, 0.1, labels=torch.arange(12, device=DEVICE) % 3, normalize=False),
        lambda: tc.nt_xent_loss(x, tau, labels=torch.arange(12, device=DEVICE) % 3),
        lambda: tc.nt_bxent_loss(x, torch.tensor([[0, 1], [1, 0], [2, 3]], device=DEVICE), temperature=0.1),  # listed pairs
        lambda: tc.nt_bxent_loss(x, temperature=0.01, labels=torch.arange(12, device=DEVICE) % 3),
    ]
    for i, fn in enumerate(others):
        value = fn()
        assert torch.isfinite(value).all(), i
        assert lean_calls[0] == 0, f"case {i} went to the one-tile executor"
    tc.image_text_contrastive_loss(x, y, tau).backward()
    assert tau.grad is not None and tau.grad != 0  # the general executor's temperature gradient


def test_explain_names_the_executor_that_ran(lean_calls):
    """``tc.explain`` says ``executor="one_tile"`` exactly for the calls the lean executor ran -- a call it hands
    on per call (per-row values, a tensor temperature) is named by the backend that ran it -- and says it in words."""
    x, _ = _rows(12, 4, torch.float32, 2)
    labels = torch.arange(12, device=DEVICE) % 3
    calls = [
        lambda: tc.nt_xent_loss(x, 0.1, labels=labels),
        lambda: tc.nt_xent_loss(x, 0.1, labels=labels, reduction="none"),
        lambda: tc.nt_xent_loss(x, torch.tensor(0.1, device=DEVICE), labels=labels),
        lambda: tc.supcon_loss(x, labels, temperature=0.1),
        lambda: tc.supcon_loss(x, labels, temperature=0.1, reduction="none"),
        lambda: tc.nt_xent_loss(x, 0.1, pairing="halves"),
        lambda: tc.nt_xent_loss(x, 0.1, pairing="halves", chunk_size=5),
    ]
    for i, fn in enumerate(calls):
        for _ in range(2):  # the plan made, then found again
            before = lean_calls[0]
            (decision,) = tc.explain(fn)
            lean = lean_calls[0] == before + 1
            assert decision.executor == ("one_tile" if lean else "torch"), i
            assert ("lean one-tile executor" in str(decision)) == lean, i
    assert [tc.explain(fn)[0].executor for fn in calls] == ["one_tile", "torch", "torch", "one_tile", "torch", "one_tile", "torch"]
    (sigmoid,) = tc.explain(lambda: tc.siglip_loss(x, x.flip(0), 10.0, -10.0))
    assert sigmoid.kernel == "sigmoid" and sigmoid.executor == sigmoid.backend
    assert tc.engine.decide(kernel="softmax", rows=12, cols=12, device=x.device, dtype=x.dtype, other_dtype=x.dtype,
                            chunk_size=None, backend="torch").executor == ""


def test_one_tile_under_autocast_and_deterministic_mode(monkeypatch, lean_calls):
    x, y = _rows(16, 8, torch.float32, 5)
    fn = lambda a, b: tc.image_text_contrastive_loss(a, b, 0.1)  # noqa: E731
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):  # the driver switches autocast off: the general path
        auto = _run(fn, x, y, (True, True))
    assert lean_calls[0] == 0 and all(torch.isfinite(t).all() for t in auto)
    _run(fn, x, y, (True, True))
    assert lean_calls[0] == 1
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        det = _run(lambda a, b: tc.nt_xent_loss(a, 0.1), x, y, (True, False))
    finally:
        torch.use_deterministic_algorithms(was)
    assert lean_calls[0] == 2
    with monkeypatch.context() as m:
        _general(m)
        want = _run(lambda a, b: tc.nt_xent_loss(a, 0.1), x, y, (True, False))
    torch.testing.assert_close(det[1], want[1], rtol=1e-6, atol=1e-7)


def test_one_tile_refuses_a_second_derivative():
    x = torch.randn(8, 4, device=DEVICE, requires_grad=True)
    loss = tc.nt_xent_loss(x, 0.1)
    with pytest.raises(RuntimeError, match="first-order"):
        torch.autograd.grad(loss, x, create_graph=True)


def test_one_tile_leaves_the_callers_rows_alone():
    x, y = _rows(8, 4, torch.float32, 2)
    keep = x.clone(), y.clone()
    tc.image_text_contrastive_loss(x.requires_grad_(), y, 0.1).backward()
    assert torch.equal(x.detach(), keep[0]) and torch.equal(y, keep[1])


def _python_calls(fn) -> int:
    """Python function calls (not C calls) in one forward + backward, after a warm-up call."""
    fn()
    count = [0]

    def profile(frame, event, arg):
        if event == "call":
            count[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


@pytest.mark.parametrize("name,bound", [("clip", 0.7), ("nt_xent", 0.7), ("supcon", 0.8), ("pml", 0.8), ("nt_bxent", 0.8)])
def test_one_tile_makes_fewer_python_calls(monkeypatch, name, bound):
    """Per-call Python is what a small call pays (and a GPU as latency): a count, which does not flake.
    Measured when written (lean / general): CLIP 100 / 162, NT-Xent 95 / 147, and the labelled losses, which
    build their relation in the loss layer either way, SupCon 115 / 169, PML 134 / 172, NT-BXent 135 / 174."""
    x, y = _rows(64, 32, torch.float32, 0)
    a, b = x.requires_grad_(), y.requires_grad_()
    labels = torch.arange(64, device=DEVICE) % 5
    calls = {"clip": lambda: tc.image_text_contrastive_loss(a, b, 0.1).backward(),
             "nt_xent": lambda: tc.nt_xent_loss(a, 0.1, pairing="halves").backward(),
             "supcon": lambda: tc.supcon_loss(a, labels, temperature=0.1).backward(),
             "pml": lambda: tc.nt_xent_loss(a, 0.1, labels=labels).backward(),
             "nt_bxent": lambda: tc.nt_bxent_loss(a, temperature=0.1, labels=labels).backward()}
    lean = _python_calls(calls[name])
    with monkeypatch.context() as m:
        _general(m)
        general = _python_calls(calls[name])
    assert lean <= bound * general, f"{name}: {lean} Python calls against the general executor's {general}"


def test_excluded_candidates_keep_the_general_executor(lean_calls):
    """False negatives left out (ids equal to the positive's, the positive itself kept: its apart rule holds)
    are not the one-tile executor's: the general one serves them, and they equal the float64 formula."""
    from torch_contrastive.engine import Options, Problem, Softmax, plan, solve
    from torch_contrastive.positives import Exclusion, Positives

    n, tau = 8, 0.1
    x, y = _rows(n, 4, torch.float64, 9)
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3], device=DEVICE)
    rows = torch.arange(n, device=DEVICE)
    positives = Positives.from_partner(rows, n, self_offset=None, layout="identity")
    exclude = Exclusion(relation=Positives.from_keys(ids, ids, self_offset=None), keep_diagonal=0)
    problem = Problem(x, y, 1 / tau, Softmax(exclude=exclude, total=(1 / n, 1 / n)), positives=positives, bound=1 / tau,
                      options=Options(normalize=True))
    chosen = plan(problem)
    assert chosen.apart is not None and not chosen.one_tile
    value, _ = solve(problem)
    assert lean_calls[0] == 0
    s = torch.nn.functional.normalize(x.double().cpu(), dim=1) @ torch.nn.functional.normalize(y.double().cpu(), dim=1).T / tau
    left_out = (ids[:, None] == ids[None, :]).cpu() & ~torch.eye(n, dtype=torch.bool)
    want = (torch.logsumexp(s.masked_fill(left_out, float("-inf")), dim=1) - s.diagonal()).mean()
    assert value.item() == pytest.approx(want.item(), rel=1e-10)
