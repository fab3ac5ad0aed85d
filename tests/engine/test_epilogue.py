"""backend="epilogue": cuBLAS GEMMs (``torch.mm``) with Triton epilogues equal the float64
references and the torch backend -- one tile kept from forward and strips of tiles (the
single-set triangle's mirror tiles included), both regimes, exclusions, a queue, ranks.

Without CUDA the epilogue kernels run in Triton's interpreter (``TRITON_INTERPRET=1``); sizes
stay small because it is slow. Skipped when triton is not installed.
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
from helpers import bf16_siglip_matches_float64, compare, queue_problem, two_set_problem  # noqa: E402
from reference import image_text, info_nce, info_nce_masked, nt_xent, supcon  # noqa: E402
from torch_contrastive.engine import softmax_terms  # noqa: E402
from torch_contrastive.positives import Exclusion, Positives  # noqa: E402

TOLS = {torch.float64: (1e-9, 1e-9), torch.float32: (1e-5, 1e-5)}
#: one tile (kept from forward), and strips of 16 (several tiles; a single set's upper triangle)
CHUNKS = [None, 16]


def _grads(fn, leaves, backend):
    copies = [x.detach().clone().requires_grad_(x.requires_grad) for x in leaves]
    value = fn(*copies, backend)
    return value.detach(), torch.autograd.grad(value.sum(), [c for c in copies if c.requires_grad])


def _same_as_torch(fn, leaves, tol):
    (v0, g0), (v1, g1) = _grads(fn, leaves, "torch"), _grads(fn, leaves, "epilogue")
    torch.testing.assert_close(v1, v0, rtol=tol, atol=tol)
    for x, y in zip(g1, g0):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol * max(1.0, y.abs().max().item()))


LOSSES = {
    "nt_xent_halves": (lambda x, y, t, c: tc.nt_xent_loss(x, t, pairing="halves", chunk_size=c, backend="epilogue"),
                       lambda x, y, t: nt_xent(x, t, "halves"), 1),
    "nt_xent_adjacent": (lambda x, y, t, c: tc.nt_xent_loss(x, t, chunk_size=c, backend="epilogue"),
                         lambda x, y, t: nt_xent(x, t), 1),
    "supcon_labels": (lambda x, y, t, c: tc.supcon_loss(x, torch.arange(x.shape[0], device=x.device) % 3, temperature=t,
                                                        chunk_size=c, backend="epilogue"),
                      lambda x, y, t: supcon(x, t, labels=torch.arange(x.shape[0]) % 3), 1),
    "clip_ids": (lambda x, y, t, c: tc.image_text_contrastive_loss(x, y, t, torch.arange(x.shape[0], device=x.device) % 4,
                                                                   chunk_size=c, backend="epilogue"),
                 lambda x, y, t: image_text(x, y, t, torch.arange(x.shape[0]) % 4), 2),
    "info_nce_pool": (lambda x, y, t, c: tc.info_nce_loss(x, y, y.flip(0) * 2, t, chunk_size=c, backend="epilogue"),
                      lambda x, y, t: info_nce(x, y, y.flip(0) * 2, t), 2),
}


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(LOSSES))
def test_losses_on_the_epilogue_equal_the_float64_references(name, dtype, chunk):
    ours, ref, n_inputs = LOSSES[name]
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(38, 5, generator=g, dtype=torch.float64), torch.randn(38, 5, generator=g, dtype=torch.float64)
    if n_inputs == 1:
        compare(lambda a, t: ours(a, None, t, chunk), lambda a, t: ref(a, None, t), [x], 0.2, dtype, TOLS[dtype])
    else:
        compare(lambda a, b, t: ours(a, b, t, chunk), lambda a, b, t: ref(a, b, t), [x, y], 0.2, dtype, TOLS[dtype])


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("fixed", [True, False])
@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 45), (45, 7), (33, 33)])
@pytest.mark.parametrize("relation", ["partner", "keys", "none"])
def test_two_sets_with_columns_weights_and_a_learned_scale(relation, rows, cols, fixed, chunk):
    """Row and column terms, per-row weights, a scale with a gradient; the bounded regime (one exp)
    and the online maximum; one tile and strips whose columns are folded from per-row-block partials."""
    a, b, scale, pos, weights = two_set_problem(rows, cols, relation)

    def fn(x, y, s, backend):
        r, c = softmax_terms(x, y, s, self_offset=None, positives=pos, row_weights=weights, columns=True, normalize=fixed,
                             fixed=fixed, chunk_size=chunk, backend=backend)
        return r.sum() + 0.7 * c.sum()

    _same_as_torch(fn, [a, b, scale], 1e-10)


@pytest.mark.parametrize("fixed", [True, False])
@pytest.mark.parametrize("n", [2, 10, 40])
def test_a_single_sets_triangle_feeds_the_mirror_rows(n, fixed):
    """Strips of 16 over a single set: only upper-triangle tiles are read, and an off-diagonal
    tile's column partials are its mirror rows' sums."""
    a = torch.randn(n, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(n)).to(DEVICE).requires_grad_()
    pos = Positives.from_partner(torch.arange(n, device=DEVICE) ^ 1, n, self_offset=0)

    def fn(x, backend):
        return softmax_terms(x, x, 2.5, self_offset=0, positives=pos, symmetric=True, normalize=fixed, fixed=fixed,
                             chunk_size=16, backend=backend)[0]

    _same_as_torch(fn, [a], 1e-10)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_constant_candidates_behind_live_ones(chunk):
    """A queue behind the live keys (``grad_columns``): the column tiles stop at the live keys."""
    q, k, queue, pos = queue_problem()

    def fn(x, y, backend):
        return softmax_terms(x, torch.cat([y, queue]), 4.0, self_offset=None, positives=pos, normalize=True, grad_columns=11,
                             chunk_size=chunk, backend=backend)[0]

    _same_as_torch(fn, [q, k], 1e-10)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("rule", ["ids", "guide", "decoupled"])
def test_false_negatives_equal_the_minus_inf_reference(rule, chunk):
    """Ids, a guide's verdicts and DCL's partner applied in the epilogue (the exclusion rule of the
    fused kernels, read at the tile's own rows and columns), against the float64 loop."""
    g = torch.Generator().manual_seed(len(rule))
    q, k, neg = (torch.randn(n, 6, generator=g, dtype=torch.float64).to(DEVICE) for n in (45, 45, 40))
    if rule == "guide":
        gq, gk, gn = (torch.randn(n, 20, generator=g, dtype=torch.float64).to(DEVICE) for n in (45, 45, 40))
        gk = gq + 0.3 * gk
        gq[10], gq[30] = gq[40], gq[2]  # near-duplicates: one candidate leaves
        kwargs = dict(guide=(gq, gk, gn), guide_margin=0.1)
        ref_kwargs = dict(guide=(gq, gk, gn), margin=0.1)
    elif rule == "ids":
        kwargs = ref_kwargs = dict(key_ids=torch.arange(45, device=DEVICE) % 7, negative_ids=torch.arange(40, device=DEVICE) % 5)
    else:
        kwargs = ref_kwargs = dict(decoupled=True)
    leaves = [x.clone().requires_grad_() for x in (q, k, neg)]
    value = tc.info_nce_loss(*leaves, 0.2, chunk_size=chunk, backend="epilogue", **kwargs)
    grads = torch.autograd.grad(value, leaves)
    ref_leaves = [x.detach().cpu().requires_grad_() for x in leaves]
    ref_kwargs = {k: (tuple(t.cpu() for t in v) if isinstance(v, tuple) else v.cpu() if isinstance(v, torch.Tensor) else v)
                  for k, v in ref_kwargs.items()}
    ref = info_nce_masked(*ref_leaves, torch.tensor(0.2, dtype=torch.float64), **ref_kwargs)
    ref_grads = torch.autograd.grad(ref, ref_leaves)
    torch.testing.assert_close(value.cpu(), ref, rtol=1e-9, atol=1e-9)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("name", ["clip", "nt_xent_halves", "info_nce_queue", "clip_float_tau"])
def test_bf16_inputs_at_a_low_temperature_equal_the_float64_formula(name, chunk):
    """tau = 0.01, bf16 rows multiplied as given (fp32 logits), the scale and the normalisation
    applied in the epilogue, the gradient tiles rounded once to bf16 with each product's factor
    folded in (and the rows' remainder when the temperature has a gradient): the torch backend's tolerances."""
    g = torch.Generator().manual_seed(11)
    x, y, queue = torch.randn(45, 24, generator=g), torch.randn(45, 24, generator=g), torch.randn(30, 24, generator=g)
    tols = (2e-5, 1e-2)
    if name == "clip":
        compare(lambda a, b, t: tc.image_text_contrastive_loss(a, b, t, chunk_size=chunk, backend="epilogue"), image_text,
                [x, y], 0.01, torch.bfloat16, tols)
    elif name == "clip_float_tau":  # a float scale: one rounded row tile, no remainder
        leaves = [t.to(torch.bfloat16).to(DEVICE).requires_grad_() for t in (x, y)]
        value = tc.image_text_contrastive_loss(*leaves, 0.01, chunk_size=chunk, backend="epilogue")
        grads = torch.autograd.grad(value, leaves)
        ref_leaves = [t.detach().double().cpu().requires_grad_() for t in leaves]
        ref = image_text(*ref_leaves, torch.tensor(0.01, dtype=torch.float64))
        ref_grads = torch.autograd.grad(ref, ref_leaves)
        assert value.item() == pytest.approx(ref.item(), rel=tols[0])
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a.double().cpu(), b, rtol=tols[1], atol=tols[1] * b.abs().max().item())
    elif name == "nt_xent_halves":
        compare(lambda a, t: tc.nt_xent_loss(a, t, pairing="halves", chunk_size=chunk, backend="epilogue"),
                lambda a, t: nt_xent(a, t, "halves"), [x[:44]], 0.01, torch.bfloat16, tols)
    else:
        q = queue.to(torch.bfloat16).to(DEVICE)
        compare(lambda a, b, t: tc.info_nce_loss(a, b, q, t, chunk_size=chunk, backend="epilogue"),
                lambda a, b, t: info_nce(a, b, q.double().cpu(), t), [x, y], 0.01, torch.bfloat16, tols)


def test_the_same_bits_on_every_run_without_deterministic_mode():
    """No atomics anywhere (column partials are added in row-block order): two runs agree bit for bit."""
    g = torch.Generator().manual_seed(2)
    x, y = (torch.randn(70, 8, generator=g).to(DEVICE).requires_grad_() for _ in range(2))
    runs = []
    for _ in range(2):
        loss = tc.image_text_contrastive_loss(x, y, 0.05, chunk_size=32, backend="epilogue")
        runs.append((loss.detach(), *torch.autograd.grad(loss, [x, y])))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo on CPU tensors")
@pytest.mark.parametrize("fixed", [True, False])
def test_distributed_column_statistics_equal_the_torch_backend(fixed):
    """CLIP with ids, DCL and uneven sizes at 2 ranks (gloo), strips of 16: each rank's column
    partials are completed across ranks as the torch backend's."""
    from dist_helpers import ranks_clip_on, run_ranks

    run_ranks(ranks_clip_on, 2, "epilogue", fixed, False, 16, timeout=300)


@pytest.mark.parametrize("call,words", [
    (lambda x: tc.nt_xent_loss(x.half(), backend="epilogue"), "fp16"),
    (lambda x: tc.siglip_loss(x.half(), x.flip(0).half(), 10.0, -10.0, backend="epilogue"), "fp16"),
    (lambda x: tc.nt_bxent_loss(x.half(), labels=torch.arange(6, device=x.device) % 2, backend="epilogue"), "fp16"),
    (lambda x: softmax_terms(x, x, 1.0, self_offset=None, backend="epilogue",
                             exclude=Exclusion(relation=Positives.from_pairs(torch.tensor([[0, 1]]), 6, 6))), "'pairs' relation"),
])
def test_what_the_epilogue_does_not_cover_is_a_clear_error(call, words):
    with pytest.raises(ValueError, match=words):
        call(torch.randn(6, 4, device=DEVICE))


def test_explain_names_the_epilogue():
    x = torch.randn(20, 8, device=DEVICE)
    (decision,) = tc.explain(tc.image_text_contrastive_loss, x, x.flip(0), 0.1, backend="epilogue")
    assert decision.backend == "epilogue" and "Triton epilogues" in str(decision)


CONFIDENT = {
    "clip": lambda x, y, t, b: tc.image_text_contrastive_loss(x, y, t, backend=b),
    "clip_strips": lambda x, y, t, b: tc.image_text_contrastive_loss(x, y, t, chunk_size=16, backend=b),
    "nt_xent_halves": lambda x, y, t, b: tc.nt_xent_loss(torch.cat([x, y]), t, pairing="halves", backend=b),
    "nt_xent_adjacent_strips": lambda x, y, t, b: tc.nt_xent_loss(torch.stack([x, y], 1).flatten(0, 1), t, chunk_size=16,
                                                                  backend=b),
    "supcon": lambda x, y, t, b: tc.supcon_loss(torch.stack([x, y], 1), temperature=t, backend=b),
}


@pytest.mark.parametrize("dtype,value_tol,grad_tol", [(torch.float32, 2e-5, 1e-4), (torch.bfloat16, 2e-5, 1e-2)])
@pytest.mark.parametrize("name", list(CONFIDENT))
def test_a_confident_model_keeps_its_digits(name, dtype, value_tol, grad_tol):
    if name == "supcon":  # positives by sample keys are not kept apart: fp32's cancellation, as on torch (~4e-4)
        value_tol, grad_tol = 2e-3, max(grad_tol, 2e-3)
    """tau = 0.05 and views that nearly agree: each row's positive dominates, so ``LSE - S_p`` and the
    positive's ``p - 1`` are tiny differences of large numbers. A lone positive is kept apart from the
    sums (left out in the kernels) and every positive's coefficient is added to the gradient tile before
    it is rounded: values to fp32 rounding, a learned temperature's gradient with them (bf16: the row
    tile's remainder), input gradients to the input dtype -- against the float64 torch backend. SupCon's
    positives (sample keys) are folded into the tile but not kept apart: its value and temperature keep
    fp32's cancellation, as the torch backend's do."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 32, generator=g)
    y = x + 0.5 * torch.randn(40, 32, generator=g)
    leaves = [t.to(dtype).to(DEVICE).requires_grad_() for t in (x, y)]
    tau = torch.tensor(0.05, device=DEVICE, requires_grad=True)
    value = CONFIDENT[name](*leaves, tau, "epilogue")
    grads = torch.autograd.grad(value, [*leaves, tau])
    ref_leaves = [t.detach().double().cpu().requires_grad_() for t in leaves]
    ref_tau = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
    ref = CONFIDENT[name](*ref_leaves, ref_tau, "torch")
    ref_grads = torch.autograd.grad(ref, [*ref_leaves, ref_tau])
    assert value.item() == pytest.approx(ref.item(), rel=value_tol)
    assert grads[2].item() == pytest.approx(ref_grads[2].item(), rel=10 * value_tol)
    for a, b in zip(grads[:2], ref_grads[:2]):
        torch.testing.assert_close(a.double().cpu(), b, rtol=grad_tol, atol=grad_tol * b.abs().max().item())


def test_a_queue_gets_no_column_gradient_tiles():
    """Behind the live keys a queue's columns are constants: the gradient kernel writes column tiles
    only as wide as the live keys (what it declares to a cost count)."""
    from torch_contrastive.engine.triton_backend._host import LAUNCH_LISTENERS

    widths = []

    class Listener:
        def launch_begins(self, name, reads, writes):
            if name == "epilogue_grad":
                widths.append([tuple(t.shape) for t in writes])

        def launch_ends(self):
            pass

    q, k, queue, pos = queue_problem()
    q, k, queue = (t.detach().to(torch.bfloat16).requires_grad_(t.requires_grad) for t in (q, k, queue))
    LAUNCH_LISTENERS.append(listener := Listener())
    try:
        softmax_terms(q, torch.cat([k, queue]), 4.0, self_offset=None, positives=pos, normalize=True, grad_columns=11,
                      backend="epilogue")[0].sum().backward()
    finally:
        LAUNCH_LISTENERS.remove(listener)
    assert widths == [[(11, 51), (11, 11)]]  # the row product's tile, the column product's (live keys only)


@pytest.mark.parametrize("chunk", [*CHUNKS, "strips"])
def test_siglip_with_bf16_rows_and_a_learned_scale_and_bias(chunk, monkeypatch):
    """SigLIP on the epilogue with bf16 rows, ids and a learnable scale and bias: the row tile keeps its
    rounding remainder, so the scale's and the bias's gradients hold fp32-level accuracy. One tile, square
    tiles of 16, and the GPU plan's row strips (3 of 16 rows x 45 columns at a small budget)."""
    import contextlib

    from torch_contrastive.engine import planner

    within = contextlib.nullcontext()
    if chunk == "strips":
        monkeypatch.setattr(planner, "_GPU_TILE_QUANTUM", 8)
        chunk, within = None, planner.simulate("cuda", budget=16 * 45 * 8)

    def loss(a, b, scale, bias, ids):
        with within:
            if not isinstance(within, contextlib.nullcontext):
                (decision,) = tc.explain(tc.siglip_loss, a, b, scale, bias, ids, backend="epilogue")
                assert "3 strips of 16x45" in str(decision), str(decision)
            return tc.siglip_loss(a, b, scale, bias, ids, chunk_size=chunk, backend="epilogue")

    bf16_siglip_matches_float64(loss)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("loss", ["pml", "nt_bxent"])
def test_the_mask_in_tile_losses_with_bf16_rows(loss, chunk):
    """PML NT-Xent and NT-BXent on the epilogue with bf16 rows and a learned temperature: raw bf16
    products in fp32, the relation formed in registers, the gradient tiles rounded once per product
    (with the rows' remainder) -- against the float64 formula."""
    from reference import nt_bxent, nt_xent_pml

    g = torch.Generator().manual_seed(6)
    x = torch.randn(40, 16, generator=g)
    labels = torch.arange(40) % 6
    if loss == "pml":
        compare(lambda z, t: tc.nt_xent_loss(z, t, labels=labels.to(DEVICE), chunk_size=chunk, backend="epilogue"),
                lambda z, t: nt_xent_pml(z, labels, t), [x], 0.1, torch.bfloat16, (2e-5, 1e-2))
    else:
        compare(lambda z, t: tc.nt_bxent_loss(z, temperature=t, labels=labels.to(DEVICE), chunk_size=chunk, backend="epilogue"),
                lambda z, t: nt_bxent(z, t, labels=labels), [x], 0.1, torch.bfloat16, (2e-5, 1e-2))


STRIPS = {
    "clip_ids": (lambda x, y, t: tc.image_text_contrastive_loss(x, y, t, torch.arange(x.shape[0], device=x.device) % 4,
                                                                backend="epilogue"),
                 lambda x, y, t: image_text(x, y, t, torch.arange(x.shape[0]) % 4)),
    "info_nce_pool": (lambda x, y, t: tc.info_nce_loss(x, y, y.flip(0) * 2, t, backend="epilogue"),
                      lambda x, y, t: info_nce(x, y, y.flip(0) * 2, t)),
    "pml": (lambda x, y, t: tc.nt_xent_loss(x, t, labels=torch.arange(x.shape[0], device=x.device) % 6, backend="epilogue"),
            lambda x, y, t: __import__("reference").nt_xent_pml(x, torch.arange(x.shape[0]) % 6, t)),
    "nt_bxent": (lambda x, y, t: tc.nt_bxent_loss(x, temperature=t, labels=torch.arange(x.shape[0], device=x.device) % 6,
                                                  backend="epilogue"),
                 lambda x, y, t: __import__("reference").nt_bxent(x, t, labels=torch.arange(x.shape[0]) % 6)),
}


@pytest.mark.parametrize("name", list(STRIPS))
def test_row_strips_across_every_column_equal_the_float64_references(name, monkeypatch):
    """Where a strip of rows across all columns fits the GPU budget and strips are fewer than square tiles
    (:func:`~torch_contrastive.engine.planner.strip_rows`), the epilogue walks row strips: each tile's column
    partials folded as for squares, the pair terms' two passes over the same strips. The GPU's plan at a small
    size: a 5,120-byte budget and 8-row quanta give 40 rows 3 strips of 16 x all columns (squares: 2 x 2 of 24)."""
    from torch_contrastive.engine import planner

    monkeypatch.setattr(planner, "_GPU_TILE_QUANTUM", 8)
    ours, ref = STRIPS[name]
    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(40, 6, generator=g), torch.randn(40, 6, generator=g)
    from torch_contrastive.engine.triton_backend._host import LAUNCH_LISTENERS

    tiles = []

    class Listener:  # the logit tiles the epilogue kernels read: each a strip across every column
        def launch_begins(self, name, reads, writes):
            tiles.extend(tuple(t.shape) for t in reads if t.dim() == 2 and t.shape[1] != 6)

        def launch_ends(self):
            pass

    with planner.simulate("cuda", budget=16 * 40 * 8):
        decisions = tc.explain(ours, x.to(DEVICE), y.to(DEVICE), 0.2)
        assert decisions and all(d.tile_cols == d.cols == 40 and "3 strips of 16x40" in str(d) for d in decisions)
        LAUNCH_LISTENERS.append(listener := Listener())
        try:
            if name in ("pml", "nt_bxent"):  # one set
                compare(lambda a, t: ours(a, None, t), lambda a, t: ref(a, None, t), [x], 0.2, torch.float32,
                        TOLS[torch.float32])
            else:
                compare(ours, ref, [x, y], 0.2, torch.float32, TOLS[torch.float32])
        finally:
            LAUNCH_LISTENERS.remove(listener)
    # (InfoNCE's learned temperature meets the pool as 80 candidates: strips of 8 rows x 80)
    width = 80 if name == "info_nce_pool" else 40
    assert tiles and all(r <= 16 and c == width for r, c in tiles), set(tiles)


def test_the_tile_walk_covers_every_entry_once_in_squares_and_strips():
    from torch_contrastive.engine.tiling import tiles

    for rows, cols, tile, tile_cols, symmetric in [(10, 7, 3, 0, False), (10, 10, 3, 0, True), (10, 7, 3, 7, False),
                                                   (10, 23, 4, 23, False), (5, 9, 2, 4, False)]:
        seen = torch.zeros(rows, cols, dtype=torch.int64)
        visited = list(tiles(rows, cols, tile, symmetric, tile_cols))
        for r0, r1, c0, c1 in visited:
            assert r1 - r0 <= tile and c1 - c0 <= (tile_cols or tile)
            seen[r0:r1, c0:c1] += 1
        per_side = -(-rows // tile), -(-cols // (tile_cols or tile))
        assert len(visited) == (per_side[0] * (per_side[0] + 1) // 2 if symmetric else per_side[0] * per_side[1])
        want = torch.ones(rows, cols, dtype=torch.int64)
        if symmetric:  # the upper triangle of square tiles
            want = torch.tensor([[int(c // tile >= r // tile) for c in range(cols)] for r in range(rows)])
        assert torch.equal(seen, want)
    with pytest.raises(ValueError, match="tile_cols must be 0"):
        next(tiles(10, 10, 3, True, 10))


@pytest.mark.parametrize("chunk", CHUNKS)
def test_one_tile_keeps_its_normalised_rows_and_strips_keep_the_half_rows(chunk):
    """bf16 rows on the epilogue: over several tiles backward keeps only the caller's half rows and
    rebuilds the fp32 unit rows (one row kernel per set); one tile keeps its R x C logits from forward
    and its fp32 unit rows beside them, so backward launches no row kernel. Gradients as the torch backend's."""
    from torch_contrastive.engine.triton_backend._host import LAUNCH_LISTENERS

    g = torch.Generator().manual_seed(9)
    x, y = (torch.randn(40, 24, generator=g).to(DEVICE, torch.bfloat16).requires_grad_() for _ in range(2))
    kept, launched = [], []

    class Listener:
        def launch_begins(self, name, reads, writes):
            launched.append(name)

        def launch_ends(self):
            pass

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = tc.image_text_contrastive_loss(x, y, 0.1, chunk_size=chunk, backend="epilogue")
    LAUNCH_LISTENERS.append(listener := Listener())
    try:
        grads = torch.autograd.grad(loss, [x, y])
    finally:
        LAUNCH_LISTENERS.remove(listener)
    wide = [t for t in kept if t.dtype == torch.float32 and t.dim() == 2 and t.shape[1] == 24]
    assert len(wide) == (2 if chunk is None else 0)
    assert launched.count("normalize_rows") == (0 if chunk is None else 2), launched
    reference = torch.autograd.grad(tc.image_text_contrastive_loss(x, y, 0.1, chunk_size=chunk, backend="torch"), [x, y])
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)


def _launch_names():
    """A listener on the Triton launches the host code announces, and the names it heard."""
    from torch_contrastive.engine.triton_backend._host import LAUNCH_LISTENERS

    names: list[str] = []

    class Listener:
        def launch_begins(self, name, reads, writes):
            names.append(name)

        def launch_ends(self):
            pass

    return LAUNCH_LISTENERS, Listener(), names


@pytest.mark.parametrize("labels", ["six", "one_alone", "all_equal"])
@pytest.mark.parametrize("strips", [False, True])
@pytest.mark.parametrize("fixed", [True, False])
def test_pml_forward_in_one_launch_per_tile_equals_the_float64_formula(fixed, strips, labels, monkeypatch):
    """PML NT-Xent where every tile holds all its rows' columns (one tile; row strips across them): each tile's
    negatives' log-sum-exps and positive terms in one launch -- both regimes (bounded: normalised rows at a
    float temperature; online maximum: raw dot products), a row whose label no other row has (no positive),
    and every row alike (no negative: L = -inf, the terms 0) -- against the float64 formula, one
    ``epilogue_pml_sums`` launch per tile and no separate log-sum-exp pass."""
    from reference import nt_xent_pml
    from torch_contrastive.engine import planner

    g = torch.Generator().manual_seed(11)
    x = torch.randn(40, 6, generator=g, dtype=torch.float64) * (1.0 if fixed else 3.0)
    keys = {"six": torch.arange(40) % 6, "one_alone": torch.cat([torch.arange(39) % 4, torch.tensor([9])]),
            "all_equal": torch.zeros(40, dtype=torch.long)}[labels]

    def ours(z, t):
        return tc.nt_xent_loss(z, 0.2 if fixed else t, labels=keys.to(z.device), normalize=fixed, backend="epilogue")

    def ref(z, t):
        return nt_xent_pml(z, keys, 0.2 if fixed else t, normalize=fixed)

    monkeypatch.setattr(planner, "_GPU_TILE_QUANTUM", 8)
    with planner.simulate("cuda", budget=16 * 40 * 8 if strips else None):
        (decision,) = tc.explain(ours, x.to(DEVICE), torch.tensor(0.2))
        assert decision.fixed is fixed and (decision.tile == 0) is not strips
        listeners, listener, names = _launch_names()
        listeners.append(listener)
        try:
            if fixed:  # a float temperature: no temperature gradient to compare
                z = x.clone().to(DEVICE).requires_grad_()
                z_ref = x.clone().requires_grad_()
                value, expected = ours(z, None), ref(z_ref, None)
                value.backward()
                expected.backward()
                assert value.item() == pytest.approx(expected.item(), rel=1e-9, abs=1e-9)
                torch.testing.assert_close(z.grad.cpu(), z_ref.grad, rtol=1e-9, atol=1e-9)
            else:
                compare(ours, ref, [x], 0.2, torch.float64, TOLS[torch.float64])
        finally:
            listeners.remove(listener)
    forward = [n for n in names if n in ("epilogue_pml_sums", "epilogue_sums", "epilogue_pair_sums")]
    assert forward == ["epilogue_pml_sums"] * (-(-40 // decision.tile) if strips else 1), names
