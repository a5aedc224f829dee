"""hvd.init(comm=[ranks]): a job on some of the launched ranks (the others are refused, naming
their rank), and init/shutdown cycles on such a subset that give back every communicator they
made (each cycle used to keep three of MPI's, which runs out of them after some 680 cycles).

Usage: init_subset.py CYCLES. Rank 0 prints what the pytest wrapper checks.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import run_main

import hpdl.torch as hvd
from hpdl.comm import discover_topology


def main() -> None:
    cycles = int(sys.argv[1])
    launched = discover_topology()
    members = [0, launched.size - 1]  # with 3 ranks launched, rank 1 is left out
    for cycle in range(1 + cycles):
        try:
            hvd.init(comm=members)
        except ValueError as err:
            assert launched.rank not in members and f"rank {launched.rank} is not in the ranks given" in str(err), err
            continue
        assert hvd.size() == 2 and hvd.rank() == members.index(launched.rank), (hvd.size(), hvd.rank())
        if cycle == 0:
            total = hvd.allreduce(torch.tensor([float(launched.rank)]), op=hvd.Sum, name="subset.sum")
            assert total.item() == float(sum(members)), total
        hvd.shutdown()
    if launched.rank == 0:
        print(f"OK init subset: launched={launched.size} members={members} cycles={cycles}", flush=True)


if __name__ == "__main__":
    run_main(main)
