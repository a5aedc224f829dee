"""How hpdl.torch's calls wait on their engine handles, in one process without hvd.init(): a call
of several handles (a group's members) that fails raises only once none of them is in flight."""

import threading

import pytest
import torch

from hpdl.engine import Handle, HorovodInternalError
from hpdl.torch import allreduce_ops, mpi_ops

MISMATCH = "Mismatched allreduce groups for tensor 'group.0.0': rank 0 has group 'group.0' of 3 tensors"


def _submitted(in_flight, *names):
    """Handles as ``Engine.submit`` makes them: each name in flight until its handle completes."""
    handles = []
    for name in names:
        in_flight.add((0, name))
        handles.append(Handle(name, in_flight, (0, name)))
    return handles


def _fail_later(handle, seconds=0.3):
    """Fail ``handle`` from another thread after ``seconds``, as the engine thread fails a group's
    other member a moment after the first (still in its queue, or later in the round)."""
    timer = threading.Timer(seconds, handle.set_error, [HorovodInternalError(MISMATCH)])
    timer.start()
    return timer


def test_a_failed_group_raises_once_none_of_its_members_is_in_flight_so_a_retry_is_accepted():
    in_flight = set()
    first, second = _submitted(in_flight, "group.0.0", "group.0.1")
    first.set_error(HorovodInternalError(MISMATCH))
    timer = _fail_later(second)
    with pytest.raises(HorovodInternalError, match="Mismatched allreduce groups"):
        mpi_ops.synchronize(mpi_ops.AsyncHandle([first, second], list))
    assert in_flight == set()  # the user's retry under the same names is not refused
    timer.join()


def test_a_failed_sparse_allreduce_raises_once_neither_allgather_is_in_flight(monkeypatch):
    in_flight = set()
    indices, values = _submitted(in_flight, "emb", "emb.values")
    handles = iter([indices, values])
    monkeypatch.setattr(allreduce_ops, "submit", lambda request: next(handles))
    result = allreduce_ops.sparse_allreduce_async(torch.eye(2).to_sparse(), "emb")
    indices.set_error(HorovodInternalError("Mismatched allgather and allreduce for tensor 'emb'"))
    timer = _fail_later(values)
    with pytest.raises(HorovodInternalError, match="Mismatched allgather"):
        result()
    assert in_flight == set()
    timer.join()


def test_a_group_whose_members_succeed_returns_every_result_in_order():
    in_flight = set()
    members = _submitted(in_flight, "g.0", "g.1")
    threading.Timer(0.1, members[1].set_result, [torch.ones(1)]).start()
    members[0].set_result(torch.zeros(1))
    assert [t.item() for t in mpi_ops.synchronize(mpi_ops.AsyncHandle(members, list))] == [0.0, 1.0]
    assert in_flight == set()
