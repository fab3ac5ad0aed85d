"""The command line: explain prints each convention; bad arguments give clear errors."""

from __future__ import annotations

import pytest

from torch_contrastive.cli import main


def test_explain_default_reproduces_seed000(capsys):
    assert main(["explain", "--temperature", "1"]) == 0
    out = capsys.readouterr().out
    assert "2.855501" in out  # seed 000, NT-Xent at tau = 1
    assert "1.072711" in out  # seed 000, NT-BXent at tau = 1
    for name in ("pairing='halves'", "labels=...", "supcon_loss"):
        assert name in out


def test_explain_single_loss_and_labels(capsys):
    assert main(["explain", "--loss", "supcon", "--labels", "0,0,1,1,0,0,1,1"]) == 0
    out = capsys.readouterr().out
    assert "supcon_loss" in out and "nt_bxent" not in out


@pytest.mark.parametrize("argv,words", [
    (["explain", "--temperature", "-1"], "positive"),
    (["explain", "--labels", "a,b"], "integers"),
    (["explain", "--loss", "triplet"], "invalid choice"),
    (["explain", "--rows", "1"], "--rows"),
    (["explain", "--rows", "3"], "--rows must be even for the NT-Xent pairing rules"),
    (["explain", "--dim", "0"], "argument --dim: expected a positive integer"),
    (["bench", "--sizes", "0", "--loss", "clip"], "argument --sizes: expected comma-separated even batch sizes"),
    (["bench", "--small", "--sizes", "0"], "argument --sizes"),
    (["bench", "--sizes", "33"], "argument --sizes"),
])
def test_explain_bad_arguments(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert words in capsys.readouterr().err


def test_explain_odd_rows_for_the_label_conventions(capsys):
    assert main(["explain", "--rows", "5", "--loss", "supcon"]) == 0
    assert "supcon_loss" in capsys.readouterr().out


def test_explain_label_count_mismatch(capsys):
    assert main(["explain", "--labels", "0,1"]) == 2
    assert "--labels" in capsys.readouterr().err
