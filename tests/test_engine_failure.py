"""How one engine fails (hpdl/engine/failure.py), without a job: the order in which the end of
the job is armed and the failure is shown to callers."""

from engine_clocks import ManualClock
from hpdl.engine import abort, failure


class _Comm:
    rank = 0
    size = 1


def _failures(failed_requests):
    return failure.Failures(_Comm(), stall_timeout_s=60.0, clock=ManualClock(),
                            oldest_in_flight=lambda: None, waiting=lambda: True,
                            fail_requests=failed_requests.append)


def test_callers_see_the_failure_only_once_the_end_of_the_job_is_armed(monkeypatch):
    # A caller that submits after the failure raises at once and may exit right after: were the
    # failure visible before the end was armed, that exit was a normal one (status 0, or a wait
    # for a lost peer in MPI_Finalize).
    failed_requests, armed = [], []
    failures = _failures(failed_requests)
    monkeypatch.setattr(abort, "arm", lambda comm, rank, message, stalled: armed.append((message, failures.failure)))
    failures.fail("hpdl engine failed on rank 0: the launcher is ending the job (SIGTERM)", ended=True, log_it=False)
    assert armed == [("hpdl engine failed on rank 0: the launcher is ending the job (SIGTERM)", None)]
    assert failures.failure == "hpdl engine failed on rank 0: the launcher is ending the job (SIGTERM)"
    assert failed_requests == [failures.failure]


def test_the_first_failure_wins_and_arms_the_end_once(monkeypatch):
    failed_requests, armed = [], []
    failures = _failures(failed_requests)
    monkeypatch.setattr(abort, "arm", lambda comm, rank, message, stalled: armed.append(message))
    failures.fail("first", log_it=False)
    failures.fail("second", log_it=False)
    assert armed == ["first"] and failures.failure == "first" and failed_requests == ["first"]


def _where(armed):
    """An abort.arm that records the thread it runs on and that thread's nice value."""
    import os
    import threading

    def arm(comm, rank, message, stalled):
        me = threading.current_thread()
        armed.append((me.name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    return arm


def _on_a_lowered_thread(failures, work):
    """Run ``work`` on a thread at nice 19 that told ``failures`` so, as the engine thread does."""
    import os
    import threading

    def run():
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        failures.note_lowered_priority()
        work()
    thread = threading.Thread(target=run, name="lowered")
    thread.start()
    thread.join(30)
    assert not thread.is_alive()


def test_a_failure_found_on_the_lowered_engine_thread_is_handled_at_normal_priority(monkeypatch):
    # At nice 19, beside busy processes, the engine thread waits seconds for each moment of CPU;
    # the end of the job (its watchdogs inherit the priority of the thread that starts them)
    # must not: the watch thread, at the process's priority, arms it.
    import os

    normal = os.getpriority(os.PRIO_PROCESS, 0)
    failed_requests, armed = [], []
    failures = _failures(failed_requests)
    monkeypatch.setattr(abort, "arm", _where(armed))
    failures.start_watch()
    try:
        _on_a_lowered_thread(failures, lambda: failures.fail("stalled", log_it=False))
        _on_a_lowered_thread(failures, lambda: failures.arm_end("a set stalled", stalled=False))
    finally:
        failures.mark_stopped()
        failures.join_watch(5)
    assert armed == [("hpdl-engine-watch", normal)] * 2
    assert failures.failure == "stalled" and failed_requests == ["stalled"]


def test_without_the_watch_thread_the_lowered_thread_handles_its_failure_itself(monkeypatch):
    failed_requests, armed = [], []
    failures = _failures(failed_requests)  # its watch thread never started (or has ended)
    monkeypatch.setattr(abort, "arm", _where(armed))
    _on_a_lowered_thread(failures, lambda: failures.fail("stalled", log_it=False))
    assert armed == [("lowered", 19)] and failures.failure == "stalled"
