"""Independent float64 references, written from the formulas of the seeds and papers (README, "Conventions").

Naive loops over (i, j) on purpose: nothing here shares code with the library.
Every function works on differentiable torch scalars so gradients can be compared.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def cosine_matrix(a: Tensor, b: Tensor, normalize: bool = True) -> list[list[Tensor]]:
    rows = []
    for i in range(a.shape[0]):
        row = []
        for j in range(b.shape[0]):
            dot = (a[i] * b[j]).sum()
            if normalize:
                dot = dot / (a[i].norm().clamp_min(1e-12) * b[j].norm().clamp_min(1e-12))
            row.append(dot)
        rows.append(row)
    return rows


def _lse(values: list[Tensor]) -> Tensor:
    return torch.logsumexp(torch.stack(values), dim=0)


def nt_xent(x: Tensor, tau, pairing: str = "adjacent", normalize: bool = True) -> Tensor:
    n = x.shape[0]
    s = cosine_matrix(x, x, normalize)
    total = 0.0
    for i in range(n):
        p = i ^ 1 if pairing == "adjacent" else (i + n // 2) % n
        others = [s[i][j] / tau for j in range(n) if j != i]
        total = total + (-s[i][p] / tau + _lse(others))
    return total / n


def nt_xent_pml(x: Tensor, labels: Tensor, tau, normalize: bool = True) -> Tensor:
    """pytorch-metric-learning convention: one term per positive pair, mean over pairs."""
    n = x.shape[0]
    s = cosine_matrix(x, x, normalize)
    terms = []
    for i in range(n):
        negs = [s[i][k] / tau for k in range(n) if labels[k] != labels[i]]
        for p in range(n):
            if p != i and labels[p] == labels[i]:
                terms.append(-s[i][p] / tau + _lse([s[i][p] / tau, *negs]))
    if not terms:
        return (x * 0).sum() * tau
    return torch.stack(terms).mean()


def nt_bxent(x: Tensor, tau, pos_indices: Tensor | None = None, labels: Tensor | None = None,
             normalize: bool = True) -> Tensor:
    n = x.shape[0]
    s = cosine_matrix(x, x, normalize)
    anchor_graph = (x * 0).sum() * tau  # keeps the graph for a batch with no pair at all
    positive = [[i == j for j in range(n)] for i in range(n)]
    if pos_indices is not None:
        for r, c in pos_indices.tolist():
            positive[r][c] = True
    else:
        for i in range(n):
            for j in range(n):
                positive[i][j] = positive[i][j] or bool(labels[i] == labels[j])
    total = 0.0
    for i in range(n):
        pos_terms, neg_terms = [], []
        for j in range(n):
            if j == i:
                continue
            z = s[i][j] / tau
            if positive[i][j]:
                pos_terms.append(-torch.nn.functional.logsigmoid(z))
            else:
                neg_terms.append(-torch.nn.functional.logsigmoid(-z))
        n_pos = sum(positive[i])
        n_neg = n - n_pos
        row = sum(pos_terms, torch.zeros((), dtype=x.dtype)) / n_pos
        if n_neg:
            row = row + sum(neg_terms, torch.zeros((), dtype=x.dtype)) / n_neg
        total = total + row
    return total / n + anchor_graph


def image_text(img: Tensor, txt: Tensor, tau, image_id=None, text_id=None, normalize: bool = True) -> Tensor:
    n = img.shape[0]
    s = cosine_matrix(img, txt, normalize)
    iid = image_id.tolist() if image_id is not None else list(range(n))
    tid = text_id.tolist() if text_id is not None else list(range(n))
    gt = [[iid[i] == iid[j] or tid[i] == tid[j] for j in range(n)] for i in range(n)]
    n_gt = sum(sum(r) for r in gt)
    loss1 = 0.0
    loss2 = 0.0
    for i in range(n):
        row = _lse([s[i][j] / tau for j in range(n)])
        col = _lse([s[j][i] / tau for j in range(n)])
        for j in range(n):
            if gt[i][j]:
                loss1 = loss1 - (s[i][j] / tau - row)
            if gt[j][i]:
                loss2 = loss2 - (s[j][i] / tau - col)
    return (loss1 / n_gt + loss2 / n_gt) / 2


def supcon(features: Tensor, tau, labels=None, mask=None, base_tau=None, contrast_mode: str = "all",
           normalize: bool = True) -> Tensor:
    """SupCon from the paper's formula; anchors without positives are left out."""
    if features.ndim == 2:
        features = features[:, None]
    bsz, views = features.shape[0], features.shape[1]
    flat = torch.cat([features[:, v] for v in range(views)], dim=0)
    n = flat.shape[0]
    sample = [k % bsz for k in range(n)]
    if mask is not None:
        rel = [[bool(mask[sample[i]][sample[j]]) for j in range(n)] for i in range(n)]
    elif labels is not None:
        rel = [[bool(labels[sample[i]] == labels[sample[j]]) for j in range(n)] for i in range(n)]
    else:
        rel = [[sample[i] == sample[j] for j in range(n)] for i in range(n)]
    s = cosine_matrix(flat, flat, normalize)
    anchors = range(bsz) if contrast_mode == "one" else range(n)
    losses = []
    for i in anchors:
        denom = _lse([s[i][a] / tau for a in range(n) if a != i])
        pos = [s[i][p] / tau - denom for p in range(n) if p != i and rel[i][p]]
        if pos:
            losses.append(-torch.stack(pos).mean())
    if not losses:
        return (flat * 0).sum() * tau
    factor = 1.0 if base_tau is None else tau / base_tau
    return factor * torch.stack(losses).mean()


# Seed 000's float32 tensor, reproduced by torch.manual_seed(21); torch.randn(8, 2).
def seed000_x() -> Tensor:
    torch.manual_seed(21)
    return torch.randn(8, 2)


SEED000_POS = torch.tensor([(0, 0), (0, 2), (0, 4), (1, 4), (1, 6), (1, 1), (2, 3), (3, 7), (4, 3), (7, 6)])

# Seed 004's printed embeddings (4 decimals).
SEED004_A = torch.tensor([
    [-1.0192, -1.2504, 0.6781, -1.4978, -0.2036],
    [-0.3796, -0.6767, 0.7013, -1.0596, -0.9061],
    [0.4155, -0.4153, -1.3006, 0.6536, -1.1877],
    [0.5762, 1.0520, -0.2545, -0.2044, 0.9800],
])
SEED004_B = torch.tensor([
    [-0.2212, -3.0712, 0.7776, 1.9826, 0.6233],
    [0.6597, 1.4035, 0.2884, -0.8971, -0.5095],
    [0.5410, 1.2093, 0.8458, 1.2963, -0.3695],
    [1.2558, -1.5282, -1.6592, -0.0406, -1.7611],
    [0.2712, 0.6679, -0.3595, -0.5791, -1.6139],
    [0.6026, -0.4435, -0.7715, -0.2869, 0.1029],
    [-0.5828, -0.4375, -0.5919, 0.3499, 0.2800],
    [-1.1419, -1.1917, 0.5485, -0.2690, 1.1158],
    [0.6038, -1.4093, -0.1854, -1.5674, -2.6291],
])
SEED004_C = torch.tensor([
    [-0.0031, -1.2745, -0.5312, 0.0224, -0.8322],
    [-1.3428, -0.7471, -1.7685, -2.0902, -2.1853],
    [0.2657, 0.0047, 0.3926, 0.0517, -0.2075],
    [0.6994, 0.0610, -0.4057, 0.7450, 0.1561],
    [-0.4123, -0.9179, -0.8227, 1.5111, -0.5250],
    [0.7570, 0.0307, -0.0365, -0.9719, 0.4156],
    [-0.6779, 0.9506, 0.2841, -0.3664, 2.0260],
    [0.1467, 2.2670, 0.7604, 1.1003, 0.3780],
])

LOG_FLOAT32_TINY = -math.log(torch.finfo(torch.float32).tiny)


def siglip(img: Tensor, txt: Tensor, scale, bias, image_id=None, text_id=None, normalize: bool = True) -> Tensor:
    """SigLIP from the paper's formula: -sum_ij log sigmoid(z_ij (t <a_i, b_j> + b)) / N."""
    n = img.shape[0]
    s = cosine_matrix(img, txt, normalize)
    iid = image_id.tolist() if image_id is not None else list(range(n))
    tid = text_id.tolist() if text_id is not None else list(range(n))
    total = (img * 0).sum() + (txt * 0).sum()
    for i in range(n):
        for j in range(n):
            z = 1.0 if (iid[i] == iid[j] or tid[i] == tid[j]) else -1.0
            total = total - torch.nn.functional.logsigmoid(z * (scale * s[i][j] + bias))
    return total / n


def info_nce(query: Tensor, key: Tensor, negatives, tau, mode: str = "unpaired", in_batch: bool = True,
             normalize: bool = True) -> Tensor:
    """SPEC §10: query i against its key, the other keys (in_batch), the pool or its own negatives."""
    n = query.shape[0]
    s_keys = cosine_matrix(query, key, normalize)
    total = 0.0
    for i in range(n):
        cands = [s_keys[i][i] / tau]
        if in_batch:
            cands += [s_keys[i][j] / tau for j in range(n) if j != i]
        if negatives is not None:
            own = negatives if mode == "unpaired" else negatives[i]
            cands += [c / tau for c in cosine_matrix(query[i : i + 1], own, normalize)[0]]
        total = total + (-s_keys[i][i] / tau + _lse(cands))
    return total / n


def mnrl(anchors: Tensor, positives: Tensor, hard_negatives: Tensor, scale: float) -> Tensor:
    """sentence-transformers' MultipleNegativesRankingLoss as its documentation states it:
    cross-entropy of scale * cos(anchor_i, [all positives; all hard negatives]) with target i."""
    cands = torch.cat([positives, hard_negatives])
    s = cosine_matrix(anchors, cands)
    total = 0.0
    for i in range(anchors.shape[0]):
        total = total + (-scale * s[i][i] + _lse([scale * c for c in s[i]]))
    return total / anchors.shape[0]


def supcon_memory(x: Tensor, labels, memory: Tensor, memory_labels, tau) -> Tensor:
    """SupCon with extra candidates: anchors = batch rows; candidates = batch (self excluded) + memory."""
    cands = torch.cat([x, memory])
    cand_labels = [int(v) for v in labels] + [int(v) for v in memory_labels]
    s = cosine_matrix(x, cands)
    losses = []
    for i in range(x.shape[0]):
        others = [j for j in range(cands.shape[0]) if j != i]
        denom = _lse([s[i][j] / tau for j in others])
        pos = [s[i][j] / tau - denom for j in others if cand_labels[j] == int(labels[i])]
        if pos:
            losses.append(-torch.stack(pos).mean())
    if not losses:
        return (x * 0).sum() * tau
    return torch.stack(losses).mean()


def nt_xent_pml_memory(x: Tensor, labels, memory: Tensor, memory_labels, tau) -> Tensor:
    """pytorch-metric-learning NT-Xent (one term per positive pair) over batch + memory candidates."""
    cands = torch.cat([x, memory])
    cand_labels = [int(v) for v in labels] + [int(v) for v in memory_labels]
    s = cosine_matrix(x, cands)
    terms = []
    for i in range(x.shape[0]):
        negs = [s[i][j] / tau for j in range(cands.shape[0]) if cand_labels[j] != int(labels[i])]
        for p in range(cands.shape[0]):
            if p != i and cand_labels[p] == int(labels[i]):
                terms.append(-s[i][p] / tau + _lse([s[i][p] / tau, *negs]))
    if not terms:
        return (x * 0).sum() * tau
    return torch.stack(terms).mean()


def info_nce_masked(query: Tensor, key: Tensor, negatives, tau, mode: str = "unpaired", in_batch: bool = True,
                    key_ids=None, negative_ids=None, guide=None, margin: float = 0.0, margin_mode: str = "absolute",
                    decoupled: bool = False) -> Tensor:
    """SPEC §12: info_nce where false negatives are masked with -inf (a query left with nothing gives 0)."""
    n = query.shape[0]
    s_keys = cosine_matrix(query, key)
    if guide is not None:
        g_keys = cosine_matrix(guide[0], guide[1])
    total = 0.0
    for i in range(n):
        g_pos = g_keys[i][i] if guide is not None else None
        thr = None
        if guide is not None:
            thr = g_pos - (margin if margin_mode == "absolute" else margin * abs(float(g_pos)))

        def leaves(cand_id, g_value, i=i, thr=thr):
            by_id = key_ids is not None and cand_id is not None and int(cand_id) == int(key_ids[i])
            by_guide = thr is not None and g_value is not None and float(g_value) > float(thr)
            return by_id or by_guide

        cands = [] if decoupled else [s_keys[i][i] / tau]
        if in_batch:
            for j in range(n):
                if j != i and not leaves(key_ids[j] if key_ids is not None else None, g_keys[i][j] if guide is not None else None):
                    cands.append(s_keys[i][j] / tau)
        if negatives is not None:
            own = negatives if mode == "unpaired" else negatives[i]
            ids = None if negative_ids is None else (negative_ids if mode == "unpaired" else negative_ids[i])
            s_neg = cosine_matrix(query[i : i + 1], own)[0]
            g_neg = cosine_matrix(guide[0][i : i + 1], guide[2] if mode == "unpaired" else guide[2][i])[0] if guide is not None else None
            for m, value in enumerate(s_neg):
                if not leaves(None if ids is None else ids[m], None if g_neg is None else g_neg[m]):
                    cands.append(value / tau)
        if cands:
            total = total + (-s_keys[i][i] / tau + _lse(cands))
    # every input stays in the graph (a fully masked input has a zero, not a missing, gradient)
    connected = 0.0 * (query.sum() + key.sum() + (0.0 if negatives is None else negatives.sum())) * tau
    return total / n + connected


def image_text_variant(img: Tensor, txt: Tensor, tau, image_id=None, text_id=None, decoupled: bool = False,
                       smoothing: float = 0.0) -> Tensor:
    """Seed 002's loss with DCL (positives out of the denominators) or label smoothing, from the formula."""
    n = img.shape[0]
    s = cosine_matrix(img, txt)
    gt = [[(image_id is not None and int(image_id[i]) == int(image_id[j])) or (text_id is not None and int(text_id[i]) == int(text_id[j]))
           or (image_id is None and text_id is None and i == j) for j in range(n)] for i in range(n)]
    n_gt = sum(sum(r) for r in gt)
    directions = []
    for transpose in (False, True):
        def logit(i, j, transpose=transpose):
            return (s[j][i] if transpose else s[i][j]) / tau

        def rel(i, j, transpose=transpose):
            return gt[j][i] if transpose else gt[i][j]

        main, uniform = 0.0, 0.0
        for i in range(n):
            cands = [logit(i, j) for j in range(n) if not (decoupled and rel(i, j))]
            lse = _lse(cands) if cands else None
            for j in range(n):
                if rel(i, j) and lse is not None:
                    main = main - (logit(i, j) - lse)
            if smoothing:
                uniform = uniform + sum(_lse([logit(i, k) for k in range(n)]) - logit(i, j) for j in range(n)) / n
        directions.append((1 - smoothing) * main / n_gt + smoothing * uniform / n)
    return (directions[0] + directions[1]) / 2 + 0.0 * (img.sum() + txt.sum()) * tau


def nt_xent_decoupled(x: Tensor, tau, pairing: str = "halves", weight=None) -> Tensor:
    """DCL: NT-Xent with the positive out of the denominator; optional positive weights (DCLW)."""
    n = x.shape[0]
    s = cosine_matrix(x, x)
    total = 0.0
    for i in range(n):
        p = i ^ 1 if pairing == "adjacent" else (i + n // 2) % n
        others = [s[i][j] / tau for j in range(n) if j not in (i, p)]
        w = 1.0 if weight is None else weight[i]  # a tensor: the reference differentiates through it
        if others:
            total = total + (-w * s[i][p] / tau + _lse(others))
    return total / n + 0.0 * x.sum() * tau


# Large batches: the same formulas over row blocks of a float64 logit matrix (the loops above take hours at 10k
# rows). tests/losses/test_label_sort.py checks these against the loops first.


def _unit64(x: Tensor) -> Tensor:
    x = x.double()
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)


def _class_blocks(z: Tensor, labels: Tensor, tau: float) -> list[tuple[Tensor, Tensor]]:
    """(rows of one label, their logits among themselves) for every label."""
    out = []
    for label in torch.unique(labels):
        rows = torch.nonzero(labels == label).flatten()
        out.append((rows, z[rows] @ z[rows].T / tau))
    return out


def nt_xent_pml_blocks(x: Tensor, labels: Tensor, tau: float, block: int = 1024) -> float:
    """:func:`nt_xent_pml` of unit rows (``|S| <= 1 / tau``: plain ``exp``):
    ``softplus(log sum_neg e^S_ik - S_ip)``, a row's negative sum being its whole sum less its own label's."""
    z, n = _unit64(x), x.shape[0]
    whole = torch.cat([torch.exp(z[r0 : r0 + block] @ z.T / tau).sum(1) for r0 in range(0, n, block)])
    total, pairs = 0.0, 0
    for rows, s in _class_blocks(z, labels, tau):
        negatives = whole[rows] - torch.exp(s).sum(1)
        terms = torch.nn.functional.softplus(torch.log(negatives)[:, None] - s)
        terms.fill_diagonal_(0.0)
        total += terms.sum().item() if n > len(rows) else 0.0
        pairs += len(rows) * (len(rows) - 1)
    return total / pairs if pairs else 0.0


def nt_bxent_blocks(x: Tensor, tau: float, labels: Tensor, block: int = 1024) -> float:
    """:func:`nt_bxent` by labels of unit rows (a row's positives counted with itself, as there); a row's negative
    sum is its whole sum less its own label's."""
    z, n = _unit64(x), x.shape[0]
    softplus = torch.nn.functional.softplus
    whole = torch.cat([softplus(z[r0 : r0 + block] @ z.T / tau).sum(1) for r0 in range(0, n, block)])
    total = 0.0
    for rows, s in _class_blocks(z, labels, tau):
        n_pos, n_neg = len(rows), n - len(rows)
        positive = softplus(-s)
        positive.fill_diagonal_(0.0)
        row = positive.sum(1) / n_pos
        if n_neg:
            row = row + (whole[rows] - softplus(s).sum(1)) / n_neg
        total += row.sum().item()
    return total / n
