"""The engine thread alone, over one-rank communicators whose collectives move only when
polled (as MPI's over TCP): polling between rounds and while a round waits, gathering
allreduces into fewer rounds, pacing an idle engine, and stopping."""

import time

import pytest
import torch

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
    """One rank alone whose allreduces are polled flights."""

    name = "fake"
    rank = 0
    size = 1

    def __init__(self):
        self.flights = []

    def allreduce_control(self, tensor, op):
        pass

    def allgather_object(self, obj):
        return [obj]

    allgather_object_control = allgather_object
    background_collectives = True

    def allreduce_start(self, tensor, op):
        self.flights.append(_PolledFlight(polls=5))
        return self.flights[-1]


def test_collectives_that_progress_only_when_polled_are_polled_between_rounds():
    from hpdl.config import Settings
    from hpdl.engine.engine import Engine

    # A cycle time of a minute: if the collective were finished only by the next round, the
    # handle would not complete before that round.
    comm = _PolledComm()
    engine = Engine(Settings.from_env({}, cycle_time_ms=60_000.0), comm)
    try:
        while engine.cycles < 1:  # the first round, with nothing to do, has passed
            time.sleep(0.001)
        rounds_before = engine.cycles
        tensor = torch.ones(1 << 20)  # 4 MiB: reduced in place, one flight
        request = Request(RequestKind.ALLREDUCE, "big", tensor=tensor, op=Op.SUM)
        handle = engine.submit(request)
        torch.testing.assert_close(handle.wait(), torch.ones(1 << 20))
        assert len(comm.flights) == 1 and comm.flights[0].left == 0
        # one round agreed and started it; the pause after it polled it to the end
        assert engine.cycles == rounds_before + 1
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
                time.sleep(0.0005)
                if self.control_wait_hook is not None:
                    self.control_wait_hook()
        finally:
            self.in_round = False

    def allreduce_start(self, tensor, op):
        self.started_in_round += self.in_round
        return super().allreduce_start(tensor, op)


def test_a_round_that_waits_finishes_what_is_done_and_starts_what_is_queued():
    from hpdl.config import Settings
    from hpdl.engine.engine import Engine

    comm = _LateRoundComm()
    # 4 KiB tensors, each reduced alone, a window of two: one in flight at a time, one queued
    engine = Engine(Settings.from_env({}, priority_window=8192, inplace_threshold=4096), comm)
    try:
        handles = []
        for i in range(6):
            request = Request(RequestKind.ALLREDUCE, f"g{i}", tensor=torch.full((1024,), float(i)), op=Op.SUM,
                              priority=i)
            handles.append(engine.submit(request))
        for i, handle in enumerate(handles):
            torch.testing.assert_close(handle.wait(), torch.full((1024,), float(i)))
        assert len(comm.flights) == 6
        # the queued ones did not all wait for a round to end: some started inside one
        assert comm.started_in_round > 0
    finally:
        engine.shutdown()


class _RecordingComm(_PolledComm):
    """One rank alone that records its rounds and the size of each allreduce it starts."""

    def __init__(self):
        super().__init__()
        self.rounds = 0
        self.started = []  # elements per allreduce started (a fused batch is one)

    def allreduce_control(self, tensor, op):
        self.rounds += 1

    def allreduce_start(self, tensor, op):
        self.started.append(tensor.numel())
        return super().allreduce_start(tensor, op)


def _gathering_engine(comm, **settings):
    from hpdl.config import Settings
    from hpdl.engine.engine import Engine

    engine = Engine(Settings.from_env({}, **settings), comm)
    while engine.cycles < 1:  # the first round, with nothing to do, has passed
        time.sleep(0.001)
    return engine


def _small_allreduce(name, value=1.0, bytes_to_come=None):
    return Request(RequestKind.ALLREDUCE, name, tensor=torch.full((256,), float(value)), op=Op.SUM,  # 1 KiB
                   bytes_to_come=bytes_to_come)


def _done_without_waiting(handle, limit_s=30.0):
    """Whether ``handle`` completes within ``limit_s`` while nobody waits on it (poll() does not
    end a gathering, as a waiter does)."""
    deadline = time.monotonic() + limit_s
    while not handle.poll() and time.monotonic() < deadline:
        time.sleep(0.005)
    return handle.poll()


def test_allreduces_no_one_waits_for_are_gathered_into_one_round_and_one_call():
    comm = _RecordingComm()
    # gather 4 KiB, for as long as a minute: only the bytes can end it here
    engine = _gathering_engine(comm, gather_bytes=4096, gather_time_ms=60_000.0)
    try:
        handles = [engine.submit(_small_allreduce(f"g{i}", i)) for i in range(3)]
        time.sleep(0.05)
        rounds = comm.rounds
        time.sleep(0.2)
        assert comm.started == [] and comm.rounds == rounds  # 3 KiB: still gathering, no round
        handles.append(engine.submit(_small_allreduce("g3", 3)))
        for i, handle in enumerate(handles):
            torch.testing.assert_close(handle.wait(), torch.full((256,), float(i)))
        assert comm.started == [4 * 256]  # one round agreed the four: one fused allreduce
    finally:
        engine.shutdown()


def test_a_burst_s_last_allreduces_are_not_held_back_together():
    # The submitter tells how many bytes are still to come: once as many are held, holding
    # more would only grow the burst's last round, so the round runs, with no waiter.
    comm = _RecordingComm()
    engine = _gathering_engine(comm, gather_bytes=1 << 20, gather_time_ms=60_000.0)
    try:
        first = engine.submit(_small_allreduce("a", bytes_to_come=3072))
        time.sleep(0.2)
        assert comm.started == []  # 1 KiB held, 3 KiB to come: still gathering
        second = engine.submit(_small_allreduce("b", bytes_to_come=2048))  # 2 KiB held, 2 to come
        assert _done_without_waiting(first) and _done_without_waiting(second)
        assert comm.started == [2 * 256]
        last = engine.submit(_small_allreduce("c", bytes_to_come=0))
        assert _done_without_waiting(last) and comm.started == [2 * 256, 256]
    finally:
        engine.shutdown()


def test_a_caller_waiting_ends_the_gathering():
    comm = _RecordingComm()
    engine = _gathering_engine(comm, gather_bytes=1 << 20, gather_time_ms=60_000.0)
    try:
        handle = engine.submit(_small_allreduce("metric", 2.0))
        time.sleep(0.1)
        assert comm.started == []
        # without the waiter's call the round would wait a minute, or 5 s, when a round must
        # check for stalls: the wait would time out
        torch.testing.assert_close(handle.wait(timeout=2), torch.full((256,), 2.0))
        assert comm.started == [256]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("gather_bytes,gather_time_ms", [(1 << 20, 20.0), (0, 60_000.0)],
                         ids=["the-gather-time-ends-it", "no-gather-bytes-no-gathering"])
def test_an_allreduce_no_one_waits_for_still_runs(gather_bytes, gather_time_ms):
    # Without a waiter, a gathering ends after the gather time; with no gather bytes, there
    # is none: every submission starts a round (a minute's gathering would outlast the poll).
    comm = _RecordingComm()
    engine = _gathering_engine(comm, gather_bytes=gather_bytes, gather_time_ms=gather_time_ms)
    try:
        handle = engine.submit(_small_allreduce("lonely"))
        assert _done_without_waiting(handle) and comm.started == [256]
    finally:
        engine.shutdown()


def test_an_idle_engine_spaces_its_rounds_out():
    from hpdl.engine import engine as engine_module

    comm = _RecordingComm()
    engine = _gathering_engine(comm)
    try:
        before = comm.rounds
        time.sleep(1.0)
        idle_rounds = comm.rounds - before
        # at a fixed first pause a second holds 1 / 0.02 = 50 rounds; doubled after each, few
        assert 1 <= idle_rounds <= 1.0 / engine_module._IDLE_PAUSE_MIN_S / 3
        # a submission is still served at once, and resets the pause
        handle = engine.submit(_small_allreduce("after_idle"))
        torch.testing.assert_close(handle.wait(timeout=30), torch.full((256,), 1.0))
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
