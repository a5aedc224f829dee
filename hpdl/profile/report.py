"""The report's tables, as text for the terminal (and as data for the HTML page), and the comparison."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

from hpdl.formatting import format_size, format_table
from hpdl.profile.analysis import Analysis, Row
from hpdl.profile.schema import OTHER_TENSORS

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
    steps = [s for s in (*a.per_rank_steps, a.steps) if s is not None]
    if steps:
        out.append(Table(
            "Per step (medians; the first step, start-up, left out)",
            ["ranks", "steps", "step ms", "compute ms", "comm ms", "exposed comm ms", "exposed %", "efficiency",
             "core wait ms"],
            [[s.label, str(s.steps), _ms(s.step_us), _ms(s.compute_us), _ms(s.comm_us), _ms(s.exposed_us),
              _pct(s.exposed_share), _pct(s.efficiency), "-" if s.core_wait_us is None else _ms(s.core_wait_us)]
             for s in steps],
            "compute: step minus the time blocked waiting for collectives (exposed communication), of the "
            "medians, so that compute + exposed = step; comm: engine "
            "time of the step's collectives (copies and backend calls, mostly hidden behind backward); "
            "efficiency estimate: compute / step; core wait: time the training thread was ready to run but "
            "waited for a core (other threads or processes on it), part of compute", "steps"))
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
        if sa.core_wait_us is not None and sb.core_wait_us is not None:
            figures.append(("core wait ms", sa.core_wait_us, sb.core_wait_us))
        step_rows = [[name, _ms(x), _ms(y), _change(x, y)] for name, x, y in figures]
        step_rows.append(["efficiency estimate", _pct(sa.efficiency), _pct(sb.efficiency),
                          f"{(sb.efficiency - sa.efficiency) * 100:+.0f} points"])
        out.append(Table("Per step (medians over all ranks' steps)", ["figure", "A", "B", "change"], step_rows))
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
