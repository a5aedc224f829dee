"""Atomic file writes: a temp file in the target's directory, renamed over the target.

A temp file is named ``.<target>.<pid>@<host>.<token>.tmp``. A writer killed mid-way (the job
is cancelled, the node fails) cannot remove its own, so every write first removes the ones its
directory holds from writers of this host that are no longer alive. The host and pid tell a
dead writer from one still writing (another rank on this node, or one on another node sharing
the file system, whose pid means nothing here). Earlier versions named them
``.<target>.<pid>.<token>.tmp``, without the host: such a file is removed only once its pid is
not alive here and it has not been written to for an hour, as its writer may live on another host.

The target's directory is resolved once it exists: ``missing/../x`` names ``x`` only after
``missing`` is created, so the checks a caller passes see the file the rename will replace.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import socket
import time
from pathlib import Path
from typing import BinaryIO, Callable, Optional, Union

# Host names cannot hold "@": the last "@" of a name ends the pid, whatever the target's name holds.
_TEMP_NAME = re.compile(r"\..+\.(?P<pid>\d+)@(?P<host>[^@]+)\.[0-9a-f]{8}\.tmp")
# The naming of earlier versions, without the host.
_HOSTLESS_TEMP_NAME = re.compile(r"\..+\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp")
# A hostless temp file untouched this long is taken as dead even if its pid is alive on another
# host: a live writer writes to it far more often.
HOSTLESS_TEMP_AGE = 3600.0


def atomic_write(
    path: Union[str, os.PathLike],
    write: Callable[[BinaryIO], None],
    *,
    fsync: bool = False,
    check_target: Optional[Callable[[str], None]] = None,
) -> Path:
    """Call ``write(f)`` on a temp file beside ``path``, then rename it over ``path``.

    Readers see the old file or the whole new one, never a partial one (a killed job, or two
    ranks writing the same cache entry). ``fsync`` also forces data and rename to disk, for
    files that must survive a machine crash (checkpoints). An ``OSError`` names ``path``, not
    the temp file. ``check_target(target)``, given the file the rename will replace (its
    directory resolved), may raise to refuse it: it runs once the directory exists and again
    right before the rename, so that neither a ``..`` after a missing directory nor a file put
    there during the write slips past the caller's checks.
    """
    path = Path(path)
    _make_parent(path)
    # Every later step uses the resolved directory: the temp file, the checks and the rename
    # all name the same file, however `path` spells it.
    target = Path(os.path.realpath(path.parent)) / path.name
    if check_target is not None:
        check_target(str(target))
    remove_stale_temp_files(target.parent)
    tmp = _temp_path(target)
    try:
        # Not mkstemp: that makes the file 0600, while mode 0666 lets the umask decide, as open() does.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(path)) from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        if check_target is not None:
            check_target(str(target))
        os.replace(tmp, target)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        # Only the system's errors (with an errno) are the file's; an OSError the writer raised
        # itself (Pillow's "cannot write mode RGB as XBM") keeps its own message.
        if isinstance(err, OSError) and err.errno is not None and err.filename in (str(tmp), str(target), None):
            raise OSError(err.errno, err.strerror, str(path)) from None
        raise
    if fsync:
        try:  # persist the rename too; directories cannot be opened on every platform
            dir_fd = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError:
            pass
    return path


def remove_stale_temp_files(directory: Union[str, os.PathLike]) -> int:
    """Remove the temp files in ``directory`` left by writers of this host that have died.

    Returns how many were removed. Temp files of live writers and of other hosts are kept; so
    are those of the earlier, hostless naming until they are an hour old.
    """
    removed = 0
    try:
        entries = [e.name for e in os.scandir(directory) if e.name.startswith(".") and e.name.endswith(".tmp")]
    except OSError:
        return 0
    host = socket.gethostname()
    for name in entries:
        if not _stale(os.path.join(directory, name), host):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed += 1
        except FileNotFoundError:
            pass  # another writer removed it first
    return removed


def _stale(path: str, host: str) -> bool:
    name = os.path.basename(path)
    # The current naming first: a host name holding ".<digits>" also fits the hostless pattern.
    match = _TEMP_NAME.fullmatch(name)
    if match is not None:
        return match["host"] == host and not _alive(int(match["pid"]))
    match = _HOSTLESS_TEMP_NAME.fullmatch(name)
    if match is None or _alive(int(match["pid"])):
        return False
    try:
        return time.time() - os.stat(path).st_mtime > HOSTLESS_TEMP_AGE
    except OSError:  # removed meanwhile
        return False


def _temp_path(path: Path, pid: Optional[int] = None) -> Path:
    pid = os.getpid() if pid is None else pid
    return path.parent / f".{path.name}.{pid}@{socket.gethostname()}.{secrets.token_hex(4)}.tmp"


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, under another user
        return True
    return True


def _make_parent(path: Path) -> None:
    try:
        make_directories(path.parent)
    except OSError as err:  # named by the target the caller asked for
        raise OSError(err.errno, err.strerror, str(path)) from None


def make_directories(directory: Union[str, os.PathLike]) -> None:
    """Create ``directory`` and its missing parents, for outputs (nothing when it exists).

    Raises:
        NotADirectoryError: when a file is where a directory must be, naming it:
            ``<file> is a file, not a directory`` (the system says "File exists" or "Not a
            directory", naming neither).
        OSError: the system's other refusals (permissions, a read-only file system).
    """
    try:
        os.makedirs(directory, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = blocking_file(directory)
        if blocker is None:
            raise
        raise NotADirectoryError(errno.ENOTDIR, not_a_directory(blocker), str(directory)) from None


def blocking_file(directory: Union[str, os.PathLike]) -> Optional[str]:
    """The nearest existing one of ``directory`` and its ancestors when it is not a directory
    (so ``directory`` can never be made), else None."""
    directory = os.path.abspath(directory)
    while True:
        if os.path.exists(directory):
            return None if os.path.isdir(directory) else directory
        parent = os.path.dirname(directory)
        if parent == directory:
            return None
        directory = parent


def not_a_directory(blocker: Union[str, os.PathLike]) -> str:
    """How every error says that ``blocker``, a file, stands where a directory must be."""
    return f"{blocker} is a file, not a directory"
