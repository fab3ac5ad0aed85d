"""Own data for the training command: image folders and caption CSVs built from digits with Pillow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn")
PIL = pytest.importorskip("PIL.Image")

from helpers import DIGIT_NAMES as NAMES  # noqa: E402
from helpers import make_digit_files  # noqa: E402
from torch_contrastive.cli import main  # noqa: E402
from torch_contrastive.cli.data import DataError, load  # noqa: E402
from torch_contrastive.cli.evaluate import recall_at_k  # noqa: E402


@pytest.fixture(scope="module")
def digit_files(tmp_path_factory):
    return make_digit_files(tmp_path_factory.mktemp("digits"))


def test_folder_loads_labels_channels_size_and_a_stratified_split(digit_files):
    folder, _ = digit_files
    data = load(str(folder), channels=3, size=16, seed=0)
    assert data.source == "folder" and data.images.shape == (120, 3, 16, 16)
    assert data.images.min() >= 0 and data.images.max() <= 1 and data.images.dtype == torch.float32
    assert data.class_names == sorted(NAMES)
    assert torch.equal(torch.bincount(data.labels), torch.full((10,), 12))
    assert len(data.test_idx) == 36 and set(data.train_idx.tolist()).isdisjoint(data.test_idx.tolist())
    assert set(torch.bincount(data.labels[data.test_idx], minlength=10).tolist()) <= {3, 4}  # stratified: 30 % of 12 each
    gray = load(str(folder), channels=1, size=8, seed=0)
    assert gray.images.shape == (120, 1, 8, 8)
    # the 8x8 grayscale round trip reproduces the digits' pixels (up to 8-bit rounding)
    from sklearn.datasets import load_digits

    first_zero = torch.tensor(load_digits().images[0], dtype=torch.float32) / 16
    row = gray.paths.index(str(folder / "zero" / "0.png"))
    assert gray.class_names[int(gray.labels[row])] == "zero"
    assert (gray.images[row, 0] - first_zero).abs().max() < 1 / 255 + 1e-6


def test_csv_rows_share_images_and_the_split_is_by_image(digit_files):
    _, table = digit_files
    data = load(str(table), channels=1, size=8, seed=3)
    assert data.source == "csv" and data.images.shape == (120, 1, 8, 8) and len(data.captions) == 240
    assert torch.equal(torch.bincount(data.row_image), torch.full((120,), 2))
    train_rows, test_rows = data.rows_of(data.train_idx), data.rows_of(data.test_idx)
    assert len(train_rows) + len(test_rows) == 240
    assert set(data.row_image[train_rows].tolist()).isdisjoint(data.row_image[test_rows].tolist())


def test_csv_image_id_groups_rows(tmp_path, digit_files):
    folder, _ = digit_files
    table = tmp_path / "ids.csv"
    table.write_text("image,caption,image_id\n"
                     f"{folder}/zero/0.png,a zero,7\n{folder}/zero/1.png,another view of the same thing,7\n"
                     f"{folder}/one/0.png,a one,8\n")
    data = load(str(table), channels=1, size=8, seed=0)
    assert len(data.images) == 2 and data.row_image.tolist() == [0, 0, 1]


def test_recall_at_k_follows_the_coco_convention():
    images = torch.eye(3)
    # captions 0, 1 describe image 0; 2 image 1; 3 image 2. Image 2's best caption is caption 2
    # (image 1's): a miss at 1; caption 3's best image is image 1: a miss at 1; both hit at 2.
    texts = torch.tensor([[1.0, 0, 0], [0.9, 0.1, 0], [0, 1.0, 0.5], [0, 0.8, 0.2]])
    owner = torch.tensor([0, 0, 1, 2])
    m = recall_at_k(images, texts, owner, ks=(1, 2))
    assert m["image_to_text_recall@1"] == pytest.approx(2 / 3)
    assert m["text_to_image_recall@1"] == pytest.approx(3 / 4)
    assert m["text_to_image_recall@2"] == 1.0 and m["image_to_text_recall@2"] == 1.0


@pytest.mark.parametrize("make,words", [
    (lambda root: (root / "empty").mkdir() or root / "empty", "has no class subfolders"),
    (lambda root: _one_image_class(root), "has 1 image(s)"),
    (lambda root: _bad_image(root), "cannot read image"),
    (lambda root: _csv(root, "picture,caption\na.png,x\n"), "missing column(s) 'image'"),
    (lambda root: _csv(root, "image,caption\nmissing.png,x\nother.png,y\n"), "t.csv, line 2: image file not found"),
    (lambda root: _csv(root, "image,caption\n"), "no rows below the header"),
    (lambda root: root / "nothing.txt", "neither a directory"),
])
def test_bad_data_is_a_clear_error_with_exit_2_and_nothing_written(tmp_path, make, words, capsys):
    path = make(tmp_path)
    with pytest.raises(DataError, match=__import__("re").escape(words)):
        load(str(path), channels=1, size=8, seed=0)
    out = tmp_path / "run"
    loss = "clip" if str(path).endswith(".csv") else "supcon"
    assert main(["train", "--loss", loss, "--data", str(path), "--epochs", "1", "--out", str(out), "--quiet"]) == 2
    assert words in capsys.readouterr().err
    assert not out.exists()


def test_recipe_and_data_kind_must_match(digit_files, tmp_path, capsys):
    folder, table = digit_files
    assert main(["train", "--loss", "clip", "--data", str(folder), "--out", str(tmp_path / "a"), "--quiet"]) == 2
    assert "caption CSV" in capsys.readouterr().err
    assert main(["train", "--loss", "nt_xent", "--data", str(table), "--out", str(tmp_path / "b"), "--quiet"]) == 2
    assert "class subfolders" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _one_image_class(root: Path) -> Path:
    for name, count in (("a", 3), ("b", 1)):
        (root / "f" / name).mkdir(parents=True)
        for k in range(count):
            PIL.new("L", (8, 8), color=k * 40).save(root / "f" / name / f"{k}.png")
    return root / "f"


def _bad_image(root: Path) -> Path:
    for name in ("a", "b"):
        (root / "f" / name).mkdir(parents=True)
        for k in range(2):
            PIL.new("L", (8, 8), color=k * 40).save(root / "f" / name / f"{k}.png")
    (root / "f" / "b" / "broken.png").write_bytes(b"not a png")
    return root / "f"


def _csv(root: Path, text: str) -> Path:
    PIL.new("L", (8, 8)).save(root / "a.png")
    (root / "t.csv").write_text(text)
    return root / "t.csv"


def test_train_and_embed_on_a_folder_and_a_csv(digit_files, tmp_path):
    folder, table = digit_files
    run_f = tmp_path / "folder-run"
    assert main(["train", "--loss", "supcon", "--data", str(folder), "--image-size", "8", "--channels", "1", "--epochs", "2",
                 "--out", str(run_f), "--quiet"]) == 0
    metrics = json.loads((run_f / "metrics.json").read_text())
    assert set(metrics["trained"]) == {"knn_accuracy", "linear_probe_accuracy", "few_shot_accuracy"}
    run_c = tmp_path / "csv-run"
    assert main(["train", "--loss", "clip", "--data", str(table), "--image-size", "12", "--epochs", "12", "--batch-size", "32",
                 "--out", str(run_c), "--quiet"]) == 0
    metrics = json.loads((run_c / "metrics.json").read_text())
    keys = {f"{d}_recall@{k}" for d in ("image_to_text", "text_to_image") for k in (1, 5, 10)}
    assert set(metrics["trained"]) == keys and set(metrics["untrained"]) == keys
    # captions name the class: a trained encoder retrieves far better than chance (untrained ~ 10/36)
    assert metrics["trained"]["text_to_image_recall@10"] > metrics["untrained"]["text_to_image_recall@10"] + 0.2
    np = pytest.importorskip("numpy")
    assert main(["embed", "--run", str(run_c), "--out", str(tmp_path / "e" / "emb.npy")]) == 0
    emb = np.load(tmp_path / "e" / "emb.npy")
    assert emb.shape == (120, 16) and np.allclose((emb**2).sum(1), 1, atol=1e-5)
    rows = json.loads((tmp_path / "e" / "captions.json").read_text())
    assert len(rows) == 240 and rows[0]["caption"] == "a handwritten zero"
    assert np.load(tmp_path / "e" / "text_emb.npy").shape == (240, 16)
    assert main(["embed", "--run", str(run_f), "--data", str(folder), "--out", str(tmp_path / "f" / "emb.npy")]) == 0
    assert np.load(tmp_path / "f" / "labels.npy").tolist() == sorted(list(range(10)) * 12)


def test_vocabulary_leaves_unknown_words_out():
    from torch_contrastive.cli.models import TextEncoder, Vocabulary

    vocab = Vocabulary(["A handwritten seven", "the digit seven"])
    tokens, offsets = vocab.encode(["an unknown caption", "the SEVEN"])
    assert tokens.tolist() == [vocab.index["the"], vocab.index["seven"]] and offsets.tolist() == [0, 0]
    out = TextEncoder(len(vocab.words), 4)(tokens, offsets)
    assert out.shape == (2, 4) and torch.isfinite(out).all()
