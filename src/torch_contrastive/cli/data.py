"""Training data for ``torch-contrastive train``: bundled digits, an image folder, a caption CSV.

* digits (no ``--data``): scikit-learn's 1,797 8x8 digits, grayscale;
* a directory ``PATH/<class>/<image>``: the folder name is the label (``nt_xent``,
  ``nt_bxent``, ``supcon``);
* a ``.csv`` with columns ``image`` (a path relative to the CSV) and ``caption``, optional
  ``image_id`` (rows with the same id -- or the same path -- are one image); several rows
  may share an image (``clip``, ``siglip``).

Images are decoded with Pillow, converted to grayscale (``channels=1``) or RGB (3),
resized to ``size`` x ``size`` and cached as one float tensor in [0, 1]. The split is
70/30: stratified by class for folders and digits, by image for CSVs (all rows of an
image fall on the same side). Every problem is a :class:`DataError` naming the file or
column; the command turns it into a message and exit code 2 before writing anything.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

#: File suffixes taken as images in a class folder (anything else is skipped).
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
TEST_FRACTION = 0.3


class DataError(Exception):
    """A data problem the user can fix (the message names the file or column)."""


@dataclass
class Data:
    """Images and their annotations, with the train/test split (indices into ``images``)."""

    source: str  # "digits", "folder" or "csv"
    images: Tensor  # (n_images, C, H, W) float32 in [0, 1]
    train_idx: Tensor  # image indices
    test_idx: Tensor
    labels: Tensor | None = None  # (n_images,) class index (digits, folder)
    class_names: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # the file of every image ("" for digits)
    captions: list[str] = field(default_factory=list)  # csv: one per caption row
    row_image: Tensor | None = None  # csv: (n_rows,) image index of every caption row

    @property
    def channels(self) -> int:
        return int(self.images.shape[1])

    @property
    def size(self) -> int:
        return int(self.images.shape[-1])

    def rows_of(self, image_idx: Tensor) -> Tensor:
        """Caption rows whose image is in ``image_idx`` (csv)."""
        if self.row_image is None:
            raise RuntimeError("internal: not caption data")
        return torch.isin(self.row_image, image_idx).nonzero().flatten()


def load(path: str | None, *, channels: int, size: int, seed: int) -> Data:
    """Digits when ``path`` is None, else an image folder or a caption CSV (see the module)."""
    if path is None:
        return load_digits(seed)
    p = Path(path)
    if p.is_dir():
        return load_folder(p, channels=channels, size=size, seed=seed)
    if p.suffix.lower() == ".csv":
        if not p.is_file():
            raise DataError(f"--data: {p} does not exist")
        return load_caption_csv(p, channels=channels, size=size, seed=seed)
    raise DataError(f"--data: {p} is neither a directory of class folders nor a .csv file")


def load_digits(seed: int) -> Data:
    from sklearn.datasets import load_digits as sk_digits

    digits = sk_digits()
    images = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train, test = _stratified_split(labels, seed)
    return Data("digits", images, train, test, labels=labels, class_names=[str(i) for i in range(10)],
                paths=[""] * len(labels))


def _decode(path: Path, channels: int, size: int) -> Tensor:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as source:  # Pillow refuses a decompression bomb (an image past ~179 M pixels) here
            img = source.convert("L" if channels == 1 else "RGB").resize((size, size), Image.Resampling.BILINEAR)
            data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
    except FileNotFoundError:
        raise DataError(f"image file not found: {path}") from None
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as err:
        raise DataError(f"cannot read image {path}: {err}") from None
    return data.reshape(size, size, channels).permute(2, 0, 1).float() / 255.0


def load_folder(root: Path, *, channels: int, size: int, seed: int) -> Data:
    classes = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise DataError(f"--data: {root} has no class subfolders (expected {root}/<class>/<image>)")
    images, labels, paths = [], [], []
    listed: list[tuple[Path, int]] = []
    for label, folder in enumerate(classes):
        files = sorted(f for f in folder.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
        if len(files) < 2:
            raise DataError(f"class folder {folder} has {len(files)} image(s): a stratified 70/30 split needs at least 2 per class")
        listed += [(f, label) for f in files]
    for f, label in _progress(listed, f"decoding {root.name}"):
        images.append(_decode(f, channels, size))
        labels.append(label)
        paths.append(str(f))
    if len(classes) < 2:
        raise DataError(f"--data: {root} has one class folder ({classes[0].name}); contrastive training with labels needs two")
    label_tensor = torch.tensor(labels, dtype=torch.int64)
    train, test = _stratified_split(label_tensor, seed)
    return Data("folder", torch.stack(images), train, test, labels=label_tensor, class_names=[c.name for c in classes], paths=paths)


def load_caption_csv(path: Path, *, channels: int, size: int, seed: int) -> Data:
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            columns = [c.strip() for c in (reader.fieldnames or [])]
            rows = []
            for row in reader:
                if None in row:  # DictReader keeps the fields past the header under None
                    raise DataError(f"{path}, line {reader.line_num}: {len(columns) + len(row[None])} fields where the header has "
                                    f"{len(columns)} (quote a caption that holds a comma)")
                rows.append({(k or "").strip(): (v or "").strip() for k, v in row.items()})
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise DataError(f"cannot read {path}: {err}") from None
    missing = [c for c in ("image", "caption") if c not in columns]
    if missing:
        raise DataError(f"{path}: missing column(s) {', '.join(repr(c) for c in missing)} (found {columns}); "
                        "expected a header with 'image' and 'caption' (and optionally 'image_id')")
    if not rows:
        raise DataError(f"{path}: no rows below the header")
    keyed = "image_id" in columns
    index: dict[str, int] = {}
    files: list[Path] = []
    first_line: list[int] = []  # the CSV line that names each image first (for error messages)
    row_image, captions = [], []
    for line, row in enumerate(rows, start=2):
        if not row.get("image") or not row.get("caption"):
            raise DataError(f"{path}, line {line}: empty 'image' or 'caption'")
        key = row["image_id"] if keyed and row.get("image_id") else row["image"]
        if key not in index:
            index[key] = len(files)
            files.append(path.parent / row["image"])
            first_line.append(line)
        row_image.append(index[key])
        captions.append(row["caption"])
    if len(files) < 2:
        raise DataError(f"{path}: the captions describe {len(files)} image(s); a 70/30 split by image needs at least 2")
    decoded = []
    for f, line in _progress(list(zip(files, first_line)), f"decoding {path.name}"):
        try:
            decoded.append(_decode(f, channels, size))
        except DataError as err:
            raise DataError(f"{path}, line {line}: {err}") from None
    images = torch.stack(decoded)
    from sklearn.model_selection import train_test_split

    train, test = train_test_split(torch.arange(len(files)).numpy(), test_size=TEST_FRACTION, random_state=seed)
    return Data("csv", images, torch.as_tensor(train).sort().values, torch.as_tensor(test).sort().values,
                paths=[str(f) for f in files], captions=captions, row_image=torch.tensor(row_image, dtype=torch.int64))


def _progress(items: list[Any], desc: str) -> Any:
    """A progress bar over ``items`` (shown on a terminal only, and only for a few hundred or more)."""
    from tqdm import tqdm

    return tqdm(items, desc=desc, leave=False, disable=None if len(items) >= 200 else True)


def _stratified_split(labels: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    from sklearn.model_selection import train_test_split

    n, classes = len(labels), int(labels.unique().numel())
    test = math.ceil(TEST_FRACTION * n)  # scikit-learn's rounding: each side must hold one image of every class
    if test < classes or n - test < classes:
        raise DataError(f"--data: a stratified 70/30 split of {n} images needs one image of each of the {classes} classes on "
                        f"both sides ({test} test and {n - test} training images here); add images, at least "
                        f"{_fewest_images(classes)} in all")
    idx = torch.arange(n).numpy()
    train, test = train_test_split(idx, test_size=TEST_FRACTION, random_state=seed, stratify=labels.numpy())
    return torch.as_tensor(train), torch.as_tensor(test)


def _fewest_images(classes: int) -> int:
    """The fewest images whose 70/30 split holds ``classes`` images on each side."""
    n = 2 * classes
    while math.ceil(TEST_FRACTION * n) < classes or n - math.ceil(TEST_FRACTION * n) < classes:
        n += 1
    return n
