"""A job's processes, found through Linux's ``/proc``, and their end: nothing left behind.

A launcher's ranks may sit in sessions and process groups of their own (torchrun's workers,
what a rank starts), so a group kill misses them; the parent links in ``/proc/PID/stat`` find
every descendant, and a mark in the environment (``NAME=value``, inherited by all a job
starts) finds those that outlived their parent. What runs jobs under a time limit uses this:
the GPU check (scripts/gpu_check.py) and the test harness (tests/ranks.py). Where ``/proc`` is
missing nothing is found.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Dict, Iterable, List

__all__ = ["alive", "descendants", "end_processes", "end_tree", "kill_tree", "processes_with_env"]

_POLL_S = 0.1


def _stat_fields(pid: int) -> List[str]:
    """The fields of ``/proc/PID/stat`` after the command name: state, parent, ..."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold anything


def _pids() -> List[int]:
    try:
        return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    """Return whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return _stat_fields(pid)[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def descendants(pid: int) -> List[int]:
    """Return every process below ``pid``: its children, theirs, and so on."""
    children: Dict[int, List[int]] = {}
    for child in _pids():
        try:
            parent = int(_stat_fields(child)[1])
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def processes_with_env(entry: str) -> List[int]:
    """Return the live processes (but this one) whose environment holds ``entry`` (``"NAME=value"``).

    A process shows its parent's environment until it has exec'd its own program.
    """
    needle = entry.encode()
    found = []
    for pid in _pids():
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0") and alive(pid):
                    found.append(pid)
        except OSError:  # ended meanwhile, or another user's
            continue
    return found


def _signal_each(pids: Iterable[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except OSError:  # gone already
            pass


def kill_tree(pid: int) -> None:
    """Kill ``pid`` and all its descendants at once (SIGKILL)."""
    # Parents before their children (descendants() lists them so): a parent killed after its
    # child could see that child end and exit on its own first (status 0, seen in CI).
    _signal_each([pid] + descendants(pid), signal.SIGKILL)


def end_processes(pids: List[int], grace_s: float = 5.0) -> None:
    """End ``pids``: SIGTERM, and SIGKILL to those still alive ``grace_s`` later."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        _signal_each([pid for pid in pids if alive(pid)], signum)  # not a pid reaped and reused since
        deadline = time.monotonic() + grace_s
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(_POLL_S)


def end_tree(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """End ``proc`` and everything below it: SIGTERM, then SIGKILL ``grace_s`` later to what is left.

    The descendants are looked for again before the SIGKILL: a process may start others while
    it ends.
    """
    victims = descendants(proc.pid)
    for signum in (signal.SIGTERM, signal.SIGKILL):
        _signal_each([proc.pid] + victims, signum)
        try:
            proc.wait(timeout=grace_s)
            if not any(alive(pid) for pid in victims):
                return
        except subprocess.TimeoutExpired:
            pass
        victims += [pid for pid in descendants(proc.pid) if pid not in victims]
