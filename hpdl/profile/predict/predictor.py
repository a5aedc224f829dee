"""From a profile of a few ranks to a prediction at many: the step's shape read from the
profile, replayed (schedule.py) at each rank count over the network model (allreduce_cost.py),
with what-if variants beside the baseline.

A step's shape is read from the profile's own records: each gradient's bytes and the moment
it was submitted (``collectives.member_ready_us``, schema version 3), the step's start and end
and its exposed communication (``steps``). The compute of a step is what it took minus the
communication it waited for; the update is what follows the last gradient's allreduce. With
``compute_rate`` (another device's measured images per second), every compute time is scaled
so that a step's compute takes ``batch_size / compute_rate`` seconds.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from hpdl.config import Settings
from hpdl.formatting import parse_size
from hpdl.profile import schema
from hpdl.profile.analysis import class_labels, class_of
from hpdl.profile.predict.allreduce_cost import Placement, allreduce_cost, check_allreduce
from hpdl.profile.predict.network import Network
from hpdl.profile.predict.schedule import Gradient, StepResult, StepShape, simulate_step

# Steps replayed per prediction: the profile's last ones with gradients (a median of their times).
MAX_STEPS = 20
# The negotiation's message: a few words per pending tensor, latency-bound at any scale.
NEGOTIATION_BYTES = 64
# The size classes of the exposed communication: `hpdl profile report`'s default buckets.
SIZE_EDGES = (128 << 10, 16 << 20, 32 << 20, 64 << 20)


class PredictError(ValueError):
    """A prediction that cannot be made from what was given; the message is one line."""


@dataclasses.dataclass(frozen=True)
class WhatIf:
    """A variant of the job: its name as given, and what it changes."""

    name: str
    gradient_scale: float = 1.0  # fp16: half the bytes
    compute_scale: float = 1.0  # batch-size=2x: twice the compute per step
    images_scale: float = 1.0  # ... and twice the images
    settings: Dict[str, Any] = dataclasses.field(default_factory=dict)  # fusion-threshold=64MB
    algorithm: Optional[str] = None  # hierarchical
    large_from: Optional[int] = None  # bandwidth>=16MB:x2: messages of this size or more ...
    large_speedup: float = 1.0  # ... take this many times less time


BASELINE = WhatIf("baseline")


def parse_what_if(text: str) -> WhatIf:
    """``fp16``, ``fusion-threshold=64MB``, ``hierarchical``, ``bandwidth>=16MB:x2``, ``batch-size=2x``."""
    spec = text.strip()
    if spec == "fp16":
        return WhatIf(spec, gradient_scale=0.5)
    if spec == "hierarchical":
        return WhatIf(spec, algorithm="hierarchical")
    if spec.startswith("fusion-threshold="):
        return WhatIf(spec, settings={"fusion_threshold": _size_of(spec.split("=", 1)[1], spec)})
    if spec.startswith("batch-size=") and spec.endswith("x"):
        factor = _positive(spec[len("batch-size="):-1], spec)
        return WhatIf(spec, compute_scale=factor, images_scale=factor)
    if spec.startswith("bandwidth>=") and ":x" in spec:
        size, factor = spec[len("bandwidth>="):].split(":x", 1)
        return WhatIf(spec, large_from=_size_of(size, spec), large_speedup=_positive(factor, spec))
    raise PredictError(f"--what-if {text!r}: not one of fp16, hierarchical, fusion-threshold=SIZE, batch-size=Nx, "
                       "bandwidth>=SIZE:xN")


def _size_of(text: str, spec: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise PredictError(f"--what-if {spec}: {err}") from None


def _positive(text: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise PredictError(f"--what-if {spec}: {text!r} is not a factor above 0")
    return value


def step_shapes(profile: Dict[str, Any], path: str) -> Tuple[List[StepShape], Dict[str, Any]]:
    """The shapes of the profile's last steps (of its first rank recorded) whose gradients'
    ready times were recorded, and the engine settings in force.

    Raises:
        PredictError: no such step (a run too short, or a profile of an older hpdl).
    """
    rank = profile["ranks"][0]
    names = rank["tensors"]
    steps = {s["step"]: s for s in schema.records(rank, "steps")}
    by_step: Dict[int, List[Dict[str, Any]]] = {}
    old = False
    for c in schema.records(rank, "collectives"):
        if c["kind"] != "allreduce" or c["process_set"] != 0:
            continue
        if not c["member_ready_us"]:
            old = True
            continue
        by_step.setdefault(c["step"], []).append(c)
    shapes = []
    for index in sorted(by_step)[-MAX_STEPS:]:
        step = steps.get(index)
        if step is None:  # the collectives of a step not ended when the recording did
            continue
        start = step["start_us"]
        gradients = [Gradient(names[n], int(size), max(0.0, (ready - start) / 1e6))
                     for c in by_step[index] for n, size, ready in zip(c["names"], c["sizes"], c["member_ready_us"])]
        backward_end = max(g.ready_s for g in gradients)
        total = (step["end_us"] - start) / 1e6
        update = max(0.0, total - backward_end - step["blocked_us"] / 1e6)
        shapes.append(StepShape(tuple(gradients), backward_end, update))
    if not shapes:
        why = ("its collectives were recorded by an older hpdl, without each gradient's ready time (profile "
               "schema 3): record it again") if old else \
            "it holds no training step with allreduces (record a few steps of training, not only set-up)"
        raise PredictError(f"{path}: cannot predict from this profile: {why}")
    return shapes, dict(profile.get("job", {}).get("settings", {}))


def job_settings(recorded: Dict[str, Any]) -> Settings:
    """The engine settings in force when the profile was recorded: hpdl's defaults, with each
    value the profile's ``job.settings`` holds (those of a known name and type)."""
    settings = Settings()
    known = {f.name for f in dataclasses.fields(Settings)}
    return dataclasses.replace(settings, **{k: v for k, v in recorded.items() if k in known
                                            and isinstance(v, type(getattr(settings, k)))})


def scaled(shape: StepShape, compute: float, gradient_scale: float = 1.0) -> StepShape:
    """``shape`` with its compute ``compute`` times as long and its gradients' bytes scaled."""
    return StepShape(tuple(Gradient(g.name, max(1, int(g.nbytes * gradient_scale)), g.ready_s * compute)
                           for g in shape.gradients), shape.backward_end_s * compute, shape.update_s * compute)


def compute_seconds(shape: StepShape) -> float:
    """A step's compute: backward's end and the update (the rest is communication)."""
    return shape.backward_end_s + shape.update_s


@dataclasses.dataclass(frozen=True)
class Point:
    """The prediction at one rank count, for one variant."""

    what_if: str
    ranks: int
    step_s: float
    img_per_s: float
    efficiency: float
    exposed_s: float
    exposed_by_class: Dict[str, float]
    algorithm: str


def exposed_by_class(result: StepResult, backward_end_s: float) -> Dict[str, float]:
    """Each size class's share of the time the optimizer waited: the part of each collective
    after backward's end and after the collectives before it."""
    shares: Dict[str, float] = {}
    covered = backward_end_s
    for c in result.collectives:
        part = max(0.0, c.end_s - max(c.start_s, covered))
        covered = max(covered, c.end_s)
        if part > 0:
            key = class_labels(SIZE_EDGES)[class_of(c.nbytes, SIZE_EDGES)]
            shares[key] = shares.get(key, 0.0) + part
    return shares


def predict(shapes: Sequence[StepShape], settings: Settings, network: Network, ranks: Sequence[int],
            ranks_per_node: int, batch_size: int, algorithm: str = "auto", nics_per_node: int = 1,
            what_ifs: Sequence[WhatIf] = (BASELINE,), compute_rate: Optional[float] = None,
            backend: str = "nccl") -> List[Point]:
    """Predict every rank count for every variant (the baseline first).

    ``backend`` decides whether the engine's thread waits for each collective: MPI among the
    ranks of one node runs them as blocking calls (schedule.py).

    Raises:
        PredictError, and the network model's errors (one line each).
    """
    base_compute = statistics.median(compute_seconds(s) for s in shapes)
    factor = 1.0 if compute_rate is None else (batch_size / compute_rate) / base_compute
    points = []
    for what_if in what_ifs:
        chosen = what_if.algorithm or algorithm
        job_settings = dataclasses.replace(settings, **what_if.settings)
        variant = [scaled(s, factor * what_if.compute_scale, what_if.gradient_scale) for s in shapes]
        images = batch_size * what_if.images_scale
        # One rank's rate: a step of compute alone (no allreduce to wait for).
        single = images / statistics.median(compute_seconds(s) for s in variant)
        for p in ranks:
            placement = Placement(p, min(ranks_per_node, p) if p > 1 else 1, nics_per_node)
            if p > 1:
                check_allreduce(network, placement, chosen)
            cost = _cost(network, placement, chosen, what_if)
            negotiation = round_overhead(network, placement, cost) if p > 1 else 0.0
            blocking = collectives_block(backend, placement)
            results = [simulate_step(s, job_settings, cost, negotiation, collectives_block=blocking) for s in variant]
            middle = sorted(range(len(results)), key=lambda i: results[i].step_s)[len(results) // 2]
            result, shape = results[middle], variant[middle]
            rate = p * images / result.step_s
            used = allreduce_cost(network, placement, 1 << 20, chosen).algorithm if p > 1 else "none"
            points.append(Point(what_if.name, p, result.step_s, rate, rate / (p * single), result.exposed_s,
                                exposed_by_class(result, shape.backward_end_s), used))
    return points


def round_overhead(network: Network, placement: Placement, cost: Callable[..., float]) -> float:
    """What a round of the engine costs before its collectives start: where the curve of the
    level that spans the job was measured through the engine beside the raw backend (``hpdl
    bench allreduce --paths backend,engine``), the engine's own overhead measured there (its
    negotiation, and on a node with more ranks than cores, its threads waiting for one);
    otherwise the negotiation alone, a small allreduce at the job's scale."""
    level = network.level("inter" if placement.nodes > 1 else "intra") or network.level("intra") \
        or network.level("inter")
    measured = getattr(level, "engine_overhead_s", None)
    if measured is not None and getattr(level, "ranks", None) == placement.ranks:
        return measured
    return cost(NEGOTIATION_BYTES, negotiation=True)


def collectives_block(backend: str, placement: Placement) -> bool:
    """Whether the engine runs each allreduce as a blocking call: MPI among the ranks of one
    node (hpdl/comm/mpi.py's ``background_collectives``); elsewhere they run in the background."""
    return backend == "mpi" and placement.nodes == 1


def _cost(network: Network, placement: Placement, algorithm: str, what_if: WhatIf) -> Callable[..., float]:
    cache: Dict[int, float] = {}

    def seconds(nbytes: int, negotiation: bool = False) -> float:
        if placement.ranks == 1:
            return 0.0
        if nbytes not in cache:
            time = allreduce_cost(network, placement, nbytes, algorithm).seconds
            if not negotiation and what_if.large_from is not None and nbytes >= what_if.large_from:
                time /= what_if.large_speedup
            cache[nbytes] = time
        return cache[nbytes]

    return seconds


def assumptions(shapes: Sequence[StepShape], settings: Settings, network: Network, ranks_per_node: int,
                algorithm: str, batch_size: int, compute_rate: Optional[float], backend: str = "nccl") -> List[str]:
    """What the prediction assumed, in lines for its output."""
    compute = statistics.median(compute_seconds(s) for s in shapes)
    gradients = statistics.median(len(s.gradients) for s in shapes)
    nbytes = statistics.median(sum(g.nbytes for g in s.gradients) for s in shapes)
    lines = [f"compute per step: {compute * 1e3:.1f} ms as profiled (median of {len(shapes)} step(s))"
             + (f", scaled to {batch_size / compute_rate * 1e3:.1f} ms by --compute-rate {compute_rate:g} img/s"
                if compute_rate else ""),
             f"gradients: {gradients:g} per step, {nbytes / 2**20:.1f} MiB, at their recorded moments in backward",
             f"batch size {batch_size} per rank; {ranks_per_node} rank(s) per node; allreduce algorithm {algorithm}",
             f"engine: fusion threshold {settings.fusion_threshold / 2**20:g} MiB, in-place threshold "
             f"{settings.inplace_threshold / 2**20:g} MiB, gathering up to {settings.gather_bytes / 2**20:g} MiB or "
             f"{settings.gather_time_ms:g} ms, cycle {settings.cycle_time_ms:g} ms (the engine's own scheduling and "
             "fusion, replayed)",
             f"backend {backend}: " + ("the engine's thread waits for each collective within a node (MPI's blocking "
                                       "calls), not across nodes" if backend == "mpi" else
                                       "collectives in the background, rounds beside them"),
             "every rank alike; collectives one after another on the backend; compute not slowed by communication"]
    lines += [f"network: {line}" for line in network.describe()]
    return lines
