"""How the wait for a non-blocking MPI allreduce shapes its time when a compute thread shares the
core: the blocking wait (it spins inside MPI), and polls with sleeps of several lengths.

Over TCP, MPI moves data only inside its calls: a blocking wait spins on a core that a busy
compute thread also wants, and a poll that sleeps too long lets the socket buffers run dry.
The engine polls allreduces in flight every 0.5 ms (hpdl/comm/mpi.py: POLL_INTERVAL_S).

Usage (docs/perf-notes/mpi-polling.md quotes the figures; two ranks, across emulated nodes for a real link):
    hpdl emulate --nodes 2 --rate 1gbit -- hpdl run -np 2 -- \\
        python scripts/measure_mpi_polling.py [--busy] [--size-kib 576] [--calls 15]
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

WAITS = [None, 5e-4, 1e-4, 2e-3]  # None: the blocking wait (MPI_Wait)


def allreduce_ms(comm, data: np.ndarray, poll_s: Optional[float]) -> float:
    """One allreduce started together on every rank, completed by ``poll_s`` sleeps between
    tests (or a blocking wait); its time in milliseconds."""
    comm.Barrier()
    started = time.perf_counter()
    request = comm.Iallreduce(MPI.IN_PLACE, data, op=MPI.SUM)
    if poll_s is None:
        request.Wait()
    else:
        while not request.Test():
            time.sleep(poll_s)
    return (time.perf_counter() - started) * 1e3


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", action="store_true", help="run a compute thread beside the waits, as training does")
    parser.add_argument("--size-kib", type=int, default=576, help="allreduce size (default: 576 KiB, float32)")
    parser.add_argument("--calls", type=int, default=15, help="allreduces per kind of wait (median reported)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    data = np.ones(args.size_kib * 1024 // 4, dtype=np.float32)
    stop = threading.Event()

    def compute() -> None:
        matrix = torch.randn(256, 256)
        while not stop.is_set():
            matrix = (matrix @ matrix).tanh_()

    worker = threading.Thread(target=compute, daemon=True) if args.busy else None
    if worker is not None:
        worker.start()
    try:
        for poll_s in WAITS:
            times = [allreduce_ms(comm, data, poll_s) for _ in range(args.calls)]
            if comm.rank == 0:
                wait = "blocking wait" if poll_s is None else f"polled every {poll_s * 1e3:g} ms"
                print(f"{args.size_kib} KiB allreduce, {'busy' if args.busy else 'idle'} core, {wait}: "
                      f"median {statistics.median(times):.2f} ms", flush=True)
    finally:
        stop.set()
        if worker is not None:
            worker.join()  # a thread still in torch at exit would abort the process
    comm.Barrier()


if __name__ == "__main__":
    main()
