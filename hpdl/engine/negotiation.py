"""Name-based negotiation: every cycle, the members of a process set agree on which named
requests are ready on all of them, check that they match, and fix one order to run them in.

Two paths, as in Horovod:
- fast: when every pending request on every rank is in the response cache, one bitwise-AND
  allreduce of a small bit vector decides (no metadata travels);
- full: otherwise each rank sends the (name, signature) of every pending request; all ranks
  then compute the same ready list, validate it and update their caches identically.
The first word of the bit vector carries flags (OR-combined, stored inverted so that AND
yields OR) that switch to the full path, report a join or a shutdown; the second the process
sets with work (inverted too); the third each rank's room for prioritized allreduces, in
units, as that many low bits, so that AND yields the smallest room of all; the fourth the
autotuner's parameters from the set's rank 0 (autotune.py), every other member sending all ones
so that AND yields rank 0's word.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from hpdl.comm import Communicator, ReduceOp
from hpdl.engine import blocked
from hpdl.engine.cache import ResponseCache
from hpdl.engine.clock import SYSTEM_CLOCK, Clock
from hpdl.engine.request import Request, RequestKind, Response, Signature, signature_of

log = logging.getLogger("hpdl.engine")

FLAG_UNCACHED = 1  # a pending request is not cached (or its signature changed)
FLAG_STALL_CHECK = 2  # a request has waited long: exchange metadata to see who is missing
FLAG_JOINED = 4  # this rank has called join()
FLAG_SHUTDOWN = 8  # this rank is shutting down: every rank stops
FLAG_ABORT = 32  # rank 0 declared a stall timeout: the message travels in a full exchange
_JOIN = RequestKind.JOIN.value
_FULL = FLAG_UNCACHED | FLAG_STALL_CHECK | FLAG_JOINED | FLAG_ABORT
_MASK = 0xFFFFFFFF
ROOM_UNITS = 32  # the room word's resolution: a rank's window is this many units
_HEADER_WORDS = 4
TUNING_NONE = _MASK  # the tuning word of a member other than rank 0: AND leaves rank 0's

@dataclasses.dataclass
class CycleResult:
    """What one negotiation decided."""

    responses: List[Response]
    shutdown: bool = False
    shutdown_by: Tuple[int, ...] = ()  # with shutdown: the (global) ranks that asked for it
    abort: Optional[str] = None
    sets_pending: int = 0  # bit i: some member has requests pending for process set i
    full: bool = False
    room: int = ROOM_UNITS  # the least room for prioritized allreduces of any member, in units
    tuning: int = TUNING_NONE  # rank 0's autotuner word (autotune.decode)


def _describe_value(field: str, value: Any) -> str:
    if field in ("shape", "ranks") and value is not None:
        return str(list(value))
    if field == "scales" and value is not None:
        return f"prescale {value[0]}, postscale {value[1]}"
    if field == "group":
        return "no group" if value is None else f"group {value[0]!r} of {value[1]} tensors"
    return str(value)


def ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


# Each Signature field that must agree, in the words of a mismatch message, in the order fields
# are checked. Not ``splits``: each rank has its own (alltoall's).
_FIELD_TEXT = {
    "kind": "operations", "dtype": "data types", "device": "devices", "shape": "tensor shapes",
    "op": "reduction ops", "root": "root ranks", "scales": "scale factors", "group": "groups",
    "priority": "priorities", "ranks": "member ranks", "removed_set": "process set ids",
}
# The kinds of request that change the engine itself (RequestKind.controls_engine), by value:
# a mismatch names the calls, which have no tensor.
_CONTROL_KINDS = frozenset(kind.value for kind in RequestKind if kind.controls_engine)


def validate(name: str, signatures: Dict[int, Signature]) -> Optional[str]:
    """Return a message naming the tensor, the field and the ranks that differ, or None."""
    kind = next(iter(signatures.values())).kind
    for field, what in _FIELD_TEXT.items():
        values: Dict[Any, List[int]] = {}
        for rank, sig in sorted(signatures.items()):
            value = getattr(sig, field)
            if field == "shape" and kind in ("allgather", "alltoall") and value is not None:
                value = value[1:]  # only trailing dimensions must agree
            values.setdefault(value, []).append(rank)
        if len(values) > 1:
            parts = [f"{ranks_text(ranks)} {'has' if len(ranks) == 1 else 'have'} {_describe_value(field, v)}"
                     for v, ranks in values.items()]
            if kind in _CONTROL_KINDS:
                return (f"Mismatched {kind} calls ({name!r}; every rank must make the same calls in the same "
                        f"order): {what}: " + "; ".join(parts))
            if field == "shape" and kind in ("allgather", "alltoall"):
                what = "trailing tensor shapes"
            return f"Mismatched {kind} {what} for tensor {name!r}: " + "; ".join(parts)
    return None


class Controller:
    """Negotiation state of one process set on this rank (one per set the rank belongs to)."""

    def __init__(self, comm: Communicator, process_set_id: int, cache_capacity: int,
                 stall_warning_s: float, stall_timeout_s: float, global_ranks: Sequence[int],
                 clock: Clock = SYSTEM_CLOCK, waits: Optional[Callable[[float], Optional[blocked.Report]]] = None):
        """Args:
            waits: the world's controller: this rank's blocking waits once one has lasted the
                given seconds (blocked.py), which its stall checks carry, so that rank 0 can end
                waits that can never end.
        """
        self.comm = comm
        self.clock = clock  # requests' arrival times and stall checks are on it
        self.process_set_id = process_set_id
        self.rank = comm.rank
        self.size = comm.size
        self.global_ranks = list(global_ranks)
        self.cache = ResponseCache(cache_capacity, comm.rank)
        self.stall_warning_s = stall_warning_s
        self.stall_timeout_s = stall_timeout_s
        self.stall_check_interval = min(stall_warning_s / 2, 5.0)
        self._vector = np.zeros(_HEADER_WORDS + self.cache.words, dtype=np.int64)
        self._vector_tensor = torch.from_numpy(self._vector)
        self._last_full = 0.0
        self._incomplete_since: Dict[str, float] = {}
        self._warned_at: Dict[str, float] = {}
        self._abort: Optional[str] = None
        self._waits = waits
        # Each request that some active member has not submitted, with the global ranks missing
        # it, as of the last full exchange (what a wait for it needs: blocked.py).
        self.missing: Dict[str, List[int]] = {}
        self._joined_before: frozenset = frozenset()
        self.full_negotiations = 0
        self.fast_negotiations = 0

    # -- one cycle -------------------------------------------------------------------------

    def cycle(self, pending: "OrderedDict[str, Request]", flags: int = 0, sets_pending: int = 0,
              room: int = ROOM_UNITS, tuning: int = TUNING_NONE) -> CycleResult:
        """Agree with the other members on what to run now; collective over the set.

        Args:
            room: this rank's room for prioritized allreduces, 0 .. ROOM_UNITS units.
            tuning: on the set's rank 0, the autotuner's word; elsewhere TUNING_NONE.
        """
        now = self.clock.monotonic()
        positions: List[int] = []
        lookup = self.cache.lookup
        join = RequestKind.JOIN
        for name, request in pending.items():
            if request.kind is join:
                flags |= FLAG_JOINED
                continue
            position = lookup(name, request.signature())
            if position is None:
                flags |= FLAG_UNCACHED
            else:
                positions.append(position)
        if pending:
            oldest = next(iter(pending.values())).arrival  # pending is in arrival order
            if now - oldest > self.stall_check_interval and now - self._last_full > self.stall_check_interval:
                flags |= FLAG_STALL_CHECK
        # A thread of this rank blocked for long (in a collective of a spatial group, say) has the
        # stall checks run too, to learn whether the ranks it waits for wait for it.
        if (self._waits is not None and not flags & FLAG_STALL_CHECK
                and now - self._last_full > self.stall_check_interval and self._waits(self.stall_check_interval)):
            flags |= FLAG_STALL_CHECK
        if self._abort is not None:
            flags |= FLAG_ABORT

        vector = self._vector
        vector[:] = 0
        vector[0] = ~flags & _MASK
        vector[1] = ~sets_pending & _MASK
        vector[2] = (1 << max(0, min(room, ROOM_UNITS))) - 1
        vector[3] = tuning & _MASK
        self.cache.encode(positions, vector[_HEADER_WORDS:])
        self.comm.allreduce_control(self._vector_tensor, ReduceOp.BAND)
        any_flags = ~int(vector[0]) & _MASK
        result = CycleResult([], sets_pending=~int(vector[1]) & _MASK, room=int(vector[2]).bit_count(),
                             tuning=int(vector[3]))
        if any_flags & FLAG_SHUTDOWN:
            result.shutdown = True
            # Every member saw the flag in this round, so every member takes part in this
            # exchange: the others' errors can name the ranks that left (a shutdown() call, or
            # a rank's exit after an exception, whose traceback is where to look).
            asked = self.comm.allgather_object_control(bool(flags & FLAG_SHUTDOWN))
            result.shutdown_by = tuple(self.global_ranks[r] for r, a in enumerate(asked) if a)
            return result
        if any_flags & _FULL:
            self._full_exchange(pending, flags, now, result)
        else:
            self._fast(result)
        return result

    def _fast(self, result: CycleResult) -> None:
        self.fast_negotiations += 1
        positions = ResponseCache.decode(self._vector[_HEADER_WORDS:])
        cache = self.cache
        responses = _complete_groups([cache.get(p) for p in positions])
        if len(responses) == len(positions):
            for position in positions:
                cache.touch(position)
        else:  # a partial group stays pending: touch only what runs
            for response in responses:
                cache.touch(cache.lookup(response.name, response.signatures[self.rank]))
        cache.hits += len(responses)
        result.responses = responses

    def _full_exchange(self, pending: "OrderedDict[str, Request]", flags: int, now: float, result: CycleResult) -> None:
        self.full_negotiations += 1
        self._last_full = now
        # Signatures travel as plain tuples: a named tuple pickles as a call of its class, at
        # several times the cost of the tuple; each is made a Signature again on arrival.
        mine = [(name, tuple(request.signature())) for name, request in pending.items()]
        waits = self._waits(self.stall_check_interval) if self._waits is not None else None
        messages = self.comm.allgather_object_control((flags, mine, self._abort if self.rank == 0 else None, waits))
        result.full = True
        abort = messages[0][2]
        if abort is not None:
            result.abort = abort
            return
        joined = frozenset(r for r, (f, _, _, _) in enumerate(messages) if f & FLAG_JOINED)
        active = [r for r in range(self.size) if r not in joined]
        lists = [OrderedDict((name, signature_of(fields)) for name, fields in m[1]) for m in messages]

        responses: List[Response] = []
        # A request is ready when every member has submitted it or joined. Those of joined
        # members count too: the last member to join may have submitted some just before
        # (the last step's gradients, say), and they run, before join() returns, with the
        # tensors of the members that submitted them and zeros from the others.
        candidates = lists[active[0]] if active else OrderedDict(
            (name, sig) for entries in lists for name, sig in entries.items() if sig.kind != _JOIN)
        for name in candidates:
            if not all(name in lists[r] for r in active):
                continue
            sigs = {r: lists[r][name] for r in range(self.size) if name in lists[r]}
            error = validate(name, sigs)
            kind = RequestKind(next(iter(sigs.values())).kind)
            absent = tuple(r for r in sorted(joined) if name not in lists[r])  # they contribute zeros
            if error is None and absent and kind != RequestKind.ALLREDUCE:
                error = (f"{kind.value} of tensor {name!r} cannot run after "
                         f"{ranks_text(list(absent))} called join(); only allreduce can")
            signatures = tuple(lists[r].get(name) for r in range(self.size))
            responses.append(Response(name, kind, signatures, error=error, joined=absent))
        responses = _complete_groups(responses)
        if joined and len(joined) == self.size:
            newly = sorted(joined - self._joined_before) or sorted(joined)
            responses.append(Response("join", RequestKind.JOIN, tuple([None] * self.size), last_joined=newly[-1]))
            self._joined_before = frozenset()
        else:
            self._joined_before = joined
        for response in responses:
            if response.error is None and not response.joined and not response.kind.controls_engine:
                self.cache.put(response)
        self.cache.misses += len(responses)
        result.responses = responses
        self._track_stalls(lists, active, {r.name for r in responses}, now, [m[3] for m in messages])

    # -- stalls ----------------------------------------------------------------------------

    def _track_stalls(self, lists: List["OrderedDict[str, Signature]"], active: List[int], ready: set, now: float,
                      waits: List[Optional[blocked.Report]]) -> None:
        """On rank 0: warn about requests some ranks have not submitted, saying where those
        ranks wait (``waits``: each member's blocking waits, in the world's set); abort after the
        timeout, or once ranks have waited for each other for the stall warning."""
        waiting: Dict[str, List[int]] = {}
        for r in active:
            for name, sig in lists[r].items():
                if name not in ready and sig.kind != _JOIN:
                    waiting.setdefault(name, [])
        for name in waiting:
            waiting[name] = [self.global_ranks[r] for r in active if name not in lists[r]]
        for name in list(self._incomplete_since):
            if name not in waiting:
                del self._incomplete_since[name]
                self._warned_at.pop(name, None)
        self.missing = waiting
        if self.rank != 0:
            return
        stuck = blocked.deadlocked(waits, self.stall_warning_s)
        if stuck and self._abort is None:
            self._abort = blocked.describe(stuck, waits, self.global_ranks)
            return
        stalled_warn, stalled_abort = [], []
        for name, missing in waiting.items():
            since = self._incomplete_since.setdefault(name, now)
            age = now - since
            if age >= self.stall_timeout_s:
                stalled_abort.append((name, missing))
            elif age >= self.stall_warning_s and now - self._warned_at.get(name, 0.0) >= self.stall_warning_s:
                stalled_warn.append((name, missing))
                self._warned_at[name] = now
        # A name is matched within its process set: the same name submitted in another set
        # on the missing rank does not count, which only the set's number makes clear.
        where = f" in process set {self.process_set_id} (ranks {self.global_ranks})" if self.process_set_id else ""
        if stalled_warn:
            log.warning(
                "One or more tensors were submitted to be reduced, gathered or broadcasted by a subset of "
                "ranks%s and are waiting for the remainder for more than %.0f s. Stalled tensors:\n%s%s",
                where, self.stall_warning_s, _stall_lines(stalled_warn), _wait_lines(stalled_warn, waits),
            )
        if stalled_abort and self._abort is None:
            self._abort = (f"collectives stalled for more than {self.stall_timeout_s:g} s "
                           f"(HPDL_STALL_TIMEOUT){where}; ranks that have not submitted them:\n"
                           + _stall_lines(stalled_abort))


def _stall_lines(items: List[Tuple[str, List[int]]]) -> str:
    lines = [f"  {name}: missing {ranks_text(missing)}" for name, missing in items[:20]]
    if len(items) > 20:
        lines.append(f"  ... and {len(items) - 20} more")
    return "\n".join(lines)


def _wait_lines(items: List[Tuple[str, List[int]]], waits: List[Optional[blocked.Report]]) -> str:
    """Where the ranks missing the stalled ``items`` wait, of those blocked in a wait for long
    (``waits``, indexed by global rank: the world's set carries them)."""
    missing = sorted({r for _, ranks in items for r in ranks if r < len(waits) and waits[r] is not None})
    lines = [f"  rank {r} waits {'for' if engine else 'in'} {what} (for {age:.0f} s)"
             for r in missing for what, _needs, _call, age, engine in waits[r][0]]
    return "\nWhere those ranks wait:\n" + "\n".join(lines) if lines else ""


def _complete_groups(responses: List[Response]) -> List[Response]:
    """Keep grouped responses only when every member of their group is ready, members adjacent.

    A group with a failed member goes at once, complete or not: when the ranks disagree on the
    group (a different number of members), the members some rank never submits would hold
    the others back until the stall timeout. Each rank then fails the rest of its own members
    (Engine._fail_groups)."""
    groups: Dict[Tuple[str, int], List[Response]] = {}
    for response in responses:
        if response.group is not None:
            groups.setdefault(response.group, []).append(response)
    if not groups:
        return responses
    out, emitted = [], set()
    for response in responses:
        group = response.group
        if group is None:
            out.append(response)
        elif group not in emitted and (len(groups[group]) >= group[1]
                                       or any(member.error is not None for member in groups[group])):
            emitted.add(group)
            out.extend(groups[group])
    return out
