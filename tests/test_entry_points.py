"""Every public entry point refuses bad input (issue 36; README, "Errors").

One table, :data:`doors.DOORS`, holds every name of ``torch_contrastive.__all__`` and of the
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
import inspect
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import torch_contrastive as tc
from doors import ATTACKS, DOORS, N5, L, X, Y, _with, public_names
from torch_contrastive.integrations import open_clip as oc
from torch_contrastive.integrations import sentence_transformers as st
from torch_contrastive.losses.global_contrastive import GlobalState


def test_every_public_name_has_a_row():
    assert set(DOORS) == public_names()
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
                ["--labels", "0,1,0,1,0,1,0,99999999999999999999999"],
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


# ------------------------------------------------------------------ the functions' options (issue 63)
#: every public function that takes the shared options, called well with ``**options`` added
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "clip_loss": lambda **kw: tc.clip_loss(X, Y, **kw),
    "image_text_contrastive_loss": lambda **kw: tc.image_text_contrastive_loss(X, Y, **kw),
    "info_nce_loss": lambda **kw: tc.info_nce_loss(X, Y, N5, **kw),
    "nt_bxent_loss": lambda **kw: tc.nt_bxent_loss(X, labels=L, **kw),
    "nt_xent_loss": lambda **kw: tc.nt_xent_loss(X, **kw),
    "siglip_loss": lambda **kw: tc.siglip_loss(X, Y, 10.0, -10.0, **kw),
    "global_contrastive_loss": lambda **kw: tc.global_contrastive_loss(X, Y, GlobalState(torch.full((8, 2), -math.inf)), **kw)[0],
    "supcon_loss": lambda **kw: tc.supcon_loss(X, L, **kw),
    "matryoshka_info_nce_loss": lambda **kw: tc.matryoshka_info_nce_loss(X, Y, [6, 3], **kw),
    "sentence_transformers.mnrl_loss": lambda **kw: st.mnrl_loss(X, [Y], **kw),
}


def _takes_options(fn: Any) -> set[str]:
    return set(inspect.signature(fn).parameters) & set(OPTIONS)


def test_every_function_with_options_is_walked():
    public = {name: getattr(tc, name) for name in tc.__all__} | {f"sentence_transformers.{n}": getattr(st, n) for n in st.__all__}
    with_options = {name for name, fn in public.items() if inspect.isfunction(fn) and _takes_options(fn)}
    assert with_options == set(FUNCTIONS)


def _option_attacks() -> list[tuple[str, str, Any]]:
    public = {name: getattr(tc, name) for name in tc.__all__} | {f"sentence_transformers.{n}": getattr(st, n) for n in st.__all__}
    return [(name, option, value) for name in FUNCTIONS for option in sorted(_takes_options(public[name]))
            for value in OPTIONS[option]]


@pytest.mark.parametrize("name,option,value", _option_attacks(), ids=lambda x: repr(x) if not isinstance(x, str) else x)
def test_a_function_refuses_a_bad_option(name, option, value):
    """The functions check every shared option as the modules do: ``normalize="no"`` is not a silent True, nor 0 a
    silent False."""
    with pytest.raises((ValueError, TypeError), match=option):
        FUNCTIONS[name](**{option: value})


OPTIONS_ALSO = {"normalize": [0, 1, "no"], "validate": [0, "no"], "gather": [0]}


@pytest.mark.parametrize("option,value", [(k, val) for k, vals in OPTIONS_ALSO.items() for val in vals])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_zero_and_one_are_not_bools(name, option, value):
    fn = {"sentence_transformers.mnrl_loss": st.mnrl_loss}.get(name) or getattr(tc, name)
    if option not in inspect.signature(fn).parameters:
        pytest.skip(f"{name} takes no {option}")
    with pytest.raises(TypeError, match=option):
        FUNCTIONS[name](**{option: value})


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_positive_weight_is_refused(weight):
    w = torch.ones(8)
    w[3] = weight
    with pytest.raises(ValueError, match="positive_weight"):
        tc.nt_xent_loss(X, 0.2, decoupled=True, positive_weight=w)
    with pytest.raises(ValueError, match="weight_fn"):
        tc.DCLLoss(weight_fn=lambda a, b: w)(X, Y)


def test_pairing_is_checked_with_labels_too():
    with pytest.raises(ValueError, match="pairing"):
        tc.nt_xent_loss(X, 0.2, labels=L, pairing="bogus")


def test_a_learnable_global_temperature_driven_below_zero_is_refused():
    loss = tc.GlobalContrastiveLoss(16, "bimodal", temperature_mode="global")
    assert loss(X, Y, torch.arange(8)) > 0
    with torch.no_grad():
        loss.tau.fill_(-0.1)
    with pytest.raises(ValueError, match="temperature must be positive"):
        loss(X, Y, torch.arange(8))
