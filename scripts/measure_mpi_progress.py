"""How much one poll moves: a stream of non-blocking MPI allreduces kept in flight, polled every
P ms with K calls of ``MPI_Test`` per wake-up, beside a busy compute thread as in training.

Over TCP, MPI moves data only inside its calls, and MPICH over UCX moves about one 64 KiB
segment per call: one Test per wake-up caps the rate at 64 KiB per poll interval, however long
the interval. Several Tests per wake-up let the polls be rarer at the link's full rate. The
engine polls its allreduces in flight every 0.5 ms with one Test (hpdl/comm/mpi.py:
POLL_INTERVAL_S); docs/perf-notes/mpi-polling.md compares the two in training.

Usage (two ranks across emulated nodes, for a real link; docs/perf-notes/mpi-polling.md quotes the
figures):
    hpdl emulate --nodes 2 --rate 1gbit -- hpdl run -np 2 -- \\
        python scripts/measure_mpi_progress.py [--tests 1,8,32] [--polls-ms 0.5,1,2,4]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import List, Optional

import numpy as np
import torch
from mpi4py import MPI


def stream(comm, buffers: List[np.ndarray], count: int, poll_s: float, tests: int) -> tuple:
    """``count`` allreduces, ``len(buffers)`` in flight at a time, polled every ``poll_s`` with
    up to ``tests`` Tests per wake-up: (MB/s of allreduced data, this thread's CPU ms, wake-ups)."""
    comm.Barrier()
    started, cpu, wakes = time.perf_counter(), time.thread_time(), 0
    in_flight: List = []
    issued = 0
    while issued < count or in_flight:
        while len(in_flight) < len(buffers) and issued < count:
            in_flight.append(comm.Iallreduce(MPI.IN_PLACE, buffers[issued % len(buffers)], op=MPI.SUM))
            issued += 1
        for _ in range(tests):  # each Test drives MPI's progress for every request
            while in_flight and in_flight[0].Test():
                in_flight.pop(0)
            if not in_flight:
                break
        if in_flight:
            time.sleep(poll_s)
            wakes += 1
    seconds = time.perf_counter() - started
    return count * buffers[0].nbytes / seconds / 1e6, (time.thread_time() - cpu) * 1e3, wakes


def _positive_list(kind):
    """An argparse type: a comma-separated list of positive ``kind`` values."""
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",")]
        except ValueError:
            values = []
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected positive numbers separated by commas, got {text!r}")
        return values
    return parse


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=_positive_list(int), default=[1, 8, 32], help="Tests per wake-up to compare (default: 1,8,32)")
    parser.add_argument("--polls-ms", type=_positive_list(float), default=[0.5, 1, 2, 4], help="poll intervals to compare (default: 0.5,1,2,4)")
    parser.add_argument("--size-mb", type=float, default=2.4,
                        help="size of each allreduce, float32 (default: 2.4, an EDSR gradient)")
    parser.add_argument("--in-flight", type=int, default=3, help="allreduces in flight at a time (default: 3)")
    parser.add_argument("--count", type=int, default=40, help="allreduces per measurement (default: 40)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per setting, median shown (default: 3)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    buffers = [np.ones(int(args.size_mb * 1e6) // 4, dtype=np.float32) for _ in range(args.in_flight)]
    stop = threading.Event()

    def compute() -> None:
        matrix = torch.randn(256, 256)
        while not stop.is_set():
            matrix = (matrix @ matrix).tanh_()

    worker = threading.Thread(target=compute, daemon=True)
    worker.start()
    try:
        settings = [(tests, poll_ms) for tests in args.tests for poll_ms in args.polls_ms]
        results = {s: [] for s in settings}
        for _ in range(args.repeats):  # alternating, so that drift touches every setting alike
            for tests, poll_ms in settings:
                results[(tests, poll_ms)].append(stream(comm, buffers, args.count, poll_ms / 1e3, tests))
        if comm.rank == 0:
            print(f"# {args.count} allreduces of {args.size_mb:g} MB, {args.in_flight} in flight, a busy compute "
                  f"thread beside; median of {args.repeats}")
            print(f"{'tests':>5} {'poll ms':>7} {'MB/s':>7} {'CPU ms':>7} {'wake-ups':>8}")
            for (tests, poll_ms), rows in results.items():
                print(f"{tests:5d} {poll_ms:7g} {statistics.median(r[0] for r in rows):7.1f} "
                      f"{statistics.median(r[1] for r in rows):7.1f} {statistics.median(r[2] for r in rows):8.0f}",
                      flush=True)
    finally:
        stop.set()
        worker.join()  # a thread still in torch at exit would abort the process
    comm.Barrier()


if __name__ == "__main__":
    main()
