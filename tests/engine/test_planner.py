"""The planner (engine/planner.py): its decisions per device without running a kernel, and the
tensor-core products (engine/products.py) against float64 references on any device."""

from __future__ import annotations

import pytest
import torch

import torch_contrastive as tc
from device import DEVICE
from helpers import DTYPES, compare
from reference import image_text, info_nce, nt_bxent, nt_xent, nt_xent_pml, supcon
from torch_contrastive.engine import planner, problem_plan

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


def _decide(device, dtype, n, m=None, **kw):
    args = {"kernel": "softmax", "rows": n, "cols": n if m is None else m, "device": device, "dtype": dtype,
            "other_dtype": dtype, "chunk_size": None, "backend": "auto", "fixed": True}
    return planner.decide(**{**args, **kw})


def test_cpu_keeps_cache_sized_tiles_and_compute_dtype_products():
    small, large = _decide(CPU, torch.float32, 512), _decide(CPU, torch.bfloat16, 16384)
    assert (small.backend, small.tile, small.half) == ("torch", 0, False)
    assert (large.backend, large.tile, large.half) == ("torch", 1024, False)  # half inputs are widened on a CPU


def test_cuda_half_inputs_go_to_tensor_cores_with_budget_sized_tiles():
    one = _decide(CUDA, torch.bfloat16, 8192)
    assert one.backend == "torch" and one.half and one.tile == 0  # 8192^2 * 12 B = 768 MiB fits the 1 GiB budget
    big = _decide(CUDA, torch.float16, 65536, backend="torch")
    assert big.half and big.tile == 9216  # sqrt(2^30 / 12) = 9459, down to a multiple of 256
    assert big.tile * big.tile * 12 <= planner.GPU_BUDGET
    fp32 = _decide(CUDA, torch.float32, 65536)
    assert not fp32.half and fp32.tile == 11520  # two fp32 buffers: sqrt(2^27) = 11585
    mixed = _decide(CUDA, torch.bfloat16, 100, other_dtype=torch.float16)
    assert not mixed.half  # one dtype for both operands, or none on tensor cores


def test_budget_and_chunk_size_override_the_plan(monkeypatch):
    monkeypatch.setattr(planner, "GPU_BUDGET", 64 * 2**20)
    assert _decide(CUDA, torch.bfloat16, 8192).tile == 2304  # sqrt(64 MiB / 12) = 2364
    assert _decide(CUDA, torch.bfloat16, 8192, chunk_size=500).tile == 500


def _problem(n=512, dtype=torch.float32, chunk_size=None, backend="auto", kernel=None, normalize=True):
    """A soft-max (or, with ``kernel``, a pair) problem of one set's ``n`` rows, labelled by 4 keys."""
    from torch_contrastive.engine import Options, PairTerms, Problem, Softmax
    from torch_contrastive.positives import Positives

    x = torch.randn(n, 8, dtype=dtype, device=DEVICE)
    keys = torch.arange(n, device=DEVICE) % 4
    stat = Softmax() if kernel is None else PairTerms(kernel)
    return Problem(x, x, 10.0, stat, positives=Positives.from_keys(keys, self_offset=0), self_offset=0,
                   symmetric=True, bound=10.0, options=Options(normalize, 1e-12, chunk_size, backend))


def test_a_kept_plan_answers_the_same_question_only():
    """The engine keeps one plan per key (a training loop asks the same question every step). Walked over what a
    plan is decided from -- the shape, the dtype, the tile, the backend, the statistic, the options and the
    :class:`~torch_contrastive.engine.planner.Target` (a simulated device, its scratch budget, the area a counted
    problem stands for) -- each variant is planned anew, and its kept plan is the one a cleared cache computes
    afresh; the same question is a look-up."""
    problem_plan._PLANS.clear()
    base = problem_plan.plan(_problem())
    problem_plan.plan(_problem())
    assert len(problem_plan._PLANS) == 1  # kept (by the relation's shape: each call's relation is put in)
    variants = {
        "rows": lambda: _problem(n=520), "dtype": lambda: _problem(dtype=torch.float64),
        "tile": lambda: _problem(chunk_size=16), "pairs": lambda: _problem(kernel="binary"),
        "normalize": lambda: _problem(normalize=False),
    }
    targets = {"cuda": planner.Target("cuda", planner.GPU_BUDGET, planner.PRODUCTS),
               "budget": planner.Target("cuda", 256 * 256 * 8, planner.PRODUCTS),  # 2 x 2 tiles of 256
               "area": planner.Target("cuda", 256 * 256 * 8, planner.PRODUCTS, 16.0)}  # as at 2,048 rows: 8 x 8
    seen = {"base": base}
    for name, make in variants.items():
        seen[name] = problem_plan.plan(make())
    for name, on in targets.items():
        with planner.simulate(on):
            seen[name] = problem_plan.plan(_problem())
            problem_plan.plan(_problem())  # its own kept plan, under its own key
    assert len(problem_plan._PLANS) == len(seen)  # every variant a plan of its own, each kept once
    assert seen["tile"].tile == 16 and seen["budget"].tile == 256 and seen["area"].tile == 64 and base.tile == 0
    assert seen["cuda"].decision.device == "cuda" and base.decision.device == DEVICE.type
    problem_plan._PLANS.clear()
    fresh = {name: problem_plan.plan(make()) for name, make in variants.items()}
    for name, on in targets.items():
        with planner.simulate(on):
            fresh[name] = problem_plan.plan(_problem())
    for name, got in fresh.items():
        assert got.with_relation(None) == seen[name].with_relation(None), name


def test_simulate_rebinds_nothing_and_nests():
    """:func:`~torch_contrastive.engine.planner.simulate` pushes a device description and pops it: the planner's
    module globals are the same objects inside, and nested simulations plan for the innermost."""
    before = dict(vars(planner))
    with planner.simulate("cuda", budget=1 << 20) as outer:
        assert planner.target(CPU) == outer == planner.Target("cuda", 1 << 20, planner.PRODUCTS)
        with planner.simulate(planner.Target("cpu", 1, "compute")) as inner:
            assert planner.target(CPU) is inner
            inside = {name: value for name, value in vars(planner).items() if value is not before.get(name)}
        assert planner.target(CPU) is outer
    assert planner.target(CPU) == planner.Target("cpu", planner.GPU_BUDGET, planner.PRODUCTS)
    assert inside == {} and not planner.SIMULATING
    with pytest.raises(ValueError, match="inside the Target"):
        with planner.simulate(planner.Target("cuda", 1, "auto"), budget=2):
            pass


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_the_bounded_algorithm_is_the_planners_choice_from_the_losss_bound(device):
    """A loss states |S| <= bound (unit rows, a host-known scale); the planner picks the one-exp
    algorithm exactly where it cannot overflow for the dtype (fp32: bound 40, fp64: 340)."""
    def fixed(dtype, bound):
        return _decide(device, dtype, 64, fixed=False, bound=bound).fixed

    assert fixed(torch.float32, 1 / 0.07) and fixed(torch.bfloat16, 40.0) and fixed(torch.float64, 340.0)
    assert not fixed(torch.float32, 40.5) and not fixed(torch.float16, 100.0) and fixed(torch.float64, 100.0)
    assert not fixed(torch.float64, 341.0) and not fixed(torch.float32, None)  # no promise: the online maximum
    assert _decide(device, torch.float32, 64, fixed=True, bound=None).fixed  # forced by the caller (tests)
    x = torch.randn(32, 8, device=DEVICE)
    assert [d.fixed for d in tc.explain(tc.clip_loss, x, x.flip(0), 0.07)] == [True]
    assert [d.fixed for d in tc.explain(tc.clip_loss, x, x.flip(0), 0.01)] == [False]  # 1 / 0.01 > 40
    assert [d.fixed for d in tc.explain(tc.clip_loss, x, x.flip(0), 0.07, normalize=False)] == [False]  # rows not unit


def test_the_kernels_take_half_rows_as_given_only_on_triton():
    assert _decide(CUDA, torch.bfloat16, 64, backend="triton").operand_dtype == torch.bfloat16
    assert _decide(CUDA, torch.float16, 64, backend="triton").operand_dtype == torch.float16
    assert _decide(CUDA, torch.float32, 64, backend="triton").operand_dtype is None
    assert _decide(CUDA, torch.bfloat16, 64, backend="triton", other_dtype=torch.float16).operand_dtype is None
    assert _decide(CUDA, torch.bfloat16, 64, backend="torch").operand_dtype is None  # torch: HalfProducts instead


def test_label_sorting_and_reductions_inside_are_planner_decisions():
    """The label sort's tile is the plan's: the torch loops' tile when the batch spans several, else 0 (one tile);
    a reduction moves inside the engine on one process only."""
    from torch_contrastive.engine import Options, PairTerms, Problem, label_sort_tile, plan
    from torch_contrastive.positives import Positives

    def labelled(n, **options):
        x = torch.randn(n, 4)
        labels = torch.arange(n) % 7
        return Problem(x, x, 2.0, PairTerms("binary"), positives=Positives.from_keys(labels, self_offset=0), self_offset=0,
                       options=Options(True, **options))

    assert label_sort_tile(labelled(4096)) == 1024  # a CPU's cache-sized tiles
    assert label_sort_tile(labelled(1024)) == 0  # one tile: nothing to skip
    assert label_sort_tile(labelled(40, chunk_size=4)) == 4
    with planner.simulate("cuda", budget=12 * 768 * 768):  # bf16 on tensor cores: 12 bytes a logit
        x = torch.randn(2048, 4).bfloat16()
        bf16 = Problem(x, x, 2.0, PairTerms("binary"), positives=Positives.from_keys(torch.arange(2048) % 7, self_offset=0),
                       self_offset=0, bound=2.0, options=Options(True, backend="torch"))
        assert label_sort_tile(bf16) == plan(bf16).tile == 768
    assert tc.explain(label_sort_tile, labelled(4096)) == []  # a question, not an engine call
    assert planner.reduce_inside("mean", False) and planner.reduce_inside("sum", False)
    assert not planner.reduce_inside("none", False) and not planner.reduce_inside("mean", True)


def _problems(device):
    """One problem per statistic, built as a loss builds it."""
    from torch_contrastive.engine import Options, PairTerms, Problem, SigmoidPairs, Softmax
    from torch_contrastive.positives import Positives

    x = torch.randn(24, 8, device=device)
    y = torch.randn(24, 8, device=device)
    labels = torch.arange(24, device=device) % 5
    partner = Positives.from_partner(torch.arange(24, device=device), 24, self_offset=None)
    return {
        "softmax": Problem(x, y, 10.0, Softmax(columns=True), positives=partner, bound=10.0, options=Options(True)),
        "pairs": Problem(x, x, 2.0, PairTerms("binary"), positives=Positives.from_keys(labels), self_offset=0,
                         options=Options(True, chunk_size=7)),
        "sigmoid": Problem(x, y, 10.0, SigmoidPairs(-10.0, 0), positives=partner, options=Options(True)),
    }


@pytest.mark.parametrize("statistic", ["softmax", "pairs", "sigmoid"])
def test_plan_says_what_solve_runs(statistic):
    """A problem is planned without running anything, and that plan is the one solve() runs."""
    from torch_contrastive.engine import plan, solve

    problem = _problems(DEVICE)[statistic]
    from torch_contrastive.engine.plans import PairPlan, SigmoidPlan, SoftmaxPlan

    decided = plan(problem)
    assert type(decided) is {"softmax": SoftmaxPlan, "pairs": PairPlan, "sigmoid": SigmoidPlan}[statistic]
    assert tc.explain(solve, problem) == [decided.decision]
    assert str(decided) == str(decided.decision)
    assert decided.decision.kernel == {"softmax": "softmax", "pairs": "pairwise", "sigmoid": "sigmoid"}[statistic]
    assert not decided.half  # fp32 rows: no half-precision products on any device
    assert (decided.tile == 7) == (statistic == "pairs")  # the problem's chunk_size reaches the plan
    assert decided.fixed == (statistic == "softmax")  # only the soft-max problem promised a bound


def test_the_plan_holds_every_statistic_decision():
    """What the executors used to re-derive is decided once, in the plan."""
    from torch_contrastive.engine import LabelRanges, Options, PairTerms, Problem, Softmax, plan
    from torch_contrastive.positives import Positives

    x, y = torch.randn(8, 4, device=DEVICE), torch.randn(8, 4, device=DEVICE)
    w = torch.rand(8, device=DEVICE)
    identity = Positives.from_partner(torch.arange(8, device=DEVICE), 8, self_offset=None, layout="identity")
    clip = Softmax(row_weights=(w, None), columns=True, columns_share_alpha=True)
    one_tile = plan(Problem(x, y, 2.0, clip, positives=identity, grad_columns=5, options=Options(True, backend="torch")))
    assert one_tile.tile_positives and one_tile.shared_alpha and one_tile.columns and one_tile.column_positives
    assert one_tile.grad_columns == 5 and one_tile.apart is not None and one_tile.apart.kind == "shift"
    tiled = plan(Problem(x, y, 2.0, clip, positives=identity, grad_columns=99, options=Options(True, chunk_size=3, backend="torch")))
    assert not tiled.tile_positives and tiled.tile == 3 and tiled.grad_columns == 8  # clamped to the candidates
    unweighted = plan(Problem(x, y, 2.0, Softmax(columns=True, columns_share_alpha=True), positives=identity,
                               options=Options(backend="torch")))
    assert not unweighted.shared_alpha and unweighted.grad_columns == 8

    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2], device=DEVICE)
    by_label = Positives.from_keys(labels, self_offset=0)
    blocks = ((0.0, 0.0), (0.0, 1.0), (2.0, 2.0))
    ranges = LabelRanges(3, blocks, blocks)
    pairs = plan(Problem(x, x, 2.0, PairTerms("binary", label_ranges=ranges), positives=by_label, self_offset=0,
                         options=Options(True, chunk_size=3)))
    assert pairs.mixed == ((True, True, False), (True, True, False), (False, False, True))
    assert pairs.symmetric and pairs.is_mixed(3, 0) and not pairs.is_mixed(6, 3)
    # PML's per-pair terms walk the triangle only in the bounded regime (one exp serves both blocks)
    online = plan(Problem(x, x, 2.0, PairTerms("pair_softplus", label_ranges=ranges), positives=by_label, self_offset=0,
                          options=Options(True, chunk_size=3)))
    assert online.mixed is not None and not online.fixed and not online.symmetric
    whole = plan(Problem(x, x, 2.0, PairTerms("binary", label_ranges=ranges), positives=by_label, self_offset=0))
    assert whole.mixed is None and not whole.symmetric  # one tile: nothing to skip


def test_label_ranges_are_read_at_the_plans_tile_and_never_narrower_than_the_labels():
    """Ranges read at one step serve any tile: exact where the tile covers whole blocks, wider otherwise -- a tile
    is never taken for all-negative while it holds two rows of one label."""
    from torch_contrastive.engine import LabelRanges, Options, PairTerms, Problem, tile_label_bounds
    from torch_contrastive.positives import Positives

    g = torch.Generator().manual_seed(4)
    for n, classes in ((37, 5), (64, 3), (50, 50)):
        labels = torch.sort(torch.randint(0, classes, (n,), generator=g)).values
        for step in (1, 3, 4, 8, 13, n):
            values = tile_label_bounds(labels, step).tolist()
            blocks = tuple((values[2 * i], values[2 * i + 1]) for i in range(len(values) // 2))
            ranges = LabelRanges(step, blocks, blocks)
            for tile in (2, 3, 4, 5, 8, 16, n):
                mixed = ranges.over(tile, n, n)
                starts = range(0, n, tile)
                assert len(mixed) == len(starts) and all(len(row) == len(starts) for row in mixed)
                for i, r0 in enumerate(starts):
                    for j, c0 in enumerate(starts):
                        shares = bool(set(labels[r0 : r0 + tile].tolist()) & set(labels[c0 : c0 + tile].tolist()))
                        assert mixed[i][j] or not shares, (n, step, tile, i, j)  # never a positive skipped
                        if tile % step == 0 or tile >= n:  # whole blocks: the exact answer
                            assert mixed[i][j] == shares, (n, step, tile, i, j)
    x = torch.randn(10, 4)
    keys = Positives.from_keys(torch.arange(10) % 3, self_offset=0)
    short = LabelRanges(4, ((0.0, 1.0),) * 2, ((0.0, 1.0),) * 2)  # 8 rows' blocks for 10
    with pytest.raises(ValueError, match="do not cover 10 x 10"):
        Problem(x, x, 2.0, PairTerms("binary", label_ranges=short), positives=keys, self_offset=0, options=Options(True))
    with pytest.raises(TypeError, match="LabelRanges"):
        PairTerms("binary", label_ranges=([(0.0, 1.0)], [(0.0, 1.0)]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step"):
        LabelRanges(0, (), ())


def test_a_problem_is_immutable_and_checked():
    import dataclasses

    from torch_contrastive.engine import Options, PairTerms, Problem, Softmax
    from torch_contrastive.positives import Exclusion, Positives

    problem = _problems(DEVICE)["softmax"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        problem.bound = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        problem.options.backend = "triton"  # type: ignore[misc]
    x = torch.randn(6, 4, device=DEVICE)
    with pytest.raises(ValueError, match=r"Softmax\(columns=True\) needs self_offset=None"):
        Problem(x, x, 1.0, Softmax(columns=True), self_offset=0)
    with pytest.raises(ValueError, match="symmetric=True needs candidates equal to anchors"):
        Problem(x, x[:5], 1.0, Softmax(), self_offset=0, symmetric=True)
    relation = Positives.from_keys(torch.arange(6, device=DEVICE) % 2)
    with pytest.raises(ValueError, match="symmetric exclusion"):
        Problem(x, x, 1.0, Softmax(exclude=Exclusion(relation=relation)), self_offset=0, symmetric=True)
    with pytest.raises(ValueError, match="PairTerms: self_offset None disagrees with the positives' 0"):
        Problem(x, x, 1.0, PairTerms("binary"), positives=relation)
    with pytest.raises(ValueError, match="PairTerms needs positives"):
        Problem(x, x, 1.0, PairTerms("binary"))
    with pytest.raises(ValueError, match="'pair_softplus' or 'binary'"):
        PairTerms("softmax")
    views = Positives.from_sample_mask(torch.eye(3, dtype=torch.bool, device=DEVICE), torch.arange(6, device=DEVICE) % 3, 6)
    with pytest.raises(ValueError, match="pair kernels take positives by ids, a partner or index pairs, not a 'mask' relation"):
        tc.engine.plan(Problem(x, x, 1.0, PairTerms("binary"), positives=views, self_offset=0, options=Options(backend="triton")))


def test_explicit_backends_are_honoured_or_refused():
    assert _decide(CPU, torch.float32, 10, backend="torch").backend == "torch"
    with pytest.raises(ValueError, match="backend='triton' cannot run this call: no kernels here"):
        _decide(CUDA, torch.float32, 10, backend="triton", serves=lambda name: "no kernels here")
    with pytest.raises(ValueError, match="backend must be one of"):
        _decide(CPU, torch.float32, 10, backend="gpu")


def test_explain_reports_what_a_call_does():
    x = torch.randn(64, 16, device=DEVICE, dtype=torch.bfloat16)
    decisions = tc.explain(tc.clip_loss, x, x.flip(0), 0.07)
    assert len(decisions) == 1
    d = decisions[0]
    assert (d.kernel, d.rows, d.cols, d.backend, d.tile) == ("softmax", 64, 64, "torch", 0)
    assert d.half == (DEVICE.type == "cuda")
    assert "backend=torch" in str(d) and "one tile" in str(d)
    assert tc.explain(tc.siglip_loss, x, x, 10.0, -10.0)[0].kernel == "sigmoid"


#: The torch tile loops' tensor-core products (backend pinned: "auto" on a GPU may take the kernels,
#: which tests/engine/test_epilogue.py and test_triton.py check).
LOSSES = {
    "clip": (lambda a, b, t, c: tc.image_text_contrastive_loss(a, b, t, chunk_size=c, backend="torch"), lambda a, b, t: image_text(a, b, t), 2),
    "clip_ids": (lambda a, b, t, c: tc.image_text_contrastive_loss(a, b, t, torch.arange(a.shape[0], device=a.device) % 4,
                                                                   chunk_size=c, backend="torch"),
                 lambda a, b, t: image_text(a, b, t, torch.arange(a.shape[0]) % 4), 2),
    "nt_xent": (lambda a, b, t, c: tc.nt_xent_loss(a, t, pairing="halves", chunk_size=c, backend="torch"),
                lambda a, b, t: nt_xent(a, t, "halves"), 1),
    "supcon": (lambda a, b, t, c: tc.supcon_loss(a, torch.arange(a.shape[0], device=a.device) % 3, temperature=t, chunk_size=c, backend="torch"),
               lambda a, b, t: supcon(a, t, labels=torch.arange(a.shape[0]) % 3), 1),
    "info_nce": (lambda a, b, t, c: tc.info_nce_loss(a, b, None, t, chunk_size=c, backend="torch"), lambda a, b, t: info_nce(a, b, None, t), 2),
    # the pair terms (PML NT-Xent, NT-BXent) take the same products
    "nt_xent_pml": (lambda a, b, t, c: tc.nt_xent_loss(a, t, labels=torch.arange(a.shape[0], device=a.device) % 3, chunk_size=c, backend="torch"),
                    lambda a, b, t: nt_xent_pml(a, torch.arange(a.shape[0]) % 3, t), 1),
    "nt_bxent": (lambda a, b, t, c: tc.nt_bxent_loss(a, labels=torch.arange(a.shape[0], device=a.device) % 3, temperature=t,
                                                     chunk_size=c, backend="torch"),
                 lambda a, b, t: nt_bxent(a, t, labels=torch.arange(a.shape[0]) % 3), 1),
}


@pytest.mark.parametrize("tau", [0.2, 0.01])  # the bounded one-exp regime and the online maximum
@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("dtype,tols", [t for t in DTYPES if t[0] in (torch.float16, torch.bfloat16)])
def test_tensor_core_products_equal_the_float64_references(name, chunk, tau, dtype, tols, monkeypatch):
    """fp16/bf16 inputs multiplied as given (HalfProducts; on a CPU with widened operands, the same
    numbers): values to fp32 round-off -- the operands are never rounded -- and gradients to the
    input dtype's rounding."""
    monkeypatch.setattr(planner, "PRODUCTS", "half")
    ours, ref, n_inputs = LOSSES[name]
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(14, 6, generator=g, dtype=torch.float64) * 3, torch.randn(14, 6, generator=g, dtype=torch.float64)
    assert tc.explain(ours, x.to(DEVICE, dtype), y.to(DEVICE, dtype), tau, chunk)[0].half
    inputs = [x, y][:n_inputs]
    if n_inputs == 1:
        compare(lambda a, t: ours(a, None, t, chunk), lambda a, t: ref(a, None, t), inputs, tau, dtype, tols)
    else:
        compare(lambda a, b, t: ours(a, b, t, chunk), lambda a, b, t: ref(a, b, t), inputs, tau, dtype, tols)


def test_auto_on_a_gpu_is_the_measured_policy():
    """On CUDA "auto" is the policy's first rule whose backend serves the call (engine/policy.py): the epilogue for
    bf16 soft-max terms from the measured 8,192 rows, the torch loops on tensor cores below, and for everything the
    epilogue was not measured on; no prediction is made or read, and the decision says which rule chose."""
    from torch_contrastive.engine import policy

    clip = planner.Traits(512, columns=True)
    serve = dict(serves=lambda name: None, traits=clip)
    small, below, at, big = (_decide(CUDA, torch.bfloat16, n, **serve) for n in (1024, 8191, 8192, 65536))
    for d in (small, below, at, big):
        assert not hasattr(d, "predicted") and "predicted" not in str(d)
    assert (small.backend, small.tile, small.half) == ("torch", 0, True) and below.backend == "torch"
    assert "policy: torch" in str(small) and "measured: H100, commit 04b01f4" in small.reason
    assert at.backend == big.backend == "epilogue" and big.operand_dtype == torch.bfloat16 and not big.half
    assert at.reason == policy.CUDA[0].reason() and "from 8,192 rows" in str(at)
    # the epilogue's tiles hold 8 bytes per logit (the torch loops' 12), as row strips across all 65,536 columns:
    # 32 strips of 2,048 rows within the 1 GiB budget, fewer than 6 x 6 squares of 11,520
    assert (big.tile, big.tile_cols) == (2048, 65536) and "32 strips of 2048x65536" in str(big)
    assert planner.resolve_tile(None, 65536, 65536, "cuda", 8) == 11520 > planner.resolve_tile(None, 65536, 65536, "cuda", 12)
    # only what serves: without the epilogue the torch loops (the fused kernels are no rule's: asked for by name)
    assert _decide(CUDA, torch.bfloat16, 65536, serves=lambda name: "no" if name == "epilogue" else None, traits=clip).backend == "torch"
    assert _decide(CUDA, torch.bfloat16, 65536, traits=clip).backend == "torch"  # no epilogue kernels for it
    for dtype in (torch.float32, torch.float16, torch.float64):  # measured on bf16 only
        assert _decide(CUDA, dtype, 65536, **serve).backend == "torch"
    assert _decide(CUDA, torch.bfloat16, 65536, kernel="pairwise", **serve).backend == "torch"  # not measured
    assert _decide(CPU, torch.bfloat16, 65536, **serve).backend == "torch"
    # an explicit backend is the caller's, and says so
    asked = _decide(CUDA, torch.bfloat16, 1024, backend="epilogue", **serve)
    assert asked.backend == "epilogue" and asked.reason == "backend='epilogue' as asked"
    # the policy alone: first rule that covers and serves
    assert policy.choose("cuda", "softmax", 8192, torch.bfloat16, torch.bfloat16, lambda name: None)[0] == "epilogue"
    assert policy.choose("cuda", "softmax", 8192, torch.bfloat16, torch.float32, lambda name: None)[0] == "torch"
    assert policy.choose("cuda", "softmax", 8192, torch.bfloat16, torch.bfloat16, lambda name: "no" if name == "epilogue" else None)[0] == "torch"
    assert policy.choose("cpu", "softmax", 65536, torch.bfloat16, torch.bfloat16, lambda name: None)[0] == "torch"
    assert all(rule.measured for rule in policy.CUDA)  # every CUDA rule names its measurement


def test_a_kept_plan_is_never_another_problems():
    """The soft-max plan is kept per key (a training loop asks the same question every step); problems
    that differ in anything the plan holds get their own plan, whatever they share."""
    from torch_contrastive.engine import Options, Problem, Softmax
    from torch_contrastive.losses._pairing import partner_positives

    x = torch.randn(12, 5, device=DEVICE)
    pos = partner_positives(12, "halves", 0, x.device, 12, 0, "halves")

    def make(**kw):
        base = dict(positives=pos, self_offset=0, symmetric=True, bound=10.0, options=Options(True, 1e-12, None, "torch"))
        base.update(kw)
        return problem_plan.plan(Problem(x, x, 10.0, Softmax(), **base))

    first = make()
    assert make() is first  # the same question: the same plan
    assert make(symmetric=False).symmetric is False and first.symmetric is True
    assert make(grad_columns=4).grad_columns == 4 and first.grad_columns == 12
    assert make(options=Options(False, 1e-12, None, "torch")).normalize is False
    assert make(positives=None, self_offset=0).positives is None
    # what the device decision is made of is part of the key too (a kept plan skips decide())
    assert make(bound=None).fixed is False and first.fixed is True
    assert make(options=Options(True, 1e-12, 4, "torch")).tile == 4 and first.tile == 0
    assert make(options=Options(True, 1e-12, None, "auto")).decision.backend == "torch"
    assert problem_plan.plan(Problem(x[:10], x[:10], 10.0, Softmax(), self_offset=0, symmetric=True, bound=10.0,
                                options=Options(True, 1e-12, None, "torch"))).decision.rows == 10
    assert make(bound=100.0).fixed is False  # |S| <= 100 overflows fp32's exp, not fp64's
    assert problem_plan.plan(Problem(x.double(), x.double(), 10.0, Softmax(), positives=pos, self_offset=0, symmetric=True,
                                bound=100.0, options=Options(True, 1e-12, None, "torch"))).fixed is True


def test_a_relation_built_per_call_is_not_held_and_its_plan_is_kept_by_shape():
    """Labels and ids give a new relation object every call. Its plan is kept by the relation's shape,
    without the relation (a kept relation would hold its N x N mask until the cache is cleared), and
    each call's plan carries that call's relation: new labels at the same shape give their own loss."""
    x = torch.randn(16, 8, device=DEVICE)
    labels = torch.arange(16, device=DEVICE) % 4
    ref = tc.supcon_loss(x.double(), labels.flip(0) % 3, temperature=0.1)
    problem_plan._PLANS.clear()
    seen = []
    for lab in (labels, labels.flip(0) % 3, labels):
        seen.append(float(tc.supcon_loss(x, lab, temperature=0.1)))
        seen.append(float(tc.nt_xent_loss(x, 0.1, labels=lab)))
    assert len(problem_plan._PLANS) == 2  # one soft-max plan, one pair plan, whatever the labels
    assert all(kept.positives is None for kept in problem_plan._PLANS.values())
    assert seen[:2] == seen[4:] and seen[:2] != seen[2:4]
    assert seen[2] == pytest.approx(float(ref), rel=1e-5)
    tc.nt_xent_loss(x, 0.1, pairing="halves")
    tc.nt_xent_loss(x, 0.1, pairing="halves")
    assert len(problem_plan._PLANS) == 3  # a pairing rule's relation is built once per shape: its plan is kept with it


@pytest.mark.parametrize("name", ["clip", "nt_xent", "info_nce", "nt_xent_pml", "nt_bxent"])
def test_tensor_core_products_with_a_float_temperature(name, monkeypatch):
    """A float temperature (no remainder product): the bf16 gradient tile is rounded as it is formed;
    values to fp32 round-off and gradients to bf16's rounding against float64 on the same inputs."""
    monkeypatch.setattr(planner, "PRODUCTS", "half")
    ours, ref, n_inputs = LOSSES[name]
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(14, 6, generator=g, dtype=torch.float64) * 3).to(torch.bfloat16)
    y = torch.randn(14, 6, generator=g, dtype=torch.float64).to(torch.bfloat16)
    inputs = [x, y][:n_inputs]
    low = [t.to(DEVICE).requires_grad_() for t in inputs]
    wide = [t.double().requires_grad_() for t in inputs]
    assert tc.explain(ours, *(low + [None] * (2 - n_inputs)), 0.2, None)[0].half
    got = ours(*(low + [None] * (2 - n_inputs)), 0.2, None)
    want = ref(*(wide + [None] * (2 - n_inputs)), 0.2)
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=2e-5)
    for a, b in zip(torch.autograd.grad(got, low), torch.autograd.grad(want, wide)):
        assert torch.allclose(a.double().cpu(), b, rtol=1e-2, atol=1e-2 * float(b.abs().max())), name


def test_a_kept_plan_is_the_devices_and_an_explicit_backends_refusal_is_asked_again(monkeypatch):
    """Plans are kept per key: a simulated GPU's plan and this machine's own for the same tensors are two plans
    (the simulated device is in the key); an explicit kernel backend's kept plan still asks its refusal at every
    call -- the kernels that served one call refuse the next when the interpreter is switched off on a CPU."""
    x = torch.randn(24, 8, device=DEVICE, requires_grad=True)
    y = torch.randn(24, 8, device=DEVICE, requires_grad=True)
    with planner.simulate("cuda"):
        simulated = tc.explain(tc.image_text_contrastive_loss, x, y, 0.1)
    own = tc.explain(tc.image_text_contrastive_loss, x, y, 0.1)
    assert simulated[0].device == "cuda" and own[0].device == DEVICE.type
    if DEVICE.type == "cuda" or pytest.importorskip("triton") is None:
        return
    tc.image_text_contrastive_loss(x, y, 0.1, backend="epilogue").backward()  # served, and its plan kept
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"backend='epilogue' cannot run this call: .*CUDA tensors"):
        tc.image_text_contrastive_loss(x, y, 0.1, backend="epilogue")
