"""The recorder: an event observer that turns one rank's engine events into profile tables.

Memory stays bounded on long runs, whatever the job names its tensors. Totals over the whole
recording are kept per distinct backend message (kind, backend, dtype, size, tensors fused: a
training job repeats a few dozen) and per tensor, for at most :data:`TENSOR_ROWS` tensors
(the ones with the most time; the rest are folded into one ``(other tensors)`` row per kind).
Unnamed collectives, whose automatic names carry a per-call counter, share one row per kind
(:func:`tensor_key`). Per-step aggregates are kept for the last :data:`STEP_WINDOW` steps and
raw collectives (one row each, with phase times and member tensors) for the last
:data:`RAW_WINDOW` collectives; how many older ones were dropped is recorded. With both
windows full that is about 52 MB per rank (docs/profile.md; ``scripts/profile_memory.py``).

A collective's phases: queue wait (its last member's submission until the engine thread
took that request from its queue), negotiation (until the ranks agreed to run it), copy in
(into the fusion buffer), backend call, copy out. Its ``ready_us`` is when its last member
was submitted: when this rank arrived at it.

A spatial group's communication (events.GROUP_KINDS: halo exchanges and the group's
collectives) runs on the thread that runs the model, outside the engine: it has no queue,
negotiation, fusion or sequence number to match across ranks, so it is kept apart from the
collectives (whose figures assume the engine's phases), in tables of its own: totals per layer
(the event's name) and operation, bounded as the tensors are; per step and kind; and the last
:data:`RAW_WINDOW` events.
"""

from __future__ import annotations

import array
import collections
import functools
import re
import threading
from typing import Any, Dict, List, Optional, Tuple

from hpdl.engine import events as ev
from hpdl.profile import schema

STEP_WINDOW = 100_000
RAW_WINDOW = 50_000
TENSOR_ROWS = 1000
OTHER_TENSORS = schema.OTHER_TENSORS
OTHER_LAYERS = schema.OTHER_LAYERS

# The names hpdl.torch gives unnamed collectives (hpdl.torch.calls.call_name): the kind, a
# per-call counter, then a grouped member's index or a sparse allreduce's part. The counter
# makes every call a new name; the optimizer's names for unnamed parameters
# (``allreduce.allreduce.noname.<group>.<index>``) are stable and do not match.
_AUTOMATIC_NAME = re.compile(r"(?P<kind>allreduce|allgather|broadcast|alltoall|reducescatter|grouped_allreduce|"
                             r"grouped_allgather|grouped_reducescatter|barrier\.\d+)\.noname\.\d+"
                             r"(?:\.\d+|(?P<part>\.indices|\.values))?")


@functools.lru_cache(maxsize=4096)  # called for every tensor of every collective; the names repeat
def tensor_key(name: str) -> str:
    """The row of the per-tensor totals that ``name`` adds to: an automatic name without its counter.

    ``allreduce.noname.17`` -> ``allreduce.noname``, ``barrier.0.noname.3`` -> ``barrier.0.noname``,
    ``grouped_allreduce.noname.4.1`` -> ``grouped_allreduce.noname``; other names are their own key.
    """
    match = _AUTOMATIC_NAME.fullmatch(name)
    if match is None:
        return name
    return f"{match['kind']}.noname{match['part'] or ''}"

# Indexes into a per-message totals list (schema.MESSAGE_COLUMNS from "calls" on).
_CALLS, _BACKEND, _COPY_IN, _COPY_OUT, _QUEUE, _NEGOTIATE, _MIN, _MAX = range(8)
# Indexes of the member names and sizes in a raw row (schema.COLLECTIVE_COLUMNS).
_NAMES, _SIZES = schema.COLLECTIVE_COLUMNS.index("names"), schema.COLLECTIVE_COLUMNS.index("sizes")
_MEMBER_READY = schema.COLLECTIVE_COLUMNS.index("member_ready_us")
_COPY_OUT_US = schema.COLLECTIVE_COLUMNS.index("copy_out_us")


class Recorder:
    """Collect one rank's collectives and steps; thread-safe (events come from two threads)."""

    def __init__(self, rank: int, zero_us: float, raw_window: int = RAW_WINDOW, step_window: int = STEP_WINDOW,
                 tensor_rows: int = TENSOR_ROWS):
        """Args:
            zero_us: this rank's wall-clock time (µs since the epoch) that is time 0 in the
                tables: the job's origin plus this rank's clock offset to rank 0.
            tensor_rows: how many tensors keep a row of their own in the per-tensor totals.
        """
        self.rank = rank
        self.zero_us = zero_us
        self.tensor_rows = tensor_rows
        self._lock = threading.Lock()
        self._queued: Dict[Tuple[int, str], float] = {}
        self._negotiated: Dict[Tuple[int, str], Tuple[float, float]] = {}
        # Copy-in time by message (its names) until its collective ends: several fused
        # messages may be in flight at once.
        self._copy_in: Dict[Tuple[str, ...], float] = {}
        self._last: Optional[Tuple[Tuple[str, ...], list, list]] = None  # names, raw row, message totals
        self._seq: Dict[int, int] = collections.defaultdict(int)
        self._messages: Dict[tuple, list] = {}
        # (kind, tensor_key(name)) -> [bytes of all calls, calls, time]
        self._tensors: Dict[Tuple[str, str], list] = {}
        self.tensors_folded = 0  # rows folded into the OTHER_TENSORS rows
        self._raw: "collections.deque[list]" = collections.deque(maxlen=raw_window)
        self._steps: "collections.deque[list]" = collections.deque(maxlen=step_window)
        # A spatial group's communication: (kind, layer, op) -> [bytes of all calls, calls, time];
        # raw events; per step and kind (at most one row per kind and step).
        self._layers: Dict[Tuple[str, str, str], list] = {}
        self.layers_folded = 0
        self._group_raw: "collections.deque[list]" = collections.deque(maxlen=raw_window)
        self._group_steps: "collections.deque[tuple]" = collections.deque(maxlen=len(ev.GROUP_KINDS) * step_window)
        self._group_step: Dict[str, list] = {}  # kind -> [calls, bytes, time] of the current step
        self.group_events_seen = 0
        self.collectives_seen = 0
        self.steps_seen = 0
        self._step_start = ev.now_us() - zero_us
        self._step_comm = [0.0, 0, 0]  # engine time, messages, bytes of the current step
        # The stepping thread (the one recording starts on, until a step says otherwise) and
        # how long it had waited for a core by then, for each step's share.
        self._core_wait = (threading.get_ident(), core_wait_ns())
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
                if event.kind in ev.GROUP_KINDS:
                    self._group_event(event)
                else:
                    self._collective(event)
            elif phase == ev.MEMCPY_OUT:
                self._copy_out(event)
            elif phase == ev.DONE:
                key = (event.process_set_id, event.names[0])
                self._queued.pop(key, None)
                self._negotiated.pop(key, None)
            elif phase == ev.STEP:
                self._step(event)

    def _collective(self, event: ev.Event) -> None:
        ps = event.process_set_id
        zero = self.zero_us
        # The member submitted last decides when this rank was ready, and its waits are the message's.
        ready, drained, negotiated = event.time_us, event.time_us, event.time_us
        latest = None
        submitted = []  # each member's submission (None: not seen, as before recording began)
        for name in event.names:
            queued = self._queued.pop((ps, name), None)
            submitted.append(queued)
            if queued is not None and (latest is None or queued > latest):
                latest = queued
                drained, negotiated = self._negotiated.pop((ps, name), (queued, queued))
            else:
                self._negotiated.pop((ps, name), None)
        if latest is not None:
            ready = latest
        # When each member was ready (a gradient's moment in backward), for replaying the step's
        # schedule (`hpdl profile predict`); a member not seen counts as ready with the last.
        member_ready = array.array("d", [(ready if t is None else t) - zero for t in submitted])
        copy_in = self._copy_in.pop(event.names, 0.0)
        queue_us, negotiate_us = max(0.0, drained - ready), max(0.0, negotiated - drained)
        backend_us = event.duration_us
        seq = self._seq[ps]
        self._seq[ps] = seq + 1
        step = self.steps_seen
        # Names by reference to the event's tuple, sizes packed: a raw row is the bulk of the
        # recorder's memory (names become indices into the name table in snapshot()).
        row = [seq, step, ps, event.kind, event.backend, event.dtype, event.nbytes, event.fused,
               event.names, array.array("q", event.sizes), ready - zero, queue_us, negotiate_us,
               event.time_us - zero, copy_in, backend_us, 0.0, member_ready]
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
            key = (event.kind, tensor_key(name))
            entry = self._tensors.get(key)
            if entry is None:
                if len(self._tensors) >= 2 * self.tensor_rows:
                    self._fold(self.tensor_rows)
                entry = self._tensors[key] = [0, 0, 0.0]
            entry[0] += nbytes
            entry[1] += 1
            entry[2] += backend_us * nbytes / total_bytes  # the tensor's share of the message's time
        self._step_comm[0] += copy_in + backend_us
        self._step_comm[1] += 1
        self._step_comm[2] += event.nbytes
        self._last = (event.names, row, totals)

    def _fold(self, keep: int) -> None:
        """Keep the ``keep`` tensors with the most time; add the others to their kind's OTHER_TENSORS row.

        Called when the table has twice ``keep`` rows, so that folding costs little per call.
        """
        self.tensors_folded += _fold(self._tensors, keep, OTHER_TENSORS)

    def _group_event(self, event: ev.Event) -> None:
        """A spatial group's halo exchange or collective: per layer, per step, raw."""
        name = event.names[0] if event.names else ""
        key = (event.kind, name, event.op)
        entry = self._layers.get(key)
        if entry is None:
            if len(self._layers) >= 2 * self.tensor_rows:
                self.layers_folded += _fold(self._layers, self.tensor_rows, OTHER_LAYERS)
            entry = self._layers[key] = [0, 0, 0.0]
        entry[0] += event.nbytes
        entry[1] += 1
        entry[2] += event.duration_us
        step = self._group_step.setdefault(event.kind, [0, 0, 0.0])
        step[0] += 1
        step[1] += event.nbytes
        step[2] += event.duration_us
        self._group_raw.append([self.steps_seen, event.kind, event.op, name, event.nbytes,
                                event.time_us - self.zero_us, event.duration_us])
        self.group_events_seen += 1

    def _copy_out(self, event: ev.Event) -> None:
        if self._last is None or self._last[0] != event.names:
            return
        _, row, totals = self._last
        row[_COPY_OUT_US] = event.duration_us
        totals[_COPY_OUT] += event.duration_us
        self._step_comm[0] += event.duration_us
        self._last = None

    def _step(self, event: ev.Event) -> None:
        end = event.time_us - self.zero_us
        comm_us, messages, nbytes = self._step_comm
        # STEP events come from the thread that steps: its wait for a core since the last step.
        thread, waited = threading.get_ident(), core_wait_ns()
        last_thread, last_waited = self._core_wait
        core_wait_us = (waited - last_waited) / 1e3 \
            if thread == last_thread and waited is not None and last_waited is not None else None
        self._core_wait = (thread, waited)
        self._steps.append((self.steps_seen, self._step_start, end, event.duration_us, comm_us, messages, nbytes,
                            core_wait_us))
        for kind, (calls, nbytes, time_us) in sorted(self._group_step.items()):
            self._group_steps.append((self.steps_seen, kind, calls, nbytes, time_us))
        self._group_step = {}
        self.steps_seen += 1
        self._step_start = end
        self._step_comm = [0.0, 0, 0]

    def snapshot(self) -> Dict[str, Any]:
        """This rank's part of the profile file (``ranks[i]`` without the job-level fields)."""
        with self._lock:
            if len(self._tensors) > self.tensor_rows:
                self._fold(self.tensor_rows)
            names: Dict[str, int] = {}
            index = lambda name: names.setdefault(name, len(names))  # noqa: E731
            messages = [_rounded([*key, *totals]) for key, totals in sorted(self._messages.items(), key=lambda kv: kv[0][3])]
            tensors = [_rounded([index(name), kind, round(entry[0] / entry[1]) if entry[1] else 0, *entry[1:]])
                       for (kind, name), entry in self._tensors.items()]
            # A training job repeats a few dozen messages: each one's member indices and sizes
            # are made once and shared by its rows (also in the pickle sent to rank 0).
            members: Dict[Tuple[str, ...], List[int]] = {}
            member_sizes: Dict[bytes, List[int]] = {}
            raw: List[list] = []
            for row in self._raw:
                row = _rounded(row)
                indices = members.get(row[_NAMES])
                if indices is None:
                    indices = members[row[_NAMES]] = [index(name) for name in row[_NAMES]]
                row[_NAMES] = indices
                packed = row[_SIZES].tobytes()
                sizes = member_sizes.get(packed)
                if sizes is None:
                    sizes = member_sizes[packed] = row[_SIZES].tolist()
                row[_SIZES] = sizes
                row[_MEMBER_READY] = [round(t, 1) for t in row[_MEMBER_READY]]
                raw.append(row)
            if len(self._layers) > self.tensor_rows:
                self.layers_folded += _fold(self._layers, self.tensor_rows, OTHER_LAYERS)
            layers = [_rounded([kind, index(name), op, round(entry[0] / entry[1]) if entry[1] else 0, *entry[1:]])
                      for (kind, name, op), entry in self._layers.items()]
            group_events = [_rounded([step, kind, op, index(name), *rest])
                            for step, kind, op, name, *rest in self._group_raw]
            return {
                "rank": self.rank,
                "tensors": list(names),
                "messages": schema.table(schema.MESSAGE_COLUMNS, messages),
                "tensors_time": schema.table(schema.TENSOR_COLUMNS, tensors),
                "tensors_folded": self.tensors_folded,
                "steps": schema.table(schema.STEP_COLUMNS, [_rounded(s) for s in self._steps]),
                "steps_dropped": self.steps_seen - len(self._steps),
                "collectives": schema.table(schema.COLLECTIVE_COLUMNS, raw),
                "collectives_dropped": self.collectives_seen - len(self._raw),
                "spatial_layers": schema.table(schema.SPATIAL_LAYER_COLUMNS, layers),
                "layers_folded": self.layers_folded,
                "spatial_steps": schema.table(schema.SPATIAL_STEP_COLUMNS, [_rounded(list(s)) for s in self._group_steps]),
                "spatial_events": schema.table(schema.SPATIAL_EVENT_COLUMNS, group_events),
                "spatial_events_dropped": self.group_events_seen - len(self._group_raw),
            }



def _fold(table: Dict[tuple, list], keep: int, other_name: str) -> int:
    """Keep the ``keep`` rows of ``table`` with the most time (entries ``[bytes, calls, time]``,
    keys ``(kind, name, ...)``); add each other row to the ``other_name`` row of its kind (the
    rest of its key kept); return how many rows were folded."""
    own = sorted((key for key in table if key[1] != other_name), key=lambda key: -table[key][2])
    for key in own[keep:]:
        entry = table.pop(key)
        other = table.setdefault((key[0], other_name, *key[2:]), [0, 0, 0.0])
        for i, value in enumerate(entry):
            other[i] += value
    return max(0, len(own) - keep)


def core_wait_ns() -> Optional[int]:
    """Nanoseconds the calling thread has spent runnable but waiting for a core (the kernel's
    run-queue time, Linux's schedstat); None where the platform does not tell."""
    # /proc/thread-self since Linux 3.17; the task's own entry before it.
    for path in ("/proc/thread-self/schedstat", f"/proc/self/task/{threading.get_native_id()}/schedstat"):
        try:
            with open(path, "rb") as f:
                return int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return None


def _rounded(row: list) -> list:
    """A copy of ``row`` with its times to a tenth of a microsecond (the clock's resolution)."""
    return [round(v, 1) if isinstance(v, float) else v for v in row]
