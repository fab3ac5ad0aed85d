"""The training command: each recipe runs, writes its files, learns; bad arguments fail clearly."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from torch_contrastive.cli import main
from torch_contrastive.cli.train import Config, augment, load_digits_split, train


@pytest.mark.parametrize("loss", ["clip", "siglip", "nt_xent", "nt_bxent", "supcon"])
def test_recipe_smoke(loss, tmp_path):
    # SigLIP's independent sigmoids start slower than a soft-max (OneCycle warm-up): 8 epochs (2 s).
    cfg = Config(loss=loss, epochs=8 if loss == "siglip" else 2, batch_size=128, dim=16, temperature=0.1, out=str(tmp_path))
    result = train(cfg, progress=False)
    for name in ("metrics.json", "config.json", "loss.png", "embedding.png"):
        assert (tmp_path / name).stat().st_size > 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    for key, value in metrics["trained"].items():
        assert 0.0 <= value <= 1.0, key
    assert metrics["loss_history"][-1] < metrics["loss_history"][0]
    # Learning, measured against the untrained encoder on the same split (which already
    # scores ~0.82 kNN and ~0.56 linear-probe on digits): two epochs must beat it clearly.
    before, after = result["untrained"], result["trained"]
    assert after["linear_probe_accuracy"] > before["linear_probe_accuracy"] + 0.1
    if loss != "nt_bxent":  # two epochs of NT-BXent improve the probe but not yet kNN
        assert after["knn_accuracy"] > before["knn_accuracy"] + 0.03
    if loss in ("clip", "siglip"):
        assert after["zero_shot_accuracy"] > before["zero_shot_accuracy"] + 0.1


def test_augment_is_seeded_and_in_range():
    x = load_digits_split(0)[0][:16]
    a = augment(x, torch.Generator().manual_seed(1))
    b = augment(x, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == x.shape
    assert a.min() >= 0 and a.max() <= 1 and not torch.equal(a, x)


@pytest.mark.parametrize("argv,words", [
    (["train", "--loss", "triplet"], "invalid choice"),
    (["train", "--epochs", "0"], "positive integer"),
    (["train", "--batch-size", "x"], "positive integer"),
    (["train", "--temperature", "-0.1"], "positive"),
    (["train", "--chunk-size", "0"], "positive integer"),
    (["train", "--batch-size", "1"], "at least 2"),
    (["train", "--seed", "-5"], "--seed: expected an integer >= 0"),
    (["train", "--logit-bias", "nan"], "--logit-bias: expected a finite number"),
    (["train", "--device", "tpu"], "invalid choice"),
    (["train", "--precision", "fp8"], "invalid choice"),
])
def test_train_bad_arguments(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert words in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("torch-contrastive train: error: argument ")


def test_out_refuses_an_existing_run_or_a_file(tmp_path, capsys):
    (tmp_path / "metrics.json").write_text("{}")
    assert main(["train", "--epochs", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds a run (metrics.json)" in err and "--overwrite" in err and "\n" not in err
    assert (tmp_path / "metrics.json").read_text() == "{}"  # untouched
    target = tmp_path / "file.txt"
    target.write_text("x")
    assert main(["train", "--epochs", "1", "--out", str(target)]) == 2
    assert "is a file; expected a folder" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_device_cuda_without_a_gpu_is_a_one_line_error(tmp_path, capsys):
    assert main(["train", "--epochs", "1", "--device", "cuda", "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.strip() == "error: --device cuda: no CUDA device is visible to PyTorch (try --device cpu)"
    assert not (tmp_path / "r").exists()


def test_fp16_with_micro_batches_is_refused(tmp_path, capsys):
    assert main(["train", "--epochs", "1", "--device", "cpu", "--precision", "fp16", "--micro-batch", "8",
                 "--out", str(tmp_path / "r")]) == 2
    assert "--precision fp16 does not combine with --micro-batch" in capsys.readouterr().err


def test_overwrite_replaces_a_run_and_the_report_says_what_runs(tmp_path, capsys):
    args = ["train", "--loss", "supcon", "--epochs", "1", "--device", "cpu", "--out", str(tmp_path)]
    (tmp_path / "metrics.json").write_text("{}")
    assert main([*args, "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert "data: digits (scikit-learn): 1797 images, 10 classes; split 1257 train / 540 test images" in out
    assert "1 epochs x 10 batches of 128 = 10 optimizer steps on cpu (fp32)" in out
    assert "warning: only 10 optimizer steps" in out
    assert json.loads((tmp_path / "metrics.json").read_text())["config"]["epochs"] == 1


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_on_the_device_found(precision, tmp_path):
    from device import DEVICE

    cfg = Config(loss="nt_xent", epochs=2, batch_size=128, dim=16, temperature=0.1, out=str(tmp_path), device=DEVICE.type,
                 precision=precision)
    result = train(cfg, progress=False)
    history = result["loss_history"]
    assert all(torch.isfinite(torch.tensor(history))) and history[-1] < history[0]
    assert result["trained"]["linear_probe_accuracy"] > result["untrained"]["linear_probe_accuracy"] + 0.05


def test_distributed_flag_outside_torchrun(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "--distributed", "--epochs", "1"]) == 2
    assert "torchrun" in capsys.readouterr().err


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch_contrastive", *args]


def test_sigkill_after_a_checkpoint_then_resume_gives_the_uninterrupted_results(tmp_path):
    """A run killed (SIGKILL) after its first checkpoint and resumed with --resume writes the
    same loss history and trained metrics, bit for bit, as a run that was never interrupted."""
    args = ["train", "--loss", "nt_xent", "--epochs", "6", "--quiet"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run(_cli(*args, "--out", str(whole)), check=True, timeout=600)
    proc = subprocess.Popen(_cli(*args, "--out", str(killed)))
    checkpoint = killed / "checkpoint.pt"
    deadline = time.monotonic() + 300
    while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert checkpoint.exists() and not (killed / "metrics.json").exists(), "the run was not interrupted mid-way"
    done = torch.load(checkpoint, weights_only=False)["epochs_done"]
    assert 1 <= done < 6
    subprocess.run(_cli("train", "--resume", str(killed)), check=True, timeout=600, capture_output=True)
    a, b = (json.loads((d / "metrics.json").read_text()) for d in (whole, killed))
    assert a["loss_history"] == b["loss_history"] and len(a["loss_history"]) == 6
    assert a["trained"] == b["trained"] and a["untrained"] == b["untrained"]
    again = subprocess.run(_cli("train", "--resume", str(killed)), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "already finished" in again.stdout


def test_checkpoint_holds_the_whole_state_and_is_written_atomically(tmp_path):
    cfg = Config(loss="clip", epochs=1, batch_size=128, out=str(tmp_path))
    train(cfg, progress=False)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert state["epochs_done"] == 1 and len(state["loss_history"]) == 1
    assert set(state["rng"]) >= {"torch", "augment", "order"} and "optimizer" in state and "scheduler" in state
    assert len(state["modules"]) == 3 and "logit_scale" in state["modules"][2]  # the learnable temperature
    assert "handwritten" in state["vocabulary"] and len(state["split"]["test"]) == 540
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left behind


def test_resume_errors(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "checkpoint.pt does not exist" in capsys.readouterr().err


def test_missing_cli_extra_names_the_extra(monkeypatch, capsys):
    import torch_contrastive.cli as cli

    real = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name, *a))
    assert main(["train", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'torch-contrastive[cli]'" in err and "scikit-learn" in err


@pytest.mark.parametrize("loss", ["nt_xent", "supcon", "nt_bxent", "clip"])
def test_micro_batch_gives_the_results_of_whole_batches(loss, tmp_path):
    """--micro-batch K (gradient caching) trains the same model: equal loss history to round-off.
    In fp32: under bf16 autocast (the GPU's "auto") a micro-batch rounds other partial sums than the
    whole batch, and two epochs carry that apart by about 1 %, which is precision, not caching."""
    results = []
    for micro in (None, 48):
        cfg = Config(loss=loss, epochs=2, batch_size=128, dim=16, temperature=0.1, micro_batch=micro, out=str(tmp_path / str(micro)),
                     precision="fp32")
        results.append(train(cfg, progress=False))
    whole, cached = results
    assert cached["loss_history"] == pytest.approx(whole["loss_history"], rel=1e-4)
    for key, value in whole["trained"].items():
        assert cached["trained"][key] == pytest.approx(value, abs=0.02), key


def test_padded_text_equals_the_bag_of_words_form():
    from torch_contrastive.cli.models import TextEncoder, Vocabulary
    from torch_contrastive.cli.train import PaddedText

    vocab = Vocabulary.digits()
    text = TextEncoder(len(vocab.words), 8)
    captions = ["a handwritten seven", "the digit one", "an unknown caption", "a scan of the number two"]
    tokens, offsets = vocab.encode(captions)
    torch.testing.assert_close(PaddedText(text)(PaddedText.pad(tokens, offsets)), text(tokens, offsets))


def test_the_tracked_metric_leaves_training_unchanged(tmp_path, monkeypatch):
    """loss.png follows a held-out kNN accuracy during training; scoring it (eval mode, no
    random draw) must not change the training that follows, bit for bit."""
    import torch_contrastive.cli.train as train_module

    tracked = train(Config(loss="supcon", epochs=3, out=str(tmp_path / "a")), progress=False)
    monkeypatch.setattr(train_module, "_track", lambda *args, **kw: None)
    plain = train(Config(loss="supcon", epochs=3, out=str(tmp_path / "b")), progress=False)
    assert tracked["loss_history"] == plain["loss_history"] and tracked["trained"] == plain["trained"]
    points = tracked["tracked"]["points"]
    assert [e for e, _ in points] == [1, 2, 3] and points[-1][1] == pytest.approx(tracked["trained"]["knn_accuracy"])


def test_resume_extends_a_constant_schedule_run_bit_for_bit(tmp_path, capsys):
    """``--resume RUN --epochs M`` on a finished 2-epoch run equals an uninterrupted
    M-epoch run (same seed): losses, metrics and weights, bit for bit on CPU."""
    common = ["train", "--loss", "nt_xent", "--schedule", "constant", "--device", "cpu", "--quiet"]
    assert main([*common, "--epochs", "2", "--out", str(tmp_path / "short")]) == 0
    assert main(["train", "--resume", str(tmp_path / "short"), "--epochs", "4", "--quiet"]) == 0
    assert main([*common, "--epochs", "4", "--out", str(tmp_path / "whole")]) == 0
    extended = json.loads((tmp_path / "short" / "metrics.json").read_text())
    whole = json.loads((tmp_path / "whole" / "metrics.json").read_text())
    assert extended["loss_history"] == whole["loss_history"] and len(whole["loss_history"]) == 4
    assert extended["trained"] == whole["trained"] and extended["config"]["epochs"] == 4
    a = torch.load(tmp_path / "short" / "checkpoint.pt", weights_only=False)["modules"]
    b = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=False)["modules"]
    assert all(torch.equal(x, y) for sa, sb in zip(a, b) for x, y in zip(sa.values(), sb.values()))
    assert json.loads((tmp_path / "short" / "config.json").read_text())["epochs"] == 4


def test_resume_cannot_extend_a_one_cycle_run_or_shrink_one(tmp_path, capsys):
    assert main(["train", "--loss", "supcon", "--epochs", "1", "--device", "cpu", "--quiet", "--out", str(tmp_path)]) == 0
    assert main(["train", "--resume", str(tmp_path), "--epochs", "3"]) == 2
    assert "only runs trained with --schedule constant can be extended" in capsys.readouterr().err
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path)]) == 0  # finished: nothing to resume, said so
    assert "nothing to resume" in capsys.readouterr().out


@pytest.mark.parametrize("loss", ["clip", "nt_xent"])
def test_prefetching_the_next_batch_changes_nothing(loss, tmp_path):
    """--prefetch on (the GPU default) prepares batch k+1 on a thread during step k: the
    augmentation draws keep their order, so the run is the same bit for bit."""
    runs = [train(Config(loss=loss, epochs=2, out=str(tmp_path / mode), device="cpu", prefetch=mode), progress=False)
            for mode in ("off", "on")]
    assert runs[0]["loss_history"] == runs[1]["loss_history"] and runs[0]["trained"] == runs[1]["trained"]


@pytest.mark.parametrize("loss", ["sogclr", "fastclip"])
def test_the_global_recipes_resume_bit_for_bit_with_their_state(loss, tmp_path):
    """The global losses' per-sample state (and fastclip's learnable temperature) live in the loss
    module: a run resumed from its checkpoint equals an uninterrupted one, state included."""
    common = ["train", "--loss", loss, "--schedule", "constant", "--device", "cpu", "--quiet", "--batch-size", "64"]
    assert main([*common, "--epochs", "1", "--out", str(tmp_path / "short")]) == 0
    assert main(["train", "--resume", str(tmp_path / "short"), "--epochs", "2", "--quiet"]) == 0
    assert main([*common, "--epochs", "2", "--out", str(tmp_path / "whole")]) == 0
    extended = json.loads((tmp_path / "short" / "metrics.json").read_text())
    whole = json.loads((tmp_path / "whole" / "metrics.json").read_text())
    assert extended["loss_history"] == whole["loss_history"] and extended["trained"] == whole["trained"]
    a = torch.load(tmp_path / "short" / "checkpoint.pt", weights_only=False)["modules"]
    b = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=False)["modules"]
    state = a[-1]["log_u"]  # the loss module comes last
    assert torch.isfinite(state[:, 0]).sum() > 100  # the training samples' states were written
    assert all(torch.equal(x, y) for sa, sb in zip(a, b) for x, y in zip(sa.values(), sb.values()))
    if loss == "fastclip":
        assert "tau" in a[-1] and whole["final_temperature"] != 0.07  # the global temperature was learned


def test_the_global_recipes_refuse_bad_options_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--loss", "sogclr", "--gamma", "0", "--out", str(tmp_path / "a")])
    assert info.value.code == 2 and "--gamma" in capsys.readouterr().err
    assert main(["train", "--loss", "supcon", "--temperature-mode", "individual", "--epochs", "1", "--quiet",
                 "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--temperature-mode and --gamma-schedule apply to --loss sogclr and fastclip" in err and "\n" not in err
    assert not (tmp_path / "b").exists()
