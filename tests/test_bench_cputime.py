"""The per-thread CPU accounting of ``hpdl bench synthetic --breakdown``."""

import os
import threading

import pytest

from hpdl.bench.cputime import GROUPS, CpuSnapshot

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")


def _work() -> None:
    total = 0
    for i in range(2_000_000):
        total += i


def test_cpu_time_is_charged_to_the_thread_that_spent_it():
    before = CpuSnapshot.take()
    # Threads that end take their time with them: keep each one alive until the second snapshot.
    done = threading.Event()
    started = []

    def work_then_wait():
        for _ in range(3 if threading.current_thread().name.startswith("hpdl") else 1):
            _work()
        started.append(1)
        done.wait()

    threads = [threading.Thread(target=work_then_wait, name=name) for name in ("hpdl-test", "backend-test")]
    for thread in threads:
        thread.start()
    while len(started) < 2:
        threading.Event().wait(0.01)
    _work()
    after = CpuSnapshot.take()
    done.set()
    for thread in threads:
        thread.join()
    spent = after.since(before)
    assert set(GROUPS) <= set(spent) and 0 <= spent["node_idle"] <= 1
    # Each group ran the loop (tens of ms of CPU), hpdl's thread three times: none is charged
    # for another's.
    for group in GROUPS:
        assert spent[group] > 10, spent
    assert spent["hpdl"] > 1.5 * max(spent["training"], spent["backend"]), spent


def test_nothing_is_charged_when_nothing_runs():
    before = CpuSnapshot.take()
    after = CpuSnapshot.take()
    spent = after.since(before)
    assert spent["hpdl"] < 5 and spent["backend"] < 5, spent


def test_a_thread_that_ends_between_snapshots_takes_none_of_the_others_time():
    # Its earlier time leaves the process's total with it: subtracting group sums charged the
    # backend threads still running less than they spent (CI saw 4 ms for a 100 ms loop).
    leave, worked, stay = threading.Event(), threading.Event(), threading.Event()

    def work_then_end():
        for _ in range(3):
            _work()
        worked.set()
        leave.wait()

    def work_then_stay():
        _work()
        worked.set()
        stay.wait()

    leaving = threading.Thread(target=work_then_end, name="backend-leaving", daemon=True)
    leaving.start()
    worked.wait()
    before = CpuSnapshot.take()
    leave.set()
    leaving.join()
    worked.clear()
    staying = threading.Thread(target=work_then_stay, name="backend-staying", daemon=True)
    staying.start()
    worked.wait()
    spent = CpuSnapshot.take().since(before)
    stay.set()
    staying.join()
    assert spent["backend"] > 10, spent
