"""backend="triton": the Triton kernels equal the torch backend and the float64 references.

On a machine without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
set here before the kernels are defined); sizes stay small because it is slow. Skipped
when triton is not installed (``pip install 'torch-contrastive[gpu]'``).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

import torch_contrastive as tc  # noqa: E402
from reference import image_text, info_nce, nt_xent, supcon  # noqa: E402
from test_losses import _compare  # noqa: E402
from torch_contrastive.engine import softmax_terms  # noqa: E402
from torch_contrastive.positives import Positives  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
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
    g = torch.Generator().manual_seed(rows * 100 + cols)
    a = torch.randn(rows, 20, generator=g, dtype=dtype, device="cpu").to(DEVICE).requires_grad_()
    b = torch.randn(cols, 20, generator=g, dtype=dtype, device="cpu").to(DEVICE).requires_grad_()
    scale = torch.tensor(3.0, dtype=dtype, device=DEVICE, requires_grad=True)
    if relation == "partner":
        pos = Positives.from_partner(torch.arange(rows, device=DEVICE) % cols, cols, self_offset=None)
    elif relation == "keys":
        pos = Positives.from_keys(torch.arange(rows, device=DEVICE) % 3, torch.arange(cols, device=DEVICE) % 4, self_offset=None)
    else:
        pos = None
    weights = (torch.linspace(0.5, 2, rows, dtype=dtype, device=DEVICE), torch.linspace(1, 3, rows, dtype=dtype, device=DEVICE))

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
    g = torch.Generator().manual_seed(5)
    q = torch.randn(11, 6, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    k = torch.randn(11, 6, generator=g, dtype=torch.float64).to(DEVICE).requires_grad_()
    queue = torch.randn(40, 6, generator=g, dtype=torch.float64).to(DEVICE)
    pos = Positives.from_partner(torch.arange(11, device=DEVICE), 51, self_offset=None)

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
        _compare(lambda a, t: ours(a, None, t, "triton"), lambda a, t: ref(a, None, t), inputs, 0.2, dtype, TOLS[dtype])
    else:
        _compare(lambda a, b, t: ours(a, b, t, "triton"), lambda a, b, t: ref(a, b, t), inputs, 0.2, dtype, TOLS[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_match_the_torch_backend(dtype):
    x = torch.randn(20, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    values = [tc.image_text_contrastive_loss(x, x.flip(0), 0.1, backend=b) for b in ("torch", "triton")]
    assert values[0].dtype == values[1].dtype == torch.float32
    torch.testing.assert_close(values[1], values[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("call,words", [
    (lambda x: tc.nt_bxent_loss(x, labels=torch.arange(6) % 2, backend="triton"), "NT-BXent"),
    (lambda x: tc.siglip_loss(x, x, 10.0, -10.0, backend="triton"), "SigLIP"),
    (lambda x: tc.nt_xent_loss(x, labels=torch.arange(6) % 2, backend="triton"), "NT-Xent with labels"),
    (lambda x: tc.info_nce_loss(x, x, key_ids=torch.arange(6) % 2, backend="triton"), "exclusions"),
    (lambda x: tc.nt_xent_loss(x, backend="cuda"), "backend must be one of"),
    (lambda x: tc.NTXentLoss(backend="tpu"), "backend must be one of"),
])
def test_what_the_kernels_do_not_cover_is_a_clear_error(call, words):
    with pytest.raises(ValueError, match=words):
        call(torch.randn(6, 4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only check")
def test_cpu_without_the_interpreter_says_how_to_run(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        tc.nt_xent_loss(torch.randn(6, 4), backend="triton")
