"""No hang in spatial parallelism's own communication: a rank that raises, exits or stalls ends
the whole job within a bound, and each rank left waiting in a halo exchange or a collective of
its group says in one line which rank it is, what it was doing (the layer) and why.

The jobs (tests/multirank/spatial_failures.py) fail rank 0 at step 2 while the other ranks go on;
the group's wait checks (hpdl/torch/spatial/comm.py) alone, over stand-in communicators and
engines, below them."""

from __future__ import annotations

import re
import time

import pytest
import torch

from ranks import run_ranks
from hpdl.engine.errors import HorovodInternalError

# Short, so that a stall ends the job soon, yet long enough that a rank slowed before the
# failure by the suite's other jobs (3 s was seen under CI) is not taken for a stalled one.
STALL_TIMEOUT_S = 8
# From rank 0's failure to the end of the job, at most: an exception stops the other ranks' waits
# at once; a stall takes the stall timeout, the liveness check (1 s) and the abort's grace (3 s).
RAISE_BOUND_S = 10
STALL_BOUND_S = STALL_TIMEOUT_S + 1 + 3 + 5
# Ranks that wait for each other end at the stall warning (hpdl/engine/blocked.py), then the
# stall checks' interval (half the warning) and the abort's grace (3 s).
STALL_WARNING_S = 2
WAITING_BOUND_S = STALL_WARNING_S + 1 + 3 + 5
SHUT_DOWN = "cannot complete: hpdl has been shut down (rank 0 called hvd.shutdown(), or exited)"
STALLED = (f"has not completed in {STALL_TIMEOUT_S} s (HPDL_STALL_TIMEOUT): a rank has died, is stuck, or runs a "
           "different step (lost: rank 0 does not answer)")


def _failing_job(launcher: str, n: int, how: str, when: str, model: str):
    """Run the job; return its stderr and how long it took to end after rank 0 failed.

    The stall timeout is short only where a stall is what is tested: elsewhere a rank slowed by a
    busy machine (the suite's other jobs) before rank 0 fails must not read as a stall."""
    stall_timeout_s = STALL_TIMEOUT_S if how == "stall" else 60
    env = {"HPDL_STALL_TIMEOUT": str(stall_timeout_s)}
    if how == "skip-backward":
        env["HPDL_STALL_WARNING"] = str(STALL_WARNING_S)
    result = run_ranks("spatial_failures.py", n, launcher, args=[how, when, model], env=env,
                       timeout=90 + stall_timeout_s, expect_ok=False)
    ended = time.time()
    failing = re.search(r"FAILING at ([0-9.]+)", result.stdout)
    assert failing, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode != 0, result.stderr[-3000:]
    assert "finished every step" not in result.stdout
    return result.stderr, ended - float(failing.group(1))


def _lines(stderr: str, rank: int) -> list:
    """The error lines of ``rank`` about its group's communication (torchrun puts "[rankN]: " first)."""
    marker = f"hpdl: rank {rank}: the "
    return [line[line.index(marker):] for line in stderr.splitlines() if marker in line]


@pytest.mark.multirank
@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_an_exception_on_one_rank_ends_the_others_halo_exchange_at_once(launcher):
    stderr, took = _failing_job(launcher, 2, "raise", "in-forward", "conv")
    assert "RuntimeError: a bad sample on rank 0" in stderr
    assert _lines(stderr, 1) == [f"hpdl: rank 1: the halo exchange of layer conv2 with group rank 0 (world rank 0) "
                                 f"{SHUT_DOWN}"], stderr[-3000:]
    assert took < RAISE_BOUND_S, f"the job ended {took:.1f} s after rank 0 raised"
    if launcher == "mpiexec":  # rank 0's own exception has its traceback; rank 1's end is its one line
        assert stderr.count("Traceback (most recent call last)") == 1, stderr[-3000:]


@pytest.mark.multirank
def test_an_exception_between_steps_ends_every_other_rank_of_the_group():
    # The reported case: rank 0 raises between steps while the others enter the next forward.
    # On 3 ranks the last one waits on the middle one, not on rank 0; each says why it stops,
    # in whichever of the forward's communication (the first that rank 0 misses) it waits.
    stderr, took = _failing_job("mpiexec", 3, "raise", "between-steps", "conv")
    for rank in (1, 2):
        lines = _lines(stderr, rank)
        assert len(lines) == 1 and lines[0].endswith(SHUT_DOWN), stderr[-3000:]
    assert took < RAISE_BOUND_S, f"the job ended {took:.1f} s after rank 0 raised"


@pytest.mark.multirank
def test_an_exception_before_backward_ends_the_first_wait_of_backward():
    # The first thing a backward does is check that every rank of the group makes the same call.
    stderr, took = _failing_job("mpiexec", 2, "raise", "before-backward", "conv")
    assert _lines(stderr, 1) == [f"hpdl: rank 1: the spatial group's allgather of calls in backward "
                                 f"(world ranks 0, 1) {SHUT_DOWN}"], stderr[-3000:]
    assert took < RAISE_BOUND_S, f"the job ended {took:.1f} s after rank 0 raised"


@pytest.mark.multirank
def test_an_exception_in_backward_ends_the_halo_exchange_of_backward():
    stderr, took = _failing_job("mpiexec", 2, "raise", "in-backward", "conv")
    assert _lines(stderr, 1) == [f"hpdl: rank 1: the halo exchange of layer conv2 in backward with group rank 0 "
                                 f"(world rank 0) {SHUT_DOWN}"], stderr[-3000:]
    assert took < RAISE_BOUND_S, f"the job ended {took:.1f} s after rank 0 raised"


@pytest.mark.multirank
@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_a_rank_that_skips_backward_but_steps_ends_the_job_at_the_stall_warning(launcher):
    # Rank 0 waits in the optimizer's allreduces, which rank 1 never submits; rank 1 waits in the
    # start of the backward, which rank 0 never begins. Neither engine sees the other's wait: the
    # stall checks do, and end the job at the stall warning, not at the timeout (60 s here).
    stderr, took = _failing_job(launcher, 2, "skip-backward", "before-backward", "conv")
    lines = _lines(stderr, 1)
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("hpdl: rank 1: the spatial group's allgather of calls in backward (world ranks 0, 1) "
                               "cannot complete: ranks 0, 1 wait for each other, and none can go on: "), lines[0]
    assert re.search(r"rank 0 waits for allreduce\.module\.conv[12]\.(weight|bias), which rank 1 has not submitted",
                     lines[0]), lines[0]
    assert "a rank skipped a call the others made (a backward() before the optimizer's step" in lines[0]
    assert took < WAITING_BOUND_S, f"the job ended {took:.1f} s after rank 0 skipped its backward"


@pytest.mark.multirank
@pytest.mark.parametrize("launcher, model, operation", [
    ("mpiexec", "pool", "allreduce of pool"),  # global pooling's sum over the group
    ("torchrun", "bn", "allgather of bn"),  # batch norm's statistics of every part
])
def test_a_stalled_rank_ends_the_job_from_the_groups_collective(launcher, model, operation):
    stderr, took = _failing_job(launcher, 2, "stall", "in-forward", model)
    assert _lines(stderr, 1) == [f"hpdl: rank 1: the spatial group's {operation} (world ranks 0, 1) {STALLED}"], \
        stderr[-3000:]
    assert took < STALL_BOUND_S, f"the job ended {took:.1f} s after rank 0 stalled"


# --- the group's waits over stand-ins ---------------------------------------------------------

class _Engine:
    """What GroupComm asks of the running engine: its bus, why it stopped, the end of the job."""

    def __init__(self):
        from hpdl.engine.events import EventBus

        self.bus = EventBus()
        self.stop_reason = None
        self.ended = []

    def end_job(self, reason):
        self.ended.append(reason)


class _Comm:
    """Two ranks' communicator, seen from group rank 1, whose transfers complete after ``polls``
    calls of the wait hook (never, by default), or raise the backend's ``error``."""

    name = "fake"
    rank = 1
    size = 2
    wait_hook = None

    def __init__(self, polls=None, error=None, on_poll=None):
        self.polls, self.error, self.on_poll = polls, error, on_poll
        self.closed = 0

    def _wait(self):
        if self.error is not None:
            raise self.error
        done = 0
        while self.polls is None or done < self.polls:
            time.sleep(0.001)
            if self.on_poll is not None:
                self.on_poll()
            self.wait_hook()
            done += 1

    def exchange(self, sends, receives):
        self._wait()

    def allreduce(self, tensor, op):
        self._wait()

    def allgather(self, tensor, first_dims):
        self._wait()
        return torch.cat([tensor, tensor])

    def unanswering(self, wait_s):
        return [0]

    def close(self):
        self.closed += 1


@pytest.fixture
def engine(monkeypatch):
    from hpdl.torch import runtime

    running = _Engine()
    monkeypatch.setattr(runtime, "engine", lambda: running)
    return running


def _group(comm, stall_timeout_s=30.0):
    from hpdl.torch.spatial.comm import GroupComm

    return GroupComm(comm, 0, [4, 7], stall_timeout_s)


def _strips():
    return [(0, torch.ones(3))], [(0, torch.empty(3))]


def test_a_wait_that_lasts_the_stall_timeout_ends_the_job_and_names_the_layer_and_the_lost_rank(engine):
    group = _group(_Comm(), stall_timeout_s=0.05)
    with pytest.raises(HorovodInternalError) as raised:
        group.exchange(*_strips(), "body.3.conv1")
    reason = ("the halo exchange of layer body.3.conv1 with group rank 0 (world rank 4) has not completed in 0.05 s "
              "(HPDL_STALL_TIMEOUT): a rank has died, is stuck, or runs a different step")
    assert str(raised.value) == f"hpdl: rank 7: {reason} (lost: rank 4 does not answer)"
    assert engine.ended == [reason]
    # The group is unusable from then on: every call raises the same line at once.
    with pytest.raises(HorovodInternalError, match="has not completed in 0.05 s"):
        group.allreduce_sum(torch.ones(2), "bn1")


def test_a_stopped_engine_ends_the_wait_and_says_why(engine):
    def stop():
        engine.stop_reason = "hpdl has been shut down (rank 0 called hvd.shutdown(), or exited)"

    group = _group(_Comm(on_poll=stop))
    started = time.monotonic()
    with pytest.raises(HorovodInternalError) as raised:
        group.allgather(torch.ones(1, 2), [1, 1], "bn1")
    assert str(raised.value) == ("hpdl: rank 7: the spatial group's allgather of bn1 (world ranks 4, 7) cannot "
                                 "complete: hpdl has been shut down (rank 0 called hvd.shutdown(), or exited)")
    assert time.monotonic() - started < 5 and len(engine.ended) == 1


def test_a_transfer_that_completes_soon_after_the_engine_stopped_is_not_failed(engine):
    # A peer that finished its side of the last exchange, then shut down, has sent what this
    # rank still receives.
    engine.stop_reason = "hpdl has been shut down (rank 0 called hvd.shutdown(), or exited)"
    group = _group(_Comm(polls=3))
    group.allreduce_sum(torch.ones(2), "whole_mean")
    assert engine.ended == []


def test_a_backend_error_becomes_the_one_line(engine, monkeypatch):
    from hpdl.torch.spatial import comm as spatial_comm

    monkeypatch.setattr(spatial_comm, "_VERDICT_WAIT_S", 0.05)  # the engine gives no reason: a crashed peer
    error = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500\nmore")
    group = _group(_Comm(error=error))
    with pytest.raises(HorovodInternalError) as raised:
        group.exchange(*_strips(), "conv2")
    assert str(raised.value) == ("hpdl: rank 7: the halo exchange of layer conv2 with group rank 0 (world rank 4) "
                                 "failed: RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                                 "[127.0.0.1]:29500 (lost: rank 4 does not answer)")
    assert len(engine.ended) == 1


def test_a_peers_closed_connection_waits_for_the_engine_to_say_why(engine):
    # A peer that shuts down closes its group's connections before its engine stops every rank's.
    import threading

    def stop_soon():
        time.sleep(0.2)
        engine.stop_reason = "hpdl has been shut down (rank 0 called hvd.shutdown(), or exited)"

    threading.Thread(target=stop_soon, daemon=True).start()
    group = _group(_Comm(error=RuntimeError("Connection closed by peer")))
    with pytest.raises(HorovodInternalError) as raised:
        group.exchange(*_strips(), "conv2")
    assert str(raised.value) == ("hpdl: rank 7: the halo exchange of layer conv2 with group rank 0 (world rank 4) "
                                 "cannot complete: hpdl has been shut down (rank 0 called hvd.shutdown(), or exited)")


def test_a_healthy_wait_reports_to_the_bus_of_the_engine_running_now(engine, monkeypatch):
    from hpdl.engine.events import EventBus
    from hpdl.torch import runtime

    group = _group(_Comm(polls=1))
    seen = []
    engine.bus.add(seen.append)
    group.exchange(*_strips(), "conv1")
    assert [event.names for event in seen] == [("conv1",)]
    # After hvd.shutdown() and hvd.init(), a new engine with a bus of its own.
    later = _Engine()
    later.bus = EventBus()
    monkeypatch.setattr(runtime, "engine", lambda: later)
    now_seen = []
    later.bus.add(now_seen.append)
    group.allreduce_sum(torch.ones(2), "pool")
    assert len(seen) == 1 and [event.names for event in now_seen] == [("pool",)]
    assert engine.ended == later.ended == []


def test_close_is_idempotent_and_safe_after_shutdown(monkeypatch, engine):
    from hpdl.torch import runtime

    comm = _Comm(polls=1)
    group = _group(comm)
    group.exchange(*_strips(), "conv1")

    def not_initialized():
        raise ValueError("hpdl has not been initialized; use hvd.init().")

    monkeypatch.setattr(runtime, "engine", not_initialized)  # hvd.shutdown() has run
    group.close()
    group.close()
    assert comm.closed == 1 and comm.wait_hook is None
    with pytest.raises(HorovodInternalError, match="rank 7: this spatial group's communicator has been closed"):
        group.exchange(*_strips(), "conv1")


def test_close_after_a_failed_wait_leaves_the_abandoned_transfers_alone(engine):
    comm = _Comm()
    group = _group(comm, stall_timeout_s=0.01)
    with pytest.raises(HorovodInternalError):
        group.exchange(*_strips(), "conv1")
    group.close()
    group.close()
    assert comm.closed == 0  # the job is ending; the transfers under way end with the process


# --- the engine's side --------------------------------------------------------------------------

def test_the_engine_says_why_it_stopped_and_ends_the_job_for_a_caller(monkeypatch):
    from test_engine_thread import _PeerShutsDownComm, _small_allreduce

    from hpdl.config import Settings
    from hpdl.engine import abort
    from hpdl.engine.engine import Engine

    armed = []
    monkeypatch.setattr(abort, "arm", lambda comm, rank, message, stalled: armed.append((message, stalled)))
    comm = _PeerShutsDownComm()
    engine = Engine(Settings.from_env({}), comm)
    try:
        assert engine.stop_reason is None
        engine.end_job("the halo exchange of layer conv1 has not completed")
        message = "hpdl engine failed on rank 0: the halo exchange of layer conv1 has not completed"
        assert engine.stop_reason == message and armed[-1] == (message, False)
        with pytest.raises(HorovodInternalError, match="the halo exchange of layer conv1"):
            engine.submit(_small_allreduce("after"))
    finally:
        engine.shutdown(timeout=5)

    comm = _PeerShutsDownComm()
    engine = Engine(Settings.from_env({}), comm)
    try:
        comm.peer_shutdown = True
        engine.submit(_small_allreduce("wake"))  # a round now: it learns of the peer's shutdown
        deadline = time.monotonic() + 30
        while engine.stop_reason is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert engine.stop_reason.startswith("hpdl has been shut down (")  # naming the ranks that asked
        armed.clear()
        engine.end_job("the halo exchange of layer conv1 cannot complete")  # stopped already: the end is armed
        assert len(armed) == 1 and engine.stop_reason.startswith("hpdl has been shut down")
    finally:
        engine.shutdown(timeout=5)
