"""Where a rank's CPU time goes, thread by thread (Linux ``/proc``).

On a node whose cores the ranks' compute fills, every millisecond a communication thread runs
is taken from the compute. This counts, over a stretch of training, the CPU time of the
process's threads in three groups: the training thread (the one that takes the snapshots),
hpdl's own Python threads (the engine and its helpers, named ``hpdl-*``) and every other
thread of the process (the backend's: gloo's I/O and work threads, MPI's progress threads,
PyTorch's intra-op pool). It also takes the node's idle share over the same stretch, which
tells a step bound by the CPU (no idle time) from one waiting on the network.
"""

from __future__ import annotations

import os
import threading
from typing import Dict, Optional

GROUPS = ("training", "hpdl", "backend")
_TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 10.0


def _thread_ms(task: str) -> Optional[float]:
    """CPU ms of one thread so far (None if it ended meanwhile): the scheduler's nanosecond
    count where the kernel keeps it, else user + system clock ticks."""
    try:
        with open(f"/proc/self/task/{task}/schedstat") as f:
            return int(f.read().split()[0]) / 1e6
    except (OSError, IndexError, ValueError):
        pass
    try:
        with open(f"/proc/self/task/{task}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) * _TICK_MS


def _node_ticks() -> Optional[tuple]:
    """(idle, total) clock ticks of the whole node since boot."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return values[3] + (values[4] if len(values) > 4 else 0), sum(values[:8])


class CpuSnapshot:
    """CPU time of this process's threads by group, and the node's idle time, at one moment."""

    def __init__(self, threads: Dict[int, tuple], node: Optional[tuple]):
        self.threads = threads  # thread id -> (group, CPU ms so far)
        self.node = node

    @classmethod
    def take(cls) -> Optional["CpuSnapshot"]:
        """Now, as seen from the calling (training) thread; None where ``/proc`` is missing."""
        if not os.path.isdir("/proc/self/task"):
            return None
        me = threading.get_native_id()
        ours = {t.native_id for t in threading.enumerate()
                if t.name.startswith("hpdl") and t.native_id is not None}
        threads = {}
        for task in os.listdir("/proc/self/task"):
            spent = _thread_ms(task)
            if spent is None:
                continue
            tid = int(task)
            threads[tid] = ("training" if tid == me else "hpdl" if tid in ours else "backend", spent)
        return cls(threads, _node_ticks())

    def since(self, earlier: "CpuSnapshot") -> Dict[str, float]:
        """CPU ms per group from ``earlier`` to this one, and the node's idle share (0-1)."""
        # Thread by thread: one that ended in between takes all its time with it, so subtracting
        # group sums would take its earlier time off the threads still running.
        out = dict.fromkeys(GROUPS, 0.0)
        for tid, (group, spent) in self.threads.items():
            then = earlier.threads.get(tid)
            out[group] += max(0.0, spent - (then[1] if then is not None else 0.0))
        if self.node is not None and earlier.node is not None:
            idle, total = (now - then for now, then in zip(self.node, earlier.node))
            out["node_idle"] = idle / total if total > 0 else 0.0
        return out
