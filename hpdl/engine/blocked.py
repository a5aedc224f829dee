"""What this rank's threads are blocked on, so that waits that can never end end the job.

Each rank's engine sees only its own collectives. A rank that waits for a peer's gradient (in
an optimizer's step) while that peer waits for it elsewhere (in a spatial group's halo
exchange or collective, or for another collective) would wait until the stall timeout
(``HPDL_STALL_TIMEOUT``, 30 minutes by default): a rank that skipped ``backward()`` but
stepped, say. So every blocking wait of a caller's thread is registered here while it lasts:
a handle's wait (``hvd.synchronize``, the optimizer's step, any blocking collective) and a
spatial group's call that has to wait (hpdl/torch/spatial/comm.py). The world's negotiation
carries each rank's waits in its stall checks (negotiation.py), and rank 0 looks for ranks
none of which can go on (:func:`deadlocked`): every wait of each needs another of them, which
is blocked in a wait of its own. Once every such wait has lasted the stall warning
(``HPDL_STALL_WARNING``), the job ends with one message saying who waits for what
(:func:`describe`), instead of at the stall timeout.

A wait counts as blocked only while its rank submits nothing new (a submission restarts its
age): a rank whose other thread still submits is going on. The one case this cannot see is a
rank whose other thread computes for longer than the stall warning without submitting, and
only then submits what its blocked thread's peers wait for: a thread of a user's own that
takes part in collectives beside the training thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple


class Wait:
    """One thread's blocking wait, while it lasts."""

    __slots__ = ("describe", "request", "needs", "call", "since", "submissions")

    def __init__(self, describe: Callable[[], str], submissions: int, request: Optional[Tuple[int, str]] = None,
                 needs: Tuple[int, ...] = (), call: Optional[tuple] = None):
        self.describe = describe  # the wait, in words ("the halo exchange of layer body.0 ..."), read when reported
        self.request = request  # a handle's wait: (process set, name); the ranks it needs are the engine's to say
        self.needs = needs  # a wait outside the engine: the world ranks of the group it waits in
        self.call = call  # a call of a group outside the engine: (the group, the call's number), alike on its ranks
        self.since = time.monotonic()
        self.submissions = submissions  # the rank's submissions when it began (or was last seen going on)


# One wait as reported in negotiation: its words, the world ranks it needs, its call (None for
# a handle's wait), its age in seconds, and whether it waits for a collective of the engine
# (whose needs are the ranks that have not submitted it).
WaitReport = Tuple[str, Tuple[int, ...], Optional[tuple], float, bool]
# One rank's report: its waits, and how many calls it has completed in each of its groups (a
# peer that completed a call has done its part of it, wherever it waits now).
Report = Tuple[List[WaitReport], Dict[Any, int]]


class Blocked:
    """The blocking waits of this process's threads. Any thread may begin and end its own waits;
    the engine thread reads them (single dict operations, atomic under the GIL)."""

    def __init__(self) -> None:
        self._waits: Dict[int, Wait] = {}
        self.submissions = 0  # collectives this process has submitted (the engine counts them)
        self.completed: Dict[Any, int] = {}  # each group's calls completed here, by group (the callers count them)

    def begin(self, wait: Wait) -> int:
        """Register ``wait`` for the calling thread; returns the key that :meth:`end` takes."""
        key = threading.get_ident()
        self._waits[key] = wait
        return key

    def end(self, key: int) -> None:
        self._waits.pop(key, None)

    def waiting(self) -> bool:
        return bool(self._waits)

    def report(self, min_age_s: float, needs_of: Callable[[int, str], Tuple[int, ...]]) -> Optional[Report]:
        """This process's waits and its groups' completed calls, when one of the waits has been
        blocked ``min_age_s`` at least (else None). A wait begun before the process's last
        submission is going on: its age restarts. ``needs_of(set, name)``: the world ranks that
        have not submitted a request."""
        waits = list(self._waits.values())
        if not waits:
            return None
        now = time.monotonic()
        submissions = self.submissions
        for wait in waits:
            if wait.submissions != submissions:
                wait.submissions, wait.since = submissions, now
        if max(now - w.since for w in waits) < min_age_s:
            return None
        return ([(w.describe(), needs_of(*w.request) if w.request is not None else tuple(w.needs), w.call,
                  now - w.since, w.request is not None) for w in waits], dict(self.completed))


BLOCKED = Blocked()


def deadlocked(reports: Sequence[Optional[Report]], min_age_s: float) -> List[int]:
    """The ranks (indices of ``reports``, None for a rank not blocked for long) none of which
    can go on, or none: the largest set of ranks, each blocked in waits of ``min_age_s`` at
    least, whose every wait needs another rank of the set. A wait for a collective of the engine
    needs the ranks that have not submitted it; a wait in a group's call, the group's ranks that
    have neither completed that call nor are in it (those take part; one blocked elsewhere,
    short of it, never will)."""
    stuck: Set[int] = {r for r, report in enumerate(reports)
                       if report is not None and report[0] and all(w[3] >= min_age_s for w in report[0])}

    def needed(rank: int, wait: WaitReport) -> bool:
        call = wait[2]
        for peer in wait[1]:
            if peer == rank or peer not in stuck:
                continue
            if call is not None:
                group, number = call
                theirs = reports[peer]
                if any(other[2] == call for other in theirs[0]) or theirs[1].get(group, 0) > number:
                    continue  # in the same call, or done with it
            return True
        return False

    changed = True
    while changed:
        changed = False
        for rank in sorted(stuck):
            if not all(needed(rank, wait) for wait in reports[rank][0]):
                stuck.discard(rank)
                changed = True
    return sorted(stuck)


def describe(ranks: Sequence[int], reports: Sequence[Optional[Report]], global_ranks: Sequence[int]) -> str:
    """The message for ``ranks`` (indices of ``reports``; named by ``global_ranks``) that wait
    for each other."""
    def named(rs: Sequence[int]) -> str:
        return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(str(r) for r in rs)

    each = []
    for rank in ranks:
        for what, needs, _call, age, engine in reports[rank][0]:
            if engine:
                verb = "has" if len(needs) == 1 else "have"
                each.append(f"rank {global_ranks[rank]} waits for {what}, which {named(needs)} {verb} not submitted "
                            f"(for {age:.0f} s)")
            else:
                each.append(f"rank {global_ranks[rank]} waits in {what} (for {age:.0f} s)")
    return (f"{named([global_ranks[r] for r in ranks])} wait for each other, and none can go on: "
            + "; ".join(each) + ": a rank skipped a call the others made (a backward() before the optimizer's "
            "step, a collective), or made them in another order")
