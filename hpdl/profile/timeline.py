"""A profile as a Chrome trace (chrome://tracing, ui.perfetto.dev): one process track per rank.

Per rank three tracks: ``training`` (each step, split into compute and the exposed wait for
communication, which the profile knows as a total per step and shows at the step's end, where
``DistributedOptimizer.step()`` waits), ``engine`` (each collective: copy in, the backend call,
copy out, nested in one slice named after the message) and ``waiting`` (each collective's
queue wait and negotiation, as asynchronous slices since they overlap). Times are µs since the
job's origin, on rank 0's clock.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List

from hpdl.profile import schema
from hpdl.profile.analysis import format_size

_TRAINING, _ENGINE, _WAITING = 1, 2, 3
_NAMES_SHOWN = 8


def _meta(pid: int, tid: int, name: str, value: Any) -> Dict[str, Any]:
    key = "sort_index" if name.endswith("sort_index") else "name"
    record = {"name": name, "ph": "M", "pid": pid, "args": {key: value}}
    if tid:
        record["tid"] = tid
    return record


def _slice(pid: int, tid: int, name: str, ts: float, dur: float, **args: Any) -> Dict[str, Any]:
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": max(dur, 0.0), "args": args}


def rank_events(rank: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The trace events of one rank of a profile."""
    pid = rank["rank"]
    names = rank["tensors"]
    out = [_meta(pid, 0, "process_name", f"rank {pid} ({rank.get('host', '?')})"),
           _meta(pid, 0, "process_sort_index", pid),
           _meta(pid, _TRAINING, "thread_name", "training"), _meta(pid, _ENGINE, "thread_name", "engine"),
           _meta(pid, _WAITING, "thread_name", "waiting (queue, negotiation)")]
    for s in schema.records(rank, "steps"):
        start, end, blocked = s["start_us"], s["end_us"], s["blocked_us"]
        out.append(_slice(pid, _TRAINING, f"step {s['step']}", start, end - start, messages=s["messages"],
                          comm_ms=s["comm_us"] / 1e3))
        out.append(_slice(pid, _TRAINING, "compute", start, end - start - blocked))
        if blocked > 0:
            out.append(_slice(pid, _TRAINING, "exposed communication", end - blocked, blocked))
    for c in schema.records(rank, "collectives"):
        members = [names[i] if 0 <= i < len(names) else f"#{i}" for i in c["names"]]
        label = f"{c['kind']} {format_size(c['bytes'])}" + (f" ({c['tensors']} tensors)" if c["tensors"] > 1 else "")
        begin = c["start_us"] - c["copy_in_us"]
        total = c["copy_in_us"] + c["backend_us"] + c["copy_out_us"]
        args = {"bytes": c["bytes"], "tensors": c["tensors"], "dtype": c["dtype"], "step": c["step"], "seq": c["seq"],
                "names": members[:_NAMES_SHOWN] + ([f"... {len(members) - _NAMES_SHOWN} more"]
                                                  if len(members) > _NAMES_SHOWN else [])}
        out.append(_slice(pid, _ENGINE, label, begin, total, **args))
        if c["copy_in_us"]:
            out.append(_slice(pid, _ENGINE, "copy in", begin, c["copy_in_us"]))
        out.append(_slice(pid, _ENGINE, f"{c['backend'].upper()}_{c['kind'].upper()}", c["start_us"], c["backend_us"],
                          bytes=c["bytes"]))
        if c["copy_out_us"]:
            out.append(_slice(pid, _ENGINE, "copy out", c["start_us"] + c["backend_us"], c["copy_out_us"]))
        ident = f"{pid}.{c['process_set']}.{c['seq']}"
        negotiated = c["ready_us"] + c["queue_us"]
        for name, ts, end in (("queue wait", c["ready_us"], negotiated),
                              ("negotiation", negotiated, negotiated + c["negotiate_us"])):
            out.append({"name": name, "cat": "waiting", "ph": "b", "id": ident, "pid": pid, "tid": _WAITING,
                        "ts": ts, "args": {"message": label}})
            out.append({"name": name, "cat": "waiting", "ph": "e", "id": ident, "pid": pid, "tid": _WAITING, "ts": end})
    return out


def trace(profile: Dict[str, Any]) -> Dict[str, Any]:
    """The whole trace document of a profile."""
    events: List[Dict[str, Any]] = []
    for rank in profile["ranks"]:
        events += rank_events(rank)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "hpdl profile timeline", "origin_us": profile["job"].get("origin_us")}}


def write_trace(profile: Dict[str, Any], path: str) -> int:
    """Write the trace of ``profile`` to ``path``; return the number of trace events."""
    document = trace(profile)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f, separators=(",", ":"))
    return len(document["traceEvents"])
