"""`hpdl bench spatial`: training one image split over 1, 2, 4, ... ranks (SpatialParallel), its
img/s, the memory each rank needs, its halo exchanges, and its efficiency against the
no-communication bound.

A driver, not a job, as `hpdl bench scaling`: for each rank count of ``ranks`` (and each grid
of that size asked for, else the rank count in row bands) it starts one job,
``hpdl run -np N -- python -m hpdl.bench.spatial ...`` (spatial.py: the real steps alternate
with the bound's in that job), and reads its record. Each job is a fresh set of processes, so
that one rank count's memory is not another's, and a memory budget (``max_memory``) is
enforced on each rank of each job. A point whose job runs out of that budget is recorded as
not fitting, and the study goes on.

The jobs' allocator, glibc's malloc set by its environment variables (each unless set already):

- ``"release"`` (the default): every block of 1 MiB or more is a mapping of its own, returned
  to the system when it is freed (MALLOC_MMAP_THRESHOLD_), so that a rank's peak is what its
  step holds. By default glibc raises that threshold, up to 32 MiB, as it sees large blocks
  freed, and keeps smaller ones in its heap, where the feature maps of one step, freed in
  another order than they were made, leave it fragmented: a rank then holds more than its
  step needs, the more so the smaller its band's maps. The price is time: the kernel hands
  out zeroed pages for each new mapping, every feature map of every step.
- ``"keep"``: every block comes from the heap, which is never given back (MALLOC_MMAP_MAX_=0,
  MALLOC_TRIM_THRESHOLD_): no page is zeroed twice, the fastest step; the fragmentation shows
  in the memory.
- ``"default"``: glibc's own behaviour.

docs/spatial.md has the figures of each.

The jobs' fusion threshold (unless HPDL_FUSION_THRESHOLD or Horovod's name sets one) is the
model's gradient bytes, rounded up to a MiB: every model here has fewer than the default 128
MiB, so the engine fuses the same messages, but its two fusion buffers, each as large as the
threshold, no longer reserve 256 MiB that the budget (RLIMIT_DATA counts memory mapped,
touched or not) would count against the step.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Tuple, Union

from hpdl.bench.jobs import JobError, Stopped, check_timeout, run_job, stops_keep_the_record
from hpdl.bench.models import benchmark_models, sr_models
from hpdl.bench.spatial import DOES_NOT_FIT, JobOptions
from hpdl.formatting import format_size, format_table
from hpdl.bench.synthetic import MAX_THREADS
from hpdl.sr.registry import scales_of

__all__ = ["SpatialStudyError", "SpatialStudyOptions", "SpatialStudyStopped", "format_summary", "plot",
           "run_study"]

Grid = Tuple[int, int]


class SpatialStudyError(JobError):
    """A job of the study failed (other than by not fitting its memory); ``record`` holds the
    points measured before it."""

    record: Optional[Dict[str, Any]] = None


class SpatialStudyStopped(Stopped):
    """The study was stopped by a signal after its running job was ended; ``record`` holds the
    points measured before."""


# The jobs' malloc settings per allocator (see the module's docstring).
ALLOCATOR_ENVIRONMENT: Dict[str, Dict[str, str]] = {
    "release": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    "keep": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)},
    "default": {},
}
ALLOCATORS = tuple(ALLOCATOR_ENVIRONMENT)


def default_image(model: str) -> Grid:
    """The input an image-size-less study trains on: ResNet-50's 224 x 224, the SR models' 256 x 256 LR."""
    return (224, 224) if model not in sr_models() else (256, 256)


@dataclasses.dataclass(frozen=True)
class SpatialStudyOptions:
    """The study: the model and its image, the rank counts and grids, and each job's steps."""

    model: str = "edsr-baseline"
    image: Optional[Grid] = None  # (height, width); None: default_image(model)
    ranks: Tuple[int, ...] = (1, 2, 4)
    grids: Tuple[Grid, ...] = ()  # asked for; a rank count without one runs in row bands
    batch_size: int = 1
    scale: int = 2
    checkpoint: bool = False
    threads: int = 1
    warmup: int = 1
    steps: int = 1
    rounds: int = 3
    max_memory: Optional[int] = None
    allocator: str = "release"  # or "keep", "default": see the module's docstring
    timeout_s: float = 3600.0  # per job
    device: str = "cpu"  # or "cuda": each rank on its node's GPUs, several ranks sharing one where needed

    def __post_init__(self) -> None:
        if self.model not in benchmark_models():
            raise ValueError(f"--model {self.model}: unknown; choose from {', '.join(benchmark_models())}")
        if self.image is not None and (len(self.image) != 2 or min(self.image) < 1):
            raise ValueError(f"--image takes a positive height and width, got {self.image}")
        if not self.ranks or min(self.ranks) < 1 or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"--ranks takes distinct rank counts of at least 1, got {','.join(map(str, self.ranks))}")
        for rows, cols in self.grids:
            if rows < 1 or cols < 1:
                raise ValueError(f"--grid {rows}x{cols}: rows and columns must be at least 1")
            if rows * cols not in self.ranks:
                raise ValueError(f"--grid {rows}x{cols} has {rows * cols} ranks, not one of --ranks "
                                 f"{','.join(map(str, self.ranks))}")
        if len(set(self.grids)) != len(self.grids):
            raise ValueError("--grid names a grid twice")
        for name in ("batch_size", "threads", "steps", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.threads > MAX_THREADS:
            raise ValueError(f"--threads must be at most {MAX_THREADS}, got {self.threads}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be at least 0, got {self.warmup}")
        if self.model in sr_models() and self.scale not in scales_of(self.model):
            raise ValueError(f"--scale of {self.model} must be one of {', '.join(map(str, scales_of(self.model)))}, "
                             f"got {self.scale}")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"--allocator takes {', '.join(ALLOCATORS)}, got {self.allocator!r}")
        if self.max_memory is not None and self.max_memory < 1:
            raise ValueError(f"--max-memory must be above 0, got {self.max_memory}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device takes cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and gpu_count() == 0:
            raise ValueError("--device cuda: this machine has no CUDA device PyTorch can use")
        check_timeout(self.timeout_s)

    @property
    def input_size(self) -> Grid:
        return self.image or default_image(self.model)

    def points(self) -> List[Tuple[int, Grid]]:
        """(ranks, grid) of every job, in the order of --ranks."""
        out = []
        for ranks in self.ranks:
            grids = [g for g in self.grids if g[0] * g[1] == ranks] or [(ranks, 1)]
            out += [(ranks, grid) for grid in grids]
        return out

    def job(self, grid: Grid) -> JobOptions:
        return JobOptions(model=self.model, image=self.input_size, grid=grid, batch_size=self.batch_size,
                          scale=self.scale, checkpoint=self.checkpoint, threads=self.threads, warmup=self.warmup,
                          steps=self.steps, rounds=self.rounds, max_memory=self.max_memory, device=self.device)

    def ranks_per_gpu(self, ranks: int) -> int:
        """How many of a job's ``ranks`` share each GPU (1 on the CPU, or with a GPU per rank)."""
        return -(-ranks // gpu_count()) if self.device == "cuda" else 1


def gpu_count() -> int:
    """This machine's CUDA devices (none without CUDA); CUDA itself is not initialized here."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_layouts(opts: SpatialStudyOptions) -> None:
    """Refuse, before any job, a grid the model cannot split the image into (a band thinner than
    a layer's halo, a layer it cannot run on parts): a dry run on the meta device, in this process.

    Raises:
        ValueError: naming the grid, the layer and what would fit.
    """
    from hpdl.bench.models import build_workload
    from hpdl.torch.spatial import SpatialError, check_split

    model = build_workload(opts.model, 1, opts.scale, image=(1, 1)).model
    height, width = opts.input_size
    for _, grid in opts.points():
        try:
            check_split(model, (opts.batch_size, 3, height, width), grid)
        except SpatialError as err:
            raise ValueError(f"--grid {grid[0]}x{grid[1]} of a {height}x{width} image: {err}") from None


def job_environment(opts: SpatialStudyOptions) -> Dict[str, str]:
    """The environment of every job: this one's, with the threads per rank and (unless set) the
    allocator's threshold and a fusion threshold of the model's gradient bytes (see the
    module's docstring)."""
    from hpdl.bench.models import build_workload, gradient_bytes

    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(opts.threads)
    env.update(malloc_environment(opts))
    if "HPDL_FUSION_THRESHOLD" not in env and "HOROVOD_FUSION_THRESHOLD" not in env:
        nbytes = gradient_bytes(build_workload(opts.model, 1, opts.scale, image=(1, 1)).model)
        env["HPDL_FUSION_THRESHOLD"] = str(max(1, -(-nbytes // 2**20)) * 2**20)
    return env


def malloc_environment(opts: SpatialStudyOptions) -> Dict[str, str]:
    """glibc's MALLOC_* variables the jobs run with: the allocator's, and any set here already
    (which win)."""
    env = dict(ALLOCATOR_ENVIRONMENT[opts.allocator])
    env.update((k, v) for k, v in os.environ.items() if k.startswith("MALLOC_"))
    return env


def job_argv(opts: SpatialStudyOptions, ranks: int, grid: Grid) -> List[str]:
    """The `hpdl run` command of one job of the study."""
    sharing = opts.ranks_per_gpu(ranks)
    per_gpu = ["--ranks-per-gpu", str(sharing)] if sharing > 1 else []
    return [sys.executable, "-m", "hpdl", "run", "-np", str(ranks), *per_gpu, "--",
            sys.executable, "-m", "hpdl.bench.spatial", opts.job(grid).to_json()]


def _run_point(opts: SpatialStudyOptions, ranks: int, grid: Grid, env: Dict[str, str],
               log: Callable[[str], None]) -> Dict[str, Any]:
    """One job: its record, or a record of the point not fitting the memory budget."""
    where = f"{ranks} rank(s), {grid[0]}x{grid[1]}"
    try:
        return run_job(job_argv(opts, ranks, grid), env, opts.timeout_s, f"the job on {where}",
                       progress=lambda line: log(f"{where}: {line}"))
    except JobError as err:
        lines = [line for line in err.stderr.splitlines() if line.startswith(DOES_NOT_FIT)]
        if not lines:
            raise SpatialStudyError(str(err), err.returncode, err.stdout, err.stderr) from None
        return {"ranks": ranks, "grid": list(grid), "status": "does not fit", "reason": lines[0][len(DOES_NOT_FIT):]}


def run_study(opts: SpatialStudyOptions, log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Run every point of the study; return its record.

    Raises:
        SpatialStudyError: a job failed; its ``record`` holds the points measured before.
        SpatialStudyStopped: SIGINT, SIGTERM or SIGHUP stopped the study (the running job is
            ended first); its ``record`` holds the points measured before.
    """
    runs: List[Dict[str, Any]] = []
    env = job_environment(opts)
    with stops_keep_the_record(SpatialStudyError, SpatialStudyStopped,
                               lambda failure: _record(opts, runs, failure=failure)):
        for ranks, grid in opts.points():
            log(f"{ranks} rank(s), {grid[0]}x{grid[1]}: starting")
            run = _run_point(opts, ranks, grid, env, log)
            runs.append(run)
            log(f"{ranks} rank(s), {grid[0]}x{grid[1]}: " + _shown(run))
    return _record(opts, runs)


def _shown(run: Dict[str, Any]) -> str:
    if run["status"] != "ok":
        return f"does not fit: {run['reason']}"
    return (f"{run['img_sec']:.3g} img/s, efficiency {run['efficiency']:.0%} of the bound, "
            f"{_mib(run['memory'])} MiB per rank")


def _mib(nbytes: Optional[float]) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.0f}"


def _record(opts: SpatialStudyOptions, runs: List[Dict[str, Any]], failure: Optional[str] = None) -> Dict[str, Any]:
    record = {"benchmark": "spatial", "model": opts.model, "image": list(opts.input_size),
              "scale": opts.scale if opts.model in sr_models() else None, "batch_size": opts.batch_size,
              "checkpoint": opts.checkpoint, "threads": opts.threads, "warmup": opts.warmup, "steps": opts.steps,
              "rounds": opts.rounds, "max_memory": opts.max_memory, "allocator": opts.allocator,
              "device": opts.device,
              "malloc_environment": malloc_environment(opts), "ranks": list(opts.ranks),
              "runs": runs, "summary": summarize(runs)}
    if failure is not None:
        record.update(complete=False, failure=failure)
    return record


def summarize(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per point: img/s, efficiency, memory per rank (and against 1 rank's), halos per step."""
    one = next((r["memory"] for r in runs if r["ranks"] == 1 and r["status"] == "ok"), None)
    out = []
    for run in runs:
        row: Dict[str, Any] = {"ranks": run["ranks"], "grid": run["grid"], "status": run["status"]}
        if run["status"] == "ok":
            halo, group = run["per_step"]["halo"], run["per_step"]["spatial"]
            row.update(img_sec=run["img_sec"], bound_img_sec=run["bound_img_sec"], efficiency=run["efficiency"],
                       paired_efficiency=run["paired_efficiency"], cpu_ratio=run["cpu_ratio"], memory=run["memory"],
                       memory_vs_1_rank=run["memory"] / one if one and run["memory"] is not None else None,
                       peak_resident=run["peak_resident"], halo_calls=halo["calls"], halo_bytes=halo["bytes"],
                       halo_ms=halo["time_us"] / 1e3, group_ms=group["time_us"] / 1e3)
        else:
            row["reason"] = run["reason"]
        out.append(row)
    return out


def format_summary(record: Dict[str, Any]) -> str:
    """The summary as a table, under a heading that says what was measured."""
    def pct(value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.0%}"

    rows = []
    for s in record["summary"]:
        grid = f"{s['grid'][0]}x{s['grid'][1]}"
        if s["status"] != "ok":
            rows.append([s["ranks"], grid, "does not fit"] + ["-"] * 10)
            continue
        rows.append([s["ranks"], grid, f"{s['img_sec']:.3g}", f"{s['bound_img_sec']:.3g}", pct(s["efficiency"]),
                     pct(s["paired_efficiency"]), "-" if s["cpu_ratio"] is None else f"{s['cpu_ratio']:.2f}",
                     _mib(s["memory"]),
                     "-" if s["memory_vs_1_rank"] is None else f"{s['memory_vs_1_rank']:.2f}",
                     _mib(s["peak_resident"]), format_size(s["halo_bytes"]), f"{s['halo_ms']:.1f}",
                     f"{s['group_ms']:.1f}"])
    height, width = record["image"]
    model = record["model"] + (f" x{record['scale']}" if record["scale"] else "")
    on_gpu = record.get("device") == "cuda"
    budget = f"; --max-memory {format_size(record['max_memory'])} per rank" if record["max_memory"] else ""
    settings = " ".join(f"{k}={v}" for k, v in sorted(record["malloc_environment"].items()))
    budget += "; on the GPU" if on_gpu else f"; malloc: {record['allocator']}" + (f" ({settings})" if settings else "")
    head = (f"# spatial: {model}, {height}x{width} input, batch {record['batch_size']}, {record['threads']} thread(s) "
            f"per rank{', checkpointed blocks' if record['checkpoint'] else ''}{budget}; medians of "
            f"{record['rounds']} alternating rounds of {record['steps']} step(s) against the no-communication bound "
            "in the same job (efficiency: bound's step time / real step time; paired: the rounds' own ratios; cpu: "
            "a rank's CPU time per real step / per bound step, apart from waiting); "
            f"memory per rank: the most any rank held above its start during the real steps"
            f"{' (on the GPU: memory allocated, as PyTorch counts it, as is the peak)' if on_gpu else ''}; "
            "halo: bytes sent and "
            "received, and time, per step and rank")
    header = ["ranks", "grid", "img/s", "bound img/s", "efficiency", "paired", "cpu", "MiB/rank", "vs 1 rank",
              "peak GPU MiB" if on_gpu else "peak RSS MiB", "halo/step", "halo ms", "group ms"]
    lines = [head, format_table(header, rows)]
    lines += [f"{s['ranks']} rank(s), {s['grid'][0]}x{s['grid'][1]}: does not fit: {s['reason']}"
              for s in record["summary"] if s["status"] != "ok"]
    return "\n".join(lines)


def plot(record: Dict[str, Any], out: Union[str, BinaryIO], image_format: str = "png") -> None:
    """img/s (real and the bound) and memory per rank against the number of ranks."""
    from matplotlib.figure import Figure  # not pyplot: no global backend to choose (sr/figures.py)

    done = [s for s in record["summary"] if s["status"] == "ok"]
    failed = [s for s in record["summary"] if s["status"] != "ok"]
    fig = Figure(figsize=(10, 4))
    rate_ax, memory_ax = fig.subplots(1, 2)
    ranks = [s["ranks"] for s in done]
    rate_ax.plot(ranks, [s["img_sec"] for s in done], marker="o", label="SpatialParallel")
    rate_ax.plot(ranks, [s["bound_img_sec"] for s in done], marker="s", linestyle="--",
                 label="no-communication bound")
    memory_ax.plot(ranks, [s["memory"] / 2**20 for s in done], marker="o", label="memory per rank (job's peak)")
    one = next((s["memory"] for s in done if s["ranks"] == 1), None)
    every = sorted({s["ranks"] for s in record["summary"]})
    if one:
        memory_ax.plot(every, [one / n / 2**20 for n in every], linestyle=":", color="gray", label="1 rank's / N")
    if record["max_memory"]:
        memory_ax.axhline(record["max_memory"] / 2**20, color="#c44e52", linestyle="--", label="--max-memory")
        if failed:
            memory_ax.plot([s["ranks"] for s in failed], [record["max_memory"] / 2**20] * len(failed), "x",
                           color="#c44e52", markersize=10, label="does not fit")
    for s in done:
        if s["grid"][1] != 1:  # a grid other than row bands: say which
            rate_ax.annotate(f"{s['grid'][0]}x{s['grid'][1]}", (s["ranks"], s["img_sec"]), fontsize=7)
            memory_ax.annotate(f"{s['grid'][0]}x{s['grid'][1]}", (s["ranks"], s["memory"] / 2**20), fontsize=7)
    for ax, label in ((rate_ax, "img/s"), (memory_ax, "MiB per rank")):
        ax.set_xlabel("ranks")
        ax.set_ylabel(label)
        ax.set_xticks(every)
        # From zero, with room above the highest point (the autoscaled top is the point itself
        # once the range is stretched down to zero, and its marker is cut in half).
        highest = max((y for line in ax.get_lines() for y in line.get_ydata()), default=0)
        ax.set_ylim(0, highest * 1.1 if highest > 0 else 1)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    height, width = record["image"]
    fig.suptitle(f"hpdl bench spatial: {record['model']}, {height}x{width}, batch {record['batch_size']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100, format=image_format)
