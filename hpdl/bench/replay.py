"""`hpdl bench replay PROFILE.json`: a profile's communication, run for real with its compute slept.

Every rank replays the profile's steps (the ones `hpdl profile predict` reads, in turn): at each
gradient's recorded moment in backward it submits a tensor of that gradient's bytes to the real
engine (``allreduce_async_``, so negotiation, fusion and the backend are the job's own), sleeps
through the rest of backward, waits for every handle as the optimizer would, then sleeps the
update. Compute costs no CPU, so 4-8 ranks fit on a 2-core machine, on one node or across
`hpdl emulate` nodes, and what a step takes beyond its sleeps is the communication the job
could not hide: what `hpdl profile predict` predicts, measured.

Every rank times its own steps; a step's time is the mean over the ranks (they run back to back
and meet at every allreduce, so each rank's steps add up to the job's time, but a rank woken
late by the scheduler shows one step long and the next short: the slowest rank's per step
would count that jitter as time). The record holds the median over the timed steps, and the
median exposed wait likewise.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from hpdl.profile.predict.schedule import StepShape

__all__ = ["ReplayOptions", "run_replay", "format_record"]

# The engine settings a replay compares with the profile's: those the prediction replays.
COMPARED_SETTINGS = ("fusion_threshold", "inplace_threshold", "cycle_time_ms", "hierarchical_allreduce")


@dataclasses.dataclass(frozen=True)
class ReplayOptions:
    """What to replay: ``steps`` timed steps after ``warmup`` ones, the profile's steps in turn."""

    steps: int = 10
    warmup: int = 2
    fp16: bool = False  # the gradients as float16: half the bytes, as fp16 gradients would be
    compute_scale: float = 1.0  # every sleep (and gradient moment) times this
    batch_size: Optional[int] = None  # images per rank per step, for img/s

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be at least 0, got {self.warmup}")
        if not self.compute_scale > 0:
            raise ValueError(f"--compute-scale must be above 0, got {self.compute_scale:g}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {self.batch_size}")


def _sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


def _tensors(shapes: Sequence[StepShape], fp16: bool) -> Dict[Tuple[str, int], torch.Tensor]:
    """One buffer per gradient (name and bytes) of the steps: allocated once, reused every step."""
    dtype = torch.float16 if fp16 else torch.float32
    buffers: Dict[Tuple[str, int], torch.Tensor] = {}
    for shape in shapes:
        for g in shape.gradients:
            if (g.name, g.nbytes) not in buffers:  # fp16: the same elements in half the bytes
                buffers[(g.name, g.nbytes)] = torch.zeros(max(1, g.nbytes // 4), dtype=dtype)
    return buffers


def replay_step(shape: StepShape, buffers: Dict[Tuple[str, int], torch.Tensor], hvd,
                compute_scale: float = 1.0) -> Tuple[float, float]:
    """Replay one step through the running engine; return its time and the wait after backward."""
    start = time.perf_counter()
    handles = []
    for g in sorted(shape.gradients, key=lambda g: g.ready_s):
        _sleep_until(start + g.ready_s * compute_scale)
        handles.append(hvd.allreduce_async_(buffers[(g.name, g.nbytes)], name=g.name))
    _sleep_until(start + shape.backward_end_s * compute_scale)
    waited_from = time.perf_counter()
    for handle in handles:
        hvd.synchronize(handle)
    wait = time.perf_counter() - waited_from
    time.sleep(shape.update_s * compute_scale)
    hvd.profile_step()  # the step's end, as DistributedOptimizer.step() marks it, for a profile of the replay
    return time.perf_counter() - start, wait


def run_replay(profile_path: str, shapes: Sequence[StepShape], recorded: Dict[str, Any],
               opts: ReplayOptions) -> Optional[Dict[str, Any]]:
    """Replay ``shapes`` in the current job; return the record on rank 0 (None elsewhere)."""
    import hpdl.torch as hvd
    from hpdl.torch.runtime import backend_name, settings as job_settings

    hvd.init()
    try:
        buffers = _tensors(shapes, opts.fp16)
        times: List[Tuple[float, float]] = []
        for index in range(opts.warmup + opts.steps):
            measured = replay_step(shapes[index % len(shapes)], buffers, hvd, opts.compute_scale)
            if index >= opts.warmup:
                times.append(measured)
        every_rank = hvd.allgather_object(times)
        if hvd.rank() != 0:
            return None
        where = {"ranks": hvd.size(), "nodes": hvd.cross_size(), "ranks_per_node": hvd.local_size(),
                 "backend": backend_name()}
        return _record(profile_path, shapes, recorded, opts, every_rank, job_settings(), where)
    finally:
        hvd.shutdown()


def _record(profile_path: str, shapes: Sequence[StepShape], recorded: Dict[str, Any], opts: ReplayOptions,
            every_rank: List[List[Tuple[float, float]]], settings, where: Dict[str, Any]) -> Dict[str, Any]:
    steps = [statistics.fmean(rank[i][0] for rank in every_rank) for i in range(opts.steps)]
    waits = [statistics.fmean(rank[i][1] for rank in every_rank) for i in range(opts.steps)]
    compute = statistics.median((s.backward_end_s + s.update_s) * opts.compute_scale for s in shapes)
    step = statistics.median(steps)
    used = {name: getattr(settings, name) for name in COMPARED_SETTINGS}
    differing = {name: {"profile": recorded[name], "replay": used[name]} for name in COMPARED_SETTINGS
                 if name in recorded and recorded[name] != used[name]}
    record = {
        "benchmark": "replay", "profile": profile_path, **where, "fp16": opts.fp16,
        "compute_scale": opts.compute_scale, "steps": opts.steps, "warmup": opts.warmup,
        "profile_steps": len(shapes), "compute_s": compute, "step_s": step, "wait_s": statistics.median(waits),
        "step_s_each": steps, "settings": used, "settings_differing": differing,
    }
    if opts.batch_size is not None:
        record["batch_size"] = opts.batch_size
        record["img_per_s"] = where["ranks"] * opts.batch_size / step
    return record


def format_record(record: Dict[str, Any]) -> str:
    """The record as text."""
    lines = [f"replay of {record['profile']} ({record['profile_steps']} step(s) in turn) on {record['ranks']} "
             f"rank(s), {record['nodes']} node(s), backend {record['backend']}"
             + (", gradients in float16" if record["fp16"] else ""),
             f"compute per step (slept): {record['compute_s'] * 1e3:.1f} ms"
             + (f" (x{record['compute_scale']:g})" if record["compute_scale"] != 1 else ""),
             f"step time (median of {record['steps']}, mean over ranks): {record['step_s'] * 1e3:.1f} ms; "
             f"waited after backward: {record['wait_s'] * 1e3:.1f} ms"]
    if "img_per_s" in record:
        lines.append(f"img/s: {record['img_per_s']:.1f} ({record['batch_size']} per rank per step)")
    for name, values in record["settings_differing"].items():
        lines.append(f"note: {name} is {values['replay']} here, {values['profile']} in the profile "
                     "(hpdl profile predict replays the profile's)")
    return "\n".join(lines)
