"""Jobs that users get wrong, as user scripts (no harness around them): each ends the way a
real script would, so tests/test_bad_input.py can check exit codes, messages and leftovers.

Usage: bad_input_jobs.py CASE
  mismatch     every rank allreduces a tensor of another shape and does not catch the error
"""

from __future__ import annotations

import sys

import torch

import hpdl.torch as hvd


def mismatch() -> None:
    hvd.allreduce(torch.ones(2 + hvd.rank()), name="bad.shape")


CASES = {"mismatch": mismatch}


if __name__ == "__main__":
    hvd.init()
    CASES[sys.argv[1]]()
    hvd.shutdown()
