"""The Triton row normalisation and its backward (``triton_backend.normalize_rows`` and
``normalize_rows_grad``) against float64 references, and the engine's use of them on the
epilogue and fused backends (one launch per input each way; fp64 keeps the torch form).

Without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``).
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
from torch_contrastive.cli.traffic import count  # noqa: E402
from torch_contrastive.engine.triton_backend.normalize_rows import normalize_rows  # noqa: E402
from torch_contrastive.engine.triton_backend.normalize_rows_grad import normalize_rows_grad  # noqa: E402

EPS = 1e-12
#: (rows, features): a partial row block, features past one block (the kernels walk them), one row
SHAPES = [(37, 45), (5, 300), (1, 7)]


def _rows(n: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows with the edge cases in front: an all-zero row, one below the floor, one whose
    squares overflow fp32 (fp32 only: bf16 has the same range, so the same row, but its values round)."""
    g = torch.Generator().manual_seed(n * 1000 + d)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    if n >= 3:
        x[0] = 0.0
        x[1] *= 1e-14
        x[2] *= 1e25
    return x.to(dtype).to(DEVICE)


def _reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, norm)`` in float64 from the formula."""
    x64 = x.double()
    norm = torch.sqrt((x64 * x64).sum(1, keepdim=True))
    return x64 / norm.clamp_min(EPS), norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_normalize_rows_is_the_formula(shape, dtype):
    x = _rows(*shape, dtype)
    y, denom, norm = normalize_rows(x, EPS)
    want_y, want_norm = _reference(x)
    assert y.dtype == torch.float32 and denom.shape == norm.shape == (shape[0], 1)
    torch.testing.assert_close(y.double(), want_y, rtol=2e-7, atol=1e-30)
    torch.testing.assert_close(norm.double(), want_norm, rtol=1e-7, atol=0.0)
    torch.testing.assert_close(denom, norm.clamp_min(EPS), rtol=0, atol=0)
    assert torch.isfinite(y).all()  # the overflowing row too: its squares were summed in fp64
    # given the denominators, the rows are rebuilt to the same bits (backward's lean path)
    again, same_denom, no_norm = normalize_rows(x, EPS, denom)
    assert torch.equal(again, y) and same_denom is denom and no_norm is None


def _reference_grad(x: torch.Tensor, g: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 autograd of ``scale * x / max(||x||, eps)``; an all-zero row gets no gradient (the
    engine's convention: the map is not differentiable there)."""
    x64 = x.double().requires_grad_()
    y = x64 / torch.linalg.vector_norm(x64, dim=1, keepdim=True).clamp_min(EPS)
    (grad,) = torch.autograd.grad((y * g.double()).sum() * scale, x64)
    return torch.where((x.double() == 0).all(1, keepdim=True), 0.0, grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", [1.0, 14.3, "tensor"])
@pytest.mark.parametrize("two", [False, True])
def test_normalize_rows_grad_is_the_formula(shape, dtype, scale, two):
    x = _rows(*shape, dtype)
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(shape, generator=gen).to(DEVICE)
    g2 = torch.randn(shape, generator=gen).to(DEVICE) if two else None
    value = 3.5 if scale == "tensor" else scale
    given = torch.tensor(value, device=DEVICE) if scale == "tensor" else value
    y, denom, norm = normalize_rows(x, EPS)
    got = normalize_rows_grad(g, y, denom, norm, EPS, given, dtype, g2)
    want = _reference_grad(x, g if g2 is None else g + g2, value)
    assert got.dtype == dtype and got.shape == x.shape
    # a row's gradient is ~scale * |g| / ||x||: compare row by row at its own magnitude
    rel = 1e-5 if dtype == torch.float32 else 8e-3
    peak = want.abs().amax(1, keepdim=True).clamp_min(1e-300)
    assert ((got.double() - want).abs() / peak).max() <= rel


def test_normalize_rows_refuses_fp64():
    with pytest.raises(TypeError, match="fp32 or half"):
        normalize_rows(torch.ones(2, 3, dtype=torch.float64, device=DEVICE), EPS)


def _clip(dtype: torch.dtype, backend: str):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 16, generator=g).to(dtype).to(DEVICE).requires_grad_()
    y = torch.randn(24, 16, generator=g).to(dtype).to(DEVICE).requires_grad_()
    return lambda: tc.image_text_contrastive_loss(x, y, 0.1, validate=False, backend=backend)


@pytest.mark.parametrize("backend", ["epilogue", "triton"])
def test_the_kernel_backends_normalise_each_input_in_one_launch_each_way(backend):
    """Two inputs: two launches forward, two backward (the torch form was 5 and 10 per input);
    fp64 keeps the torch form."""
    counted = count(_clip(torch.float32, backend), 24, 24, 16)
    assert counted.ops.get("triton:normalize_rows") == 2 and counted.ops.get("triton:normalize_rows_grad") == 2
    assert "linalg_vector_norm" not in counted.ops and "addcmul" not in counted.ops
    wide = count(_clip(torch.float64, backend), 24, 24, 16)
    assert "triton:normalize_rows" not in wide.ops and wide.ops.get("linalg_vector_norm") == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["epilogue", "triton"])
def test_the_kernel_backends_gradients_equal_the_torch_backend(dtype, backend):
    """A single set (two accumulators added in the kernel), a learnable temperature (a tensor
    scale read in the kernel) and bf16 rows (rebuilt from the denominators in backward)."""
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(20, 24, generator=g).to(dtype)
    x0[3] = 0.0
    t0 = torch.tensor(0.2)
    out = {}
    for name in ("torch", backend):
        x = x0.clone().to(DEVICE).requires_grad_()
        t = t0.clone().to(DEVICE).requires_grad_()
        loss = tc.nt_xent_loss(x, t, pairing="adjacent", backend=name)
        loss.backward()
        out[name] = (loss.detach(), x.grad, t.grad)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip(out[backend], out["torch"]):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * max(1.0, want.abs().max().item()))
    assert (out[backend][1][3] == 0).all()  # the all-zero row: no gradient, on both


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_normalised_before_a_gather_take_the_kernels_on_the_kernel_backends(dtype):
    """``gather=True`` normalises each rank's rows before the gather (``_normalize.prepare``): on the
    kernel backends by the row kernels, with the torch form's values and gradients."""
    from torch_contrastive._normalize import prepare
    from torch_contrastive.engine.planner import rows_by_kernel

    x0 = _rows(9, 20, dtype)
    g = torch.randn(9, 20, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    out = {}
    for backend in ("torch", "epilogue"):
        x = x0.clone().requires_grad_()
        y = prepare(x, True, EPS, backend)
        (y * g).sum().backward()
        out[backend] = (y.detach(), x.grad)
    assert out["epilogue"][1].dtype == dtype and out["epilogue"][0].dtype == torch.float32
    for got, want in zip(out["epilogue"], out["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))
    cpu, f32, f64 = torch.device("cpu"), torch.float32, torch.float64
    assert rows_by_kernel(cpu, f32, "epilogue") and rows_by_kernel(cpu, f32, "triton") and not rows_by_kernel(cpu, f32, "torch")
    assert not rows_by_kernel(cpu, f32, "auto") and not rows_by_kernel(cpu, f64, "epilogue")
