"""FeatureQueue, and memory rows on the supervised losses (pytorch-metric-learning's CrossBatchMemory)."""

from __future__ import annotations

import pytest
import torch

import torch_contrastive as tc
from helpers import DTYPES, compare
from reference import nt_xent_pml_memory, supcon_memory


# ----------------------------------------------------------------- the queue
def test_queue_is_a_fifo_ring_buffer():
    queue = tc.FeatureQueue(5)
    assert len(queue) == 0 and queue.labels is None and queue.dim is None
    with pytest.raises(RuntimeError, match="push a batch first"):
        _ = queue.features
    rows = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    queue.push(rows[:3], torch.tensor([0, 1, 2]))
    assert len(queue) == 3 and torch.equal(queue.features, rows[:3]) and queue.labels.tolist() == [0, 1, 2]
    queue.push(rows[3:7], torch.tensor([3, 4, 5, 6]))  # wraps: row 6 overwrites row 0
    assert len(queue) == 5
    assert sorted(queue.labels.tolist()) == [2, 3, 4, 5, 6]
    for label, row in zip(queue.labels.tolist(), queue.features):
        assert torch.equal(row, rows[label])
    queue.push(rows, torch.arange(8))  # larger than the queue: only the newest 5 rows stay
    assert sorted(queue.labels.tolist()) == [3, 4, 5, 6, 7]
    for label, row in zip(queue.labels.tolist(), queue.features):
        assert torch.equal(row, rows[label])
    queue.reset()
    assert len(queue) == 0 and queue.features.shape == (0, 3)


def test_queue_stores_detached_copies_and_never_touches_the_input():
    queue = tc.FeatureQueue(4, 2)
    x = torch.ones(2, 2, requires_grad=True)
    y = x * 2
    queue.push(y)
    assert not queue.features.requires_grad
    with torch.no_grad():
        y.add_(1)  # the caller's tensor changes later: the queue keeps the pushed values
    assert queue.features.eq(2).all()


def test_queue_state_dict_round_trip_and_to():
    queue = tc.FeatureQueue(6)
    queue.push(torch.randn(4, 3), torch.tensor([5, 6, 7, 8]))
    queue.push(torch.randn(4, 3), torch.tensor([1, 2, 3, 4]))
    fresh = tc.FeatureQueue(6)  # no buffers yet: load_state_dict must still restore them
    fresh.load_state_dict(queue.state_dict())
    assert len(fresh) == 6 and torch.equal(fresh.features, queue.features) and torch.equal(fresh.labels, queue.labels)
    fresh.push(torch.zeros(1, 3), torch.tensor([0]))  # continues at the same write position
    queue.push(torch.zeros(1, 3), torch.tensor([0]))
    assert torch.equal(fresh.features, queue.features)
    moved = queue.to(torch.float64)
    assert moved.features.dtype == torch.float64
    with pytest.raises(ValueError, match="size"):
        tc.FeatureQueue(7).load_state_dict(queue.state_dict())
    model = torch.nn.Module()
    model.queue = tc.FeatureQueue(3, 2)
    assert "queue.queue_features" in model.state_dict()


@pytest.mark.parametrize("call,exc,words", [
    (lambda q: q.push(torch.zeros(2, 4)), ValueError, "features must have 3 columns"),
    (lambda q: q.push(torch.zeros(2, 3)), ValueError, "filled with labels"),
    (lambda q: q.push(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long)), ValueError, "labels must have shape (2,)"),
    (lambda q: q.push(torch.zeros(2, 3), torch.zeros(2)), TypeError, "labels must have an integer dtype"),
    (lambda q: q.push(torch.zeros(3)), ValueError, "features must have 2 dimensions"),
    (lambda q: tc.FeatureQueue(0), ValueError, "size must be a positive int"),
    (lambda q: tc.FeatureQueue(4, dim=0), ValueError, "dim must be"),
])
def test_queue_bad_input(call, exc, words):
    queue = tc.FeatureQueue(4)
    queue.push(torch.zeros(1, 3), torch.tensor([1]))
    with pytest.raises(exc, match=__import__("re").escape(words)):
        call(queue)


def test_moco_step_with_the_queue_equals_the_formula():
    """loss with queue.features as negatives == the float64 loop with the same rows."""
    from reference import info_nce

    g = torch.Generator().manual_seed(0)
    queue = tc.FeatureQueue(16, 5, dtype=torch.float64)
    queue.push(torch.randn(4, 5, generator=g, dtype=torch.float64))  # an empty queue gives no negative: a ValueError
    for _ in range(3):
        q, k = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randn(6, 5, generator=g, dtype=torch.float64)
        negs = queue.features.clone()
        ours = tc.info_nce_loss(q, k, queue.features, 0.2, in_batch_negatives=False)
        if len(negs):
            assert ours.item() == pytest.approx(info_nce(q, k, negs, 0.2, in_batch=False).item(), rel=1e-10)
        queue.push(k)
    assert len(queue) == 16


# ----------------------------------------------------------------- memory rows on supervised losses
def _memory_case(n, m, classes, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g, dtype=torch.float64)
    labels = torch.randint(0, classes, (n,), generator=g)
    mem = torch.randn(m, 5, generator=g, dtype=torch.float64)
    mem_labels = torch.randint(0, classes + 1, (m,), generator=g)
    return x, labels, mem, mem_labels


@pytest.mark.parametrize("dtype,tols", DTYPES)
@pytest.mark.parametrize("n,m,classes", [(7, 5, 3), (13, 9, 4), (1, 4, 1), (6, 0, 2)])
@pytest.mark.parametrize("chunk", [None, 4])
@pytest.mark.parametrize("loss", ["supcon", "nt_xent"])
def test_memory_reference(loss, chunk, n, m, classes, dtype, tols):
    """Values and gradients (batch, live memory rows, tau) vs the float64 loops."""
    x, labels, mem, mem_labels = _memory_case(n, m, classes, seed=n + m)
    if loss == "supcon":
        ours = lambda a, b, t: tc.supcon_loss(a, labels, temperature=t, memory_emb=b, memory_labels=mem_labels, chunk_size=chunk)  # noqa: E731
        ref = lambda a, b, t: supcon_memory(a, labels, b, mem_labels, t)  # noqa: E731
    else:
        ours = lambda a, b, t: tc.nt_xent_loss(a, t, labels=labels, memory_emb=b, memory_labels=mem_labels, chunk_size=chunk)  # noqa: E731
        ref = lambda a, b, t: nt_xent_pml_memory(a, labels, b, mem_labels, t)  # noqa: E731
    if m == 0:  # an empty memory: the plain loss (and no gradient slot for it)
        compare(lambda a, t: ours(a, mem.to(a), t), lambda a, t: ref(a, mem, t), [x], 0.3, dtype, tols)
    else:
        compare(ours, ref, [x, mem], 0.3, dtype, tols)


@pytest.mark.parametrize("chunk", [None, 4])
def test_detached_memory_gets_no_gradient_work_and_same_batch_gradient(chunk):
    x, labels, mem, mem_labels = _memory_case(12, 9, 3, seed=1)
    grads = []
    for live in (False, True):
        xx = x.clone().requires_grad_()
        mm = mem.clone().requires_grad_(live)
        tc.supcon_loss(xx, labels, temperature=0.2, memory_emb=mm, memory_labels=mem_labels, chunk_size=chunk).backward()
        grads.append(xx.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


@pytest.fixture
def pml():
    return pytest.importorskip("pytorch_metric_learning.losses")


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("name", ["SupConLoss", "NTXentLoss"])
def test_matches_cross_batch_memory(pml, name, seed):
    """pytorch-metric-learning 2.9's CrossBatchMemory holding the same memory rows.

    It enqueues the batch before computing (detached copies, self pairs removed): the same
    candidates as ours (batch + memory), so the values agree. Its gradient only flows
    through the anchors (its candidate copies are detached); ours is the full gradient,
    checked against the float64 loops above.
    """
    g = torch.Generator().manual_seed(seed)
    n, m = int(torch.randint(4, 30, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
    x, mem = torch.randn(n, 16, generator=g), torch.randn(m, 16, generator=g)
    labels, mem_labels = torch.randint(0, 5, (n,), generator=g), torch.randint(0, 6, (m,), generator=g)
    wrapper = pml.CrossBatchMemory(getattr(pml, name)(temperature=0.1), 16, memory_size=128)
    wrapper.embedding_memory[:m] = mem
    wrapper.label_memory[:m] = mem_labels
    wrapper.queue_idx = m
    ref = wrapper(x, labels)
    queue = tc.FeatureQueue(128)
    queue.push(mem, mem_labels)
    if name == "SupConLoss":
        ours = tc.SupConLoss(0.1)(x, labels, memory_emb=queue.features, memory_labels=queue.labels)
    else:
        ours = tc.NTXentLoss(0.1)(x, labels, memory_emb=queue.features, memory_labels=queue.labels)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    # and the next step sees this batch in both memories
    queue.push(x, labels)
    x2, y2 = torch.randn(n, 16, generator=g), torch.randint(0, 5, (n,), generator=g)
    ref2 = wrapper(x2, y2)
    fn = tc.supcon_loss if name == "SupConLoss" else lambda e, y, **kw: tc.nt_xent_loss(e, labels=y, **kw)
    ours2 = fn(x2, y2, temperature=0.1, memory_emb=queue.features, memory_labels=queue.labels)
    assert ours2.item() == pytest.approx(ref2.item(), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("call,exc,words", [
    (lambda x, y, m, my: tc.supcon_loss(x, y, memory_emb=m), ValueError, "memory_emb needs memory_labels"),
    (lambda x, y, m, my: tc.supcon_loss(x, y, memory_labels=my), ValueError, "memory_labels was given without memory_emb"),
    (lambda x, y, m, my: tc.supcon_loss(x[:, None].expand(-1, 2, -1), memory_emb=m, memory_labels=my), ValueError, "needs labels"),
    (lambda x, y, m, my: tc.nt_xent_loss(x[:6], memory_emb=m, memory_labels=my), ValueError, "memory_emb needs labels"),
    (lambda x, y, m, my: tc.supcon_loss(x, y, memory_emb=m[:, :3], memory_labels=my), ValueError, "feature size 5"),
    (lambda x, y, m, my: tc.nt_xent_loss(x, labels=y, memory_emb=m, memory_labels=my[:2]), ValueError, "memory_labels must have shape"),
    (lambda x, y, m, my: tc.supcon_loss(x, y, memory_emb=m, memory_labels=my.float()), TypeError, "memory_labels must have an integer"),
    (lambda x, y, m, my: tc.supcon_loss(x, y, memory_emb=m * float("inf"), memory_labels=my), ValueError, "memory_emb contains non-finite"),
])
def test_memory_bad_input(call, exc, words):
    x, labels, mem, mem_labels = _memory_case(7, 4, 3, seed=0)
    with pytest.raises(exc, match=__import__("re").escape(words)):
        call(x, labels, mem, mem_labels)
