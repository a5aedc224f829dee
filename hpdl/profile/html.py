"""The HTML report: one self-contained page (no scripts, no fetched fonts) with tables and plots.

Plots are drawn with matplotlib (imported here only, when a page is asked for) as inline SVG
with text as paths, so the page renders the same anywhere and needs no network.
"""

from __future__ import annotations

import html
import io
import re
from typing import List, Optional

from hpdl.engine.events import HALO, SPATIAL
from hpdl.profile import schema
from hpdl.formatting import format_size
from hpdl.profile.analysis import Analysis
from hpdl.profile.findings import BenchCurve, bench_points
from hpdl.profile.report import NOTHING_RECORDED, Table, job_line, tables
from hpdl.profile.spatial_comm import time_by_step

_MAX_RANK_PLOTS = 4
_MAX_LAYER_BARS = 20
_METADATA = re.compile(r"<metadata>.*?</metadata>", re.S)
_STYLE = """
body { font-family: sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { padding: 0.2em 0.7em; border-bottom: 1px solid #e4e4e4; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f2f2f2; } p.note { color: #555; font-size: 0.85em; } figure { margin: 1em 0; }
li { margin: 0.4em 0; } .plot svg { max-width: 100%; height: auto; }
"""


def _figure(width: float = 7.5, height: float = 3.2):
    from matplotlib.figure import Figure  # `hpdl profile report --html` checks that it is installed
    return Figure(figsize=(width, height), layout="constrained")


def _svg(fig) -> str:
    import matplotlib

    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "path"}):
        fig.savefig(buffer, format="svg")
    text = buffer.getvalue()
    svg = _METADATA.sub("", text[text.index("<svg"):])  # credits with links: nothing to show or fetch
    return f'<div class="plot">{svg}</div>'


def _classes_plot(a: Analysis) -> str:
    fig = _figure()
    ax = fig.subplots()
    labels = [r.label for r in a.classes]
    ax.bar(labels, [r.time_us / 1e3 for r in a.classes], color="#4c72b0")
    for i, r in enumerate(a.classes):
        if r.time_us:
            ax.annotate(f"{r.share:.0%}", (i, r.time_us / 1e3), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("ms per rank (backend calls)")
    ax.set_title("Communication time by message size")
    return _svg(fig)


def _size_plot(a: Analysis, bench: Optional[BenchCurve]) -> str:
    fig = _figure(height=3.4)
    latency_ax, bw_ax = fig.subplots(1, 2)
    points = [p for p in a.latency_points() if p[0] > 0 and p[1] > 0]
    for kind in sorted({p[3] for p in points}):
        mine = [p for p in points if p[3] == kind]
        latency_ax.scatter([p[0] for p in mine], [p[1] for p in mine], label=kind, s=18)
        with_bw = [p for p in mine if p[2]]
        if with_bw:
            bw_ax.scatter([p[0] for p in with_bw], [p[2] for p in with_bw], label=kind, s=18)
    if bench:
        curve = bench_points(bench)
        latency_ax.plot([c[0] for c in curve], [c[1] for c in curve], color="#555", label="hpdl bench allreduce")
        bw_ax.plot([c[0] for c in curve], [c[2] for c in curve], color="#555", label="hpdl bench allreduce")
    for ax, label in ((latency_ax, "mean latency (µs)"), (bw_ax, "bus bandwidth (GB/s)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(label)
        if ax.has_data():
            ax.legend(fontsize=7)
    latency_ax.set_title("Latency by message size")
    bw_ax.set_title("Bus bandwidth by message size")
    return _svg(fig)


def _steps_plot(a: Analysis) -> str:
    from matplotlib.ticker import MaxNLocator

    ranks = a.ranks[:_MAX_RANK_PLOTS]
    fig = _figure(height=1.6 + 1.4 * len(ranks))
    axes = fig.subplots(len(ranks), 1, sharex=True, squeeze=False)[:, 0]
    for ax, rank in zip(axes, ranks):
        steps = Analysis.steady(list(schema.records(rank, "steps")))
        index = [s["step"] for s in steps]
        exposed = [s["blocked_us"] / 1e3 for s in steps]
        # Part of compute: the training thread ready to run, waiting for a core (0 where not recorded).
        waited = [(s["core_wait_us"] or 0.0) / 1e3 for s in steps]
        # The spatial groups' halo exchanges and collectives: on the training thread, not compute.
        by_step = time_by_step(rank)
        spatial = [by_step.get(s["step"], 0.0) / 1e3 for s in steps]
        compute = [(s["end_us"] - s["start_us"]) / 1e3 - e - w - g
                   for s, e, w, g in zip(steps, exposed, waited, spatial)]
        ax.bar(index, compute, color="#4c72b0", label="compute", width=1.0)
        bottom = compute
        for values, color, label in ((waited, "#8172b3", "waiting for a core"),
                                     (spatial, "#55a868", "spatial communication"),
                                     (exposed, "#dd8452", "exposed communication")):
            if any(values) or label == "exposed communication":
                ax.bar(index, values, bottom=bottom, color=color, label=label, width=1.0)
                bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylabel(f"rank {rank['rank']}\nms")
    axes[0].set_title("Per step: compute, waiting for a core and communication (start-up step left out)")
    axes[0].legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    return _svg(fig)


def _layers_plot(a: Analysis) -> str:
    rows = a.spatial.layers[:_MAX_LAYER_BARS]
    fig = _figure(height=1.2 + 0.22 * len(rows))
    ax = fig.subplots()
    colors = {HALO: "#55a868", SPATIAL: "#c44e52"}
    labels = [f"{r.label} ({r.op})" for r in reversed(rows)]
    ax.barh(labels, [r.time_us / 1e3 for r in reversed(rows)], color=[colors.get(r.kind, "#4c72b0")
                                                                      for r in reversed(rows)])
    ax.tick_params(axis="y", labelsize=7)
    ax.set_xlabel("ms per rank")
    ax.set_title("Spatial communication by layer (green: halo exchanges, red: group collectives)")
    return _svg(fig)


def _skew_plot(a: Analysis) -> str:
    arrival = a.arrival
    fig = _figure(height=2.8)
    late_ax, last_ax = fig.subplots(1, 2)
    ranks = [str(r.rank) for r in arrival.ranks]
    late_ax.bar(ranks, [r.mean_late_us / 1e3 for r in arrival.ranks], color="#c44e52")
    late_ax.set_xlabel("rank")
    late_ax.set_ylabel("ms behind the first rank")
    late_ax.set_title("Mean arrival behind the first rank")
    last_ax.bar(ranks, [100 * r.last / arrival.collectives for r in arrival.ranks], color="#8172b3")
    last_ax.set_xlabel("rank")
    last_ax.set_ylabel("% of collectives")
    last_ax.set_title("Last to arrive")
    return _svg(fig)


def _table(t: Table) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in t.header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in t.rows)
    note = f'<p class="note">{html.escape(t.note)}</p>' if t.note else ""
    return f"<h2>{html.escape(t.title)}</h2><table><tr>{head}</tr>{body}</table>{note}"


def render_html(a: Analysis, path: str, found: List[str], bench: Optional[BenchCurve] = None) -> str:
    """The whole page."""
    parts: List[str] = [f"<h1>hpdl communication profile</h1><p>{html.escape(job_line(a, path))}</p>"]
    if a.empty:  # as the text report: no tables of zeros, no plots of nothing
        parts.append(f"<p>{html.escape(NOTHING_RECORDED)}</p>")
        return _page(path, parts)
    if found:
        parts.append("<h2>Findings</h2><ul>" + "".join(f"<li>{html.escape(f)}</li>" for f in found) + "</ul>")
    plots = {"classes": lambda: _classes_plot(a) + _size_plot(a, bench), "steps": lambda: _steps_plot(a),
             "arrival": lambda: _skew_plot(a), "layers": lambda: _layers_plot(a)}
    for t in tables(a):
        parts.append(_table(t) + (plots[t.key]() if t.key in plots else ""))
    if bench:
        parts.append(f'<p class="note">bench curve: {len(bench)} sizes from {format_size(min(bench))} to '
                     f'{format_size(max(bench))}</p>')
    return _page(path, parts)


def _page(path: str, parts: List[str]) -> str:
    body = "\n".join(parts)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>hpdl profile: '
            f"{html.escape(path)}</title><style>{_STYLE}</style></head><body>\n{body}\n</body></html>\n")
