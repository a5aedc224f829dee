"""A Chrome-trace (chrome://tracing, Perfetto) timeline of engine events, in Horovod's layout.

One ``pid`` per tensor name (named by a ``process_name`` metadata record); per tensor the
phases NEGOTIATE_<KIND> (queued until agreed), <KIND> (agreed until done) and, nested inside,
MEMCPY_IN_FUSION_BUFFER, the backend op (e.g. MPI_ALLREDUCE) and MEMCPY_OUT_FUSION_BUFFER.
A spatial group's communication, outside the engine (events.GROUP_KINDS), gets one ``pid`` per
kind and layer (``halo: body.0.body.0``) with one slice per exchange or collective
(``HALO_SENDRECV``, ``SPATIAL_ALLREDUCE``), its bytes and backend in the arguments.
The first record carries ``start_time_since_epoch_in_micros``; timestamps are relative to it.

Records go to the file as they happen, whole, each event's in one unbuffered write: a rank
that is killed, or a job that crashes, leaves a trace that ends after its last complete
record, without the closing ``]``, which trace viewers accept (as Horovod's timeline, written
as the job runs). A buffered file would lose what is in its buffer and could end mid-record,
which no viewer loads.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Dict, List

from hpdl.atomic_file import make_directories
from hpdl.engine import events as ev


class Timeline:
    """An event observer that streams a Chrome trace to a file."""

    def __init__(self, path: str, mark_cycles: bool = False):
        """Raises:
            ValueError: the file cannot be written (naming it and why); missing directories are made.
        """
        self.path = path
        self.mark_cycles = mark_cycles
        try:
            make_directories(os.path.dirname(os.path.abspath(path)))
            self._file = open(path, "wb", buffering=0)
        except OSError as err:
            raise ValueError(f"cannot write the timeline to {os.path.abspath(path)}: {err.strerror or err}") from None
        self._start = ev.now_us()
        self._pids: Dict[str, int] = {}
        self._open: Dict[str, str] = {}  # tensor name -> the phase currently open on its pid
        self._lock = threading.Lock()
        self._pending: List[str] = []  # the records of the event being written
        self._first = True
        self._flush("[\n")
        self._write({"name": "process_name", "ph": "M", "pid": 0,
                     "args": {"name": "hpdl", "start_time_since_epoch_in_micros": int(self._start)}})
        self._flush()

    def _write(self, record: dict) -> None:
        self._pending.append(("" if self._first else ",\n") + json.dumps(record, separators=(",", ":")))
        self._first = False

    def _flush(self, text: str = "") -> None:
        """Write ``text`` and the pending records to the file in one write: whole records or none."""
        data = (text + "".join(self._pending)).encode()
        self._pending.clear()
        view = memoryview(data)
        while view:  # a regular file takes it all at once; a pipe may not
            view = view[self._file.write(view):]

    def _pid(self, name: str) -> int:
        pid = self._pids.get(name)
        if pid is None:
            pid = self._pids[name] = len(self._pids) + 1
            self._write({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
            self._write({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        return pid

    def observe(self, event: ev.Event) -> None:
        with self._lock:
            if self._file.closed:
                return
            try:
                self._records(event)
            finally:
                self._flush()

    def _records(self, event: ev.Event) -> None:
        ts = event.time_us - self._start
        kind = event.kind.upper()
        if event.phase == ev.CYCLE:
            if self.mark_cycles:
                self._write({"name": "CYCLE_START", "ph": "i", "s": "g", "pid": 0, "ts": ts})
            return
        if event.kind in ev.GROUP_KINDS:  # no queue or negotiation: one slice, on its layer's track
            pid = self._pid(f"{event.kind}: {event.names[0] if event.names else ''}")
            self._write({"name": f"{kind}_{event.op}", "ph": "X", "pid": pid, "tid": 0, "ts": ts,
                         "dur": event.duration_us, "args": {"bytes": event.nbytes, "backend": event.backend}})
            return
        for name in event.names:
            pid = self._pid(name)
            if event.phase == ev.QUEUED:
                self._begin(name, pid, f"NEGOTIATE_{kind}", ts)
            elif event.phase == ev.NEGOTIATED:
                self._end(name, pid, ts)
                self._begin(name, pid, kind, ts)
            elif event.phase == ev.DONE:
                self._end(name, pid, ts)
            else:
                label = event.op if event.phase == ev.COLLECTIVE else event.phase
                args = {"bytes": event.nbytes, "tensors": event.fused}
                self._write({"name": label, "ph": "X", "pid": pid, "tid": 0, "ts": ts,
                             "dur": event.duration_us, "args": args})

    def _begin(self, name: str, pid: int, phase: str, ts: float) -> None:
        self._open[name] = phase
        self._write({"name": phase, "ph": "B", "pid": pid, "tid": 0, "ts": ts})

    def _end(self, name: str, pid: int, ts: float) -> None:
        if self._open.pop(name, None) is not None:
            self._write({"ph": "E", "pid": pid, "tid": 0, "ts": ts})

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                try:
                    self._flush("\n]\n")
                finally:
                    self._file.close()
