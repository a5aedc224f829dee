"""One job of `hpdl bench spatial`: training steps of ``SpatialParallel(model)`` on one image
split over the job's ranks, against the no-communication bound, and the memory each rank needs.

The driver (spatial_study.py) starts it under ``hpdl run -np N`` as
``python -m hpdl.bench.spatial OPTIONS_JSON``; rank 0 prints one JSON record on stdout, and
progress lines on stderr (jobs.PROGRESS).

- Real steps: ``SpatialParallel(model, grid, checkpoint)`` trained with
  ``hvd.DistributedOptimizer``, as a user trains it.
- The bound: a copy of the model, made before the real one is wrapped, in
  ``SpatialParallel.no_communication()`` with the plain optimizer: each rank computes its band
  alone (halos left at zero, no group collectives, no gradient exchange). An image is done
  when its slowest band is, so a round's time, real or bound, is its slowest rank's.
- Rounds of ``steps`` steps each alternate the order (real then bound, bound then real, ...),
  each from a barrier, so that a drifting machine hits both alike; the figures are medians over
  the rounds, and the efficiency is the bound's step time over the real one (also as the median
  of the rounds' own ratios, steadier on a drifting machine). The ranks' CPU time per step,
  real over bound, says what the communication adds to the work (copies, polling, the
  gradients' allreduce) apart from waiting, however busy the machine is.
- Memory, per rank: what is resident at the start (imports, hvd.init), and the most resident
  during the real steps (the kernel's high-water mark, reset before each real round); the
  job's memory is the difference: model, optimizer state, activations, the allocator's caches.
- With a budget (``max_memory``), RLIMIT_DATA is set at the start to what the rank holds plus
  the budget (memory.limit_data), so an allocation past it fails. A rank that cannot allocate
  says so on stderr (:data:`DOES_NOT_FIT`) and ends the job at once, since its peers would wait
  for it in their next halo exchange: the driver reports the point as not fitting.
- Halo exchanges and group collectives per step are counted from the engine's event bus
  (events.GROUP_KINDS) over the real steps.
- On a GPU (``device`` cuda: each rank on its local GPU, ``hpdl run --ranks-per-gpu K`` for K
  ranks sharing one), the memory is the device's as PyTorch's allocator counts it (allocated
  at the start, the peak allocated during the real steps), the budget is the allocator's share
  of the device (memory.CudaMemory), and each round's clock stops after the device is done.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from hpdl.bench import memory
from hpdl.bench.jobs import PROGRESS
from hpdl.bench.models import build_workload, sr_models
from hpdl.bench.stats import median
from hpdl.formatting import format_size
from hpdl.bench.synthetic import make_optimizer, usual_optimizer
from hpdl.engine import events as ev

# The line a rank that cannot allocate prints on stderr, then the job ends with this status.
DOES_NOT_FIT = "hpdl-bench-spatial: does not fit: "
EXIT_DOES_NOT_FIT = 3


@dataclasses.dataclass(frozen=True)
class JobOptions:
    """One point of the study: the model, the image, the grid; checked by the driver."""

    model: str
    image: Tuple[int, int]  # height, width (the SR models' LR input)
    grid: Tuple[int, int]  # row bands, column bands
    batch_size: int = 1
    scale: int = 2
    checkpoint: bool = False
    threads: int = 1
    warmup: int = 1
    steps: int = 1  # per round
    rounds: int = 3
    max_memory: Optional[int] = None  # bytes each rank may allocate beyond what it holds at the start
    device: str = "cpu"  # or "cuda": this rank's GPU

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "JobOptions":
        fields = json.loads(text)
        fields["image"], fields["grid"] = tuple(fields["image"]), tuple(fields["grid"])
        return cls(**fields)


class _GroupTraffic:
    """An event observer counting the spatial group's halo exchanges and collectives while on:
    kind -> [calls, bytes, µs]."""

    def __init__(self) -> None:
        self.on = False
        self.totals: Dict[str, List[float]] = {kind: [0, 0, 0.0] for kind in ev.GROUP_KINDS}

    def __call__(self, event: ev.Event) -> None:
        if self.on and event.phase == ev.COLLECTIVE and event.kind in self.totals:
            total = self.totals[event.kind]
            total[0] += 1
            total[1] += event.nbytes
            total[2] += event.duration_us


def _progress(rank: int, text: str) -> None:
    if rank == 0:
        sys.stderr.write(PROGRESS + text + "\n")
        sys.stderr.flush()


def _training_step(net, optimizer, x: torch.Tensor, target: torch.Tensor, loss_fn) -> Callable[[], None]:
    def step() -> None:
        optimizer.zero_grad()
        loss_fn(net(x), target).backward()
        optimizer.step()

    return step


def _bound_step(net, step: Callable[[], None]) -> Callable[[], None]:
    def alone() -> None:
        with net.no_communication():
            step()

    return alone


def _round(hvd, step: Callable[[], None], steps: int, peaks: List[int], meter, sync: Callable[[], None]
           ) -> Tuple[float, float]:
    """``steps`` steps from a barrier; return the slowest rank's seconds per step, and the CPU
    seconds per step the ranks' processes used (all their threads; the mean over ranks). The
    rank's peak memory over them (``meter``'s: resident, or the GPU's) is added to ``peaks``."""
    hvd.barrier()
    meter.reset_peak()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    sync()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    peak = meter.peak_resident()
    if peak is not None:
        peaks.append(peak)
    ranks = hvd.allgather_object((elapsed, cpu), name="bench.spatial.round")
    return max(wall for wall, _ in ranks) / steps, statistics.fmean(c for _, c in ranks) / steps


def measure(opts: JobOptions) -> Optional[Dict[str, Any]]:
    """Run the job on this rank (hvd initialized); return the record on rank 0, None elsewhere."""
    import hpdl.torch as hvd
    from hpdl.torch import spatial

    rank, size = hvd.rank(), hvd.size()
    device, meter, sync = _device(opts, hvd)
    start_resident = meter.resident()
    limit = meter.limit(opts.max_memory) if opts.max_memory is not None else None
    image = tuple(opts.image)
    workload = build_workload(opts.model, opts.batch_size, opts.scale, image=image)
    if device.type != "cpu":  # before the copy for the bound and the split: both follow the model
        workload.model.to(device)
        workload.inputs, workload.targets = workload.inputs.to(device), workload.targets.to(device)
    classifier = opts.model not in sr_models()
    bound_model = copy.deepcopy(workload.model)  # before the real one's blocks are wrapped (checkpoint)
    net = spatial.SpatialParallel(workload.model, grid=opts.grid, checkpoint=opts.checkpoint)
    bound = spatial.SpatialParallel(bound_model, grid=opts.grid, checkpoint=opts.checkpoint)
    kind = usual_optimizer(opts.model)
    optimizer = hvd.DistributedOptimizer(make_optimizer(kind, net.parameters(), size),
                                         named_parameters=net.named_parameters())
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    bound_optimizer = make_optimizer(kind, bound.parameters(), size)
    # Each rank keeps its part of the batch alone, as a loader of parts would deliver it.
    x = net.scatter(workload.inputs)
    target = workload.targets if classifier else net.scatter(workload.targets)
    workload.inputs = workload.targets = None
    steps = {"real": _training_step(net, optimizer, x, target, workload.loss),
             "bound": _bound_step(bound, _training_step(bound, bound_optimizer, x, target, workload.loss))}

    traffic = _GroupTraffic()
    ev.subscribe(traffic)
    try:
        warm = time.perf_counter()
        for _ in range(opts.warmup):
            steps["real"]()
            steps["bound"]()
        _progress(rank, f"warm-up: {opts.warmup} real and bound step(s) in {time.perf_counter() - warm:.1f} s")
        times: Dict[str, List[float]] = {"real": [], "bound": []}
        cpu: Dict[str, List[float]] = {"real": [], "bound": []}
        peaks: Dict[str, List[int]] = {"real": [], "bound": []}
        for r in range(opts.rounds):
            for mode in (("real", "bound") if r % 2 == 0 else ("bound", "real")):
                traffic.on = mode == "real"
                wall, cpu_s = _round(hvd, steps[mode], opts.steps, peaks[mode], meter, sync)
                times[mode].append(wall)
                cpu[mode].append(cpu_s)
                traffic.on = False
            _progress(rank, f"round {r + 1}/{opts.rounds}: {times['real'][-1]:.2f} s per step, bound "
                            f"{times['bound'][-1]:.2f} s")
    finally:
        ev.unsubscribe(traffic)
    counted = opts.rounds * opts.steps
    mine = {"start_resident": start_resident, "peak_resident": max(peaks["real"], default=None),
            "bound_peak_resident": max(peaks["bound"], default=None), "data_limit": limit,
            "traffic": {k: {"calls": c / counted, "bytes": b / counted, "time_us": t / counted}
                        for k, (c, b, t) in traffic.totals.items()}}
    ranks = hvd.allgather_object(mine, name="bench.spatial.ranks")
    if rank != 0:
        return None
    return _record(opts, size, times, cpu, ranks)


def _device(opts: JobOptions, hvd) -> Tuple[torch.device, Any, Callable[[], None]]:
    """This rank's device, what measures its memory there, and the wait for it to finish."""
    if opts.device == "cpu":
        return torch.device("cpu"), memory.HostMemory, lambda: None
    device = torch.device("cuda", hvd.local_gpu())
    torch.cuda.set_device(device)
    return device, memory.CudaMemory(device), lambda: torch.cuda.synchronize(device)


def _record(opts: JobOptions, size: int, times: Dict[str, List[float]], cpu: Dict[str, List[float]],
            ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    real, bound = median(times["real"]), median(times["bound"])
    memories = [r["peak_resident"] - r["start_resident"] for r in ranks
                if r["peak_resident"] is not None and r["start_resident"] is not None]
    traffic = {kind: {figure: statistics.fmean(r["traffic"][kind][figure] for r in ranks)
                      for figure in ("calls", "bytes", "time_us")} for kind in ev.GROUP_KINDS}
    return {
        "ranks": size, "grid": list(opts.grid), "status": "ok", "options": dataclasses.asdict(opts),
        "step_s": times, "median_step_s": {"real": real, "bound": bound},
        "img_sec": opts.batch_size / real, "bound_img_sec": opts.batch_size / bound,
        "efficiency": bound / real,
        "paired_efficiency": median([b / r for r, b in zip(times["real"], times["bound"])]),
        # CPU seconds per step of a rank's process, however busy the machine: what the
        # communication adds to the work (copies, polling, the engine), apart from waiting.
        "cpu_s": cpu, "cpu_ratio": median(cpu["real"]) / median(cpu["bound"]) if median(cpu["bound"]) else None,
        # Per rank, and the most any rank needed: the image fits when its hungriest band does.
        "memory_per_rank": memories, "memory": max(memories) if memories else None,
        "peak_resident": max((r["peak_resident"] for r in ranks if r["peak_resident"] is not None), default=None),
        "per_rank": ranks,
        "per_step": traffic,  # means over ranks: halo exchanges and group collectives per real step
    }


def _not_fitting(rank: int, err: BaseException, opts: JobOptions) -> str:
    """The line a rank that could not allocate prints: how much it tried, within which budget."""
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    tried = re.search(r"allocate (\d+) bytes", text)
    on_gpu = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)  # CUDA's out-of-memory error
    what = (f"could not allocate {format_size(int(tried.group(1)))}" if tried else
            f"could not allocate {on_gpu.group(1)} on its GPU" if on_gpu else f"could not allocate ({text})")
    budget = f" beyond the {format_size(opts.max_memory)} of --max-memory" if opts.max_memory is not None else ""
    return f"{DOES_NOT_FIT}rank {rank} {what}{budget}"


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    opts = JobOptions.from_json(argv[0])
    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    import hpdl.torch as hvd

    hvd.init()
    try:
        record = measure(opts)
    except (MemoryError, RuntimeError) as err:
        if not memory.out_of_memory(err, under_budget=opts.max_memory is not None):
            raise
        sys.stderr.write(_not_fitting(hvd.rank(), err, opts) + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
        # The other ranks wait for this one in their next exchange: end the job, not them alone.
        os._exit(EXIT_DOES_NOT_FIT)
    if record is not None:
        print(json.dumps(record))
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
