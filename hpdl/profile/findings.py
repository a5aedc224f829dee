"""Findings: what the profile's numbers mean, in plain words, each tied to a figure.

With an ``hpdl bench allreduce --json`` file, message-size findings compare the bandwidth
reached in the job with what the backend alone reached on this machine at that size.
"""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional, Tuple

from hpdl.engine.events import HALO
from hpdl.formatting import format_size
from hpdl.profile.analysis import Analysis
from hpdl.profile.schema import ProfileError, read_file

# Bench curve: message bytes -> (mean latency µs, bus bandwidth GB/s).
BenchCurve = Dict[int, Tuple[float, float]]


def load_bench(path: str) -> BenchCurve:
    """Read an ``hpdl bench allreduce --json`` file (its backend path, else its first path)."""
    try:
        data = json.loads(read_file(path, "--bench file").decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ProfileError(f"--bench file {path} is not JSON; write it with `hpdl bench allreduce --json`") from None
    records = data.get("records") if isinstance(data, dict) and data.get("benchmark") == "allreduce" else None
    if not isinstance(records, list) or not records:
        raise ProfileError(f"--bench file {path} is not `hpdl bench allreduce --json` output (no allreduce records)")
    try:
        paths = [r["path"] for r in records]
        wanted = "backend" if "backend" in paths else paths[0]
        return {int(r["size"]): (float(r["avg_us"]), float(r["busbw_GBps"])) for r in records if r["path"] == wanted}
    except (KeyError, TypeError, ValueError) as err:
        raise ProfileError(f"--bench file {path}: a record lacks a usable {err}") from None


def bench_at(curve: BenchCurve, nbytes: float) -> Optional[Tuple[int, float]]:
    """The bench size nearest ``nbytes`` (on a log scale) and its bus bandwidth."""
    if not curve or nbytes <= 0:
        return None
    size = min(curve, key=lambda s: abs(math.log(s) - math.log(nbytes)))
    return size, curve[size][1]


def _ms(us: float) -> str:
    return f"{us / 1e3:.1f} ms"


_HALF_DTYPES = ("float16", "bfloat16")


def _fp16_spelling(a: Analysis) -> Optional[str]:
    """How the profiled job itself asks for fp16 gradients (half the bytes), in its own
    command's spelling; None where its allreduces are half precision already.

    ``--fp16-allreduce`` is only ``hpdl bench synthetic``'s: a training script needs the
    optimizer's argument, ``hpdl sr train`` its config key.
    """
    allreduces = [m for ms in a.messages for m in ms if m["kind"] == "allreduce"]
    if allreduces and all(m["dtype"] in _HALF_DTYPES for m in allreduces):
        return None
    command = [str(word) for word in a.job.get("command") or []]
    program = os.path.basename(command[0]) if command else ""
    if program in ("hpdl", "__main__.py"):
        if command[1:3] == ["bench", "synthetic"]:
            return "`--fp16-allreduce`"
        if command[1:3] == ["sr", "train"]:
            return "`compression=fp16`"
    return "`compression=hvd.Compression.fp16` in `hvd.DistributedOptimizer`, `compression=fp16` in `hpdl sr train`"


def _size_class(a: Analysis, bench: Optional[BenchCurve]) -> Optional[str]:
    top = max(a.classes, key=lambda r: r.time_us, default=None)
    if top is None or not top.time_us:
        return None
    text = (f"{top.share:.0%} of communication time is in {top.label} messages ({top.calls:.0f} calls, "
            f"{_ms(top.time_us)} per rank")
    bw = top.busbw_gbps
    if bw is None:
        return text + ")."
    text += f") at {bw:.2f} GB/s bus bandwidth"
    reached = bench_at(bench, top.mean_bytes) if bench else None
    if reached is None:
        return text + (": run `hpdl bench allreduce --json > b.json` and give it with --bench to see "
                       "what the backend alone reaches at that size.")
    size, bench_bw = reached
    text += f", against {bench_bw:.2f} GB/s that `hpdl bench allreduce` reached at {format_size(size)}"
    if bw < 0.5 * bench_bw:
        return text + (f": the backend alone moves such messages {bench_bw / bw:.1f}x faster; in training they "
                       "compete with compute for cores and memory bandwidth, or wait for a late rank (see arrival).")
    if bw >= 0.8 * bench_bw:
        fp16 = _fp16_spelling(a)
        return text + (": these messages already run at the backend's speed here; only "
                       + (f"fewer bytes (fp16 gradients: {fp16}) or " if fp16 else "")
                       + "a faster backend (an MPI tuned for large messages) makes them faster.")
    return text + ": some of the backend's speed is lost to contention with compute."


def _exposed(a: Analysis) -> Optional[str]:
    s = a.steps
    if s is None or not s.step_us:
        return None
    head = (f"exposed communication is {s.exposed_share:.0%} of the step ({_ms(s.exposed_us)} of "
            f"{_ms(s.step_us)}, median over {s.steps} steps)")
    if s.exposed_share >= 0.1:
        if a.size < 2:
            # Nothing crosses a link: fewer bytes or earlier exchanges would not shorten the wait.
            return head + (": with one rank nothing is exchanged, so this is the engine's own work on the "
                           "gradients (queue, rounds, copies); profile at the rank count the job runs with to "
                           f"see what exchanging them costs (efficiency estimate {s.efficiency:.0%}).")
        fp16 = _fp16_spelling(a)
        return head + (": backward does not hide it; try " + (f"fp16 gradients, half the bytes ({fp16}), or "
                                                               if fp16 else "")
                       + "a smaller HPDL_FUSION_THRESHOLD so reductions start earlier in backward (efficiency "
                       f"estimate {s.efficiency:.0%}).")
    if s.spatial_us >= 0.1 * s.step_us:
        return head + (": backward hides the engine's communication; the spatial communication (halo exchanges, "
                       f"group collectives) is the rest of the step that is not compute (efficiency estimate "
                       f"{s.efficiency:.0%}).")
    return head + f": backward hides the communication; the step is bound by compute (efficiency estimate {s.efficiency:.0%})."


def _rate(bytes_per_us: float) -> str:
    """MB/s, or GB/s from 1 GB/s."""
    return f"{bytes_per_us / 1e3:.2f} GB/s" if bytes_per_us >= 1e3 else f"{bytes_per_us:.1f} MB/s"


def _spatial(a: Analysis) -> Optional[str]:
    """How much of the step the spatial groups' own communication takes, and where."""
    sc = a.spatial
    if not sc.present:
        return None
    parts = []
    for k in sc.kinds:
        # A halo's rows are the bulk of the bytes; a group collective's few bytes have no rate to speak of.
        rate = f" at {_rate(k.nbytes / k.time_us)}" if k.kind == HALO and k.time_us and k.nbytes else ""
        parts.append(f"{k.calls:.0f} {k.label} of {format_size(k.nbytes)}{rate} ({_ms(k.time_us)})")
    top = sc.layers[0]
    where = f"; the layer with the most is {top.label} ({top.op}, {top.share:.0%} of it)"
    s = a.steps
    if not sc.per_step or s is None or not s.step_us:
        return f"spatial communication, per rank: {', '.join(parts)}{where}."
    share = s.spatial_us / s.step_us
    text = (f"the spatial communication takes {share:.0%} of the step ({_ms(s.spatial_us)} of {_ms(s.step_us)}, "
            f"medians: {', '.join(parts)}){where}; the model waits for it on its own thread")
    if share >= 0.1:
        return text + (": each exchange and collective waits for the other bands, so bands that reach it at "
                       "different times (uneven bands, a busy core) wait there, and thin bands move more rows per "
                       "pixel computed; larger images per rank, or fewer bands, lower it.")
    return text + ": the step is bound by compute."


def _core_wait(a: Analysis) -> Optional[str]:
    s = a.steps
    if s is None or s.core_wait_us is None or not s.compute_us:
        return None
    share = s.core_wait_us / s.compute_us
    if share < 0.05:
        return None
    return (f"the training thread waited {_ms(s.core_wait_us)} per step for a core, ready to run ({share:.0%} of its "
            f"compute, median over {s.steps} steps): other threads or processes share its cores (the engine's and "
            "the backend's threads, data loading, other ranks on the node), so part of what communication costs "
            "shows as slower compute, not as exposed communication, and the efficiency estimate is above the "
            "real one. Give each rank cores of its own, or fewer threads (OMP_NUM_THREADS, DataLoader workers).")


def _straggler(a: Analysis) -> Optional[str]:
    arrival, steps = a.arrival, a.steps
    if arrival is None or not arrival.collectives:
        return None
    worst = max(arrival.ranks, key=lambda r: r.mean_late_us)
    # Weighed by time, not by count: a rank last by a hair at most collectives costs less than
    # one that is last less often but far behind.
    behind = sum(r.mean_late_us for r in arrival.ranks)
    share = worst.mean_late_us / behind if behind else 0.0
    threshold = max(1000.0, 0.05 * steps.step_us) if steps else 1000.0
    if share >= 0.6 and worst.mean_late_us >= threshold:
        return (f"rank {worst.rank} arrives {_ms(worst.mean_late_us)} after the first rank on average over all "
                f"{arrival.collectives} collectives matched across ranks, {share:.0%} of all ranks' time behind (the "
                f"last to arrive at {worst.last / arrival.collectives:.0%} of them; median spread "
                f"{_ms(arrival.median_spread_us)}): it computes slower (a busy core, uneven data) and every other "
                "rank waits for it.")
    return (f"no rank straggles: the median spread of arrival at a collective is {_ms(arrival.median_spread_us)} "
            f"(90th percentile {_ms(arrival.p90_spread_us)}).")


def _small_messages(a: Analysis) -> Optional[str]:
    small = a.classes[0]
    per_step = a.fusion.messages_per_step
    if small.share >= 0.3 and per_step > 20:
        return (f"{small.share:.0%} of communication time is in {small.label} messages, {per_step:.0f} messages per "
                "step: per-call overhead dominates; fuse more (a larger HPDL_GATHER_BYTES, so that a round waits for "
                "more tensors, or a larger HPDL_FUSION_THRESHOLD).")
    return None


def _negotiation(a: Analysis) -> Optional[str]:
    steady = [a.steady_collectives(rank) for rank in a.ranks]
    negotiate = sum(c["negotiate_us"] for cs in steady for c in cs) / len(a.ranks)
    backend = sum(c["backend_us"] for cs in steady for c in cs) / len(a.ranks)
    if not (backend and negotiate > backend):
        return None
    text = (f"collectives wait {_ms(negotiate)} per rank in negotiation against {_ms(backend)} in backend "
            "calls (after start-up): ")
    slow_rounds = ("with collectives in flight on a slow link they queue behind the data (a smaller "
                   "HPDL_PRIORITY_WINDOW keeps less in flight), else the engine cycles too slowly (HPDL_CYCLE_TIME).")
    if a.size < 2:
        return text + ("with one rank there is no one to wait for, so this is the engine's rounds themselves: it "
                       "cycles too slowly (HPDL_CYCLE_TIME).")
    w = a.waits
    if w is None or not w.negotiate_us:
        return text + (f"the file has no collective recorded by more than one of the {a.size} ranks, so it cannot "
                       "tell ranks waiting for each other from slow rounds.")
    # Weighed by time: what share of all negotiation is waiting for a rank that joined later.
    if w.waiting_share < 0.5:
        return text + (f"{1 - w.waiting_share:.0%} of it is what even the last rank to join a collective waits "
                       f"for its round, so the rounds are slow, not the ranks: {slow_rounds}")
    worst = max(w.ranks, key=lambda r: r.late_us)
    # Averaged over the collectives this rank joined last, not over all of them as the arrival
    # finding is, and by joining (submission plus queue wait), not by submission alone.
    text += (f"{w.waiting_share:.0%} of it is ranks waiting for the last to join (a rank joins when its engine "
             f"thread takes the request: its submission plus its queue wait). Rank {worst.rank} joins last at "
             f"{worst.last / w.collectives:.0%} of collectives, and at those it joins "
             f"{_ms(worst.late_us / max(worst.last, 1))} after the first on average")
    if worst.late_us > 0 and worst.late_queue_us >= 0.5 * worst.late_us:
        return text + (f", {worst.late_queue_us / worst.late_us:.0%} of that in its queue: rank {worst.rank}'s "
                       f"engine thread is late to take requests from its queue ({_ms(worst.queue_us)} of queue wait "
                       "in all), waiting for a core; the engine threads run at low priority (HPDL_ENGINE_NICE), so "
                       "leave them a core (fewer compute threads) or raise their priority.")
    return text + ": it submits them late, its training thread still computing (see arrival)."


def _fill(a: Analysis) -> Optional[str]:
    f = a.fusion
    if f.max_fill is not None and f.max_fill >= 0.95:
        return (f"fused messages reach {f.buffer}: the gradients are split over several messages; a larger "
                "HPDL_FUSION_THRESHOLD sends fewer.")
    if f.fill is not None and f.fill < 0.25:
        return (f"fused messages fill {f.fill:.0%} of {f.buffer} on average ({f.tensors_per_message:.1f} tensors "
                "per message): the buffer is larger than what is ready at once.")
    return None


def findings(a: Analysis, bench: Optional[BenchCurve] = None) -> List[str]:
    """Plain-words findings, most important first."""
    found = [_size_class(a, bench), _exposed(a), _spatial(a), _core_wait(a), _straggler(a), _small_messages(a),
             _negotiation(a), _fill(a)]
    return [f for f in found if f]


def bench_points(curve: BenchCurve) -> List[Tuple[int, float, float]]:
    """(bytes, latency µs, bus bandwidth GB/s) of the bench curve, by size (for plots)."""
    return [(size, *curve[size]) for size in sorted(curve)]

