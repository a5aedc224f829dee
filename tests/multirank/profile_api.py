"""The profiler from code: start/stop, profile_step, a recording and a subscription across
shutdown()/init(), and the failure path (the engine failed: parts written, rank 0 merges).

Usage: profile_api.py {api|survive|abort|crash|term|late} FILE. Rank 0 prints what the pytest wrapper checks.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import run_main

import hpdl.torch as hvd
from hpdl.engine import events

mode, path = sys.argv[1], sys.argv[2]


def steps(count: int, prefix: str) -> None:
    for i in range(count):
        handles = [hvd.allreduce_async(torch.ones(1000 * (j + 1)), name=f"{prefix}.{j}") for j in range(3)]
        for h in handles:
            hvd.synchronize(h)
        hvd.profile_step()


def api() -> None:
    seen = []
    events.subscribe(seen.append)
    hvd.init()
    rank = hvd.rank()
    steps(1, "before")  # not recorded: no profile yet
    hvd.start_profile(path)
    steps(3, "grad")
    hvd.stop_profile()
    steps(1, "after")  # not recorded: stopped
    first_engine = len(seen)
    hvd.shutdown()
    hvd.init()  # a new engine delivers to the same subscriber
    steps(1, "again")
    hvd.shutdown()
    events.unsubscribe(seen.append)
    if rank == 0:
        again = [e for e in seen[first_engine:] if e.phase == events.COLLECTIVE]
        print(f"SUBSCRIBER second_engine_names={sorted({n for e in again for n in e.names})}")


def survive() -> None:
    # HPDL_PROFILE is set: each shutdown writes the recording so far; init() goes on with it.
    hvd.init()
    steps(2, "first")
    hvd.shutdown()
    hvd.init()
    steps(3, "second")
    hvd.shutdown()


def abort() -> None:
    # Rank 1 stops submitting: after HPDL_STALL_TIMEOUT every engine fails, so the gather at
    # shutdown is impossible and each rank writes its part; rank 0 merges them.
    hvd.init()
    hvd.start_profile(path)
    steps(2, "grad")
    try:
        if hvd.rank() == 1:
            for _ in range(600):
                time.sleep(0.05)
        else:
            steps(1, "stalled")
    except hvd.HorovodInternalError:
        print(f"RAISED rank={hvd.rank()}", flush=True)
    hvd.shutdown()


def crash() -> None:
    # Rank 1 dies from an uncaught exception while rank 0 waits in a collective: its exit must
    # not gather (rank 0 would never join), but write its part and let the job end.
    hvd.init()
    hvd.start_profile(path)
    steps(2, "grad")
    if hvd.rank() == 1:
        raise RuntimeError("rank 1 fails")
    steps(1, "waiting")


def term() -> None:
    # Rank 1 gets SIGTERM (as from a launcher ending the job, or a batch system's time limit)
    # while rank 0 waits in a collective: its part must be written, not lost with the process.
    import signal

    hvd.init()
    hvd.start_profile(path)
    steps(2, "grad")
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler ends the process here
    steps(1, "waiting")


def late() -> None:
    # Rank 1 reaches shutdown well after rank 0 has given up its gather (the deadline shortened
    # here): rank 0 writes the file without rank 1, whose part must join it afterwards.
    from hpdl.torch.profiler import session

    session.GATHER_DEADLINE_S = 1.0
    hvd.init()
    hvd.start_profile(path)
    steps(2, "grad")
    if hvd.rank() == 1:
        time.sleep(4)
    hvd.shutdown()


if mode in ("crash", "term"):
    {"crash": crash, "term": term}[mode]()  # not run_main, which would end the process before the exception hooks see it
else:
    run_main({"api": api, "survive": survive, "abort": abort, "late": late}[mode])
