"""Failures never hang: mismatched requests, a rank that stops submitting, a rank that dies.

Usage: engine_failures.py {mismatch|stall|cross|kill}. Each rank prints one line per expected
outcome ("RAISED <what>: <message>") that the pytest wrapper checks. ``stall`` needs
STALL_MARKS, a directory where the stalled rank leaves a mark once it has reported.
"""

from __future__ import annotations

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import run_main

import hpdl.torch as hvd
from hpdl.engine import abort


def expect_error(what, fn):
    try:
        fn()
    except hvd.HorovodInternalError as err:
        message = " ".join(str(err).split())
        print(f"RAISED {what} rank={hvd.rank()}: {message}", flush=True)
        return message
    raise AssertionError(f"{what}: no HorovodInternalError on rank {hvd.rank()}")


def mismatch():
    rank = hvd.rank()
    expect_error("shape", lambda: hvd.allreduce(torch.ones(2 + rank), name="shape.t"))
    expect_error("dtype", lambda: hvd.allreduce(torch.ones(2, dtype=torch.float32 if rank == 0 else torch.float64),
                                                name="dtype.t"))
    expect_error("root", lambda: hvd.broadcast(torch.ones(2), root_rank=rank, name="root.t"))
    expect_error("op", lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum if rank == 0 else hvd.Max, name="op.t"))
    # Groups whose size differs between ranks (the first rank's larger, then smaller): every
    # member fails on every rank at once, and none is left waiting (a retry under the same
    # name finds none in flight, and no stall ends the job later).
    for larger in (0, 1):
        name = f"group.{larger}"
        expect_error(f"group{larger}", lambda: hvd.grouped_allreduce([torch.ones(1)] * (3 if rank == larger else 2),
                                                                     name=name))
        retried = hvd.grouped_allreduce([torch.ones(1)] * 3, name=name, op=hvd.Sum)
        assert [t.item() for t in retried] == [float(hvd.size())] * 3, retried
    # add_process_set naming other ranks on some rank: every rank raises at once (each used to
    # wait, until the stall timeout, for a request of its own name that no other rank made).
    expect_error("process_set", lambda: hvd.add_process_set([0] if rank == 0 else [1]))
    pair = hvd.add_process_set([0, 1])
    if rank in (0, 1):
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="pair", process_set=pair).item() == 2.0
    hvd.remove_process_set(pair)
    # The engine goes on working after such errors.
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after").tolist() == [float(hvd.size())] * 2
    print(f"CONTINUED rank={rank}", flush=True)


def stall():
    rank = hvd.rank()
    if rank == 1:
        # Stop submitting: the engine of every rank must give up after HPDL_STALL_TIMEOUT,
        # and this rank raises too (in its main thread).
        try:
            for _ in range(600):
                time.sleep(0.05)
        except hvd.HorovodInternalError as err:
            print(f"RAISED stall rank=1: {' '.join(str(err).split())}", flush=True)
            open(os.path.join(os.environ["STALL_MARKS"], "reported"), "w").close()
            return
        raise AssertionError("the stalled rank was never told")
    expect_error("stall", lambda: hvd.allreduce(torch.ones(3), name="stalled.tensor"))


def cross():
    rank = hvd.rank()
    # Not waits that can never end: rank 1 computes past the stall warning before it submits,
    # while the others wait for it.
    if rank == 1:
        time.sleep(3.0)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="late").item() == hvd.size()
    # Rank 0 waits for a collective the others never submit, and they for one it never submits:
    # every rank raises at the stall warning, not at the stall timeout.
    expect_error("cross", lambda: hvd.allreduce(torch.ones(1), name="cross.a" if rank == 0 else "cross.b"))


def kill():
    rank = hvd.rank()
    if rank == 1:
        hvd.allreduce(torch.ones(3), name="before")
        os.kill(os.getpid(), signal.SIGKILL)

    def before_and_after():
        # The failure may reach a survivor already in "before": rank 1 can have its result and
        # die while the last bytes it sends are still in its send queue (the reset drops them).
        hvd.allreduce(torch.ones(3), name="before")
        time.sleep(0.5)
        for i in range(1000):
            hvd.allreduce(torch.ones(1 << 16), name=f"after.{i}")

    expect_error("kill", before_and_after)


def main():
    hvd.init()
    {"mismatch": mismatch, "stall": stall, "cross": cross, "kill": kill}[sys.argv[1]]()
    print(f"DONE rank={hvd.rank()}", flush=True)
    if sys.argv[1] == "mismatch":
        hvd.shutdown()
    else:
        leave_after_the_failure(sys.argv[1])


def leave_after_the_failure(mode: str) -> None:
    """Leave without the collective shutdown (the engine has failed), but not before the
    stalled rank, told in the same round and then woken from its sleep, has reported: the
    launcher may kill the remaining ranks as soon as one leaves without finalizing. On a loaded
    machine that can take seconds, so its mark is waited for, as long as the job is left to
    live (hpdl aborts it ABORT_GRACE_S after the failure)."""
    if mode == "stall":
        mark = os.path.join(os.environ["STALL_MARKS"], "reported")
        deadline = time.monotonic() + max(0.0, abort.remaining() - 0.3)
        while not os.path.exists(mark) and time.monotonic() < deadline:
            time.sleep(0.02)
    else:
        time.sleep(1.0)
    os._exit(0)


if __name__ == "__main__":
    run_main(main)
