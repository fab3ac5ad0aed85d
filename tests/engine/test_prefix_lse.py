"""engine/prefix_lse.py: every prefix's row (and column) log-sum-exps over the negatives from one pass, against
the float64 definition per prefix -- both regimes (fixed shift, online maximum), strips, a prefix listed twice, the
scales' gradient -- and float64 gradcheck."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from device import DEVICE
from torch_contrastive.engine.prefix_lse import PrefixRowLSE
from torch_contrastive.engine.prefixes import prefix_plan


def reference(a, c, dims, scales, leave_out, columns):
    """Per prefix: the normalised prefixes' logits, the left-out pairs removed, log-sum-exp over rows (and columns)."""
    out = []
    for p, d in enumerate(dims):
        s = F.normalize(a[:, :d], dim=1) @ F.normalize(c[:, :d], dim=1).T * scales[p]
        left = torch.zeros_like(s, dtype=torch.bool)
        left[torch.arange(a.shape[0], device=a.device)[:, None], leave_out] = True
        s = s.masked_fill(left, -torch.inf)
        out.append(torch.cat([s.logsumexp(1), s.logsumexp(0)]) if columns else s.logsumexp(1))
    return torch.stack(out, 1)


def _case(columns, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n, width = (9, 13) if columns else (10, 13)
    a = torch.randn(n, width, generator=g, dtype=torch.float64).to(DEVICE, dtype).requires_grad_()
    c = torch.randn(n, width, generator=g, dtype=torch.float64).to(DEVICE, dtype).requires_grad_() if columns else a
    rows = torch.arange(n, device=DEVICE)
    # two sets: the diagonal; one set: self and a partner half a batch away
    leave = rows[:, None] if columns else torch.stack([rows, (rows + n // 2) % n], 1)
    return a, c, leave


@pytest.mark.parametrize("columns", [False, True])
@pytest.mark.parametrize("fixed", [True, False])
@pytest.mark.parametrize("strip", [None, 4])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_every_prefix_equals_the_float64_definition(columns, fixed, strip, dtype, tol):
    """Values and gradients (inputs and scales, any incoming gradient), odd sizes, a prefix listed twice with two
    scales; fixed scales up to 20 under the fixed shift, or scales up to 200 (logits far past fp32's exp range) online."""
    a, c, leave = _case(columns, dtype)
    dims, values = [13, 8, 3, 8], ([10.0, 5.0, 20.0, 7.0] if fixed else [100.0, 5.0, 200.0, 7.0])
    scales = torch.tensor(values, dtype=dtype, device=DEVICE, requires_grad=True)
    cuts = sorted(set(dims))
    plan = prefix_plan(cuts, [1.0] * len(cuts), 13, 1.0, True, 1e-12, a.shape[0], c.shape[0], strip)
    got = PrefixRowLSE.apply(a, c, plan, tuple(cuts.index(d) for d in dims), leave, columns, scales,
                             tuple(values) if fixed else None)
    want = reference(a.double(), c.double(), dims, scales.double(), leave, columns)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 10)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)
    inputs = (a, scales) if not columns else (a, c, scales)
    for mine, ref in zip(torch.autograd.grad((got.double() * weights).sum(), inputs),
                         torch.autograd.grad((want * weights).sum(), inputs)):
        torch.testing.assert_close(mine.double(), ref.double(), rtol=tol * 10, atol=tol * 10 * ref.abs().max().item())


@pytest.mark.parametrize("strip", [None, 3, 4])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_the_upper_triangle_equals_the_float64_definition(strip, dtype, tol):
    """One set, the fixed shift, its symmetric statistic from the upper triangle's strips (each row's sum from its
    own strip's row and the earlier strips' columns; a partner left of the strip): values and gradients."""
    a, _, leave = _case(False, dtype, seed=4)
    dims, values = [13, 8, 3, 8], [10.0, 5.0, 20.0, 7.0]
    scales = torch.tensor(values, dtype=dtype, device=DEVICE)
    cuts = sorted(set(dims))
    plan = prefix_plan(cuts, [1.0] * len(cuts), 13, 1.0, True, 1e-12, a.shape[0], a.shape[0], strip)
    got = PrefixRowLSE.apply(a, a, plan, tuple(cuts.index(d) for d in dims), leave, False, scales, tuple(values), True)
    want = reference(a.double(), a.double(), dims, scales.double(), leave, False)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 10)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)
    (mine,), (ref,) = torch.autograd.grad((got.double() * weights).sum(), (a,)), torch.autograd.grad((want * weights).sum(), (a,))
    torch.testing.assert_close(mine.double(), ref.double(), rtol=tol * 10, atol=tol * 10 * ref.abs().max().item())


def test_the_upper_triangle_makes_half_the_products():
    """Counted, not timed: the upper triangle's strips multiply about half the square, forward and backward."""
    from torch_contrastive.cli.traffic import count

    a, _, leave = _case(False, torch.float64)
    plan = prefix_plan([5, 13], [1.0, 1.0], 13, 1.0, True, 1e-12, a.shape[0], a.shape[0], 2)
    flops = [sum(count(lambda upper=upper: PrefixRowLSE.apply(a, a, plan, (1, 0), leave, False, torch.tensor([3.0, 2.0], device=DEVICE),
                                                              (3.0, 2.0), upper).sum(), 10, 10, 13,
                       simulate_device=None).gemm_flops.values()) for upper in (False, True)]
    # strips of 2 rows against columns from the strip on: 10 + 8 + 6 + 4 + 2 = 30 of 50 columns per pass
    assert flops[1] * 50 == flops[0] * 30


@pytest.mark.parametrize("columns", [False, True])
@pytest.mark.parametrize("fixed", [True, False])
def test_gradcheck(columns, fixed):
    a, c, leave = _case(columns, torch.float64, seed=2)
    scales = torch.tensor([3.0, 2.0], dtype=torch.float64, device=DEVICE, requires_grad=not fixed)
    plan = prefix_plan([5, 13], [1.0, 1.0], 13, 1.0, True, 1e-12, a.shape[0], c.shape[0], 4)
    inputs = (a, scales) if not columns else (a, c, scales)

    def fn(*xs):
        a_, c_ = (xs[0], xs[0]) if not columns else (xs[0], xs[1])
        return PrefixRowLSE.apply(a_, c_, plan, (1, 0), leave, columns, xs[-1], (3.0, 2.0) if fixed else None)

    assert torch.autograd.gradcheck(fn, inputs)


def test_gradcheck_upper_triangle():
    a, _, leave = _case(False, torch.float64, seed=3)
    plan = prefix_plan([5, 13], [1.0, 1.0], 13, 1.0, True, 1e-12, a.shape[0], a.shape[0], 3)
    scales = torch.tensor([3.0, 2.0], dtype=torch.float64, device=DEVICE)
    assert torch.autograd.gradcheck(lambda x: PrefixRowLSE.apply(x, x, plan, (1, 0), leave, False, scales, (3.0, 2.0), True), (a,))


@pytest.mark.parametrize("fixed,per_row", [(True, False), (False, False), (False, True)])  # per-row scales: online only
@pytest.mark.parametrize("strip", [None, 4])
def test_per_row_scales_and_the_soft_max_means(fixed, per_row, strip):
    """Each anchor row its own scale (individual temperatures, up to 200: the online maximum) or one per prefix, and the
    soft-max mean of each row's logits over its negatives (a value, no gradient) against float64."""
    a, c, leave = _case(True, torch.float64, seed=5)
    dims = [13, 8, 3]
    g = torch.Generator().manual_seed(6)
    scales = (torch.rand(a.shape[0], 3, generator=g, dtype=torch.float64) * 190 + 10 if per_row
              else torch.tensor([10.0, 5.0, 20.0], dtype=torch.float64)).to(DEVICE).requires_grad_()
    plan = prefix_plan(dims[::-1], [1.0] * 3, 13, 1.0, True, 1e-12, a.shape[0], c.shape[0], strip)
    which = tuple(sorted(dims).index(d) for d in dims)
    got = PrefixRowLSE.apply(a, c, plan, which, leave, False, scales, (10.0, 5.0, 20.0) if fixed else None, False, True)
    lse, means = got[:, :3], got[:, 3:]
    want_lse, want_means = [], []
    for p, d in enumerate(dims):
        s = F.normalize(a[:, :d], dim=1) @ F.normalize(c[:, :d], dim=1).T * (scales[:, p, None] if per_row else scales[p])
        s = s.masked_fill(torch.eye(a.shape[0], dtype=torch.bool, device=DEVICE), -torch.inf)
        want_lse.append(s.logsumexp(1))
        soft = s.softmax(1)
        want_means.append((soft * s.masked_fill(soft == 0, 0.0)).sum(1))
    torch.testing.assert_close(lse, torch.stack(want_lse, 1), rtol=1e-12, atol=1e-11)
    torch.testing.assert_close(means, torch.stack(want_means, 1).detach(), rtol=1e-11, atol=1e-10)
    w = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(DEVICE)
    for mine, ref in zip(torch.autograd.grad((lse * w).sum(), (a, c, scales)),
                         torch.autograd.grad((torch.stack(want_lse, 1) * w).sum(), (a, c, scales))):
        torch.testing.assert_close(mine, ref, rtol=1e-10, atol=1e-10 * ref.abs().max().item())


def test_the_upper_triangles_strips():
    """About n / 8 rows per strip (the triangle then multiplies 9/16 of the square), no fewer than 128, within the
    budget's strip; a caller's chunk as given."""
    from torch_contrastive.engine.prefix_lse import upper_strip

    assert upper_strip(2048, 10_000, None) == 256
    assert upper_strip(1024, 10_000, None) == 128
    assert upper_strip(300, 10_000, None) == 128
    assert upper_strip(8192, 585, None) == 585
    assert upper_strip(1024, 10_000, 50) == 50
