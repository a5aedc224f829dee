"""A rank's note to :mod:`hpdl.launch.rank_watch`, its parent under `hpdl run`, that its end is its own.

rank_watch names a rank that ended with an exit code other than 0 only when the rank could not
say why itself. A rank that leaves through Python's own exit (``sys.exit``, an uncaught
exception after its traceback) or through hpdl's abort of a failed job (after its error line)
has said it; one ended by ``os._exit``, a signal or a crash in C code has not. So a process
importing hpdl writes its pid, at that exit, into the pipe that rank_watch passes down in
``HPDL_RANK_EXIT`` (the descriptor and the pipe's inode, so that a process that inherited the
variable but not the pipe, or holds another file at that number, writes nothing).

A process whose hpdl import started MPI also says so (``mpi:PID``): MPICH's mpiexec ends the
job itself when such a rank ends, and rank_watch need only end it for a rank that never did.
"""

from __future__ import annotations

import atexit
import os
from typing import Optional, Set, Tuple

ENV = "HPDL_RANK_EXIT"

_installed = False


def channel(fd: int) -> str:
    """The value of ``HPDL_RANK_EXIT`` that points a child at the pipe whose write end is ``fd``."""
    return f"{fd}:{os.fstat(fd).st_ino}"


def _pipe() -> Optional[int]:
    """The descriptor of the pipe rank_watch passed to this process, or None."""
    try:
        fd_text, inode_text = os.environ[ENV].split(":")
        fd = int(fd_text)
        return fd if os.fstat(fd).st_ino == int(inode_text) else None
    except (KeyError, ValueError, OSError):
        return None


def install() -> None:
    """Note this process's exit through Python, if rank_watch watches it (at ``import hpdl``)."""
    global _installed
    if not _installed and _pipe() is not None:
        _installed = True
        atexit.register(note)


_MPI = "mpi:"  # before the pid: a note that MPI started, not of the exit


def note() -> None:
    """Tell rank_watch that this process is ending on its own account, its reason said."""
    _write(f"{os.getpid()}\n")


def note_mpi_started() -> None:
    """Tell rank_watch that this process has started MPI (its launcher now counts it)."""
    _write(f"{_MPI}{os.getpid()}\n")


def _write(line: str) -> None:
    fd = _pipe()
    if fd is not None:
        try:
            os.write(fd, line.encode())
        except OSError:
            pass


def noted(read_fd: int) -> Tuple[Set[int], Set[int]]:
    """The pids that have noted their exit, and those that have noted starting MPI, in the pipe
    whose read end is ``read_fd`` (non-blocking)."""
    os.set_blocking(read_fd, False)
    data = b""
    while True:
        try:
            chunk = os.read(read_fd, 4096)
        except BlockingIOError:  # a descendant still holds the write end
            break
        if not chunk:
            break
        data += chunk
    words = data.decode(errors="replace").split()
    started = {int(word[len(_MPI):]) for word in words if word.startswith(_MPI) and word[len(_MPI):].isdigit()}
    return {int(word) for word in words if word.isdigit()}, started


def pipe() -> Tuple[int, int]:
    """A pipe for one child: the read end stays here, the write end is inherited."""
    read_fd, write_fd = os.pipe()
    os.set_inheritable(write_fd, True)
    return read_fd, write_fd
