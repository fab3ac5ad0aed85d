"""The positive structure: tiles, counts and aggregates agree with a dense mask."""

from __future__ import annotations

import pytest
import torch

from torch_contrastive.positives import Positives


def _dense(pos: Positives) -> torch.Tensor:
    return pos.tile(0, pos.num_rows, 0, pos.num_cols)


def _structures():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (13,), generator=g)
    other = torch.randint(0, 5, (13,), generator=g)
    mask = torch.rand(5, 5, generator=g) > 0.5
    return {
        "labels": Positives.from_keys(labels),
        "labels_offset": Positives.from_keys(labels[3:9], labels, self_offset=3),
        "two_keys": Positives.from_keys((labels, other), self_offset=None),
        "pairs": Positives.from_pairs(torch.randint(0, 13, (20, 2), generator=g), 13, 13),
        "mask": Positives.from_sample_mask(mask, torch.arange(15) % 5, 15),
        "mask_one": Positives.from_sample_mask(mask, torch.arange(5), 15),
    }


@pytest.mark.parametrize("name", list(_structures()))
def test_tiles_counts_and_aggregate_agree_with_dense(name):
    pos = _structures()[name]
    dense = _dense(pos)
    for tile in (1, 4, 7):
        for r0 in range(0, pos.num_rows, tile):
            for c0 in range(0, pos.num_cols, tile):
                r1, c1 = min(r0 + tile, pos.num_rows), min(c0 + tile, pos.num_cols)
                assert torch.equal(pos.tile(r0, r1, c0, c1), dense[r0:r1, c0:c1])
    assert torch.equal(pos.row_counts(), dense.sum(1))
    cand = torch.randn(pos.num_cols, 3, dtype=torch.float64)
    torch.testing.assert_close(pos.aggregate(cand), dense.double() @ cand)
    if pos.kind != "mask":
        assert torch.equal(pos.col_counts(), dense.sum(0))


def test_self_pairs_are_never_positive():
    pos = Positives.from_keys(torch.zeros(6, dtype=torch.int64))
    assert not _dense(pos).diagonal().any()
    assert pos.row_counts().tolist() == [5] * 6


def test_two_keys_are_or_combined():
    img = torch.tensor([0, 0, 1, 2])
    txt = torch.tensor([5, 6, 6, 7])
    dense = _dense(Positives.from_keys((img, txt), self_offset=None))
    expected = (img[:, None] == img[None]) | (txt[:, None] == txt[None])
    assert torch.equal(dense, expected)


def test_pairs_drop_duplicates_and_self():
    pos = Positives.from_pairs(torch.tensor([[0, 1], [0, 1], [2, 2], [3, 0]]), 4, 4)
    assert pos.row_counts().tolist() == [1, 0, 0, 1]


def test_identity_keys_aggregate_is_the_candidates_themselves():
    keys = torch.arange(5)
    pos = Positives.from_keys(keys, self_offset=None)
    cand = torch.randn(5, 2)
    assert pos.aggregate(cand) is cand  # no copy for CLIP without ids
