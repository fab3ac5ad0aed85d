"""The pair kernels' one-tile functions (engine/pairwise.py) in fixed mode: each pair's terms and sigmoids
read off one exponentiated tile, and ``H = G + G^T`` of a symmetric relation formed directly, against the
textbook softplus / sigmoid formulas in float64 and against ``G + G^T``."""

from __future__ import annotations

import pytest
import torch

import torch_contrastive as tc
from device import DEVICE
from helpers import assert_pml_memory
from torch_contrastive.engine.pair_kernels import KERNELS as PAIR_KERNELS

KERNELS = ("pair_softplus", "binary")


def _tile(n: int, labels: torch.Tensor, bound: float, dtype: torch.dtype, seed: int):
    """A symmetric logit tile with |S| <= bound and one set's 0/1 label masks (the self pair in neither)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.nn.functional.normalize(torch.randn(n, 6, generator=g, dtype=torch.float64), dim=1)
    s = (z @ z.T * bound).to(dtype).to(DEVICE)
    pos = (labels[:, None] == labels[None, :]).to(dtype).to(DEVICE)
    pos.fill_diagonal_(0)
    neg = 1 - pos
    neg.fill_diagonal_(0)
    return s, pos, neg


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x) without torch's softplus threshold (x above 20 returned as x, an error of e^-20)."""
    return torch.logaddexp(x, torch.zeros((), dtype=x.dtype, device=x.device))


def _softplus_terms(kernel: str, s: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor):
    """(per-row outputs, d out / d S per output) from softplus (its gradient: sigmoid), with autograd, in float64."""
    s = s.double().detach().requires_grad_()
    pos, neg = pos.double(), neg.double()
    if kernel == "pair_softplus":  # PML: softplus(log N_i - S_ip) on positives
        neg_sum = (s.exp() * neg).sum(1, keepdim=True)
        has_neg = (neg_sum > 0).double()  # a row without negatives: softplus(-inf) = 0, and no gradient
        outs = ((_softplus((neg_sum + 1 - has_neg).log() - s) * pos * has_neg).sum(1),)
    else:  # NT-BXent: softplus(-S) on positives, softplus(S) on negatives
        outs = ((_softplus(-s) * pos).sum(1), (_softplus(s) * neg).sum(1))
    return outs, s


# a row that has no negatives (every row shares its label) and one with no positives (a label of its own)
LABELS = {"mixed": torch.tensor([0, 1, 0, 2, 1, 0, 3, 1, 1]), "one class": torch.zeros(6, dtype=torch.long)}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("labels", list(LABELS))
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("bound", [1.0, 14.0, 40.0])
def test_single_fixed_equals_softplus_and_sigmoid(kernel, labels, dtype, tol, bound):
    lab = LABELS[labels]
    s, pos, neg = _tile(lab.numel(), lab, bound, dtype, seed=int(bound))
    fn = PAIR_KERNELS[kernel]
    want, s64 = _softplus_terms(kernel, s, pos, neg)
    outputs, kept = fn.single_fixed(s.clone(), pos, 0)
    assert len(outputs) == len(want)
    # a term computed as log(t) - S or log(1 + u) carries an absolute error of a rounding of log(t) (|S| <= 40)
    atol = tol * max(bound, 1.0)
    for got, w in zip(outputs, want):
        torch.testing.assert_close(got.double().cpu(), w.detach().cpu(), rtol=tol, atol=atol)
    # gradients: every output weighted by its own coefficient per row
    g = torch.Generator().manual_seed(1)
    grads = tuple(torch.rand(lab.numel(), generator=g, dtype=torch.float64) for _ in want)
    torch.autograd.backward(want, [gr.to(s64.device) for gr in grads])
    got_grad = fn.single_grad_fixed(kept, tuple(gr.to(dtype).to(DEVICE) for gr in grads))
    torch.testing.assert_close(got_grad.double().cpu(), s64.grad.cpu(), rtol=tol * 10, atol=tol * 10)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("self_offset", [None, 3, -2])
def test_single_fixed_finds_the_self_pair_off_the_diagonal(kernel, self_offset):
    """Two sets (a reference set: no self pair) and a rank's rows among gathered candidates (the self pair
    at column ``i + offset``; a negative offset as for rows past the columns' start): every pair but the
    self pair is a positive or a negative, against float64 with an explicit negative mask."""
    g = torch.Generator().manual_seed(8)
    rows, cols = 7, 11
    s = torch.nn.functional.normalize(torch.randn(rows, 5, generator=g, dtype=torch.float64), dim=1) @ \
        torch.nn.functional.normalize(torch.randn(cols, 5, generator=g, dtype=torch.float64), dim=1).T * 12.0
    pos = (torch.randint(0, 3, (rows, 1), generator=g) == torch.randint(0, 3, (1, cols), generator=g)).double()
    neg = 1 - pos
    if self_offset is not None:
        pos.diagonal(self_offset).zero_()
        neg.diagonal(self_offset).zero_()
    fn = PAIR_KERNELS[kernel]
    want, s64 = _softplus_terms(kernel, s, pos, neg)
    outputs, kept = fn.single_fixed(s.clone().to(DEVICE), pos.to(DEVICE), self_offset)
    for got, w in zip(outputs, want):
        torch.testing.assert_close(got.cpu(), w.detach(), rtol=1e-12, atol=1e-12)
    grads = tuple(torch.rand(rows, generator=g, dtype=torch.float64) for _ in want)
    torch.autograd.backward(want, list(grads))
    got_grad = fn.single_grad_fixed(kept, tuple(gr.to(DEVICE) for gr in grads))
    torch.testing.assert_close(got_grad.cpu(), s64.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("labels", list(LABELS))
def test_single_grad_fixed_both_is_g_plus_its_transpose(kernel, labels):
    lab = LABELS[labels]
    s, pos, _ = _tile(lab.numel(), lab, 10.0, torch.float64, seed=3)
    fn = PAIR_KERNELS[kernel]
    _, kept = fn.single_fixed(s.clone(), pos, 0)
    g = torch.Generator().manual_seed(2)
    grads = tuple(torch.rand(lab.numel(), generator=g, dtype=torch.float64).to(DEVICE) for _ in range(2 if kernel == "binary" else 1))
    one_role = fn.single_grad_fixed(kept, grads)
    torch.testing.assert_close(fn.single_grad_fixed_both(kept, grads), one_role + one_role.t(), rtol=1e-12, atol=1e-14)


def test_listed_one_way_pairs_keep_both_roles_of_the_gradient():
    """NT-BXent by listed pairs, some listed one way only: the relation is not symmetric, so the one tile's
    ``G + G^T`` is formed from G (the symmetric shortcut would pull a one-way pair from both ends)."""
    import reference as ref
    import torch_contrastive as tc

    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    pairs = torch.tensor([[0, 1], [2, 5], [5, 3], [6, 7], [7, 6]])
    a = x.clone().to(DEVICE).requires_grad_()
    tc.nt_bxent_loss(a, pairs.to(DEVICE), temperature=0.2).backward()
    b = x.clone().requires_grad_()
    want = ref.nt_bxent(b, 0.2, pos_indices=pairs)
    want.backward()
    torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("loss", ["nt_xent", "supcon"])
def test_two_sets_on_one_bounded_tile_keep_both_gradients(loss):
    """A memory's rows are a second set (the relation is R x C, not symmetric): a float temperature puts the
    call on one bounded tile, whose rows and memory take their gradients from G, not from one set's G + G^T."""
    import reference as ref
    import torch_contrastive as tc

    g = torch.Generator().manual_seed(5)
    x, mem = torch.randn(9, 4, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)
    labels, mem_labels = torch.arange(9) % 3, torch.arange(5) % 4
    a, m = x.clone().to(DEVICE).requires_grad_(), mem.clone().to(DEVICE).requires_grad_()
    if loss == "nt_xent":
        ours = tc.nt_xent_loss(a, 0.2, labels=labels.to(DEVICE), memory_emb=m, memory_labels=mem_labels.to(DEVICE))
    else:
        ours = tc.supcon_loss(a, labels.to(DEVICE), temperature=0.2, memory_emb=m, memory_labels=mem_labels.to(DEVICE))
    ours.backward()
    b, n = x.clone().requires_grad_(), mem.clone().requires_grad_()
    fn = ref.nt_xent_pml_memory if loss == "nt_xent" else ref.supcon_memory
    want = fn(b, labels, n, mem_labels, 0.2)
    want.backward()
    assert ours.item() == pytest.approx(want.item(), rel=1e-10)
    torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(m.grad.cpu(), n.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_confident_tile_keeps_the_digits_of_its_small_terms(kernel):
    """Positives near +30 and negatives near -30 (|S| within the fixed bound): every term is tiny
    (softplus of about -30 to -60), and float32 keeps each row's value to its own digits, not to an ulp of
    |S| (a form that cancels, ``log(e^S + N) - S``, is off by about 4e-6 absolute: every digit). PML's
    ``log N_i - S_ip`` carries an ulp of |S| ~ 60 (about 1e-4 of the term); NT-BXent's terms come whole."""
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 0, 1])
    n = labels.numel()
    same = labels[:, None] == labels[None, :]
    g = torch.Generator().manual_seed(6)
    s64 = torch.where(same, 30.0, -30.0).double() + torch.rand(n, n, generator=g, dtype=torch.float64)
    s64 = ((s64 + s64.T) / 2).float().double()  # the float32 tile's values, exactly
    pos = same.double()
    pos.fill_diagonal_(0)
    neg = 1 - same.double()
    want, _ = _softplus_terms(kernel, s64, pos, neg)
    got, _ = PAIR_KERNELS[kernel].single_fixed(s64.float().to(DEVICE), pos.float().to(DEVICE), 0)
    for g32, w in zip(got, want):
        assert (w > 0).all() and (w < 1e-9).all()  # the regime: every row's sum is tiny
        torch.testing.assert_close(g32.double().cpu(), w.detach(), rtol=1e-3 if kernel == "pair_softplus" else 1e-5, atol=0)


@pytest.mark.parametrize("chunk", [3, 4])
def test_tiles_of_two_sets_in_fixed_mode(chunk):
    """PML's NT-Xent with a memory over several tiles and a float temperature (the bounded regime: 0/1 float
    masks multiply, every exp unshifted): the values and gradients equal the float64 loops."""
    import torch_contrastive as tc

    g = torch.Generator().manual_seed(7)
    x, mem = torch.randn(13, 5, generator=g, dtype=torch.float64), torch.randn(6, 5, generator=g, dtype=torch.float64)
    labels, mem_labels = torch.randint(0, 4, (13,), generator=g), torch.randint(0, 5, (6,), generator=g)
    a, m = x.clone().to(DEVICE).requires_grad_(), mem.clone().to(DEVICE).requires_grad_()
    ours = tc.nt_xent_loss(a, 0.2, labels=labels.to(DEVICE), memory_emb=m, memory_labels=mem_labels.to(DEVICE), chunk_size=chunk)
    ours.backward()
    assert_pml_memory(ours, a, m, x, mem, labels, mem_labels)


def test_pmls_lean_one_tile_sums_its_rows_inside_the_kernel():
    """PML's NT-Xent weighs every row 1 (its mean over pairs): the lean one tile reads only the rows' total, so
    its kernel forms it as one dot product over the tile (the rows' sums and their sum would be three ops); the
    value is the float64 formula's."""
    from helpers import OpNames
    from reference import nt_xent_pml

    g = torch.Generator().manual_seed(2)
    x = torch.randn(24, 6, generator=g, dtype=torch.float64)
    labels = torch.arange(24) % 5
    tc.nt_xent_loss(x, 0.2, labels=labels)  # the first call plans (and keeps the call)
    with OpNames() as ops:
        value = tc.nt_xent_loss(x, 0.2, labels=labels)
    assert ops.names.count("dot") == 1, ops.names
    assert value.item() == pytest.approx(nt_xent_pml(x, labels, torch.tensor(0.2, dtype=torch.float64)).item(), rel=1e-9)
