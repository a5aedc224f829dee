"""hvd.init() and hvd.init(comm=[ranks]) run again and again: a job on some of the launched
ranks (the others are refused, naming their rank), and init/shutdown cycles that give back
every communicator, socket and thread they took (each cycle used to keep three of MPI's
communicators, which ran out after some 680 cycles, and a gloo group's sockets under torch).

Usage: init_subset.py {subset|whole} CYCLES. Rank 0 prints what the pytest wrapper checks.
"""

from __future__ import annotations

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import run_main

import hpdl.torch as hvd
from hpdl.comm import discover_topology


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def main() -> None:
    mode, cycles = sys.argv[1], int(sys.argv[2])
    launched = discover_topology()
    members = [0, launched.size - 1]  # with 3 ranks launched, rank 1 is left out
    taken = None
    for cycle in range(1 + cycles):
        try:
            hvd.init(comm=members if mode == "subset" else None)
        except ValueError as err:
            assert launched.rank not in members and f"rank {launched.rank} is not in the ranks given" in str(err), err
            continue
        expected = (2, members.index(launched.rank)) if mode == "subset" else (launched.size, launched.rank)
        assert (hvd.size(), hvd.rank()) == expected, ((hvd.size(), hvd.rank()), expected)
        if cycle == 0:
            total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, name="cycle.sum")
            assert total.item() == float(sum(range(hvd.size()))), total
        hvd.shutdown()
        if cycle == 0:  # what the first cycle set up for good (the MPI library, torch's default group)
            taken = (open_files(), threading.active_count())
    if taken is not None:
        now = (open_files(), threading.active_count())
        assert now[0] <= taken[0] + 2 and now[1] <= taken[1], f"{cycles} cycles took (files, threads) {taken} -> {now}"
    if launched.rank == 0:
        print(f"OK init {mode}: launched={launched.size} members={members} cycles={cycles}", flush=True)


if __name__ == "__main__":
    run_main(main)
