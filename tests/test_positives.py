"""The positive structure: tiles, counts and aggregates agree with a dense mask written from the definition."""

from __future__ import annotations

import pytest
import torch

import torch_contrastive.positives as positives_module
from torch_contrastive.positives import Positives


def _drop_self(mask: torch.Tensor, offset: int | None) -> torch.Tensor:
    mask = mask.clone()
    if offset is not None:
        for i in range(mask.shape[0]):
            if 0 <= i + offset < mask.shape[1]:
                mask[i, i + offset] = False
    return mask


def _structures():
    """name -> (Positives, expected dense bool mask built with loops from the definition)."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (13,), generator=g)
    other = torch.randint(0, 5, (13,), generator=g)
    mask = torch.rand(5, 5, generator=g) > 0.5
    pairs = torch.randint(0, 13, (20, 2), generator=g)
    same = labels[:, None] == labels[None, :]
    pair_mask = torch.zeros(13, 13, dtype=torch.bool)
    for r, c in pairs.tolist():
        pair_mask[r, c] = True
    partner = torch.arange(12) ^ 1
    partner_mask = torch.zeros(12, 12, dtype=torch.bool)
    partner_mask[torch.arange(12), partner] = True
    views = torch.tensor([[bool(mask[i % 5, j % 5]) for j in range(15)] for i in range(15)])
    return {
        "labels": (Positives.from_keys(labels), _drop_self(same, 0)),
        "labels_offset": (Positives.from_keys(labels[3:9], labels, self_offset=3), _drop_self(same[3:9], 3)),
        "two_keys": (Positives.from_keys((labels, other), self_offset=None), same | (other[:, None] == other[None, :])),
        "two_keys_offset": (Positives.from_keys((labels[2:7], other[2:7]), (labels, other), self_offset=2),
                            _drop_self((same | (other[:, None] == other[None, :]))[2:7], 2)),
        "pairs": (Positives.from_pairs(pairs, 13, 13), _drop_self(pair_mask, 0)),
        "pairs_two_set": (Positives.from_pairs(pairs, 13, 13, self_offset=None), pair_mask),
        "partner": (Positives.from_partner(partner, 12), partner_mask),
        "partner_offset": (Positives.from_partner(partner[4:8], 12, self_offset=4), partner_mask[4:8]),
        "mask": (Positives.from_sample_mask(mask, torch.arange(15) % 5, 15), _drop_self(views, 0)),
        "mask_one": (Positives.from_sample_mask(mask, torch.arange(5), 15), _drop_self(views[:5], 0)),
    }


@pytest.mark.parametrize("dense_limit", [0, positives_module.DENSE_KEYS_LIMIT])
@pytest.mark.parametrize("name", list(_structures()))
def test_tiles_counts_and_aggregate_agree_with_dense(name, dense_limit, monkeypatch):
    # dense_limit 0: key relations grouped by a sort; the default: small ones held densely.
    monkeypatch.setattr(positives_module, "DENSE_KEYS_LIMIT", dense_limit)
    pos, expected = _structures()[name]
    assert expected.shape == (pos.num_rows, pos.num_cols)
    for tile in (1, 4, 7, 64):
        for r0 in range(0, pos.num_rows, tile):
            for c0 in range(0, pos.num_cols, tile):
                r1, c1 = min(r0 + tile, pos.num_rows), min(c0 + tile, pos.num_cols)
                assert torch.equal(pos.tile(r0, r1, c0, c1), expected[r0:r1, c0:c1]), (tile, r0, c0)
    assert torch.equal(pos.row_counts(), expected.sum(1))
    assert int(pos.pair_count()) == int(expected.sum())
    for dtype in (torch.float32, torch.float64):  # the counts as values (a dense relation's CPU form)
        assert torch.equal(pos.row_counts_as(dtype), expected.sum(1).to(dtype))
        assert float(pos.pair_count_as(dtype)) == float(expected.sum())
    cand = torch.randn(pos.num_cols, 3, dtype=torch.float64)
    torch.testing.assert_close(pos.aggregate(cand), expected.double() @ cand)
    rows = torch.randn(pos.num_rows, 3, dtype=torch.float64)
    torch.testing.assert_close(pos.aggregate_transposed(rows), expected.double().T @ rows)


def test_a_dense_relation_is_converted_to_values_once_per_dtype():
    """A small call reads the 0/1 values several times (its counts, its tile): one conversion per dtype."""
    pos = Positives.from_keys(torch.tensor([0, 1, 0, 2, 1]))
    first = pos.dense_as(torch.float32)
    assert pos.dense_as(torch.float32) is first and pos.tile_values(0, 5, 0, 5, torch.float32) is first
    assert pos.dense_as(torch.float64) is not first and torch.equal(pos.dense_as(torch.float64), first.double())
    assert torch.equal(first, pos.dense.float())


def test_self_pairs_are_never_positive():
    pos = Positives.from_keys(torch.zeros(6, dtype=torch.int64))
    assert not pos.tile(0, 6, 0, 6).diagonal().any()
    assert pos.row_counts().tolist() == [5] * 6


def test_pairs_drop_duplicates_and_self():
    pos = Positives.from_pairs(torch.tensor([[0, 1], [0, 1], [2, 2], [3, 0]]), 4, 4)
    assert pos.row_counts().tolist() == [1, 0, 0, 1]
    cand = torch.eye(4, dtype=torch.float64)
    assert pos.aggregate(cand).tolist() == [[0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]


@pytest.mark.parametrize("name", ["pairs", "pairs_two_set"])
def test_row_lists_are_each_rows_sorted_columns(name):
    """The per-row lists the Triton kernels search: exactly the mask's columns, in order, as int32."""
    pos, expected = _structures()[name]
    offsets, columns = pos.row_lists
    assert offsets.dtype == columns.dtype == torch.int32
    assert offsets.tolist()[0] == 0 and columns.tolist()[-1] == -1
    for r in range(pos.num_rows):
        got = columns[offsets[r]:offsets[r + 1]].tolist()
        assert got == expected[r].nonzero().flatten().tolist(), r
    empty = Positives.from_pairs(torch.zeros(0, 2, dtype=torch.int64), 3, 3).row_lists
    assert empty[0].tolist() == [0, 0, 0, 0] and empty[1].tolist() == [-1]


def test_identity_partner_aggregate_is_the_candidates_themselves():
    pos = Positives.from_partner(torch.arange(5), 5, self_offset=None, layout="identity")
    cand = torch.randn(5, 2)
    assert pos.aggregate(cand) is cand  # no copy for CLIP without ids
    assert pos.aggregate_transposed(cand) is cand
    shuffled = Positives.from_partner(torch.tensor([2, 0, 1, 4, 3]), 5, self_offset=None)
    assert torch.equal(shuffled.aggregate(cand), cand[[2, 0, 1, 4, 3]])
    assert torch.equal(shuffled.aggregate_transposed(cand), cand[[1, 2, 0, 4, 3]])


@pytest.mark.parametrize("dense_limit", [0, positives_module.DENSE_KEYS_LIMIT])
def test_large_keys_group_correctly(dense_limit, monkeypatch):
    monkeypatch.setattr(positives_module, "DENSE_KEYS_LIMIT", dense_limit)
    # Keys far apart and negative (hashes) must group by equality only.
    keys = torch.tensor([2**62, -(2**62), 2**62, 7, -1, 7])
    pos = Positives.from_keys(keys)
    assert pos.row_counts().tolist() == [1, 0, 1, 1, 0, 1]


@pytest.mark.parametrize("dtype,width", [(torch.float32, 10), (torch.float32, 4100), (torch.float64, 4100)])
def test_guide_tile_counts_and_excluded_columns_are_exact(dtype, width):
    """A guide tile's record: the excluded count, rows excluding more than one, and each row's
    excluded column (index arithmetic below 2**24 in fp32, argmin above)."""
    from torch_contrastive.positives import Exclusion

    exclusion = Exclusion(guide=(torch.zeros(4, 1), torch.zeros(width, 1), torch.zeros(4)), learn=True)
    keep = torch.ones(4, width, dtype=dtype)
    keep[0, width - 1] = 0  # row 0: the last column; row 1: none; row 2: column 3; row 3: two
    keep[2, 3] = 0
    keep[3, 1] = keep[3, 5] = 0
    exclusion._remember(keep, 0, 0)
    torch.testing.assert_close(exclusion.record.flags[(0, 0)], torch.tensor([4.0, 1.0]))
    column, kept = exclusion.record.firsts[(0, 0)]
    assert column[[0, 2]].tolist() == [width - 1, 3]
    assert kept.tolist() == [False, True, False, False]
    exclusion.learn_from([4.0, 1.0])  # a row excludes two: this tile is masked again, not scattered
    assert not exclusion.record.firsts


def test_an_exclusion_is_a_frozen_rule_with_one_record_per_call():
    """The rule cannot change after it is built; what a call learns about its tiles lives in its
    own record, so two calls never share one."""
    import dataclasses

    from torch_contrastive.positives import Exclusion

    first, second = Exclusion(diagonal=1, learn=True), Exclusion(diagonal=1, learn=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.diagonal = 2  # type: ignore[misc]
    assert first.record is not second.record
    first.learn_from([])
    assert first.learned and not second.learned
