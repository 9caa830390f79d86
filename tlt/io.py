"""Atomic file writes: write a temporary file beside the target, fsync, then rename over it, so a
reader (or a crash) sees the old file or the new one, never a torn one."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def umask() -> int:
    """The process's file-creation mask (os.umask can only be read by setting it, so it is set back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        # mkstemp makes the file private (0600); give it the permissions an ordinary open() would.
        os.chmod(tmp, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, data: Any) -> None:
    atomic_write_bytes(Path(path), (json.dumps(data, indent=2) + "\n").encode())


@contextlib.contextmanager
def atomic_folder(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a hidden temporary folder beside `final` to fill; when the block ends without error it is
    renamed to `final` (replacing a leftover of that name), otherwise removed. A crash at any moment
    leaves either no `final` or a complete one."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-"))
    try:
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it private; the result is an ordinary folder
        yield tmp
        if final.exists():  # e.g. a checkpoint of this step from a run that died before moving on
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
