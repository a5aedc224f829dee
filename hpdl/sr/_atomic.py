"""Atomic file writes: a temp file in the target's directory, renamed over the target."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import BinaryIO, Callable, Union


def atomic_write(
    path: Union[str, os.PathLike], write: Callable[[BinaryIO], None], *, fsync: bool = False
) -> Path:
    """Call ``write(f)`` on a temp file beside ``path``, then rename it over ``path``.

    Readers see the old file or the whole new one, never a partial one (a killed job, or two
    ranks writing the same cache entry). ``fsync`` also forces data and rename to disk, for
    files that must survive a machine crash (checkpoints).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp: that makes the file 0600, while mode 0666 lets the umask decide, as open() does.
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        try:  # persist the rename too; directories cannot be opened on every platform
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError:
            pass
    return path
