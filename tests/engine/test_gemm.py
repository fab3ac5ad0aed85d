"""backend="gemm": the matmul with the soft-max statistic in its epilogue (``triton_backend/gemm_sums.py``) equals
float64 -- its kernel against ``logsumexp`` of the float64 logits (both regimes, two sets with columns, a single
set's triangle, a self pair, a ragged D, half rows with factors), and every soft-max loss on it against the float64
formulas and the torch backend (values and gradients, one tile and strips, bf16 at tau 0.01, gathered on gloo
ranks); SigLIP's row sums likewise (a diagonal, ids, none; bf16 with factors) and the loss on it. Its FLOPs are
counted from the grid against the product's floor.

Without CUDA the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``): small sizes. Skipped without triton.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

import torch_contrastive as tc  # noqa: E402
from device import DEVICE  # noqa: E402
from helpers import bf16_siglip_matches_float64, compare  # noqa: E402
from reference import image_text, info_nce, nt_xent, siglip, supcon  # noqa: E402
from torch_contrastive.engine import planner  # noqa: E402
from torch_contrastive.engine.triton_backend import keys as kernel_keys  # noqa: E402
from torch_contrastive.engine.triton_backend.gemm_sigmoid_sums import gemm_sigmoid_sums  # noqa: E402
from torch_contrastive.engine.triton_backend.gemm_sums import counted_flops, gemm_sums  # noqa: E402

TOLS = {torch.float64: (1e-9, 1e-9), torch.float32: (1e-5, 1e-5)}


def _reference_lse(x, y, self_offset):
    """Row and column ``logsumexp`` of ``x @ y.T`` in float64, the self pair left out."""
    s = x.double().cpu() @ y.double().cpu().t()
    if self_offset is not None:
        i = torch.arange(s.shape[0])
        keep = i + self_offset < s.shape[1]
        s[i[keep], i[keep] + self_offset] = float("-inf")
    return torch.logsumexp(s, 1), torch.logsumexp(s, 0)


def _lse(stats, fixed):
    top, total = stats
    return total.log() if fixed else top + total.log()


@pytest.mark.parametrize("fixed", [True, False])
@pytest.mark.parametrize("rows,cols,d,self_offset", [(70, 45, 40, 1), (45, 70, 32, None), (1, 33, 7, None), (33, 1, 64, 0)])
def test_two_sets_rows_and_columns_equal_float64(rows, cols, d, self_offset, fixed):
    """Tiles past the last row and column, a D that is (32, 64) or is not (7, 40) a multiple of the K slice."""
    g = torch.Generator().manual_seed(rows + cols)
    x, y = (torch.randn(n, d, generator=g, dtype=torch.float64).to(DEVICE) for n in (rows, cols))
    row, col = gemm_sums(x, y, self_offset, True, False, fixed)
    want_r, want_c = _reference_lse(x, y, self_offset)
    assert (row[0] is None) == fixed
    torch.testing.assert_close(_lse(row, fixed).cpu(), want_r, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(_lse(col, fixed).cpu(), want_c, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fixed", [True, False])
@pytest.mark.parametrize("n", [2, 31, 67, 97])
def test_a_single_sets_triangle_gives_the_mirror_rows_their_sums(n, fixed):
    """Only the tiles on and above the diagonal run; every row's slots are written once (a slot left unwritten or
    written twice changes the sum)."""
    x = torch.randn(n, 20, generator=torch.Generator().manual_seed(n), dtype=torch.float64).to(DEVICE)
    row, col = gemm_sums(x, x, 0, False, True, fixed)
    assert col is None
    torch.testing.assert_close(_lse(row, fixed).cpu(), _reference_lse(x, x, 0)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fixed", [True, False])
@pytest.mark.parametrize("d,symmetric", [(24, False), (64, False), (64, True)])
def test_half_rows_take_their_factors_in_the_epilogue(d, symmetric, fixed):
    """bf16 rows multiplied as given, ``S_ij = fx_i fy_j <x_i, y_j>`` applied to the fp32 tile (the GPU's form of a
    normalised bf16 call: a D the K slice divides, or not; two sets, or a single set's triangle)."""
    g = torch.Generator().manual_seed(d)
    x = torch.randn(50, d, generator=g).bfloat16().to(DEVICE)
    y = x if symmetric else torch.randn(50, d, generator=g).bfloat16().to(DEVICE)
    fx = (torch.rand(50, generator=g).to(DEVICE) + 0.5) / d ** 0.5
    fy = fx if symmetric else torch.rand(50, generator=g).to(DEVICE) + 0.5
    row, col = gemm_sums(x, y, 0 if symmetric else None, not symmetric, symmetric, fixed, (fx, fy))
    scaled = fx.double().cpu()[:, None] * (x.double().cpu() @ y.double().cpu().t()) * fy.double().cpu()[None, :]
    if symmetric:
        scaled.fill_diagonal_(float("-inf"))
    torch.testing.assert_close(_lse(row, fixed).cpu().double(), torch.logsumexp(scaled, 1), rtol=1e-6, atol=1e-6)
    if not symmetric:
        torch.testing.assert_close(_lse(col, fixed).cpu().double(), torch.logsumexp(scaled, 0), rtol=1e-6, atol=1e-6)


def test_a_single_sets_triangle_refuses_columns_or_an_offset_self_pair():
    x = torch.randn(8, 4, device=DEVICE)
    with pytest.raises(ValueError, match="single set"):
        gemm_sums(x, x, 1, False, True, True)
    with pytest.raises(ValueError, match="single set"):
        gemm_sums(x, x, 0, True, True, True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("positives", ["diagonal", "ids", "none"])
def test_sigmoid_row_sums_equal_float64(positives, dtype):
    """SigLIP's ``sum_j softplus(-z_ij S_ij)`` per row, ``S = fx_i fy_j <x_i, y_j> + b`` (factors for half rows), a
    positive on a shifted diagonal, by equal ids, or none; 45 x 70 (ragged tiles)."""
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(45, 64, generator=g, dtype=torch.float64), torch.randn(70, 64, generator=g, dtype=torch.float64)
    x, y = x.to(dtype).to(DEVICE), y.to(dtype).to(DEVICE)
    fx, fy = torch.rand(45, generator=g) / 8 + 0.05, torch.rand(70, generator=g) + 0.5
    factors = None if dtype == torch.float64 else (fx.to(DEVICE), fy.to(DEVICE))
    bias = torch.tensor([-2.0], dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=DEVICE)
    ids_r, ids_c = torch.arange(45) % 7, torch.arange(70) % 5
    diagonal = 3 if positives == "diagonal" else None
    keys = kernel_keys((ids_r.to(DEVICE),), (ids_c.to(DEVICE),)) if positives == "ids" else {}
    got = gemm_sigmoid_sums(x, y, bias, factors, diagonal, keys)
    s = x.double().cpu() @ y.double().cpu().t()
    if factors is not None:
        s = fx.double()[:, None] * s * fy.double()[None, :]
    s = s + bias.double().cpu()
    z = -torch.ones_like(s)
    if positives == "diagonal":
        i = torch.arange(45)
        z[i, i + 3] = 1.0
    elif positives == "ids":
        z[ids_r[:, None] == ids_c[None, :]] = 1.0
    want = torch.nn.functional.softplus(-z * s).sum(1)
    tol = 1e-10 if dtype == torch.float64 else 1e-5  # (softplus by Kahan's log1p: a few ulps per term)
    torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol)


LOSSES = {
    "clip": (lambda x, y, t, c: tc.image_text_contrastive_loss(x, y, t, chunk_size=c, backend="gemm"), image_text, 2),
    "clip_ids": (lambda x, y, t, c: tc.image_text_contrastive_loss(x, y, t, torch.arange(x.shape[0], device=x.device) % 4,
                                                                   chunk_size=c, backend="gemm"),
                 lambda x, y, t: image_text(x, y, t, torch.arange(x.shape[0]) % 4), 2),
    "nt_xent_adjacent": (lambda x, y, t, c: tc.nt_xent_loss(x, t, chunk_size=c, backend="gemm"),
                         lambda x, y, t: nt_xent(x, t), 1),
    "nt_xent_halves": (lambda x, y, t, c: tc.nt_xent_loss(x, t, pairing="halves", chunk_size=c, backend="gemm"),
                       lambda x, y, t: nt_xent(x, t, "halves"), 1),
    "supcon_labels": (lambda x, y, t, c: tc.supcon_loss(x, torch.arange(x.shape[0], device=x.device) % 3, temperature=t,
                                                        chunk_size=c, backend="gemm"),
                      lambda x, y, t: supcon(x, t, labels=torch.arange(x.shape[0]) % 3), 1),
    "info_nce_pool": (lambda x, y, t, c: tc.info_nce_loss(x, y, y.flip(0) * 2, t, chunk_size=c, backend="gemm"),
                      lambda x, y, t: info_nce(x, y, y.flip(0) * 2, t), 2),
    "siglip_ids": (lambda x, y, t, c: tc.siglip_loss(x, y, 1 / t, -3.0, torch.arange(x.shape[0], device=x.device) % 6,
                                                     chunk_size=c, backend="gemm"),
                   lambda x, y, t: siglip(x, y, 1 / t, -3.0, torch.arange(x.shape[0]) % 6), 2),
    "siglip_diagonal": (lambda x, y, t, c: tc.siglip_loss(x, y, 1 / t, -3.0, chunk_size=c, backend="gemm"),
                        lambda x, y, t: siglip(x, y, 1 / t, -3.0), 2),
}


@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(LOSSES))
def test_the_losses_on_the_fused_matmul_equal_the_float64_formulas(name, dtype, chunk):
    """Forward from the fused matmul, backward from the epilogue's tiles (one tile, or strips of 16): the soft-max
    losses and SigLIP."""
    ours, ref, n_inputs = LOSSES[name]
    g = torch.Generator().manual_seed(3)
    x, y = (torch.randn(38, 5, generator=g, dtype=torch.float64) for _ in range(2))
    if n_inputs == 1:
        compare(lambda a, t: ours(a, None, t, chunk), lambda a, t: ref(a, None, t), [x], 0.2, dtype, TOLS[dtype])
    else:
        compare(lambda a, b, t: ours(a, b, t, chunk), ref, [x, y], 0.2, dtype, TOLS[dtype])


def _error(backend, tau):
    """The largest gradient error against float64 of a bf16 CLIP call at ``tau`` on ``backend``, relative to the
    largest gradient."""
    g = torch.Generator().manual_seed(11)
    x, y = (torch.randn(45, 24, generator=g).bfloat16() for _ in range(2))
    ref_leaves = [t.double().requires_grad_() for t in (x, y)]
    ref_grads = torch.autograd.grad(image_text(*ref_leaves, torch.tensor(tau, dtype=torch.float64)), ref_leaves)
    leaves = [t.to(DEVICE).requires_grad_() for t in (x, y)]
    with planner.simulate("cuda"):  # the GPU's plan: bf16 rows multiplied as given
        grads = torch.autograd.grad(tc.image_text_contrastive_loss(*leaves, tau, backend=backend), leaves)
    return max(((a.double().cpu() - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, ref_grads))


def test_bf16_at_tau_001_is_within_twice_the_torch_paths_error():
    """The issue's bound: the fused path's bf16 error at tau 0.01 at most twice the torch loops'."""
    ours, torch_loops = _error("gemm", 0.01), _error("torch", 0.01)
    assert ours <= 2 * torch_loops + 1e-6, (ours, torch_loops)


def test_siglip_with_bf16_rows_and_a_learned_scale_and_bias_equals_float64():
    """The GPU's plan (bf16 rows multiplied as given, the scale and norms as factors): the value, the rows' gradients
    at bf16 accuracy, the scale's and the bias's at fp32 accuracy -- the epilogue strategy's tolerances."""
    def loss(a, b, scale, bias, ids):
        with planner.simulate("cuda"):
            return tc.siglip_loss(a, b, scale, bias, ids, backend="gemm")

    bf16_siglip_matches_float64(loss)


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo on CPU tensors")
@pytest.mark.parametrize("fixed", [True, False])
def test_gathered_clip_on_two_ranks_equals_the_torch_backend(fixed):
    """CLIP with ids and uneven sizes at 2 gloo ranks, strips of 16: the column sums completed across ranks."""
    from dist_helpers import ranks_clip_on, run_ranks

    run_ranks(ranks_clip_on, 2, "gemm", fixed, False, 16, False, timeout=300)


@pytest.mark.parametrize("call,words", [
    (lambda x: tc.nt_bxent_loss(x, labels=torch.arange(6, device=x.device) % 2, backend="gemm"), "not pair terms"),
    (lambda x: tc.siglip_loss(x.half(), x.flip(0).half(), 10.0, -10.0, backend="gemm"), "fp16"),
    (lambda x: tc.nt_xent_loss(x.half(), backend="gemm"), "fp16"),
    (lambda x: tc.image_text_contrastive_loss(x, x.flip(0), 0.1, decoupled=True, backend="gemm"), "exclusions"),
])
def test_what_the_fused_matmul_does_not_cover_is_a_clear_error(call, words):
    with pytest.raises(ValueError, match=words):
        call(torch.randn(6, 4, device=DEVICE))


def test_explain_names_the_fused_matmul():
    x = torch.randn(20, 8, device=DEVICE)
    (decision,) = tc.explain(tc.image_text_contrastive_loss, x, x.flip(0), 0.1, backend="gemm")
    assert decision.backend == "gemm" and "fused matmul" in str(decision)


@pytest.mark.parametrize("rows,cols,d,block,symmetric", [(65536, 65536, 768, 128, False), (65536, 65536, 768, 128, True),
                                                         (70, 45, 40, 32, False), (16384, 16384, 512, 128, True)])
def test_the_grids_flops_are_the_products_floor_where_the_tiles_divide_the_rows(rows, cols, d, block, symmetric):
    """Counted from the block sizes: every program's tile, padded, times D; against ``2 R C D`` (a single set's
    triangle: ``2 N (N + 1) / 2 D``). At 65,536 rows the 128-wide grid does the floor and a triangle's diagonal
    tiles' lower halves (1/512 of it); a ragged small problem pays its padding."""
    counted, floor = counted_flops(rows, cols, d, block, symmetric)
    n_i, n_j = -(-rows // block), -(-cols // block)
    tiles = sum(1 for i in range(n_i) for j in range(n_j) if not symmetric or j >= i)  # the grid's programs that run
    assert counted == 2 * tiles * block * block * d
    assert floor == 2 * d * (rows * (rows + 1) // 2 if symmetric else rows * cols)
    if rows % block == 0:
        assert counted <= 1.05 * floor
    else:
        assert counted > floor


def test_one_tile_side_per_dtype():
    """The slots are sized before the autotuner picks a config: every config serving a dtype has the same side, the
    tensor cores' 128 for half rows."""
    from torch_contrastive.engine.triton_backend._configs import ANY, HALF, gemm_tiles

    sides = {dtype: {c.kwargs["BLOCK"] for c in gemm_tiles() if dtype in c.dtypes} for dtype in ANY}
    assert all(len(s) == 1 for s in sides.values()), sides
    assert all(sides[dtype] == {128} for dtype in HALF)
