"""A profile as a Chrome trace (chrome://tracing, ui.perfetto.dev): one process track per rank.

Per rank these tracks: ``training`` (each step, split into compute and the exposed wait for
communication, which the profile knows as a total per step and shows at the step's end, where
``DistributedOptimizer.step()`` waits), ``backend calls`` (each collective's backend call,
named after the call, with its message in the arguments), ``copies`` (copy into and out of
the fusion buffer) and ``waiting`` (each collective's queue wait and negotiation, as
asynchronous slices since they overlap); and in a spatial-parallel job ``halo exchanges`` and
``group collectives`` (each exchange or collective of its spatial group, on the thread that
runs the model, named after the layer). Times are µs since the job's origin, on rank 0's
clock.

Complete slices on one track must nest (viewers drop or misdraw the others), but the phases
of one message do not nest with the next message's: with two fusion buffers (gloo, NCCL)
the next message is copied in while the last one is in flight. So copies have a track of
their own. A slice may still overlap another of its track (the profile places a copy-out at
the end of its backend call, having no start of its own for it, and a background backend's
calls are timed by completions seen on another thread):
such a slice goes to an extra track of the same name (``copies (fusion buffer) 2``), so that
every track nests.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, TextIO

from hpdl.engine.events import HALO, SPATIAL
from hpdl.output_files import write_file
from hpdl.profile import schema
from hpdl.formatting import format_size

_TRAINING, _BACKEND, _COPIES, _WAITING, _HALO, _GROUP = 1, 2, 3, 4, 5, 6
_GROUP_TRACKS = {HALO: _HALO, SPATIAL: _GROUP}  # events.GROUP_KINDS: the spatial group's own
_EXTRA_TRACKS = 100  # track ids of a family's extra tracks: 100 * family + n
_NAMES_SHOWN = 8
_EPSILON_US = 1e-3  # times are µs with 0.1 µs resolution: closer ends are the same instant


def _meta(pid: int, tid: int, name: str, value: Any) -> Dict[str, Any]:
    key = "sort_index" if name.endswith("sort_index") else "name"
    record = {"name": name, "ph": "M", "pid": pid, "args": {key: value}}
    if tid:
        record["tid"] = tid
    return record


def _slice(pid: int, tid: int, name: str, ts: float, dur: float, **args: Any) -> Dict[str, Any]:
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": max(dur, 0.0), "args": args}


def _separate(slices: List[Dict[str, Any]], tid: int) -> List[int]:
    """Put slices that do not nest on their own tracks; return the extra track ids used.

    Each slice goes to the first track of the family (``tid``, then its extra tracks) whose
    last slice ended by its start; the slices of one family never nest on purpose.
    """
    ends: List[float] = []  # per track, the end of its last slice
    tracks = [tid]
    for item in sorted(slices, key=lambda s: (s["ts"], -s["dur"])):
        for i, end in enumerate(ends):
            if item["ts"] >= end - _EPSILON_US:
                break
        else:
            i = len(ends)
            ends.append(0.0)
            if i:
                tracks.append(_EXTRA_TRACKS * tid + i)
        item["tid"] = tracks[i]
        ends[i] = item["ts"] + item["dur"]
    return tracks[1:]


def rank_events(rank: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The trace events of one rank of a profile."""
    pid = rank["rank"]
    names = rank["tensors"]
    track_names = {_TRAINING: "training", _BACKEND: "backend calls", _COPIES: "copies (fusion buffer)",
                   _WAITING: "waiting (queue, negotiation)"}
    out = [_meta(pid, 0, "process_name", f"rank {pid} ({rank.get('host', '?')})"),
           _meta(pid, 0, "process_sort_index", pid)]
    for s in schema.records(rank, "steps"):
        start, end = s["start_us"], s["end_us"]
        length = max(end - start, 0.0)
        blocked = min(max(s["blocked_us"], 0.0), length)
        out.append(_slice(pid, _TRAINING, f"step {s['step']}", start, length, messages=s["messages"],
                          comm_ms=s["comm_us"] / 1e3))
        out.append(_slice(pid, _TRAINING, "compute", start, length - blocked))
        if blocked > 0:
            out.append(_slice(pid, _TRAINING, "exposed communication", start + length - blocked, blocked))
    calls: List[Dict[str, Any]] = []
    copies: List[Dict[str, Any]] = []
    for c in schema.records(rank, "collectives"):
        members = [names[i] if 0 <= i < len(names) else f"#{i}" for i in c["names"]]
        label = f"{c['kind']} {format_size(c['bytes'])}" + (f" ({c['tensors']} tensors)" if c["tensors"] > 1 else "")
        args = {"message": label, "bytes": c["bytes"], "tensors": c["tensors"], "dtype": c["dtype"],
                "step": c["step"], "seq": c["seq"],
                "names": members[:_NAMES_SHOWN] + ([f"... {len(members) - _NAMES_SHOWN} more"]
                                                  if len(members) > _NAMES_SHOWN else [])}
        calls.append(_slice(pid, _BACKEND, f"{c['backend'].upper()}_{c['kind'].upper()}", c["start_us"],
                            c["backend_us"], **args))
        if c["copy_in_us"]:
            copies.append(_slice(pid, _COPIES, "copy in", c["start_us"] - c["copy_in_us"], c["copy_in_us"],
                                 message=label, seq=c["seq"]))
        if c["copy_out_us"]:
            copies.append(_slice(pid, _COPIES, "copy out", c["start_us"] + c["backend_us"], c["copy_out_us"],
                                 message=label, seq=c["seq"]))
        ident = f"{pid}.{c['process_set']}.{c['seq']}"
        negotiated = c["ready_us"] + c["queue_us"]
        for name, ts, end in (("queue wait", c["ready_us"], negotiated),
                              ("negotiation", negotiated, negotiated + c["negotiate_us"])):
            out.append({"name": name, "cat": "waiting", "ph": "b", "id": ident, "pid": pid, "tid": _WAITING,
                        "ts": ts, "args": {"message": label}})
            out.append({"name": name, "cat": "waiting", "ph": "e", "id": ident, "pid": pid, "tid": _WAITING, "ts": end})
    group: Dict[int, List[Dict[str, Any]]] = {}
    for e in schema.records(rank, "spatial_events"):
        tid = _GROUP_TRACKS.get(e["kind"], _GROUP)
        layer = names[e["name"]] if 0 <= e["name"] < len(names) else f"#{e['name']}"
        group.setdefault(tid, []).append(_slice(pid, tid, f"{e['kind']} {layer}", e["start_us"], e["duration_us"],
                                                layer=layer, op=e["op"], bytes=e["bytes"], step=e["step"]))
    for tid in group:
        track_names[tid] = "halo exchanges" if tid == _HALO else "group collectives"
    order = {tid: 10 * tid for tid in track_names}
    for family, slices in ((_BACKEND, calls), (_COPIES, copies), *sorted(group.items())):
        for n, extra in enumerate(_separate(slices, family), start=2):
            track_names[extra] = f"{track_names[family]} {n}"
            order[extra] = 10 * family + n - 1  # beside its family
    out += calls + copies + [item for slices in group.values() for item in slices]
    out += [_meta(pid, tid, "thread_name", name) for tid, name in track_names.items()]
    out += [_meta(pid, tid, "thread_sort_index", order[tid]) for tid in track_names]
    return out


def trace(profile: Dict[str, Any]) -> Dict[str, Any]:
    """The whole trace document of a profile."""
    events: List[Dict[str, Any]] = []
    for rank in profile["ranks"]:
        events += rank_events(rank)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "hpdl profile timeline", "origin_us": profile["job"].get("origin_us")}}


def dump_trace(document: Dict[str, Any], stream: TextIO) -> None:
    """Write a trace document (:func:`trace`) to a text stream, compactly."""
    json.dump(document, stream, separators=(",", ":"))


def write_trace(document: Dict[str, Any], path: str) -> int:
    """Write a trace document (:func:`trace`) to ``path`` ("-": stdout); return the number of trace events.

    A file is replaced atomically, whatever it held; `hpdl profile timeline` first refuses
    outputs that are its input or exist (:mod:`hpdl.output_files`).

    Raises:
        OSError: naming ``path`` when the file system refuses it.
    """
    if path == "-":
        dump_trace(document, sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
    else:
        write_file(path, lambda f: dump_trace(document, f))
    return len(document["traceEvents"])
