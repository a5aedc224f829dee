"""Jobs that users get wrong, as user scripts (no harness around them): each ends the way a
real script would, so tests/test_bad_input.py can check exit codes, messages and leftovers.

Usage: bad_input_jobs.py CASE
  mismatch     every rank allreduces a tensor of another shape and does not catch the error
  world        print "rank R of S" after hvd.init()
  self-world   the same after hvd.init(comm=MPI.COMM_SELF), a user's own communicator
"""

from __future__ import annotations

import sys

import torch

import hpdl.torch as hvd


def mismatch() -> None:
    hvd.allreduce(torch.ones(2 + hvd.rank()), name="bad.shape")


def world() -> None:
    print(f"rank {hvd.rank()} of {hvd.size()}", flush=True)


CASES = {"mismatch": mismatch, "world": world, "self-world": world}


if __name__ == "__main__":
    if sys.argv[1] == "self-world":
        from mpi4py import MPI

        hvd.init(comm=MPI.COMM_SELF)
    else:
        hvd.init()
    CASES[sys.argv[1]]()
    hvd.shutdown()
