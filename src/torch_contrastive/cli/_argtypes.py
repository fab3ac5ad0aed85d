"""argparse ``type=`` converters shared by the command-line subcommands.

Each raises ``argparse.ArgumentTypeError`` with a message saying what was expected, so
argparse reports ``error: argument --x: expected ...`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import math


def int_list(text: str) -> list[int]:
    """Comma-separated integers, e.g. ``0,1,0,1``."""
    try:
        values = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 0,1,0,1; got {text!r}") from None
    big = [v for v in values if not -(2**63) <= v < 2**63]
    if big:  # a label tensor is int64
        raise argparse.ArgumentTypeError(f"expected integers within int64 (|value| < 2**63); got {big[0]}")
    return values


def batch_sizes(text: str) -> list[int]:
    """Comma-separated even integers >= 2 (batch sizes: the NT-Xent cases take 2N rows)."""
    expected = "comma-separated even batch sizes >= 2 such as 1024,4096"
    try:
        values = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}; got {text!r}") from None
    if not values or any(v < 2 or v % 2 for v in values):
        raise argparse.ArgumentTypeError(f"expected {expected}; got {text!r}")
    return values


def _int_from(text: str, low: int, expected: str) -> int:
    """An integer >= ``low``; else argparse's error saying what was ``expected``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_from(text, 1, "a positive integer")


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def unit_fraction(text: str) -> float:
    """A number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (a random seed)."""
    return _int_from(text, 0, "an integer >= 0")


def finite_float(text: str) -> float:
    """Any finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def batch_size(text: str) -> int:
    """An integer >= 2: a contrastive batch needs at least two images."""
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"expected at least 2 (a contrastive batch needs negatives), got {text!r}")
    return value
