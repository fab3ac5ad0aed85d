"""Where the subcommands write, and the data they are given, checked before any work: a bad
``--out``, too few images or a run that does not fit the data is one line and exit 2, and
nothing is left behind (issue 36)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("sklearn")
PIL = pytest.importorskip("PIL.Image")

from helpers import make_digit_files  # noqa: E402
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


def _finished_run(out: Path) -> None:
    assert main(["train", "--loss", "nt_xent", "--epochs", "1", "--out", str(out), "--quiet"]) == 0
    assert {p.name for p in out.iterdir()} >= {"metrics.json", "checkpoint.pt", "config.json", "loss.png", "embedding.png"}


def test_a_run_that_fails_after_training_keeps_its_checkpoint_and_looks_unfinished(tmp_path, monkeypatch, capsys):
    """A failure at the last step (the plots) deletes nothing an earlier step finished: the checkpoint stays, metrics.json
    (written last, the mark of a finished run) is not there, and --resume finishes the run."""
    from torch_contrastive.cli import train

    def no_plots(*args, **kwargs):
        raise OSError("disk full while writing loss.png")

    monkeypatch.setattr(train, "plots", no_plots)
    out = tmp_path / "run"
    with pytest.raises(OSError, match="disk full"):
        main(["train", "--loss", "nt_xent", "--epochs", "1", "--out", str(out), "--quiet"])
    assert {p.name for p in out.iterdir()} == {"checkpoint.pt", "config.json"}
    assert "keeps the checkpoint of its finished epochs" in capsys.readouterr().err
    monkeypatch.undo()
    assert main(["train", "--resume", str(out), "--quiet"]) == 0
    assert (out / "metrics.json").exists() and (out / "loss.png").exists()


def test_a_failed_overwrite_leaves_the_earlier_run_readable_aside(tmp_path, monkeypatch, capsys):
    from torch_contrastive.cli import train

    out = tmp_path / "run"
    _finished_run(out)
    earlier = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()

    def broken(cfg, **kwargs):
        (Path(cfg.out) / "config.json").write_text('{"new": true}')
        raise RuntimeError("a failure inside training")

    monkeypatch.setattr(train, "train", broken)
    with pytest.raises(RuntimeError, match="inside training"):
        main(["train", "--loss", "nt_xent", "--epochs", "1", "--out", str(out), "--quiet", "--overwrite"])
    err = capsys.readouterr().err
    aside = tmp_path / "run.replaced"
    assert f"kept in {aside}" in err and "moved the earlier run's" in err
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == earlier  # the earlier run, whole
    assert not (out / "metrics.json").exists() and not (out / "checkpoint.pt").exists()  # nothing here reads as finished
    monkeypatch.undo()
    assert main(["train", "--resume", str(aside), "--quiet"]) == 0  # readable: "already finished"
    assert "already finished" in capsys.readouterr().out


def test_a_successful_overwrite_replaces_the_earlier_run(tmp_path, capsys):
    out = tmp_path / "run"
    _finished_run(out)
    assert main(["train", "--loss", "nt_xent", "--epochs", "1", "--out", str(out), "--quiet", "--overwrite"]) == 0
    assert not (tmp_path / "run.replaced").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_an_interrupted_write_leaves_no_partial_file(tmp_path, monkeypatch):
    """Every file of a run folder is written under a temporary name, then renamed: a write that fails leaves the
    earlier file (or none) and no temporary file."""
    from torch_contrastive.cli import _paths

    target = tmp_path / "metrics.json"
    target.write_text("earlier")

    def failing(fd, *args, **kwargs):
        class Handle:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                os.close(fd)

            def write(self, payload):
                raise OSError("interrupted")

        return Handle()

    monkeypatch.setattr(_paths.os, "fdopen", failing)
    with pytest.raises(OSError, match="interrupted"):
        _paths.write_atomically(target, b"new")
    assert target.read_text() == "earlier" and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]
    with pytest.raises(OSError, match="interrupted"):
        _paths.write_atomically(tmp_path / "config.json", b"{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_the_run_folder_writers_go_through_the_atomic_write():
    """No run-folder writer writes in place: the train, report, checkpoint and embed modules never call ``write_text``,
    ``savefig`` on a path, ``np.save`` or ``torch.save`` on a path (they hand bytes to ``write_atomically``)."""
    import inspect

    from torch_contrastive.cli import checkpoint, embed, report, train

    for module in (train, report, checkpoint, embed):
        source = inspect.getsource(module)
        for call in (".write_text(", "np.save(", "savefig(out", "torch.save(state, out", "open(out"):
            assert call not in source, (module.__name__, call)


# ------------------------------------------------------------------ one line and exit 2, never a traceback (issue 63)
def _extra_field_csv(root: Path) -> list[str]:
    _, csv_path = make_digit_files(root, per_class=3, classes=2)
    lines = csv_path.read_text().splitlines()
    lines[2] += ",an extra field"
    csv_path.write_text("\n".join(lines) + "\n")
    return ["--loss", "clip", "--data", str(csv_path)]


def _too_few_for_the_split(root: Path) -> list[str]:
    folder, _ = make_digit_files(root, per_class=2, classes=5)
    return ["--loss", "supcon", "--data", str(folder)]


def _decompression_bomb(root: Path) -> list[str]:
    folder, _ = make_digit_files(root, per_class=3, classes=2)
    big = next(p for p in folder.iterdir() if p.is_dir()) / "huge.png"
    PIL.new("L", (14000, 14000)).save(big)  # 196 M pixels: past Pillow's bomb limit, a few kB on disk
    return ["--loss", "supcon", "--data", str(folder)]


def _diverging(root: Path) -> list[str]:
    return ["--loss", "nt_xent", "--lr", "1e30"]


def _foreign_checkpoint(root: Path) -> list[str]:
    import torch

    (root / "foreign").mkdir()
    torch.save({"format": 1, "weights": [1.0]}, root / "foreign" / "checkpoint.pt")
    return ["--resume", str(root / "foreign")]


def _changed_data(root: Path) -> list[str]:
    import torch

    assert main(["train", "--loss", "supcon", "--epochs", "2", "--out", str(root / "done"), "--quiet"]) == 0
    (root / "done" / "metrics.json").unlink()
    state = torch.load(root / "done" / "checkpoint.pt", weights_only=False)
    state["epochs_done"], state["split"]["images"] = 1, 5  # as if trained on another data set
    torch.save(state, root / "done" / "checkpoint.pt")
    return ["--resume", str(root / "done")]


def _rank_without_world(root: Path) -> list[str]:
    os.environ["RANK"] = "0"  # (the test's monkeypatch restores the environment)
    return ["--distributed"]


TRAIN_FAILURES = {
    "a CSV row with more fields than its header": (_extra_field_csv, "fields where the header has 2"),
    "5 class folders of 2 images": (_too_few_for_the_split, "needs one image of each of the 5 classes"),
    "a decompression-bomb PNG": (_decompression_bomb, "could be decompression bomb"),
    "--lr 1e30 diverging": (_diverging, "training diverged"),
    "--resume of a checkpoint this program did not write": (_foreign_checkpoint, "is not a checkpoint this program wrote"),
    "--resume after the data changed": (_changed_data, "the data changed since the checkpoint was written"),
    "--distributed with RANK but no WORLD_SIZE": (_rank_without_world, "WORLD_SIZE"),
}


@pytest.mark.parametrize("case", list(TRAIN_FAILURES))
def test_train_answers_a_problem_the_user_can_fix_in_one_line(case, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", os.environ.get("RANK", ""))
    monkeypatch.delenv("RANK")
    build, words = TRAIN_FAILURES[case]
    argv = build(tmp_path)
    capsys.readouterr()
    out = tmp_path / "run"
    before = sorted(p.name for p in tmp_path.iterdir())
    fresh = [] if "--resume" in argv else ["--epochs", "1", "--out", str(out)]
    code = main(["train", "--quiet", *fresh, *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err and "Traceback" not in err, (code, err)
    assert words in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no run folder left behind
