"""Where the subcommands write: checked before any data is loaded or any work is done, so a bad
``--out`` is one line and exit 2 rather than a traceback after minutes of work."""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["cannot_write", "save_figure", "save_npy", "write_atomically"]


def cannot_write(path: str | Path, flag: str, *, folder: bool) -> str | None:
    """Why ``path`` cannot be written (one line naming ``flag``), or None.

    ``folder``: the path is a folder to write into (created if missing); otherwise a file name
    (its folder created if missing). Refused: a file where a folder is expected (or the reverse),
    a path below a file, and a place where this process cannot create anything (probed with a
    temporary folder, removed again: nothing is left behind).
    """
    target = Path(path).expanduser()
    if target.exists():
        if folder and not target.is_dir():
            return f"{flag} {path} is a file; expected a folder"
        if not folder and target.is_dir():
            return f"{flag} {path} is a folder; expected a file name"
    existing = target if folder and target.is_dir() else target.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{flag} {path} lies below {existing}, which is a file"
    try:
        tempfile.TemporaryDirectory(dir=existing).cleanup()
    except OSError as err:
        return f"{flag} {path}: cannot write in {existing} ({err.strerror or err})"
    return None


def write_atomically(path: Path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` through a temporary file in its folder and ``os.replace``: a run folder only
    gains complete files (an interrupted write leaves the old file, or none, never a partial one)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_figure(fig: Any, path: Path) -> None:
    """A matplotlib figure as a PNG at ``path``, rendered in memory and written atomically."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    write_atomically(path, buffer.getvalue())


def save_npy(path: Path, array: Any) -> None:
    """``numpy.save`` of ``array`` at ``path``, written atomically."""
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array)
    write_atomically(path, buffer.getvalue())
