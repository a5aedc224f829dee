"""The engine thread alone, over one-rank communicators whose collectives move only when
polled (as MPI's over TCP): polling between rounds and while a round waits, gathering
allreduces into fewer rounds, pacing an idle engine, and stopping.

The engine runs on a clock whose time passes only when the test says (engine_clocks.py), so
each test sees the same rounds at the same moments on every run. The policy's decisions
alone: test_engine_scheduling.py."""

import time

import pytest
import torch

from engine_clocks import ManualClock
from hpdl.engine.errors import HorovodInternalError
from hpdl.engine.request import Op, Request, RequestKind


class _PolledFlight:
    """A collective that, like MPI's non-blocking ones, moves only when polled: done after
    ``polls`` calls of done()."""

    poll_interval_s = 0.0005
    runs_in_order = False

    def __init__(self, polls):
        self.left = polls
        self.callbacks = []

    def done(self):
        if self.left > 0:
            self.left -= 1
            if self.left == 0:
                for callback in self.callbacks:
                    callback()
        return self.left == 0

    def wait(self):
        while not self.done():
            pass

    def on_done(self, callback):
        self.callbacks.append(callback)


class _PolledComm:
    """One rank alone whose allreduces are polled flights, done after ``polls`` polls."""

    name = "fake"
    rank = 0
    size = 1
    polls = 5

    def __init__(self):
        self.flights = []

    def allreduce_control(self, tensor, op):
        pass

    def allgather_object(self, obj):
        return [obj]

    allgather_object_control = allgather_object
    background_collectives = True

    def allreduce_start(self, tensor, op):
        self.flights.append(_PolledFlight(polls=self.polls))
        return self.flights[-1]


def _engine(comm, clock, **settings):
    """An engine on ``clock`` whose first round, with nothing to do, has passed."""
    from hpdl.config import Settings
    from hpdl.engine.engine import Engine

    engine = Engine(Settings.from_env({}, **settings), comm, clock=clock)
    clock.settle()
    assert engine.cycles == 1
    return engine


def test_collectives_that_progress_only_when_polled_are_polled_between_rounds():
    # A cycle time of a minute, of which 10 ms pass: if the collective were finished only by
    # the next round, the handle would not be complete.
    comm = _PolledComm()
    clock = ManualClock()
    engine = _engine(comm, clock, cycle_time_ms=60_000.0)
    try:
        tensor = torch.ones(1 << 20)  # 4 MiB: reduced in place, one flight
        request = Request(RequestKind.ALLREDUCE, "big", tensor=tensor, op=Op.SUM)
        handle = engine.submit(request)
        clock.advance(0.01)
        assert handle.poll()
        torch.testing.assert_close(handle.wait(), torch.ones(1 << 20))
        assert len(comm.flights) == 1 and comm.flights[0].left == 0
        # one round agreed and started it; the pause after it polled it to the end
        assert engine.cycles == 2
    finally:
        engine.shutdown()


class _LateRoundComm(_PolledComm):
    """A rank whose rounds wait (for a late peer, or behind data on the connection): each
    calls ``control_wait_hook`` between polls, as MPI's control waits do."""

    control_wait_hook = None
    runs_in_order = False  # as MPI's: half the window in flight, half queued

    def __init__(self):
        super().__init__()
        self.in_round = False
        self.started_in_round = 0

    def allreduce_control(self, tensor, op):
        self.in_round = True
        try:
            for _ in range(30):
                if self.control_wait_hook is not None:
                    self.control_wait_hook()
        finally:
            self.in_round = False

    def allreduce_start(self, tensor, op):
        self.started_in_round += self.in_round
        return super().allreduce_start(tensor, op)


def test_a_round_that_waits_finishes_what_is_done_and_starts_what_is_queued():
    comm = _LateRoundComm()
    clock = ManualClock()
    # 4 KiB tensors, each reduced alone, a window of two: one in flight at a time, one queued
    engine = _engine(comm, clock, priority_window=8192, inplace_threshold=4096)
    try:
        handles = []
        for i in range(6):
            request = Request(RequestKind.ALLREDUCE, f"g{i}", tensor=torch.full((1024,), float(i)), op=Op.SUM,
                              priority=i)
            handles.append(engine.submit(request))
        # Nobody waits: the six are gathered for the gather time, then negotiated together, and
        # what is in flight is polled at the backend's pace, so a round can begin before the
        # allreduce in flight is done.
        clock.advance_until(lambda: all(handle.poll() for handle in handles))
        for i, handle in enumerate(handles):
            torch.testing.assert_close(handle.wait(), torch.full((1024,), float(i)))
        assert len(comm.flights) == 6
        # the queued ones did not all wait for a round to end: some started inside one
        assert comm.started_in_round > 0
    finally:
        engine.shutdown()


class _RecordingComm(_PolledComm):
    """One rank alone that records its rounds (when, on ``clock``) and the size of each
    allreduce it starts; they are done at their first poll, as a blocking call would be."""

    polls = 1

    def __init__(self, clock):
        super().__init__()
        self.clock = clock
        self.rounds = []  # the clock's time at each round
        self.started = []  # elements per allreduce started (a fused batch is one)

    def allreduce_control(self, tensor, op):
        self.rounds.append(self.clock.monotonic())

    def allreduce_start(self, tensor, op):
        self.started.append(tensor.numel())
        return super().allreduce_start(tensor, op)


def _small_allreduce(name, value=1.0, bytes_to_come=None):
    return Request(RequestKind.ALLREDUCE, name, tensor=torch.full((256,), float(value)), op=Op.SUM,  # 1 KiB
                   bytes_to_come=bytes_to_come)


def _recording_engine(**settings):
    clock = ManualClock()
    comm = _RecordingComm(clock)
    return _engine(comm, clock, **settings), comm, clock


def test_allreduces_no_one_waits_for_are_gathered_into_one_round_and_one_call():
    # gather 4 KiB, for as long as a minute (capped at a stall check's 5 s): only the bytes end it here
    engine, comm, clock = _recording_engine(gather_bytes=4096, gather_time_ms=60_000.0)
    try:
        handles = [engine.submit(_small_allreduce(f"g{i}", i)) for i in range(3)]
        clock.advance(0.02)  # the idle pause is over: the gathering holds the round all the same
        rounds = len(comm.rounds)
        clock.advance(1.0)
        assert comm.started == [] and len(comm.rounds) == rounds  # 3 KiB: still gathering, no round
        handles.append(engine.submit(_small_allreduce("g3", 3)))
        clock.settle()
        for i, handle in enumerate(handles):
            torch.testing.assert_close(handle.wait(), torch.full((256,), float(i)))
        assert comm.started == [4 * 256]  # one round agreed the four: one fused allreduce
    finally:
        engine.shutdown()


def test_a_burst_s_last_allreduces_are_not_held_back_together():
    # The submitter tells how many bytes are still to come: once as many are held, holding
    # more would only grow the burst's last round, so the round runs, with no waiter.
    engine, comm, clock = _recording_engine(gather_bytes=1 << 20, gather_time_ms=60_000.0)
    try:
        first = engine.submit(_small_allreduce("a", bytes_to_come=3072))
        clock.advance(1.0)
        assert comm.started == [] and not first.poll()  # 1 KiB held, 3 KiB to come: still gathering
        second = engine.submit(_small_allreduce("b", bytes_to_come=2048))  # 2 KiB held, 2 to come
        clock.settle()
        assert first.poll() and second.poll() and comm.started == [2 * 256]
        last = engine.submit(_small_allreduce("c", bytes_to_come=0))
        clock.settle()
        assert last.poll() and comm.started == [2 * 256, 256]
    finally:
        engine.shutdown()


def test_a_caller_waiting_ends_the_gathering():
    engine, comm, clock = _recording_engine(gather_bytes=1 << 20, gather_time_ms=60_000.0)
    try:
        handle = engine.submit(_small_allreduce("metric", 2.0))
        clock.advance(1.0)
        assert comm.started == []
        # no time passes from here: only the waiter's call can end the gathering
        torch.testing.assert_close(handle.wait(timeout=30), torch.full((256,), 2.0))
        assert comm.started == [256]
    finally:
        engine.shutdown()


def test_the_gather_time_ends_a_gathering_no_one_waits_for():
    engine, comm, clock = _recording_engine(gather_bytes=1 << 20, gather_time_ms=20.0)
    try:
        handle = engine.submit(_small_allreduce("lonely"))
        submitted = clock.monotonic()
        clock.advance(0.019)
        assert not handle.poll() and comm.started == []
        clock.advance(0.001)
        assert handle.poll() and comm.started == [256]
        assert comm.rounds[-1] == pytest.approx(submitted + 0.02)
    finally:
        engine.shutdown()


def test_without_gather_bytes_every_submission_starts_a_round():
    engine, comm, clock = _recording_engine(gather_bytes=0, gather_time_ms=60_000.0)
    try:
        handle = engine.submit(_small_allreduce("lonely"))
        clock.settle()  # no time passes
        assert handle.poll() and comm.started == [256]
    finally:
        engine.shutdown()


def test_an_idle_engine_spaces_its_rounds_out():
    engine, comm, clock = _recording_engine()
    try:
        start = comm.rounds[0]
        clock.advance(1.0)
        # at a fixed first pause a second would hold 1 / 0.02 = 50 rounds; doubled after each, 11
        gaps = [round(b - a, 6) for a, b in zip(comm.rounds, comm.rounds[1:])]
        assert gaps == [0.02, 0.04, 0.08] + [0.1] * 8
        # a submission is still served at once (no time passes), and resets the pause
        handle = engine.submit(_small_allreduce("after_idle"))
        clock.settle()
        torch.testing.assert_close(handle.wait(timeout=30), torch.full((256,), 1.0))
        assert comm.rounds[-1] == start + 1.0
        clock.advance(0.1)
        assert comm.rounds[-3:] == pytest.approx([start + 1.0, start + 1.02, start + 1.06])
    finally:
        engine.shutdown()


class _PeerShutsDownComm(_PolledComm):
    """One rank whose next round learns that a peer has called shutdown()."""

    peer_shutdown = False

    def allreduce_control(self, tensor, op):
        from hpdl.engine.negotiation import FLAG_SHUTDOWN

        if self.peer_shutdown:
            tensor[0] &= ~FLAG_SHUTDOWN  # the peer's flag (the words travel inverted, ANDed)


def test_a_request_submitted_as_the_engine_stops_fails_instead_of_waiting_for_ever():
    from hpdl.config import Settings
    from hpdl.engine.engine import Engine

    comm = _PeerShutsDownComm()
    engine = Engine(Settings.from_env({}), comm)
    late = []
    fail_pending = engine._fail_pending

    def fail_pending_then_submit(message):
        fail_pending(message)
        # The narrowest moment: after the stopping engine's last look at its queue, before it
        # is marked stopped (a user thread's submission can land here).
        late.append(engine.submit(_small_allreduce("late")))

    engine._fail_pending = fail_pending_then_submit
    try:
        comm.peer_shutdown = True
        engine.submit(_small_allreduce("wake"))  # a round now: it learns of the shutdown
        deadline = time.monotonic() + 30
        while not late and time.monotonic() < deadline:
            time.sleep(0.005)
        assert late, "the engine did not stop"
        with pytest.raises(HorovodInternalError, match="shut down"):
            late[0].wait(timeout=10)
    finally:
        engine.shutdown(timeout=5)
