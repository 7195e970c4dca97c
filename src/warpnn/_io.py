"""Atomic file writes for checkpoints: a crash leaves the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """Open a binary file that replaces ``path`` only when the ``with`` block succeeds.

    Writes go to a temporary file in the same folder (so the final rename never crosses file systems),
    which is flushed, fsynced and renamed over ``path`` with ``os.replace``; on error it is removed and
    ``path`` is untouched. The file gets the permissions of the file it replaces, or those the user's umask
    gives a new file (``open`` would give), not the owner-only 0600 of a temporary file. Works with writers that take a file, e.g.
    ``with warpnn.atomic_write("model.eqx") as f: eqx.tree_serialise_leaves(f, model)``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with contextlib.suppress(OSError, AttributeError):  # best effort: no os.fchmod on Windows
            os.fchmod(fd, _mode_for(path))
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (POSIX; not possible on Windows)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _mode_for(path: Path) -> int:
    """The permission bits ``path`` should get: those of the file it replaces, else 0o666 less the umask."""
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    # Reading the umask means setting it; /proc tells it without that (Linux >= 4.7), so other threads
    # creating files meanwhile never see a changed umask.
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write`)."""
    with atomic_write(path) as f:
        f.write(data)
