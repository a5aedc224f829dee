"""The jobs a benchmark driver starts (`hpdl bench scaling`, `hpdl bench spatial`): each an
`hpdl run` command whose rank 0 prints one JSON record on stdout.

A job has a time limit; a job that outlives it, or whose driver is stopped meanwhile (Ctrl-C,
SIGTERM, SIGHUP), is ended with its ranks before the error goes on, so that no rank outlives
its driver. A job that fails is reported in one line: the last line of its stderr, else the
exit string MPICH's banner prints when a rank dies without a word. Lines of the job's stderr
that start with :data:`PROGRESS` are handed to the driver as they come, for a progress line of
its own on long jobs. And the plots' file format, which drivers check before their first job.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

# The longest --timeout: a year, as for hpdl's other times.
MAX_TIMEOUT_S = 365 * 24 * 3600.0
# From SIGTERM to SIGKILL when ending a job: time for the launcher to end its ranks.
KILL_AFTER_S = 10.0
# A job's stderr line starting with this is progress, handed to the driver as it comes.
PROGRESS = "hpdl-progress: "


class JobError(RuntimeError):
    """A job failed or timed out; the message names it and says why, in one line. ``returncode``,
    ``stdout`` and ``stderr`` are the job's (None where it did not end by itself)."""

    def __init__(self, message: str, returncode: Optional[int] = None, stdout: str = "", stderr: str = ""):
        super().__init__(message)
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


class Stopped(Exception):
    """The study was stopped by a signal (Ctrl-C, SIGTERM) after its running job was ended.

    ``record`` holds what the jobs that ended before measured; ``signum`` is the signal.
    """

    def __init__(self, signum: int, record: Dict[str, Any]):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum, self.record = signum, record


class Terminated(BaseException):
    """Raised in the driver by SIGTERM or SIGHUP, like KeyboardInterrupt by SIGINT."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def check_timeout(timeout_s: float) -> None:
    """Refuse a --timeout no job can have (ValueError, naming it)."""
    if not (math.isfinite(timeout_s) and 0 < timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"--timeout takes seconds above 0 and at most {MAX_TIMEOUT_S:.0f} (a year), got {timeout_s:g}")


@contextlib.contextmanager
def signals_stop_the_driver() -> Iterator[None]:
    """Within the block, SIGTERM (kill, a batch system's time limit) and SIGHUP (the terminal
    closed) raise :class:`Terminated` in the driver, as Ctrl-C raises KeyboardInterrupt, so that
    the running job is ended; by default they would leave it running without its driver."""
    def terminate(signum: int, _frame) -> None:
        raise Terminated(signum)

    handlers = ({s: signal.signal(s, terminate) for s in (signal.SIGTERM, signal.SIGHUP)}
                if threading.current_thread() is threading.main_thread() else {})
    try:
        yield
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def stops_keep_the_record(error: type, stopped: type, record: Callable[..., Dict[str, Any]]) -> Iterator[None]:
    """A driver's jobs under ``signals_stop_the_driver``; whatever ends them early keeps the
    record of the runs done: ``error`` (a job failed) gets it as ``.record``, and SIGINT or a
    terminating signal raises ``stopped(signum, record)``. ``record(failure=...)`` makes it."""
    try:
        with signals_stop_the_driver():
            yield
    except error as err:
        err.record = record(failure=str(err))
        raise
    except KeyboardInterrupt:
        raise stopped(signal.SIGINT, record(failure="stopped by SIGINT")) from None
    except Terminated as stop:
        name = signal.Signals(stop.signum).name
        raise stopped(stop.signum, record(failure=f"stopped by {name}")) from None


def run_job(argv: Sequence[str], env: Dict[str, str], timeout_s: float, what: str,
            progress: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Run one job; return the JSON record its rank 0 printed.

    Args:
        what: the job in words, for messages ("the default job on 2 rank(s)").
        progress: called with each :data:`PROGRESS` line of the job's stderr (without the
            prefix) as it comes.

    Raises:
        JobError: it could not start, failed, outlived ``timeout_s`` or printed no record.
    """
    try:
        proc = subprocess.Popen(list(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as err:
        raise JobError(f"cannot start {what}: {err.strerror or err}") from None
    try:
        stdout, stderr = _wait(proc, timeout_s, progress)
    except subprocess.TimeoutExpired:
        end_job(proc)
        raise JobError(f"{what} did not end within {timeout_s:g} s (--timeout)") from None
    except BaseException:  # Ctrl-C or SIGTERM: the job must not outlive the driver
        end_job(proc)
        raise
    if proc.returncode != 0:
        raise JobError(f"{what} failed (exit {proc.returncode}): {reason(stdout, stderr)}", proc.returncode,
                       stdout, stderr)
    start = stdout.find("{")
    try:
        return json.loads(stdout[start:]) if start >= 0 else json.loads(stdout)
    except ValueError:
        raise JobError(f"{what} printed no record: {reason(stdout, stderr)}", proc.returncode, stdout,
                       stderr) from None


def _wait(proc: subprocess.Popen, timeout_s: float,
          progress: Optional[Callable[[str], None]] = None) -> Tuple[str, str]:
    """``proc.communicate(timeout=timeout_s)``, also for timeouts beyond what one wait takes
    (poll() refuses more than about 24 days); with ``progress``, stderr is read line by line."""
    if progress is not None:
        return _wait_relaying(proc, timeout_s, progress)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            return proc.communicate(timeout=max(0.0, min(left, 3600.0)))
        except subprocess.TimeoutExpired:
            if left <= 3600.0:
                raise


def _wait_relaying(proc: subprocess.Popen, timeout_s: float, progress: Callable[[str], None]) -> Tuple[str, str]:
    """Wait, reading stdout and stderr on threads; hand each progress line to ``progress`` (on
    this thread, so that a failing callback or a signal lands in the driver)."""
    out: List[str] = []
    err: List[str] = []
    lines: List[str] = []
    lock = threading.Lock()

    def read(stream, into: List[str], relay: bool) -> None:
        for line in stream:
            into.append(line)
            if relay and line.startswith(PROGRESS):
                with lock:
                    lines.append(line[len(PROGRESS):].rstrip("\n"))

    readers = [threading.Thread(target=read, args=(proc.stdout, out, False), daemon=True),
               threading.Thread(target=read, args=(proc.stderr, err, True), daemon=True)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout_s
    while True:
        with lock:
            pending, lines[:] = list(lines), []
        for line in pending:
            progress(line)
        if proc.poll() is not None and not any(r.is_alive() for r in readers):
            break
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
        time.sleep(0.1)
    proc.wait()
    return "".join(out), "".join(line for line in err if not line.startswith(PROGRESS))


def end_job(proc: subprocess.Popen) -> None:
    """End a job: SIGTERM to its launcher, which ends the ranks, then SIGKILL if it lingers."""
    try:
        proc.terminate()
        try:
            proc.communicate(timeout=KILL_AFTER_S)
        except (subprocess.TimeoutExpired, ValueError):  # ValueError: its pipes are being read elsewhere
            try:
                proc.wait(timeout=KILL_AFTER_S)
            except subprocess.TimeoutExpired:
                pass
    finally:  # a second Ctrl-C while waiting still leaves no launcher behind
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def reason(stdout: str, stderr: str) -> str:
    """Why a job failed, in one line: the last line of its stderr, else the exit string
    MPICH's banner prints on stdout when a rank dies (killed, say) without a word."""
    def meaningful(text: str) -> List[str]:
        return [line.strip() for line in text.splitlines() if line.strip().strip("=").strip()]

    errors = meaningful(stderr)
    if errors:
        return errors[-1]
    marker = "TERMINATED WITH THE EXIT STRING:"
    exits = [line.split(marker, 1)[1].strip() for line in meaningful(stdout) if marker in line]
    return f"a rank ended: {exits[-1]}" if exits else "no message"


def plot_format(path: str, option: str = "--plot") -> str:
    """The image format of the plot file ``path``: its extension's, PNG without one.

    Raises:
        ValueError: naming the option and the file, when matplotlib writes no such format.
    """
    from matplotlib.figure import Figure

    extension = os.path.splitext(path)[1][1:].lower()
    formats = Figure().canvas.get_supported_filetypes()
    if extension and extension not in formats:
        raise ValueError(f"{option} {path}: matplotlib writes no .{extension} files; use one of "
                         f"{', '.join('.' + f for f in sorted(formats))}")
    return extension or "png"
