"""Jobs that users get wrong, as user scripts (no harness around them): each ends the way a
real script would, so tests/test_bad_input.py can check exit codes, messages and leftovers.

Usage: bad_input_jobs.py CASE
  mismatch     every rank allreduces a tensor of another shape and does not catch the error
  stall-c      rank 1 blocks in C code (os.read on an empty pipe) while the others allreduce
  stall-sleep  rank 1 sleeps 90 s in Python while the others allreduce
  stall-set    as stall-c, in a process set of ranks 0 and 1
  world        print "rank R of S" after hvd.init()
  self-world   the same after hvd.init(comm=MPI.COMM_SELF), a user's own communicator
"""

from __future__ import annotations

import os
import sys
import time

import torch

import hpdl.torch as hvd


def mismatch() -> None:
    hvd.allreduce(torch.ones(2 + hvd.rank()), name="bad.shape")


def stall(block, process_set=None) -> None:
    if hvd.rank() == 1:
        block()
    else:
        hvd.allreduce(torch.ones(3), name="stalled.tensor", process_set=process_set or hvd.global_process_set)
    print(f"rank {hvd.rank()} went on", flush=True)


def read_empty_pipe() -> None:
    read_end, _write_end = os.pipe()
    os.read(read_end, 1)


def world() -> None:
    print(f"rank {hvd.rank()} of {hvd.size()}", flush=True)


CASES = {
    "mismatch": mismatch,
    "world": world,
    "self-world": world,
    "stall-c": lambda: stall(read_empty_pipe),
    "stall-sleep": lambda: stall(lambda: time.sleep(90)),
    "stall-set": lambda: stall(read_empty_pipe, hvd.add_process_set([0, 1])),
}


if __name__ == "__main__":
    if sys.argv[1] == "self-world":
        from mpi4py import MPI

        hvd.init(comm=MPI.COMM_SELF)
    else:
        hvd.init()
    CASES[sys.argv[1]]()
    hvd.shutdown()
