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
