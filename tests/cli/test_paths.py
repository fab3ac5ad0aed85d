"""Where the subcommands write, and the data they are given, checked before any work: a bad
``--out``, too few images or a run that does not fit the data is one line and exit 2, and
nothing is left behind (issue 36)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("sklearn")
PIL = pytest.importorskip("PIL.Image")

from test_data import make_digit_files  # noqa: E402

from torch_contrastive.cli import main  # noqa: E402
from torch_contrastive.cli._paths import cannot_write  # noqa: E402


def _unwritable(tmp_path: Path) -> Path:
    """A folder this process cannot create anything in: a read-only folder, or (as root, whom file
    modes do not stop) a place below /proc; skipped where neither holds."""
    if os.name == "posix" and os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        return locked
    place = Path("/proc/torch-contrastive-test")
    try:
        place.mkdir(parents=True)
    except OSError:
        return place
    place.rmdir()
    pytest.skip("no unwritable place on this machine")


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --") and "\n" not in err and "Traceback" not in err, err
    return err


def test_cannot_write_names_the_flag_and_leaves_nothing(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert "--out" in cannot_write(afile / "run", "--out", folder=True) and "is a file" in cannot_write(afile / "r", "--o", folder=True)
    assert "is a file; expected a folder" in cannot_write(afile, "--out", folder=True)
    assert "is a folder; expected a file name" in cannot_write(tmp_path, "--out", folder=False)
    assert "cannot write" in cannot_write(_unwritable(tmp_path) / "deep" / "run", "--out", folder=True)
    assert cannot_write(tmp_path / "new" / "deeper", "--out", folder=True) is None
    assert cannot_write(tmp_path / "new" / "emb.npy", "--out", folder=False) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] + (["locked"] if (tmp_path / "locked").exists() else [])


@pytest.mark.parametrize("command", [
    ["train", "--epochs", "1", "--quiet"],
    ["embed", "--run", "no-such-run"],
    ["bench", "--small", "--sizes", "2"],
])
@pytest.mark.parametrize("where", ["below a file", "unwritable"])
def test_every_subcommand_refuses_an_out_it_cannot_write_before_any_work(command, where, tmp_path, capsys):
    if where == "below a file":
        (tmp_path / "afile").write_text("x")
        out = tmp_path / "afile" / ("emb.npy" if command[0] == "embed" else "run")
    else:
        out = _unwritable(tmp_path) / "run" / ("emb.npy" if command[0] == "embed" else "x")
    assert main([*command, "--out", str(out)]) == 2
    err = _one_line(capsys)
    assert "--out" in err and ("lies below" in err if where == "below a file" else "cannot write" in err)


def test_train_refuses_data_too_small_for_its_splits_and_writes_nothing(tmp_path, capsys):
    """Two images pass a 70/30 split with one image on each side: refused before training (the
    embedding plot of the held-out split needs two), not a traceback after it."""
    table = tmp_path / "two.csv"
    for k in range(2):
        PIL.new("L", (8, 8), color=k * 90).save(tmp_path / f"{k}.png")
    table.write_text("image,caption\n0.png,a dark square\n1.png,a grey square\n")
    out = tmp_path / "run"
    assert main(["train", "--loss", "clip", "--data", str(table), "--epochs", "1", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "split 70/30 into 1 for training and 1 held out" in err and "\n" not in err.strip()
    assert not out.exists()


def test_embed_refuses_data_the_runs_encoder_does_not_take(tmp_path, capsys):
    run = tmp_path / "digits-run"
    assert main(["train", "--loss", "supcon", "--epochs", "1", "--out", str(run), "--quiet"]) == 0
    folder, _ = make_digit_files(tmp_path / "rgb", per_class=3, classes=3, mode="RGB")
    out = tmp_path / "e" / "emb.npy"
    assert main(["embed", "--run", str(run), "--data", str(folder), "--out", str(out)]) == 2
    err = _one_line(capsys)
    assert "--run" in err and "does not take" in err and "32x32 px" in err
    assert not out.exists()


def test_a_training_run_that_fails_leaves_no_half_written_folder(tmp_path, monkeypatch):
    from torch_contrastive.cli import train

    def broken(cfg, **kwargs):
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out) / "config.json").write_text("{}")
        raise RuntimeError("a failure inside training")

    monkeypatch.setattr(train, "train", broken)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="inside training"):
        main(["train", "--epochs", "1", "--out", str(out), "--quiet"])
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError):
        main(["train", "--epochs", "1", "--out", str(kept), "--quiet", "--overwrite"])
    assert (kept / "notes.txt").read_text() == "mine"  # a folder that was there before is never removed
