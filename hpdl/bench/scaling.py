"""`hpdl bench scaling`: training throughput against the number of ranks, for hpdl and DDP.

A driver, not a job: it starts `hpdl run -np N -- hpdl bench synthetic ... --json` at every
rank count, for every system asked for, in alternating repeats (repeat after repeat, rank
counts in alternating order, so a drifting machine hits every point alike), and reads each
job's record. Systems:

- ``hpdl``, ``hpdl-fp16`` (``--fp16-allreduce``), ``hpdl-hier`` (hierarchical allreduce),
  ``hpdl-overlap`` (``--overlap-forward``: the exchange overlaps the next forward);
- ``ddp`` (DistributedDataParallel over gloo) and ``ddp-fp16`` (its ``fp16_compress_hook``).

The no-communication ceiling (every rank training alone, at once) is measured in the same
job as ``hpdl``; efficiency is reported against it and against N times the 1-rank figure.
On several hosts (``--hosts``, or the hostfile ``hpdl emulate`` sets), the ranks are spread
evenly over them, so that N ranks cross node boundaries as soon as N > 1.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, BinaryIO, Dict, List, Optional, Sequence, Tuple, Union

from hpdl.bench.jobs import JobError, Stopped, check_timeout, run_job, stops_keep_the_record
from hpdl.bench.stats import median, spread
from hpdl.formatting import format_table

__all__ = ["SYSTEMS", "ScalingOptions", "run_scaling", "format_summary", "plot"]

# system -> (job that measures it, the mode in that job's record)
SYSTEMS: Dict[str, Tuple[str, str]] = {
    "hpdl": ("default", "hpdl"),
    "hpdl-fp16": ("fp16", "hpdl"),
    "hpdl-hier": ("hierarchical", "hpdl"),
    "hpdl-overlap": ("overlap", "hpdl"),
    "ddp": ("default", "ddp"),
    "ddp-fp16": ("fp16", "ddp"),
}


class ScalingError(JobError):
    """A job of the study failed; the message names it and says why, in one line.

    ``record`` holds what the study measured before it (the runs of the jobs that ended well),
    so that minutes of jobs are not lost with the one that failed.
    """

    record: Optional[Dict[str, Any]] = None


class ScalingStopped(Stopped):
    """The study was stopped by a signal (Ctrl-C, SIGTERM) after its running job was ended;
    ``record`` holds the runs of the jobs that ended before."""


@dataclasses.dataclass(frozen=True)
class ScalingOptions:
    """The study: which rank counts and systems, and the synthetic benchmark's own arguments."""

    ranks: Tuple[int, ...] = (1, 2)
    systems: Tuple[str, ...] = ("hpdl", "ddp")
    repeats: int = 3
    hosts: Optional[Tuple[Tuple[str, int], ...]] = None  # (host, slots); None: this host only
    synthetic_args: Tuple[str, ...] = ()  # --model, --batch-size, ... passed on to every job
    timeout_s: float = 1800.0  # per job

    def __post_init__(self) -> None:
        if not self.ranks or any(n < 1 for n in self.ranks) or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"--ranks takes distinct rank counts of at least 1, got {','.join(map(str, self.ranks))}")
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if not self.systems or unknown or len(set(self.systems)) != len(self.systems):
            raise ValueError(f"--systems takes distinct systems among {', '.join(SYSTEMS)}, got {','.join(self.systems)}")
        if self.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {self.repeats}")
        check_timeout(self.timeout_s)
        if self.hosts is not None:
            slots = sum(s for _, s in self.hosts)
            if max(self.ranks) > slots:
                raise ValueError(f"{max(self.ranks)} ranks do not fit the {slots} slots of the hosts")

    def jobs(self) -> List[str]:
        """The jobs to run at each point: the default one always (it measures the ceiling)."""
        wanted = {SYSTEMS[s][0] for s in self.systems} | {"default"}
        return [job for job in ("default", "fp16", "hierarchical", "overlap") if job in wanted]


def spread_over(hosts: Sequence[Tuple[str, int]], ranks: int) -> List[Tuple[str, int]]:
    """Place ``ranks`` evenly over ``hosts`` (the first ones taking the remainder), within slots."""
    placed = {name: 0 for name, _ in hosts}
    left = ranks
    while left:
        for name, slots in hosts:
            if left and placed[name] < slots:
                placed[name] += 1
                left -= 1
    return [(name, n) for name, _ in hosts if (n := placed[name])]


def job_argv(opts: ScalingOptions, job: str, ranks: int) -> List[str]:
    """The `hpdl run` command of one job of the study."""
    run = [sys.executable, "-m", "hpdl", "run", "-np", str(ranks)]
    if opts.hosts is not None:
        run += ["-H", ",".join(f"{h}:{n}" for h, n in spread_over(opts.hosts, ranks))]
    if job == "hierarchical":
        run.append("--hierarchical-allreduce")
    compare = {"default": [m for m in ("ddp",) if "ddp" in opts.systems] + ["ceiling"],
               "fp16": ["ddp"] if "ddp-fp16" in opts.systems else [],
               "hierarchical": [], "overlap": []}[job]
    bench = [sys.executable, "-m", "hpdl", "bench", "synthetic", *opts.synthetic_args, "--json", "--repeats", "1"]
    if job == "fp16":
        bench.append("--fp16-allreduce")
    elif job == "overlap":
        bench.append("--overlap-forward")
    if compare:
        bench += ["--compare", ",".join(compare)]
    return run + ["--"] + bench


def _run_job(opts: ScalingOptions, job: str, ranks: int) -> Dict[str, float]:
    """Run one job; return img/s per rank by mode ("hpdl", "ddp", "ceiling").

    A job that outlives ``opts.timeout_s``, or a driver interrupted meanwhile, ends the job
    (its launcher ends its ranks) before the error goes on: no rank is left running.
    """
    env = {k: v for k, v in os.environ.items() if k != "HPDL_HIERARCHICAL_ALLREDUCE"}
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        record = run_job(job_argv(opts, job, ranks), env, opts.timeout_s, f"the {job} job on {ranks} rank(s)")
    except JobError as err:
        raise ScalingError(str(err), err.returncode, err.stdout, err.stderr) from None
    if "median" in record:  # a --compare record
        return {mode: float(value) for mode, value in record["median"].items()}
    return {"hpdl": float(record["img_sec_per_rank"])}


def run_scaling(opts: ScalingOptions, log=print) -> Dict[str, Any]:
    """Run the study; return its record (every job's figures and the summary).

    Raises:
        ScalingError: a job failed; its ``record`` holds the runs done before.
        ScalingStopped: SIGINT, SIGTERM or SIGHUP stopped the study (the running job is ended
            first); its ``record`` holds the runs done before.
    """
    runs: List[Dict[str, Any]] = []
    jobs = opts.jobs()
    with stops_keep_the_record(ScalingError, ScalingStopped, lambda failure: _record(opts, runs, failure=failure)):
        _run_all(opts, jobs, runs, log)
    return _record(opts, runs)


def _run_all(opts: ScalingOptions, jobs: List[str], runs: List[Dict[str, Any]], log) -> None:
    """Every job of the study in alternating repeats, adding each one's runs to ``runs``."""
    for repeat in range(opts.repeats):
        order = list(opts.ranks) if repeat % 2 == 0 else list(reversed(opts.ranks))
        for ranks in order:
            for job in jobs:
                try:
                    modes = _run_job(opts, job, ranks)
                except ScalingError as err:
                    err.args = (f"repeat {repeat + 1}/{opts.repeats}: {err}",)
                    raise
                runs.append({"repeat": repeat, "ranks": ranks, "job": job, "img_sec_per_rank": modes})
                shown = ", ".join(f"{m} {v:.3g}" for m, v in modes.items())
                log(f"repeat {repeat + 1}/{opts.repeats}, {ranks} rank(s), {job} job: {shown} img/s per rank")


def _record(opts: ScalingOptions, runs: List[Dict[str, Any]], failure: Optional[str] = None) -> Dict[str, Any]:
    """The study's record; with ``failure``, of a study that ended early (``complete`` false)."""
    record = {"benchmark": "scaling", "ranks": list(opts.ranks), "systems": list(opts.systems),
              "repeats": opts.repeats, "hosts": [list(h) for h in opts.hosts] if opts.hosts else None,
              "synthetic_args": list(opts.synthetic_args), "runs": runs, "summary": summarize(opts, runs)}
    if failure is not None:
        record.update(complete=False, failure=failure)
    return record


def summarize(opts: ScalingOptions, runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per system and rank count: median total img/s, its spread, and the two efficiencies.

    A point no job measured (a study that ended early) has no row.
    """
    def totals(job: str, mode: str, ranks: int) -> List[float]:
        return [ranks * r["img_sec_per_rank"][mode] for r in runs
                if r["job"] == job and r["ranks"] == ranks and mode in r["img_sec_per_rank"]]

    out = []
    for system in opts.systems:
        job, mode = SYSTEMS[system]
        one = totals(job, mode, 1) if 1 in opts.ranks else []
        for ranks in opts.ranks:
            values, ceiling = totals(job, mode, ranks), totals("default", "ceiling", ranks)
            if not values:
                continue
            total = median(values)
            out.append({
                "system": system, "ranks": ranks, "total_img_sec": total, "spread": spread(values),
                "efficiency_vs_1_rank": total / (ranks * median(one)) if one else None,
                "efficiency_vs_ceiling": total / median(ceiling) if ceiling else None,
            })
    return out


def format_summary(record: Dict[str, Any]) -> str:
    """The summary as a table."""
    def pct(value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.0%}"

    rows = [[s["system"], s["ranks"], f"{s['total_img_sec']:.3g}", f"+-{s['spread']:.2g}",
             pct(s["efficiency_vs_1_rank"]), pct(s["efficiency_vs_ceiling"])] for s in record["summary"]]
    where = ("on " + ", ".join(f"{h}:{n}" for h, n in record["hosts"])) if record["hosts"] else "on this host"
    head = (f"# scaling: {' '.join(record['synthetic_args'])} {where}; medians of {record['repeats']} alternating "
            "repeats; efficiency = img/s against N x the 1-rank figure, and against the no-communication "
            "ceiling of the same job")
    return head + "\n" + format_table(["system", "ranks", "img/s (total)", "spread", "vs 1 rank", "vs ceiling"], rows)


def plot(record: Dict[str, Any], out: Union[str, BinaryIO], image_format: str = "png") -> None:
    """Write the plot to a file or binary stream: total img/s and efficiency against the number of
    ranks, one line per system."""
    from matplotlib.figure import Figure  # not pyplot: no global backend to choose (sr/figures.py)

    fig = Figure(figsize=(10, 4))
    rate_ax, eff_ax = fig.subplots(1, 2)
    for system in record["systems"]:
        rows = sorted((s for s in record["summary"] if s["system"] == system), key=lambda s: s["ranks"])
        ranks = [s["ranks"] for s in rows]
        rate_ax.plot(ranks, [s["total_img_sec"] for s in rows], marker="o", label=system)
        eff = [s["efficiency_vs_ceiling"] for s in rows]
        if all(e is not None for e in eff):
            eff_ax.plot(ranks, [100 * e for e in eff], marker="o", label=system)
    ceiling = sorted((s for s in record["summary"] if s["system"] == record["systems"][0]), key=lambda s: s["ranks"])
    for ax, label in ((rate_ax, "img/s (total)"), (eff_ax, "% of the no-communication ceiling")):
        ax.set_xlabel("ranks")
        ax.set_ylabel(label)
        ax.set_xticks([s["ranks"] for s in ceiling])
        ax.grid(True, alpha=0.3)
        ax.legend()
    highest = max((100 * s["efficiency_vs_ceiling"] for s in record["summary"] if s["efficiency_vs_ceiling"]),
                  default=100)
    eff_ax.set_ylim(0, max(110, highest + 10))
    fig.suptitle(f"hpdl bench scaling: {' '.join(record['synthetic_args'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100, format=image_format)
