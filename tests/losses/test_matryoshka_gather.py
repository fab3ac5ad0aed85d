"""Matryoshka's one pass under ``gather=True``: this rank's anchors against every rank's candidates, equal to
one call per prefix of the loss itself with ``gather=True`` (values and every rank's gradients), on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

import torch_contrastive as tc

DIMS, WEIGHTS = [7, 4, 2], [1.0, 0.5, 2.0]


def _cases(rank: int):
    """name -> (loss, tensors, kwargs), this rank's rows (ranks hold different numbers of rows)."""
    g = torch.Generator().manual_seed(100 + rank)
    n = 6 if rank == 0 else 4

    def rows(k: int) -> torch.Tensor:
        return torch.randn(k, 7, generator=g, dtype=torch.float64)

    x, y, neg = rows(n), rows(n), rows(3)

    def guide(k: int) -> torch.Tensor:  # a frozen guide model's rows: no gradient
        return torch.randn(k, 5, generator=g, dtype=torch.float64)

    labels = torch.randint(0, 3, (n,), generator=g)
    ids = torch.randint(0, 2, (n,), generator=g) + 2 * rank  # duplicates within and across ranks
    views = torch.randn(n // 2, 2, 7, generator=g, dtype=torch.float64)
    tau = torch.tensor(0.3, dtype=torch.float64)
    return {
        "clip": (tc.clip_loss, [x, y], {"temperature": 0.2}),
        "clip ids": (tc.clip_loss, [x, y], {"temperature": 0.2, "image_id": ids, "text_id": labels}),
        "clip ids sum": (tc.clip_loss, [x, y], {"temperature": 0.2, "image_id": ids, "reduction": "sum"}),
        "clip decoupled": (tc.clip_loss, [x, y], {"temperature": 0.2, "decoupled": True}),
        "clip learnable": (tc.clip_loss, [x, y], {"temperature": tau}),
        "info_nce": (tc.info_nce_loss, [x, y], {"temperature": 0.2}),
        "info_nce negatives": (tc.info_nce_loss, [x, y, neg], {"temperature": 0.2, "grad_reduction": "sum"}),
        "nt_xent adjacent": (tc.nt_xent_loss, [x], {"temperature": 0.2}),
        "nt_xent halves dcl": (tc.nt_xent_loss, [x], {"temperature": 0.2, "pairing": "halves", "decoupled": True}),
        "nt_xent sum": (tc.nt_xent_loss, [x], {"temperature": 0.2, "reduction": "sum"}),
        "supcon labels": (tc.supcon_loss, [x], {"temperature": 0.2, "labels": labels}),
        "supcon views": (tc.supcon_loss, [views], {"temperature": 0.2}),
        "siglip": (tc.siglip_loss, [x, y], {"logit_scale": 5.0, "logit_bias": -2.0}),
        "siglip negative only sum": (tc.siglip_loss, [x, y], {"logit_scale": 5.0, "logit_bias": -2.0, "negative_only": True,
                                                              "reduction": "sum"}),
        "siglip ids learnable sum": (tc.siglip_loss, [x, y], {"logit_scale": torch.tensor(5.0, dtype=torch.float64),
                                                              "logit_bias": torch.tensor(-2.0, dtype=torch.float64),
                                                              "image_id": ids, "reduction": "sum"}),
        # the label conventions scored pair by pair: this rank's rows against every rank's, the labels gathered
        "nt_xent pml": (tc.nt_xent_loss, [x], {"temperature": 0.2, "labels": labels}),
        "nt_xent pml learnable sum": (tc.nt_xent_loss, [x], {"temperature": tau, "labels": labels, "reduction": "sum"}),
        "nt_bxent labels": (tc.nt_bxent_loss, [x], {"temperature": 0.3, "labels": labels}),
        "nt_bxent labels none": (tc.nt_bxent_loss, [x], {"temperature": 0.3, "labels": labels, "reduction": "none"}),
        # reduction="none": this rank's anchors' values, each row's own gradient (weighted unevenly below)
        "nt_xent none": (tc.nt_xent_loss, [x], {"temperature": 0.2, "pairing": "halves", "reduction": "none"}),
        "supcon none": (tc.supcon_loss, [x], {"temperature": 0.2, "labels": labels, "reduction": "none"}),
        "info_nce none": (tc.info_nce_loss, [x, y, neg], {"temperature": 0.2, "reduction": "none"}),
        # SupCon's contrast_mode="one": this rank's first views against every rank's views
        "supcon one labels": (tc.supcon_loss, [views], {"temperature": 0.2, "labels": labels[: n // 2], "contrast_mode": "one"}),
        "supcon one views": (tc.supcon_loss, [views], {"temperature": 0.2, "contrast_mode": "one"}),
        # a memory is this rank's own, after every rank's rows (as the losses take it); its gradient too
        "supcon base zero": (tc.supcon_loss, [x], {"temperature": 0.2, "labels": labels, "base_temperature": 0.07,
                                                   "single_class": "zero"}),
        "supcon memory": (tc.supcon_loss, [x], {"temperature": 0.2, "labels": labels, "memory_emb": rows(3),
                                                "memory_labels": torch.tensor([0, 1, 2])}),
        "nt_xent pml memory sum": (tc.nt_xent_loss, [x], {"temperature": 0.2, "labels": labels, "memory_emb": rows(2 + rank),
                                                          "memory_labels": torch.arange(2 + rank) % 3, "reduction": "sum"}),
        # NT-BXent's listed pairs: this rank's own, their columns among every rank's rows
        "nt_bxent pos_indices": (tc.nt_bxent_loss, [x], {"temperature": 0.3,
                                                         "pos_indices": torch.tensor([[0, 1], [1, 0], [2, 3], [0, 1], [3, 2]])}),
        "clip none": (tc.clip_loss, [x, y], {"temperature": 0.2, "reduction": "none"}),
        "clip ids none": (tc.clip_loss, [x, y], {"temperature": 0.2, "image_id": ids, "text_id": labels, "reduction": "none"}),
        "clip smoothing": (tc.clip_loss, [x, y], {"temperature": 0.2, "label_smoothing": 0.1}),
        "clip ids smoothing sum": (tc.clip_loss, [x, y], {"temperature": 0.2, "image_id": ids, "label_smoothing": 0.2,
                                                          "reduction": "sum"}),
        "clip ids smoothing none": (tc.clip_loss, [x, y], {"temperature": 0.2, "text_id": labels, "label_smoothing": 0.1,
                                                           "reduction": "none"}),
        "clip ids dcl none": (tc.clip_loss, [x, y], {"temperature": 0.2, "image_id": ids, "decoupled": True, "reduction": "none"}),
        # NT-Xent's positive weights: this rank's rows' own (a weight with its gradient; DCLW's read off the outputs)
        "nt_xent weighted": (tc.nt_xent_loss, [x], {"temperature": 0.2, "pairing": "halves", "decoupled": True,
                                                    "positive_weight": torch.rand(n, generator=g, dtype=torch.float64) + 0.5}),
        "dclw module": (tc.DCLWLoss(0.2, sigma=0.4, gather=True).double(), [x[: n // 2], y[: n // 2]], {}),
        # InfoNCE's false-negative rules: every rank's keys (and negatives, as gather_negatives says) with their ids and
        # guide rows gathered; duplicate ids within and across ranks
        "info_nce ids": (tc.info_nce_loss, [x, y, neg], {"temperature": 0.2, "key_ids": ids, "negative_ids": torch.tensor([2, 0, 5])}),
        "info_nce guide": (tc.info_nce_loss, [x, y, neg], {"temperature": 0.2, "guide": (guide(n), guide(n), guide(3)),
                                                           "guide_margin": 0.1}),
        "info_nce moco": (tc.info_nce_loss, [x, y, neg], {"temperature": 0.2, "in_batch_negatives": False}),
        "info_nce dcl none": (tc.info_nce_loss, [x, y], {"temperature": 0.2, "decoupled": True, "reduction": "none"}),
        # label smoothing over every rank's keys (the uniform part's count is theirs)
        "info_nce smoothing": (tc.info_nce_loss, [x, y], {"temperature": 0.2, "label_smoothing": 0.1}),
        "info_nce smoothing sum": (tc.info_nce_loss, [x, y], {"temperature": 0.2, "label_smoothing": 0.3, "reduction": "sum"}),
        "info_nce smoothing none": (tc.info_nce_loss, [x, y], {"temperature": 0.2, "label_smoothing": 0.2, "reduction": "none"}),
        "info_nce paired": (tc.info_nce_loss, [x, y, rows(2 * n).view(n, 2, 7)], {"temperature": 0.2, "negative_mode": "paired"}),
        "info_nce paired moco sum": (tc.info_nce_loss, [x, y, rows(n).view(n, 1, 7)], {"temperature": 0.2, "negative_mode": "paired",
                                                                                     "in_batch_negatives": False, "reduction": "sum"}),
        "info_nce paired none": (tc.info_nce_loss, [x, y, rows(3 * n).view(n, 3, 7)], {"temperature": 0.2, "negative_mode": "paired",
                                                                                     "reduction": "none"}),
        # paired negatives with the false-negative rules: every rank's keys' ids and guide rows; the paired ones stay
        "info_nce paired ids": (tc.info_nce_loss, [x, y, rows(2 * n).view(n, 2, 7)],
                                {"temperature": 0.2, "negative_mode": "paired", "key_ids": ids,
                                 "negative_ids": torch.randint(0, 4, (n, 2), generator=g)}),
        "info_nce paired guide dcl none": (tc.info_nce_loss, [x, y, rows(2 * n).view(n, 2, 7)],
                                           {"temperature": 0.2, "negative_mode": "paired", "decoupled": True, "reduction": "none",
                                            "guide": (guide(n), guide(n), guide(2 * n).view(n, 2, 5)), "guide_margin": 0.1}),
        "info_nce paired smoothing": (tc.info_nce_loss, [x, y, rows(2 * n).view(n, 2, 7)],
                                      {"temperature": 0.2, "negative_mode": "paired", "label_smoothing": 0.2}),
        "info_nce own negatives": (tc.info_nce_loss, [x, y, neg], {"temperature": 0.2, "key_ids": ids, "gather_negatives": False,
                                                                   "reduction": "sum"}),
    }


def _ranks(rank: int, world: int, name: str) -> None:
    from torch_contrastive.losses.matryoshka import _as_function, _one_pass

    fn, tensors, kwargs = _cases(rank)[name]
    kwargs = kwargs if isinstance(fn, torch.nn.Module) else {**kwargs, "gather": True}  # a module: its own option
    assert _one_pass(*_as_function(fn, tensors, kwargs)) is not None, name
    results = []
    for one_pass in (True, False):
        inputs = [t.clone().requires_grad_() for t in tensors]
        args = {k: (v.clone().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                for k, v in kwargs.items()}
        loss = tc.matryoshka_loss(fn, inputs, DIMS, WEIGHTS, one_pass=one_pass, **args)
        if loss.ndim:  # per-row values: weighted unevenly, so that each row's own gradient is checked
            loss = (loss * torch.linspace(0.5, 2.0, loss.numel(), dtype=loss.dtype)).sum()
        learnable = [v for v in args.values() if isinstance(v, torch.Tensor) and v.requires_grad]
        grads = torch.autograd.grad(loss, inputs + learnable)
        shared = [g.clone() for g in grads[len(inputs):]]
        for g in shared:  # a replicated parameter (0-dim): the ranks' gradients are summed (DDP averages them)
            if g.ndim == 0:  # (a per-row weight is this rank's own: compared as it is)
                torch.distributed.all_reduce(g)
        results.append((loss.detach(), *grads[: len(inputs)], *shared))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _every_case(rank: int, world: int, names: list[str]) -> None:
    for name in names:  # in order on both ranks: the first failure stops both, named
        try:
            _ranks(rank, world, name)
        except Exception as error:
            raise AssertionError(f"case {name!r} on rank {rank}") from error


def test_gathered_one_pass_equals_one_call_per_prefix():
    """Every case above on two gloo ranks, in one pair of spawned processes (a spawn costs seconds, a case a
    fraction of one): the one pass equals one gathered call per prefix, values and gradients."""
    from dist_helpers import run_ranks

    run_ranks(_every_case, 2, list(_cases(0)), timeout=600)


def test_gather_on_one_process_is_the_local_one_pass():
    """``gather=True`` without a process group is the local loss: the one pass, equal to one call per prefix."""
    from torch_contrastive.losses.matryoshka import _one_pass

    x = torch.randn(8, 6, dtype=torch.float64)
    assert _one_pass(tc.nt_xent_loss, [x], {"gather": True}) is not None
    got = tc.matryoshka_loss(tc.nt_xent_loss, [x], [6, 3], temperature=0.2, gather=True)
    want = tc.matryoshka_loss(tc.nt_xent_loss, [x], [6, 3], temperature=0.2, gather=True, one_pass=False)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _global_ranks(rank: int, world: int, mode: str, temperature_mode: str) -> None:
    """One GlobalContrastiveLoss per prefix with gather=True, two steps: the one pass (this rank's rows against every
    rank's, gathered once) equal to each module's own gathered call -- values, every rank's gradients (a learnable
    temperature's summed over the ranks) and the states every rank keeps."""
    from torch_contrastive.losses import prefix_global

    g = torch.Generator().manual_seed(200 + rank)
    n = 6 if rank == 0 else 4
    a, b = (torch.randn(n, 7, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    taus = [0.2, 0.5, 0.1] if temperature_mode != "individual" else ([0.2, 0.5, 0.1] if mode == "unimodal" else [0.02, 0.04, 0.01])

    def make():
        return [tc.GlobalContrastiveLoss(24, mode, tau, temperature_mode=temperature_mode, gather=True, state_dtype=torch.float64)
                for tau in taus]

    ours, theirs = make(), make()
    for step in range(2):
        index = torch.arange(n) + (0 if rank == 0 else 6) + 10 * step
        assert prefix_global._covered(ours, [a, b], {"index": index}) is not None  # the one pass, not its fallback
        results = []
        for losses, one_pass in ((ours, True), (theirs, False)):
            gathers = _counting_gathers()
            loss = tc.matryoshka_loss(losses, [a, b], DIMS, WEIGHTS, index=index, one_pass=one_pass)
            if one_pass:  # the rows gathered once at full width (both inputs), not again by each prefix's module
                assert gathers() == 2, gathers()
            learnable = [m.tau for m in losses] if temperature_mode == "global" else []
            grads = torch.autograd.grad(loss, [a, b, *learnable])
            shared = [g_.clone() for g_ in grads[2:]]
            for g_ in shared:
                torch.distributed.all_reduce(g_)
            results.append((loss.detach(), *grads[:2], *shared))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for mine, ref in zip(ours, theirs):
        for name in ("log_u", *(("tau_state", "tau_grad") if temperature_mode == "individual" else ())):
            torch.testing.assert_close(getattr(mine, name), getattr(ref, name), rtol=1e-12, atol=1e-12)


def _counting_gathers():
    """Count the autograd-aware row gathers (the tensors ``Scope.rows_of`` gathers, which ``Scope.rows`` calls)
    from here on, in this rank's process."""
    from torch_contrastive.distributed import Scope

    original = getattr(Scope.rows_of, "__wrapped__", Scope.rows_of)
    calls = [0]

    def rows_of(self, *xs):
        calls[0] += len(xs)
        return original(self, *xs)

    rows_of.__wrapped__ = original
    Scope.rows_of = rows_of
    return lambda: calls[0]


@pytest.mark.parametrize("mode", ["unimodal", "bimodal"])
@pytest.mark.parametrize("temperature_mode", ["fixed", "global", "individual"])
def test_gathered_global_losses_in_one_pass(mode, temperature_mode):
    from dist_helpers import run_ranks

    run_ranks(_global_ranks, 2, mode, temperature_mode, timeout=180)
