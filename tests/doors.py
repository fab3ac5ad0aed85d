"""Every public entry point, registered once: :data:`DOORS` (a loss function, a module, a helper, a drop-in,
with the tensors it takes). The contracts that cover every entry point walk this table -- bad input
(``test_entry_points.py``), ``torch.compile`` (``test_compile.py``) -- so a new public name gets their checks by
being listed here; a name of a package's ``__all__`` without a row fails ``test_every_public_name_has_a_row``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

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


def public_names() -> set[str]:
    names = set(tc.__all__)
    names |= {f"open_clip.{n}" for n in oc.__all__} | {f"sentence_transformers.{n}" for n in st.__all__}
    return names
