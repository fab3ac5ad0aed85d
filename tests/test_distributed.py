"""gather=True on a gloo group: global-batch values and gradients on every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import torch_contrastive as tc
from dist_helpers import run_ranks

D_IN, D = 6, 5


def _sizes(world: int, uneven: bool) -> list[int]:
    return [4 + 2 * r for r in range(world)] if uneven else [6] * world


def _global_case(case: str, sizes: list[int], seed: int = 0):
    """Inputs for every rank, and the single-process reference on the concatenation."""
    g = torch.Generator().manual_seed(seed)
    total = sum(sizes)
    views = 2 if case.startswith("supcon_views") or case == "supcon_one" else 1
    x = torch.randn(total * views, D_IN, generator=g, dtype=torch.float64)
    y = torch.randn(total, D_IN, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 3, (total,), generator=g)
    ids = torch.randint(0, 4, (total,), generator=g)
    pairs = [torch.randint(0, n, (n, 2), generator=g) for n in sizes]
    return x, y, labels, ids, pairs


def _bounds(sizes, rank):
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def _loss(case, emb, emb_y, labels, ids, pairs, gather, offsets_for_keys=None):
    """The loss of one case on the given (local or global) batch."""
    if case == "nt_xent_halves" and not gather:
        return tc.nt_xent_loss(emb, 0.3, labels=offsets_for_keys)  # one positive each: same loss as halves
    views = emb.reshape(2, -1, D).transpose(0, 1) if case in ("supcon_views", "supcon_one") else None
    calls = {
        "nt_xent_adjacent": lambda: tc.nt_xent_loss(emb, 0.3, gather=gather),
        "nt_xent_halves": lambda: tc.nt_xent_loss(emb, 0.3, pairing="halves", gather=True),
        "nt_xent_pml": lambda: tc.nt_xent_loss(emb, 0.3, labels=labels, gather=gather),
        "nt_bxent_pairs": lambda: tc.nt_bxent_loss(emb, pairs, 0.3, gather=gather),
        "nt_bxent_labels": lambda: tc.nt_bxent_loss(emb, labels=labels, temperature=0.3, gather=gather),
        "clip": lambda: tc.image_text_contrastive_loss(emb, emb_y, 0.1, gather=gather),
        "clip_ids": lambda: tc.image_text_contrastive_loss(emb, emb_y, 0.1, ids, labels, gather=gather),
        "siglip": lambda: tc.siglip_loss(emb, emb_y, 7.0, -2.0, gather=gather),
        "siglip_ids": lambda: tc.siglip_loss(emb, emb_y, 7.0, -2.0, ids, labels, gather=gather),
        "supcon_labels": lambda: tc.supcon_loss(emb, labels, temperature=0.2, gather=gather),
        "supcon_views": lambda: tc.supcon_loss(views, temperature=0.2, gather=gather),
        "supcon_one": lambda: tc.supcon_loss(views, labels, temperature=0.2, contrast_mode="one", gather=gather),
        # candidates beyond the batch: keys and pools of all ranks; paired negatives stay with their
        # query; a queue / memory is global already (same rows on every rank, not gathered)
        "info_nce": lambda: tc.info_nce_loss(emb, emb_y, None, 0.2, gather=gather),
        "info_nce_pool": lambda: tc.info_nce_loss(emb, emb_y, torch.sin(emb_y) * 2, 0.2, gather=gather),
        "info_nce_pool_only": lambda: tc.info_nce_loss(emb, emb_y, torch.sin(emb_y) * 2, 0.2, in_batch_negatives=False, gather=gather),
        "info_nce_paired": lambda: tc.info_nce_loss(emb, emb_y, torch.stack([emb_y.roll(1, 1), emb_y.cos()], 1), 0.2,
                                                    negative_mode="paired", gather=gather),
        "info_nce_queue": lambda: tc.info_nce_loss(emb, emb_y, QUEUE, 0.2, in_batch_negatives=False, gather=gather,
                                                   gather_negatives=False),
        "info_nce_keys_queue": lambda: tc.info_nce_loss(emb, emb_y, QUEUE, 0.2, gather=gather, gather_negatives=False),
        "supcon_memory": lambda: tc.supcon_loss(emb, labels, temperature=0.2, memory_emb=QUEUE, memory_labels=QUEUE_LABELS,
                                                gather=gather),
        "nt_xent_pml_memory": lambda: tc.nt_xent_loss(emb, 0.3, labels=labels, memory_emb=QUEUE, memory_labels=QUEUE_LABELS,
                                                      gather=gather),
        # false negatives and variants: ids gathered with the rows, guide rows gathered, DCL, smoothing
        "info_nce_ids": lambda: tc.info_nce_loss(emb, emb_y, torch.sin(emb_y) * 2, 0.2, key_ids=ids, negative_ids=labels,
                                                 gather=gather),
        "info_nce_guide": lambda: tc.info_nce_loss(emb, emb_y, torch.sin(emb_y) * 2, 0.2, guide=(emb.detach().cos(), emb_y.detach(),
                                                   emb_y.detach().sin()), guide_margin=0.05, gather=gather),
        "info_nce_dcl": lambda: tc.info_nce_loss(emb, emb_y, None, 0.2, decoupled=True, gather=gather),
        "info_nce_smooth": lambda: tc.info_nce_loss(emb, emb_y, torch.sin(emb_y) * 2, 0.2, label_smoothing=0.1, gather=gather),
        "clip_dcl_ids": lambda: tc.image_text_contrastive_loss(emb, emb_y, 0.1, ids, None, decoupled=True, gather=gather),
        "clip_smooth_ids": lambda: tc.image_text_contrastive_loss(emb, emb_y, 0.1, ids, labels, label_smoothing=0.2, gather=gather),
        # without ids: the text direction's positives from the engine's own columns (decoupled), or every image (smoothing)
        "clip_dcl": lambda: tc.image_text_contrastive_loss(emb, emb_y, 0.1, decoupled=True, gather=gather),
        "clip_smooth": lambda: tc.image_text_contrastive_loss(emb, emb_y, 0.1, label_smoothing=0.2, gather=gather),
        "clip_sum": lambda: tc.image_text_contrastive_loss(emb, emb_y, 0.1, reduction="sum", normalize=False, gather=gather),
        "nt_xent_dcl": lambda: tc.nt_xent_loss(emb, 0.3, decoupled=True, gather=gather),
        # a positive weight that requires grad (computed from the rows): its gradient term crosses ranks too
        "nt_xent_dcl_weight": lambda: tc.nt_xent_loss(emb, 0.3, decoupled=True, positive_weight=torch.sigmoid(emb.sum(1)),
                                                      gather=gather),
    }
    return calls[case]()


QUEUE = torch.randn(9, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
QUEUE_LABELS = torch.randint(0, 4, (9,), generator=torch.Generator().manual_seed(6))

CASES = ["nt_xent_adjacent", "nt_xent_halves", "nt_xent_pml", "nt_bxent_pairs", "nt_bxent_labels",
         "clip", "clip_ids", "siglip", "siglip_ids", "supcon_labels", "supcon_views", "supcon_one",
         "info_nce", "info_nce_pool", "info_nce_pool_only", "info_nce_paired", "info_nce_queue", "info_nce_keys_queue",
         "supcon_memory", "nt_xent_pml_memory", "info_nce_ids", "info_nce_guide", "info_nce_dcl", "info_nce_smooth",
         "clip_dcl_ids", "clip_smooth_ids", "clip_dcl", "clip_smooth", "clip_sum", "nt_xent_dcl", "nt_xent_dcl_weight"]


def _check_case(rank, world, case, sizes):
    torch.manual_seed(0)
    model_x = torch.nn.Linear(D_IN, D).double()
    model_y = torch.nn.Linear(D_IN, D).double()
    x, y, labels, ids, pairs = _global_case(case, sizes)
    lo, hi = _bounds(sizes, rank)
    total = sum(sizes)
    views = 2 if case in ("supcon_views", "supcon_one") else 1

    def rows_of(t, lo, hi):
        # Multi-view cases store view-major blocks (view 0 of all samples, then view 1).
        if views == 1:
            return t[lo:hi]
        return torch.cat([t[v * total + lo : v * total + hi] for v in range(views)])

    # Distributed: this rank's rows only.
    emb = model_x(rows_of(x, lo, hi))
    loss = _loss(case, emb, model_y(y[lo:hi]), labels[lo:hi], ids[lo:hi], pairs[rank], gather=True)
    loss.backward()
    grads = [p.grad.clone() for p in (*model_x.parameters(), *model_y.parameters()) if p.grad is not None]
    for gr in grads:  # what DDP does: average over ranks
        dist.all_reduce(gr)
        gr /= world

    # Single process on the concatenated batch, in each rank's order.
    ref_x = torch.nn.Linear(D_IN, D).double()
    ref_y = torch.nn.Linear(D_IN, D).double()
    ref_x.load_state_dict(model_x.state_dict())
    ref_y.load_state_dict(model_y.state_dict())
    order = [rows_of(x, *_bounds(sizes, r)) for r in range(world)]
    if views > 1:  # back to one view-major batch of all samples
        order = [torch.cat([o.reshape(views, -1, D_IN)[v] for o in order]) for v in range(views)]
    full = torch.cat(order)
    all_pairs = torch.cat([p + _bounds(sizes, r)[0] for r, p in enumerate(pairs)])
    halves_keys = torch.cat([torch.arange(n) % (n // 2) + _bounds(sizes, r)[0] for r, n in enumerate(sizes)])
    ref = _loss(case, ref_x(full), ref_y(y), labels, ids, all_pairs, gather=False, offsets_for_keys=halves_keys)
    ref.backward()
    ref_grads = [p.grad for p in (*ref_x.parameters(), *ref_y.parameters()) if p.grad is not None]
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-9, atol=1e-12, msg=f"{case} value on rank {rank}")
    assert len(grads) == len(ref_grads)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=f"{case} gradient on rank {rank}")


def _all_cases(rank, world, sizes):
    for case in CASES:
        _check_case(rank, world, case, sizes)


@pytest.mark.parametrize("world,uneven", [(2, False), (2, True), (4, False), (4, True)])
def test_every_loss_matches_single_process(world, uneven):
    run_ranks(_all_cases, world, _sizes(world, uneven), timeout=300)


def _mismatch(rank, world, what):
    dim = 4 + rank if what == "dim" else 4
    dtype = torch.float64 if (what == "dtype" and rank == 1) else torch.float32
    x = torch.randn(6, dim, dtype=dtype)
    labels = torch.arange(6) % 2 if (what != "labels" or rank == 0) else None
    with pytest.raises(ValueError, match="ranks disagree"):
        if labels is None:
            tc.nt_xent_loss(x, gather=True)
        else:
            tc.nt_xent_loss(x, labels=labels, gather=True)


@pytest.mark.parametrize("what", ["dim", "dtype", "labels"])
def test_rank_mismatch_is_a_clear_error(what):
    run_ranks(_mismatch, 2, what, timeout=60)


def _gather_with_grad(rank, world, sizes):
    x = (torch.arange(sizes[rank] * 3, dtype=torch.float64).reshape(-1, 3) + 100 * rank).requires_grad_()
    out = tc.all_gather_with_grad(x)
    expected = torch.cat([torch.arange(n * 3, dtype=torch.float64).reshape(-1, 3) + 100 * r for r, n in enumerate(sizes)])
    assert torch.equal(out.detach(), expected)
    # Each rank weighs every gathered row by (rank + 1) * row index; this rank's rows must
    # receive the sum of those weights over all ranks.
    weight = torch.arange(expected.shape[0], dtype=torch.float64)[:, None].expand(-1, 3)
    (out * weight * (rank + 1)).sum().backward()
    lo, hi = _bounds(sizes, rank)
    total_factor = sum(r + 1 for r in range(world))
    torch.testing.assert_close(x.grad, weight[lo:hi] * total_factor, rtol=0, atol=0)


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_with_grad_sums_gradients_over_ranks(world):
    run_ranks(_gather_with_grad, world, [2 + r for r in range(world)], timeout=60)


def test_all_gather_with_grad_without_group_is_identity():
    x = torch.randn(3, 2)
    assert tc.all_gather_with_grad(x) is x


def _bad_input_on_one_rank(rank, world):
    x = torch.randn(6, 4)
    if rank == 1:
        x[2, 1] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        tc.nt_xent_loss(x, gather=True)
    # The group is still usable afterwards: nobody was left waiting in a collective.
    assert torch.isfinite(tc.nt_xent_loss(torch.randn(6, 4), gather=True))


def test_bad_input_on_one_rank_raises_on_every_rank():
    run_ranks(_bad_input_on_one_rank, 2, timeout=60)


def _ddp_training(rank, world, steps, batches, grad_reduction):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, 8), torch.nn.Tanh(), torch.nn.Linear(8, D)).double()
    reference = torch.nn.Sequential(torch.nn.Linear(D_IN, 8), torch.nn.Tanh(), torch.nn.Linear(8, D)).double()
    reference.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    loss_fn = tc.SupConLoss(0.2, gather=True, grad_reduction=grad_reduction)
    for step in range(steps):
        xb, lb = batches[step]
        per = xb.shape[0] // world
        opt.zero_grad()
        loss = loss_fn(ddp(xb[rank * per : (rank + 1) * per]), lb[rank * per : (rank + 1) * per])
        loss.backward()
        if grad_reduction == "sum":  # a framework that sums gradients instead of DDP's mean
            for p in model.parameters():
                p.grad *= world
        opt.step()
        ref_opt.zero_grad()
        tc.SupConLoss(0.2)(reference(xb), lb).backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("grad_reduction", ["mean", "sum"])
def test_real_ddp_training_matches_single_process(grad_reduction):
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(12, D_IN, generator=g, dtype=torch.float64), torch.randint(0, 3, (12,), generator=g)) for _ in range(4)]
    run_ranks(_ddp_training, 2, 4, batches, grad_reduction, timeout=120)


def test_without_process_group_gather_is_local():
    x = torch.randn(8, 4)
    assert tc.nt_xent_loss(x, gather=True).item() == tc.nt_xent_loss(x).item()


def test_example_script_under_torchrun(tmp_path):
    script = Path(__file__).resolve().parents[1] / "examples" / "ddp_simclr.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script), "--steps", "3", "--check"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "matches single-process" in out.stdout


def test_train_command_under_torchrun(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "torch_contrastive", "train", "--distributed", "--loss", "supcon", "--epochs", "2",
                          "--quiet", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["config"]["distributed"] and metrics["loss_history"][-1] < metrics["loss_history"][0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")
def test_train_command_under_torchrun_on_the_gpu(tmp_path):
    """Each rank on its local GPU with NCCL (the crash of 'No backend type associated with
    device type cpu' when NCCL met CPU tensors)."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                          "-m", "torch_contrastive", "train", "--distributed", "--device", "cuda", "--loss", "supcon",
                          "--epochs", "2", "--quiet", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["config"]["device"] == "cuda" and metrics["loss_history"][-1] < metrics["loss_history"][0]


def _queue_push_gather(rank, world, sizes):
    """push(gather=True): every rank holds the same rows (rank order), sizes may differ."""
    queue = tc.FeatureQueue(sum(sizes) + 3)
    rows = torch.full((sizes[rank], 2), float(rank)) + torch.arange(sizes[rank])[:, None]
    queue.push(rows, torch.full((sizes[rank],), 10**15 + rank), gather=True)  # ids beyond float precision stay exact
    expected = torch.cat([torch.full((n, 2), float(r)) + torch.arange(n)[:, None] for r, n in enumerate(sizes)])
    assert len(queue) == sum(sizes)
    assert torch.equal(queue.features, expected)
    assert queue.labels.tolist() == [10**15 + r for r, n in enumerate(sizes) for _ in range(n)]
    local = tc.FeatureQueue(8)
    local.push(rows)  # without gather: this rank's rows only
    assert len(local) == sizes[rank]


@pytest.mark.parametrize("world", [2, 3])
def test_queue_push_gather_keeps_ranks_identical(world):
    run_ranks(_queue_push_gather, world, [1 + r for r in range(world)])


def _local_warning(rank, world):
    import warnings

    x = torch.randn(6, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tc.nt_xent_loss(x, 0.3)
        tc.supcon_loss(x, torch.arange(6) % 2)  # once per process
        tc.nt_xent_loss(x, 0.3, gather=True)
    local = [w for w in caught if "gather=False" in str(w.message)]
    assert len(local) == 1 and "only sees its local negatives" in str(local[0].message)


def test_gather_false_under_a_process_group_warns_once():
    run_ranks(_local_warning, 2)


@pytest.mark.parametrize("loss", ["clip", "nt_xent", "supcon"])
def test_a_gathered_call_reads_the_ranks_sizes_once_and_its_launches_do_not_grow_with_the_ranks(loss):
    """Counted on a fake process group (collectives that move nothing, the c10d Python as on a real one): a gathered
    call with ``validate=False`` reads every rank's row counts once (one host synchronisation: ranks may hold
    different numbers of rows) -- not once per rank -- and gathers each input in one collective, so its launches are
    the same at 4 ranks and at 32."""
    fake = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch_contrastive.cli.traffic import count

    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(8, D, generator=g).requires_grad_() for _ in range(2))
    labels = torch.arange(8) % 3
    call = {"clip": lambda: tc.image_text_contrastive_loss(x, y, 0.1, gather=True, validate=False),
            "nt_xent": lambda: tc.nt_xent_loss(x, 0.1, gather=True, validate=False),
            "supcon": lambda: tc.supcon_loss(x, labels, temperature=0.1, gather=True, validate=False)}[loss]
    counted = {}
    for world in (4, 32):
        dist.init_process_group("fake", store=fake.FakeStore(), rank=1, world_size=world)
        try:
            counted[world] = count(call, 8, 8 * world, D, simulate_device=None)
        finally:
            dist.destroy_process_group()
    assert counted[4].syncs == counted[32].syncs == 1, (counted[4].syncs, counted[32].syncs)
    assert counted[4].launches == counted[32].launches, (counted[4].ops, counted[32].ops)


def test_equal_batches_are_gathered_in_one_collective_and_uneven_ones_padded():
    """``gather_padded``: equal sizes gather straight into the result (the collective and its output, nothing
    else); uneven sizes pad, gather and leave the padding out (the rows in rank order, checked on two gloo
    ranks by the tests above)."""
    fake = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.utils._python_dispatch import TorchDispatchMode

    from torch_contrastive.distributed import gather_padded

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    dist.init_process_group("fake", store=fake.FakeStore(), rank=0, world_size=4)
    try:
        x = torch.randn(3, 2)
        with Ops() as equal:
            out = gather_padded(x, [3, 3, 3, 3])
        with Ops() as uneven:
            ragged = gather_padded(x, [3, 1, 3, 2])
    finally:
        dist.destroy_process_group()
    assert out.shape == (12, 2) and ragged.shape == (9, 2)
    assert len(equal.names) == 2 and "empty" in equal.names[0], equal.names
    assert any(name.startswith("cat") for name in uneven.names), uneven.names


def _clip_half_ranks(rank, world, with_ids):
    """One rank of bf16 CLIP on the tensor-core product scheme (the GPU's, widened to the same numbers here): the
    caller's half rows gathered as given, normalised inside by fp32 factors, the gathered rows' gradients summed
    over the ranks in fp32 -- against the float64 formula on the whole batch."""
    from reference import image_text
    from torch_contrastive.engine import planner

    planner.PRODUCTS = "half"
    g = torch.Generator().manual_seed(3)
    n, d, tau = 6, 16, 0.05
    x, y = (torch.randn(world * n, d, generator=g).bfloat16() for _ in range(2))
    ids = torch.arange(world * n) % 4 if with_ids else None
    mine = slice(rank * n, rank * n + n)
    xa, ya = x[mine].clone().requires_grad_(), y[mine].clone().requires_grad_()
    local_ids = None if ids is None else ids[mine]

    def call(a, b):
        return tc.image_text_contrastive_loss(a, b, tau, local_ids, local_ids, gather=True, grad_reduction="sum")

    (decision,) = tc.explain(call, xa, ya)
    assert decision.half, str(decision)  # the tensor-core scheme, not fp32 rows
    loss = call(xa, ya)
    loss.backward()
    xr, yr = x.double().requires_grad_(), y.double().requires_grad_()
    ref = image_text(xr, yr, tau, ids, ids)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    for ours, want in ((xa.grad, xr.grad[mine]), (ya.grad, yr.grad[mine])):
        assert ours.dtype == torch.bfloat16
        scale = yr.grad.abs().max().item() + xr.grad.abs().max().item()
        torch.testing.assert_close(ours.double(), want, rtol=1e-2, atol=1e-2 * scale)


@pytest.mark.parametrize("with_ids", [False, True])
def test_gathered_bf16_clip_on_tensor_core_products_equals_the_float64_formula(with_ids):
    run_ranks(_clip_half_ranks, 2, with_ids, timeout=120)


def _single_set_half_ranks(rank, world):
    """One rank of bf16 NT-Xent (labels: PML's convention) and SupCon on the tensor-core scheme: the caller's half
    rows gathered as given and normalised inside -- against the float64 formulas on the whole batch."""
    from reference import nt_xent_pml, supcon
    from torch_contrastive.engine import planner

    planner.PRODUCTS = "half"
    g = torch.Generator().manual_seed(4)
    n, d, tau = 6, 16, 0.1
    x = torch.randn(world * n, d, generator=g).bfloat16()
    labels = torch.arange(world * n) % 4
    mine = slice(rank * n, rank * n + n)
    calls = {"supcon": (lambda a: tc.supcon_loss(a, labels[mine], temperature=tau, gather=True, grad_reduction="sum"),
                        lambda a: supcon(a, tau, labels=labels)),
             "nt_xent_pml": (lambda a: tc.nt_xent_loss(a, tau, labels=labels[mine], gather=True, grad_reduction="sum"),
                             lambda a: nt_xent_pml(a, labels, tau))}
    for name, (ours_fn, ref_fn) in calls.items():
        xa = x[mine].clone().requires_grad_()
        (decision,) = tc.explain(ours_fn, xa)
        assert decision.half, (name, str(decision))
        loss = ours_fn(xa)
        loss.backward()
        xr = x.double().requires_grad_()
        ref = ref_fn(xr)
        ref.backward()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5), name
        assert xa.grad.dtype == torch.bfloat16
        torch.testing.assert_close(xa.grad.double(), xr.grad[mine], rtol=1e-2, atol=1e-2 * xr.grad.abs().max().item())


def test_gathered_bf16_single_sets_on_tensor_core_products_equal_the_float64_formulas():
    run_ranks(_single_set_half_ranks, 2, timeout=120)
