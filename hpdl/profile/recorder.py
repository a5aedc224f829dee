"""The recorder: an event observer that turns one rank's engine events into profile tables.

Memory stays bounded on long runs. Totals over the whole recording are kept per distinct
backend message (kind, backend, dtype, size, tensors fused: a training job repeats a few
dozen) and per tensor; per-step aggregates are kept for the last :data:`STEP_WINDOW` steps
and raw collectives (one row each, with phase times and member tensors) for the last
:data:`RAW_WINDOW` collectives; how many older ones were dropped is recorded.

A collective's phases: queue wait (its last member's submission until the engine thread
took that request from its queue), negotiation (until the ranks agreed to run it), copy in
(into the fusion buffer), backend call, copy out. Its ``ready_us`` is when its last member
was submitted: when this rank arrived at it.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Dict, Optional, Tuple

from hpdl.engine import events as ev
from hpdl.profile import schema

STEP_WINDOW = 100_000
RAW_WINDOW = 50_000

# Indexes into a per-message totals list (schema.MESSAGE_COLUMNS from "calls" on).
_CALLS, _BACKEND, _COPY_IN, _COPY_OUT, _QUEUE, _NEGOTIATE, _MIN, _MAX = range(8)


class Recorder:
    """Collect one rank's collectives and steps; thread-safe (events come from two threads)."""

    def __init__(self, rank: int, zero_us: float, raw_window: int = RAW_WINDOW, step_window: int = STEP_WINDOW):
        """Args:
            zero_us: this rank's wall-clock time (µs since the epoch) that is time 0 in the
                tables: the job's origin plus this rank's clock offset to rank 0.
        """
        self.rank = rank
        self.zero_us = zero_us
        self._lock = threading.Lock()
        self._names: Dict[str, int] = {}
        self._queued: Dict[Tuple[int, str], float] = {}
        self._negotiated: Dict[Tuple[int, str], Tuple[float, float]] = {}
        # Copy-in time by message (its names) until its collective ends: several fused
        # messages may be in flight at once.
        self._copy_in: Dict[Tuple[str, ...], float] = {}
        self._last: Optional[Tuple[Tuple[str, ...], list, list]] = None  # names, raw row, message totals
        self._seq: Dict[int, int] = collections.defaultdict(int)
        self._messages: Dict[tuple, list] = {}
        self._tensors: Dict[Tuple[str, str], list] = {}
        self._raw: "collections.deque[list]" = collections.deque(maxlen=raw_window)
        self._steps: "collections.deque[list]" = collections.deque(maxlen=step_window)
        self.collectives_seen = 0
        self.steps_seen = 0
        self._step_start = ev.now_us() - zero_us
        self._step_comm = [0.0, 0, 0]  # engine time, messages, bytes of the current step
        self.paused = False

    def observe(self, event: ev.Event) -> None:
        """Take one engine event (the observer given to ``events.subscribe``)."""
        if self.paused:
            return
        phase = event.phase
        with self._lock:
            if phase == ev.QUEUED:
                self._queued[(event.process_set_id, event.names[0])] = event.time_us
            elif phase == ev.NEGOTIATED:
                self._negotiated[(event.process_set_id, event.names[0])] = (event.drained_us, event.time_us)
            elif phase == ev.MEMCPY_IN:
                self._copy_in[event.names] = event.duration_us
            elif phase == ev.COLLECTIVE:
                self._collective(event)
            elif phase == ev.MEMCPY_OUT:
                self._copy_out(event)
            elif phase == ev.DONE:
                key = (event.process_set_id, event.names[0])
                self._queued.pop(key, None)
                self._negotiated.pop(key, None)
            elif phase == ev.STEP:
                self._step(event)

    def _name_index(self, name: str) -> int:
        index = self._names.get(name)
        if index is None:
            index = self._names[name] = len(self._names)
        return index

    def _collective(self, event: ev.Event) -> None:
        ps = event.process_set_id
        zero = self.zero_us
        # The member submitted last decides when this rank was ready, and its waits are the message's.
        ready, drained, negotiated = event.time_us, event.time_us, event.time_us
        latest = None
        for name in event.names:
            queued = self._queued.pop((ps, name), None)
            if queued is not None and (latest is None or queued > latest):
                latest = queued
                drained, negotiated = self._negotiated.pop((ps, name), (queued, queued))
            else:
                self._negotiated.pop((ps, name), None)
        if latest is not None:
            ready = latest
        copy_in = self._copy_in.pop(event.names, 0.0)
        queue_us, negotiate_us = max(0.0, drained - ready), max(0.0, negotiated - drained)
        backend_us = event.duration_us
        seq = self._seq[ps]
        self._seq[ps] = seq + 1
        step = self.steps_seen
        row = [seq, step, ps, event.kind, event.backend, event.dtype, event.nbytes, event.fused,
               [self._name_index(n) for n in event.names], list(event.sizes), ready - zero, queue_us, negotiate_us,
               event.time_us - zero, copy_in, backend_us, 0.0]
        self._raw.append(row)
        self.collectives_seen += 1
        key = (event.kind, event.backend, event.dtype, event.nbytes, event.fused)
        totals = self._messages.get(key)
        if totals is None:
            totals = self._messages[key] = [0, 0.0, 0.0, 0.0, 0.0, 0.0, backend_us, backend_us]
        totals[_CALLS] += 1
        totals[_BACKEND] += backend_us
        totals[_COPY_IN] += copy_in
        totals[_QUEUE] += queue_us
        totals[_NEGOTIATE] += negotiate_us
        totals[_MIN] = min(totals[_MIN], backend_us)
        totals[_MAX] = max(totals[_MAX], backend_us)
        sizes = event.sizes or (event.nbytes,)
        total_bytes = sum(sizes) or 1
        for name, nbytes in zip(event.names, sizes):
            entry = self._tensors.get((event.kind, name))
            if entry is None:
                entry = self._tensors[(event.kind, name)] = [nbytes, 0, 0.0]
            entry[1] += 1
            entry[2] += backend_us * nbytes / total_bytes  # the tensor's share of the message's time
        self._step_comm[0] += copy_in + backend_us
        self._step_comm[1] += 1
        self._step_comm[2] += event.nbytes
        self._last = (event.names, row, totals)

    def _copy_out(self, event: ev.Event) -> None:
        if self._last is None or self._last[0] != event.names:
            return
        _, row, totals = self._last
        row[-1] = event.duration_us
        totals[_COPY_OUT] += event.duration_us
        self._step_comm[0] += event.duration_us
        self._last = None

    def _step(self, event: ev.Event) -> None:
        end = event.time_us - self.zero_us
        comm_us, messages, nbytes = self._step_comm
        self._steps.append([self.steps_seen, self._step_start, end, event.duration_us, comm_us, messages, nbytes])
        self.steps_seen += 1
        self._step_start = end
        self._step_comm = [0.0, 0, 0]

    def snapshot(self) -> Dict[str, Any]:
        """This rank's part of the profile file (``ranks[i]`` without the job-level fields)."""
        with self._lock:
            messages = [_rounded([*key, *totals]) for key, totals in sorted(self._messages.items(), key=lambda kv: kv[0][3])]
            tensors = [_rounded([self._name_index(name), kind, *entry]) for (kind, name), entry in self._tensors.items()]
            return {
                "rank": self.rank,
                "tensors": list(self._names),
                "messages": schema.table(schema.MESSAGE_COLUMNS, messages),
                "tensors_time": schema.table(schema.TENSOR_COLUMNS, tensors),
                "steps": schema.table(schema.STEP_COLUMNS, [_rounded(s) for s in self._steps]),
                "steps_dropped": self.steps_seen - len(self._steps),
                "collectives": schema.table(schema.COLLECTIVE_COLUMNS, [_rounded(r) for r in self._raw]),
                "collectives_dropped": self.collectives_seen - len(self._raw),
            }



def _rounded(row: list) -> list:
    """A copy of ``row`` with its times to a tenth of a microsecond (the clock's resolution)."""
    return [round(v, 1) if isinstance(v, float) else v for v in row]
