"""The report's tables, as text for the terminal (and as data for the HTML page), and the comparison."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

from hpdl.formatting import format_size, format_table
from hpdl.profile.analysis import Analysis, Row
from hpdl.profile.schema import OTHER_LAYERS, OTHER_TENSORS

TOP = 10


@dataclasses.dataclass
class Table:
    """A titled table with an optional note under it."""

    title: str
    header: List[str]
    rows: List[List[str]]
    note: str = ""
    key: str = ""  # what the table shows: classes, messages, tensors, steps, arrival, fusion


def _ms(us: Optional[float]) -> str:
    return "-" if us is None else f"{us / 1e3:.2f}"


def _bw(row: Row) -> str:
    bw = row.busbw_gbps
    return "-" if bw is None else f"{bw:.3f}"


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.0%}"


def _time_rows(rows: Sequence[Row]) -> List[List[str]]:
    return [[r.label, f"{r.calls:.0f}", _ms(r.time_us), _ms(r.mean_us), _bw(r), _pct(r.share)] for r in rows]


def job_line(a: Analysis, path: str) -> str:
    """One line naming the file and the job it profiles."""
    job = a.job
    settings = job.get("settings", {})
    hosts = sorted(set(job.get("hosts", [])))
    missing = job.get("missing_ranks") or []
    line = (f"{path}: {_ranks(a.size)} ({job.get('backend', '?')}) on {', '.join(hosts) or '?'}; fusion threshold "
            f"{format_size(settings.get('fusion_threshold', 0))}"
            f"{' (autotuned, at the end)' if settings.get('autotune') else ''}, in place from "
            f"{format_size(settings.get('inplace_threshold', 0))}; recorded {job.get('started', '?')}")
    return line + (f"; MISSING ranks {', '.join(map(str, missing))}" if missing else "")


def _ranks(count: int) -> str:
    return f"{count} rank" if count == 1 else f"{count} ranks"


def _folded(a: Analysis) -> str:
    folded = a.tensors_folded
    return f", {folded} of them folded into the {OTHER_TENSORS!r} rows" if folded else ""


def tables(a: Analysis) -> List[Table]:
    """Every table of the report, in order."""
    head = ["calls", "total ms", "mean ms", "busbw GB/s", "share"]
    out = [
        Table("Communication time by message size (backend calls, per rank)", ["size class", *head],
              _time_rows(a.classes), f"all communication: {_ms(a.total_comm_us)} ms per rank; busbw as nccl-tests "
              "(allreduce: bytes/time x 2(p-1)/p)", "classes"),
        Table(f"Top backend messages (of {len(a.by_message)})", ["message", *head], _time_rows(a.by_message[:TOP]),
              key="messages"),
        Table(f"Top tensors (of {a.tensor_count}{_folded(a)}; a fused message's time shared by bytes)",
              ["tensor", "bytes", "calls", "total ms", "share"],
              [[r.label, format_size(r.nbytes), f"{r.calls:.0f}", _ms(r.time_us), _pct(r.share)]
               for r in a.by_tensor[:TOP]], key="tensors"),
    ]
    out += spatial_tables(a)
    steps = [s for s in (*a.per_rank_steps, a.steps) if s is not None]
    if steps:
        spatial = a.spatial.present
        out.append(Table(
            "Per step (medians; the first step, start-up, left out)",
            ["ranks", "steps", "step ms", "compute ms", "comm ms", "exposed comm ms", "exposed %"]
            + (["spatial comm ms"] if spatial else []) + ["efficiency", "core wait ms"],
            [[s.label, str(s.steps), _ms(s.step_us), _ms(s.compute_us), _ms(s.comm_us), _ms(s.exposed_us),
              _pct(s.exposed_share)] + ([_ms(s.spatial_us)] if spatial else [])
             + [_pct(s.efficiency), "-" if s.core_wait_us is None else _ms(s.core_wait_us)]
             for s in steps],
            "compute: step minus the time blocked waiting for collectives (exposed communication)"
            + (" and the spatial communication (halo exchanges and group collectives, which the model waits "
               "for)" if spatial else "")
            + ", of the medians, so that compute + exposed" + (" + spatial" if spatial else "")
            + " = step; comm: engine time of the step's collectives (copies and backend calls, mostly hidden "
            "behind backward); efficiency estimate: compute / step; core wait: time the training thread was "
            "ready to run but waited for a core (other threads or processes on it), part of compute", "steps"))
    if a.arrival is not None:
        arr = a.arrival
        out.append(Table(
            f"Arrival at collectives ({arr.collectives} matched across ranks)",
            ["rank", "last to arrive", "mean behind first ms"],
            [[str(r.rank), _pct(r.last / arr.collectives), _ms(r.mean_late_us)] for r in arr.ranks],
            f"spread of arrival (last minus first rank): median {_ms(arr.median_spread_us)} ms, 90th percentile "
            f"{_ms(arr.p90_spread_us)} ms, largest {_ms(arr.max_spread_us)} ms", "arrival"))
    f = a.fusion
    out.append(Table("Fusion", ["figure", "value"], [
        ["messages per step (median)", f"{f.messages_per_step:.1f}" if a.steps is not None else "-"],
        ["tensors per message (mean)", f"{f.tensors_per_message:.1f}"],
        ["messages carrying several tensors", _pct(f.fused_share)],
        [f"fill of {f.buffer} (mean, max)", f"{_pct(f.fill)}, {_pct(f.max_fill)}"],
        ["fusion buffer reuse (hits / requests)", _pct(f.reuse)],
    ], key="fusion"))
    return out


def spatial_tables(a: Analysis) -> List[Table]:
    """The spatial groups' own communication, per kind and per layer (none in other jobs)."""
    sc = a.spatial
    if not sc.present:
        return []
    if sc.per_step:
        title = "Spatial communication per step (on the thread that runs the model; medians over steps)"
        share = lambda k: _pct(k.time_us / a.steps.step_us) if a.steps and a.steps.step_us else "-"  # noqa: E731
    else:
        title = "Spatial communication per rank (no steps were marked: totals)"
        share = lambda k: "-"  # noqa: E731
    kinds = Table(title, ["kind", "calls", "bytes", "ms", "of the step"],
                  [[k.label, f"{k.calls:.0f}", format_size(k.nbytes), _ms(k.time_us), share(k)] for k in sc.kinds],
                  "halo exchanges: rows sent to and received from the neighbour bands (bytes: both ways); group "
                  "collectives: the spatial group's allreduces and allgathers (batch norm statistics, global "
                  "pooling, gather). Outside the engine, and not hidden behind compute.", "spatial")
    folded = f", {sc.layers_folded} folded into the {OTHER_LAYERS!r} rows" if sc.layers_folded else ""
    layers = Table(f"Top layers by spatial communication (of {len(sc.layers)}{folded}; totals per rank)",
                   ["layer", "kind", "op", "calls", "bytes per call", "total ms", "mean ms", "share"],
                   [[r.label, r.kind, r.op, f"{r.calls:.0f}", format_size(r.bytes_per_call), _ms(r.time_us),
                     _ms(r.mean_us), _pct(r.share)] for r in sc.layers[:TOP]], key="layers")
    return [kinds, layers]


NOTHING_RECORDED = "nothing recorded: no collectives and no steps between the start of the recording and its end"


def render(a: Analysis, path: str, found: List[str]) -> str:
    """The terminal report."""
    parts = [job_line(a, path)]
    if a.empty:
        parts.append(NOTHING_RECORDED)
        return "\n".join(parts)
    for t in tables(a):
        parts += ["", t.title, format_table(t.header, t.rows)] + ([t.note] if t.note else [])
    if found:
        parts += ["", "Findings"] + [f"- {text}" for text in found]
    return "\n".join(parts)


def _number(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def _change(old: Optional[float], new: Optional[float]) -> str:
    if old is None or new is None or not old:
        return "-"
    return f"{(new - old) / old:+.0%}"


def compare_tables(a: Analysis, b: Analysis) -> List[Table]:
    """Two runs side by side: time by size class, per-step figures, with changes in percent."""
    rows = [[ra.label, _ms(ra.time_us), _ms(rb.time_us), _change(ra.time_us, rb.time_us), _bw(ra), _bw(rb)]
            for ra, rb in zip(a.classes, b.classes)]
    rows.append(["all communication", _ms(a.total_comm_us), _ms(b.total_comm_us),
                 _change(a.total_comm_us, b.total_comm_us), "", ""])
    out = [Table("Communication time by message size, ms per rank",
                 ["size class", "A ms", "B ms", "change", "A busbw GB/s", "B busbw GB/s"], rows)]
    sa, sb = a.steps, b.steps
    if sa is not None and sb is not None:
        figures = [("step ms", sa.step_us, sb.step_us), ("compute ms", sa.compute_us, sb.compute_us),
                   ("comm ms", sa.comm_us, sb.comm_us), ("exposed comm ms", sa.exposed_us, sb.exposed_us)]
        if a.spatial.present or b.spatial.present:
            figures.append(("spatial comm ms", sa.spatial_us, sb.spatial_us))
        if sa.core_wait_us is not None and sb.core_wait_us is not None:
            figures.append(("core wait ms", sa.core_wait_us, sb.core_wait_us))
        step_rows = [[name, _ms(x), _ms(y), _change(x, y)] for name, x, y in figures]
        step_rows.append(["efficiency estimate", _pct(sa.efficiency), _pct(sb.efficiency),
                          f"{(sb.efficiency - sa.efficiency) * 100:+.0f} points"])
        out.append(Table("Per step (medians over all ranks' steps)", ["figure", "A", "B", "change"], step_rows))
    out += _compare_spatial(a, b)
    fa, fb = a.fusion, b.fusion
    # A profile without steps has no messages per step (not 0): "-", as in the report.
    per_step_a = fa.messages_per_step if sa is not None else None
    per_step_b = fb.messages_per_step if sb is not None else None
    out.append(Table("Fusion", ["figure", "A", "B", "change"], [
        ["messages per step", _number(per_step_a), _number(per_step_b), _change(per_step_a, per_step_b)],
        ["tensors per message", f"{fa.tensors_per_message:.1f}", f"{fb.tensors_per_message:.1f}",
         _change(fa.tensors_per_message, fb.tensors_per_message)],
    ]))
    return out


def _compare_spatial(a: Analysis, b: Analysis) -> List[Table]:
    """Each kind of spatial communication per step (or per rank without steps), A beside B."""
    if not (a.spatial.present or b.spatial.present):
        return []
    kinds = list(dict.fromkeys([k.kind for k in a.spatial.kinds] + [k.kind for k in b.spatial.kinds]))
    rows = []
    for kind in kinds:
        ka, kb = a.spatial.kind(kind), b.spatial.kind(kind)
        label = (ka or kb).label
        for figure, value, show in (("ms", lambda k: k.time_us, _ms), ("bytes", lambda k: k.nbytes, format_size),
                                    ("calls", lambda k: k.calls, lambda v: f"{v:.0f}")):
            x, y = (value(ka) if ka else None), (value(kb) if kb else None)
            rows.append([f"{label} {figure}", "-" if x is None else show(x), "-" if y is None else show(y),
                         _change(x, y)])
    per = "per step" if a.spatial.per_step and b.spatial.per_step else "per step, or per rank where no steps were marked"
    return [Table(f"Spatial communication ({per}, medians)", ["figure", "A", "B", "change"], rows)]


# The settings an autotuned recording holds as they were at its end, not for the whole run.
_AUTOTUNED = ("fusion_threshold", "cycle_time_ms")


def _setting(settings: dict, key: str) -> str:
    """A recorded setting in words: switches on or off (a recording without autotuning has no
    ``autotune`` key), autotuned ones marked as the values at the end."""
    value = settings.get(key, False if key == "autotune" else None)
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value} (autotuned, at the end)" if key in _AUTOTUNED and settings.get("autotune") else str(value)


def render_compare(a: Analysis, path_a: str, b: Analysis, path_b: str) -> str:
    """The terminal comparison of run A (before) and run B (after)."""
    parts = [f"A: {job_line(a, path_a)}", f"B: {job_line(b, path_b)}"]
    hosts_a, hosts_b = len(set(a.job.get("hosts", []))), len(set(b.job.get("hosts", [])))
    job = [("ranks", a.size, b.size), ("backend", a.job.get("backend", "?"), b.job.get("backend", "?")),
           ("hosts", hosts_a, hosts_b)]
    differ = [f"{name} {x} -> {y}" for name, x, y in job if x != y]
    parts.append(f"job changed: {', '.join(differ)}" if differ else
                 f"job: the same ({_ranks(a.size)}, {a.job.get('backend', '?')}, {hosts_a} host(s))")
    sa, sb = a.job.get("settings", {}), b.job.get("settings", {})
    changed = [f"{key} {_setting(sa, key)} -> {_setting(sb, key)}" for key in sorted({*sa, *sb})
               if _setting(sa, key) != _setting(sb, key)]
    parts.append(f"settings changed: {', '.join(changed)}" if changed else "settings: the same")
    for t in compare_tables(a, b):
        parts += ["", t.title, format_table(t.header, t.rows)]
    return "\n".join(parts)
