"""Run an `hpdl` command in the test's own process, as its command line runs in one of its own.

A process of its own spends seconds on imports before any work (torch, and the compiler
machinery that torch.optim's constructors import); the sr tests start dozens of tiny one-rank
runs. A command that must be killed, or must meet a lock held by another process, or runs
several ranks, still runs in a process of its own.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import traceback
from typing import Sequence

import torch

import hpdl.torch as hvd
from hpdl.cli import main


def run_hpdl(argv: Sequence[str]) -> subprocess.CompletedProcess:
    """`hpdl ARGV` here: its exit status and what it wrote, as ``subprocess.run`` returns them.

    An exception that escapes the command ends it as it would end the process: its traceback
    on stderr, exit status 1. The job of one rank it joins ends with it (hvd.shutdown()), and
    the threads it set for torch are given back, so that the next command and test start as in
    a fresh process.
    """
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
            except Exception:  # noqa: BLE001 - as the interpreter reports it at the top level
                traceback.print_exc()
                code = 1
    finally:
        hvd.shutdown()
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["hpdl", *argv], code, out.getvalue(), err.getvalue())
