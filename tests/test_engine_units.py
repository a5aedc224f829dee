"""Engine pieces that need no other rank: cache, fusion plan, validation, handles, timeline,
the executor over fake backends. The scheduling policy: test_engine_scheduling.py; the engine
thread acting on it: test_engine_thread.py."""

import json
import threading

import numpy as np
import pytest
import torch

from hpdl.engine import events as ev
from hpdl.engine.cache import ResponseCache
from hpdl.engine.errors import HorovodInternalError
from hpdl.engine.fusion import FusionBuffers, plan_fusion
from hpdl.engine.handle import Handle
from hpdl.engine.negotiation import validate
from hpdl.engine.request import Op, Request, RequestKind, Response
from hpdl.engine.timeline import Timeline


def allreduce_response(name, numel, dtype=torch.float32, op=Op.SUM, group=None, ranks=2):
    req = Request(RequestKind.ALLREDUCE, name, tensor=torch.zeros(numel, dtype=dtype), op=op, group=group)
    return Response(name, RequestKind.ALLREDUCE, tuple([req.signature()] * ranks))


def test_cache_bits_round_trip():
    cache = ResponseCache(100, rank=0)
    words = np.zeros(cache.words, dtype=np.int64)
    cache.encode([0, 31, 32, 63, 99], words)
    assert ResponseCache.decode(words) == [0, 31, 32, 63, 99]


def test_cache_positions_are_deterministic_lru():
    a, b = ResponseCache(2, rank=0), ResponseCache(2, rank=1)
    for cache in (a, b):
        for name in ("x", "y"):
            cache.put(allreduce_response(name, 4))
        cache.touch(cache.lookup("x", allreduce_response("x", 4).signatures[0]))
        cache.put(allreduce_response("z", 4))  # evicts y, the least recently used
    assert a.names() == b.names() == {"x": 0, "z": 1}


def test_cache_miss_on_changed_signature():
    cache = ResponseCache(4, rank=0)
    cache.put(allreduce_response("x", 4))
    assert cache.lookup("x", allreduce_response("x", 4).signatures[0]) == 0
    assert cache.lookup("x", allreduce_response("x", 5).signatures[0]) is None


def test_fusion_respects_threshold_and_compatibility():
    small = [allreduce_response(f"s{i}", 256) for i in range(10)]  # 1 KiB each
    other = allreduce_response("d", 256, dtype=torch.float64)
    big = allreduce_response("big", 1 << 20)
    batches = plan_fusion(small[:5] + [other] + small[5:] + [big], threshold=4096)
    names = [[r.name for r in b] for b in batches]
    assert names == [["s0", "s1", "s2", "s3"], ["s4", "s5", "s6", "s7"], ["d"], ["s8", "s9"], ["big"]]


def test_fusion_leaves_large_tensors_in_place():
    """From the in-place threshold up a tensor runs alone (no copies); smaller ones still fuse,
    and a fixed group stays fused whatever its members' sizes."""
    small = [allreduce_response(f"s{i}", 256) for i in range(3)]  # 1 KiB each
    large = [allreduce_response(f"l{i}", 1024) for i in range(2)]  # 4 KiB each: at the threshold
    group = [allreduce_response(f"g.{i}", 1024, group=("g", 2)) for i in range(2)]
    responses = [small[0], large[0], small[1], large[1], small[2]] + group
    batches = plan_fusion(responses, threshold=1 << 20, inplace_threshold=4096)
    assert [[r.name for r in b] for b in batches] == [["s0", "s1", "s2", "g.0", "g.1"], ["l0"], ["l1"]]
    unlimited = plan_fusion(responses, threshold=1 << 20, inplace_threshold=0)
    assert [[r.name for r in b] for b in unlimited] == [["s0", "l0", "s1", "l1", "s2", "g.0", "g.1"]]


def test_fusion_keeps_groups_together():
    group = [allreduce_response(f"g.{i}", 256, group=("g", 3)) for i in range(3)]
    lone = allreduce_response("lone", 512)
    batches = plan_fusion([lone] + group, threshold=3 * 1024)
    assert [[r.name for r in b] for b in batches] == [["lone"], ["g.0", "g.1", "g.2"]]


def test_fusion_buffer_is_reused():
    buffers = FusionBuffers()
    a = buffers.get(torch.float32, torch.device("cpu"), 10, capacity_bytes=4096)
    b = buffers.get(torch.float32, torch.device("cpu"), 1000, capacity_bytes=4096)
    assert a.data_ptr() == b.data_ptr() and (buffers.hits, buffers.misses) == (1, 1)


def test_validation_names_tensor_field_and_ranks():
    sig = lambda shape, dtype=torch.float32: Request(RequestKind.ALLREDUCE, "w", tensor=torch.zeros(shape, dtype=dtype)).signature()
    assert validate("w", {0: sig((2,)), 1: sig((2,))}) is None
    message = validate("w", {0: sig((2,)), 1: sig((3,)), 2: sig((3,))})
    assert message == "Mismatched allreduce tensor shapes for tensor 'w': rank 0 has [2]; ranks 1, 2 have [3]"
    assert "data types" in validate("w", {0: sig((2,)), 1: sig((2,), torch.float64)})
    gather = lambda rows: Request(RequestKind.ALLGATHER, "g", tensor=torch.zeros(rows, 3)).signature()
    assert validate("g", {0: gather(1), 1: gather(5)}) is None  # first dims may differ


def test_a_signature_is_read_by_name_and_hashable():
    from hpdl.engine.negotiation import _FIELD_TEXT
    from hpdl.engine.request import Signature, signature_of

    sig = Request(RequestKind.ALLREDUCE, "w", tensor=torch.zeros(2, 3), op=Op.AVERAGE, prescale=0.5,
                  priority=4).signature()
    assert isinstance(sig, Signature)
    assert (sig.kind, sig.dtype, sig.shape, sig.device, sig.op, sig.root, sig.scales, sig.splits, sig.group,
            sig.priority) == ("allreduce", "float32", (2, 3), "cpu", "average", None, (0.5, 1.0), None, None, 4)
    # as it travels in a full exchange (a plain tuple) and comes back: equal, same hash, same key
    again = signature_of(tuple(sig))
    assert again == sig and hash(again) == hash(sig) and {sig: 1}[again] == 1 and again.shape == (2, 3)
    barrier = Request(RequestKind.BARRIER, "b").signature()
    assert barrier.kind == "barrier" and barrier.dtype is None and barrier.root is None
    # every field that must agree has its words; each rank has its own splits (alltoall's)
    assert list(_FIELD_TEXT) and set(_FIELD_TEXT) == set(Signature._fields) - {"splits"}


def test_handle_result_error_and_callbacks():
    h = Handle("x")
    seen = []
    h.add_done_callback(lambda handle: seen.append(handle.name))
    assert not h.poll()
    threading.Thread(target=h.set_result, args=(42,)).start()  # completed on another thread
    assert h.wait() == 42 and h.poll() and seen == ["x"]
    e = Handle("y")
    e.set_error(ValueError("boom"))
    with pytest.raises(HorovodInternalError, match="y: boom"):
        e.wait()
    with pytest.raises(TimeoutError):
        Handle("z").wait(timeout=0.01)


def test_timeline_is_chrome_trace(tmp_path):
    path = tmp_path / "t.json"
    timeline = Timeline(str(path))
    t = ev.now_us()
    timeline.observe(ev.Event(ev.QUEUED, "allreduce", ("a",), t))
    timeline.observe(ev.Event(ev.NEGOTIATED, "allreduce", ("a",), t + 10))
    timeline.observe(ev.Event(ev.COLLECTIVE, "allreduce", ("a",), t + 11, duration_us=5, nbytes=64, op="MPI_ALLREDUCE"))
    timeline.observe(ev.Event(ev.DONE, "allreduce", ("a",), t + 20))
    timeline.close()
    records = json.loads(path.read_text())
    assert "start_time_since_epoch_in_micros" in records[0]["args"]
    phases = [(r.get("name"), r["ph"]) for r in records[1:]]
    assert ("NEGOTIATE_ALLREDUCE", "B") in phases and ("ALLREDUCE", "B") in phases and ("MPI_ALLREDUCE", "X") in phases
    assert sum(1 for _, ph in phases if ph == "E") == 2


def test_event_bus_inactive_without_observers():
    bus = ev.EventBus()
    assert not bus.active
    got = []
    observer = got.append
    bus.add(observer)
    with ev.Span(bus, phase=ev.COLLECTIVE, kind="allreduce", names=("a",)):
        pass
    assert bus.active and got[0].phase == ev.COLLECTIVE
    bus.remove(observer)
    assert not bus.active


class _DoublingComm:
    """A stand-in for a 2-rank communicator whose peer holds the same values: SUM doubles."""

    name = "fake"
    rank = 0
    size = 2

    def __init__(self):
        self.calls = []

    def allreduce(self, tensor, op):
        self.calls.append(tensor.numel())
        tensor.mul_(2)

    def allreduce_start(self, tensor, op):
        from hpdl.comm.base import FINISHED

        self.allreduce(tensor, op)
        return FINISHED


class _LaterFlight:
    """A collective in flight that a test completes by hand (the backend's thread in real runs)."""

    poll_interval_s = 0.0
    runs_in_order = True

    def __init__(self, tensor):
        self.tensor = tensor
        self.finished = False
        self.callbacks = []

    def done(self):
        return self.finished

    def wait(self):
        if not self.finished:
            self.complete()

    def on_done(self, callback):
        self.callbacks.append(callback)

    def complete(self):
        self.tensor.mul_(2)  # the peer holds the same values: SUM doubles
        self.finished = True
        for callback in self.callbacks:
            callback()


class _BackgroundComm(_DoublingComm):
    """A 2-rank stand-in whose allreduces run in the background until the test completes them."""

    def __init__(self):
        super().__init__()
        self.flights = []

    def allreduce_start(self, tensor, op):
        self.calls.append(tensor.numel())
        self.flights.append(_LaterFlight(tensor))
        return self.flights[-1]


def _average_requests(count, numel, first=0):
    requests, responses = {}, []
    for i in range(first, first + count):
        tensor = torch.full((numel,), float(i))
        req = Request(RequestKind.ALLREDUCE, f"t{i}", tensor=tensor, op=Op.AVERAGE)
        req.handle = Handle(req.name)
        requests[req.name] = req
        responses.append(Response(req.name, RequestKind.ALLREDUCE, (req.signature(), req.signature())))
    return requests, responses


def test_background_allreduces_complete_their_handles_when_the_backend_is_done():
    from hpdl.engine.execution import Executor

    notified = []
    executor = Executor(ev.EventBus(), rank=0, fusion_threshold=1 << 20, inplace_threshold=1024,
                        on_done=lambda: notified.append(1))
    comm = _BackgroundComm()
    # two large tensors (in place, one call each) and three small ones (one fused call)
    requests, responses = _average_requests(2, 1024)
    small_requests, small_responses = _average_requests(3, 4, first=2)
    requests.update(small_requests)
    executor.run(comm, 0, responses + small_responses, requests, cycle=0)
    assert comm.calls == [1024, 1024, 12] and len(executor.in_flight) == 3
    assert not any(r.handle.poll() for r in requests.values())  # nothing is done before the backend
    comm.flights[1].complete()
    executor.complete()  # finishes in start order: the first is still running
    assert not any(r.handle.poll() for r in requests.values()) and notified == [1]
    comm.flights[0].complete()
    comm.flights[2].complete()
    executor.complete()
    assert not executor.in_flight and executor.oldest_in_flight() is None
    for i in range(5):  # averaged: (x + x) / 2
        torch.testing.assert_close(requests[f"t{i}"].handle.wait(), torch.full((1024 if i < 2 else 4,), float(i)))


def test_fused_batches_take_a_second_buffer_then_wait_for_the_oldest():
    from hpdl.engine.execution import Executor

    executor = Executor(ev.EventBus(), rank=0, fusion_threshold=1 << 20)
    comm = _BackgroundComm()
    first, first_responses = _average_requests(3, 4)
    executor.run(comm, 0, first_responses, first, cycle=0)
    second, second_responses = _average_requests(3, 4, first=3)
    # the first buffer is in flight: the second batch is fused into the other one, no waiting
    executor.run(comm, 0, second_responses, second, cycle=1)
    assert not any(r.handle.poll() for r in first.values())
    assert len(comm.flights) == 2 and executor.buffers.misses == 2
    third, third_responses = _average_requests(3, 4, first=6)
    # both buffers in flight: the third batch finishes the oldest and reuses its buffer
    executor.run(comm, 0, third_responses, third, cycle=2)
    assert all(r.handle.poll() for r in first.values())
    assert not any(r.handle.poll() for r in second.values())
    assert executor.buffers.misses == 2 and executor.buffers.hits == 1
    for i in range(3):
        torch.testing.assert_close(first[f"t{i}"].handle.wait(), torch.full((4,), float(i)))
    executor.complete(block=True)
    for i in range(3, 6):
        torch.testing.assert_close(second[f"t{i}"].handle.wait(), torch.full((4,), float(i)))
    for i in range(6, 9):
        torch.testing.assert_close(third[f"t{i}"].handle.wait(), torch.full((4,), float(i)))


def test_a_joined_rank_contributes_zeros_of_the_agreed_shape():
    from hpdl.engine.allreduce import InPlace

    _, responses = _average_requests(1, 6)  # this rank has joined: none of the batch's requests is its own
    alone = InPlace(responses, {}, comm=_DoublingComm(), join_device=-1, bus=ev.EventBus(), rank=0,
                    process_set_id=0, cycle=0)
    assert alone.members == [None] and alone.inputs[0] is alone.outputs[0]
    torch.testing.assert_close(alone.begin(), torch.zeros(6))
    assert alone.divisor == 2  # an average over both ranks, the joined one's zeros included


def test_collectives_in_flight_fail_with_the_engine():
    from hpdl.engine.execution import Executor

    executor = Executor(ev.EventBus(), rank=0, fusion_threshold=1 << 20)
    requests, responses = _average_requests(2, 4)
    executor.run(_BackgroundComm(), 0, responses, requests, cycle=0)
    executor.fail_in_flight(HorovodInternalError("lost: rank 1 does not answer"))
    for request in requests.values():
        with pytest.raises(HorovodInternalError, match="rank 1"):
            request.handle.wait()


def test_without_background_collectives_every_call_blocks():
    from hpdl.engine.execution import Executor

    executor = Executor(ev.EventBus(), rank=0, fusion_threshold=1 << 20, background=False)
    requests, responses = _average_requests(2, 4)
    comm = _BackgroundComm()
    executor.run(comm, 0, responses, requests, cycle=0)
    assert comm.flights == [] and comm.calls == [8]  # the blocking call, fused
    assert all(r.handle.poll() for r in requests.values())


@pytest.mark.parametrize("count", [3, 40])  # scaled while copying out, and by a pass over the buffer
def test_fused_average_writes_the_mean_into_every_output(count):
    from hpdl.engine.execution import Executor

    executor = Executor(ev.EventBus(), rank=0, fusion_threshold=1 << 20)
    requests, responses = {}, []
    for i in range(count):
        tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3) + i
        req = Request(RequestKind.ALLREDUCE, f"t{i}", tensor=tensor, output=torch.empty_like(tensor),
                      op=Op.AVERAGE, prescale=0.5, postscale=3.0)
        req.handle = Handle(req.name)
        requests[req.name] = req
        responses.append(Response(req.name, RequestKind.ALLREDUCE, (req.signature(), req.signature())))
    comm = _DoublingComm()
    executor.run(comm, 0, responses, requests, cycle=0)
    assert comm.calls == [6 * count]  # one fused backend call
    for i in range(count):
        expected = (torch.arange(6, dtype=torch.float32).reshape(2, 3) + i) * 0.5 * 2 * 3.0 / 2
        torch.testing.assert_close(requests[f"t{i}"].handle.wait(), expected)
        torch.testing.assert_close(requests[f"t{i}"].tensor, torch.arange(6, dtype=torch.float32).reshape(2, 3) + i)


def test_waiting_on_a_handle_calls_its_on_wait_hook():
    woken = []

    def on_wait(handle):  # the engine is told; it completes the handle on its own thread
        woken.append(handle)
        threading.Thread(target=handle.set_result, args=(1,)).start()

    h = Handle("w", on_wait=on_wait)
    assert h.wait() == 1 and woken == [h]
    h.wait()  # already done: no hook
    assert woken == [h]


def _prioritized(name, numel, priority):
    req = Request(RequestKind.ALLREDUCE, name, tensor=torch.zeros(numel), priority=priority)
    req.handle = Handle(name)
    return Response(name, RequestKind.ALLREDUCE, (req.signature(), req.signature())), req


def test_queued_allreduces_start_in_order_as_the_flight_window_has_room():
    from types import SimpleNamespace

    from hpdl.config import Settings
    from hpdl.engine.engine import Engine
    from hpdl.engine.process_set import ProcessSetState
    from hpdl.engine.scheduling import Scheduler

    started = []

    class _Executor:
        in_flight_bytes = 0

        def run(self, comm, ps_id, responses, requests, cycle):
            started.append([r.name for r in responses])
            self.in_flight_bytes += sum(r.nbytes for r in responses)

    executor = _Executor()
    scheduler = Scheduler(Settings.from_env({}, priority_window=32 * 4096, inplace_threshold=4096))
    engine = SimpleNamespace(executor=executor, _scheduler=scheduler, cycles=0)
    ps = ProcessSetState(0, [0, 1], None, None, paced=True, flight_window=2 * 4096)
    for prio in range(4):
        ps.backlog.add(*_prioritized(f"p{prio}", 1024, prio))
    ps.backlog.queue(32, scheduler.batches_to_queue)
    Engine._start_queued_of(engine, ps, everything=False)
    assert started == [["p0"], ["p1"]] and ps.backlog.queued_bytes == 2 * 4096  # the flight window is full
    Engine._start_queued_of(engine, ps, everything=False)
    assert len(started) == 2
    executor.in_flight_bytes = 4096  # the first one is done: room for one more
    Engine._start_queued_of(engine, ps, everything=False)
    assert started[-1] == ["p2"]
    Engine._start_queued_of(engine, ps, everything=True)  # before a round's own collectives: all of them
    assert started[-1] == ["p3"] and not ps.backlog.queued and ps.backlog.queued_bytes == 0


def test_priorities_must_agree_across_ranks():
    a = Request(RequestKind.ALLREDUCE, "w", tensor=torch.zeros(4), priority=1).signature()
    b = Request(RequestKind.ALLREDUCE, "w", tensor=torch.zeros(4), priority=2).signature()
    message = validate("w", {0: a, 1: b})
    assert "priorities" in message and "'w'" in message


@pytest.mark.parametrize("in_order", [True, False])
def test_a_background_collective_is_timed_from_when_the_backend_was_free_of_the_earlier_ones(in_order, monkeypatch):
    from hpdl.engine.execution import Executor

    now = [1_000_000.0]  # the events' clock, in microseconds, moved by the test
    monkeypatch.setattr(ev, "now_us", lambda: now[0])
    bus = ev.EventBus()
    collectives = []
    bus.add(lambda e: collectives.append(e) if e.phase == ev.COLLECTIVE else None)
    executor = Executor(bus, rank=0, fusion_threshold=1 << 20, inplace_threshold=1024)
    comm = _BackgroundComm()
    requests, responses = _average_requests(2, 1024)  # two in-place allreduces, started together
    executor.run(comm, 0, responses, requests, cycle=0)
    for flight in comm.flights:
        flight.runs_in_order = in_order
    now[0] += 50_000
    comm.flights[0].complete()
    now[0] += 50_000
    comm.flights[1].complete()
    executor.complete()
    first, second = collectives
    assert (first.time_us, first.duration_us) == (1_000_000, 50_000)  # from its start
    if in_order:
        # the second waited behind the first: its own time starts when the first finished
        assert (second.time_us, second.duration_us) == (1_050_000, 50_000)
    else:
        # side by side (MPI's non-blocking collectives): from its own start
        assert (second.time_us, second.duration_us) == (1_000_000, 100_000)


class _TwoRankComm:
    """Just what a Controller reads when it is made: this rank and the set's size."""

    rank, size = 0, 2


def test_a_stall_in_a_process_set_names_the_set():
    # The same name submitted in the global set by the "missing" rank does not count in this
    # one: without the set in the message, "m: missing rank 2" reads as a false accusation.
    from collections import OrderedDict

    from hpdl.engine.negotiation import Controller

    controller = Controller(_TwoRankComm(), 1, 0, stall_warning_s=60.0, stall_timeout_s=0.0, global_ranks=[0, 2])
    sig = Request(RequestKind.ALLREDUCE, "m", tensor=torch.zeros(1)).signature()
    controller._track_stalls([OrderedDict(m=sig), OrderedDict()], [0, 1], set(), now=1.0, waits=[None, None])
    assert controller._abort.startswith("collectives stalled for more than 0 s (HPDL_STALL_TIMEOUT) in process set 1 "
                                        "(ranks [0, 2]); ranks that have not submitted them:\n  m: missing rank 2")


def test_a_group_the_ranks_disagree_on_fails_at_once_though_incomplete():
    # Rank 0 groups three tensors under "g", rank 1 two: the members both submitted fail on
    # every rank now (each rank then fails its own other members), instead of waiting for a
    # third member rank 1 never submits until the stall timeout.
    from hpdl.engine.negotiation import _complete_groups

    def member(i, rank_counts):
        sigs = tuple(Request(RequestKind.ALLREDUCE, f"g.{i}", tensor=torch.zeros(1), group=("g", n)).signature()
                     for n in rank_counts)
        return Response(f"g.{i}", RequestKind.ALLREDUCE, sigs, error=validate(f"g.{i}", dict(enumerate(sigs))))

    members = [member(i, (3, 2)) for i in range(2)]
    assert members[0].error == ("Mismatched allreduce groups for tensor 'g.0': rank 0 has group 'g' of 3 tensors; "
                                "rank 1 has group 'g' of 2 tensors")
    assert [r.name for r in _complete_groups(members)] == ["g.0", "g.1"]
    agreed = [allreduce_response(f"h.{i}", 1, group=("h", 3)) for i in range(2)]
    assert _complete_groups(agreed) == []  # an incomplete group without errors still waits


def test_an_allreduce_against_an_allgather_fails_naming_both_kinds():
    # What a DistributedOptimizer meets when a sparse gradient was not produced on some rank: the
    # engine names the operations, and its error carries the kinds, for the optimizer's advice
    # (hpdl/torch/optimizer_base.py); the engine gives none of its own.
    dense = Request(RequestKind.ALLREDUCE, "allreduce.embed.weight", tensor=torch.zeros(10, 4)).signature()
    gathered = Request(RequestKind.ALLGATHER, "allreduce.embed.weight", tensor=torch.zeros(3, 1)).signature()
    message = validate("allreduce.embed.weight", {0: gathered, 1: dense})
    assert message == ("Mismatched allgather operations for tensor 'allreduce.embed.weight': "
                       "rank 0 has allgather; rank 1 has allreduce")
    error = Response("allreduce.embed.weight", RequestKind.ALLGATHER, (gathered, dense), error=message).refused()
    assert isinstance(error, HorovodInternalError) and str(error) == message
    assert error.kinds == {"allgather", "allreduce"} and error.joined == ()


def test_requests_that_change_the_engine_name_their_member_ranks_and_sets():
    add = [Request(RequestKind.ADD_PROCESS_SET, "process_set.add.0", ranks=ranks).signature()
           for ranks in ((0, 1), (0, 2))]
    assert validate("process_set.add.0", dict(enumerate(add))) == (
        "Mismatched add_process_set calls ('process_set.add.0'; every rank must make the same calls in the same "
        "order): member ranks: rank 0 has [0, 1]; rank 1 has [0, 2]")
    remove = [Request(RequestKind.REMOVE_PROCESS_SET, "process_set.remove.1", removed_set=set_id).signature()
              for set_id in (1, 2)]
    assert validate("process_set.remove.1", dict(enumerate(remove))).endswith(
        "process set ids: rank 0 has 1; rank 1 has 2")
    assert all(kind.controls_engine == (kind in (RequestKind.JOIN, RequestKind.ADD_PROCESS_SET,
                                                RequestKind.REMOVE_PROCESS_SET, RequestKind.SPLIT_COMMUNICATOR))
               for kind in RequestKind)