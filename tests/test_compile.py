"""``torch.compile`` of every public loss equals eager, values and gradients (issue 63; docs/engine.md).

The contract walks :data:`doors.DOORS`: every door with a call (a loss function, a module, a drop-in) has its
rows in :data:`TRACED` -- the same call with a temperature ``t`` (a float, or a learnable 0-dim tensor; a
module: its fixed or its learnable temperature) and ``validate`` -- so a new public loss is compiled here by
being registered (:func:`test_every_loss_door_is_compiled`). Each row is compiled with ``fullgraph=True`` on a
fresh library (no kept call, no kept plan: the first call of a training step), under ``aot_eager`` for every
temperature kind and ``validate``, and each function's first row under ``inductor``; the default mode (graph breaks allowed) after an
eager call of the same signature. ``torch.func`` transforms are refused with a clear error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import torch_contrastive as tc
from doors import DOORS, N5, L, X, Y
from torch_contrastive.engine import problem_plan
from torch_contrastive.integrations import open_clip as oc
from torch_contrastive.integrations import sentence_transformers as st
from torch_contrastive.losses import _kept, _pairing
from torch_contrastive.losses.global_contrastive import GlobalState

pytestmark = pytest.mark.slow

Row = Callable[[dict[str, torch.Tensor], Any, bool], Any]


def _module(make: Callable[[Any], torch.nn.Module], call: Callable[[torch.nn.Module, dict[str, torch.Tensor]], Any]) -> Row:
    """A module row: built once per (temperature kind, validate) -- ``make(t)`` gets the float, or None for the
    module's learnable temperature -- then called; its parameters are among the gradients compared."""
    built: dict[tuple[bool, bool], torch.nn.Module] = {}

    def build(t: Any, validate: bool) -> None:  # outside the compiled region: Dynamo builds no parameter
        key = (isinstance(t, torch.Tensor), validate)
        if key not in built:
            built[key] = make(None if key[0] else t, validate)

    def row(x: dict[str, torch.Tensor], t: Any, validate: bool) -> Any:
        return call(built[(isinstance(t, torch.Tensor), validate)], x)

    row.modules, row.build = built, build  # type: ignore[attr-defined]
    return row


def _learnable(cls: type, **kw: Any) -> Callable[[Any, bool], torch.nn.Module]:
    return lambda t, validate: cls(learnable_temperature=True, validate=validate, **kw) if t is None else \
        cls(t, validate=validate, **kw)


TWO = {"image_feat": X, "text_feat": Y}
ONE = {"embeddings": X}

#: door -> {variant: (tensors, row)}; a row is ``row(tensors, t, validate) -> loss`` (or a tuple whose first item is)
TRACED: dict[str, dict[str, tuple[dict[str, torch.Tensor], Row]]] = {
    "clip_loss": {"": (TWO, lambda x, t, v: tc.clip_loss(x["image_feat"], x["text_feat"], t, validate=v)),
                  "ids": (TWO, lambda x, t, v: tc.clip_loss(x["image_feat"], x["text_feat"], t, L, L, validate=v))},
    "image_text_contrastive_loss": {"": (TWO, lambda x, t, v: tc.image_text_contrastive_loss(x["image_feat"], x["text_feat"], t,
                                                                                               validate=v))},
    "info_nce_loss": {"": ({"query": X, "key": Y, "negatives": N5},
                           lambda x, t, v: tc.info_nce_loss(x["query"], x["key"], x["negatives"], t, validate=v))},
    "matryoshka_info_nce_loss": {"": ({"query": X, "key": Y}, lambda x, t, v: tc.matryoshka_info_nce_loss(
        x["query"], x["key"], [6, 3], temperature=t if isinstance(t, float) else 0.2, validate=v))},
    "matryoshka_loss": {"": (ONE, lambda x, t, v: tc.matryoshka_loss(tc.nt_xent_loss, [x["embeddings"]], [6, 3], temperature=t,
                                                                     validate=v))},
    "nt_bxent_loss": {"labels": (ONE, lambda x, t, v: tc.nt_bxent_loss(x["embeddings"], labels=L, temperature=t, validate=v)),
                      "pairs": (ONE, lambda x, t, v: tc.nt_bxent_loss(x["embeddings"], torch.tensor([[0, 1], [1, 0], [2, 5]]),
                                                                      t, validate=v))},
    "nt_xent_loss": {"adjacent": (ONE, lambda x, t, v: tc.nt_xent_loss(x["embeddings"], t, validate=v)),
                     "halves": (ONE, lambda x, t, v: tc.nt_xent_loss(x["embeddings"], t, pairing="halves", validate=v)),
                     "labels": (ONE, lambda x, t, v: tc.nt_xent_loss(x["embeddings"], t, labels=L, validate=v)),
                     "decoupled": (ONE, lambda x, t, v: tc.nt_xent_loss(x["embeddings"], t, decoupled=True, validate=v))},
    "siglip_loss": {"": (TWO, lambda x, t, v: tc.siglip_loss(x["image_feat"], x["text_feat"], 1 / t, -1.0, validate=v))},
    "global_contrastive_loss": {"": ({"a": X, "b": Y}, lambda x, t, v: tc.global_contrastive_loss(
        x["a"], x["b"], GlobalState(torch.full((8, 2), -math.inf)), t, validate=v)[0])},
    "supcon_loss": {"labels": ({"features": X}, lambda x, t, v: tc.supcon_loss(x["features"], L, temperature=t, validate=v)),
                    "views": ({"features": X}, lambda x, t, v: tc.supcon_loss(x["features"].view(4, 2, 6), L[:4], temperature=t,
                                                                              validate=v))},
    "ClipLoss": {"": ({"a": X, "b": Y}, _module(_learnable(tc.ClipLoss), lambda m, x: m(x["a"], x["b"])))},
    "ImageTextContrastiveLoss": {"": ({"a": X, "b": Y}, _module(_learnable(tc.ImageTextContrastiveLoss), lambda m, x: m(x["a"], x["b"])))},
    "DCLLoss": {"": ({"a": X, "b": Y}, _module(_learnable(tc.DCLLoss), lambda m, x: m(x["a"], x["b"])))},
    "DCLWLoss": {"": ({"a": X, "b": Y}, _module(_learnable(tc.DCLWLoss), lambda m, x: m(x["a"], x["b"])))},
    "InfoNCELoss": {"": ({"a": X, "b": Y}, _module(_learnable(tc.InfoNCELoss), lambda m, x: m(x["a"], x["b"])))},
    "NTBXentLoss": {"": (ONE, _module(_learnable(tc.NTBXentLoss), lambda m, x: m(x["embeddings"], labels=L)))},
    "NTXentLoss": {"": (ONE, _module(_learnable(tc.NTXentLoss), lambda m, x: m(x["embeddings"])))},
    "SupConLoss": {"": (ONE, _module(_learnable(tc.SupConLoss), lambda m, x: m(x["embeddings"], L)))},
    "SigLipLoss": {"": ({"a": X, "b": Y}, _module(lambda t, v: tc.SigLipLoss(learnable=t is None, validate=v),
                                                   lambda m, x: m(x["a"], x["b"])))},
    "GlobalContrastiveLoss": {"": ({"a": X, "b": Y}, _module(lambda t, v: tc.GlobalContrastiveLoss(
        16, "bimodal", temperature=0.1 if t is None else t, validate=v), lambda m, x: m(x["a"], x["b"], torch.arange(8))))},
    "open_clip.ClipLoss": {"": ({"a": X, "b": Y}, lambda x, t, v: oc.ClipLoss()(x["a"], x["b"], 1 / t if isinstance(t, torch.Tensor)
                                                                                 else torch.tensor(1 / t)))},
    "open_clip.SigLipLoss": {"": ({"a": X, "b": Y}, lambda x, t, v: oc.SigLipLoss()(
        x["a"], x["b"], 1 / t if isinstance(t, torch.Tensor) else torch.tensor(1 / t), torch.tensor(-1.0)))},
    "sentence_transformers.mnrl_loss": {"": ({"q": X, "d": Y}, lambda x, t, v: st.mnrl_loss(x["q"], [x["d"]], scale=1 / t))},
}

#: doors with a call that are not compiled here, and why
NOT_TRACED: dict[str, str] = {}
#: doors whose temperature is a float only (no tensor temperature to learn)
FLOAT_ONLY = {"matryoshka_info_nce_loss", "sentence_transformers.mnrl_loss", "GlobalContrastiveLoss", "global_contrastive_loss"}


def test_every_loss_door_is_compiled():
    with_call = {name for name, door in DOORS.items() if door.call is not None}
    assert with_call == set(TRACED) | set(NOT_TRACED)
    assert set(TRACED) <= set(DOORS)


def _fresh() -> None:
    """The library as a new process has it: no kept call, no kept plan, no kept partners; Dynamo's caches empty."""
    torch._dynamo.reset()
    _kept.clear()
    problem_plan._PLANS.clear()
    _pairing._PARTNERS.clear()
    _pairing._PARTNER_POSITIVES.clear()


def _run(row: Row, tensors: dict[str, torch.Tensor], tau: str, validate: bool, fn: Callable[..., Any] | None = None):
    """One forward and backward: the value and the gradients of the inputs, the temperature and any module's parameters."""
    x = {k: v.clone().requires_grad_(True) for k, v in tensors.items()}
    t: Any = 0.2 if tau == "float" else torch.tensor(0.2, requires_grad=True)
    if hasattr(row, "build"):
        row.build(t, validate)
    out = (fn or row)(x, t, validate)
    value = out[0] if isinstance(out, tuple) else out
    value.backward()
    modules = getattr(row, "modules", {})
    params = [p for m in modules.values() for p in m.parameters() if p.grad is not None]
    # (a module's temperature is its own parameter: the tensor t is for the functions)
    taken = [t.grad] if isinstance(t, torch.Tensor) and not modules else []
    grads = [x[k].grad for k in sorted(x)] + taken + [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return value.detach(), grads


def _compare(row: Row, tensors: dict[str, torch.Tensor], tau: str, validate: bool, **compile_kw: Any) -> None:
    compiled = torch.compile(row, **compile_kw)
    got = _run(row, tensors, tau, validate, compiled)
    want = _run(row, tensors, tau, validate)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert len(got[1]) == len(want[1])
    for g, w in zip(got[1], want[1]):
        assert g is not None and w is not None
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _rows() -> list[tuple[str, str]]:
    return [(name, variant) for name, variants in TRACED.items() for variant in variants]


def _id(case: tuple[str, str]) -> str:
    return f"{case[0]}-{case[1]}" if case[1] else case[0]


@pytest.mark.parametrize("validate", [False, True], ids=["unvalidated", "validated"])
@pytest.mark.parametrize("tau", ["float", "tensor"])
@pytest.mark.parametrize("case", _rows(), ids=_id)
def test_fullgraph_first_call_equals_eager(case, tau, validate):
    if tau == "tensor" and case[0] in FLOAT_ONLY:
        pytest.skip("a float temperature only")
    tensors, row = TRACED[case[0]][case[1]]
    _fresh()
    _compare(row, tensors, tau, validate, fullgraph=True, backend="aot_eager")


@pytest.mark.parametrize("case", _rows(), ids=_id)
def test_default_mode_after_an_eager_call_equals_eager(case):
    tensors, row = TRACED[case[0]][case[1]]
    _fresh()
    _run(row, tensors, "float", True)  # the eager call first: a kept call, a kept plan
    _run(row, tensors, "float", True)
    _compare(row, tensors, "float", True, backend="aot_eager")


def _inductor_rows() -> list[tuple[str, str]]:
    """Each function door's first row: inductor's compile costs seconds a graph on a CPU, and the modules and the
    further variants run the same engine calls (aot_eager above traces every row)."""
    return [(name, next(iter(variants))) for name, variants in TRACED.items()
            if not hasattr(next(iter(variants.values()))[1], "build")]


@pytest.mark.parametrize("case", _inductor_rows(), ids=_id)
def test_inductor_fullgraph_equals_eager(case):
    tensors, row = TRACED[case[0]][case[1]]
    _fresh()
    _compare(row, tensors, "float" if case[0] in FLOAT_ONLY else "tensor", False, fullgraph=True, backend="inductor")


@pytest.mark.parametrize("bad,words", [("nan", "non-finite"), ("tau", "temperature must be positive")])
def test_validate_true_refuses_bad_input_inside_the_compiled_graph(bad, words):
    """``validate=True`` under ``torch.compile``: the value checks are assertions in the graph (no host read, so
    ``fullgraph=True`` holds), and bad input still stops the step with the argument named."""
    _fresh()
    step = torch.compile(lambda x, t: tc.nt_xent_loss(x, t), fullgraph=True, backend="aot_eager")
    x, t = X.clone(), torch.tensor(0.2)
    step(x, t)  # good input compiles and runs
    if bad == "nan":
        x[2, 1] = float("nan")
    else:
        t = torch.tensor(-0.2)
    with pytest.raises(RuntimeError, match=words):
        step(x, t)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_torch_func_transforms_are_refused_clearly(transform):
    def loss(x: torch.Tensor) -> torch.Tensor:
        return tc.nt_xent_loss(x, 0.2)

    with pytest.raises(NotImplementedError, match=r"torch\.func"):
        if transform == "grad":
            torch.func.grad(loss)(X.clone())
        else:
            torch.func.vmap(loss)(X.clone()[None].expand(2, 8, 6))
