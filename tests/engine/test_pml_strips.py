"""PML NT-Xent's strips on a GPU plan (engine/pml_strips.py): two forward sweeps (a label relation's triangle for the
negatives' sums), backward's products factored through ``[E ; T]`` -- against the float64 formula, in the compute
dtype and on tensor-core products; and where the general loop stays (the CPU, the online regime, fp16 products)."""

from __future__ import annotations

import pytest
import torch

import reference as ref
import torch_contrastive as tc
from device import DEVICE
from helpers import assert_pml_memory
from torch_contrastive.engine import pairwise, planner, pml_strips
from torch_contrastive.engine.cost import pair_factoring_pays


def _spied(monkeypatch):
    """Which factored form ran, and on which products: ``("eager", half)`` -- backward's products formed in forward
    (a reduced value) -- or ``("backward", half)``."""
    walks = []
    real_backward, real_eager = pml_strips.softplus_backward, pml_strips.softplus_with_gradient

    def backward(prod, *args):
        walks.append(("backward", prod.half))
        return real_backward(prod, *args)

    def eager(prod, *args):
        walks.append(("eager", prod.half))
        return real_eager(prod, *args)
    monkeypatch.setattr(pairwise.pml_strips, "softplus_backward", backward)
    monkeypatch.setattr(pairwise.pml_strips, "softplus_with_gradient", eager)
    return walks


def _labels(relation: str, n: int) -> torch.Tensor:
    labels = torch.arange(n) % 5
    if relation == "a singleton and a class of two":  # a row without a positive; a row with one
        labels[3], labels[4], labels[9] = 11, 12, 12
    if relation == "one class":  # no row has a negative: every term and gradient is 0
        labels = torch.zeros(n, dtype=torch.long)
    return labels


@pytest.mark.parametrize("products", ["compute", "half"])
@pytest.mark.parametrize("relation", ["labels", "sorted labels", "a singleton and a class of two", "one class"])
def test_the_strips_equal_the_float64_formula(relation, products, monkeypatch):
    """Strips of 8 rows on the simulated GPU plan: float64 to 1e-10, bf16 rows on tensor cores to bf16's rounding of
    the stacked factors; sorted by label (validate=True), the tiles without a positive skip sweep 2 and the relation."""
    monkeypatch.setattr(planner, "PRODUCTS", products)
    walks = _spied(monkeypatch)
    n = 29
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64) * 2
    labels = _labels(relation, n)
    dtype = torch.float64 if products == "compute" else torch.bfloat16
    ours = x.to(dtype).clone().to(DEVICE).requires_grad_()
    with planner.simulate("cuda"):
        got = tc.nt_xent_loss(ours, 0.2, labels=labels.to(DEVICE), chunk_size=8, backend="torch",
                              validate=relation == "sorted labels")
        got.backward()
    assert walks == [("eager", products == "half")]
    wide = x.to(dtype).double().clone().requires_grad_()
    want = ref.nt_xent_pml(wide, labels, 0.2)
    want.backward()
    if relation == "one class":
        assert float(got.detach()) == 0.0 and not ours.grad.any()
        return
    tol = 1e-10 if dtype == torch.float64 else 2e-6
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=tol)
    err = float((ours.grad.double().cpu() - wide.grad).abs().max() / wide.grad.abs().max())
    assert err < (1e-10 if dtype == torch.float64 else 1e-2), err


def test_a_memory_walks_every_tile_and_takes_its_column_gradient(monkeypatch):
    """Two sets (a batch against itself and a memory): sweep 1 walks every tile, and backward's column product
    ``[E ; T]^T [r X ; -g X]`` is the memory's gradient -- against float64."""
    walks = _spied(monkeypatch)
    g = torch.Generator().manual_seed(7)
    x, mem = torch.randn(19, 5, generator=g, dtype=torch.float64), torch.randn(11, 5, generator=g, dtype=torch.float64)
    labels, mem_labels = torch.randint(0, 4, (19,), generator=g), torch.randint(0, 5, (11,), generator=g)
    a, m = x.clone().to(DEVICE).requires_grad_(), mem.clone().to(DEVICE).requires_grad_()
    with planner.simulate("cuda"):
        ours = tc.nt_xent_loss(a, 0.2, labels=labels.to(DEVICE), memory_emb=m, memory_labels=mem_labels.to(DEVICE),
                               chunk_size=8, backend="torch", validate=False)
        ours.backward()
    assert walks == [("eager", False)]
    assert_pml_memory(ours, a, m, x, mem, labels, mem_labels)


def _dense_rows(x: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each row's ``sum_p softplus(log N_i - S_ip)``, densely in float64 (the rows normalised)."""
    z = torch.nn.functional.normalize(x, dim=1)
    s = scale * (z @ z.T)
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(labels), dtype=torch.bool)
    lse = torch.logsumexp(s.masked_fill(same, float("-inf")), dim=1, keepdim=True)
    return torch.where(same & ~eye, torch.nn.functional.softplus(lse - s), 0.0).sum(1)


@pytest.mark.parametrize("reduced", [False, True])
def test_a_learnable_scale_takes_the_gradient_of_the_formula(reduced, monkeypatch):
    """A tensor scale's gradient from the factored products' rows and columns (the engine's bounded mode forced: a
    loss's learnable temperature has no host-known bound, so it keeps the general loop) -- against float64; per-row
    outputs (backward's products) and a weighted sum reduced inside (``combine``: the products formed in forward)."""
    from torch_contrastive.engine.pairwise import pairwise_rows
    from torch_contrastive.positives import Positives

    walks = _spied(monkeypatch)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(26, 5, generator=g, dtype=torch.float64)
    labels = torch.arange(26) % 4
    weights = torch.rand(26, generator=g, dtype=torch.float64)
    scale = torch.tensor(3.0, dtype=torch.float64, device=DEVICE, requires_grad=True)
    ours = x.clone().to(DEVICE).requires_grad_()
    with planner.simulate("cuda"):
        (out,) = pairwise_rows(ours, ours, scale, Positives.from_keys(labels.to(DEVICE)), kernel="pair_softplus",
                               normalize=True, chunk_size=8, fixed=True, backend="torch",
                               combine=((weights.to(DEVICE),), 0.5) if reduced else None)
        (out if reduced else (out * weights.to(DEVICE)).sum() * 0.5).backward()
    assert walks == [("eager" if reduced else "backward", False)]
    want_scale = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    wide = x.clone().requires_grad_()
    want = _dense_rows(wide, labels, want_scale)
    (want * weights).sum().mul(0.5).backward()
    torch.testing.assert_close(out.detach().cpu(), (want * weights).sum().mul(0.5).detach() if reduced else want.detach(),
                               rtol=1e-10, atol=1e-12)
    assert float(scale.grad) == pytest.approx(float(want_scale.grad), rel=1e-9)
    torch.testing.assert_close(ours.grad.cpu(), wide.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", ["a CPU plan", "the online regime", "fp16 products"])
def test_the_general_loop_stays_where_factoring_does_not_serve(case, monkeypatch):
    """The CPU (passes in cache cost less than the wider products), a temperature without the bound (``e^S`` would
    need a running shift) and fp16 tensor-core products (``e^S`` overflows fp16 past 11) keep the general loop --
    which still equals the float64 formula."""
    walks = _spied(monkeypatch)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(21, 6, generator=g, dtype=torch.float64)
    labels = torch.arange(21) % 4
    tau = 0.01 if case == "the online regime" else 0.2
    # float32: a bound of 100 is past fp32's unshifted range (40); float64's would take it
    dtype = {"fp16 products": torch.float16, "the online regime": torch.float32}.get(case, torch.float64)
    monkeypatch.setattr(planner, "PRODUCTS", "half" if case == "fp16 products" else "compute")
    ours = x.to(dtype).clone().to(DEVICE if case != "a CPU plan" else "cpu").requires_grad_()
    if case == "a CPU plan":
        got = tc.nt_xent_loss(ours, tau, labels=labels, chunk_size=8, backend="torch")
    else:
        with planner.simulate("cuda"):
            got = tc.nt_xent_loss(ours, tau, labels=labels.to(DEVICE), chunk_size=8, backend="torch", validate=False)
    got.backward()
    assert walks == []
    wide = x.to(dtype).double().clone().requires_grad_()
    want = ref.nt_xent_pml(wide, labels, tau)
    want.backward()
    tol = {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype, 2e-3)
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=tol)
    assert float((ours.grad.double().cpu() - wide.grad).abs().max() / wide.grad.abs().max()) < tol * 10


def test_the_model_factors_pmls_strips_below_the_features_it_prices():
    """PML's factored strips of a reduced value save about 38 passes on tensor cores and do fewer GEMM FLOPs than the
    general loop (cost.PAIR_FORMED): they pay at any width there, and at the fp32 rate below about 1,050 features.
    Per-row outputs keep backward's [E ; T] (cost.PAIR_PER_ROW): about 30 passes for one GEMM-equivalent more, so up
    to about 17,000 features on tensor cores, about 590 at the fp32 rate."""
    assert pair_factoring_pays("half", 1 << 20, kernel="pair_softplus")
    assert pair_factoring_pays("wide", 1024, kernel="pair_softplus")
    assert not pair_factoring_pays("wide", 1152, kernel="pair_softplus")
    assert pair_factoring_pays("half", 16384, kernel="pair_softplus", per_row=True)
    assert not pair_factoring_pays("half", 32768, kernel="pair_softplus", per_row=True)
    assert pair_factoring_pays("wide", 512, kernel="pair_softplus", per_row=True)
    assert not pair_factoring_pays("wide", 1024, kernel="pair_softplus", per_row=True)


def test_explain_shows_the_factored_strips_decision():
    """The pair terms' factoring is the planner's decision (``Decision.factored``, one place): ``tc.explain`` shows it
    for PML's strips on a GPU plan in the bounded regime, and not in the online one."""
    x = torch.randn(64, 8, dtype=torch.float32, device=DEVICE)
    labels = (torch.arange(64) % 5).to(DEVICE)
    with planner.simulate("cuda"):
        bounded = tc.explain(lambda: tc.nt_xent_loss(x, 0.2, labels=labels, chunk_size=16, backend="torch", validate=False))
        online = tc.explain(lambda: tc.nt_xent_loss(x, 0.01, labels=labels, chunk_size=16, backend="torch", validate=False))
    assert [d.factored for d in bounded] == [True] and "backward factored" in str(bounded[0])
    assert [d.factored for d in online] == [False] and "backward factored" not in str(online[0])


@pytest.mark.parametrize("reduced", [False, True])
def test_a_ranks_rows_against_the_gathered_columns(reduced, monkeypatch):
    """A rank's rows against every rank's columns (the self pair at ``i + offset``, as a distributed call's): the
    strips walk every tile and clear the shifted self diagonal -- rows and column gradients against float64, both
    forms (per-row outputs; a weighted sum reduced inside, its products formed in forward)."""
    from torch_contrastive.engine.pairwise import pairwise_rows
    from torch_contrastive.positives import Positives

    walks = _spied(monkeypatch)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(30, 6, generator=g, dtype=torch.float64)
    labels = torch.arange(30) % 4
    offset, rows = 10, 12
    a = x[offset : offset + rows].clone().to(DEVICE).requires_grad_()
    b = x.clone().to(DEVICE).requires_grad_()
    weights = torch.rand(rows, generator=g, dtype=torch.float64)
    relation = Positives.from_keys(labels[offset : offset + rows].to(DEVICE), labels.to(DEVICE), self_offset=offset)
    with planner.simulate("cuda"):
        (out,) = pairwise_rows(a, b, 5.0, relation, kernel="pair_softplus", normalize=True, chunk_size=8, fixed=True,
                               backend="torch", combine=((weights.to(DEVICE),), 1.0) if reduced else None)
        (out if reduced else (out * weights.to(DEVICE)).sum()).backward()
    assert walks == [("eager" if reduced else "backward", False)]
    wa, wb = x[offset : offset + rows].clone().requires_grad_(), x.clone().requires_grad_()
    za, zb = torch.nn.functional.normalize(wa, dim=1), torch.nn.functional.normalize(wb, dim=1)
    s = 5.0 * za @ zb.T
    same = labels[offset : offset + rows, None] == labels[None, :]
    own = torch.zeros_like(same)
    own[torch.arange(rows), torch.arange(rows) + offset] = True
    lse = torch.logsumexp(s.masked_fill(same, float("-inf")), dim=1, keepdim=True)
    want = torch.where(same & ~own, torch.nn.functional.softplus(lse - s), 0.0).sum(1)
    (want * weights).sum().backward()
    torch.testing.assert_close(out.detach().cpu(), (want * weights).sum().detach() if reduced else want.detach(),
                               rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(a.grad.cpu(), wa.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(b.grad.cpu(), wb.grad, rtol=1e-9, atol=1e-12)


def test_the_products_formed_in_forward_are_scaled_by_the_incoming_gradient_and_skipped_without_one(monkeypatch):
    """A reduced loss's products are formed in forward for a unit incoming gradient: a loss scaled by 3 before
    backward gets 3 times the float64 gradient; under ``no_grad``, or with rows that need no gradient, forward forms
    none (the plain two sweeps) -- the same value."""
    walks = _spied(monkeypatch)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(27, 6, generator=g, dtype=torch.float64)
    labels = torch.arange(27) % 4
    ours = x.clone().to(DEVICE).requires_grad_()
    with planner.simulate("cuda"):
        got = tc.nt_xent_loss(ours, 0.2, labels=labels.to(DEVICE), chunk_size=8, backend="torch", validate=False)
        (3 * got).backward()
        with torch.no_grad():
            quiet = tc.nt_xent_loss(ours, 0.2, labels=labels.to(DEVICE), chunk_size=8, backend="torch", validate=False)
        detached = tc.nt_xent_loss(ours.detach(), 0.2, labels=labels.to(DEVICE), chunk_size=8, backend="torch",
                                   validate=False)
    assert walks == [("eager", False)]
    wide = x.clone().requires_grad_()
    want = ref.nt_xent_pml(wide, labels, 0.2)
    (3 * want).backward()
    for value in (got, quiet, detached):
        assert float(value.detach()) == pytest.approx(float(want.detach()), rel=1e-10)
    torch.testing.assert_close(ours.grad.cpu(), wide.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("reduced", [False, True])
def test_rows_without_negatives_have_no_term_and_no_gradient_in_both_forms(reduced, monkeypatch):
    """One class: no row has a negative (``log N = -inf``), so every term, sigmoid and gradient is 0 -- not ``0 / 0``
    -- with per-row outputs (backward's products) and a reduced value (formed in forward)."""
    from torch_contrastive.engine.pairwise import pairwise_rows
    from torch_contrastive.positives import Positives

    walks = _spied(monkeypatch)
    x = torch.randn(20, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(DEVICE).requires_grad_()
    relation = Positives.from_keys(torch.zeros(20, dtype=torch.long, device=DEVICE))
    with planner.simulate("cuda"):
        (out,) = pairwise_rows(x, x, 5.0, relation, kernel="pair_softplus", normalize=True, chunk_size=8, fixed=True,
                               backend="torch", combine=((torch.ones(20, dtype=torch.float64, device=DEVICE),), 1.0) if reduced else None)
        out.sum().backward()
    assert walks == [("eager" if reduced else "backward", False)]
    assert not out.detach().any() and not x.grad.isnan().any() and not x.grad.any()
