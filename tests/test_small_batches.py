"""Small batches on GPUs: host synchronisations, torch.compile, and the plain formulas the bench compares with."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_contrastive as tc
from device import DEVICE
from torch_contrastive.cli import bench_small
from torch_contrastive.cli.synccount import count_host_syncs, host_sync_events


def _cases(n: int, device: str = "cpu"):
    """(name, fn(x, y, t, validate, chunk)) for every loss and convention."""
    g = torch.Generator().manual_seed(n)
    labels = torch.randint(0, 3, (n,), generator=g).to(device)
    ids = torch.randint(0, 4, (n,), generator=g).to(device)
    pairs = torch.randint(0, n, (n, 2), generator=g).to(device)
    mask = (torch.rand(n // 2, n // 2, generator=g) > 0.5).float().to(device)
    queue = torch.randn(7, 6, generator=g).to(device)  # a constant queue / memory (D = 6 as _inputs)
    queue_labels = torch.randint(0, 3, (7,), generator=g).to(device)
    return [
        ("nt_xent_adjacent", lambda x, y, t, v, c: tc.nt_xent_loss(x, t, validate=v, chunk_size=c)),
        ("nt_xent_halves", lambda x, y, t, v, c: tc.nt_xent_loss(x, t, pairing="halves", validate=v, chunk_size=c)),
        ("nt_xent_pml", lambda x, y, t, v, c: tc.nt_xent_loss(x, t, labels=labels, validate=v, chunk_size=c)),
        ("nt_bxent_pairs", lambda x, y, t, v, c: tc.nt_bxent_loss(x, pairs, t, validate=v, chunk_size=c)),
        ("nt_bxent_labels", lambda x, y, t, v, c: tc.nt_bxent_loss(x, labels=labels, temperature=t, validate=v, chunk_size=c)),
        ("clip", lambda x, y, t, v, c: tc.image_text_contrastive_loss(x, y, t, validate=v, chunk_size=c)),
        ("clip_ids", lambda x, y, t, v, c: tc.image_text_contrastive_loss(x, y, t, ids, labels, validate=v, chunk_size=c)),
        ("siglip", lambda x, y, t, v, c: tc.siglip_loss(x, y, 1 / t, -2.0, validate=v, chunk_size=c)),
        ("siglip_ids", lambda x, y, t, v, c: tc.siglip_loss(x, y, 1 / t, t - 1.0, ids, labels, validate=v, chunk_size=c)),
        ("supcon_labels", lambda x, y, t, v, c: tc.supcon_loss(x, labels, temperature=t, validate=v, chunk_size=c)),
        ("supcon_views", lambda x, y, t, v, c: tc.supcon_loss(x.reshape(n // 2, 2, -1), temperature=t, validate=v, chunk_size=c)),
        ("supcon_mask_one", lambda x, y, t, v, c: tc.supcon_loss(x.reshape(n // 2, 2, -1), mask=mask, temperature=t,
                                                                  contrast_mode="one", validate=v, chunk_size=c)),
        ("info_nce", lambda x, y, t, v, c: tc.info_nce_loss(x, y, None, t, validate=v, chunk_size=c)),
        ("info_nce_hard", lambda x, y, t, v, c: tc.info_nce_loss(x, y, y.roll(1, 1) * 2, t, validate=v, chunk_size=c)),
        ("info_nce_queue", lambda x, y, t, v, c: tc.info_nce_loss(x, y, queue, t, in_batch_negatives=False, validate=v, chunk_size=c)),
        ("info_nce_paired", lambda x, y, t, v, c: tc.info_nce_loss(x, y, torch.stack([y.roll(1, 1), y.flip(1)], 1), t,
                                                                   negative_mode="paired", validate=v, chunk_size=c)),
        ("supcon_memory", lambda x, y, t, v, c: tc.supcon_loss(x, labels, temperature=t, memory_emb=queue,
                                                               memory_labels=queue_labels, validate=v, chunk_size=c)),
        ("nt_xent_pml_memory", lambda x, y, t, v, c: tc.nt_xent_loss(x, t, labels=labels, memory_emb=queue,
                                                                     memory_labels=queue_labels, validate=v, chunk_size=c)),
        ("info_nce_ids", lambda x, y, t, v, c: tc.info_nce_loss(x, y, queue, t, key_ids=ids, negative_ids=queue_labels,
                                                                validate=v, chunk_size=c)),
        ("info_nce_guide", lambda x, y, t, v, c: tc.info_nce_loss(x, y, queue, t, guide=(x.detach().cos(), y.detach(), queue.sin()),
                                                                  guide_margin=0.1, validate=v, chunk_size=c)),
        ("nt_xent_dcl", lambda x, y, t, v, c: tc.nt_xent_loss(x, t, pairing="halves", decoupled=True, validate=v, chunk_size=c)),
        ("clip_smooth_ids", lambda x, y, t, v, c: tc.image_text_contrastive_loss(x, y, t, ids, labels, label_smoothing=0.1,
                                                                                 validate=v, chunk_size=c)),
    ]


CASE_NAMES = [name for name, _ in _cases(8)]


def _inputs(n: int = 12, d: int = 6, device: str = "cpu"):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, d, generator=g).to(device).requires_grad_()
    y = torch.randn(n, d, generator=g).to(device).requires_grad_()
    return x, y


# ------------------------------------------------------------------ host synchronisations
@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("temperature", ["float", "tensor"])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_no_host_sync_without_validation_and_at_most_one_with_it(name, temperature, chunk):
    fn = dict(_cases(12))[name]
    x, y = _inputs()
    t = 0.2 if temperature == "float" else torch.tensor(0.2, requires_grad=True)
    events = host_sync_events(lambda: fn(x, y, t, False, chunk).backward())
    assert events == [], f"{name}: validate=False synchronised the host: {events}"
    assert count_host_syncs(lambda: fn(x, y, t, True, chunk).backward()) <= 1


def test_sync_counter_sees_host_reads():
    x = torch.randn(4, 3)
    assert host_sync_events(lambda: float(x.sum())) == ["__float__"]
    assert host_sync_events(lambda: x[x > 0]) == ["index(bool mask)"]
    assert count_host_syncs(lambda: (x.sum().tolist(), x.max().item())) == 2
    assert count_host_syncs(lambda: torch.unique(x)) >= 1


def test_validation_still_catches_bad_values_in_its_single_read():
    x, _ = _inputs()
    bad = x.detach().clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        tc.nt_xent_loss(bad, torch.tensor(0.2))
    with pytest.raises(ValueError, match="temperature must be positive"):
        tc.nt_xent_loss(x, torch.tensor(-0.2))
    with pytest.raises(ValueError, match="pos_indices must lie"):
        tc.nt_bxent_loss(x, torch.tensor([[0, 40]]), 0.2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", CASE_NAMES)
def test_cuda_no_sync_under_sync_debug_mode(name):
    fn = dict(_cases(12, "cuda"))[name]
    x, y = _inputs(device="cuda")
    t = torch.tensor(0.2, device="cuda", requires_grad=True)
    fn(x, y, t, False, None).backward()  # warm-up: lazy CUDA initialisation may synchronise
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(x, y, t, False, None).backward()
        fn(x, y, 0.2, False, 5).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ------------------------------------------------------------------ torch.compile
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_compile_fullgraph_matches_eager(name, backend):
    torch._dynamo.reset()
    fn = dict(_cases(12, DEVICE))[name]

    def loss(x, y, t):
        return fn(x, y, t, False, None)

    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    results = []
    for f in (loss, compiled):
        x, y = _inputs(device=DEVICE)
        t = torch.tensor(0.2, device=DEVICE, requires_grad=True)  # a learnable temperature: no host read even then
        value = f(x, y, t)
        value.backward()
        results.append((value.detach(), x.grad, y.grad if y.grad is not None else torch.zeros_like(y), t.grad))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the bench's plain formulas
def test_plain_formulas_equal_the_library():
    for name, (ours, plain, _) in bench_small.cases(24, 8, 0.3, torch.Generator().manual_seed(0)).items():
        assert ours(True).item() == pytest.approx(plain().item(), rel=1e-5), name


def test_small_bench_measures_ratios_and_syncs():
    rows = bench_small.measure(32, d=8, pairs=3)
    assert {r["loss"] for r in rows} == {"clip", "nt_xent halves", "supcon labels", "nt_xent labels (PML)", "nt_bxent labels"}
    for r in rows:
        assert r["value"] == pytest.approx(r["plain_value"], rel=1e-5)
        assert r["ratio"] > 0 and r["syncs_no_validate"] == 0 and r["syncs_validate"] == 1


class _OpCounter(TorchDispatchMode):
    """Counts the ATen ops a call dispatches (views included): a small call's time is its op count."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _ops(fn, leaves) -> int:
    fn().backward()  # caches (partner relations, flat places, the planner's answer) as in a training loop
    for leaf in leaves:
        leaf.grad = None
    with _OpCounter() as counter:
        fn().backward()
    return counter.ops


@pytest.mark.parametrize("name", list(bench_small.cases(8, 4, 0.1, torch.Generator())))
def test_a_small_call_runs_no_more_ops_than_the_plain_formula(name):
    """At 64 rows (one tile), forward + backward with validation dispatches no more ATen ops than the
    plain PyTorch formula it replaces (bench --small's baselines) -- counted, so it cannot flake."""
    ours, plain, leaves = bench_small.cases(64, 128, 0.1, torch.Generator().manual_seed(64))[name]
    assert _ops(lambda: ours(True), leaves) <= _ops(plain, leaves)
