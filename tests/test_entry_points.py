"""Every public entry point refuses bad input (issue 36; README, "Errors").

One table, :data:`DOORS`, holds every name of ``torch_contrastive.__all__`` and of the
integrations' ``__all__`` -- a loss function, a module (its constructor and its call), a helper
-- with the tensors it takes. Each tensor argument is attacked with every bad kind of value in
:data:`ATTACKS` (wrong ndim, integer dtype, a list, NaN, inf, no rows): the call must raise a
``ValueError``/``TypeError`` that names the argument as the caller spelled it, never return a
NaN, and leave the caller's tensors as they were. Options and constructors have their own rows
(:data:`OPTIONS`, :data:`CASES`), and every CLI subcommand its bad arguments (:data:`CLI`): one
line on stderr and exit status 2. A name added to a package's ``__all__`` (or a subcommand added
to the CLI) without a row here fails :func:`test_every_public_name_has_a_row`: no door without
its checks.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

import torch_contrastive as tc
from torch_contrastive.integrations import open_clip as oc
from torch_contrastive.integrations import sentence_transformers as st
from torch_contrastive.losses.global_contrastive import GlobalState

X = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
Y = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
N5 = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
L = torch.tensor([0, 1, 0, 1, 2, 2, 3, 3])


def _with(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def attack(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[1] = value
        return t

    return attack


#: kind of bad value -> (how a good tensor is spoiled, the exception it must raise)
ATTACKS: dict[str, tuple[Callable[[torch.Tensor], Any], type[Exception]]] = {
    "1-D": (lambda t: t[0], ValueError),
    "4-D": (lambda t: t[None, None], ValueError),
    "integer dtype": (lambda t: t.long(), TypeError),
    "a list": (lambda t: t.tolist(), TypeError),
    "NaN": (_with(float("nan")), ValueError),
    "inf": (_with(float("inf")), ValueError),
    "no rows": (lambda t: t[:0], ValueError),
}


@dataclass
class Door:
    """One public name: ``call(**tensors)`` is a good call; ``skip`` lists (argument, attack) pairs
    that are not bad input for it, with the reason."""

    call: Callable[..., Any] | None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    skip: dict[tuple[str, str], str] = field(default_factory=dict)
    note: str = ""


_AUTHORS_VIEWS = "the SupCon authors' code takes (bsz, n_views, ...) and flattens the trailing dimensions"

DOORS: dict[str, Door] = {
    # the loss functions
    "clip_loss": Door(lambda image_feat, text_feat: tc.clip_loss(image_feat, text_feat), {"image_feat": X, "text_feat": Y}),
    "image_text_contrastive_loss": Door(lambda image_feat, text_feat: tc.image_text_contrastive_loss(image_feat, text_feat),
                                        {"image_feat": X, "text_feat": Y}),
    "info_nce_loss": Door(lambda query, key, negatives: tc.info_nce_loss(query, key, negatives),
                          {"query": X, "key": Y, "negatives": N5},
                          skip={("negatives", "no rows"): "an empty pool beside the in-batch negatives is a loss"}),
    "matryoshka_info_nce_loss": Door(lambda query, key, negatives: tc.matryoshka_info_nce_loss(query, key, [6, 3], negatives=negatives),
                                     {"query": X, "key": Y, "negatives": N5},
                                     skip={("negatives", "no rows"): "an empty pool beside the in-batch negatives is a loss"}),
    "matryoshka_loss": Door(lambda embeddings: tc.matryoshka_loss(tc.nt_xent_loss, [embeddings], [6, 3]), {"embeddings": X}),
    "nt_bxent_loss": Door(lambda embeddings: tc.nt_bxent_loss(embeddings, labels=L), {"embeddings": X}),
    "nt_xent_loss": Door(lambda embeddings: tc.nt_xent_loss(embeddings), {"embeddings": X}),
    "siglip_loss": Door(lambda image_feat, text_feat: tc.siglip_loss(image_feat, text_feat, 10.0, -10.0),
                        {"image_feat": X, "text_feat": Y}),
    "global_contrastive_loss": Door(lambda a, b: tc.global_contrastive_loss(a, b, GlobalState(torch.full((8, 2), -math.inf)))[0],
                                    {"a": X, "b": Y}),
    "supcon_loss": Door(lambda features: tc.supcon_loss(features, L), {"features": X}, skip={("features", "4-D"): _AUTHORS_VIEWS}),
    # the modules (constructed, then called)
    "ClipLoss": Door(lambda image_features, text_features: tc.ClipLoss()(image_features, text_features),
                     {"image_features": X, "text_features": Y}),
    "ImageTextContrastiveLoss": Door(lambda image_features, text_features: tc.ImageTextContrastiveLoss()(image_features, text_features),
                                     {"image_features": X, "text_features": Y}),
    "DCLLoss": Door(lambda out0, out1: tc.DCLLoss()(out0, out1), {"out0": X, "out1": Y}),
    "DCLWLoss": Door(lambda out0, out1: tc.DCLWLoss()(out0, out1), {"out0": X, "out1": Y}),
    "InfoNCELoss": Door(lambda query, key: tc.InfoNCELoss()(query, key), {"query": X, "key": Y}),
    "NTBXentLoss": Door(lambda embeddings: tc.NTBXentLoss()(embeddings, labels=L), {"embeddings": X}),
    "NTXentLoss": Door(lambda embeddings: tc.NTXentLoss()(embeddings), {"embeddings": X}),
    "SigLipLoss": Door(lambda image_features, text_features: tc.SigLipLoss()(image_features, text_features),
                       {"image_features": X, "text_features": Y}),
    "GlobalContrastiveLoss": Door(lambda a, b: tc.GlobalContrastiveLoss(16, "bimodal")(a, b, torch.arange(a.shape[0]) if
                                                                                       isinstance(a, torch.Tensor) and a.ndim else
                                                                                       torch.arange(8)),
                                  {"a": X, "b": Y}),
    "SupConLoss": Door(lambda features: tc.SupConLoss()(features, L), {"features": X}, skip={("features", "4-D"): _AUTHORS_VIEWS}),
    # the helpers: their tensors are not loss rows; their bad input is in CASES
    "FeatureQueue": Door(None, note="CASES: size, dim, dtype, fill, overflow and push's rows"),
    "Positives": Door(None, note="CASES: keys that are not 1-D integer tensors"),
    "RngSnapshot": Door(None, note="CASES: devices"),
    "all_gather_with_grad": Door(None, note="CASES: a non-tensor, a 0-dim tensor (any other tensor is gathered as it is)"),
    "explain": Door(None, note="CASES: a non-callable, a bad call"),
    "grad_cache": Door(None, note="CASES: encoders, inputs, loss_fn, micro_batch"),
    "pair_keys": Door(None, note="CASES: n_rows, pairing"),
    "text_ids": Door(None, note="CASES: texts"),
    "Decision": Door(None, note="not a door: the planner's answer (explain returns it); users read it, never build one"),
    # the integrations
    "open_clip.ClipLoss": Door(lambda image_features, text_features: oc.ClipLoss()(image_features, text_features, torch.tensor(14.0)),
                               {"image_features": X, "text_features": Y}),
    "open_clip.SigLipLoss": Door(lambda image_features, text_features: oc.SigLipLoss()(image_features, text_features,
                                                                                      torch.tensor(10.0), torch.tensor(-10.0)),
                                 {"image_features": X, "text_features": Y}),
    "sentence_transformers.mnrl_loss": Door(lambda queries, docs: st.mnrl_loss(queries, [docs]), {"queries": X, "docs": Y}),
    "sentence_transformers.MultipleNegativesRankingLoss": Door(None, note="CASES: model, scale, similarity_fct; its rows go through mnrl_loss"),
    "sentence_transformers.CachedMultipleNegativesRankingLoss": Door(None, note="CASES: model, mini_batch_size"),
    "sentence_transformers.GISTEmbedLoss": Door(None, note="CASES: model, guide, temperature, margin_strategy"),
    "sentence_transformers.CachedGISTEmbedLoss": Door(None, note="CASES: guide, mini_batch_size"),
    "sentence_transformers.MultipleNegativesSymmetricRankingLoss": Door(None, note="CASES: model, scale"),
    "sentence_transformers.CachedMultipleNegativesSymmetricRankingLoss": Door(None, note="CASES: model, mini_batch_size"),
    "sentence_transformers.MatryoshkaLoss": Door(None, note="CASES: model, loss, matryoshka_dims, n_dims_per_step; its rows go through "
                                                            "matryoshka_info_nce_loss"),
}


def _public_names() -> set[str]:
    names = set(tc.__all__)
    names |= {f"open_clip.{n}" for n in oc.__all__} | {f"sentence_transformers.{n}" for n in st.__all__}
    return names


def test_every_public_name_has_a_row():
    assert set(DOORS) == _public_names()
    assert all(door.call is not None or door.note for door in DOORS.values())


def _attacks() -> list[tuple[str, str, str]]:
    return [(name, arg, kind) for name, door in DOORS.items() if door.call is not None
            for arg in door.tensors for kind in ATTACKS if (arg, kind) not in door.skip]


@pytest.mark.parametrize("name,arg,kind", _attacks())
def test_a_bad_tensor_is_refused_in_the_callers_words(name, arg, kind):
    door = DOORS[name]
    spoil, exc = ATTACKS[kind]
    given = {k: v.clone() for k, v in door.tensors.items()}
    kwargs = dict(given)
    kwargs[arg] = spoil(given[arg])
    before = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    with pytest.raises((ValueError, TypeError)) as info:
        door.call(**kwargs)
    assert isinstance(info.value, exc), info.value
    assert arg in str(info.value), info.value
    for k, v in before.items():  # the caller's tensors are never modified
        assert torch.equal(kwargs[k], v) or (torch.isnan(v).any() and torch.equal(kwargs[k].nan_to_num(), v.nan_to_num())), k


@pytest.mark.parametrize("name", [n for n, d in DOORS.items() if d.call is not None])
def test_one_row_batches_are_a_clear_error_or_a_finite_loss(name):
    door = DOORS[name]
    try:
        value = door.call(**{k: v[:1] for k, v in door.tensors.items()})
    except (ValueError, TypeError) as err:
        assert any(k in str(err) for k in (*door.tensors, "labels", "rows", "batch")), err
    else:
        assert torch.isfinite(value).all()


MODULES = [tc.ClipLoss, tc.DCLLoss, tc.DCLWLoss, tc.ImageTextContrastiveLoss, tc.InfoNCELoss, tc.NTBXentLoss, tc.NTXentLoss,
           tc.SupConLoss]
#: a module option -> values that are not that option
OPTIONS: dict[str, list[Any]] = {
    "temperature": [0.0, -1.0, float("nan"), float("inf"), "0.1", None, torch.tensor([0.1, 0.2])],
    "reduction": ["avg", None],
    "chunk_size": [0, -3, 2.5, "8"],
    "backend": ["gpu", None],
    "validate": ["yes", None, 1],
    "eps": [-1.0, float("nan"), "x"],
    "gather": ["yes"],
    "grad_reduction": ["avg"],
    "normalize": ["no", None],
    "learnable_temperature": ["yes"],
}


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
@pytest.mark.parametrize("option,value", [(k, val) for k, vals in OPTIONS.items() for val in vals])
def test_a_module_refuses_a_bad_option_at_construction(module, option, value):
    with pytest.raises((ValueError, TypeError), match=option):
        module(**{option: value})


class _Tower(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


CASES: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    # (public name, call, exception, words of the message)
    ("FeatureQueue", lambda: tc.FeatureQueue(0, 4), ValueError, "size"),
    ("FeatureQueue", lambda: tc.FeatureQueue(2.5, 4), ValueError, "size"),
    ("FeatureQueue", lambda: tc.FeatureQueue(4, 0), ValueError, "dim"),
    ("FeatureQueue", lambda: tc.FeatureQueue(4, 4, fill="x"), ValueError, "fill"),
    ("FeatureQueue", lambda: tc.FeatureQueue(4, 4, overflow="x"), ValueError, "overflow"),
    ("FeatureQueue", lambda: tc.FeatureQueue(4, 4, dtype=torch.int64), TypeError, "dtype"),
    ("FeatureQueue", lambda: tc.FeatureQueue(4, 6).push(X[0]), ValueError, "features"),
    ("FeatureQueue", lambda: tc.FeatureQueue(4, 6).push(X.tolist()), TypeError, "features"),
    ("FeatureQueue", lambda: tc.FeatureQueue(4, 6).push(X.long()), TypeError, "features"),
    ("FeatureQueue", lambda: tc.FeatureQueue(4, 5).push(X), ValueError, "features"),
    # push makes no host read (a training step's queue update): a non-finite row pushed is named by the
    # loss that reads the queue
    ("FeatureQueue", lambda: _pushed_nan_then_read(), ValueError, "negatives"),
    ("FeatureQueue", lambda: tc.info_nce_loss(X, Y, tc.FeatureQueue(8, 6).features, in_batch_negatives=False),
     ValueError, "negatives"),
    ("Positives", lambda: tc.Positives.from_keys(X[:, 0]), TypeError, "row_keys"),
    ("Positives", lambda: tc.Positives.from_keys(L, L[None]), TypeError, "col_keys"),
    ("RngSnapshot", lambda: tc.RngSnapshot(devices="x"), TypeError, "devices"),
    ("RngSnapshot", lambda: tc.RngSnapshot(devices=[torch.cuda.device_count()]), ValueError, "devices"),
    ("all_gather_with_grad", lambda: tc.all_gather_with_grad([1.0]), TypeError, "x"),
    ("all_gather_with_grad", lambda: tc.all_gather_with_grad(torch.tensor(1.0)), ValueError, "x"),
    ("explain", lambda: tc.explain(3), TypeError, "fn"),
    ("explain", lambda: tc.explain(tc.nt_xent_loss, X[:7]), ValueError, "embeddings"),
    ("grad_cache", lambda: tc.grad_cache(3, X, tc.nt_xent_loss, 2), TypeError, "encoders"),
    ("grad_cache", lambda: tc.grad_cache(_Tower(), 3, tc.nt_xent_loss, 2), TypeError, "inputs"),
    ("grad_cache", lambda: tc.grad_cache(_Tower(), X, 3, 2), TypeError, "loss_fn"),
    ("grad_cache", lambda: tc.grad_cache(_Tower(), X, tc.nt_xent_loss, 0), ValueError, "micro_batch"),
    ("grad_cache", lambda: tc.grad_cache([_Tower(), _Tower()], [X, Y, X], tc.nt_xent_loss, 2), ValueError, "encoders and inputs"),
    ("GlobalContrastiveLoss", lambda: tc.GlobalContrastiveLoss(8)(X, Y, torch.arange(8) + 1), ValueError, "index"),
    ("GlobalContrastiveLoss", lambda: tc.GlobalContrastiveLoss(8, gamma=1.5), ValueError, "gamma"),
    ("global_contrastive_loss", lambda: tc.global_contrastive_loss(X, Y, GlobalState(torch.zeros(8, 3))), ValueError, "log_u"),
    ("pair_keys", lambda: tc.pair_keys(7, "halves"), ValueError, "n_rows"),
    ("pair_keys", lambda: tc.pair_keys("8", "halves"), TypeError, "n_rows"),
    ("pair_keys", lambda: tc.pair_keys(8, "neighbours"), ValueError, "pairing"),
    ("text_ids", lambda: tc.text_ids("a caption"), TypeError, "texts"),
    ("text_ids", lambda: tc.text_ids([1, 2]), TypeError, "texts"),
    ("open_clip.ClipLoss", lambda: oc.ClipLoss(local_loss="yes"), TypeError, "local_loss"),
    ("open_clip.ClipLoss", lambda: oc.ClipLoss()(X, Y, torch.tensor([1.0, 2.0])), ValueError, "logit_scale"),
    ("open_clip.SigLipLoss", lambda: oc.SigLipLoss()(X, Y, 10.0, float("nan")), ValueError, "logit_bias"),
    ("sentence_transformers.mnrl_loss", lambda: st.mnrl_loss(X, X), TypeError, "docs"),
    ("sentence_transformers.mnrl_loss", lambda: st.mnrl_loss(X, [X], similarity="bogus"), ValueError, "similarity"),
    ("sentence_transformers.mnrl_loss", lambda: st.mnrl_loss(X, [X], chunk_size=0), ValueError, "chunk_size"),
    ("sentence_transformers.mnrl_loss", lambda: st.mnrl_loss(X, [X], directions=("query_to_doc", "doc_to_query"),
                                                             hardness_strength=float("inf")), ValueError, "hardness_strength"),
    ("sentence_transformers.MultipleNegativesRankingLoss", lambda: st.MultipleNegativesRankingLoss(3), TypeError, "model"),
    ("sentence_transformers.MultipleNegativesRankingLoss", lambda: st.MultipleNegativesRankingLoss(_Tower(), scale=0.0),
     ValueError, "scale"),
    ("sentence_transformers.MultipleNegativesRankingLoss",
     lambda: st.MultipleNegativesRankingLoss(_Tower(), similarity_fct="bogus"), ValueError, "similarity_fct"),
    ("sentence_transformers.CachedMultipleNegativesRankingLoss", lambda: st.CachedMultipleNegativesRankingLoss(3), TypeError, "model"),
    ("sentence_transformers.CachedMultipleNegativesRankingLoss",
     lambda: st.CachedMultipleNegativesRankingLoss(_Tower(), mini_batch_size=0), ValueError, "mini_batch_size"),
    ("sentence_transformers.MultipleNegativesSymmetricRankingLoss", lambda: st.MultipleNegativesSymmetricRankingLoss(3), TypeError,
     "model"),
    ("sentence_transformers.MultipleNegativesSymmetricRankingLoss",
     lambda: st.MultipleNegativesSymmetricRankingLoss(_Tower(), scale=float("nan")), ValueError, "scale"),
    ("sentence_transformers.CachedMultipleNegativesSymmetricRankingLoss",
     lambda: st.CachedMultipleNegativesSymmetricRankingLoss(_Tower(), mini_batch_size=0), ValueError, "mini_batch_size"),
    ("sentence_transformers.GISTEmbedLoss", lambda: st.GISTEmbedLoss(_Tower(), 3), TypeError, "guide"),
    ("sentence_transformers.CachedGISTEmbedLoss", lambda: st.CachedGISTEmbedLoss(_Tower(), 3), TypeError, "guide"),
    ("sentence_transformers.CachedGISTEmbedLoss", lambda: st.CachedGISTEmbedLoss(_Tower(), _Tower(), mini_batch_size=0), ValueError,
     "mini_batch_size"),
    ("sentence_transformers.MatryoshkaLoss", lambda: st.MatryoshkaLoss(3, st.MultipleNegativesRankingLoss(_Tower()), [4]), TypeError,
     "model"),
    ("sentence_transformers.MatryoshkaLoss", lambda: st.MatryoshkaLoss(_Tower(), "mnrl", [4]), TypeError, "loss"),
    ("sentence_transformers.MatryoshkaLoss", lambda: st.MatryoshkaLoss(_Tower(), _Tower(), [4, -2]), ValueError, "matryoshka_dims"),
    ("sentence_transformers.MatryoshkaLoss", lambda: st.MatryoshkaLoss(_Tower(), _Tower(), [4], n_dims_per_step=-3), ValueError,
     "n_dims_per_step"),
    ("sentence_transformers.GISTEmbedLoss", lambda: st.GISTEmbedLoss(_Tower(), _Tower(), temperature=0.0), ValueError, "temperature"),
    ("sentence_transformers.GISTEmbedLoss", lambda: st.GISTEmbedLoss(_Tower(), _Tower(), margin_strategy="x"), ValueError,
     "margin_strategy"),
]


def _pushed_nan_then_read() -> Any:
    queue = tc.FeatureQueue(4, 6)
    queue.push(_with(float("nan"))(N5[:4]))
    return tc.info_nce_loss(X, Y, queue.features)


def test_every_helper_has_its_cases():
    helpers = {name for name, door in DOORS.items() if door.call is None and not door.note.startswith("not a door")}
    assert helpers <= {case[0] for case in CASES}


@pytest.mark.parametrize("name,call,exc,words", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_helper_refuses_bad_input(name, call, exc, words):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert isinstance(info.value, exc) and words in str(info.value), info.value


# ------------------------------------------------------------------------------------------ the CLI
#: subcommand -> bad argument lists (each: one line on stderr, exit 2, no traceback)
CLI: dict[str, list[list[str]]] = {
    "explain": [["--rows", "3"], ["--rows", "1", "--loss", "supcon"], ["--dim", "0"], ["--temperature", "-1"],
                ["--labels", "0,1"], ["--labels", "a,b"], ["--loss", "bogus"]],
    "train": [["--epochs", "0"], ["--batch-size", "1"], ["--lr", "nan"], ["--loss", "bogus"], ["--seed", "-1"],
              ["--data", "/no/such/folder"], ["--resume", "/no/such/run"], ["--out", "/proc/x/run"], ["--chunk-size", "0"],
              ["--loss", "sogclr", "--gamma", "1.5"], ["--loss", "supcon", "--temperature-mode", "global"],
              ["--loss", "nt_xent", "--gamma-schedule", "cosine"]],
    "embed": [["--run", "/no/such/run"], ["--run", "x", "--out", "/proc/x/emb.npy"]],
    "bench": [["--sizes", "0"], ["--small", "--sizes", "3"], ["--dim", "0"], ["--calibrate"], ["--out", "/proc/x/bench"],
              ["--backend", "gpu"]],
}


def _subcommands() -> set[str]:
    from torch_contrastive.cli import build_parser

    parser = build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(actions[0].choices)


def test_every_subcommand_has_its_bad_arguments():
    assert set(CLI) == _subcommands()


@pytest.mark.parametrize("argv", [[cmd, *args] for cmd, cases in CLI.items() for args in cases], ids=" ".join)
def test_a_subcommand_answers_bad_arguments_in_one_line_with_exit_2(argv, capsys, tmp_path, monkeypatch):
    from torch_contrastive.cli import main

    monkeypatch.chdir(tmp_path)  # nothing it might write lands in the checkout
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err.strip()
    assert code == 2, (code, err)
    assert err and "\n" not in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing is written"
