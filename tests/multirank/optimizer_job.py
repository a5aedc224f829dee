"""The optimizer checks of one layout in one job, for one start-up of its ranks: every scenario
of optimizer_equivalence.py (then the overlap ones under a 16-byte priority window), every check
of optimizer_behaviour.py, and last optimizer_overlap_end.py with the model and optimizer kept,
whose end is a shutdown while a rank still has gradients to submit. Each part inits and shuts
hpdl down itself and prints its own lines; a failing part ends the job.

Usage: optimizer_job.py (no arguments).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import optimizer_behaviour
import optimizer_equivalence
import optimizer_overlap_end
from _common import run_main


def main() -> None:
    optimizer_equivalence.main(["--priority-window", "16"])
    optimizer_behaviour.main([])
    optimizer_overlap_end.main(["kept"])


if __name__ == "__main__":
    run_main(main)
