"""The engine's scheduling policy alone (hpdl/engine/scheduling.py), on a clock the test sets:
the pacing of rounds, gathering allreduces into fewer rounds, and the priority window. The
engine thread acting on these decisions: test_engine_thread.py."""

import pytest
import torch

from engine_clocks import FakeClock
from hpdl.config import Settings
from hpdl.engine.handle import Handle
from hpdl.engine.negotiation import ROOM_UNITS
from hpdl.engine.process_set import Backlog, ProcessSetState
from hpdl.engine.request import Op, Request, RequestKind, Response
from hpdl.engine.scheduling import Scheduler

CYCLE_S = 0.001  # HPDL_CYCLE_TIME's default
STALL_CHECK_S = 5.0  # a Controller's stall_check_interval at the default stall warning


def scheduler(clock=None, **settings):
    return Scheduler(Settings.from_env({}, **settings), clock if clock is not None else FakeClock())


# -- pacing ----------------------------------------------------------------------------------

def pauses(sched, rounds, progressed=False, arrived=0, started=0.0):
    """The pause before each next round, over ``rounds`` rounds alike."""
    return [round(sched.next_round_at(started, progressed, arrived) - started, 6) for _ in range(rounds)]


def test_an_idle_rank_doubles_its_pause_while_its_rounds_find_nothing():
    sched = scheduler()
    assert sched.idle
    # at a fixed first pause a second would hold 50 rounds; doubled after each, 11
    assert pauses(sched, 6) == [0.02, 0.04, 0.08, 0.1, 0.1, 0.1]
    # a round that ran something starts the doubling afresh
    assert pauses(sched, 1, progressed=True) == [0.02]
    assert pauses(sched, 2) == [0.02, 0.04]


def test_an_idle_rank_keeps_the_cycle_time_while_a_negotiation_needs_it():
    sched = scheduler()
    sched.after_round(hot=True, idle=True)  # a full exchange, or a process set with work, is under way
    assert pauses(sched, 3, progressed=True) == [CYCLE_S] * 3


def test_a_rank_waiting_for_its_peers_doubles_its_pause_up_to_a_cap():
    sched = scheduler()
    sched.after_round(hot=False, idle=False)  # requests pending that the rounds cannot run yet
    assert pauses(sched, 5) == [0.002, 0.004, 0.005, 0.005, 0.005]
    # a round that ran something, or a new request of this rank, brings the cycle time back
    assert pauses(sched, 1, progressed=True) == [CYCLE_S]
    sched.next_round_at(0.0, progressed=False, arrived=0)
    assert pauses(sched, 1, arrived=1) == [CYCLE_S]


def test_a_waiter_cuts_a_doubled_pause_short():
    sched = scheduler()
    sched.after_round(hot=False, idle=False)
    handle = Handle("w")
    assert not sched.round_for_waiter(handle)  # at the cycle time: nothing to cut short
    sched.next_round_at(0.0, progressed=False, arrived=0)
    assert sched.round_for_waiter(handle) and sched.fruitless == 0
    assert pauses(sched, 1) == [0.002]  # the doubling starts again from the cycle time


def test_a_submission_wakes_an_idle_engine_at_once_and_only_then():
    sched = scheduler()
    assert sched.round_for_submission(allreduce("a"))
    assert not sched.idle
    assert not sched.round_for_submission(allreduce("b"))  # the engine is busy already


def test_the_cycle_time_follows_the_autotuner():
    sched = scheduler()
    sched.after_round(hot=True, idle=True)
    sched.set_cycle_time(4.0)
    assert sched.cycle_time_ms == 4.0 and pauses(sched, 1, progressed=True) == [0.004]


def test_a_pause_polls_what_is_in_flight_and_more_often_for_a_waiter():
    clock = FakeClock(now=10.0)
    sched = scheduler(clock)
    assert sched.wait_s(10.02, poll_s=0.0) == pytest.approx(0.02)  # nothing to poll: to the end
    assert sched.wait_s(10.02, poll_s=0.0005) == 0.0005
    handle = Handle("w")
    sched.round_for_waiter(handle)
    assert sched.wait_s(10.02, poll_s=0.0005) == 5e-5  # a caller waits for a result
    handle.set_result(None)
    assert sched.wait_s(10.02, poll_s=0.0005) == 0.0005  # its result is there
    clock.advance(0.03)
    assert sched.wait_s(10.02, poll_s=0.0005) <= 0  # the pause is over


# -- gathering -------------------------------------------------------------------------------

def allreduce(name, numel=256, arrival=0.0, bytes_to_come=None, priority=None):
    """An allreduce of ``numel`` float32 (1 KiB by default), taken from the queue at ``arrival``."""
    request = Request(RequestKind.ALLREDUCE, name, tensor=torch.zeros(numel), op=Op.SUM,
                      bytes_to_come=bytes_to_come, priority=priority)
    request.arrival = arrival
    return request


def pending_set(*requests):
    ps = ProcessSetState(0, [0, 1], None, None)
    for request in requests:
        ps.admit(request)
    return ps


def gather_until(sched, *requests, backlogged=False, shutting_down=False):
    return sched.gather_until([pending_set(*requests)], backlogged=backlogged, shutting_down=shutting_down,
                              stall_check_s=STALL_CHECK_S)


def test_allreduces_no_one_waits_for_are_gathered_until_the_gather_time():
    clock = FakeClock(now=10.0)
    sched = scheduler(clock, gather_bytes=4096, gather_time_ms=50.0)
    assert gather_until(sched, allreduce("a", arrival=10.0), allreduce("b", arrival=10.01)) == pytest.approx(10.05)
    assert sched.gathering and sched.gathered == 2048 and not sched.idle
    clock.advance(0.05)  # the oldest has waited the gather time: the round runs now
    sched.end_gathering()
    assert gather_until(sched, allreduce("a", arrival=10.0), allreduce("b", arrival=10.01)) is None
    assert not sched.gathering


def test_a_gathering_lasts_no_longer_than_a_stall_check_allows():
    sched = scheduler(FakeClock(now=10.0), gather_time_ms=60_000.0)
    assert gather_until(sched, allreduce("a", arrival=10.0)) == 10.0 + STALL_CHECK_S


def test_submissions_during_a_gathering_are_counted_until_its_bytes_are_reached():
    sched = scheduler(gather_bytes=4096, gather_time_ms=60_000.0)
    assert gather_until(sched, allreduce("g0", arrival=1000.0)) is not None
    assert not sched.round_for_submission(allreduce("g1"))
    assert not sched.round_for_submission(allreduce("g2"))  # 3 KiB: still gathering, no round
    assert sched.round_for_submission(allreduce("g3"))  # 4 KiB: a round, one fused call
    # at the next look the four are pending: worth a round, not a longer hold
    assert gather_until(sched, *(allreduce(f"g{i}", arrival=1000.0) for i in range(4))) is None


def test_a_burst_s_last_allreduces_are_not_held_back_together():
    # The submitter tells how many bytes are still to come: once as many are held, holding
    # more would only grow the burst's last round, so the round runs, with no waiter.
    sched = scheduler(gather_bytes=1 << 20, gather_time_ms=60_000.0)
    first = allreduce("a", arrival=1000.0, bytes_to_come=3072)
    assert gather_until(sched, first) is not None  # 1 KiB held, 3 KiB to come: gathering
    assert sched.round_for_submission(allreduce("b", bytes_to_come=2048))  # 2 KiB held, 2 to come
    assert gather_until(sched, first, allreduce("b", arrival=1000.0, bytes_to_come=2048)) is None
    assert gather_until(scheduler(gather_bytes=1 << 20), allreduce("c", arrival=1000.0, bytes_to_come=0)) is None


def test_a_caller_waiting_ends_the_gathering():
    sched = scheduler(gather_bytes=1 << 20, gather_time_ms=60_000.0)
    metric = allreduce("metric", arrival=1000.0)
    assert gather_until(sched, metric) is not None
    handle = Handle("metric")
    assert sched.round_for_waiter(handle)  # the engine is woken
    sched.end_gathering()
    assert gather_until(sched, metric) is None  # and holds nothing while the wait lasts
    handle.set_result(None)
    assert gather_until(sched, metric) is not None


@pytest.mark.parametrize("what", ["no gather bytes", "shutting down", "hot", "backlogged", "not an allreduce",
                                  "nothing pending"])
def test_what_is_never_gathered(what):
    sched = scheduler(gather_bytes=0 if what == "no gather bytes" else 1 << 20)
    sched.hot = what == "hot"
    requests = [allreduce("a", arrival=1000.0)]
    if what == "not an allreduce":
        requests.append(Request(RequestKind.BROADCAST, "b", tensor=torch.zeros(1)))
    elif what == "nothing pending":
        requests = []
    assert gather_until(sched, *requests, backlogged=what == "backlogged",
                        shutting_down=what == "shutting down") is None
    assert not sched.gathering


def test_a_submission_that_is_no_allreduce_ends_a_gathering():
    sched = scheduler(gather_bytes=1 << 20)
    assert gather_until(sched, allreduce("a", arrival=1000.0)) is not None
    assert sched.round_for_submission(Request(RequestKind.BARRIER, "b"))


# -- priorities ------------------------------------------------------------------------------

def prioritized(name, numel, priority):
    req = allreduce(name, numel, priority=priority)
    req.handle = Handle(name)
    return Response(name, RequestKind.ALLREDUCE, (req.signature(), req.signature())), req


def queued_names(backlog):
    names = []
    while backlog.head() is not None:
        names.append([r.name for r in backlog.pop().responses])
    return names


def backlog_of(*agreed):
    backlog = Backlog()
    for response, request in agreed:
        backlog.add(response, request)
    return backlog


def test_backlog_queues_the_most_urgent_that_fit_in_the_agreed_room():
    # one unit: 4096 bytes (1024 float32); tensors of 4096 bytes and more go alone
    sched = scheduler(priority_window=32 * 4096, inplace_threshold=4096)
    # arrival order is backward's (last layer first); priority is the forward's order
    backlog = backlog_of(*[prioritized(f"p{prio}", 1024, prio) for prio in (5, 4, 3, 2, 1, 0)])
    backlog.queue(3, sched.batches_to_queue)  # room for three tensors
    assert backlog.queued == 3 and backlog.waiting == 3 and backlog.queued_bytes == 3 * 4096
    assert set(backlog.head().requests) == {"p0"}  # each batch carries this rank's requests
    backlog.queue(0, sched.batches_to_queue)  # some rank has no room: nothing more is queued
    assert backlog.queued == 3
    assert queued_names(backlog) == [["p0"], ["p1"], ["p2"]] and backlog.queued_bytes == 0
    assert sorted(r.name for r in backlog.clear()) == ["p3", "p4", "p5"]  # the rest still waits
    # a tensor larger than the whole window is queued once every window is empty
    backlog = backlog_of(prioritized("huge", 64 * 1024, 0))
    backlog.queue(ROOM_UNITS - 1, sched.batches_to_queue)
    assert not backlog.queued
    backlog.queue(ROOM_UNITS, sched.batches_to_queue)
    assert queued_names(backlog) == [["huge"]]
    # tensors under the in-place size are queued together (to be fused), up to that size
    backlog = backlog_of(*[prioritized(f"s{prio}", 256, prio) for prio in range(6)])  # 1 KiB each
    backlog.queue(ROOM_UNITS, sched.batches_to_queue)
    assert queued_names(backlog) == [["s0", "s1", "s2", "s3"], ["s4", "s5"]]


def test_the_room_counts_what_is_in_flight_and_what_is_queued():
    sched = scheduler(priority_window=32 * 4096)  # one unit: 4096 bytes
    assert sched.room(0, 0) == ROOM_UNITS
    assert sched.room(4096, 0) == ROOM_UNITS - 1
    assert sched.room(4096, 2 * 4096) == ROOM_UNITS - 3
    assert sched.room(4095, 2 * 4096) == ROOM_UNITS - 3  # a unit partly used is no room
    assert sched.room(64 * 4096, 0) == 0


def test_a_queued_batch_starts_when_it_fits_beside_what_is_in_flight():
    sched = scheduler()
    assert sched.may_start(0, 10_000, flight_window=4096)  # nothing in flight: whatever its size
    assert sched.may_start(2048, 2048, flight_window=4096)
    assert not sched.may_start(2048, 2049, flight_window=4096)


@pytest.mark.parametrize("in_order,flight_window", [(True, 8192), (False, 4096)])
def test_queued_allreduces_start_between_rounds_only_where_collectives_run_in_the_background(
        in_order, flight_window):
    from types import SimpleNamespace

    sched = scheduler(priority_window=8192)
    comm = SimpleNamespace(background_collectives=True, runs_in_order=in_order)
    # side by side (MPI) half the window in flight, the other half queued; in order all of it
    assert sched.pacing(comm, background=True) == (True, flight_window)
    assert not sched.pacing(comm, background=False)[0]  # HPDL_BACKGROUND_COLLECTIVES=0: every call blocks
    assert not sched.pacing(SimpleNamespace(background_collectives=False), background=True)[0]
