"""tools/matryoshka_ratio.py, the in-process one-pass / per-prefix ratio quoted in docs/losses.md: both modes
run at a tiny size, so the command behind the figures never rots."""

from __future__ import annotations

import sys

import pytest

from helpers import ROOT, load_file


@pytest.fixture(scope="module")
def ratio_tool():
    return load_file("matryoshka_ratio", ROOT / "tools" / "matryoshka_ratio.py")


def test_wrapped_prints_one_ratio_per_one_pass_form(ratio_tool, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["matryoshka_ratio.py", "--wrapped", "--n", "24", "--d", "80", "--pairs", "1"])
    ratio_tool.main()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" one pass")[0].strip() for line in lines] == [
        "clip", "clip image_id", "info_nce", "nt_xent decoupled", "supcon labels", "nt_xent labels (PML)", "nt_bxent labels",
        "supcon mask", "supcon memory", "nt_xent memory (PML)", "nt_bxent pos_indices", "siglip image_id",
        "global unimodal", "global bimodal"]
    assert all(float(line.rsplit(":", 1)[1]) > 0 for line in lines)


def test_every_wrapped_form_takes_the_one_pass(ratio_tool, monkeypatch):
    """The forms the tool times are the ones the one pass covers (else it would time per prefix twice)."""
    from torch_contrastive.losses import matryoshka

    seen = []
    original = matryoshka._one_pass

    def spy(loss_fn, tensors, kwargs):
        form = original(loss_fn, tensors, kwargs)
        seen.append(form is not None)
        return form

    monkeypatch.setattr(matryoshka, "_one_pass", spy)
    original_global = matryoshka.global_one_pass

    def spy_global(*args):
        total = original_global(*args)
        seen.append(total is not None)
        return total

    monkeypatch.setattr(matryoshka, "global_one_pass", spy_global)
    monkeypatch.setattr(sys, "argv", ["matryoshka_ratio.py", "--wrapped", "--n", "16", "--d", "64", "--pairs", "1"])
    ratio_tool.main()
    assert seen and all(seen)
