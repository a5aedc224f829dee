"""A rank's output passed on to its launcher in whole lines: the part of rank_watch.py between
a rank's command and the launcher.

Launchers pass a rank's output on in the chunks they read, and a program may write a line in
pieces: unbuffered Python (``PYTHONUNBUFFERED=1``, the default of many container images) writes
each piece of a ``print`` on its own. Open MPI's ``--tag-output`` (which `hpdl run` passes, as
horovodrun does) tags every chunk, not every line, so such a line came out as
``[1,0]<stdout>:a[1,0]<stdout>: [1,0]<stdout>:1``, with the other ranks' pieces in between; ranks
sharing one stream without tags (torchrun's, on a terminal) interleave their pieces too.

So the watch gives the command pipes of its own, a pseudo-terminal where its own stream is a
terminal (the command then sees a terminal as before: Python line-buffers it, progress bars
draw), and writes what comes out in writes that end at a line's end (``\\n``, or the ``\\r``
with which a progress bar redraws its line, the bar then one redraw behind), each at most
``CHUNK`` bytes: what Open MPI reads at once, and what a pipe writes at once without mixing it
with another writer's bytes. A partial line goes on once it has waited ``HOLD_S`` (a prompt, a
line whose end is slow to come) or when the command ends; a line longer than ``CHUNK`` is cut.
When stdout and stderr are one file (``2>&1``, one terminal), both go through one channel, in
the order written. A burst faster than the launcher reads may still be cut where its reads end
(Open MPI reads a pseudo-terminal, whose writes reach the reader in pieces), as without hpdl.
"""

from __future__ import annotations

import fcntl
import os
import select
import subprocess
import termios
import time
from typing import Dict, List, Optional

__all__ = ["CHUNK", "HOLD_S", "LineRelay"]

CHUNK = 4096
# How long a partial line waits for its end before it goes on as it is.
HOLD_S = 1.0
# After the command ended: its output still in the pipes is read until they close, or until
# nothing came for DRAIN_QUIET_S (a process it left behind holds them), at most DRAIN_MAX_S.
DRAIN_QUIET_S = 0.25
DRAIN_MAX_S = 2.0
_READ = 65536
_POLL_S = 0.05  # how often the command's end is looked for where the kernel has no pidfd


def _line_end(data: bytes) -> int:
    """The length of ``data`` up to and including its last line end (0: none): a ``\\n``, or a
    ``\\r`` followed by more (a last ``\\r`` may be the start of ``\\r\\n``)."""
    return max(data.rfind(b"\n"), data.rfind(b"\r", 0, len(data) - 1)) + 1


class _Channel:
    """One output of the command: the end read here, the launcher's descriptor written to."""

    def __init__(self, read_fd: int, target_fd: int, terminal: bool) -> None:
        self.read_fd, self.target_fd, self.terminal = read_fd, target_fd, terminal
        self.pending = bytearray()  # a partial line
        self.since: Optional[float] = None  # when its first byte came
        self.open = True
        self.broken = False  # the launcher's end is gone: what comes is dropped

    def read(self, now: float) -> bool:
        """Read what is there and pass its whole lines on; return whether anything came."""
        try:
            data = os.read(self.read_fd, _READ)
        except OSError:  # EIO: a pseudo-terminal's every writer has closed it
            data = b""
        if not data:
            self.close()
            return False
        had = len(self.pending)
        self.pending += data
        end = _line_end(self.pending)
        if len(self.pending) - end >= CHUNK:  # a line too long for one chunk: its head goes now
            end = len(self.pending) - (len(self.pending) - end) % CHUNK
        if end:
            self._write(bytes(self.pending[:end]))
            del self.pending[:end]
        if not self.pending:
            self.since = None
        elif end >= had or self.since is None:  # what waits now came with this read
            self.since = now
        return True

    def deadline(self) -> Optional[float]:
        return self.since + HOLD_S if self.since is not None else None

    def release_held(self, now: float) -> None:
        """Pass on a partial line that has waited long enough."""
        if self.since is not None and now - self.since >= HOLD_S:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self._write(bytes(self.pending))
            self.pending.clear()
        self.since = None

    def close(self) -> None:
        self.flush()
        if self.open:
            self.open = False
            os.close(self.read_fd)

    def _write(self, data: bytes) -> None:
        """Write ``data`` (whole lines, but for a partial line let go) in chunks ending at line ends."""
        while data and not self.broken:
            cut = len(data) if len(data) <= CHUNK else (_line_end(data[:CHUNK]) or CHUNK)
            piece, data = memoryview(data[:cut]), data[cut:]
            try:
                while piece:
                    try:
                        piece = piece[os.write(self.target_fd, piece):]
                    except BlockingIOError:  # a launcher's non-blocking stream, full for now
                        select.select([], [self.target_fd], [])
            except OSError:  # EPIPE, EIO: no one reads the rank's output any more
                self.broken = True


class LineRelay:
    """The command's stdout and stderr, passed on to this process's in whole lines."""

    def __init__(self, channels: List[_Channel], child_ends: Dict[int, int]) -> None:
        self.channels = channels
        self.child_ends = child_ends  # this process's descriptor -> the command's end of its channel

    @classmethod
    def open(cls) -> Optional["LineRelay"]:
        """Make the channels for this process's stdout and stderr; None where they cannot be made
        (the command then writes to this process's streams itself, as without a relay)."""
        channels: List[_Channel] = []
        child_ends: Dict[int, int] = {}
        try:
            for fd in (1, 2):
                shared = fd == 2 and _same_file(1, 2) and 1 in child_ends
                if shared:
                    child_ends[2] = child_ends[1]
                    continue
                terminal = os.isatty(fd)
                read_fd, write_fd = _terminal_pair(fd) if terminal else os.pipe()
                channels.append(_Channel(read_fd, fd, terminal))
                child_ends[fd] = write_fd
        except OSError:
            for channel in channels:
                os.close(channel.read_fd)
            for write_fd in set(child_ends.values()):
                os.close(write_fd)
            return None
        return cls(channels, child_ends)

    @property
    def stdout(self) -> int:
        return self.child_ends[1]

    @property
    def stderr(self) -> int:
        return self.child_ends[2]

    def started(self) -> None:
        """Close this process's copies of the command's ends, once it has them (or failed to start)."""
        for write_fd in set(self.child_ends.values()):
            os.close(write_fd)
        self.child_ends = {}

    def resized(self) -> None:
        """Give the command's pseudo-terminals this process's terminal's new size (on SIGWINCH)."""
        for channel in self.channels:
            if channel.terminal and channel.open:
                _copy_size(channel.target_fd, channel.read_fd)

    def run(self, child: subprocess.Popen) -> int:
        """Pass the output on until the command has ended and its output is in; return its return code."""
        pidfd = _pidfd(child.pid)
        try:
            returncode = self._until_ended(child, pidfd)
        finally:
            if pidfd is not None:
                os.close(pidfd)
        self._drain()
        return returncode

    def _until_ended(self, child: subprocess.Popen, pidfd: Optional[int]) -> int:
        while True:
            returncode = child.poll()
            if returncode is not None:
                return returncode
            open_fds = [c.read_fd for c in self.channels if c.open]
            if not open_fds:  # it closed its output, and goes on
                return child.wait()
            deadlines = [d for d in (c.deadline() for c in self.channels) if d is not None]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            if pidfd is None:
                timeout = _POLL_S if timeout is None else min(timeout, _POLL_S)
            self._step(open_fds + ([pidfd] if pidfd is not None else []), timeout)

    def _drain(self) -> None:
        end = time.monotonic() + DRAIN_MAX_S
        quiet = time.monotonic() + DRAIN_QUIET_S
        while any(c.open for c in self.channels):
            now = time.monotonic()
            if now >= min(end, quiet):
                break
            if self._step([c.read_fd for c in self.channels if c.open], min(end, quiet) - now):
                quiet = time.monotonic() + DRAIN_QUIET_S
        for channel in self.channels:
            channel.close()

    def _step(self, fds: List[int], timeout: Optional[float]) -> bool:
        """Wait for output (or the command's end) up to ``timeout``; pass on what came and the
        partial lines that waited long enough; return whether any output came."""
        ready = set(select.select(fds, [], [], timeout)[0])
        now = time.monotonic()
        came = False
        for channel in self.channels:
            if channel.open and channel.read_fd in ready:
                came = channel.read(now) or came
            channel.release_held(now)
        return came


def _same_file(a: int, b: int) -> bool:
    try:
        return os.path.samestat(os.fstat(a), os.fstat(b))
    except OSError:
        return False


def _terminal_pair(fd: int) -> tuple:
    """A pseudo-terminal for the command where ``fd`` is a terminal: ``(master, slave)``.

    The slave gets ``fd``'s settings and size, but passes bytes on unchanged (no output
    processing): ``fd``'s own terminal turns them into what it shows, as when the command
    wrote to it directly.
    """
    master, slave = os.openpty()
    try:
        attributes = termios.tcgetattr(fd)
        attributes[1] &= ~termios.OPOST
        termios.tcsetattr(slave, termios.TCSANOW, attributes)
    except termios.error:
        pass
    _copy_size(fd, master)
    return master, slave


def _copy_size(source: int, target: int) -> None:
    try:
        fcntl.ioctl(target, termios.TIOCSWINSZ, fcntl.ioctl(source, termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        pass


def _pidfd(pid: int) -> Optional[int]:
    """A descriptor that becomes readable when ``pid`` ends (Linux 5.3), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
