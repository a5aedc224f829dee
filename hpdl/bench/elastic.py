"""`hpdl bench elastic`: how long an elastic job takes to go on after a worker dies, and to
take in a host that appears, and where that time goes.

A driver, not a job: for each model and worker count it starts one elastic job,
``hpdl run -np N --min-np N-1 --max-np N --host-discovery-script S -- python -m
hpdl.bench.elastic_worker ...``, on hosts that are this machine's names (localhost, 127.0.0.1,
127.0.0.2, ...: each a host of its own, one slot each), and in each round:

1. once the world of N has done ``steps`` steps, SIGKILLs the worker of the highest rank
   (stamped with ``time.time()`` right before the kill): the driver blacklists its host and
   the survivors form a world of N-1;
2. once that world has done ``steps`` steps, rewrites the file that the discovery script
   prints with a host name never used before (stamped at the rename): the driver starts a
   worker there and the survivors take it in at their next commit (HostsUpdatedInterrupt).

Each worker (hpdl/bench/elastic_worker.py) logs the moments each phase of a reset begins and
ends, on the same clock; the driver's lines on stderr ("... going on without it",
"generation N: ...") are stamped as they arrive here. Each phase is measured at the world's
pace: a boundary is the moment the last worker of the new world passed it, so the phases of
a reset add up to its total. After a death: detect (the death -> the last survivor's collective
raised HorovodInternalError), restore (the last commit loaded back), shutdown (hvd.shutdown()),
wait (for the driver's next generation and its every member), init (the process group formed,
the engine started), sync (the state broadcast from rank 0, after the reset callbacks; in parts:
the parameters, the optimizer's state, the rest), first step (the new world's first training
step, ended). After a host appears: discover (the file rewritten -> the driver published the
generation that holds the new worker, its discovery running every
HPDL_ELASTIC_DISCOVERY_INTERVAL), notice (-> the last survivor's commit raised
HostsUpdatedInterrupt), shutdown, wait (mostly for the new worker's interpreter, imports and
model), init, sync, first step; and the new worker's own start: python (spawned -> the script
runs), imports (torch and hpdl), model (the model and its optimizer built: PyTorch's first
optimizer imports torch._dynamo).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from hpdl.bench.elastic_worker import TINY
from hpdl.bench.jobs import JobError, Stopped, check_timeout, end_job, reason, stops_keep_the_record
from hpdl.bench.models import sr_models
from hpdl.bench.stats import median
from hpdl.formatting import format_table

__all__ = ["ElasticBenchError", "ElasticBenchOptions", "ElasticBenchStopped", "NEW_WORKER_PHASES", "PHASES",
           "format_summary", "host_names", "run_elastic_bench"]

# The phases of each kind of reset, in order; they add up to its total.
PHASES = {
    "failure": ("detect", "restore", "shutdown", "wait", "init", "sync", "first_step"),
    "host": ("discover", "notice", "shutdown", "wait", "init", "sync", "first_step"),
}
NEW_WORKER_PHASES = ("python", "imports", "model")
_POLL_S = 0.02
# Steps the first world does before the first death: its first steps warm up.
_WARMUP_STEPS = 2
# Host names: localhost and 127.0.0.1-254, this machine's names, each a host of its own for the driver.
_MAX_HOSTS = 255


class ElasticBenchError(JobError):
    """A job of the benchmark failed; ``record`` holds the points measured before."""

    record: Optional[Dict[str, Any]] = None


class ElasticBenchStopped(Stopped):
    """Stopped by a signal after its running job was ended; ``record`` holds the points measured."""


@dataclasses.dataclass(frozen=True)
class ElasticBenchOptions:
    models: Tuple[str, ...] = ("edsr-baseline", "edsr")
    workers: Tuple[int, ...] = (2, 4, 8)
    rounds: int = 1
    steps: int = 2  # steps of each world before the next change
    scale: int = 2
    patch: int = 8  # LR patch, batch 1
    optimizer: str = "sgd"
    discovery_interval_s: float = 1.0
    timeout_s: float = 900.0  # per job

    def __post_init__(self) -> None:
        known = sr_models() + (TINY,)
        unknown = [m for m in self.models if m not in known]
        if not self.models or unknown or len(set(self.models)) != len(self.models):
            raise ValueError(f"--model takes distinct models among {', '.join(known)}, got {','.join(self.models)}")
        if not self.workers or any(n < 2 for n in self.workers) or len(set(self.workers)) != len(self.workers):
            raise ValueError(f"--workers takes distinct worker counts of at least 2 (a death leaves N-1), got "
                             f"{','.join(map(str, self.workers))}")
        for name in ("rounds", "steps", "patch"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if max(self.workers) + self.rounds > _MAX_HOSTS:
            raise ValueError(f"{max(self.workers)} workers and {self.rounds} round(s) need "
                             f"{max(self.workers) + self.rounds} host names of this machine; localhost and "
                             f"127.0.0.1-254 are {_MAX_HOSTS}")
        if self.optimizer not in ("sgd", "adam"):
            raise ValueError(f"--optimizer takes sgd or adam, got {self.optimizer}")
        if not 0 < self.discovery_interval_s <= 3600:
            raise ValueError(f"--discovery-interval takes seconds above 0 and at most 3600, got "
                             f"{self.discovery_interval_s:g}")
        check_timeout(self.timeout_s)
        from hpdl.sr.registry import make_config

        for model in self.models:
            if model != TINY:
                try:
                    make_config(model, self.scale)
                except ValueError as err:  # naming the scales the model has
                    raise ValueError(f"--scale {self.scale} for {model}: {err}") from None

    def points(self) -> List[Tuple[str, int]]:
        return [(model, workers) for model in self.models for workers in self.workers]


def host_names(count: int) -> List[str]:
    """``count`` names of this machine, each a host of its own: localhost, 127.0.0.1, 127.0.0.2, ..."""
    if count > _MAX_HOSTS:
        raise ValueError(f"{count} host names asked for; this machine has {_MAX_HOSTS} (127.0.0.1-254 and localhost)")
    return ["localhost"] + [f"127.0.0.{i}" for i in range(1, count)]


# -- one job ------------------------------------------------------------------------------------


class _Job:
    """One elastic job: its process, the driver's stderr lines stamped as they come, and the
    workers' events as they are written."""

    def __init__(self, argv: Sequence[str], env: Dict[str, str], folder: str, what: str, timeout_s: float):
        self.what = what
        self.folder = folder
        self.events_dir = os.path.join(folder, "events")
        os.makedirs(self.events_dir)
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.events: List[Dict[str, Any]] = []
        self._offsets: Dict[str, int] = {}
        self.stderr: List[Tuple[float, str]] = []
        self.stdout: List[str] = []
        try:
            self.proc = subprocess.Popen(list(argv), env=env, cwd=folder, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
        except OSError as err:
            raise ElasticBenchError(f"cannot start {what}: {err.strerror or err}") from None
        self._readers = [threading.Thread(target=self._read, args=(self.proc.stdout, False), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, True), daemon=True)]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, stamped: bool) -> None:
        for line in stream:
            if stamped:
                self.stderr.append((time.time(), line.rstrip("\n")))
            else:
                self.stdout.append(line)

    def poll(self, ending: bool = False) -> None:
        """Read the events written since the last look; fail if the job ran out of time, or
        ended (unless ``ending``)."""
        for name in sorted(os.listdir(self.events_dir)):
            path = os.path.join(self.events_dir, name)
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1  # whole lines only: a line being written waits for the next look
            self._offsets[path] = self._offsets.get(path, 0) + end
            self.events.extend(json.loads(line) for line in data[:end].splitlines() if line.strip())
        if self.proc.poll() is not None and not ending:
            raise self.failed(f"ended early (exit {self.proc.returncode})")
        if time.monotonic() > self.deadline:
            raise ElasticBenchError(f"{self.what} did not end within {self.timeout_s:g} s (--timeout)")

    def failed(self, how: str) -> ElasticBenchError:
        for reader in self._readers:
            reader.join(timeout=5)
        stderr = "\n".join(line for _, line in self.stderr)
        return ElasticBenchError(f"{self.what} {how}: {reason(''.join(self.stdout), stderr)}",
                                 self.proc.returncode, "".join(self.stdout), stderr)

    def wait_for(self, found: Callable[[], Any], ending: bool = False) -> Any:
        while True:
            self.poll(ending)
            value = found()
            if value is not None and value is not False:
                return value
            time.sleep(_POLL_S)

    def end(self) -> None:
        if self.proc.poll() is None:
            end_job(self.proc)

    # -- what the events say -------------------------------------------------------------------

    def of(self, event: str, **fields: Any) -> List[Dict[str, Any]]:
        return [e for e in self.events if e["event"] == event and all(e.get(k) == v for k, v in fields.items())]

    def world(self, size: int, after: int, steps: int) -> Optional[int]:
        """The first generation newer than ``after`` of ``size`` workers whose rank 0 did ``steps`` steps."""
        done: Dict[int, int] = {}
        for e in self.of("step", rank=0, size=size):
            if e["gen"] > after:
                done[e["gen"]] = done.get(e["gen"], 0) + 1
        ready = [g for g, n in done.items() if n >= steps]
        return min(ready) if ready else None

    def every_member_stepped(self, generation: int) -> bool:
        """Whether each worker of ``generation`` logged a step in it: rank 0's step finds the
        world, and the others' events (which the phases need) may come a moment later."""
        stepped = {e["worker"] for e in self.of("step", gen=generation)}
        return set(self.members(generation)) <= stepped

    def members(self, generation: int) -> Dict[int, int]:
        """worker -> rank in ``generation``."""
        return {e["worker"]: e["rank"] for e in self.of("joined", gen=generation)}

    def pid(self, worker: int) -> int:
        return self.of("start", worker=worker)[0]["pid"]

    def driver_line(self, after: float, text: str) -> Optional[float]:
        """When the driver's first stderr line holding ``text`` after ``after`` came."""
        return next((t for t, line in list(self.stderr) if t >= after and line.startswith("hpdl run: ")
                     and text in line), None)


def job_argv(opts: ElasticBenchOptions, model: str, workers: int, folder: str) -> List[str]:
    """The `hpdl run` command of one job."""
    return [sys.executable, "-m", "hpdl", "run", "-np", str(workers), "--min-np", str(workers - 1),
            "--max-np", str(workers), "--host-discovery-script", os.path.join(folder, "discover.sh"), "--",
            sys.executable, "-m", "hpdl.bench.elastic_worker", "--model", model, "--scale", str(opts.scale),
            "--patch", str(opts.patch), "--optimizer", opts.optimizer,
            "--events", os.path.join(folder, "events"), "--stop", os.path.join(folder, "stop")]


def job_environment(opts: ElasticBenchOptions) -> Dict[str, str]:
    """This environment with one thread per worker, the discovery interval, and hpdl importable."""
    import hpdl

    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["HPDL_ELASTIC_DISCOVERY_INTERVAL"] = f"{opts.discovery_interval_s:g}"
    env.pop("HOROVOD_ELASTIC_DISCOVERY_INTERVAL", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(hpdl.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def run_point(opts: ElasticBenchOptions, model: str, workers: int,
              log: Callable[[str], None] = lambda line: None) -> Dict[str, Any]:
    """Run one job of ``opts.rounds`` rounds at ``workers`` workers; return its record."""
    what = f"the job of {model} on {workers} workers"
    names = host_names(workers + opts.rounds)
    folder = tempfile.mkdtemp(prefix="hpdl-bench-elastic-")
    job: Optional[_Job] = None
    try:
        hosts_file = os.path.join(folder, "hosts")  # what the discovery script prints, rewritten to add a host
        _write(hosts_file, "".join(f"{h}:1\n" for h in names[:workers]))
        script = os.path.join(folder, "discover.sh")
        _write(script, f"#!/bin/sh\nexec cat {shlex.quote(hosts_file)}\n")
        os.chmod(script, 0o755)
        job = _Job(job_argv(opts, model, workers, folder), job_environment(opts), folder, what, opts.timeout_s)
        rounds = []
        generation = job.wait_for(lambda: job.world(workers, -1, _WARMUP_STEPS + opts.steps))
        listed = workers
        for number in range(opts.rounds):
            members = job.members(generation)
            victim = next(w for w, r in members.items() if r == workers - 1)
            pid = job.pid(victim)
            died = time.time()
            os.kill(pid, signal.SIGKILL)
            smaller = job.wait_for(lambda: job.world(workers - 1, generation, opts.steps))
            job.wait_for(lambda: job.every_member_stepped(smaller))
            listed += 1
            _write(hosts_file, "".join(f"{h}:1\n" for h in names[:listed]))
            appeared = time.time()
            larger = job.wait_for(lambda: job.world(workers, smaller, opts.steps))
            job.wait_for(lambda: job.every_member_stepped(larger))
            done = {"round": number, "failure": failure_phases(job, died, generation, smaller, victim),
                    "host": host_phases(job, appeared, smaller, larger)}
            rounds.append(done)
            log(f"{model}, {workers} workers, round {number + 1}/{opts.rounds}: "
                f"death -> first step {done['failure']['total']:.2f} s, "
                f"new host -> first step {done['host']['total']:.2f} s")
            generation = larger
        last = max(e["step"] for e in job.of("step"))
        _write(os.path.join(folder, "stop"), str(last + 3))  # no rank is past last + 1: every one stops there
        job.wait_for(lambda: job.proc.poll() is not None, ending=True)
        job.poll(ending=True)  # the last events
        exit_note = _exit_note(job, generation)
        if exit_note is not None:
            log(f"{model}, {workers} workers: warning: {exit_note}")
    except BaseException:
        if job is not None:
            job.end()
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    parameters = next((e["parameters"] for e in job.of("built")), None)
    return {"model": model, "workers": workers, "parameters": parameters,
            "step_s": _steady_step(job, workers), "exit_status": job.proc.returncode,
            "exit_note": exit_note, "rounds": rounds,
            "median": {kind: _medians([r[kind] for r in rounds]) for kind in ("failure", "host")}}


def _steady_step(job: _Job, workers: int) -> float:
    """The median step of the worlds of ``workers`` (rank 0's), but the first steps of each world."""
    by_generation: Dict[int, List[float]] = {}
    for e in job.of("step", rank=0, size=workers):
        by_generation.setdefault(e["gen"], []).append(e["t"] - e["t0"])
    first = min(by_generation)
    steady = [t for g, times in by_generation.items() for t in times[_WARMUP_STEPS if g == first else 1:]]
    return median(steady or [t for times in by_generation.values() for t in times])


def _exit_note(job: _Job, generation: int) -> Optional[str]:
    """None when the job ended well; what went wrong when it failed only after every worker of
    its last world had finished (logged ``done`` after hvd.shutdown()), so that what was
    measured stands (the failure is an exit's: see docs/elastic.md, "How fast a reset is").

    Raises:
        ElasticBenchError: it failed before that.
    """
    if job.proc.returncode == 0:
        return None
    unfinished = [w for w in job.members(generation) if not job.of("done", worker=w)]
    if unfinished:
        raise job.failed(f"failed (exit {job.proc.returncode}) before worker(s) "
                         f"{', '.join(map(str, unfinished))} finished")
    error = job.failed(f"ended with exit status {job.proc.returncode}")
    return f"{error} after every worker had finished training and shut hpdl down; the figures stand"


def _last(job: _Job, event: str, workers: Sequence[int], after: float, **fields: Any) -> float:
    """The moment the last of ``workers`` logged its first ``event`` after ``after``."""
    times = []
    for worker in workers:
        found = [e["t"] for e in job.of(event, worker=worker, **fields) if e["t"] >= after]
        if not found:
            raise ElasticBenchError(f"worker {worker} logged no {event!r} event after {after:.3f}")
        times.append(min(found))
    return max(times)


def _phases(kind: str, bounds: Sequence[float]) -> Dict[str, float]:
    phases = {name: bounds[i + 1] - bounds[i] for i, name in enumerate(PHASES[kind])}
    return dict(phases, total=bounds[-1] - bounds[0])


def _sync_parts(job: _Job, members: Sequence[int], after: float, generation: int,
                bounds: Sequence[float]) -> Dict[str, float]:
    """The sync phase in parts: the parameters' broadcast, the optimizer's state, the rest (the
    plain objects), from ``bounds``' init to resume."""
    gen = dict(gen=generation)
    parameters = _last(job, "synced", members, after, part="parameters", **gen)
    optimizer = _last(job, "synced", members, after, part="optimizer", **gen)
    return {"parameters": parameters - bounds[-4], "optimizer": optimizer - parameters, "rest": bounds[-2] - optimizer}


def failure_phases(job: _Job, died: float, before: int, after: int, victim: int) -> Dict[str, float]:
    """The reset from the death at ``died`` of generation ``before`` to the first step of ``after``."""
    survivors = list(job.members(after))
    new = dict(gen=after)
    bounds = [died, _last(job, "seen", survivors, died, kind="failure"),
              _last(job, "shutdown", survivors, died), _last(job, "join", survivors, died),
              _last(job, "joined", survivors, died, **new), _last(job, "init", survivors, died, **new),
              _last(job, "resume", survivors, died, **new), _last(job, "step", survivors, died, **new)]
    phases = _phases("failure", bounds)
    phases["resumed"] = bounds[-2] - died
    phases["sync_parts"] = _sync_parts(job, survivors, died, after, bounds)
    seen_by_driver = job.driver_line(died, f"worker {victim} ")
    phases["driver_saw_death"] = None if seen_by_driver is None else seen_by_driver - died
    return phases


def host_phases(job: _Job, appeared: float, before: int, after: int) -> Dict[str, Any]:
    """The reset from the host's appearance at ``appeared`` to the first step of ``after``."""
    members = list(job.members(after))
    survivors = [w for w in members if w in job.members(before)]
    new = [w for w in members if w not in survivors]
    published = job.driver_line(appeared, f"generation {after}:")
    if published is None:  # the line came late or not at all: the new worker's start bounds it
        published = min(e["t"] for e in job.of("start") if e["worker"] in new)
    gen = dict(gen=after)
    bounds = [appeared, published, _last(job, "seen", survivors, appeared, kind="hosts"),
              _last(job, "join", survivors, appeared), _last(job, "joined", members, appeared, **gen),
              _last(job, "init", members, appeared, **gen), _last(job, "resume", members, appeared, **gen),
              _last(job, "step", members, appeared, **gen)]
    phases = _phases("host", bounds)
    phases["resumed"] = bounds[-2] - appeared
    phases["sync_parts"] = _sync_parts(job, members, appeared, after, bounds)
    starts = [_last(job, e, new, appeared) for e in ("start", "imported", "built", "join")]
    phases["new_worker"] = {"python": starts[0] - published, "imports": starts[1] - starts[0],
                            "model": starts[2] - starts[1], "ready": starts[3] - published}
    return phases


def _medians(rounds: List[Dict[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in rounds[0].items():
        if isinstance(value, dict):
            out[key] = _medians([r[key] for r in rounds])
        else:
            values = [r[key] for r in rounds if r[key] is not None]
            out[key] = median(values) if values else None
    return out


# -- the study -----------------------------------------------------------------------------------


def run_elastic_bench(opts: ElasticBenchOptions, log: Callable[[str], None] = lambda line: None) -> Dict[str, Any]:
    """Run every point; return the record.

    Raises:
        ElasticBenchError: a job failed; its ``record`` holds the points measured before.
        ElasticBenchStopped: SIGINT, SIGTERM or SIGHUP stopped it (the running job ended first).
    """
    runs: List[Dict[str, Any]] = []
    with stops_keep_the_record(ElasticBenchError, ElasticBenchStopped,
                               lambda failure: _record(opts, runs, failure=failure)):
        for model, workers in opts.points():
            log(f"{model}, {workers} workers: starting")
            started = time.monotonic()
            run = run_point(opts, model, workers, log)
            runs.append(run)
            m = run["median"]
            log(f"{model}, {workers} workers: death -> first step {m['failure']['total']:.2f} s (resumed "
                f"{m['failure']['resumed']:.2f} s), new host -> first step {m['host']['total']:.2f} s; a step "
                f"{run['step_s']:.2f} s; the job took {time.monotonic() - started:.0f} s")
    return _record(opts, runs)


def _record(opts: ElasticBenchOptions, runs: List[Dict[str, Any]], failure: Optional[str] = None) -> Dict[str, Any]:
    record = {"benchmark": "elastic", "models": list(opts.models), "workers": list(opts.workers),
              "rounds": opts.rounds, "steps": opts.steps, "scale": opts.scale, "patch": opts.patch,
              "batch_size": 1, "optimizer": opts.optimizer, "discovery_interval_s": opts.discovery_interval_s,
              "phases": {k: list(v) for k, v in PHASES.items()}, "runs": runs, "complete": failure is None}
    if failure is not None:
        record["failure"] = failure
    return record


def format_summary(record: Dict[str, Any]) -> str:
    """Two tables, medians over the rounds: a worker's death, a host's appearance."""
    def s(value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.2f}"

    head = (f"# elastic: time to the first step of the new world, medians of {record['rounds']} round(s); "
            f"batch 1 of {record['patch']}x{record['patch']} LR patches, x{record['scale']}, "
            f"{record['optimizer']}, a commit after every step, 1 thread per worker, discovery every "
            f"{record['discovery_interval_s']:g} s; seconds")
    out = [head, "", "a worker killed (SIGKILL): N -> N-1"]
    rows = []
    for run in record["runs"]:
        m = run["median"]["failure"]
        rows.append([run["model"], f"{run['workers']} -> {run['workers'] - 1}", s(m["total"]), s(m["resumed"]),
                     s(m["driver_saw_death"])] + [s(m[p]) for p in PHASES["failure"]] + [s(run["step_s"])])
    out.append(format_table(["model", "workers", "total", "resumed", "driver"] + list(PHASES["failure"])
                            + ["step"], rows))
    out += ["", "a host appears (discovery script): N-1 -> N"]
    rows = []
    for run in record["runs"]:
        m = run["median"]["host"]
        w = m["new_worker"]
        rows.append([run["model"], f"{run['workers'] - 1} -> {run['workers']}", s(m["total"]), s(m["resumed"])]
                    + [s(m[p]) for p in PHASES["host"]] + [s(w["python"]), s(w["imports"]), s(w["model"])])
    out.append(format_table(["model", "workers", "total", "resumed"] + list(PHASES["host"])
                            + ["new:python", "imports", "model"], rows))
    out += ["", "the sync, in parts: the parameters' broadcast, the optimizer's state (its scalars as an object), "
                "the rest (the state's plain objects)"]
    rows = []
    for run in record["runs"]:
        for kind, change in (("failure", f"{run['workers']} -> {run['workers'] - 1}"),
                             ("host", f"{run['workers'] - 1} -> {run['workers']}")):
            parts = run["median"][kind]["sync_parts"]
            rows.append([run["model"], change, s(run["median"][kind]["sync"]), s(parts["parameters"]),
                         s(parts["optimizer"]), s(parts["rest"])])
    out.append(format_table(["model", "workers", "sync", "parameters", "optimizer", "rest"], rows))
    out += ["", "total: the event -> the new world's first step ended; resumed: -> that step started; driver: "
                "the driver's line on the death; step: a step of the full world"]
    out += [f"{run['model']}, {run['workers']} workers: {run['exit_note']}" for run in record["runs"]
            if run.get("exit_note")]
    return "\n".join(out)
