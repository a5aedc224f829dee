"""The two costs no engine with a background thread can avoid, measured on this machine.

1. A hand-off round trip between two Python threads with the engine's own primitives (a
   request appended to a deque, the thread woken through a bare lock, the caller woken through
   the request's lock): what a synchronous call through the engine pays at least once.
2. The latency of a 32-byte MPI allreduce, the size of the engine's control round.

Usage (docs/perf-notes/allreduce.md quotes the figures):
    python scripts/measure_handoff.py                  # one process: the other core idles
    mpiexec -n 2 python scripts/measure_handoff.py     # two at once, plus the MPI round
"""

from __future__ import annotations

import _thread
import collections
import statistics
import threading
import time

ROUNDS = 2000


def _percentiles(samples):
    samples = sorted(samples)
    n = len(samples)
    return statistics.median(samples) * 1e6, samples[n // 10] * 1e6, samples[9 * n // 10] * 1e6


def handoff_round_trips(rounds: int = ROUNDS):
    queue: collections.deque = collections.deque()
    wake = _thread.allocate_lock()
    wake.acquire()

    def worker() -> None:
        while True:
            wake.acquire()
            while queue:
                done = queue.popleft()
                if done is None:
                    return
                done.release()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()

    def one() -> None:
        done = _thread.allocate_lock()
        done.acquire()
        queue.append(done)
        if wake.locked():
            try:
                wake.release()
            except RuntimeError:  # released by a racing call already
                pass
        done.acquire()

    for _ in range(rounds // 10):
        one()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        one()
        samples.append(time.perf_counter() - start)
    queue.append(None)
    if wake.locked():
        wake.release()
    thread.join()
    return _percentiles(samples)


def tiny_allreduce(comm, rounds: int = 5 * ROUNDS):
    import numpy as np
    from mpi4py import MPI

    buffer = np.zeros(4, np.int64)
    for _ in range(rounds // 5):
        comm.Allreduce(MPI.IN_PLACE, buffer, MPI.SUM)
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buffer, MPI.SUM)
        samples.append(time.perf_counter() - start)
    return _percentiles(samples)


def main() -> None:
    comm = None
    try:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    except ImportError:
        pass
    size = comm.Get_size() if comm is not None else 1
    rank = comm.Get_rank() if comm is not None else 0
    handoff = handoff_round_trips()
    results = comm.gather(handoff, root=0) if comm is not None else [handoff]
    if rank == 0:
        for r, (median, p10, p90) in enumerate(results):
            print(f"rank {r} of {size}: thread hand-off round trip median {median:.1f} us "
                  f"(p10 {p10:.1f}, p90 {p90:.1f})")
    if comm is not None and size > 1:
        median, p10, p90 = tiny_allreduce(comm)
        if rank == 0:
            print(f"32-byte MPI allreduce on {size} ranks: median {median:.1f} us (p10 {p10:.1f}, p90 {p90:.1f})")


if __name__ == "__main__":
    main()
