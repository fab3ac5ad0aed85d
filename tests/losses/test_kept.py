"""Kept calls (losses/_kept.py): a repeated small call replayed without its set-up -- the same bits as the
full path, the full path whenever the signature or the surroundings differ, bad input still refused."""

from __future__ import annotations

import importlib
import threading

import pytest
import torch

import reference as ref
import torch_contrastive as tc
from device import DEVICE
from torch_contrastive.cli.synccount import host_sync_events
from torch_contrastive.engine import planner, softmax
from torch_contrastive.engine.torch_loops import TORCH_LOOPS
from torch_contrastive.losses import _kept

solve_module = importlib.import_module("torch_contrastive.engine.solve")
image_text = importlib.import_module("torch_contrastive.losses.image_text")


@pytest.fixture(autouse=True)
def fresh():
    """Every test starts with nothing kept (what a test before it kept is not this one's)."""
    _kept.clear()
    yield
    _kept.clear()


@pytest.fixture
def full_paths(monkeypatch):
    """How many calls ran the full path of a loss (its set-up): calls of ``solve``, the engine's one entry."""
    calls = [0]
    real = solve_module.solve

    def counted(problem):
        calls[0] += 1
        return real(problem)

    for module in ("torch_contrastive.losses.image_text", "torch_contrastive.losses.nt_xent", "torch_contrastive.losses.supcon",
                   "torch_contrastive.losses._labelled", "torch_contrastive.losses.nt_bxent"):
        monkeypatch.setattr(importlib.import_module(module), "solve", counted)
    return calls


def _rows(n, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)


CALLS = {
    "clip": (2, lambda a, b, **kw: tc.image_text_contrastive_loss(a, b, 0.1, **kw)),
    "clip alias, keywords": (2, lambda a, b, **kw: tc.clip_loss(a, b, temperature=0.07, reduction="sum", **kw)),
    "nt_xent halves": (1, lambda a, b, **kw: tc.nt_xent_loss(a, 0.2, pairing="halves", **kw)),
    "nt_xent adjacent": (1, lambda a, b, **kw: tc.nt_xent_loss(a, 0.5, **kw)),
    "module": (1, lambda a, b, **kw: tc.NTXentLoss(temperature=0.3, **kw)(a)),
}


def _run(fn, x, y, **kw):
    a, b = x.clone().requires_grad_(), y.clone().requires_grad_()
    loss = fn(a, b, **kw)
    loss.backward()
    return loss.detach(), a.grad, b.grad


@pytest.mark.parametrize("validate", [False, True])
@pytest.mark.parametrize("name", list(CALLS))
def test_a_repeated_call_is_kept_and_is_the_full_path_bit_for_bit(name, validate, full_paths):
    _, fn = CALLS[name]
    x, y = _rows(12, 5, seed=1), _rows(12, 5, seed=2)
    first = _run(fn, x, y, validate=validate)
    assert full_paths[0] == 1 and len(_kept._KEPT) == 1
    x2, y2 = _rows(12, 5, seed=3), _rows(12, 5, seed=4)  # other values, the same signature
    kept = _run(fn, x2, y2, validate=validate)
    assert full_paths[0] == 1, "the second call ran its set-up again"
    _kept.clear()
    full = _run(fn, x2, y2, validate=validate)
    assert full_paths[0] == 2
    for k, f in zip(kept, full):
        assert (k is None) == (f is None)
        if k is not None:
            assert k.dtype == f.dtype and torch.equal(k, f), name
    assert not torch.equal(first[0], kept[0])  # the kept call read its own inputs


def test_a_kept_call_equals_the_float64_formula():
    x, y = _rows(10, 4, seed=5), _rows(10, 4, seed=6)
    for _ in range(3):  # the first call keeps, the others replay
        a, b = x.clone().requires_grad_(), y.clone().requires_grad_()
        loss = tc.image_text_contrastive_loss(a, b, 0.1, validate=False)
        loss.backward()
    a64, b64 = (t.detach().double().cpu().requires_grad_() for t in (x, y))
    want = ref.image_text(a64, b64, 0.1)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=2e-6)
    torch.testing.assert_close(a.grad.double().cpu(), a64.grad, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(b.grad.double().cpu(), b64.grad, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("change", ["rows", "dtype", "requires_grad", "temperature", "reduction", "positional",
                                    "simulated", "area", "budget", "products"])
def test_a_different_signature_or_plan_state_runs_the_full_path(change, full_paths, monkeypatch):
    x = _rows(12, 5)
    call = {"tau": 0.1, "kw": {"pairing": "halves"}}
    tc.nt_xent_loss(x.clone().requires_grad_(), 0.1, pairing="halves")
    tc.nt_xent_loss(x.clone().requires_grad_(), 0.1, pairing="halves")
    assert full_paths[0] == 1
    arg = x.clone().requires_grad_()
    if change == "rows":
        arg = _rows(14, 5).requires_grad_()
    elif change == "dtype":
        arg = x.double().requires_grad_()
    elif change == "requires_grad":
        arg = x.clone()
    elif change == "temperature":
        call["tau"] = 0.2
    elif change == "reduction":
        call["kw"]["reduction"] = "sum"
    elif change == "positional":  # the same value passed by keyword: its own signature (the full path once more)
        call["kw"]["temperature"] = call.pop("tau")
    elif change == "simulated":
        monkeypatch.setattr(planner, "SIMULATING", [planner.Target("cuda", planner.GPU_BUDGET, planner.PRODUCTS)])
    elif change == "area":  # the simulated target standing for a larger problem
        monkeypatch.setattr(planner, "SIMULATING", [planner.Target(DEVICE.type, planner.GPU_BUDGET, planner.PRODUCTS, 4.0)])
    elif change == "budget":
        monkeypatch.setattr(planner, "GPU_BUDGET", planner.GPU_BUDGET // 2)
    else:
        monkeypatch.setattr(planner, "PRODUCTS", "compute" if planner.PRODUCTS != "compute" else "half")
    args = (arg, call["tau"]) if "tau" in call else (arg,)
    tc.nt_xent_loss(*args, **call["kw"])
    assert full_paths[0] == 2, change


def test_bad_input_is_refused_after_a_call_was_kept():
    x = _rows(12, 5)
    for _ in range(2):
        tc.nt_xent_loss(x, 0.1, pairing="halves", validate=False)
    assert len(_kept._KEPT) == 1
    with pytest.raises(TypeError, match="validate"):
        tc.nt_xent_loss(x, 0.1, pairing="halves", validate=0)  # == False, another type: the full path refuses it
    with pytest.raises(ValueError, match="temperature"):
        tc.nt_xent_loss(x, float("nan"), pairing="halves", validate=False)
    with pytest.raises(ValueError, match="temperature"):
        tc.nt_xent_loss(x, -0.1, pairing="halves", validate=False)
    with pytest.raises(TypeError, match="embeddings"):
        tc.nt_xent_loss(x.long(), 0.1, pairing="halves", validate=False)
    with pytest.raises(ValueError, match="even"):
        tc.nt_xent_loss(x[:11], 0.1, pairing="halves", validate=False)
    with pytest.raises(ValueError, match="pairing"):
        tc.nt_xent_loss(x, 0.1, pairing=["halves"], validate=False)  # unhashable: never kept, refused by the full path


def test_validate_reads_the_kept_loss_once_and_names_a_non_finite_input():
    x, y = _rows(12, 5, seed=1), _rows(12, 5, seed=2)
    tc.image_text_contrastive_loss(x, y, 0.1)
    assert len(_kept._KEPT) == 1 and _kept._NOT_KEPT not in _kept._KEPT.values()
    fn = lambda: tc.image_text_contrastive_loss(x, y, 0.1)  # noqa: E731
    assert len(host_sync_events(fn)) == len(host_sync_events(lambda: image_text.image_text_contrastive_loss.__wrapped__(x, y, 0.1)))
    assert len(host_sync_events(fn)) == 1
    bad = y.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="text_feat"):
        tc.image_text_contrastive_loss(x, bad, 0.1)
    tc.image_text_contrastive_loss(x, y, 0.1, validate=False)
    assert host_sync_events(lambda: tc.image_text_contrastive_loss(x, y, 0.1, validate=False)) == []


def test_calls_that_are_not_one_lean_call_run_their_full_path_every_time(full_paths):
    x = _rows(12, 5)
    for _ in range(3):
        per_row = tc.nt_xent_loss(x, 0.1, reduction="none")  # per-row values: the general executor
        several = tc.nt_xent_loss(x, 0.1, chunk_size=4)  # several tiles
    assert full_paths[0] == 6
    assert list(_kept._KEPT.values()) == [_kept._NOT_KEPT, _kept._NOT_KEPT]
    assert per_row.shape == (12,) and several.ndim == 0
    tau = torch.tensor(0.1, device=DEVICE)
    for _ in range(2):
        tc.nt_xent_loss(x, tau)  # a tensor among the other arguments, not the labels: no signature at all
    assert len(_kept._KEPT) == 2


def test_explain_autocast_and_a_replaced_executor_see_the_full_path(full_paths, monkeypatch):
    x = _rows(12, 5)
    fn = lambda: tc.nt_xent_loss(x, 0.1, pairing="halves", validate=False)  # noqa: E731
    fn()
    fn()
    assert full_paths[0] == 1
    decisions = tc.explain(fn)
    assert full_paths[0] == 2 and [d.executor for d in decisions] == ["one_tile"]
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        fn()
    assert full_paths[0] == 3
    monkeypatch.setitem(TORCH_LOOPS.forms, (tc.engine.Softmax, "one_tile"), softmax.TORCH)
    general = fn()
    assert full_paths[0] == 4
    monkeypatch.undo()
    assert torch.equal(general, fn()) and full_paths[0] == 4


def test_threads_keep_and_replay_their_own_calls():
    """The one-tile executor's notes are per thread: calls of other shapes on other threads never mix."""
    inputs = {n: _rows(n, 5, seed=n) for n in (8, 10, 12, 14)}
    want = {n: tc.nt_xent_loss.__wrapped__(x, 0.1, pairing="halves") for n, x in inputs.items()}
    got: dict[int, list[torch.Tensor]] = {n: [] for n in inputs}

    def work(n):
        for _ in range(20):
            got[n].append(tc.nt_xent_loss(inputs[n], 0.1, pairing="halves"))

    threads = [threading.Thread(target=work, args=(n,)) for n in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for n, values in got.items():
        assert len(values) == 20 and all(torch.equal(v, want[n]) for v in values), n


def test_many_signatures_start_the_kept_calls_afresh(monkeypatch):
    monkeypatch.setattr(_kept, "LIMIT", 3)
    x = _rows(12, 5)
    for tau in (0.1, 0.2, 0.3, 0.4):
        tc.nt_xent_loss(x, tau)
    assert len(_kept._KEPT) == 1  # cleared at the limit, then the fourth kept


def test_a_loss_that_changes_the_lean_result_is_not_kept():
    """Only a full path that returns the lean call's own output is kept: a loss that goes on from it (here a
    wrapper doubling NT-Xent) runs its full path every call."""

    @_kept.kept(1)
    def doubled(x, tau):
        return 2 * tc.nt_xent_loss.__wrapped__(x, tau, pairing="halves")

    x = _rows(12, 5)
    want = 2 * tc.nt_xent_loss.__wrapped__(x, 0.1, pairing="halves")
    assert torch.equal(doubled(x, 0.1), want) and torch.equal(doubled(x, 0.1), want)
    assert list(_kept._KEPT.values()) == [_kept._NOT_KEPT]


#: Label losses: a kept call rebuilds its relation and statistic from each call's labels (the loss's own functions).
LABEL_CALLS = {
    "supcon, labels by position": lambda a, y, **kw: tc.supcon_loss(a, y, temperature=0.1, **kw),
    "supcon, labels by keyword": lambda a, y, **kw: tc.supcon_loss(a, labels=y, temperature=0.3, reduction="sum", **kw),
    "supcon module": lambda a, y, **kw: tc.SupConLoss(temperature=0.2, **kw)(a, y),
    "pml nt_xent": lambda a, y, **kw: tc.nt_xent_loss(a, 0.1, labels=y, **kw),
    "nt_bxent": lambda a, y, **kw: tc.nt_bxent_loss(a, labels=y, temperature=0.2, **kw),
}


def _labels(n, classes, seed, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, classes, (n,), generator=g).to(DEVICE, dtype)


def _run_labels(fn, x, y, **kw):
    a = x.clone().requires_grad_()
    loss = fn(a, y, **kw)
    loss.backward()
    return loss.detach(), a.grad


@pytest.mark.parametrize("validate", [False, True])
@pytest.mark.parametrize("name", list(LABEL_CALLS))
def test_a_labelled_call_is_kept_with_its_relation_rebuilt_from_each_calls_labels(name, validate, full_paths):
    fn = LABEL_CALLS[name]
    x = _rows(14, 5, seed=1)
    first = _run_labels(fn, x, _labels(14, 3, seed=1), validate=validate)
    assert full_paths[0] == 1 and len(_kept._KEPT) == 1 and _kept._NOT_KEPT not in _kept._KEPT.values()
    x2, y2 = _rows(14, 5, seed=3), _labels(14, 4, seed=2)  # other values and other labels, the same signature
    kept = _run_labels(fn, x2, y2, validate=validate)
    assert full_paths[0] == 1, "the second call ran its set-up again"
    _kept.clear()
    full = _run_labels(fn, x2, y2, validate=validate)
    assert full_paths[0] == 2
    for k, f in zip(kept, full):
        assert torch.equal(k, f), name  # the same functions on the same labels: the same bits
    assert not torch.equal(first[0], kept[0])


@pytest.mark.parametrize("name", ["supcon, labels by position", "pml nt_xent", "nt_bxent"])
def test_a_kept_labelled_call_whose_relation_changes_form_runs_the_full_path(name, full_paths, monkeypatch):
    """A kept label call rebuilds its relation from each call's labels in the form its rule gives now: when the rule
    changed since the call was kept (the dense mask's limit, here), the relation is not the form the kept plan was
    made for, and the call runs its full path -- with the same values as a call never kept."""
    import torch_contrastive.positives as positives_module

    fn = LABEL_CALLS[name]
    x, y = _rows(14, 5, seed=1), _labels(14, 3, seed=1)
    _run_labels(fn, x, y)
    _run_labels(fn, x, y)
    assert full_paths[0] == 1  # kept, with a dense relation
    monkeypatch.setattr(positives_module, "DENSE_KEYS_LIMIT", 0)  # every relation grouped by key from now on
    got = _run_labels(fn, x, y)
    assert full_paths[0] == 2, "a relation of another form replayed in the kept plan"
    _kept.clear()
    want = _run_labels(fn, x, y)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_a_kept_labelled_call_equals_the_float64_formula():
    """SupCon (Khosla et al.'s SupConLoss on one view) from naive loops, the kept call on new labels."""
    x, y = _rows(10, 4, dtype=torch.float64, seed=5), _labels(10, 3, seed=5)
    tc.supcon_loss(x, y, temperature=0.5)
    x2, y2 = _rows(10, 4, dtype=torch.float64, seed=6), _labels(10, 3, seed=6)
    got = tc.supcon_loss(x2, y2, temperature=0.5)
    assert _kept._NOT_KEPT not in _kept._KEPT.values()
    z = torch.nn.functional.normalize(x2.cpu(), dim=1)
    s = z @ z.t() / 0.5
    labels = y2.cpu().tolist()
    terms = []
    for i in range(10):
        others = [j for j in range(10) if j != i]
        positives = [p for p in others if labels[p] == labels[i]]
        if not positives:
            continue
        lse = torch.logsumexp(torch.stack([s[i, j] for j in others]), 0)
        terms.append(sum(lse - s[i, p] for p in positives) / len(positives))
    want = torch.stack(terms).mean()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=1e-12)


def test_labels_that_differ_in_shape_or_dtype_or_come_with_other_tensors_take_the_full_path(full_paths):
    x = _rows(14, 5)
    fn = LABEL_CALLS["pml nt_xent"]
    fn(x, _labels(14, 3, seed=1))
    fn(x, _labels(14, 3, seed=2, dtype=torch.int32))  # another dtype: another signature (the full path converts it)
    assert full_paths[0] == 2 and len(_kept._KEPT) == 2
    with pytest.raises(ValueError, match="labels"):  # another length: refused by the full path
        fn(x, _labels(13, 3, seed=1))
    with pytest.raises(TypeError, match="labels"):
        fn(x, _labels(14, 3, seed=1).float())
    runs = full_paths[0]
    memory = (_rows(6, 5, seed=9), _labels(6, 3, seed=9))
    for _ in range(2):  # a memory: the relation is not the labels' alone
        tc.nt_xent_loss(x, 0.1, labels=_labels(14, 3, seed=1), memory_emb=memory[0], memory_labels=memory[1])
    for _ in range(2):  # a mask instead of labels: a tensor that is not the labels
        tc.supcon_loss(x, mask=torch.eye(14, dtype=torch.bool, device=DEVICE), temperature=0.1)
    assert full_paths[0] == runs + 4


def test_a_kept_labelled_call_converts_and_checks_its_labels_as_the_full_path():
    x = _rows(14, 5)
    y = _labels(14, 3, seed=1, dtype=torch.int32)
    tc.supcon_loss(x, y, temperature=0.1)
    y2 = _labels(14, 3, seed=4, dtype=torch.int32)
    kept = tc.supcon_loss(x, y2, temperature=0.1)
    _kept.clear()
    assert torch.equal(kept, tc.supcon_loss(x, y2.long(), temperature=0.1))
    tc.supcon_loss(x, y, temperature=0.1)  # kept again
    assert _kept._NOT_KEPT not in _kept._KEPT.values() and len(_kept._KEPT) == 2
    bad = x.clone()
    bad[2, 0] = float("nan")
    with pytest.raises(ValueError, match="features"):  # validate=True: the kept call's read reruns the full path
        tc.supcon_loss(bad, y, temperature=0.1)


def test_a_labelled_call_is_kept_only_when_its_relation_is_the_rebuilt_one(monkeypatch):
    """The lean call must have read the relation and statistic the noted function built: a loss that noted
    another relation (here a copy) is not kept."""
    import copy

    supcon_module = importlib.import_module("torch_contrastive.losses.supcon")
    real = supcon_module.note_rebuild
    monkeypatch.setattr(supcon_module, "note_rebuild", lambda positives, stat, fn, *bound: real(copy.copy(positives), stat, fn, *bound))
    x = _rows(14, 5)
    tc.supcon_loss(x, _labels(14, 3, seed=1), temperature=0.1)
    assert list(_kept._KEPT.values()) == [_kept._NOT_KEPT]


@pytest.mark.parametrize("name", ["supcon, labels by position", "pml nt_xent", "nt_bxent"])
def test_a_kept_labelled_call_makes_the_full_paths_host_reads(name):
    fn = LABEL_CALLS[name]
    x, y = _rows(14, 5), _labels(14, 3, seed=1)
    for validate in (True, False):
        fn(x, y, validate=validate)
        kept = host_sync_events(lambda validate=validate: fn(x, y, validate=validate))
        assert len(kept) == (1 if validate else 0), (validate, kept)
