"""The drop-in call forms against the installed peers: sentence-transformers, open_clip,
lightly and pytorch-metric-learning (values and gradients on the peers' own call paths)."""

from __future__ import annotations

import itertools

import pytest
import torch

import torch_contrastive as tc
from dist_helpers import run_ranks
from peers import lightly_files, open_clip_loss, tiny_st_pair
from peers import param_grads as _param_grads
from peers import st_features as _features
from torch_contrastive.integrations import open_clip as oc
from torch_contrastive.integrations import sentence_transformers as ours_st

F64 = torch.float64


def _grads(value, leaves):
    return torch.autograd.grad(value, leaves)


def _assert_same(ref, got, ref_leaves, got_leaves, tol=1e-12):
    torch.testing.assert_close(got.to(ref.dtype), ref, rtol=tol, atol=tol)
    for a, b in zip(_grads(ref, ref_leaves), _grads(got, got_leaves)):
        torch.testing.assert_close(b, a, rtol=tol, atol=tol)


# ---------------------------------------------------------------- sentence-transformers
st_losses = pytest.importorskip("sentence_transformers.sentence_transformer.losses")
st_util = pytest.importorskip("sentence_transformers.util")

MNRL_CASES = [
    (dirs, mode, hardness, k)
    for dirs, mode in [(("query_to_doc",), "joint"), (("query_to_doc", "doc_to_query"), "joint"),
                       (("query_to_doc", "doc_to_query"), "per_direction"),
                       (("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"), "joint"),
                       (("query_to_doc", "doc_to_doc"), "joint")]
    for hardness, k in [(None, 2), (None, 3), ("in_batch_negatives", 3), ("hard_negatives", 4), ("all_negatives", 3)]
]


@pytest.mark.parametrize("similarity", ["cos_sim", "dot_score"])
@pytest.mark.parametrize(("directions", "partition_mode", "hardness_mode", "columns"), MNRL_CASES)
def test_mnrl_matches_sentence_transformers(device, directions, partition_mode, hardness_mode, columns, similarity):
    gen = torch.Generator().manual_seed(len(directions) * 10 + columns)
    emb = [torch.randn(7, 5, generator=gen, dtype=F64).to(device).requires_grad_() for _ in range(columns)]
    fn = getattr(st_util, similarity)
    kwargs = dict(scale=7.0, similarity_fct=fn, directions=directions, partition_mode=partition_mode,
                  hardness_mode=hardness_mode, hardness_strength=0.5 if hardness_mode else 0.0)
    ref = st_losses.MultipleNegativesRankingLoss(torch.nn.Identity(), **kwargs).compute_loss_from_embeddings(emb, None)
    got = ours_st.MultipleNegativesRankingLoss(torch.nn.Identity(), **kwargs, chunk_size=3).compute_loss_from_embeddings(emb)
    _assert_same(ref, got, emb, emb)


def test_mnrl_fp32_strips_match_float64():
    gen = torch.Generator().manual_seed(3)
    emb = [torch.randn(33, 8, generator=gen, dtype=F64) for _ in range(3)]
    loss = ours_st.MultipleNegativesRankingLoss(torch.nn.Identity(), directions=("query_to_doc", "doc_to_query"))
    ref = loss.compute_loss_from_embeddings(emb)
    got = loss.compute_loss_from_embeddings([e.float() for e in emb])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def _all_equal_the_first(results):
    """Every (value, parameter gradients) pair equals the first (the peer's) to float64 rounding."""
    for other in results[1:]:
        torch.testing.assert_close(other[0], results[0][0], rtol=1e-10, atol=1e-12)
        for a, b in zip(results[0][1], other[1]):
            torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)


@pytest.fixture(scope="module")
def st_models(tmp_path_factory):
    return tiny_st_pair(tmp_path_factory)


@pytest.mark.parametrize("directions", [("query_to_doc",), ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")])
def test_mnrl_through_a_model_matches_parameter_gradients(st_models, directions):
    model, _, words = st_models
    _, features = _features(model, words, 6, 3, seed=1)
    results = []
    for cls in (st_losses.MultipleNegativesRankingLoss, ours_st.MultipleNegativesRankingLoss):
        model.zero_grad()
        value = cls(model, directions=directions)(features, None)
        value.backward()
        results.append((value.detach(), _param_grads(model)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-10, atol=1e-12)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("budget", [{"mini_batch_size": 2}, {"mini_batch_num_tokens": 9}])
def test_cached_mnrl_matches_sentence_transformers(st_models, budget):
    model, _, words = st_models
    _, features = _features(model, words, 7, 3, seed=2)
    results = []
    for cls in (st_losses.CachedMultipleNegativesRankingLoss, ours_st.CachedMultipleNegativesRankingLoss,
                ours_st.MultipleNegativesRankingLoss):
        model.zero_grad()
        loss = cls(model, directions=("query_to_doc", "doc_to_query"), **({} if cls is ours_st.MultipleNegativesRankingLoss else budget))
        value = loss(features, None)
        value.backward()
        results.append((value.detach(), _param_grads(model)))
    _all_equal_the_first(results)


@pytest.mark.parametrize("cached", [False, True])
def test_the_symmetric_ranking_losses_match_sentence_transformers(st_models, cached):
    """``MultipleNegativesSymmetricRankingLoss`` and its cached form: values and parameter gradients equal
    to the installed peer's (which is itself MNRL over both directions, per direction)."""
    import warnings

    model, _, words = st_models
    _, features = _features(model, words, 6, 3, seed=4)
    name = "CachedMultipleNegativesSymmetricRankingLoss" if cached else "MultipleNegativesSymmetricRankingLoss"
    budget = {"mini_batch_size": 2} if cached else {}
    results = []
    for module in (st_losses, ours_st):
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the peer's class is deprecated in favour of MNRL's options
            value = getattr(module, name)(model, **budget)(features, None)
        value.backward()
        results.append((value.detach(), _param_grads(model)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-10, atol=1e-12)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)


def test_token_budget_ranges():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]])
    features = {"input_ids": torch.zeros_like(mask), "attention_mask": mask}
    assert ours_st.mini_batch_ranges(features, 32, 5) == [(0, 2), (2, 4), (4, 5)]  # 3+2 | 4+1 | 4
    assert ours_st.mini_batch_ranges(features, 32, 2) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]  # one row at least
    assert ours_st.mini_batch_ranges(features, 2) == [(0, 2), (2, 4), (4, 5)]
    with pytest.raises(ValueError, match="attention_mask"):
        ours_st.mini_batch_ranges({"input_ids": mask}, 2, 5)


def test_rng_snapshot_replays_dropout():
    layer = torch.nn.Dropout(0.5)
    x = torch.ones(64)
    snapshot = tc.RngSnapshot()
    first = layer(x)
    after_first = torch.rand(1)
    with snapshot.restored():
        again = layer(x)
    assert torch.equal(first, again)
    assert not torch.equal(torch.rand(1), after_first)  # outside the block the generator went on


@pytest.mark.parametrize(("anchors", "positives", "strategy", "margin", "negatives"),
                         [(True, True, "absolute", 0.0, False), (True, True, "relative", 0.1, True),
                          (False, True, "absolute", 0.05, True), (True, False, "absolute", 0.0, True), (False, False, "relative", 0.0, False)])
def test_gist_matches_sentence_transformers(st_models, anchors, positives, strategy, margin, negatives):
    model, guide, words = st_models
    _, features = _features(model, words, 6, 3 if negatives else 2, seed=3)
    results = []
    for cls in (st_losses.GISTEmbedLoss, ours_st.GISTEmbedLoss):
        model.zero_grad()
        loss = cls(model, guide, temperature=0.05, margin_strategy=strategy, margin=margin, contrast_anchors=anchors,
                   contrast_positives=positives)
        value = loss(features, None)
        value.backward()
        results.append((value.detach(), _param_grads(model)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-10, atol=1e-12)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("budget", [{"mini_batch_size": 2}, {"mini_batch_num_tokens": 9}])
@pytest.mark.parametrize(("strategy", "margin", "negatives"), [("absolute", 0.0, False), ("relative", 0.1, True)])
def test_cached_gist_matches_sentence_transformers(st_models, budget, strategy, margin, negatives):
    """CachedGISTEmbedLoss by rows and by token budget: value and every parameter gradient equal to the
    peer's cached loss and to our uncached GISTEmbedLoss."""
    model, guide, words = st_models
    _, features = _features(model, words, 7, 3 if negatives else 2, seed=6)
    results = []
    for cls, extra in ((st_losses.CachedGISTEmbedLoss, budget), (ours_st.CachedGISTEmbedLoss, budget), (ours_st.GISTEmbedLoss, {})):
        model.zero_grad()
        value = cls(model, guide, temperature=0.05, margin_strategy=strategy, margin=margin, **extra)(features, None)
        value.backward()
        results.append((value.detach(), _param_grads(model)))
    _all_equal_the_first(results)


def test_sentence_transformers_bad_arguments():
    identity = torch.nn.Identity()
    with pytest.raises(ValueError, match="query_to_doc"):
        ours_st.MultipleNegativesRankingLoss(identity, directions=("doc_to_query",))
    with pytest.raises(ValueError, match="per_direction"):
        ours_st.MultipleNegativesRankingLoss(identity, directions=("query_to_doc", "doc_to_doc"), partition_mode="per_direction")
    with pytest.raises(ValueError, match="hardness_mode"):
        ours_st.MultipleNegativesRankingLoss(identity, hardness_mode="hard")
    with pytest.raises(ValueError, match="similarity_fct"):
        ours_st.MultipleNegativesRankingLoss(identity, similarity_fct=torch.cdist)
    with pytest.raises(ValueError, match="mini_batch_size"):
        ours_st.CachedMultipleNegativesRankingLoss(identity, mini_batch_size=0)
    with pytest.raises(ValueError, match="margin_strategy"):
        ours_st.GISTEmbedLoss(identity, identity, margin_strategy="both")
    with pytest.raises(ValueError, match="mini_batch_num_tokens"):
        ours_st.CachedGISTEmbedLoss(identity, identity, mini_batch_num_tokens=0)


# ---------------------------------------------------------------- open_clip
@pytest.fixture(scope="module")
def oc_ref():
    return open_clip_loss()


def _unit_leaves(rows, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.functional.normalize(torch.randn(rows, 6, generator=gen, dtype=F64), dim=1).to(device).requires_grad_()
            for _ in range(2)]


def test_open_clip_forms_match_single_process(oc_ref, device):
    image, text = _unit_leaves(9, 0, device)
    scale = torch.tensor(7.0, dtype=F64, device=device, requires_grad=True)
    bias = torch.tensor(-3.0, dtype=F64, device=device, requires_grad=True)
    leaves = [image, text, scale]
    _assert_same(oc_ref.ClipLoss()(image, text, scale), oc.ClipLoss(chunk_size=4)(image, text, scale), leaves, leaves)
    _assert_same(oc_ref.SigLipLoss()(image, text, scale, bias), oc.SigLipLoss(chunk_size=4)(image, text, scale, bias),
                 [*leaves, bias], [*leaves, bias])
    ref = oc_ref.SigLipLoss()._loss(image, text, scale, bias, negative_only=True)
    _assert_same(ref, oc.SigLipLoss().negative_only_loss(image, text, scale, bias), [*leaves, bias], [*leaves, bias])
    assert set(oc.ClipLoss()(image, text, scale, output_dict=True)) == {"contrastive_loss"}


@pytest.mark.parametrize("scale,exc,words", [(torch.ones(2), ValueError, "logit_scale must be a scalar"),
                                             (0.0, ValueError, "logit_scale must be positive"),
                                             (float("nan"), ValueError, "logit_scale must be positive"),
                                             (None, TypeError, "logit_scale must be a positive float"),
                                             (torch.tensor([1, 2]), ValueError, "logit_scale must be a scalar")])
def test_open_clip_loss_checks_logit_scale_in_its_own_name(scale, exc, words):
    x = torch.nn.functional.normalize(torch.randn(6, 4), dim=1)
    with pytest.raises(exc, match=words):
        oc.ClipLoss()(x, x.flip(0), scale)


def _open_clip_ranks(rank, world):
    ref_module = open_clip_loss()
    image, text = _unit_leaves(4 * world, 5)
    rows = slice(4 * rank, 4 * rank + 4)
    for local_loss, with_grad in itertools.product([False, True], repeat=2):
        kwargs = dict(local_loss=local_loss, gather_with_grad=with_grad, rank=rank, world_size=world)
        a, b = image[rows].detach().requires_grad_(), text[rows].detach().requires_grad_()
        _assert_same(ref_module.ClipLoss(**kwargs)(a, b, 5.0), oc.ClipLoss(**kwargs, chunk_size=3)(a, b, 5.0), [a, b], [a, b])
    for impl in ("bidir", "shift"):
        a, b = image[rows].detach().requires_grad_(), text[rows].detach().requires_grad_()
        kwargs = dict(rank=rank, world_size=world, dist_impl=impl)
        _assert_same(ref_module.SigLipLoss(**kwargs)(a, b, 6.0, -2.0), oc.SigLipLoss(**kwargs)(a, b, 6.0, -2.0), [a, b], [a, b])


@pytest.mark.parametrize("world", [2, 3])
def test_open_clip_distributed_forms_match(world):
    run_ranks(_open_clip_ranks, world, timeout=180)


def test_open_clip_rank_arguments_must_match_the_group():
    image, text = _unit_leaves(4, 1)
    with pytest.raises(ValueError, match="process group"):
        oc.ClipLoss(rank=0, world_size=2)(image, text, 5.0)
    with pytest.raises(ValueError, match="horovod"):
        oc.ClipLoss(use_horovod=True)


# ---------------------------------------------------------------- lightly
@pytest.mark.parametrize(("batch", "size"), [(8, 32), (12, 32), (5, 7)])
def test_lightly_memory_bank_is_a_random_dropping_queue(device, batch, size):
    with lightly_files() as files:
        torch.manual_seed(11)
        ref = files["ntx_ent_loss"].NTXentLoss(temperature=0.2, memory_bank_size=(size, 6))
        torch.manual_seed(11)
        queue = tc.FeatureQueue(size, 6, fill="random", overflow="drop")
        gen = torch.Generator().manual_seed(batch)
        for _ in range(6):
            out0, out1 = (torch.randn(batch, 6, generator=gen).requires_grad_() for _ in range(2))
            expected = ref(out0, out1)
            got = tc.info_nce_loss(out0, out1, queue.features, 0.2, in_batch_negatives=False)
            queue.push(torch.nn.functional.normalize(out1.detach(), dim=1))
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(queue.features, ref.memory_bank.bank, rtol=0, atol=0)  # stored (size, dim)


def test_queue_fill_and_overflow_rules():
    queue = tc.FeatureQueue(5, 2, fill="random", generator=torch.Generator().manual_seed(0))
    assert len(queue) == 5
    torch.testing.assert_close(queue.features.norm(dim=1), torch.ones(5))
    wrap = tc.FeatureQueue(5, 1)
    drop = tc.FeatureQueue(5, 1, overflow="drop")
    for q in (wrap, drop):
        q.push(torch.arange(3.0)[:, None])
        q.push(torch.arange(10.0, 14.0)[:, None])
    assert wrap.features.flatten().tolist() == [12.0, 13.0, 2.0, 10.0, 11.0]  # the newest rows kept
    assert drop.features.flatten().tolist() == [0.0, 1.0, 2.0, 10.0, 11.0]  # 12, 13 dropped; next push at row 0
    drop.push(torch.tensor([[7.0]]))
    assert drop.features.flatten().tolist()[0] == 7.0
    with pytest.raises(ValueError, match="dim"):
        tc.FeatureQueue(5, fill="random")
    with pytest.raises(ValueError, match="overflow"):
        tc.FeatureQueue(5, overflow="ring")


def test_dcl_weight_fn_gradients_match_lightly():
    def weight_fn(a, b):
        return torch.sum((a - b) ** 2, dim=1)

    with lightly_files() as files:
        gen = torch.Generator().manual_seed(4)
        out0, out1 = (torch.randn(6, 4, generator=gen, dtype=F64).requires_grad_() for _ in range(2))
        ref = files["dcl_loss"].DCLLoss(0.2, weight_fn=weight_fn)(out0, out1)
    got = tc.DCLLoss(0.2, weight_fn=weight_fn)(out0, out1)
    _assert_same(ref, got, [out0, out1], [out0, out1])
    with pytest.raises(ValueError, match="weight_fn"):
        tc.DCLLoss(0.2, weight_fn=lambda a, b: a.sum())(out0, out1)


# ---------------------------------------------------------------- pytorch-metric-learning
pml = pytest.importorskip("pytorch_metric_learning.losses")


@pytest.mark.parametrize("loss", ["supcon", "nt_xent"])
def test_reference_set_matches_pml(device, loss):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(10, 5, generator=gen, dtype=F64).to(device).requires_grad_()
    ref_emb = torch.randn(7, 5, generator=gen, dtype=F64).to(device).requires_grad_()
    y, ry = torch.randint(0, 3, (10,), generator=gen).to(device), torch.randint(0, 3, (7,), generator=gen).to(device)
    if loss == "supcon":
        expected = pml.SupConLoss(temperature=0.3)(x, y, ref_emb=ref_emb, ref_labels=ry)
        got = tc.supcon_loss(x, y, temperature=0.3, ref_emb=ref_emb, ref_labels=ry, chunk_size=4)
    else:
        expected = pml.NTXentLoss(temperature=0.3)(x, y, ref_emb=ref_emb, ref_labels=ry)
        got = tc.nt_xent_loss(x, 0.3, labels=y, ref_emb=ref_emb, ref_labels=ry, chunk_size=4)
    _assert_same(expected, got, [x, ref_emb], [x, ref_emb])


def test_single_class_convention_matches_pml(device):
    x = torch.randn(8, 4, dtype=F64, device=device, requires_grad=True)
    same = torch.zeros(8, dtype=torch.long, device=device)
    assert pml.SupConLoss(temperature=0.3)(x, same).item() == 0.0
    zero = tc.supcon_loss(x, same, temperature=0.3, single_class="zero")
    assert zero.item() == 0.0 and torch.autograd.grad(zero, x)[0].abs().max().item() == 0.0
    assert tc.supcon_loss(x, same, temperature=0.3).item() > 0.69  # the formula: at least log 7 / ... per anchor
    mixed = torch.tensor([0, 0, 0, 0, 0, 0, 0, 1], device=device)
    _assert_same(pml.SupConLoss(temperature=0.3)(x, mixed), tc.supcon_loss(x, mixed, temperature=0.3, single_class="zero"), [x], [x])
    ref_emb = torch.randn(5, 4, dtype=F64, device=device, requires_grad=True)
    ref_labels = torch.tensor([0, 0, 1, 0, 1], device=device)  # one class in the batch, negatives among the references
    _assert_same(pml.SupConLoss(temperature=0.3)(x, same, ref_emb=ref_emb, ref_labels=ref_labels),
                 tc.supcon_loss(x, same, temperature=0.3, single_class="zero", ref_emb=ref_emb, ref_labels=ref_labels),
                 [x, ref_emb], [x, ref_emb])
    with pytest.raises(ValueError, match="single_class"):
        tc.supcon_loss(x, same, single_class="pml")
    with pytest.raises(ValueError, match="ref_labels"):
        tc.supcon_loss(x, same, ref_emb=x)


_Q = torch.nn.functional.normalize(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), dim=1)
_D = torch.nn.functional.normalize(torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), dim=1)
_BOTH = ("query_to_doc", "doc_to_query")


def _nan_rows(x):
    out = x.clone()
    out[2, 1] = float("nan")
    return out


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(queries=_nan_rows(_Q)), ValueError, "queries has non-finite values"),
    (dict(docs=[_D, _nan_rows(_D)]), ValueError, r"docs\[1\] has non-finite values"),
    (dict(queries=_Q[:0]), ValueError, "queries must not be empty"),
    (dict(scale=float("inf")), ValueError, "scale must be a positive finite float"),
    (dict(hardness_mode="all_negatives", hardness_strength=float("inf")), ValueError, "hardness_strength must be a finite"),
    (dict(queries=_Q * 1e19, docs=[_D * 1e19], similarity="dot"), ValueError, "the logits overflow"),
    (dict(similarity="bogus"), ValueError, "similarity must be one of"),
    (dict(docs=[_D[:, :3]]), ValueError, r"queries and docs\[0\] must have the same feature dimension"),
    (dict(docs=[_D[:5]]), ValueError, "docs\\[0\\]"),
    (dict(queries=torch.ones(6, 4, dtype=torch.int64)), TypeError, "queries must be a floating-point tensor"),
    (dict(queries=_Q[0]), ValueError, "queries must have 2 dimensions"),
    (dict(docs=_D), TypeError, "docs must be a list"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
])
def test_mnrl_loss_checks_every_direction_as_the_default_one(kwargs, exc, words):
    """Every option of mnrl_loss goes through the core losses' checks, whatever its directions: bad
    inputs are clear errors naming the argument, never a NaN loss or a torch-internal message."""
    args = {"queries": _Q, "docs": [_D], "directions": _BOTH, **kwargs}
    queries, docs = args.pop("queries"), args.pop("docs")
    with pytest.raises(exc, match=words):
        ours_st.mnrl_loss(queries, docs, **args)
