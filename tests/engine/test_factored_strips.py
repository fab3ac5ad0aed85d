"""The soft-max terms' bounded strips with their backward factored (engine/factored_strips.py): ``exp(S)`` multiplied
against ``[B | v B]`` and ``[A | u A]``, the coefficients applied to the accumulators -- against the float64
formulas, for every shape of the terms (two sets with and without a candidate gradient, a single set's triangle,
a queue of constants, excluded false negatives), in the compute dtype and on tensor-core products; and the
planner's choice of it by the cost model."""

from __future__ import annotations

import pytest
import torch

import reference as ref
import torch_contrastive as tc
from device import DEVICE
from helpers import softmax_cases
from torch_contrastive.engine import factored_strips, planner, softmax
from torch_contrastive.engine.cost import FORMED_STRIPS, PATHS, factoring_pays, formed

CUDA = torch.device("cuda")


def _cases(labels, ids, pool):
    """(name, ours(a, b, chunk), the float64 formula(a, b), which inputs take a gradient)."""
    return [
        *softmax_cases(labels),
        ("clip with duplicate ids", lambda a, b, chunk: tc.image_text_contrastive_loss(a, b, 0.1, ids, ids, chunk_size=chunk,
                                                                                     backend="torch"),
         lambda a, b: ref.image_text(a, b, 0.1, ids.cpu(), ids.cpu()), (True, True)),
        ("info_nce with a pool", lambda a, b, chunk: tc.info_nce_loss(a, b, pool.to(a.dtype), 0.1, chunk_size=chunk, backend="torch"),
         lambda a, b: ref.info_nce(a, b, pool.cpu().double(), 0.1), (True, True)),
        ("info_nce without false negatives",
         lambda a, b, chunk: tc.info_nce_loss(a, b, temperature=0.1, key_ids=ids, chunk_size=chunk, backend="torch"),
         lambda a, b: ref.info_nce_masked(a, b, None, 0.1, key_ids=ids.cpu()), (True, True)),
    ]


def _spied(monkeypatch):
    calls = []
    real = factored_strips.backward_factored

    def spy(*args):
        calls.append(args[0].half)
        return real(*args)
    monkeypatch.setattr(softmax, "backward_factored", spy)
    return calls


@pytest.mark.parametrize("products", ["compute", "half"])
def test_the_factored_strips_equal_the_float64_formulas(products, monkeypatch):
    """Every case on strips of 8 rows with the factored backward: float64 rows to 1e-10 (the compute dtype), bf16
    rows on the simulated GPU's tensor-core products to bf16's rounding (``exp(S)`` and the operands each rounded
    once)."""
    monkeypatch.setattr(planner, "FACTORED", "on")
    monkeypatch.setattr(planner, "PRODUCTS", products)
    calls = _spied(monkeypatch)
    n = 30
    labels = torch.arange(n, device=DEVICE) % 4
    ids = torch.arange(n, device=DEVICE) // 3  # three rows share each id
    g = torch.Generator().manual_seed(11)
    pool = torch.randn(9, 6, generator=g, dtype=torch.float64).bfloat16().double().to(DEVICE)  # exact in bf16
    x, y = (torch.randn(n, 6, generator=g, dtype=torch.float64) * 2 for _ in range(2))
    dtype = torch.float64 if products == "compute" else torch.bfloat16
    for name, ours, formula, grads in _cases(labels, ids, pool):
        a, b = (t.to(dtype).to(DEVICE).requires_grad_(w) for t, w in zip((x, y), grads))
        before = len(calls)
        if products == "half":
            with planner.simulate("cuda"):
                got = ours(a, b, 8)
                got.backward()
        else:
            got = ours(a, b, 8)
            got.backward()
        assert len(calls) > before, name
        wides = [t.to(dtype).double().requires_grad_(w) for t, w in zip((x, y), grads)]
        want = formula(*wides)
        want.backward()
        tol = 1e-10 if dtype == torch.float64 else 2e-6
        assert float(got.detach()) == pytest.approx(float(want.detach()), rel=tol, abs=tol), name
        for ours_x, wide in zip((a, b), wides):
            if wide.grad is None:
                continue
            err = float((ours_x.grad.double().cpu() - wide.grad).abs().max() / wide.grad.abs().max())
            assert err < (1e-10 if dtype == torch.float64 else 1e-2), (name, err)
    assert any(calls) == (products == "half")  # tensor-core products factored (bf16 exp(S), bf16 operands)


def test_a_learnable_temperature_on_tensor_cores_keeps_the_formed_tile(monkeypatch):
    """A tensor scale's gradient multiplies the formed tile's rounding remainder (engine/products.py): the plan does
    not factor it even in the bounded regime forced and factoring asked for; the scale's gradient stays fp32-accurate
    (against float64)."""
    monkeypatch.setattr(planner, "FACTORED", "on")
    monkeypatch.setattr(planner, "PRODUCTS", "half")
    calls = _spied(monkeypatch)
    g = torch.Generator().manual_seed(3)
    x, y = (torch.nn.functional.normalize(torch.randn(20, 8, generator=g, dtype=torch.float64), dim=1).bfloat16()
            for _ in range(2))
    scale = torch.tensor(10.0, dtype=torch.float64)
    got_scale = scale.float().to(DEVICE).requires_grad_()
    with planner.simulate("cuda"):
        row, _ = softmax.softmax_terms(x.to(DEVICE), y.to(DEVICE), got_scale, self_offset=None, fixed=True, chunk_size=8,
                                        backend="torch")
        row.sum().backward()
    assert calls == []
    want_scale = scale.clone().requires_grad_()
    torch.logsumexp(want_scale * x.double() @ y.double().t(), 1).sum().backward()
    assert float(got_scale.grad) == pytest.approx(float(want_scale.grad), rel=1e-4)


def _decide(device, dtype, n, d, **kw):
    args = {"kernel": "softmax", "rows": n, "cols": n, "device": device, "dtype": dtype, "other_dtype": dtype,
            "chunk_size": None, "backend": "torch", "fixed": True, "traits": planner.Traits(d, True, False, None)}
    return planner.decide(**{**args, **kw})


def test_the_planner_factors_where_the_model_prices_it_lower(monkeypatch):
    """On a GPU's strips: bf16 on tensor cores factors (two GEMM-equivalents at the bf16 rate against 7.5 passes);
    fp16 never (``exp(S)`` overflows it); fp32 at 512 features forms the tile (the fp32 rate makes the wider GEMMs
    cost more than the four passes they save), at 32 it factors; one tile and the online regime never; a CPU only
    when asked (``FACTORED``)."""
    monkeypatch.setattr(planner, "PRODUCTS", "auto")
    assert _decide(CUDA, torch.bfloat16, 16384, 512).factored
    assert not _decide(CUDA, torch.float16, 16384, 512).factored
    assert not _decide(CUDA, torch.float32, 16384, 512).factored
    assert _decide(CUDA, torch.float32, 16384, 32).factored
    assert not _decide(CUDA, torch.bfloat16, 1024, 512).factored  # one tile
    assert not _decide(CUDA, torch.bfloat16, 16384, 512, fixed=False, bound=None).factored
    assert not _decide(torch.device("cpu"), torch.float32, 4096, 32).factored
    monkeypatch.setattr(planner, "FACTORED", "on")
    assert _decide(torch.device("cpu"), torch.float32, 4096, 32).factored
    monkeypatch.setattr(planner, "FACTORED", "off")
    assert not _decide(CUDA, torch.bfloat16, 16384, 512).factored


def test_factoring_pays_weighs_the_wider_gemms_against_the_formed_tiles_passes():
    """The model's comparison: the formed path is the factored one plus FORMED_STRIPS; factoring pays where the
    formed tile's passes and launches cost more than the GEMMs' extra width, at the GEMMs' own rate."""
    path, extra = PATHS[("columns", "torch", "half")], FORMED_STRIPS[("columns", "half")]
    made = formed(path, extra)
    assert made.passes_strips == pytest.approx(path.passes_strips + extra.passes)
    assert made.gemms_strips == pytest.approx(path.gemms_strips + extra.gemms) and extra.gemms < 0
    assert factoring_pays(path, extra, 16384, 16384, 512, "bfloat16", 4)
    assert not factoring_pays(path, extra, 16384, 16384, 16384, "bfloat16", 4)  # wide rows: the GEMMs dominate
    wide, wide_extra = PATHS[("columns", "torch", "fp32")], FORMED_STRIPS[("columns", "fp32")]
    assert not factoring_pays(wide, wide_extra, 16384, 16384, 512, "float32", 4)
    assert factoring_pays(wide, wide_extra, 16384, 16384, 32, "float32", 4)
