"""Validate hpdl on a GPU machine in one run (scripts/gpu-check.sh; docs/gpu.md says what it covers).

Steps, in order (what the first run proved, the tests and the single-mode figures, comes last or
is shortened, so that the side-by-side figures fit the budget):

- the machine (GPU, driver, PyTorch, NCCL) and `hpdl check`;
- ``compare-*``: `hpdl bench synthetic --compare plain,ddp` at 1 rank over nccl (hpdl against a
  plain PyTorch loop and DDP, alternating, the order rotated each repeat) for ResNet-50 at batch
  256 and EDSR x2 at batch 16, in float32, bf16 and fp16 mixed precision;
- ``share-gpu-K``: hpdl against DDP (both over gloo) with K = 2 and 4 ranks on the one GPU,
  EDSR-baseline, and again under NVIDIA MPS where `nvidia-cuda-mps-control` is installed (the
  daemon started and stopped here);
- ``spatial-cuda``: `hpdl bench spatial --device cuda`, one EDSR-baseline image over 1, 2 and 4
  ranks sharing the GPU under a cap of GPU memory that one rank's step exceeds;
- ``compile-*``: `hpdl bench synthetic --compile` for both models (against the eager hpdl figure
  of the compare step);
- the tests marked gpu (pytest -m gpu), with the time left.

Nothing hangs and nothing stops the rest: every step runs in a process group of its own under
a time limit, its own and what is left of the whole run's budget (``--budget``, under 8
minutes), and a step that fails, times out or cannot run is recorded with the reason while
the next one starts. The log (every step's output) and a JSON summary (each step's status, time
and figures) are rewritten after every step in ``$OUT`` (else gpu-check-out/), so even a run
that is killed leaves them. Without a CUDA device it prints one line and exits 0, running
nothing; otherwise it exits 1 if any step failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the checkout's hpdl, however this file was started
    sys.path.insert(0, str(ROOT))

from hpdl.launch.process_tree import end_processes, end_tree, processes_with_env  # noqa: E402 - after ROOT

SCHEMA = "hpdl.gpu-check/2"
BUDGET_S = 440.0  # the whole run; with the ends of its last steps, under the 8 minutes a check may take
MIN_STEP_S = 10.0  # a step with less time left than this is not started
MPS_STOP_RESERVE_S = 20.0  # kept back for stopping the MPS daemon, once started
SHARED_GPU_RANKS = (2, 4)  # ranks sharing the one GPU in the share-gpu steps
STEP_MARK = "GPU_CHECK_STEP"  # in every step's environment: what it leaves running is found by it
# The seeds' single-V100 figure: what the ResNet-50 float32 number is read against.
V100_RESNET50_IMG_S = 334.0
# Short benchmark runs: the figures settle within a few batches on a GPU (docs/gpu.md).
BENCH_ARGS = ["--num-warmup", "3", "--num-iters", "2", "--num-batches-per-iter", "5", "--json"]
COMPARE_ARGS = ["--repeats", "3"]  # three modes, each first once as the order rotates
MODELS = {
    "resnet50": ["--model", "resnet50", "--batch-size", "256"],
    "edsr-x2": ["--model", "edsr", "--scale", "2", "--batch-size", "16", "--patch", "48"],
}
PRECISIONS = {"fp32": [], "bf16": ["--amp", "bf16"], "fp16": ["--amp", "fp16"]}
SHARED_MODEL = ["--model", "edsr-baseline", "--scale", "2", "--batch-size", "16", "--patch", "48"]
# One EDSR-baseline image of 1024x1024 (LR) needs about 14 GiB for a step on one rank (862 MiB
# at 256x256 on the CPU, times 16), 2 ranks about half: a cap of 10 GiB refuses 1 rank, holds 2 and 4.
SPATIAL_ARGS = ["--model", "edsr-baseline", "--image", "1024", "--ranks", "1,2,4", "--max-memory", "10G",
                "--warmup", "1", "--rounds", "2", "--timeout", "110", "--overwrite"]


@dataclasses.dataclass
class Step:
    """One command of the check, what limits it and what its output means."""

    name: str
    argv: List[str]
    cap_s: float  # its own time limit; what is left of the budget may cut it shorter
    kind: str = "command"  # how its output is read: command, environment, tests, bench, mps-start, mps-servers
    env: Dict[str, str] = dataclasses.field(default_factory=dict)
    stdin: Optional[str] = None
    meta: Dict[str, Any] = dataclasses.field(default_factory=dict)
    needs: Optional[str] = None  # a step whose success this one needs (else skipped, naming it)
    cannot: Optional[str] = None  # why it cannot run here (skipped with this reason)


@dataclasses.dataclass
class Outcome:
    """What one step did: "passed", "failed", "timed out" or "skipped"."""

    status: str
    seconds: float = 0.0
    returncode: Optional[int] = None
    reason: Optional[str] = None
    output: str = ""


# -- the plan ------------------------------------------------------------------------------------


def gpu_test_workers(xdist_found: bool, cores: int) -> int:
    """How many pytest-xdist workers run the gpu tests: one per 4 cores (each test starts ranks of
    its own), at most 4; 1 (one after another) without xdist."""
    return max(1, min(4, cores // 4)) if xdist_found else 1


def plan(python: str, torchrun: Optional[str], mps_control: Optional[str], pytest_found: bool,
         pytest_timeout_found: bool, mps_dir: str, test_workers: int = 1, out_dir: str = "gpu-check-out") -> List[Step]:
    """The steps of a check, in order (a pure function of what this machine has)."""
    hpdl = [python, "-m", "hpdl"]
    steps = [
        Step("environment", [python, "-c", ENVIRONMENT_PROBE], 60, kind="environment"),
        Step("hpdl-check", hpdl + ["check"], 60),
    ]
    for model, args in MODELS.items():
        for precision, amp in PRECISIONS.items():
            bench = ["bench", "synthetic", "--device", "cuda", *args, *amp, "--compare", "plain,ddp", *COMPARE_ARGS,
                     *BENCH_ARGS]
            steps.append(Step(f"compare-{model}-{precision}", _ranks_argv(python, torchrun, 1, bench, "nccl"), 60,
                              kind="compare", env=_ranks_env(torchrun, 1, "nccl"),
                              meta={"figure": f"{model}-{precision}", "ranks": 1}))
    mps_env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(mps_dir, "pipe"),
               "CUDA_MPS_LOG_DIRECTORY": os.path.join(mps_dir, "log")}
    shared = ["bench", "synthetic", "--device", "cuda", *SHARED_MODEL, "--compare", "ddp", *COMPARE_ARGS, *BENCH_ARGS]

    def share_gpu(mps: bool) -> List[Step]:
        return [Step(f"share-gpu-{ranks}" + ("-mps" if mps else ""), _ranks_argv(python, torchrun, ranks, shared),
                     75, kind="compare", env={**(mps_env if mps else {}), **_ranks_env(torchrun, ranks)},
                     meta={"ranks": ranks, "mps": mps}, needs="mps-start" if mps else None)
                for ranks in SHARED_GPU_RANKS]

    steps += share_gpu(mps=False)
    spatial_json = os.path.join(out_dir, "spatial-cuda.json")
    steps.append(Step("spatial-cuda", hpdl + ["bench", "spatial", "--device", "cuda", *SPATIAL_ARGS,
                                              "--json", spatial_json], 120, kind="spatial",
                      meta={"json": spatial_json}))
    for model, args in MODELS.items():
        steps.append(Step(f"compile-{model}", hpdl + ["bench", "synthetic", "--device", "cuda", *args, "--compile",
                                                      *BENCH_ARGS], 120, kind="bench", meta={"compiled": model}))
    if mps_control is None:
        steps.append(Step("mps", [], 0, cannot="nvidia-cuda-mps-control is not installed here: no MPS runs"))
    else:
        steps.append(Step("mps-start", [mps_control, "-d"], 20, kind="mps-start", env=mps_env))
        steps += share_gpu(mps=True)
        steps.append(Step("mps-servers", [mps_control], 15, kind="mps-servers", env=mps_env,
                          stdin="get_server_list\n", needs="mps-start"))
        steps.append(Step("mps-stop", [mps_control], 20, env=mps_env, stdin="quit\n", needs="mps-start",
                          meta={"reserved": True}))
    # A test module that fails to import here (a package this machine lacks) must not stop the rest.
    tests = [python, "-m", "pytest", "-v", "-rfEs", "-m", "gpu", "-p", "no:cacheprovider",
             "--continue-on-collection-errors"]
    if pytest_timeout_found:
        tests.append("--timeout=150")  # one hung test must not take the others' time
    if test_workers >= 2:
        # One after another the tests took 237 s of their 240 on an H200 (docs/gpu.md): most of a
        # test is its ranks starting, so four side by side (a GPU machine has the cores) share it.
        tests += ["-n", str(test_workers), "--dist", "load"]
    steps.append(Step("gpu-tests", tests + ["tests"], 240, kind="tests",
                      cannot=None if pytest_found else "pytest is not installed here (pip install pytest)"))
    return steps


def select_steps(steps: List[Step], wanted: Sequence[str]) -> List[Step]:
    """The steps whose names start with one of ``wanted``, in the plan's order, with the MPS
    daemon's steps around the MPS runs chosen; ValueError for a name that matches none."""
    unknown = [w for w in wanted if not any(s.name.startswith(w) for s in steps)]
    if unknown:
        raise ValueError(f"no step named {unknown[0]!r}")
    chosen = [s for s in steps if any(s.name.startswith(w) for w in wanted)]
    if any(s.needs == "mps-start" for s in chosen):
        chosen = [s for s in steps if s in chosen or s.name in ("mps-start", "mps-servers", "mps-stop")]
    return chosen


def _ranks_argv(python: str, torchrun: Optional[str], ranks: int, bench: List[str],
                backend: Optional[str] = None) -> List[str]:
    """K ranks of ``hpdl bench`` on the one GPU: through `hpdl run --ranks-per-gpu K` (torchrun,
    as the machine has no mpiexec), or torch's own launcher module where no torchrun is found
    (told the ranks per GPU and the backend by :func:`_ranks_env`)."""
    if torchrun is not None:
        chosen = ["--backend", backend] if backend else []
        return [python, "-m", "hpdl", "run", "-np", str(ranks), "--ranks-per-gpu", str(ranks), *chosen,
                "--launcher", "torchrun", "--", python, "-m", "hpdl", *bench]
    return [python, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone",
            "-m", "hpdl", *bench]


def _ranks_env(torchrun: Optional[str], ranks: int, backend: Optional[str] = None) -> Dict[str, str]:
    if torchrun is not None:  # hpdl run sets them
        return {}
    return {"HPDL_RANKS_PER_GPU": str(ranks), **({"HPDL_BACKEND": backend} if backend else {})}


ENVIRONMENT_PROBE = """\
import json, platform, torch
out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "cudnn": torch.backends.cudnn.version(), "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
       "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32, "gpus": []}
try:
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
except Exception as err:
    out["nccl"] = f"unavailable: {err}"
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    out["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                        "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count,
                        "bf16": torch.cuda.is_bf16_supported()})
print(json.dumps(out))
"""


def shown(argv: Sequence[str]) -> str:
    """``argv`` as one line for the log, the list and the summary (a script given with -c as its name)."""
    words = ["<environment probe>" if word == ENVIRONMENT_PROBE else shlex.quote(word) for word in argv]
    return " ".join(words) or "-"


# -- running a step ------------------------------------------------------------------------------


def end_leftovers(mark: str) -> List[int]:
    """End the live processes whose environment holds ``mark`` (``NAME=value``, set on one step's
    command): what it started in sessions of its own and left running (a test's ranks after its
    timeout) would hold the GPU through the next steps. Returns their pids."""
    found = processes_with_env(mark)
    end_processes(found)
    return found


def run_command(argv: Sequence[str], timeout_s: float, env: Dict[str, str], log: Callable[[str], None],
                stdin: Optional[str] = None) -> Outcome:
    """Run ``argv`` in a session of its own, its output (stdout and stderr) into ``log`` line by
    line; end it with all it started after ``timeout_s``."""
    start = time.monotonic()
    try:
        proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", env=env, cwd=ROOT, start_new_session=True,
                                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL)
    except OSError as err:
        return Outcome("failed", reason=f"cannot start {argv[0]}: {err.strerror or err}")
    lines: List[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            log(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if stdin is not None:
        try:
            proc.stdin.write(stdin)
            proc.stdin.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        end_tree(proc)
        timed_out = True
    reader.join(5)
    seconds = time.monotonic() - start
    output = "".join(lines)
    if timed_out:
        return Outcome("timed out", seconds, proc.returncode, f"ended after {timeout_s:.0f} s", output)
    if proc.returncode != 0:
        return Outcome("failed", seconds, proc.returncode, _last_error(output, proc.returncode), output)
    return Outcome("passed", seconds, 0, None, output)


def _last_error(output: str, returncode: int) -> str:
    """The line that says why a command failed: its last error line, else its exit status."""
    for line in reversed(output.splitlines()):
        text = line.strip()
        if re.match(r"(hpdl: error:|\w*Error\b|\w+Exception\b|FAILED |ERROR |error:)", text):
            return text[:300]
    return f"exited {returncode}"


# -- reading what the steps printed --------------------------------------------------------------


def json_record(output: str) -> Optional[Dict[str, Any]]:
    """The JSON object a command printed (a benchmark's --json record), among other lines."""
    for match in re.finditer(r"^\{", output, re.M):
        try:
            record, _ = json.JSONDecoder().raw_decode(output[match.start():])
        except ValueError:
            continue
        if isinstance(record, dict):
            return record
    return None


_TEST_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)
# pytest-xdist's -v lines: "[gw0] [ 50%] PASSED tests/test_gpu.py::test_x[nccl-1]"
_XDIST_TEST_LINE = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+)",
                              re.M)
_TEST_REASON = re.compile(r"^(FAILED|ERROR) (\S+::\S+) - (.*)$", re.M)
_SKIP_REASON = re.compile(r"^SKIPPED \[\d+\] \S+: (.*)$", re.M)


def read_test_results(output: str) -> Dict[str, Any]:
    """Per test, its result (from pytest -v, as each ends, so a run cut short keeps those done),
    the counts, why each failed, and why tests were skipped."""
    results: Dict[str, str] = {}
    for name, result in _TEST_LINE.findall(output):
        results[name] = result
    for result, name in _XDIST_TEST_LINE.findall(output):
        results[name] = result
    counts: Dict[str, int] = {}
    for result in results.values():
        counts[result.lower()] = counts.get(result.lower(), 0) + 1
    failures = {name: reason[:300] for _, name, reason in _TEST_REASON.findall(output)}
    return {"counts": counts, "results": results, "failures": failures,
            "skip_reasons": sorted(set(_SKIP_REASON.findall(output)))}


def bench_figures(record: Dict[str, Any]) -> Dict[str, Any]:
    """The figures of a synthetic benchmark record."""
    keys = ("model", "batch_size", "amp", "compile", "ranks", "backend", "device", "gpu", "img_sec_per_rank",
            "img_sec_per_rank_conf", "total_img_sec", "total_img_sec_conf")
    return {key: record[key] for key in keys if key in record}


def compare_figures(record: Dict[str, Any]) -> Dict[str, Any]:
    """The figures of a synthetic benchmark record with --compare: each mode's median img/s per
    rank and runs, and hpdl's ratios to the others (of the medians, and the median of each
    repeat's own ratio)."""
    keys = ("model", "batch_size", "amp", "ranks", "backend", "ddp_backend", "device", "gpu", "median", "runs",
            "ratio", "paired_ratio")
    return {key: record[key] for key in keys if key in record}


def spatial_figures(record: Dict[str, Any]) -> Dict[str, Any]:
    """What `hpdl bench spatial`'s record says per point (img/s, memory per rank, fit or not)."""
    keys = ("ranks", "grid", "status", "reason", "img_sec", "bound_img_sec", "efficiency", "memory",
            "memory_vs_1_rank", "peak_resident")
    return {"model": record.get("model"), "image": record.get("image"), "device": record.get("device"),
            "max_memory": record.get("max_memory"),
            "points": [{k: row[k] for k in keys if k in row} for row in record.get("summary", [])]}


# -- the run -------------------------------------------------------------------------------------


class Check:
    """Runs the plan under the budget, keeps the log and rewrites the summary after every step."""

    def __init__(self, steps: List[Step], out_dir: Path, budget_s: float, env: Dict[str, str],
                 echo: Callable[[str], None] = print):
        self.steps, self.out_dir, self.budget_s, self.env, self.echo = steps, out_dir, budget_s, env, echo
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.outcomes: Dict[str, Outcome] = {}
        self.records: List[Dict[str, Any]] = []
        self.environment: Dict[str, Any] = {}
        self.tests: Optional[Dict[str, Any]] = None
        self.figures: Dict[str, Any] = {"compare": {}, "share_gpu": {}, "compile": {}}
        out_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = out_dir / "gpu-check.log"
        self.summary_path = out_dir / "gpu-check.json"
        self._log = open(self.log_path, "w", encoding="utf-8")

    def log(self, text: str) -> None:
        self._log.write(text)
        self._log.flush()

    def run(self) -> int:
        try:
            for index, step in enumerate(self.steps, 1):
                outcome = self._run_step(step)
                self.outcomes[step.name] = outcome
                self._read(step, outcome)
                self.records.append(self._record(step, outcome))
                self.write_summary(finished=False)
                where = f"[{index}/{len(self.steps)}] {step.name}"
                why = f": {outcome.reason}" if outcome.reason and outcome.status != "passed" else ""
                self.echo(f"gpu-check: {where} {outcome.status} ({outcome.seconds:.1f} s){why}")
        finally:
            self.write_summary(finished=True)
            self._log.close()
        for line in self.figure_lines():
            self.echo(line)
        self.echo(f"gpu-check: log {self.log_path}, summary {self.summary_path}")
        return 0 if self.ok else 1

    @property
    def ok(self) -> bool:
        return all(o.status in ("passed", "skipped") for o in self.outcomes.values())

    def _run_step(self, step: Step) -> Outcome:
        self.log(f"\n=== {step.name}: {shown(step.argv)}\n")
        if step.cannot is not None:
            return self._skipped(step.cannot)
        if step.needs is not None and self.outcomes.get(step.needs, Outcome("skipped")).status != "passed":
            return self._skipped(f"{step.needs} did not pass")
        left = self.deadline - time.monotonic()
        if not step.meta.get("reserved"):
            left -= self._reserve()
        if left < MIN_STEP_S and not step.meta.get("reserved"):
            return self._skipped(f"out of time: {max(left, 0):.0f} s of the {self.budget_s:.0f} s budget left")
        timeout = max(min(step.cap_s, left), MIN_STEP_S)
        mark = f"{STEP_MARK}={os.getpid()}.{step.name}"
        outcome = run_command(step.argv, timeout, {**self.env, **step.env, STEP_MARK: mark.split("=", 1)[1]},
                              self.log, step.stdin)
        if step.kind != "mps-start":  # the MPS daemon is meant to outlive its start
            left_over = end_leftovers(mark)
            if left_over:
                self.log(f"--- ended {len(left_over)} process(es) it left running: {left_over}\n")
        self.log(f"--- {step.name}: {outcome.status} in {outcome.seconds:.1f} s"
                 + (f" ({outcome.reason})" if outcome.reason else "") + "\n")
        return outcome

    def _skipped(self, reason: str) -> Outcome:
        self.log(f"--- skipped: {reason}\n")
        return Outcome("skipped", reason=reason)

    def _reserve(self) -> float:
        """Time kept for the MPS daemon's stop while it runs."""
        started = self.outcomes.get("mps-start")
        stopped = "mps-stop" in self.outcomes
        return MPS_STOP_RESERVE_S if started is not None and started.status == "passed" and not stopped else 0.0

    def _read(self, step: Step, outcome: Outcome) -> None:
        """Take the step's figures from its output into the summary."""
        if step.kind == "tests" and outcome.status != "skipped":
            self.tests = read_test_results(outcome.output)
            if outcome.status == "passed" and not self.tests["counts"].get("passed"):
                # On a machine with a GPU every one skipping means a check is wrong somewhere.
                skips = "; ".join(self.tests["skip_reasons"]) or "none ran"
                outcome.status, outcome.reason = "failed", f"no test marked gpu passed ({skips})"
        elif step.kind == "environment" and outcome.status == "passed":
            self.environment = json_record(outcome.output) or {}
        elif step.kind in ("bench", "compare") and outcome.status == "passed":
            record = json_record(outcome.output)
            if record is None:
                outcome.status, outcome.reason = "failed", "no JSON record in its output"
                return
            if step.kind == "bench":
                self.figures["compile"][step.meta["compiled"]] = bench_figures(record)
            elif "figure" in step.meta:
                self.figures["compare"][step.meta["figure"]] = compare_figures(record)
            else:
                mode = "with MPS" if step.meta["mps"] else "without MPS"
                self.figures["share_gpu"].setdefault(mode, {})[str(step.meta["ranks"])] = compare_figures(record)
        elif step.kind == "spatial" and outcome.status == "passed":
            try:
                record = json.loads(Path(step.meta["json"]).read_text())
            except (OSError, ValueError) as err:
                outcome.status, outcome.reason = "failed", f"no record in {step.meta['json']}: {err}"
                return
            self.figures["spatial"] = spatial_figures(record)
        elif step.kind == "mps-servers" and outcome.status == "passed":
            # Whether the ranks went through MPS: the servers the daemon runs, and its log's
            # lines about servers and clients (a server may end once its clients have).
            log = Path(step.env["CUDA_MPS_LOG_DIRECTORY"]) / "control.log"
            try:
                lines = log.read_text(errors="replace").splitlines()
            except OSError as err:
                lines = [f"({log}: {err.strerror})"]
            self.figures["mps"] = {
                "servers": [line.strip() for line in outcome.output.splitlines() if line.strip().isdigit()],
                "control_log": [line for line in lines if re.search(r"client|server", line, re.I)][-20:]}

    def _record(self, step: Step, outcome: Outcome) -> Dict[str, Any]:
        return {"name": step.name, "command": shown(step.argv), "status": outcome.status,
                "seconds": round(outcome.seconds, 1), "returncode": outcome.returncode, "reason": outcome.reason,
                **({"env": step.env} if step.env else {})}

    def write_summary(self, finished: bool) -> None:
        summary = {
            "schema": SCHEMA, "started": self.started_at, "finished": finished,
            "seconds": round(time.monotonic() - self.start, 1), "budget_s": self.budget_s,
            "host": socket.gethostname(), "ok": self.ok, "environment": self.environment,
            "steps": self.records, "tests": self.tests, "figures": self._figures(),
        }
        text = json.dumps(summary, indent=1) + "\n"
        tmp = self.summary_path.with_name(f".{self.summary_path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, self.summary_path)  # a reader, or a kill, never sees half a summary

    def _figures(self) -> Dict[str, Any]:
        figures = dict(self.figures)
        resnet = figures["compare"].get("resnet50-fp32", {}).get("median", {}).get("hpdl")
        if resnet:
            figures["resnet50_fp32_vs_v100_reference"] = {
                "reference_img_s": V100_RESNET50_IMG_S, "ratio": round(resnet / V100_RESNET50_IMG_S, 2)}
        for model, compiled in self.figures["compile"].items():
            eager = figures["compare"].get(f"{model}-fp32", {}).get("median", {}).get("hpdl")
            if eager and "img_sec_per_rank" in compiled:
                figures.setdefault("compiled_vs_eager", {})[model] = round(compiled["img_sec_per_rank"] / eager, 3)
        return figures

    def figure_lines(self) -> List[str]:
        lines = []
        for name, f in self.figures["compare"].items():
            median = f.get("median", {})
            ratios = ", ".join(f"hpdl/{k} {v:.3f}" for k, v in f.get("paired_ratio", {}).items())
            lines.append(f"gpu-check: {name}: hpdl {median.get('hpdl', 0):.1f} img/s; {ratios}")
        for mode, by_ranks in self.figures["share_gpu"].items():
            cells = "; ".join(f"{k} ranks: hpdl {v['median']['hpdl'] * v['ranks']:.1f}, ddp "
                              f"{v['median']['ddp'] * v['ranks']:.1f} img/s (hpdl/ddp {v['paired_ratio']['ddp']:.3f})"
                              for k, v in by_ranks.items())
            lines.append(f"gpu-check: EDSR-baseline ranks sharing the GPU {mode}: {cells}")
        if "spatial" in self.figures:
            cells = "; ".join(f"{p['ranks']} ranks " + (f"{p['img_sec']:.3g} img/s, {p['memory'] / 2**30:.2f} GiB/rank"
                                                        if p["status"] == "ok" else p["status"])
                              for p in self.figures["spatial"]["points"])
            lines.append(f"gpu-check: spatial on the GPU: {cells}")
        for model, f in self.figures["compile"].items():
            lines.append(f"gpu-check: {model} compiled: {f['img_sec_per_rank']:.1f} img/s")
        return lines


# -- the command line ----------------------------------------------------------------------------


def _mps_control() -> Optional[str]:
    """NVIDIA MPS's control program: on PATH, or beside a driver mounted at /usr/local/nvidia."""
    return shutil.which("nvidia-cuda-mps-control") or shutil.which("nvidia-cuda-mps-control",
                                                                   path="/usr/local/nvidia/bin:/usr/bin")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line, not argparse's usage and error."""
        self.exit(2, f"gpu-check: error: {message}\n")


def main(argv: Optional[Sequence[str]] = None, cuda_reason: Optional[Callable[[], Optional[str]]] = None) -> int:
    """Run the check; return the exit status.

    Args:
        cuda_reason: why CUDA cannot be used here (None: it can); default: hpdl's own probe.
    """
    parser = _Parser(prog="scripts/gpu-check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder of the log and summary (default: $OUT, else gpu-check-out)")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help=f"seconds the whole run may take (default {BUDGET_S:.0f})")
    parser.add_argument("--steps", default=None,
                        help="comma-separated step names or prefixes to run (default: all); --list shows them")
    parser.add_argument("--list", action="store_true", help="print the steps and their commands, run nothing")
    args = parser.parse_args(argv)
    if not 0 < args.budget <= 3600:
        parser.error(f"--budget must be in (0, 3600] seconds, got {args.budget:g}")

    from hpdl.launch.detect import detect_launchers

    python = sys.executable
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    mps_dir = os.path.join(tempfile.gettempdir(), f"hpdl-gpu-check-mps-{os.getpid()}")
    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / "gpu-check-out")
    steps = plan(python, detect_launchers(env).torchrun, _mps_control(),
                 importlib.util.find_spec("pytest") is not None,
                 importlib.util.find_spec("pytest_timeout") is not None, mps_dir,
                 gpu_test_workers(importlib.util.find_spec("xdist") is not None, os.cpu_count() or 1),
                 out_dir=str(out_dir))
    if args.steps:
        try:
            steps = select_steps(steps, [w.strip() for w in args.steps.split(",") if w.strip()])
        except ValueError as err:
            parser.error(f"--steps: {err}; --list shows them")
    if args.list:
        for step in steps:
            print(f"{step.name}: {shown(step.argv)}" + (f" (skipped: {step.cannot})" if step.cannot else ""))
        return 0

    if cuda_reason is None:
        try:
            from hpdl.comm.select import cuda_unavailable_reason as cuda_reason
        except ImportError as err:  # no torch: nothing here can use a GPU
            print(f"gpu-check: cannot import PyTorch ({err}); nothing run", flush=True)
            return 1
    reason = cuda_reason()
    if reason is not None:
        print(f"gpu-check: no CUDA device here ({reason}); nothing run", flush=True)
        return 0
    for sub in ("pipe", "log"):  # the MPS daemon's folders, out of $OUT (whose files all come back)
        os.makedirs(os.path.join(mps_dir, sub), exist_ok=True)
    try:
        return Check(steps, out_dir, args.budget, env).run()
    finally:  # what the daemon's log said is in the summary by now
        shutil.rmtree(mps_dir, ignore_errors=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `--list | head`: the reader went away
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
