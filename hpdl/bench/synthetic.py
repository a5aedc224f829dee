"""Synthetic training throughput, after Horovod's ``pytorch_synthetic_benchmark.py``.

Every rank trains the same model on one fixed random batch (no data loading), with
``hvd.DistributedOptimizer`` after ``broadcast_parameters`` / ``broadcast_optimizer_state``;
after warm-up batches it times ``num_iters`` iterations of ``num_batches_per_iter`` batches
and reports images per second per rank (mean and 1.96 sigma over iterations, as Horovod).

With ``compare`` it alternates runs of hpdl with runs of one or more baselines in the same job
layout, ``repeats`` times each, the order rotated from one repeat to the next (hpdl, ddp, plain;
ddp, plain, hpdl; plain, hpdl, ddp; ...: no mode always runs first, on a machine still warming
up, or always after the same one), and reports the medians and the ratios hpdl/baseline:
- ``plain``: a plain PyTorch loop, no hpdl and no DDP (what a user starts from: hpdl/plain is
  what hpdl costs at one rank); at several ranks every rank runs it alone, as the ceiling;
- ``ddp``: the same training with ``torch.nn.parallel.DistributedDataParallel``, over nccl
  where each rank has a GPU of its own, else over gloo (:func:`ddp_backend`);
- ``ceiling``: every rank trains its own model with no communication at all, at the same time
  as the others (N independent single-process runs): the most the machine can do;
- ``lockstep``: as the ceiling, but after each backward every rank waits for all the others
  (a barrier, no data exchanged), as synchronous data-parallel training must: the most any
  synchronous method can reach, so hpdl/lockstep isolates the cost of the communication itself
  from the cost of keeping the ranks in step (uneven ranks, and ranks that run the same layers
  at the same moment competing for shared caches and memory bandwidth);
- ``profiled``: hpdl with the communication profiler recording (``hvd.start_profile``), so
  hpdl/profiled is the profiler's cost (its file is written after the timed batches, and
  discarded).
With ``breakdown`` it also reports, per mode and rank, where a timed batch's time went: forward
(with ``zero_grad`` and the loss), backward, the wait after backward (hpdl: ``synchronize()``,
the gradients' allreduces still running; lockstep: the barrier; DDP waits inside backward,
the ceiling has nothing to wait for), and the optimizer update; and the CPU time of the rank's
threads per timed batch (cputime.py): where the cores a node's compute needs went.
Between runs nothing of the other mode keeps running: hpdl is initialised and shut down
around each of its runs, so its engine thread never competes with a baseline.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from hpdl.bench.cputime import GROUPS, CpuSnapshot
from hpdl.bench.models import benchmark_models, build_workload, gradient_bytes, sr_models
from hpdl.bench.stats import median, spread
from hpdl.formatting import format_table
from hpdl.sr.config import AMP_MODES, DEVICE_NAMES, is_device_name
from hpdl.sr.models import count_parameters
from hpdl.sr.registry import known_scales, scales_of
from hpdl.torch.mixed_precision import FP16_OVERLAP_REASON, MixedPrecision

__all__ = ["COMPARE", "SyntheticOptions", "device_of", "run_synthetic"]

COMPARE = ("plain", "ddp", "ceiling", "lockstep", "profiled")
# The most --threads per rank: torch's OpenMP pool of 100,000,000 threads ends the process
# with a segmentation fault, not an error.
MAX_THREADS = 1024
PHASES = ("forward", "backward", "wait", "update")

# Per timed batch, the seconds of each phase of PHASES (wait None where the mode has none).
PhaseTimes = Tuple[float, float, Optional[float], float]


@dataclasses.dataclass
class BatchTrace:
    """What ``breakdown`` records of one rank's timed batches: each batch's phase times, and
    the CPU time of the rank's threads over them (summed, with the batches it covers)."""

    phases: List[PhaseTimes] = dataclasses.field(default_factory=list)
    cpu_ms: Dict[str, float] = dataclasses.field(default_factory=dict)
    cpu_batches: int = 0
    node_idle: List[float] = dataclasses.field(default_factory=list)

    def add_cpu(self, delta: Dict[str, float], batches: int) -> None:
        """Add what ``CpuSnapshot.since`` measured over ``batches`` timed batches."""
        idle = [delta["node_idle"]] if "node_idle" in delta else []
        self._add_cpu({group: delta[group] for group in GROUPS}, batches, idle)

    def merge(self, other: "BatchTrace") -> None:
        """Add another run's batches (of the same mode and rank)."""
        self.phases.extend(other.phases)
        self._add_cpu(other.cpu_ms, other.cpu_batches, other.node_idle)

    def _add_cpu(self, cpu_ms: Dict[str, float], batches: int, node_idle: List[float]) -> None:
        for group, ms in cpu_ms.items():
            self.cpu_ms[group] = self.cpu_ms.get(group, 0.0) + ms
        self.cpu_batches += batches
        self.node_idle.extend(node_idle)


@dataclasses.dataclass(frozen=True)
class SyntheticOptions:
    """What to train and how long; defaults follow Horovod's synthetic benchmark."""

    model: str = "resnet50"
    batch_size: int = 32
    scale: int = 2
    patch: int = 48
    num_iters: int = 10
    num_batches_per_iter: int = 10
    num_warmup: int = 10
    fp16_allreduce: bool = False
    overlap_forward: bool = False  # hpdl: DistributedOptimizer(overlap_forward=model)
    optimizer: Optional[str] = None  # "sgd" or "adam"; None: the model's usual one
    threads: int = 1
    compare: Tuple[str, ...] = ()  # baselines among COMPARE
    repeats: int = 5
    breakdown: bool = False  # time the phases of every timed batch
    device: str = "auto"  # auto (this rank's GPU if CUDA is available, else cpu), cpu, cuda or cuda:N
    amp: str = "none"  # mixed precision: none, bf16 or fp16 (hpdl/torch/mixed_precision.py)
    compile: bool = False  # the forward through torch.compile (DDP: the DDP module compiled, as PyTorch advises)

    def __post_init__(self) -> None:
        if self.model not in benchmark_models():
            raise ValueError(f"unknown model {self.model!r}; choose from {', '.join(benchmark_models())}")
        for name in ("batch_size", "patch", "num_iters", "num_batches_per_iter", "threads", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.num_warmup < 0:
            raise ValueError(f"num-warmup must be >= 0, got {self.num_warmup}")
        if self.threads > MAX_THREADS:
            raise ValueError(f"threads must be at most {MAX_THREADS}, got {self.threads}")
        # ResNet-50 ignores the scale; a value no model takes is still a mistake on the command line.
        scales = scales_of(self.model) if self.model in sr_models() else known_scales()
        if self.scale not in scales:
            of = f" of {self.model}" if self.model in sr_models() else ""
            raise ValueError(f"scale{of} must be one of {', '.join(map(str, scales))}, got {self.scale}")
        if self.optimizer not in (None, "sgd", "adam"):
            raise ValueError(f"optimizer must be sgd or adam, got {self.optimizer!r}")
        if not is_device_name(self.device):
            raise ValueError(f"device must be {DEVICE_NAMES}, got {self.device!r}")
        if self.amp not in AMP_MODES:
            raise ValueError(f"amp must be {', '.join(AMP_MODES)}, got {self.amp!r}")
        if self.amp == "fp16" and self.overlap_forward:
            raise ValueError(f"overlap-forward does not go with amp fp16: {FP16_OVERLAP_REASON}")
        unknown = [c for c in self.compare if c not in COMPARE]
        if unknown or len(set(self.compare)) != len(self.compare):
            raise ValueError(f"compare takes distinct baselines among {', '.join(COMPARE)}, got {','.join(self.compare)}")


def usual_optimizer(model: str) -> str:
    """The optimizer a benchmark model trains with: adam for the SR models (their recipes), sgd
    for ResNet-50 (Horovod's benchmark)."""
    return "adam" if model in sr_models() else "sgd"


def _optimizer_kind(opts: SyntheticOptions) -> str:
    """The optimizer asked for, else the model's usual one."""
    return opts.optimizer or usual_optimizer(opts.model)


def make_optimizer(kind: str, params, size: int) -> torch.optim.Optimizer:
    """The benchmarks' optimizer ``kind`` ("sgd", "adam") of ``params``, for ``size`` ranks."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.01 * size)  # Horovod's benchmark: lr scaled by size
    return torch.optim.Adam(params, lr=1e-4)  # the EDSR recipe


def _rate(value: float) -> str:
    """Format img/s with three significant digits (EDSR runs below 1 img/s on a CPU core)."""
    digits = 1 if value <= 0 else max(1, 2 - math.floor(math.log10(value)))
    return f"{value:.{digits}f}"


def _timed(opts: SyntheticOptions, step: Callable[[], None], log: Callable[[str], None],
           trace: Optional[BatchTrace] = None, sync: Callable[[], None] = lambda: None) -> List[float]:
    """Run warm-up then the timed iterations; return img/s per iteration on this rank.

    ``trace`` (whose ``phases`` the step appends to) keeps the timed batches only, and their
    CPU time by thread. ``sync`` waits for the device (a GPU runs the batches after the host
    has queued them): each iteration is timed from an idle device to an idle device.
    """
    log("Running warmup...")
    for _ in range(opts.num_warmup):
        step()
    if trace is not None:
        trace.phases.clear()
    cpu_start = CpuSnapshot.take() if trace is not None else None
    log("Running benchmark...")
    rates = []
    for i in range(opts.num_iters):
        sync()
        start = time.perf_counter()
        for _ in range(opts.num_batches_per_iter):
            step()
        sync()
        rate = opts.batch_size * opts.num_batches_per_iter / (time.perf_counter() - start)
        log(f"Iter #{i}: {_rate(rate)} img/sec per rank")
        rates.append(rate)
    cpu_end = CpuSnapshot.take() if cpu_start is not None else None
    if cpu_end is not None:
        trace.add_cpu(cpu_end.since(cpu_start), opts.num_iters * opts.num_batches_per_iter)
    return rates


def _train_loop(model, optimizer, workload, phases: Optional[List[PhaseTimes]] = None,
                synchronize: bool = False, barrier: Optional[Callable[[], None]] = None,
                precision: Optional[MixedPrecision] = None, sync: Callable[[], None] = lambda: None
                ) -> Callable[[], None]:
    """One training batch; with ``phases``, timed phase by phase.

    Args:
        synchronize: the optimizer is hpdl's: time its wait for the gradients apart, with
            ``synchronize()`` then the update under ``skip_synchronize()`` (what ``step()`` does).
        barrier: wait for every rank between backward and the update (the lockstep baseline).
        precision: mixed precision (autocast, and loss scaling for float16); default none.
        sync: wait for the device, at each phase's end when timing phases on a GPU.
    """
    precision = precision or MixedPrecision("none", torch.device("cpu"))

    def forward() -> torch.Tensor:
        optimizer.zero_grad()
        with precision.autocast():
            out = model(workload.inputs)
        return workload.loss(out.float(), workload.targets)

    if phases is None:
        def step() -> None:
            precision.backward(forward())
            if barrier is not None:
                barrier()
            precision.step(optimizer)

        return step

    clock = time.perf_counter

    def timed_step() -> None:
        start = clock()
        loss = forward()
        sync()
        forward_end = clock()
        precision.backward(loss)
        sync()
        backward_end = update_start = clock()
        wait = None
        wait_for_ranks = optimizer.synchronize if synchronize else barrier
        if wait_for_ranks is not None:
            wait_for_ranks()
            sync()
            update_start = clock()
            wait = update_start - backward_end
        precision.step(optimizer, synchronized=synchronize)
        sync()
        phases.append((forward_end - start, backward_end - forward_end, wait, clock() - update_start))

    return timed_step


def device_of(opts: SyntheticOptions) -> torch.device:
    """This rank's device: ``--device``, where auto and cuda name the local rank's GPU
    (hpdl/comm/devices.py, with HPDL_RANKS_PER_GPU ranks per GPU)."""
    from hpdl.comm import discover_topology
    from hpdl.comm.devices import check_gpu_index
    from hpdl.config import Settings
    from hpdl.sr.config import resolve_device

    local_rank, per_gpu = discover_topology().local_rank, Settings.from_env().ranks_per_gpu
    device = resolve_device(opts.device, "--device",
                            lambda: check_gpu_index(local_rank, per_gpu, torch.cuda.device_count()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # as Horovod's benchmark: the fastest kernels for the fixed shapes
    return device


def _sync(device: torch.device) -> Callable[[], None]:
    """A wait for ``device`` to finish what it was given (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _workload(opts: SyntheticOptions, device: torch.device):
    """The model and its random batch, on ``device``."""
    workload = build_workload(opts.model, opts.batch_size, opts.scale, opts.patch)
    workload.model.to(device)
    workload.inputs, workload.targets = workload.inputs.to(device), workload.targets.to(device)
    return workload


def _compiled(model: torch.nn.Module, opts: SyntheticOptions):
    """What runs the forward: ``model``, or with ``opts.compile`` its torch.compile'd self (the
    optimizers and hooks stay on ``model``'s own parameters and modules)."""
    return torch.compile(model) if opts.compile else model


def _run_hpdl(opts: SyntheticOptions, log: Callable[[str], None],
              trace: Optional[BatchTrace] = None) -> List[float]:
    import hpdl.torch as hvd

    device = device_of(opts)
    workload = _workload(opts, device)
    model = workload.model
    optimizer = make_optimizer(_optimizer_kind(opts), model.parameters(), hvd.size())
    compression = hvd.Compression.fp16 if opts.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         overlap_forward=model if opts.overlap_forward else None)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    # With overlap_forward the wait for the gradients falls in the next forward (the updates
    # wait there): synchronizing apart would undo the overlap.
    loop = _train_loop(_compiled(model, opts), optimizer, workload, trace.phases if trace else None,
                       synchronize=not opts.overlap_forward, precision=MixedPrecision(opts.amp, device),
                       sync=_sync(device))
    return _timed(opts, loop, log, trace, _sync(device))


def _run_ddp(opts: SyntheticOptions, log: Callable[[str], None],
             trace: Optional[BatchTrace] = None, group=None) -> List[float]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    device = device_of(opts)
    workload = _workload(opts, device)
    # As hpdl: no per-forward buffer broadcast (BatchNorm statistics stay local, as in Horovod).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # newer torch renames broadcast_buffers
        model = DistributedDataParallel(workload.model, device_ids=[device] if device.type == "cuda" else None,
                                        broadcast_buffers=False, process_group=group)
    if opts.fp16_allreduce:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    optimizer = make_optimizer(_optimizer_kind(opts), model.parameters(), dist.get_world_size())
    loop = _train_loop(_compiled(model, opts), optimizer, workload, trace.phases if trace else None,
                       precision=MixedPrecision(opts.amp, device), sync=_sync(device))
    return _timed(opts, loop, log, trace, _sync(device))


def _run_ceiling(opts: SyntheticOptions, log: Callable[[str], None],
                 trace: Optional[BatchTrace] = None,
                 barrier: Optional[Callable[[], None]] = None) -> List[float]:
    device = device_of(opts)
    workload = _workload(opts, device)
    optimizer = make_optimizer(_optimizer_kind(opts), workload.model.parameters(), 1)
    loop = _train_loop(_compiled(workload.model, opts), optimizer, workload, trace.phases if trace else None,
                       barrier=barrier,
                       precision=MixedPrecision(opts.amp, device), sync=_sync(device))
    return _timed(opts, loop, log, trace, _sync(device))


def _run_profiled(opts: SyntheticOptions, log: Callable[[str], None],
                  trace: Optional[BatchTrace] = None, control=None) -> List[float]:
    """hpdl with the profiler recording; the profile goes to a temporary file, then away."""
    import tempfile

    import hpdl.torch as hvd

    with tempfile.TemporaryDirectory(prefix="hpdl-profiled-") as tmp:
        hvd.init()
        hvd.start_profile(f"{tmp}/profile.json")
        rates = _run_hpdl(opts, log, trace)
        control.barrier()  # every rank done before the profile is gathered and the engines stop
        hvd.stop_profile()
        hvd.shutdown()
    return rates


def _polite_barrier(control) -> Callable[[], None]:
    """A barrier over ``control`` that sleeps while it waits (MPI's Barrier would spin on a
    core that a rank still computing may need)."""
    from hpdl.comm import ReduceOp

    token = torch.zeros(1, dtype=torch.int64)
    return lambda: control.allreduce_control(token, ReduceOp.SUM)


def _breakdown(per_rank: List[List[PhaseTimes]]) -> List[Dict[str, Optional[Dict[str, float]]]]:
    """Per rank and phase (and the whole step), the median and mean over batches, in ms."""
    out = []
    for batches in per_rank:
        entry: Dict[str, Optional[Dict[str, float]]] = {}
        columns = list(zip(*batches)) if batches else [() for _ in PHASES]
        for name, values in zip(PHASES, columns):
            if not values or values[0] is None:
                entry[name] = None
                continue
            entry[name] = {"median_ms": 1e3 * median(list(values)), "mean_ms": 1e3 * statistics.fmean(values)}
        steps = [sum(v for v in batch if v is not None) for batch in batches]
        entry["step"] = ({"median_ms": 1e3 * median(steps), "mean_ms": 1e3 * statistics.fmean(steps)}
                         if steps else None)
        out.append(entry)
    return out


def _breakdown_lines(breakdowns: Dict[str, List[Dict[str, Optional[Dict[str, float]]]]]) -> List[str]:
    def cell(value: Optional[Dict[str, float]]) -> str:
        return "-" if value is None else f"{value['median_ms']:.1f} ({value['mean_ms']:.1f})"

    rows = [[mode, str(rank), *(cell(entry[name]) for name in (*PHASES, "step"))]
            for mode, ranks in breakdowns.items() for rank, entry in enumerate(ranks)]
    return [
        "Step breakdown, ms per batch: median (mean) over the timed batches. wait: after backward,",
        "for the gradients' allreduces (hpdl) or the other ranks (lockstep); DDP waits inside backward.",
        format_table(["mode", "rank", *PHASES, "step"], rows),
    ]


def _cpu_per_batch(traces: Dict[str, List[BatchTrace]]) -> Dict[str, List[Optional[Dict[str, float]]]]:
    """Per mode and rank, the CPU ms per timed batch of each thread group, and the node's idle
    share over the timed batches (None where /proc was not there to read)."""
    out: Dict[str, List[Optional[Dict[str, float]]]] = {}
    for mode, ranks in traces.items():
        out[mode] = []
        for trace in ranks:
            if not trace.cpu_batches:
                out[mode].append(None)
                continue
            entry = {group: trace.cpu_ms[group] / trace.cpu_batches for group in GROUPS}
            if trace.node_idle:
                entry["node_idle"] = statistics.fmean(trace.node_idle)
            out[mode].append(entry)
    return out


def _cpu_lines(cpu: Dict[str, List[Optional[Dict[str, float]]]]) -> List[str]:
    rows = [[mode, str(rank), *(f"{entry[g]:.1f}" for g in GROUPS),
             f"{sum(entry[g] for g in GROUPS):.1f}",
             f"{100 * entry['node_idle']:.0f} %" if "node_idle" in entry else "-"]
            for mode, ranks in cpu.items() for rank, entry in enumerate(ranks) if entry is not None]
    if not rows:
        return []
    return [
        "CPU time per batch, ms, by thread: the training thread; hpdl's own (the engine, and the MPI",
        "calls it makes); the backend's (gloo's I/O and workers); node idle: the node's idle share.",
        format_table(["mode", "rank", *GROUPS, "all", "node idle"], rows),
    ]


def _header(opts: SyntheticOptions, size: int, backend: str) -> List[str]:
    workload = build_workload(opts.model, 1, opts.scale, opts.patch)
    params, nbytes = count_parameters(workload.model), gradient_bytes(workload.model)
    optimizer = _optimizer_kind(opts)
    return [
        f"Model: {opts.model}" + (f" x{opts.scale}, LR patch {opts.patch}x{opts.patch}" if opts.model in sr_models() else "")
        + f" ({params:,} parameters, {nbytes / 2**20:.1f} MiB of gradients)",
        f"Batch size: {opts.batch_size} per rank; optimizer {optimizer}; "
        f"{'fp16' if opts.fp16_allreduce else 'no'} compression"
        + ("; hpdl overlaps the next forward" if opts.overlap_forward else ""),
        f"Number of ranks: {size} ({backend}), {opts.threads} thread(s) per rank",
        f"Device: {_describe_device(device_of(opts))}; {'no mixed precision' if opts.amp == 'none' else 'amp ' + opts.amp}"
        + ("; torch.compile" if opts.compile else ""),
    ]


def _describe_device(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    return f"{device} ({torch.cuda.get_device_name(device)})"


def _summary(rates: List[float]) -> Dict[str, float]:
    # Horovod's figures: mean over iterations, +- 1.96 standard deviations.
    mean = statistics.fmean(rates)
    return {"mean": mean, "conf": 1.96 * statistics.pstdev(rates) if len(rates) > 1 else 0.0}


def _base_record(opts: SyntheticOptions, size: int, backend: str) -> Dict[str, Any]:
    record = {"benchmark": "synthetic", "ranks": size, "backend": backend, "unit": "img/sec per rank"}
    record.update(dataclasses.asdict(opts))
    record["optimizer"] = _optimizer_kind(opts)
    device = device_of(opts)
    record["device"] = str(device)  # where it ran, "auto" resolved
    if device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(device)
    return record


def _single(opts: SyntheticOptions, json_output: bool) -> Optional[Dict[str, Any]]:
    """hpdl alone, printing as Horovod's benchmark does."""
    import hpdl.torch as hvd
    from hpdl.torch.runtime import job_backend

    backend = job_backend()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    log = print if rank == 0 and not json_output else (lambda _line: None)
    for line in _header(opts, size, backend):
        log(line)
    trace = BatchTrace() if opts.breakdown else None
    rates = _run_hpdl(opts, log, trace)
    summary = _summary(rates)
    log(f"Img/sec per rank: {_rate(summary['mean'])} +-{_rate(summary['conf'])}")
    log(f"Total img/sec on {size} ranks: {_rate(size * summary['mean'])} +-{_rate(size * summary['conf'])}")
    record = _base_record(opts, size, backend)
    record.update(iterations=rates, img_sec_per_rank=summary["mean"], img_sec_per_rank_conf=summary["conf"],
                  total_img_sec=size * summary["mean"], total_img_sec_conf=size * summary["conf"])
    if trace is not None:
        traces = {"hpdl": hvd.allgather_object(trace)}
        breakdown = {"hpdl": _breakdown([t.phases for t in traces["hpdl"]])}
        cpu = _cpu_per_batch(traces)
        for line in _breakdown_lines(breakdown) + _cpu_lines(cpu):
            log(line)
        record["phases_ms"] = breakdown
        record["cpu_ms_per_batch"] = cpu
    hvd.shutdown()
    return record if rank == 0 else None


def ddp_backend(device: torch.device, size: int) -> str:
    """DDP's backend here: nccl where each rank has a GPU of its own (as DDP runs on GPUs), else
    gloo (on the CPU, and where ranks share a GPU: nccl refuses two ranks on one device)."""
    from hpdl.comm.devices import ranks_share_gpus
    from hpdl.comm import discover_topology
    from hpdl.config import Settings

    if device.type != "cuda" or not torch.distributed.is_nccl_available():
        return "gloo"
    local_size = discover_topology().local_size
    shared = ranks_share_gpus(Settings.from_env().ranks_per_gpu, local_size, torch.cuda.device_count())
    return "gloo" if shared else "nccl"


def run_order(modes: List[str], repeat: int) -> List[str]:
    """The order of the modes' runs in repeat ``repeat`` (from 0): ``modes`` rotated by it, so
    that over len(modes) repeats each mode runs first once and after each other mode alike."""
    shift = repeat % len(modes)
    return modes[shift:] + modes[:shift]


def _compare(opts: SyntheticOptions, json_output: bool) -> Optional[Dict[str, Any]]:
    """Alternate hpdl and the baselines; report medians over ``repeats`` runs and the ratios."""
    import hpdl.torch as hvd
    from hpdl.torch.runtime import job_backend, job_communicator

    # For barriers and results, apart from hpdl's engine; DDP gets a group of its own.
    control = job_communicator()
    ddp_over = ddp_backend(device_of(opts), control.size)
    ddp_comm = job_communicator(ddp_over) if "ddp" in opts.compare else None
    rank, size = control.rank, control.size
    log = print if rank == 0 and not json_output else (lambda _line: None)
    backend = job_backend()
    for line in _header(opts, size, backend):
        log(line)
    log(f"Comparing hpdl with {' and '.join(opts.compare)}{f' (DDP over {ddp_over})' if ddp_comm else ''}: "
        f"{opts.repeats} alternating runs each of "
        f"{opts.num_warmup} warm-up batches + {opts.num_iters} x {opts.num_batches_per_iter} timed batches")
    barrier = _polite_barrier(control)
    baselines = {"ddp": functools.partial(_run_ddp, group=ddp_comm.process_group if ddp_comm else None),
                 "plain": _run_ceiling,  # the same loop: no communication, each rank alone
                 "ceiling": _run_ceiling,
                 "lockstep": functools.partial(_run_ceiling, barrier=barrier),
                 "profiled": functools.partial(_run_profiled, control=control)}
    runs: Dict[str, List[float]] = {"hpdl": [], **{name: [] for name in opts.compare}}
    # Per mode and rank, the phase times and CPU time of every timed batch of every run.
    trace_log: Dict[str, List[BatchTrace]] = {mode: [BatchTrace() for _ in range(size)] for mode in runs}
    quiet = lambda _line: None  # noqa: E731 - iteration lines only in single runs
    for repeat in range(opts.repeats):
        for mode in run_order(list(runs), repeat):
            control.barrier()
            trace = BatchTrace() if opts.breakdown else None
            if mode == "hpdl":
                hvd.init()
                rates = _run_hpdl(opts, quiet, trace)
                control.barrier()  # every rank done before any engine stops
                hvd.shutdown()
            else:
                rates = baselines[mode](opts, quiet, trace)
            if trace is not None:
                for rank_trace, run_trace in zip(trace_log[mode], control.allgather_object(trace)):
                    rank_trace.merge(run_trace)
            # The mean over ranks of each rank's mean: equal for modes whose ranks run in step,
            # fairer for the ceiling whose ranks run independently.
            value = statistics.fmean(control.allgather_object(statistics.fmean(rates)))
            runs[mode].append(value)
            log(f"Run {repeat + 1}/{opts.repeats} {mode}: {_rate(value)} img/sec per rank")
    control.barrier()
    control.close()
    if ddp_comm is not None:
        ddp_comm.close()

    medians = {mode: median(values) for mode, values in runs.items()}
    spreads = {mode: spread(values) for mode, values in runs.items()}
    ratios = {name: medians["hpdl"] / medians[name] for name in opts.compare}
    # The same ratio taken within each repeat (runs minutes apart see different machine speeds,
    # runs side by side nearly the same), then the median: steadier on a drifting machine.
    paired = {name: median([h / b for h, b in zip(runs["hpdl"], runs[name])]) for name in opts.compare}
    rows = [[mode, _rate(medians[mode]), f"+-{_rate(spreads[mode])}", _rate(size * medians[mode]),
             " ".join(_rate(v) for v in runs[mode])] for mode in runs]
    log(format_table(["mode", "median img/sec per rank", "spread", f"total on {size} ranks", "runs"], rows))
    for name, ratio in ratios.items():
        log(f"Ratio hpdl/{name}: {ratio:.3f} (median of the {opts.repeats} runs' ratios: {paired[name]:.3f})")
    record = _base_record(opts, size, backend)
    record.update(runs=runs, median=medians, spread=spreads, ratio=ratios, paired_ratio=paired)
    if ddp_comm is not None:
        record["ddp_backend"] = ddp_over
    if opts.breakdown:
        breakdowns = {mode: _breakdown([t.phases for t in per_rank]) for mode, per_rank in trace_log.items()}
        cpu = _cpu_per_batch(trace_log)
        for line in _breakdown_lines(breakdowns) + _cpu_lines(cpu):
            log(line)
        record["phases_ms"] = breakdowns
        record["cpu_ms_per_batch"] = cpu
    return record if rank == 0 else None


def run_synthetic(opts: SyntheticOptions, json_output: bool = False) -> Optional[Dict[str, Any]]:
    """Run the benchmark in the current job; print on rank 0 and return its record there (None elsewhere)."""
    torch.set_num_threads(opts.threads)
    if not opts.compare:
        return _single(opts, json_output)
    return _compare(opts, json_output)
