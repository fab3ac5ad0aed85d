"""MatryoshkaLoss against the installed sentence-transformers: values and parameter gradients equal for
the ranking losses (plain, cached, symmetric; every prefix in one pass), the GIST loss and a foreign
loss (per prefix), with and without n_dims_per_step."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from peers import param_grads, st_features, tiny_st_pair
from torch_contrastive.integrations import sentence_transformers as ours_st

st_losses = pytest.importorskip("sentence_transformers.sentence_transformer.losses")

DIMS, WEIGHTS = [16, 8, 4, 2], [1.0, 0.5, 2.0, 1.0]


@pytest.fixture(scope="module")
def st_models(tmp_path_factory):
    return tiny_st_pair(tmp_path_factory)


def _run(model, wrapper, inner, features, n_dims_per_step, seed):
    model.zero_grad()
    loss = wrapper(model, inner, DIMS, WEIGHTS, n_dims_per_step=n_dims_per_step)
    random.seed(seed)  # both wrappers draw their prefixes from Python's random, in the same way
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the peer's symmetric classes are deprecated
        value = loss(features, None)
    value.backward()
    return value.detach(), param_grads(model)


def _assert_same(ref, got):
    torch.testing.assert_close(got[0], ref[0], rtol=1e-10, atol=1e-12)
    assert len(ref[1]) == len(got[1]) > 0
    for a, b in zip(ref[1], got[1]):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)


RANKING = [
    ("MultipleNegativesRankingLoss", {}, True),
    ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 2}, True),
    ("MultipleNegativesSymmetricRankingLoss", {}, True),
    ("CachedMultipleNegativesSymmetricRankingLoss", {"mini_batch_size": 3}, True),
    ("MultipleNegativesRankingLoss", {"directions": ("query_to_doc", "query_to_query")}, False),
    ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 2, "hardness_mode": "all_negatives", "hardness_strength": 0.5}, False),
]


@pytest.mark.parametrize("n_dims_per_step", [-1, 2])
@pytest.mark.parametrize("name,kwargs,single_pass", RANKING)
def test_matryoshka_around_the_ranking_losses_matches_sentence_transformers(st_models, name, kwargs, single_pass, n_dims_per_step):
    model, _, words = st_models
    _, features = st_features(model, words, 7, 3, seed=3)  # queries, positives, one hard-negative column
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the peer's symmetric classes are deprecated
        peer_inner = getattr(st_losses, name)(model, **kwargs)
    ref = _run(model, st_losses.MatryoshkaLoss, peer_inner, features, n_dims_per_step, seed=5)
    inner = getattr(ours_st, name)(model, **kwargs)
    from torch_contrastive.integrations._matryoshka import one_pass

    assert one_pass(inner) == single_pass
    _assert_same(ref, _run(model, ours_st.MatryoshkaLoss, inner, features, n_dims_per_step, seed=5))


@pytest.mark.parametrize("n_dims_per_step", [-1, 3])
def test_matryoshka_around_gist_and_a_foreign_loss_matches_sentence_transformers(st_models, n_dims_per_step):
    """GIST (ours and the peer's) and a loss of the peer's own are called once per prefix on embeddings
    computed once; the guide model keeps its full width."""
    model, guide, words = st_models
    _, features = st_features(model, words, 6, 3, seed=4)
    ref = _run(model, st_losses.MatryoshkaLoss, st_losses.GISTEmbedLoss(model, guide, temperature=0.05), features,
               n_dims_per_step, seed=7)
    _assert_same(ref, _run(model, ours_st.MatryoshkaLoss, ours_st.GISTEmbedLoss(model, guide, temperature=0.05), features,
                           n_dims_per_step, seed=7))
    _assert_same(ref, _run(model, ours_st.MatryoshkaLoss, st_losses.GISTEmbedLoss(model, guide, temperature=0.05), features,
                           n_dims_per_step, seed=7))
    out = model(features[0])["sentence_embedding"]
    assert out.shape[1] == 16  # the model's forward is its own again


@pytest.mark.parametrize("n_dims_per_step", [-1, 2])
def test_matryoshka_around_cached_gist_matches_sentence_transformers(st_models, n_dims_per_step):
    """The cached GIST loss: one embedding pass and one replay for all prefixes (the guide's embeddings
    once, at full width); the peer decorates its loss's calculate_loss."""
    model, guide, words = st_models
    _, features = st_features(model, words, 7, 3, seed=8)
    ref = _run(model, st_losses.MatryoshkaLoss, st_losses.CachedGISTEmbedLoss(model, guide, temperature=0.05, mini_batch_size=3),
               features, n_dims_per_step, seed=9)
    _assert_same(ref, _run(model, ours_st.MatryoshkaLoss, ours_st.CachedGISTEmbedLoss(model, guide, temperature=0.05, mini_batch_size=3),
                           features, n_dims_per_step, seed=9))


def test_matryoshka_checks_its_arguments(st_models):
    model, _, _ = st_models
    inner = ours_st.MultipleNegativesRankingLoss(model)
    for dims, weights, n, words in (([], None, -1, "matryoshka_dims"), ([16, 0], None, -1, "positive ints"),
                                    ([32, 8], None, -1, "cannot exceed the embedding size 16"),
                                    ([16, 8], [1.0], -1, "one number per dim"), ([16, 8], [1.0, float("nan")], -1, "finite"),
                                    ([16, 8], None, 0, "n_dims_per_step"), ([16, 8], None, True, "n_dims_per_step")):
        with pytest.raises(ValueError, match=words):
            ours_st.MatryoshkaLoss(model, inner, dims, weights, n_dims_per_step=n)
    with pytest.raises(TypeError, match="CachedMultipleNegativesRankingLoss"):
        ours_st.MatryoshkaLoss(model, st_losses.CachedMultipleNegativesRankingLoss(model), [16, 8])
    loss = ours_st.MatryoshkaLoss(model, inner, [4, 16, 8], [1, 2, 3])
    assert loss.matryoshka_dims == (16, 8, 4) and loss.matryoshka_weights == (2, 3, 1)  # sorted largest first, as the peer
    assert loss.get_config_dict()["loss"] == "MultipleNegativesRankingLoss"


def _gathered_ranks(rank, world, symmetric):
    """One rank of MatryoshkaLoss around the ranking loss with gather_across_devices, in one pass: this rank's
    value and the gradient of its own embeddings against the float64 definition written out over the whole
    group (the peer's gathering: every rank's doc columns, rank-ordered, query i's positive at its global row;
    a rank's rows get every rank's loss's gradient, as through the peer's all_gather with gradient)."""
    import torch.nn.functional as F

    from torch_contrastive.integrations._matryoshka import one_pass

    rows, width, dims, weights, scale = 3, 16, [16, 8, 4], [1.0, 0.5, 2.0], 20.0
    g = torch.Generator().manual_seed(0)
    every = [torch.randn(world * rows, width, generator=g, dtype=torch.float64) for _ in range(3)]  # queries, positives, negatives
    mine = [e[rank * rows:(rank + 1) * rows].clone().requires_grad_() for e in every]
    cls = ours_st.MultipleNegativesSymmetricRankingLoss if symmetric else ours_st.MultipleNegativesRankingLoss
    inner = cls(torch.nn.Linear(1, 1), scale=scale, gather_across_devices=True)  # a stand-in model: embeddings are given
    assert one_pass(inner)
    wrapper = ours_st.MatryoshkaLoss(inner.model, inner, dims, weights)
    value = wrapper.loss_from_embeddings(mine if not symmetric else mine[:2], None, dims, weights)
    grads = torch.autograd.grad(value, mine if not symmetric else mine[:2])

    leaves = [e.clone().requires_grad_() for e in (every if not symmetric else every[:2])]
    total, mine_ref = 0.0, None
    for r in range(world):  # every rank's loss, each its own mean
        loss_r = 0.0
        for d, w in zip(dims, weights):
            q, *cols = (F.normalize(e[:, :d], dim=1) for e in leaves)
            q_r = q[r * rows:(r + 1) * rows]
            target = torch.arange(rows) + r * rows
            term = F.cross_entropy(q_r @ torch.cat(cols).T * scale, target)
            if symmetric:
                term = 0.5 * (term + F.cross_entropy(cols[0][r * rows:(r + 1) * rows] @ q.T * scale, target))
            loss_r = loss_r + w * term
        total = total + loss_r
        if r == rank:
            mine_ref = loss_r
    want = torch.autograd.grad(total, leaves)
    torch.testing.assert_close(value.detach(), mine_ref.detach(), rtol=1e-10, atol=1e-12)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref[rank * rows:(rank + 1) * rows], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("symmetric", [False, True])
def test_gather_across_devices_keeps_the_one_pass(symmetric):
    from dist_helpers import run_ranks

    run_ranks(_gathered_ranks, 2, symmetric, timeout=180)


# ------------------------------------------------------------------ where the peer's users look (issue 63)
@pytest.mark.parametrize("name,kwargs", [("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 2}),
                                         ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 2, "mini_batch_num_tokens": 9})])
def test_the_peers_matryoshka_around_our_cached_loss_matches_the_peers_own(st_models, name, kwargs):
    """sentence-transformers' own MatryoshkaLoss wraps a gradient-caching loss's ``calculate_loss`` (our loss says it is
    one: ``uses_gradient_cache``); around ours it equals the peer's pair, values and parameter gradients, where it once
    raised a shape mismatch (the replay re-embedded at the full width)."""
    model, _, words = st_models
    _, features = st_features(model, words, 7, 2, seed=8)
    ref = _run(model, st_losses.MatryoshkaLoss, getattr(st_losses, name)(model, **kwargs), features, -1, seed=2)
    _assert_same(ref, _run(model, st_losses.MatryoshkaLoss, getattr(ours_st, name)(model, **kwargs), features, -1, seed=2))


def test_a_mini_batch_is_trimmed_to_its_own_longest_sequence_as_the_peers(st_models):
    """Each mini-batch drops the padding columns all its rows share at the end (the peer's ``_create_minibatch``): the
    features the model sees are the peer's, for right padding and left padding."""
    from sentence_transformers.base.losses.gradcache import _create_minibatch

    from torch_contrastive.integrations.sentence_transformers import _row_ends, _rows_of

    model, _, words = st_models
    _, (features,) = st_features(model, words, 9, 1, seed=11)
    left = {k: (v.flip(1) if k in ("input_ids", "attention_mask", "token_type_ids") else v) for k, v in features.items()}
    for given in (features, left):
        ends, n = _row_ends(given), given["input_ids"].shape[0]
        for start, stop in ((0, 3), (3, 6), (6, 9), (2, 3)):
            ours, peers = _rows_of(given, start, stop, n, ends), _create_minibatch(given, start, stop)
            assert set(ours) == set(peers)
            for key in peers:
                assert torch.equal(ours[key], peers[key]) if isinstance(peers[key], torch.Tensor) else ours[key] == peers[key], key
    widths = {_rows_of(features, s, s + 3, 9, _row_ends(features))["input_ids"].shape[1] for s in (0, 3, 6)}
    assert max(widths) == features["input_ids"].shape[1] or len(widths) > 1  # the texts' lengths differ: so do the widths


def test_the_model_card_reads_what_the_peer_writes(st_models):
    """``citation``, ``get_config_dict`` (the similarity as ``"cos_sim"``, the cached losses' budgets, the GIST losses'
    options) and the class's public path: the same keys and values as the peer's losses."""
    model, guide, _ = st_models
    pairs = [
        (ours_st.MultipleNegativesRankingLoss(model), st_losses.MultipleNegativesRankingLoss(model)),
        (ours_st.CachedMultipleNegativesRankingLoss(model, mini_batch_size=4, mini_batch_num_tokens=64),
         st_losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=4, mini_batch_num_tokens=64)),
        (ours_st.GISTEmbedLoss(model, guide), st_losses.GISTEmbedLoss(model, guide)),
        (ours_st.CachedGISTEmbedLoss(model, guide, mini_batch_size=4), st_losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=4)),
        (ours_st.MatryoshkaLoss(model, ours_st.MultipleNegativesRankingLoss(model), [16, 8]),
         st_losses.MatryoshkaLoss(model, st_losses.MultipleNegativesRankingLoss(model), [16, 8])),
    ]
    for ours, peers in pairs:
        mine, theirs = ours.get_config_dict(), peers.get_config_dict()
        assert {k: mine[k] for k in theirs} == theirs, type(ours).__name__
        assert ours.citation.strip().startswith("@") and "title" in ours.citation
        assert type(ours).__module__ == "torch_contrastive.integrations.sentence_transformers"
    mnrl = ours_st.MultipleNegativesRankingLoss(model)
    a, b = torch.randn(3, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    from sentence_transformers import util

    torch.testing.assert_close(mnrl.similarity_fct(a, b), util.cos_sim(a, b))
    assert ours_st.MultipleNegativesRankingLoss(model, similarity_fct=util.dot_score).get_config_dict()["similarity_fct"] == "dot_score"
