"""GPU cost counted on a CPU: the counter against hand counts, the simulated plan, the model's fit."""

from __future__ import annotations

import contextlib
import csv
import sys

import pytest
import torch

import torch_contrastive as tc
from torch_contrastive.cli import main, traffic
from torch_contrastive.cli.cost import (
    GPUS,
    PATHS,
    WIDE,
    Counts,
    Gpu,
    fit,
    predict,
    predictions,
    terms,
)
from torch_contrastive.cli.traffic import (
    EPILOGUE_LOSSES,
    GATHERED,
    GATHERED_SHAPES,
    LOSSES,
    _Count,
    cases,
    count,
    count_gathered,
    count_loss,
    gpu_tiles,
)
from torch_contrastive.engine import planner, problem_plan
from torch_contrastive.engine.products import HalfProducts


def test_gemm_flops_and_logit_bytes_of_a_plain_product_are_counted_exactly():
    """(a @ b.T).sum() with R = 40, C = 24, D = 7: three products of 2 R C D FLOPs (forward, and
    the two gradients); the (40, 24) logits are written once and read by the sum, and the
    backward's expanded ones are read from their one stored value."""
    a = torch.randn(40, 7, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(24, 7, dtype=torch.bfloat16, requires_grad=True)
    got = count(lambda: (a @ b.t()).float().sum(), 40, 24, 7, simulate_device=None)
    assert got.gemm_flops == {"bfloat16": 3 * 2 * 40 * 24 * 7}
    logits = 40 * 24
    # mm writes bf16 logits; the cast reads them and writes fp32; the sum reads fp32; backward:
    # the fp32 gradient of the cast (expanded one: 4 bytes) -> bf16 gradient written once, read by two mms
    assert got.logit_bytes == 2 * logits + (2 + 4) * logits + 4 * logits + (4 + 2 * logits) + 2 * 2 * logits
    assert got.passes == pytest.approx(got.logit_bytes / (4 * logits))
    assert got.syncs == 0
    assert got.ops["mm"] == 3 and "t" not in got.ops and "expand" not in got.ops  # views launch nothing
    # a batch of row dot products (1 x D by D x 1) is one launch and an O(N D) pass, no GEMM work
    dots = count(lambda: torch.bmm(a.float().unsqueeze(1), b[:1].float().expand(40, 7).unsqueeze(2)).sum(), 40, 24, 7,
                 simulate_device=None)
    assert dots.ops["bmm"] == 3 and dots.gemm_flops == {}


def test_indexed_ops_count_the_entries_they_touch():
    """take / index_fill_ / index_add_ on a logit tile move the indexed entries, not the tile; a full
    op on the same tile moves all of it."""
    s = torch.randn(50, 50)
    idx = torch.arange(0, 2500, 51)  # 50 entries
    ones = torch.ones(50)
    counter = _Count(50, 50, 3)
    with counter:
        torch.take(s, idx)
        s.view(-1).index_fill_(0, idx, 0.0)
        s.view(-1).index_add_(0, idx, ones)
    assert counter.logit_bytes == 3 * 2 * 50 * 4 and counter.launches == 3
    with counter:
        s.exp_()
    assert counter.logit_bytes == 3 * 2 * 50 * 4 + 2 * 2500 * 4


def test_widening_on_a_cpu_is_not_a_gpu_cost():
    """The tensor-core products widen half operands on a CPU only: no copy is counted, and the product
    counts at the operands' own width and dtype."""
    x = torch.randn(30, 6, dtype=torch.bfloat16)
    y = torch.randn(20, 6, dtype=torch.bfloat16)
    prod = HalfProducts(x, y, x.float(), None, None, 2.0)

    def logits() -> torch.Tensor:
        return prod.logits(0, 30, 0, 20).sum().requires_grad_()

    got = count(logits, 30, 20, 6, simulate_device=None)
    assert "_to_copy" not in got.ops
    assert got.gemm_flops == {"bfloat16": 2 * 30 * 20 * 6}
    assert got.ops["mm"] == 1 and got.ops["mul_"] == 1


def test_simulate_plans_as_on_a_gpu_and_restores_the_planner():
    before = planner.GPU_BUDGET
    args = dict(kernel="softmax", rows=2048, cols=2048, device=torch.device("cpu"), dtype=torch.bfloat16,
                other_dtype=torch.bfloat16, chunk_size=None, backend="auto")
    cpu = planner.decide(**args)
    with planner.simulate("cuda", budget=2048 * 2048 * 12 // 4):
        gpu = planner.decide(**args)
        assert planner.target(torch.device("cpu")).budget == 2048 * 2048 * 12 // 4 and gpu.budget == 2048 * 2048 * 12 // 4
    assert not cpu.half and cpu.device == "cpu"
    assert gpu.half and gpu.device == "cuda" and gpu.backend == "torch" and gpu.tile == 1024  # two tiles per side
    assert planner.GPU_BUDGET == before and not planner.SIMULATING
    assert gpu_tiles(8192) == 1 and gpu_tiles(65536) > 1


def test_a_loss_on_the_simulated_plan_is_exact_and_makes_no_host_sync(monkeypatch):
    monkeypatch.setattr(planner, "PRODUCTS", "half")  # tensor-core products (the model widens a call this small)
    x = torch.randn(96, 32, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randn(96, 32, dtype=torch.bfloat16, requires_grad=True)
    with planner.simulate("cuda"):
        loss = tc.image_text_contrastive_loss(x, y, 0.07, validate=False)
    ref = tc.image_text_contrastive_loss(x.double(), y.double(), 0.07)
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-3)
    got = count(lambda: tc.image_text_contrastive_loss(x, y, 0.07, validate=False), 96, 96, 32)
    # three GEMM-equivalents, bf16 operands as given (HalfProducts): the logits and the two gradient products
    assert got.syncs == 0 and got.gemm_flops == {"bfloat16": 3 * 2 * 96 * 96 * 32}
    assert count(lambda: tc.image_text_contrastive_loss(x, y, 0.07), 96, 96, 32).syncs == 1


def test_the_model_proposes_widened_products_for_a_host_bound_call_and_the_plan_keeps_tensor_cores(monkeypatch):
    """bf16 inputs on a GPU: the model (offline, by the counted PATHS) prices the torch loops' products widened to fp32
    below tensor cores while a call is host-bound and above from where the fp32 GEMMs cost more than the launches they
    save -- a proposal for a GPU session to measure; the plan takes tensor cores at every size (the form a GPU has
    measured). No widened price while TF32 may round an fp32 GEMM."""
    bf16 = torch.bfloat16
    args = dict(kernel="softmax", cols=None, device=torch.device("cuda"), dtype=bf16, other_dtype=bf16, chunk_size=None,
                backend="torch", traits=planner.Traits(512, columns=True))

    def half(rows: int) -> bool:
        return planner.decide(**{**args, "rows": rows, "cols": rows}).half

    assert half(1024) and half(16384)
    times = dict(predictions(1024, 1024, bf16, bf16, None, args["traits"]))
    assert times[WIDE] < times["torch"]
    big = dict(predictions(16384, 16384, bf16, bf16, None, args["traits"]))
    assert big[WIDE] > big["torch"]
    before = torch.backends.cuda.matmul.allow_tf32  # (a module-like switch: set and restored by hand)
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        assert WIDE not in dict(predictions(1024, 1024, bf16, bf16, None, args["traits"]))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert "float32" not in count_loss("clip", "torch", 128, 512).gemm_flops
    monkeypatch.setattr(planner, "PRODUCTS", "compute")
    assert not half(1024)


def test_counts_scale_with_the_logits_and_keep_their_launches():
    small = count_loss("nt_xent", "torch", 256, 16)
    big = small.scaled(1024, 1024)
    assert big.launches == small.launches and big.syncs == small.syncs
    assert big.logit_bytes == 16 * small.logit_bytes and big.passes == pytest.approx(small.passes)
    assert big.gemm_flops == {dtype: 16 * flops for dtype, flops in small.gemm_flops.items()}
    assert big.bytecodes == small.bytecodes  # the host's Python does not grow with the logits
    tiled = count_loss("nt_xent", "torch", 256, 16, tiles=4)
    assert tiled.launches > small.launches  # a tile loop launches per tile


def test_the_model_adds_its_three_terms_and_the_fit_recovers_known_constants():
    truth = Gpu("toy", {"bfloat16": 1e12}, bandwidth=1.5e11, launch=4e-6, source="test")
    rows = [Counts(n, n, launches, int(passes * 4 * n * n), {"bfloat16": 6 * n * n * 64}, 0)
            for n, launches, passes in ((1024, 50, 13.0), (4096, 80, 20.0), (8192, 1600, 40.0), (2048, 30, 9.0))]
    for c in rows:
        gemm, traffic, launch = terms(c, truth)
        assert predict(c, truth) == pytest.approx(gemm + traffic + launch)
        assert traffic == pytest.approx(c.logit_bytes / 1.5e11) and launch == pytest.approx(c.launches * 4e-6)
    start = Gpu("toy", {"bfloat16": 1e12}, bandwidth=1.0, launch=1.0, source="start")
    fitted, rms = fit([(c, predict(c, truth)) for c in rows], start, peak_bandwidth=3e11)
    assert fitted.bandwidth == pytest.approx(1.5e11, rel=1e-9) and fitted.launch == pytest.approx(4e-6, rel=1e-6)
    assert rms < 1e-6
    assert "H100" in GPUS and GPUS["H100"].gemm_flops["bfloat16"] > 0


def test_the_model_takes_the_longer_of_device_and_host_and_the_host_fit_recovers_known_constants():
    """A call costs max(device, host): the host pays each eager op, each Triton launch and each Python bytecode
    (ours and the plain formula's alike); fit_host recovers those constants from host-bound rows, a bytecode
    priced as a fixed fraction of an eager op."""
    from torch_contrastive.cli.cost import fit_host, host_time

    truth = Gpu("toy", {"bfloat16": 1e12}, bandwidth=1.5e11, launch=4e-6, source="test", host_op=30e-6, host_kernel=250e-6,
                host_bytecode=30e-6 / 150)
    rows = []
    for n, eager, triton_launches, python, ours in ((256, 55, 0, 700, False), (512, 35, 0, 600, False), (256, 69, 0, 4000, True),
                                                    (512, 42, 0, 3000, True), (256, 44, 9, 6000, True), (512, 27, 5, 5000, True)):
        c = Counts(n, n, eager + triton_launches, int(4 * 4 * n * n), {"bfloat16": 6 * n * n * 64}, 0,
                   {"aten:mm": eager, **({"triton:epilogue_sums": triton_launches} if triton_launches else {})}, python)
        device = sum(terms(c, truth))
        host = eager * 30e-6 + python * 0.2e-6 + triton_launches * 250e-6
        assert host_time(c, truth) == pytest.approx(host) and host > device  # small calls: host-bound
        assert predict(c, truth) == pytest.approx(max(device, host))
        rows.append((c, host, ours))
    fitted, rms = fit_host(rows, Gpu("toy", {"bfloat16": 1e12}, 1.5e11, 4e-6, "start"), bytecodes_per_op=150)
    assert (fitted.host_op, fitted.host_kernel, fitted.host_bytecode) == pytest.approx((30e-6, 250e-6, 0.2e-6), rel=1e-9)
    assert rms < 1e-9
    big = Counts(65536, 65536, 60, 5 * 4 * 65536**2, {"bfloat16": 6 * 65536**2 * 768}, 0)
    assert predict(big, truth) == pytest.approx(sum(terms(big, truth)))  # large calls: device-bound
    with pytest.raises(ValueError, match="plain formula"):
        fit_host([r for r in rows if r[2]], truth)
    with pytest.raises(ValueError, match="Triton launches"):
        fit_host([r for r in rows if not r[0].ops.get("triton:epilogue_sums")], truth)


def test_the_bytecode_fit_recovers_an_ops_and_a_bytecodes_host_time():
    from torch_contrastive.cli.cost import fit_bytecodes

    rows = [(n, b, n * 5e-6 + b * 30e-9) for n, b in ((55, 700), (43, 2600), (35, 600), (47, 3400), (60, 900))]
    op, bytecode, rms = fit_bytecodes(rows)
    assert (op, bytecode) == pytest.approx((5e-6, 30e-9), rel=1e-9) and rms < 1e-9
    with pytest.raises(ValueError, match="in proportion"):
        fit_bytecodes([(10, 100, 1.0), (20, 200, 2.0)])


def test_python_bytecodes_are_counted_per_call_and_a_kept_plan_costs_fewer():
    """The host's Python of a call, counted: a plan looked up (a training loop's second step) runs fewer
    bytecodes than one built, and the count is the same call after call; a plain formula runs few."""
    from torch_contrastive.cli.traffic import bytecodes

    ours, dense = cases(64, 16)["clip"]
    problem_plan._PLANS.clear()
    with planner.simulate("cuda"):
        first, second, third = bytecodes(ours), bytecodes(ours), bytecodes(ours)
    assert first > second + 300 and second == third
    assert 200 < bytecodes(dense) < second


def test_bench_traffic_writes_the_counts_and_refuses_calibrate_alone(tmp_path, capsys):
    assert main(["bench", "--traffic", "--sizes", "96", "--dim", "16", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "traffic.csv") as fh:
        rows = list(csv.DictReader(fh))
    gathered = [r for r in rows if r["loss"].startswith("clip_gathered_")]  # the distributed shapes: ours, dense
    assert [(r["loss"], r["impl"], r["n"], r["syncs"], r["default"]) for r in gathered] == \
        [(f"clip_gathered_{world}", impl, str(local), syncs, default) for local, world in GATHERED_SHAPES
         for impl, syncs, default in (("torch", "1", "True"), ("dense", "0", "False"))]
    rows = [r for r in rows if r not in gathered]
    assert [r["loss"] for r in rows if r["impl"] == "torch"] == list(LOSSES) == list(cases(4, 2))
    assert [r["loss"] for r in rows if r["impl"] == "epilogue"] == list(EPILOGUE_LOSSES) == list(LOSSES)
    assert {r["impl"] for r in rows} == {"torch", "epilogue", "dense"}
    # one default per loss, the model's choice: at 96 rows every call is host-bound and the torch loops
    # launch no Triton kernel (each costs the host several eager ops)
    defaults = {r["loss"]: r["impl"] for r in rows if r["default"] == "True"}
    assert list(defaults) == list(LOSSES)
    assert set(defaults.values()) == {"torch"}
    for r in rows:
        if r["default"] == "True":  # the model's choice is its fastest counted path
            others = [float(o["predicted_ms"]) for o in rows if o["loss"] == r["loss"] and o["impl"] != "dense"]
            assert float(r["predicted_ms"]) <= min(others) * 1.01, r["loss"]
    assert all(float(r["predicted_ms"]) > 0 and int(r["syncs"]) == 0 for r in rows)
    assert "prediction" in capsys.readouterr().out
    assert main(["bench", "--calibrate", "--out", str(tmp_path)]) == 2


def test_bench_traffic_host_fits_a_bytecodes_cost_against_an_ops(tmp_path, capsys):
    """``--host`` times every loss's small call on this CPU and prints the fit (its numbers are this machine's:
    only their shape is checked); ``--host`` alone is refused like ``--calibrate``."""
    assert main(["bench", "--traffic", "--host", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bytecodes per op" in out and out.count("\n") >= 2 * len(LOSSES) + 3
    for name in LOSSES:
        assert f"\n{name} " in out
    assert main(["bench", "--host", "--out", str(tmp_path)]) == 2
    assert "--host goes with --traffic" in capsys.readouterr().err


@pytest.mark.parametrize("tiles", [1, 3])
def test_every_loss_on_the_gpu_plan_makes_no_host_sync_without_validation(tiles, monkeypatch):
    """Issue 34's sync budget, counted on the simulated GPU plan: zero host syncs with validate=False
    for every loss, one tile and strips -- the default call (the CUDA policy's pick), then the
    torch loops on tensor cores and the epilogue."""
    for name in LOSSES:
        assert count_loss(name, "ours", 48, 8, tiles=tiles).syncs == 0, name  # the policy's pick
    monkeypatch.setattr(planner, "PRODUCTS", "half")
    for name in LOSSES:
        for impl in ("torch", "epilogue"):
            got = count_loss(name, impl, 48, 8, tiles=tiles)
            assert got.syncs == 0, (name, impl)
            # the logit products take the bf16 rows on tensor cores, the pair terms' too (the CPU's widening
            # not counted; a small dense label mask may add fp32 products of its own)
            assert got.gemm_flops["bfloat16"] >= 2 * 48 * 48 * 8, (name, impl)


def test_a_label_relations_form_is_its_size_on_every_device_plan():
    """A label relation is a dense mask up to positives.DENSE_KEYS_LIMIT entries and grouped by key beyond, on the CPU
    plan and on the CUDA plan alike: the GPU's priced forms were never measured on a GPU (issue 64)."""
    from torch_contrastive.positives import DENSE_KEYS_LIMIT, Positives

    side = int(DENSE_KEYS_LIMIT**0.5)
    for simulated in (False, True):
        with planner.simulate("cuda") if simulated else contextlib.nullcontext():
            for n, dense in ((side, True), (side + 1, False), (4096, False)):
                keys = torch.arange(n) % 7
                assert (Positives.from_keys(keys).dense is not None) == dense, (simulated, n)
    with planner.simulate("cuda", area=4.0):  # a count standing for a larger call: the form is still its own size's
        assert Positives.from_keys(torch.arange(side) % 7).dense is not None


def test_a_count_standing_for_a_larger_call_holds_its_relation_in_the_same_form():
    """The counter counts a large call small: at a size whose label relation takes the large call's form (grouped
    beyond DENSE_KEYS_LIMIT, dense up to it), with no tile edge a feature side."""
    from torch_contrastive.positives import DENSE_KEYS_LIMIT

    for n in (64, 200, 256, 258, 4096, 65536):
        for at in (48, 66, 130):
            got = traffic.counted_rows(min(at, n), n, 32)
            assert got % 2 == min(at, n) % 2 and got >= min(at, n)
            assert (got * got <= DENSE_KEYS_LIMIT) == (n * n <= DENSE_KEYS_LIMIT), (n, at, got)
            assert got not in traffic.feature_sides(32)
    assert traffic.counted_rows(66, 4096, 32) == 258  # the first even size past the limit's side (256)
    # a gathered relation (world times the columns): 66 x 66 x 32 and 1,024 x 1,024 x 32 both past the limit
    assert traffic.same_relation_form(66, 1024, 32) and traffic.same_relation_form(40, 60, 16)
    assert not traffic.same_relation_form(60, 1024, 16)  # 57,600 entries: a dense mask, where the real call groups


def test_an_accumulating_product_counts_its_flops():
    acc = torch.zeros(20, 6)
    g = torch.randn(20, 30)
    b = torch.randn(30, 6)
    counter = _Count(20, 30, 6)
    with counter:
        acc.addmm_(g, b)
        torch.addmm(acc, g, b)
    assert counter.flops == {"float32": 2 * 2 * 20 * 30 * 6} and counter.launches == 2


def test_flattened_feature_rows_are_features_and_a_flattened_tile_is_a_tile():
    """A dot product over rows flattened to one vector (SupCon's positive part, engine/one_tile_half.py) reads
    features, however long the vector; a tile's diagonal is a row statistic; a flattened tile is the tile."""
    rows, tile = torch.randn(64, 6), torch.randn(64, 64)
    counter = _Count(64, 64, 6)
    with counter:
        torch.dot(rows.view(-1), rows.view(-1))  # 384 numbers: past 64 * 64 / 64, yet features
        tile.diagonal().sum()
    assert counter.logit_bytes == 0 and counter.launches == 2
    with counter:
        tile.view(-1).sum()
    assert counter.logit_bytes == 64 * 64 * 4


def test_an_announced_kernel_launch_counts_once_with_the_bytes_it_declares():
    """A Triton launch is one launch moving the logit-sized tensors it declares; the tensor work the
    interpreter does inside is not counted."""
    pytest.importorskip("triton")
    from torch_contrastive.engine.triton_backend._host import LAUNCH_LISTENERS, announced

    s = torch.randn(50, 40)
    g = torch.empty(50, 40, dtype=torch.bfloat16)
    counter = _Count(50, 40, 3)
    vector = torch.zeros(40)
    LAUNCH_LISTENERS.append(counter)
    try:
        with counter, announced("k", reads=(s,), writes=(g, vector)):
            g.copy_(s.exp() * 2)  # stands for the kernel's own work
    finally:
        LAUNCH_LISTENERS.remove(counter)
    assert counter.launches == 1 and counter.ops == {"triton:k": 1}
    assert counter.logit_bytes == 50 * 40 * (4 + 2)  # an (N,) vector is not logit-sized


@pytest.mark.parametrize("n", [8192, 32768])
@pytest.mark.parametrize("name", EPILOGUE_LOSSES)
def test_the_epilogue_path_moves_at_most_six_passes(name, n):
    """Issue 34's byte budget for the cuBLAS + epilogue path (bf16, the GPU plan at n rows, counted at 256
    and scaled): the GEMM writes a logit tile once and the epilogue reads it once; backward reads the
    kept or recomputed tile once and writes the gradient tiles once in bf16 for the GEMMs -- at most 6
    fp32 passes (the dense formula: 10 to 20), at most 1.5x the dense formula's launches (plus, for a
    label relation, the grouped form's own, which the model prefers at these sizes), no host sync.
    The planner's own tiles: one, or the epilogue's row strips (two sets, the pair terms) and squares (a single
    set's triangle). PML NT-Xent's pair terms need each row's final log-sum-exp of negatives: where a tile spans
    its rows' columns both come from one launch (``epilogue_pml_sums``). A grouped label relation's indexing adds
    ~0.03."""
    pytest.importorskip("triton")
    tiles = gpu_tiles(n, "epilogue")
    assert (tiles == 1) == (n == 8192)  # one tile kept from forward, and strips
    ours = count_loss(name, "epilogue", n, 48, at=256)
    dense = count_loss(name, "dense", n, 48, at=256)
    assert ours.passes <= 6.0 + 0.05 and ours.passes < dense.passes, (ours.passes, dense.passes)
    if name == "nt_xent_pml":
        assert "triton:epilogue_pml_sums" in ours.ops and "triton:epilogue_sums" not in ours.ops, ours.ops
    assert any(op.startswith("triton:epilogue") and op.endswith("grad") for op in ours.ops)
    assert ours.gemm_flops.keys() == {"bfloat16"}  # every product on tensor cores: no fp32 mask product at this size
    if tiles == 1:
        assert ours.launches <= 1.5 * dense.launches, (ours.launches, dense.launches)
    assert ours.syncs == 0


@pytest.mark.parametrize("key", list(PATHS))
def test_the_planners_path_costs_are_the_counted_ones(key, monkeypatch):
    """Every entry of cost.PATHS -- what the offline model prices each backend's call at -- re-counted on the
    simulated GPU plan at 256 rows (one tile, and 4 x 4 tiles for the strips and the launches per tile):
    a change to a path shows here until the table follows it. Its Python bytecodes where the table was
    counted (CPython 3.11: another version's compiler emits other bytecodes)."""
    pytest.importorskip("triton")
    kind, backend, operands = key
    # the torch loops' product scheme forced: "half" on tensor cores, "wide" widened to fp32 (else the model's choice)
    monkeypatch.setattr(planner, "PRODUCTS", {"half": "half", "wide": "compute"}.get(operands, "auto"))
    # a single set's soft-max triangle visits 10 of 16 tiles; the pair terms every tile (a positive in each)
    name, visited = {"columns": ("clip", 16), "rows": ("nt_xent", 10), "pair_softplus": ("nt_xent_pml", 16),
                     "binary": ("nt_bxent", 16)}[kind]
    dtype = torch.float32 if operands == "fp32" else torch.bfloat16
    got = []
    for chunk in (None, 64):
        ours, _ = cases(256, 48, dtype=dtype, chunk=chunk, backend=backend)[name]
        got.append(count(ours, 256, 256, 48))
    one, strips = got
    want = PATHS[key]
    unit = 2 * 256 * 256 * 48
    # what this run counted, in the table's own fields: a failure prints the entry to paste into cost.PATHS
    counted = dict(launches=one.launches, per_tile=round((strips.launches - one.launches) / (visited - 1), 1),
                   passes_one=round(one.passes, 2), passes_strips=round(strips.passes, 2),
                   gemms_one=round(sum(one.gemm_flops.values()) / unit, 2),
                   gemms_strips=round(sum(strips.gemm_flops.values()) / unit, 2), bytecodes=one.bytecodes,
                   bytecodes_per_tile=round((strips.bytecodes - one.bytecodes) / (visited - 1)))
    note = f"re-counted {key}: {counted}"
    assert counted["launches"] == pytest.approx(want.launches, abs=1), note
    assert counted["per_tile"] == pytest.approx(want.per_tile, abs=0.5), note
    assert counted["passes_one"] == pytest.approx(want.passes_one, abs=0.3), note
    assert counted["passes_strips"] == pytest.approx(want.passes_strips, abs=0.3), note
    if sys.version_info[:2] == (3, 11):
        assert one.bytecodes == pytest.approx(want.bytecodes, rel=0.1), note
        assert counted["bytecodes_per_tile"] == pytest.approx(want.bytecodes_per_tile, rel=0.15, abs=60), note
    if backend != "triton":  # the fused kernels' products are tl.dot inside them: not visible to the counter
        assert counted["gemms_one"] == pytest.approx(want.gemms_one, abs=0.01), note
        assert counted["gemms_strips"] == pytest.approx(want.gemms_strips, abs=0.01), note


def test_the_fused_kernels_constants_are_the_fit_to_the_measured_rows():
    from torch_contrastive.cli.cost import FUSED, Fused, fit_fused
    from torch_contrastive.cli.traffic import fused_calibration

    truth = Fused(rate=1e14, overhead=1e-3, source="test")
    rows = [(f, f / truth.rate + truth.overhead) for f in (1e11, 3e12, 2e13)]
    recovered, err = fit_fused(rows)
    assert recovered.rate == pytest.approx(1e14) and recovered.overhead == pytest.approx(1e-3) and err < 1e-9
    fitted, rms = fused_calibration()
    assert fitted.rate == pytest.approx(FUSED["H100"].rate, rel=0.01)
    assert fitted.overhead == pytest.approx(FUSED["H100"].overhead, rel=0.01)
    assert rms < 0.01


@pytest.mark.parametrize("name", ["supcon", "clip"])
def test_the_epilogue_backward_reads_the_positives_in_registers(name):
    """The epilogue kernels form a key or partner relation in registers and add its coefficients to the
    gradient tile: backward aggregates no relation (a grouped label relation's index_add ops, a partner's
    gathers) -- what the torch loops pay per call beyond their tiles."""
    pytest.importorskip("triton")
    from torch_contrastive.engine.triton_backend._host import LAUNCH_LISTENERS

    ours, _ = cases(256, 48, backend="epilogue")[name]
    counter = _Count(256, 256, 48)
    with planner.simulate("cuda", area=(8192 / 256) ** 2):  # a grouped label relation, as at 8,192 rows
        loss = ours()
        LAUNCH_LISTENERS.append(counter)
        try:
            with counter:
                loss.backward()
        finally:
            LAUNCH_LISTENERS.remove(counter)
    assert counter.ops["triton:epilogue_grad"] == 1
    aggregating = {"index_add", "index_add_", "index_select", "gather", "index"}
    assert not aggregating & set(counter.ops), counter.ops


def test_the_calibration_counts_the_measured_rows_as_they_ran():
    """The H100 rows were measured before two changes that are switches: counted as they ran, a kernel
    backend's one tile rebuilds its unit rows in backward (two row kernels more for two sets) and a large
    call walks square tiles (the epilogue's 16,384 rows: 2 x 2 squares, where today's plan takes 2 strips)."""
    pytest.importorskip("triton")
    from torch_contrastive.cli import traffic
    from torch_contrastive.engine import driver

    now = count_loss("clip", "epilogue", 48, 8)
    with traffic._as_measured():
        assert driver.ONE_TILE_KEEPS_ROWS is False
        then = count_loss("clip", "epilogue", 48, 8)
    assert driver.ONE_TILE_KEEPS_ROWS is True
    assert then.ops["triton:normalize_rows"] == now.ops["triton:normalize_rows"] + 2 == 4
    assert then.launches == now.launches + 2
    assert traffic._square_tiles(16384, "epilogue") == 2 and gpu_tiles(16384, "epilogue", "clip") == 2
    strips = planner.decide(kernel="softmax", rows=16384, cols=16384, device=torch.device("cuda"), dtype=torch.bfloat16,
                            other_dtype=torch.bfloat16, chunk_size=None, backend="epilogue", serves=lambda name: None,
                            traits=planner.Traits(512, columns=True))
    assert (strips.tile, strips.tile_cols) == (8192, 16384)


def test_the_distributed_shape_is_predicted_no_slower_than_open_clips_gathered_formula():
    """Issue 34's distributed shape (1,024 rows per rank against 32,768 gathered, D = 512), counted on a fake process
    group of 32 ranks: our gathered CLIP (one host read of the ranks' sizes, each input gathered in one collective)
    against open_clip's (``torch.distributed.nn.all_gather`` of every rank's features, both directions dense), the
    model's H100 time of ours no longer than the dense formula's. Both are host-bound there; at 4,096 x 65,536 (16
    ranks) ours still is, the formula bound by its device (its fp32 logits' passes)."""
    from torch_contrastive.cli.cost import host_time, predict, terms

    assert GATHERED == GATHERED_SHAPES[0] == (1024, 32)
    for local, world in GATHERED_SHAPES:  # and issue 35's 4,096 x 65,536
        ours, dense = (count_gathered(impl, local, world, 512) for impl in ("ours", "dense"))
        assert (ours.rows, ours.cols) == (dense.rows, dense.cols) == (local, local * world)
        assert ours.syncs == 1 and dense.syncs == 0
        assert set(ours.gemm_flops) == {"bfloat16"}  # the caller's half rows on tensor cores, as in one process
        assert predict(ours) <= predict(dense), (local, predict(ours), predict(dense))
        if local == GATHERED[0]:
            assert host_time(ours) >= sum(terms(ours)) and host_time(dense) >= sum(terms(dense))
