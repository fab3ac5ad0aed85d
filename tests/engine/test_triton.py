"""backend="triton": the Triton kernels equal the torch backend and the float64 references.

On a machine without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
set here before the kernels are defined); sizes stay small because it is slow. Skipped
when triton is not installed (``pip install 'torch-contrastive[gpu]'``).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

import torch_contrastive as tc  # noqa: E402
from device import DEVICE  # noqa: E402
from helpers import compare, queue_problem, two_set_problem  # noqa: E402
from reference import image_text, info_nce, nt_bxent, nt_xent, nt_xent_pml, nt_xent_pml_memory, supcon  # noqa: E402
from torch_contrastive.engine import softmax_terms  # noqa: E402
from torch_contrastive.positives import Exclusion, Positives  # noqa: E402

TOLS = {torch.float64: (1e-9, 1e-9), torch.float32: (1e-5, 1e-5)}


def _both(fn, leaves):
    """Value and gradients of ``fn(*leaves, backend)`` for both backends."""
    out = []
    for backend in ("torch", "triton"):
        copies = [x.detach().clone().requires_grad_(x.requires_grad) for x in leaves]
        value = fn(*copies, backend)
        grads = torch.autograd.grad(value.sum(), [c for c in copies if c.requires_grad])
        out.append((value.detach(), grads))
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 45), (45, 7), (33, 33)])
@pytest.mark.parametrize("relation", ["partner", "keys", "none"])
def test_softmax_terms_two_sets_with_columns(rows, cols, relation, dtype):
    a, b, scale, pos, weights = two_set_problem(rows, cols, relation, dtype)

    def fn(x, y, s, backend):
        r, c = softmax_terms(x, y, s, self_offset=None, positives=pos, row_weights=weights, columns=True, normalize=True,
                             backend=backend)
        return r.sum() + 0.7 * c.sum()

    (v0, g0), (v1, g1) = _both(fn, [a, b, scale])
    tol = TOLS[dtype][0]
    torch.testing.assert_close(v1, v0, rtol=tol, atol=tol)
    for x, y in zip(g1, g0):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol * max(1.0, y.abs().max().item()))


@pytest.mark.parametrize("n", [2, 10, 40])
def test_softmax_terms_single_set(n):
    a = torch.randn(n, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(n)).to(DEVICE).requires_grad_()
    pos = Positives.from_partner(torch.arange(n, device=DEVICE) ^ 1, n, self_offset=0)

    def fn(x, backend):
        return softmax_terms(x, x, 2.5, self_offset=0, positives=pos, symmetric=True, normalize=True, backend=backend)[0]

    (v0, g0), (v1, g1) = _both(fn, [a])
    torch.testing.assert_close(v1, v0, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g1[0], g0[0], rtol=1e-10, atol=1e-12)


def test_constant_candidates_behind_live_ones():
    """A queue behind the live keys (grad_columns): the same gradients as the torch backend."""
    q, k, queue, pos = queue_problem()

    def fn(x, y, backend):
        return softmax_terms(x, torch.cat([y, queue]), 4.0, self_offset=None, positives=pos, normalize=True, grad_columns=11,
                             backend=backend)[0]

    (v0, g0), (v1, g1) = _both(fn, [q, k])
    torch.testing.assert_close(v1, v0, rtol=1e-10, atol=1e-12)
    for x, y in zip(g1, g0):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


LOSSES = {
    "nt_xent_halves": (lambda x, y, t, b: tc.nt_xent_loss(x, t, pairing="halves", backend=b),
                       lambda x, y, t: nt_xent(x, t, "halves"), 1),
    "supcon_labels": (lambda x, y, t, b: tc.supcon_loss(x, torch.arange(x.shape[0]) % 3, temperature=t, backend=b),
                      lambda x, y, t: supcon(x, t, labels=torch.arange(x.shape[0]) % 3), 1),
    "clip_ids": (lambda x, y, t, b: tc.image_text_contrastive_loss(x, y, t, torch.arange(x.shape[0]) % 4, backend=b),
                 lambda x, y, t: image_text(x, y, t, torch.arange(x.shape[0]) % 4), 2),
    "info_nce_pool": (lambda x, y, t, b: tc.info_nce_loss(x, y, y.flip(0) * 2, t, backend=b),
                      lambda x, y, t: info_nce(x, y, y.flip(0) * 2, t), 2),
    "info_nce_paired": (lambda x, y, t, b: tc.info_nce_loss(x, y, torch.stack([y.roll(1, 0), y.flip(1)], 1), t,
                                                            negative_mode="paired", backend=b),
                        lambda x, y, t: info_nce(x, y, torch.stack([y.roll(1, 0), y.flip(1)], 1), t, "paired"), 2),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(LOSSES))
def test_losses_on_triton_equal_the_float64_references(name, dtype):
    ours, ref, n_inputs = LOSSES[name]
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(14, 5, generator=g, dtype=torch.float64), torch.randn(14, 5, generator=g, dtype=torch.float64)
    inputs = [x, y][:n_inputs]
    if n_inputs == 1:
        compare(lambda a, t: ours(a, None, t, "triton"), lambda a, t: ref(a, None, t), inputs, 0.2, dtype, TOLS[dtype])
    else:
        compare(lambda a, b, t: ours(a, b, t, "triton"), lambda a, b, t: ref(a, b, t), inputs, 0.2, dtype, TOLS[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_match_the_torch_backend(dtype):
    x = torch.randn(20, 8, generator=torch.Generator().manual_seed(0)).to(DEVICE, dtype)
    values = [tc.image_text_contrastive_loss(x, x.flip(0), 0.1, backend=b) for b in ("torch", "triton")]
    assert values[0].dtype == values[1].dtype == torch.float32
    # both backends multiply the caller's half rows with fp32 logits; on a GPU the accumulation order
    # differs (tensor-core tiles), so they agree to fp32 accumulation, not bit for bit
    tol = (1e-5, 1e-6) if DEVICE.type == "cpu" else (1e-3, 1e-4)
    torch.testing.assert_close(values[1], values[0], rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("name", ["clip", "nt_xent_halves", "info_nce_queue"])
@pytest.mark.parametrize("dtype,tols", [(torch.float16, (2e-5, 2e-3)), (torch.bfloat16, (2e-5, 1e-2))])
def test_half_inputs_at_a_low_temperature_equal_the_float64_formula(name, dtype, tols, scheme):
    """tau = 0.01: the kernels multiply the caller's half rows as given and apply the scale and the
    normalisation to the fp32 logit tile, so values and gradients hold the torch backend's
    tolerances (rounding ``x / ||x|| / tau`` to half first cost ~1-4 % of the gradients)."""
    g = torch.Generator().manual_seed(11)
    x, y, queue = torch.randn(45, 24, generator=g), torch.randn(45, 24, generator=g), torch.randn(30, 24, generator=g)
    if name == "clip":
        compare(lambda a, b, t: tc.image_text_contrastive_loss(a, b, t, backend="triton"), image_text, [x, y], 0.01, dtype, tols)
    elif name == "nt_xent_halves":
        compare(lambda a, t: tc.nt_xent_loss(a, t, pairing="halves", backend="triton"),
                 lambda a, t: nt_xent(a, t, "halves"), [x[:44]], 0.01, dtype, tols)
    else:
        q = queue.to(dtype).to(DEVICE)
        compare(lambda a, b, t: tc.info_nce_loss(a, b, q, t, backend="triton"),
                 lambda a, b, t: info_nce(a, b, q.double().cpu(), t), [x, y], 0.01, dtype, tols)


@pytest.mark.parametrize("call,words", [
    (lambda x: softmax_terms(x, x, 1.0, self_offset=None, backend="triton",
                             exclude=Exclusion(relation=Positives.from_pairs(torch.tensor([[0, 1]]), 6, 6))), "'pairs' relation"),
    (lambda x: softmax_terms(x, x, 1.0, self_offset=None, backend="triton",
                             exclude=Exclusion(relation=Positives.from_partner(torch.arange(6), 6),
                                               keep=Positives.from_partner(torch.arange(6), 6))), "kept relation"),
    (lambda x: tc.nt_xent_loss(x, backend="cuda"), "backend must be one of"),
    (lambda x: tc.NTXentLoss(backend="tpu"), "backend must be one of"),
])
def test_what_the_kernels_do_not_cover_is_a_clear_error(call, words):
    with pytest.raises(ValueError, match=words):
        call(torch.randn(6, 4, device=DEVICE))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only check")
def test_cpu_without_the_interpreter_says_how_to_run(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        tc.nt_xent_loss(torch.randn(6, 4), backend="triton")


#: (dtype, scheme) for the slow float64-loop comparisons: both dtypes on the fused kernels, the
#: row-owned ones once (their arithmetic is the same per dtype; the interpreter is slow).
DTYPE_SCHEMES = [(torch.float64, "fused"), (torch.float32, "fused"), (torch.float32, "deterministic")]


@contextlib.contextmanager
def _in_scheme(name: str):
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(name == "deterministic")
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


@pytest.fixture(params=["fused", "deterministic"])
def scheme(request):
    """Both kernel schemes: atomics (each tile once) and row-owned (torch.use_deterministic_algorithms)."""
    with _in_scheme(request.param):
        yield request.param


if triton is not None:
    import triton.language as tl

    from torch_contrastive.engine.triton_backend._tile import tile_of

    @triton.jit
    def _record_tiles(out_ptr, n_rows, n_cols, BLOCK: tl.constexpr, GROUP: tl.constexpr):
        bi, bj = tile_of(n_rows, n_cols, BLOCK, GROUP)
        pid = tl.program_id(0)
        tl.store(out_ptr + 2 * pid, bi)
        tl.store(out_ptr + 2 * pid + 1, bj)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the grouped order is read back through the interpreter's grid")
@pytest.mark.parametrize("n_row_blocks,n_col_blocks", [(1, 1), (3, 5), (5, 3), (11, 13)])
def test_grouped_grid_visits_every_tile_once_in_grouped_order(n_row_blocks, n_col_blocks):
    """Program ``pid`` of the fused kernels owns tile ``tile_of(pid)``: every tile exactly once, a group
    of row blocks finishing before the next starts, and inside a group column block by column block."""
    block, group = 4, 2
    n = n_row_blocks * n_col_blocks
    out = torch.full((2 * n,), -1, dtype=torch.int32)
    _record_tiles[(n,)](out, n_row_blocks * block - 1, n_col_blocks * block - 2, BLOCK=block, GROUP=group)
    tiles = [tuple(t) for t in out.view(n, 2).tolist()]
    assert sorted(tiles) == [(i, j) for i in range(n_row_blocks) for j in range(n_col_blocks)]
    groups = [i // group for i, _ in tiles]
    assert groups == sorted(groups)
    first_group = [(j, i) for i, j in tiles if i < group]
    assert first_group == sorted(first_group)


def test_autotuning_configs_are_pruned_per_device_dtype_and_size(monkeypatch):
    """The interpreter runs one 32-wide config (nothing timed); on a GPU each dtype keeps the configs that name it
    (fp32 and fp64 the small FMA tiles), a small problem keeps no tile larger than itself; the half lists hold
    128-wide tiles where the compile check passes them."""
    from torch_contrastive.engine.triton_backend import _configs

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # prune reads the switch per call: on a GPU too
    monkeypatch.setenv("TORCH_CONTRASTIVE_AUTOTUNE", "1")  # the GPU suite turns timing off
    lists = (_configs.square_sums(), _configs.square_grads(), _configs.row_blocks(), _configs.row_output_blocks(),
             _configs.owned_outputs())
    assert max(_configs._side(c) for c in _configs.row_blocks()) == 128
    assert max(_configs._side(c) for c in _configs.row_output_blocks()) == 128
    for configs in lists:
        (only,) = _configs.prune(configs, {"x_ptr": torch.empty(1), "bucket": 4096})
        assert set(only.kwargs.values()) == {_configs.INTERPRETER_BLOCK}
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            named = {"x_ptr": torch.empty(1, dtype=dtype), "bucket": 65536}
            wide = _configs.prune(configs, named)
            assert wide == [c for c in configs if dtype in c.dtypes] and wide, dtype
            small = _configs.prune(configs, {**named, "bucket": 64})
            assert small and all(_configs._side(c) <= 64 and dtype in c.dtypes for c in small)
            monkeypatch.setenv("TORCH_CONTRASTIVE_AUTOTUNE", "0")  # one config, the smallest tile: nothing timed
            (untimed,) = _configs.prune(configs, named)
            assert dtype in untimed.dtypes and _configs._side(untimed) == min(_configs._side(c) for c in wide)
            monkeypatch.setenv("TORCH_CONTRASTIVE_AUTOTUNE", "1")
        fp32 = _configs.prune(configs, {"x_ptr": torch.empty(1), "bucket": 65536})
        assert all(_configs._side(c) * c.kwargs["BLOCK_D"] <= 256 * c.num_warps for c in fp32)  # <= 8 per thread
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _configs.bucket(1000, 70) == 1024 and _configs.bucket(1024) == 1024 and _configs.bucket(0) == 1


FALSE_NEGATIVES = {
    "ids": dict(key_ids=torch.arange(45) % 7, negative_ids=torch.arange(40) % 5),
    "guide_absolute": "guide",
    "guide_relative": "guide",
    "decoupled": dict(decoupled=True),
    "ids_decoupled": dict(key_ids=torch.arange(45) % 7, decoupled=True),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("rule", list(FALSE_NEGATIVES))
def test_false_negatives_in_the_kernels_equal_the_minus_inf_reference(rule, normalize, dtype, scheme):
    """Ids, guide verdicts (both margin modes) and DCL applied inside the tiles: 45 queries,
    45 keys and a pool of 40 (several blocks), both regimes (bounded: normalised inputs;
    online maximum: raw dot products) and both schemes, against the float64 loop."""
    from reference import info_nce_masked

    g = torch.Generator().manual_seed(len(rule))
    q, k, neg = (torch.randn(n, 6, generator=g, dtype=torch.float64).to(DEVICE) for n in (45, 45, 40))
    if not normalize:
        q, k, neg = q / 3, k / 3, neg / 3
    kwargs: dict = {}
    ref_kwargs: dict = {}
    if FALSE_NEGATIVES[rule] == "guide":
        gq, gk, gn = (torch.randn(n, 20, generator=g, dtype=torch.float64).to(DEVICE) for n in (45, 45, 40))
        gk = gq + 0.3 * gk
        gk[3] = -gq[3]  # a query whose positive scores low in the guide: many candidates leave
        gq[10], gq[30] = gq[40], gq[2]  # near-duplicates: one candidate leaves
        mode = rule.split("_")[1]
        kwargs = dict(guide=(gq, gk, gn), guide_margin=0.1, guide_margin_mode=mode)
        ref_kwargs = dict(guide=(gq, gk, gn), margin=0.1, margin_mode=mode)
    else:
        kwargs = dict(FALSE_NEGATIVES[rule])
        ref_kwargs = dict(kwargs)
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, neg)]
    value = tc.info_nce_loss(*leaves, 0.2, normalize=normalize, backend="triton", **kwargs)
    grads = torch.autograd.grad(value, leaves)
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    if normalize:
        ref = info_nce_masked(*ref_leaves, torch.tensor(0.2, dtype=torch.float64), **ref_kwargs)
    else:  # raw dot products: the same loop on unnormalised rows
        ref = tc.info_nce_loss(*ref_leaves, 0.2, normalize=False, backend="torch", **kwargs)
    ref_grads = torch.autograd.grad(ref, ref_leaves)
    rtol, atol = TOLS[dtype]
    torch.testing.assert_close(value.double(), ref, rtol=rtol, atol=atol)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b, rtol=rtol, atol=atol * max(1.0, b.abs().max().item()))


SYMMETRIC_AND_TWO_SIDED = {
    "nt_xent_dcl_halves": (lambda x, t, b: tc.nt_xent_loss(x, t, pairing="halves", decoupled=True, backend=b), 1),
    "nt_xent_dcl_adjacent": (lambda x, t, b: tc.nt_xent_loss(x, t, decoupled=True, backend=b), 1),
    "nt_xent_adjacent": (lambda x, t, b: tc.nt_xent_loss(x, t, backend=b), 1),
    "supcon_labels": (lambda x, t, b: tc.supcon_loss(x, torch.arange(x.shape[0]) % 5, temperature=t, backend=b), 1),
    "clip_ids_dcl": (lambda x, y, t, b: tc.image_text_contrastive_loss(x, y, t, torch.arange(x.shape[0]) % 9, decoupled=True,
                                                                       backend=b), 2),
    "clip_two_ids_dcl": (lambda x, y, t, b: tc.image_text_contrastive_loss(x, y, t, torch.arange(x.shape[0]) % 9,
                                                                           torch.arange(x.shape[0]) % 11, decoupled=True,
                                                                           backend=b), 2),
    "clip_dcl": (lambda x, y, t, b: tc.image_text_contrastive_loss(x, y, t, decoupled=True, backend=b), 2),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(SYMMETRIC_AND_TWO_SIDED))
def test_triangle_tiles_and_two_sided_exclusions_equal_the_torch_backend(name, dtype, scheme):
    """70 rows (three blocks: the upper triangle has off-diagonal tiles whose column sums are
    their mirror rows'), DCL's partner / id exclusions in both directions; fp64 results of the
    torch backend are the reference (themselves tested against the float64 loops)."""
    fn, n_inputs = SYMMETRIC_AND_TWO_SIDED[name]
    g = torch.Generator().manual_seed(7)
    inputs = [torch.randn(70, 6, generator=g, dtype=torch.float64).to(DEVICE) for _ in range(n_inputs)]
    leaves = [x.to(dtype).requires_grad_() for x in inputs]
    value = fn(*leaves, 0.3, "triton")
    grads = torch.autograd.grad(value, leaves)
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    ref = fn(*ref_leaves, 0.3, "torch")
    ref_grads = torch.autograd.grad(ref, ref_leaves)
    rtol, atol = TOLS[dtype]
    torch.testing.assert_close(value.double(), ref, rtol=rtol, atol=atol)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b, rtol=rtol, atol=atol * max(1.0, b.abs().max().item()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo on CPU tensors")
@pytest.mark.parametrize("fixed", [True, False])
def test_distributed_column_statistics_on_triton_equal_the_torch_backend(fixed, scheme):
    """CLIP with ids, DCL and uneven sizes at 2 ranks (gloo): the column log-sum-exp is
    completed across ranks from the kernels' partial sums / log-sum-exps."""
    from dist_helpers import ranks_clip_on, run_ranks

    run_ranks(ranks_clip_on, 2, "triton", fixed, scheme == "deterministic", None, timeout=300)


@pytest.mark.parametrize("rows,cols", [(45, 70), (70, 45)])
@pytest.mark.parametrize("fixed", [True, False])
@pytest.mark.parametrize("what", ["keys", "guide_diagonal"])
def test_asymmetric_exclusions_read_right_in_the_column_pass(what, fixed, rows, cols, scheme):
    """An exclusion that is not symmetric (different row and column keys; a guide threshold
    per row plus a strided diagonal) on a two-set problem with column log-sum-exps: the
    column pass reads it transposed. Values and gradients equal the torch backend."""
    g = torch.Generator().manual_seed(rows)
    a = torch.randn(rows, 6, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    b = torch.randn(cols, 6, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    if what == "keys":
        keys = torch.arange(rows, device=DEVICE) % 4, torch.arange(cols, device=DEVICE) % 6
        exclude = Exclusion(relation=Positives.from_keys(*keys, self_offset=None),
                            keep_diagonal=0)
    else:
        ga = torch.nn.functional.normalize(torch.randn(rows, 17, generator=g, dtype=torch.float64), dim=1).to(DEVICE)
        gb = torch.nn.functional.normalize(torch.randn(cols, 17, generator=g, dtype=torch.float64), dim=1).to(DEVICE)
        exclude = Exclusion(guide=(ga, gb, torch.linspace(-0.2, 0.4, rows, dtype=torch.float64, device=DEVICE)), diagonal=1)
    weights = (torch.linspace(0.5, 2, rows, dtype=torch.float64, device=DEVICE), None)

    def fn(x, y, backend):
        r, c = softmax_terms(x, y, 2.0, self_offset=None, columns=True, fixed=fixed, normalize=fixed, exclude=exclude,
                             row_weights=weights, col_weights=(torch.linspace(1, 2, cols, dtype=torch.float64, device=DEVICE), None),
                             backend=backend)
        r, c = torch.where(torch.isinf(r), 0.0, r), torch.where(torch.isinf(c), 0.0, c)
        return r.sum() + 0.7 * c.sum()

    (v0, g0), (v1, g1) = _both(fn, [a, b])
    torch.testing.assert_close(v1, v0, rtol=1e-10, atol=1e-10)
    for x, y in zip(g1, g0):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------ SigLIP's sigmoid kernels
#: The kernel schemes of SigLIP and the mask-in-tile losses: the fused kernels (both schemes), and the
#: epilogue kernels over strips of 16 logit tiles from torch.mm
KERNEL_SCHEMES = [(*case, "triton") for case in DTYPE_SCHEMES] + [(torch.float64, "fused", "epilogue"),
                                                                  (torch.float32, "fused", "epilogue")]


@pytest.mark.parametrize("n,ids", [(1, "none"), (7, "none"), (45, "none"), (45, "image"), (70, "both"), (33, "negative_only")])
@pytest.mark.parametrize("dtype,scheme_name,backend", KERNEL_SCHEMES)
def test_siglip_on_triton_equals_the_float64_formula(n, ids, dtype, scheme_name, backend):
    """Values and gradients of inputs, scale and bias: positives on the diagonal, by ids (duplicates
    positive), or none (open_clip's negative-only term); sizes that leave ragged tiles -- the fused
    kernels, and the epilogue kernels over strips of 16 logit tiles from torch.mm."""
    from reference import cosine_matrix, siglip

    g = torch.Generator().manual_seed(n)
    iid = torch.randint(0, max(1, n // 2), (n,), generator=g) if ids in ("image", "both") else None
    tid = torch.randint(0, max(1, n // 3), (n,), generator=g) if ids == "both" else None
    a, b = (torch.randn(n, 20, generator=g, dtype=torch.float64) for _ in range(2))
    ref_in = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    ref_p = [torch.tensor(7.0, dtype=torch.float64, requires_grad=True), torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)]
    if ids == "negative_only":
        s = torch.stack([torch.stack(row) for row in cosine_matrix(*ref_in, True)])
        ref = -torch.nn.functional.logsigmoid(-(ref_p[0] * s + ref_p[1])).sum() / n
    else:
        ref = siglip(*ref_in, *ref_p, iid, tid)
    ref.backward()
    our_in = [t.to(DEVICE, dtype).requires_grad_() for t in (a, b)]
    our_p = [torch.tensor(v, dtype=dtype, device=DEVICE, requires_grad=True) for v in (7.0, -3.0)]
    with _in_scheme(scheme_name):
        ours = tc.siglip_loss(*our_in, *our_p, None if iid is None else iid.to(DEVICE), None if tid is None else tid.to(DEVICE),
                              negative_only=ids == "negative_only", chunk_size=16 if backend == "epilogue" else None,
                              backend=backend)
        ours.backward()
    rtol, atol = TOLS[dtype]
    assert ours.item() == pytest.approx(ref.item(), rel=rtol, abs=atol)
    for got, want in zip([*our_in, *our_p], [*ref_in, *ref_p]):
        torch.testing.assert_close(got.grad.double().cpu(), want.grad, rtol=10 * rtol, atol=10 * atol)


@pytest.mark.parametrize("dtype,tols,backend", [(torch.float16, (2e-5, 2e-3), "triton"), (torch.bfloat16, (2e-5, 1e-2), "triton"),
                                                (torch.bfloat16, (2e-5, 1e-2), "epilogue")])
def test_siglip_on_triton_with_half_inputs_equals_the_float64_formula(dtype, tols, backend):
    """Half rows reach the kernels as given, with the scale and the normalisation as fp32 factors (the
    epilogue: raw bf16 products from torch.mm, the gradient tiles rounded once per product)."""
    from reference import siglip

    g = torch.Generator().manual_seed(9)
    iid = torch.randint(0, 20, (45,), generator=g)
    a, b = (torch.randn(45, 20, generator=g).to(dtype) for _ in range(2))
    ref_in = [a.double().requires_grad_(), b.double().requires_grad_()]
    ref = siglip(*ref_in, 10.0, -10.0, iid)
    ref.backward()
    our_in = [t.to(DEVICE).requires_grad_() for t in (a, b)]
    ours = tc.siglip_loss(*our_in, 10.0, -10.0, iid.to(DEVICE), backend=backend)
    ours.backward()
    rtol, grad_tol = tols
    assert ours.dtype == torch.float32 and ours.item() == pytest.approx(ref.item(), rel=rtol, abs=rtol)
    for got, want in zip(our_in, ref_in):
        assert got.grad.dtype == dtype
        torch.testing.assert_close(got.grad.double().cpu(), want.grad, rtol=grad_tol,
                                   atol=grad_tol * max(1.0, want.grad.abs().max().item()))


@pytest.mark.parametrize("backend", ["triton", "epilogue"])
def test_siglip_on_triton_keeps_the_small_terms_of_a_confident_model(backend):
    """Scale 100, bias -20: every per-pair term is about e^-80 relative to 1 -- kept, not rounded to 0."""
    from reference import siglip

    x = torch.eye(6, dtype=torch.float64) + 0.01 * torch.randn(6, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref_in = x.clone().requires_grad_()
    ref = siglip(ref_in, x, 100.0, -20.0)
    ref.backward()
    ours_in = x.float().to(DEVICE).requires_grad_()
    ours = tc.siglip_loss(ours_in, x.float().to(DEVICE), 100.0, -20.0, backend=backend)
    ours.backward()
    assert 0 < ours.item() == pytest.approx(ref.item(), rel=1e-4)
    torch.testing.assert_close(ours_in.grad.double().cpu(), ref_in.grad, rtol=1e-3, atol=1e-3 * ref_in.grad.abs().max().item())


# ------------------------------------------------------------------ the mask-in-tile losses' kernels
@pytest.mark.parametrize("n,classes", [(1, 1), (7, 3), (45, 4), (70, 70), (33, 1)])
@pytest.mark.parametrize("dtype,scheme_name,backend", KERNEL_SCHEMES)
def test_labelled_nt_xent_and_nt_bxent_on_triton_equal_the_float64_formula(n, classes, dtype, scheme_name, backend):
    """PML's NT-Xent (one term per positive pair) and NT-BXent with labels: values and gradients of the
    inputs and a tensor temperature; all one class (no negatives), all distinct (no positives), ragged
    tiles -- the fused kernels, and the epilogue kernels over strips of 16."""
    x = torch.randn(n, 12, generator=torch.Generator().manual_seed(n + classes), dtype=torch.float64)
    labels = torch.arange(n) % classes
    rtol, _ = TOLS[dtype]
    chunk = 16 if backend == "epilogue" else None
    with _in_scheme(scheme_name):
        compare(lambda z, t: tc.nt_xent_loss(z, t, labels=labels.to(DEVICE), chunk_size=chunk, backend=backend),
                 lambda z, t: nt_xent_pml(z, labels, t), [x], 0.2, dtype, (rtol, 10 * rtol))
        compare(lambda z, t: tc.nt_bxent_loss(z, temperature=t, labels=labels.to(DEVICE), chunk_size=chunk, backend=backend),
                 lambda z, t: nt_bxent(z, t, labels=labels), [x], 0.2, dtype, (rtol, 10 * rtol))


def _listed_pairs(n: int) -> torch.Tensor:
    """Index pairs with repeats and self pairs; from 45 rows on, row 3 lists 45 columns (two tiles
    of 32 under the interpreter, so its list is searched per tile); 1 row: only its self pair."""
    g = torch.Generator().manual_seed(n)
    pairs = torch.randint(0, n, (2 * n, 2), generator=g)
    pairs = torch.cat([pairs, pairs[: n // 2], torch.arange(min(n, 5)).repeat(2, 1).T])
    if n >= 45:
        pairs = torch.cat([pairs, torch.stack([torch.full((45,), 3), torch.arange(n - 45, n)], 1)])
    return pairs


@pytest.mark.parametrize("n", [1, 7, 45, 70])
@pytest.mark.parametrize("dtype,scheme_name,backend", KERNEL_SCHEMES)
def test_nt_bxent_with_pos_indices_on_triton_equals_the_float64_formula(n, dtype, scheme_name, backend):
    """NT-BXent's listed pairs: membership tested per tile from each row's sorted columns; repeats count
    once, self pairs not at all, a row's long list spans tiles; values and gradients (inputs and tau)."""
    x = torch.randn(n, 12, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    pairs = _listed_pairs(n)
    rtol, _ = TOLS[dtype]
    with _in_scheme(scheme_name):
        compare(lambda z, t: tc.nt_bxent_loss(z, pairs.to(DEVICE), t, chunk_size=16 if backend == "epilogue" else None,
                                              backend=backend),
                 lambda z, t: nt_bxent(z, t, pos_indices=pairs), [x], 0.2, dtype, (rtol, 10 * rtol))


def test_nt_bxent_with_no_listed_pair_on_triton_equals_the_torch_backend():
    """An empty list: every pair but the self pair is a negative."""
    x = torch.randn(40, 12, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(DEVICE)
    none = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    want = tc.nt_bxent_loss(x, none, 0.1, reduction="none", backend="torch")
    torch.testing.assert_close(tc.nt_bxent_loss(x, none, 0.1, reduction="none", backend="triton"), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("loss", [tc.nt_xent_loss, tc.nt_bxent_loss, "nt_bxent_pairs"])
def test_labelled_per_row_values_on_triton_equal_the_torch_backend(loss):
    """``reduction="none"``: the kernels' rows in the caller's order (no label sorting on Triton)."""
    x = torch.randn(45, 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE)
    labels = (torch.arange(45) * 7 % 5).to(DEVICE)
    if loss == "nt_bxent_pairs":
        pairs = _listed_pairs(45).to(DEVICE)
        want, got = (tc.nt_bxent_loss(x, pairs, 0.1, reduction="none", backend=b) for b in ("torch", "triton"))
    else:
        want = loss(x, temperature=0.1, labels=labels, reduction="none", backend="torch")
        got = loss(x, temperature=0.1, labels=labels, reduction="none", backend="triton")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_pml_nt_xent_with_a_memory_on_triton_equals_the_float64_formula():
    """Memory rows (a queue with labels) are candidates of the kernels' pair terms too."""
    g = torch.Generator().manual_seed(5)
    x, memory = torch.randn(20, 12, generator=g, dtype=torch.float64), torch.randn(30, 12, generator=g, dtype=torch.float64)
    labels, memory_labels = torch.arange(20) % 4, torch.arange(30) % 5
    compare(lambda z, t: tc.nt_xent_loss(z, t, labels=labels.to(DEVICE), memory_emb=memory.to(DEVICE),
                                          memory_labels=memory_labels.to(DEVICE), backend="triton"),
             lambda z, t: nt_xent_pml_memory(z, labels, memory, memory_labels, t), [x], 0.1, torch.float64,
             TOLS[torch.float64])


LEAN = {
    "clip": lambda x, y, b: tc.clip_loss(x, y, 0.07, backend=b),
    "nt_xent": lambda x, y, b: tc.nt_xent_loss(torch.cat([x, y]), 0.1, pairing="halves", backend=b),
    "siglip": lambda x, y, b: tc.siglip_loss(x, y, 10.0, -10.0, backend=b),
    "nt_bxent_labels": lambda x, y, b: tc.nt_bxent_loss(torch.cat([x, y]), temperature=0.1, backend=b,
                                                        labels=torch.arange(2 * x.shape[0], device=x.device) % 5),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(LEAN))
def test_half_inputs_on_triton_keep_only_half_rows_for_backward(name, dtype, scheme):
    """Backward needs the operands; on the kernels' half path the caller's bf16 rows are kept, not
    fp32 normalised copies (4 more bytes per element, the largest saved state at 65k x 768). The
    copies rebuilt in backward give the torch backend's gradients."""
    n, d = 40, 24
    x = torch.randn(n, d, device=DEVICE, dtype=dtype, requires_grad=True)
    y = torch.randn(n, d, device=DEVICE, dtype=dtype, requires_grad=True)
    kept: list[torch.Tensor] = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = LEAN[name](x, y, "triton")
    wide = [tuple(t.shape) for t in kept if t.dtype == torch.float32 and t.dim() == 2 and t.shape[1] == d]
    assert wide == [], f"fp32 (rows, D) copies kept for backward: {wide}"
    grads = torch.autograd.grad(loss, [x, y])
    reference = LEAN[name](x, y, "torch")
    expected = torch.autograd.grad(reference, [x, y])
    torch.testing.assert_close(loss, reference, rtol=2e-3, atol=2e-3)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)


FUSED_KERNELS = [("tile_sums", "_tile_sums_kernel"), ("tile_grad", "_tile_grad_kernel"), ("pair_terms", "_pair_sums_kernel"),
                 ("pair_terms", "_pair_grad_kernel"), ("sigmoid_pairs", "_sigmoid_sums_kernel"),
                 ("sigmoid_pairs", "_sigmoid_grad_kernel")]
EVERY_FORM = {
    "clip": lambda x, y: tc.clip_loss(x, y, 0.1, backend="triton"),
    "nt_xent": lambda x, y: tc.nt_xent_loss(torch.cat([x, y]), 0.1, pairing="halves", backend="triton"),
    "siglip": lambda x, y: tc.siglip_loss(x, y, 10.0, -10.0, backend="triton"),
    "pml_labels": lambda x, y: tc.nt_xent_loss(x, 0.1, labels=torch.arange(x.shape[0], device=x.device) % 4, backend="triton"),
    "nt_bxent_pairs": lambda x, y: tc.nt_bxent_loss(x, _listed_pairs(x.shape[0]).to(x.device), 0.1, backend="triton"),
}


@pytest.mark.parametrize("name", list(EVERY_FORM))
def test_deterministic_mode_runs_no_atomic_kernel(name, monkeypatch):
    """``torch.use_deterministic_algorithms(True)`` promises bitwise-reproducible results: no kernel that
    adds with atomics may run, for any loss (the interpreter is sequential, so a repeat cannot show it)."""
    import importlib

    def refuse(*args, **kwargs):
        raise AssertionError("an atomic kernel ran in deterministic mode")

    for module, kernel in FUSED_KERNELS:
        monkeypatch.setattr(importlib.import_module(f"torch_contrastive.engine.triton_backend.{module}"), kernel,
                            type("Refuse", (), {"__getitem__": lambda self, grid: refuse})())
    g = torch.Generator().manual_seed(4)
    x, y = (torch.randn(40, 8, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_() for _ in range(2))
    with _in_scheme("deterministic"):
        loss = EVERY_FORM[name](x, y)
        grads = torch.autograd.grad(loss, [x, y], allow_unused=True)
    assert torch.isfinite(loss) and any(g is not None and g.abs().sum() > 0 for g in grads)
