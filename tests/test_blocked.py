"""Waits that can never end (hpdl/engine/blocked.py): which ranks the stall checks find blocked
for good, which they leave alone, and the words that end the job. The jobs that meet them are
in tests/test_torch_multirank.py (collectives of the engine) and tests/test_spatial_failures.py
(a spatial group's call against the optimizer's allreduces)."""

from __future__ import annotations

from collections import OrderedDict

import torch

from hpdl.engine import blocked
from hpdl.engine.blocked import Blocked, Wait, deadlocked, describe
from hpdl.engine.request import Request, RequestKind

GROUP = (0, (0, 1, 2))  # a spatial group's key: its serial number and world ranks
LONG = 90.0


def engine_wait(name, missing, age=LONG):
    return (name, tuple(missing), None, age, True)


def group_wait(what, needs, number, age=LONG):
    return (what, tuple(needs), (GROUP, number), age, False)


def test_two_ranks_each_waiting_for_a_collective_the_other_never_submits():
    reports = [([engine_wait("a", [1])], {}), ([engine_wait("b", [0])], {})]
    assert deadlocked(reports, 60.0) == [0, 1]


def test_a_rank_waiting_for_one_that_computes_is_left_alone():
    reports = [([engine_wait("a", [1])], {}), None]
    assert deadlocked(reports, 60.0) == []


def test_waits_younger_than_the_stall_warning_are_left_alone():
    reports = [([engine_wait("a", [1], age=59.0)], {}), ([engine_wait("b", [0])], {})]
    assert deadlocked(reports, 60.0) == []


def test_ranks_in_the_same_call_of_a_group_take_part_in_it():
    # Both in the group's allgather number 4, waiting for rank 2, which computes.
    reports = [([group_wait("allgather", [1, 2], 4)], {GROUP: 4}), ([group_wait("allgather", [0, 2], 4)], {GROUP: 4}),
               None]
    assert deadlocked(reports, 60.0) == []


def test_a_spatial_call_against_the_optimizers_allreduce():
    # Rank 1 skipped its backward and steps: it waits for gradients rank 0 has not submitted,
    # while rank 0 waits in the group's call 7, which rank 1 has not reached (7 calls completed).
    reports = [([group_wait("allgather of calls", [1], 7)], {GROUP: 7}),
               ([engine_wait("allreduce.w", [0])], {GROUP: 7})]
    assert deadlocked(reports, 60.0) == [0, 1]


def test_a_peer_that_completed_the_call_has_done_its_part():
    # Rank 1 finished halo exchange 10 and waits in the optimizer for rank 0's gradients; rank 0
    # still waits in exchange 10 for rank 2, which computes: rank 2 will end both waits.
    reports = [([group_wait("halo exchange", [1, 2], 10)], {GROUP: 10}),
               ([engine_wait("allreduce.w", [0, 2])], {GROUP: 11}), None]
    assert deadlocked(reports, 60.0) == []
    # Had rank 1 not completed exchange 10, it would never: both wait for good.
    reports[1] = ([engine_wait("allreduce.w", [0, 2])], {GROUP: 10})
    assert deadlocked(reports, 60.0) == [0, 1]


def test_a_rank_with_a_thread_whose_wait_can_end_is_not_blocked_for_good():
    reports = [([engine_wait("a", [1]), engine_wait("c", [2])], {}), ([engine_wait("b", [0])], {}), None]
    assert deadlocked(reports, 60.0) == []


def test_a_ring_of_three_ranks():
    reports = [([engine_wait("a", [1])], {}), ([engine_wait("b", [2])], {}), ([engine_wait("c", [0])], {})]
    assert deadlocked(reports, 60.0) == [0, 1, 2]


def test_the_message_says_who_waits_for_what():
    reports = [([group_wait("the spatial group's allgather of calls in backward (world ranks 0, 1)", [1], 7)], {}),
               ([engine_wait("allreduce.w", [0])], {})]
    assert describe([0, 1], reports, [0, 1]) == (
        "ranks 0, 1 wait for each other, and none can go on: rank 0 waits in the spatial group's allgather of calls "
        "in backward (world ranks 0, 1) (for 90 s); rank 1 waits for allreduce.w, which rank 0 has not submitted "
        "(for 90 s): a rank skipped a call the others made (a backward() before the optimizer's step, a "
        "collective), or made them in another order")


def test_a_submission_restarts_the_age_of_the_waits_before_it(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(blocked.time, "monotonic", lambda: now[0])
    registry = Blocked()
    key = registry.begin(Wait("x".__str__, registry.submissions, request=(0, "x")))
    now[0] = 105.0
    assert registry.report(4.0, lambda set_id, name: (1,)) == ([("x", (1,), None, 5.0, True)], {})
    assert registry.report(6.0, lambda set_id, name: (1,)) is None  # not yet that long
    registry.submissions += 1  # another thread of the rank submitted: it goes on
    now[0] = 108.0
    assert registry.report(1.0, lambda set_id, name: (1,)) is None  # its age restarted now
    now[0] = 110.0
    assert registry.report(1.0, lambda set_id, name: (1,))[0][0][3] == 2.0
    registry.end(key)
    assert registry.report(0.0, lambda set_id, name: ()) is None and not registry.waiting()


class _TwoRankComm:
    rank, size = 0, 2


def test_rank_0s_stall_check_ends_the_job_with_the_message():
    from hpdl.engine.negotiation import Controller

    controller = Controller(_TwoRankComm(), 0, 0, stall_warning_s=60.0, stall_timeout_s=1800.0, global_ranks=[0, 1])
    sig = Request(RequestKind.ALLREDUCE, "b", tensor=torch.zeros(1)).signature()
    waits = [([engine_wait("a", [1])], {}), ([engine_wait("b", [0])], {})]
    controller._track_stalls([OrderedDict(), OrderedDict(b=sig)], [0, 1], set(), now=1.0, waits=waits)
    assert controller.missing == {"b": [0]}  # what a wait for "b" needs, on every rank
    assert controller._abort.startswith("ranks 0, 1 wait for each other, and none can go on: rank 0 waits for a, "
                                        "which rank 1 has not submitted (for 90 s)")


def test_the_stall_warning_says_where_the_missing_ranks_wait(caplog):
    from hpdl.engine.negotiation import Controller

    controller = Controller(_TwoRankComm(), 0, 0, stall_warning_s=1.0, stall_timeout_s=1800.0, global_ranks=[0, 1])
    sig = Request(RequestKind.ALLREDUCE, "b", tensor=torch.zeros(1)).signature()
    waits = [([group_wait("the halo exchange of layer conv2", [2], 3)], {}), None]  # rank 2 computes
    controller._track_stalls([OrderedDict(), OrderedDict(b=sig)], [0, 1], set(), now=1.0, waits=waits)
    controller._track_stalls([OrderedDict(), OrderedDict(b=sig)], [0, 1], set(), now=3.0, waits=waits)
    assert controller._abort is None
    assert "b: missing rank 0\nWhere those ranks wait:\n  rank 0 waits in the halo exchange of layer conv2 (for 90 s)" \
        in caplog.text
