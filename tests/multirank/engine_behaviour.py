"""Engine behaviour seen through the public API: fusion, the response cache, poll().

Usage: engine_behaviour.py [in-turn LABEL ...]. Without an argument every check runs under the
job's settings ("OK engine behaviour ..."); with ``in-turn``, the checks of each LABEL of
IN_TURN run under its settings in turn, each with a fresh engine, and rank 0 prints
"OK LABEL: ..." for each. torch_api.py runs these checks under the default settings in its job.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import assert_equal, engine_with, run_main

import hpdl.torch as hvd
from hpdl.engine import HorovodInternalError
from hpdl.torch import runtime


def check_fusion(rank, size):
    # 200 tensors of 16 KiB submitted together go through far fewer backend calls.
    fused = []
    engine = runtime.engine()
    observer = lambda event: fused.append(event.fused) if event.phase == "COLLECTIVE" else None
    engine.bus.add(observer)
    before = engine.stats()
    for round_ in range(2):  # the second round must reuse the first round's fusion buffer
        tensors = [torch.full((4096,), float(rank + i)) for i in range(200)]
        handles = [hvd.allreduce_async_(t, name=f"fuse.{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
        for i, h in enumerate(handles):
            assert_equal(hvd.synchronize(h), torch.full((4096,), float(sum(range(size)) + size * i)), f"fused {i}")
    after = engine.stats()
    engine.bus.remove(observer)
    calls = after["backend_calls"] - before["backend_calls"]
    assert calls <= 80, f"2 x 200 small allreduces took {calls} backend calls: fusion is not working"
    assert max(fused) >= 10, f"largest fused collective carried {max(fused)} tensors"
    assert after["fusion_buffer_hits"] > before["fusion_buffer_hits"], "fusion buffer never reused"
    return calls, max(fused)


def check_cache(rank, size, steps=10, tensors=20):
    engine = runtime.engine()
    before = engine.stats()
    for step in range(steps):
        handles = [hvd.allreduce_async(torch.ones(10) * i, name=f"cache.{i}", op=hvd.Sum) for i in range(tensors)]
        for h in handles:
            hvd.synchronize(h)
    after = engine.stats()
    hits = after["cache_hits"] - before["cache_hits"]
    capacity = runtime.settings().cache_capacity
    if capacity == 0:
        assert hits == 0, f"cache disabled but {hits} hits"
    else:
        assert hits >= (steps - 2) * tensors, f"steady state should take the cached path: {hits} hits"
        assert after["fast_negotiations"] > before["fast_negotiations"]
    return hits


def check_gathering(rank, size, steps=15, tensors=20):
    """Gradients arriving a few milliseconds apart, none waited for until the step's end (as
    in backward): the engine gathers them into one round and one fused call per step, where a
    round per submission made a call per tensor. Only when the gather time is long enough
    that nothing but the bytes or the waiting caller can end a gathering is the count exact;
    a caller whose wait did not end it would hold each step for seconds."""
    engine = runtime.engine()
    settings = runtime.settings()
    before = None
    for step in range(-1, steps):
        if step == 0:
            # The first step's names were new: its full negotiation asks for a quick round
            # after it, which runs at once, gathering nothing. Counted from the next step on.
            time.sleep(0.2)
            before = engine.stats()
        handles = []
        for i in range(tensors):
            handles.append(hvd.allreduce_async(torch.full((256,), float(rank + i)), name=f"gather.{i}", op=hvd.Sum))
            time.sleep(0.002)
        for i, h in enumerate(handles):
            assert_equal(hvd.synchronize(h), torch.full((256,), float(sum(range(size)) + size * i)), f"gathered {i}")
    calls = engine.stats()["backend_calls"] - before["backend_calls"]
    if settings.gather_bytes >= tensors * 1024 and settings.gather_time_ms >= 10_000:
        assert calls == steps, f"{steps} steps of {tensors} gathered allreduces took {calls} backend calls"
    return calls


def check_backward_ends_its_gathering(rank, size, steps=3):
    """DistributedOptimizer tells the engine the bytes of the step still to come with each
    gradient: once backward has made the last one, nothing is held back, though no one waits
    yet (with a gather time too long to end it, they would be held for seconds). Returns the
    longest time from the end of backward to every allreduce done."""
    from hpdl.torch import mpi_ops

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    longest = 0.0
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 64)).sum().backward()
        ended = time.monotonic()
        handles = [submitted.handle for submitted in optimizer._pending.values()]
        assert len(handles) == 4, f"{len(handles)} allreduces submitted by backward"
        while not all(mpi_ops.poll(h) for h in handles) and time.monotonic() - ended < 30:
            time.sleep(0.002)
        longest = max(longest, time.monotonic() - ended)
        optimizer.step()
    return longest


def check_poll_in_flight(rank, size):
    if size == 1:
        return  # alone, nothing keeps the op in flight
    big = torch.ones(8 << 20)  # 32 MiB
    if rank == 0:
        h = hvd.allreduce_async_(big, name="poll.big", op=hvd.Sum)
        assert not hvd.poll(h), "poll() must be False while the other ranks have not even submitted"
        hvd.broadcast_object("go", 0, name="poll.go")
        while not hvd.poll(h):
            time.sleep(0.001)
    else:
        hvd.broadcast_object(None, 0, name="poll.go")
        h = hvd.allreduce_async_(big, name="poll.big", op=hvd.Sum)
    assert hvd.synchronize(h)[0].item() == float(size)


def check_shutdown_names_the_rank(rank, size):
    """Rank 0 shuts down while the others wait on an allreduce it never submits: their error
    names rank 0 (where its traceback, if it exited on an exception, is to be found)."""
    if size == 1:
        hvd.shutdown()
        return
    if rank == 0:
        hvd.barrier()
        hvd.shutdown()
        return
    handle = hvd.allreduce_async(torch.ones(2), name="never.on.rank.0")
    hvd.barrier()
    try:
        hvd.synchronize(handle)
    except HorovodInternalError as err:
        assert "rank 0 called hvd.shutdown()" in str(err), err
    else:
        raise AssertionError("an allreduce rank 0 never submitted completed")
    # A collective started afterwards says so too: this rank did not shut down, rank 0 did.
    try:
        hvd.allreduce(torch.ones(2), name="after.rank.0.left")
    except HorovodInternalError as err:
        assert "rank 0 called hvd.shutdown()" in str(err) and "init() again" not in str(err), err
    else:
        raise AssertionError("an allreduce after rank 0 shut down completed")
    hvd.shutdown()


def check_all(rank, size):
    """Every check under the job's settings; rank 0 prints what they saw. Shuts hpdl down."""
    calls, biggest = check_fusion(rank, size)
    hits = check_cache(rank, size)
    gathered_calls = check_gathering(rank, size)
    burst_done_s = check_backward_ends_its_gathering(rank, size)
    check_poll_in_flight(rank, size)
    check_shutdown_names_the_rank(rank, size)
    return (f"size={size} fusion_calls={calls} biggest_fused={biggest} cache_hits={hits} "
            f"gathered_calls={gathered_calls} burst_done_s={burst_done_s:.3f}")


def check_gathering_settings(rank, size):
    calls = check_gathering(rank, size)
    burst_done_s = check_backward_ends_its_gathering(rank, size)
    return f"gathered_calls={calls} burst_done_s={burst_done_s:.3f}"


# The settings a job can run checks under in turn, each with a fresh engine (settings are read at
# hvd.init()): LABEL -> (settings, checks). The gathering checks under a gather time too long to
# end a gathering (only the bytes or a waiting caller may) and under a round per submission;
# every check with Horovod's variables (one alias, one not honoured) and with a timeline, whose
# file the label names (timeline=PATH).
IN_TURN = {
    "held": ({"HPDL_GATHER_TIME": "60000"}, check_gathering_settings),
    "per-submission": ({"HPDL_GATHER_BYTES": "0"}, check_gathering_settings),
    "horovod-variables": ({"HOROVOD_CACHE_CAPACITY": "0", "HOROVOD_HIERARCHICAL_ALLGATHER": "1"}, check_all),
    "timeline": ({}, check_all),
}


def in_turn(labels):
    for label in labels:
        name, _, value = label.partition("=")
        settings, check = IN_TURN[name]
        if name == "timeline":
            settings = {"HPDL_TIMELINE": value}
        with engine_with(settings):
            rank = hvd.rank()
            seen = check(rank, hvd.size())  # check_all shuts hpdl down
            if rank == 0:
                print(f"OK {name}: {seen}", flush=True)


def main():
    if sys.argv[1:2] == ["in-turn"]:
        in_turn(sys.argv[2:])
        return
    hvd.init()
    rank = hvd.rank()
    seen = check_all(rank, hvd.size())
    if rank == 0:
        print(f"OK engine behaviour: {seen}")


if __name__ == "__main__":
    run_main(main)
