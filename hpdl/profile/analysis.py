"""What a profile says: time by message-size class, per message and tensor, per step, per rank, fusion.

Every figure is a mean over the ranks recorded (all ranks run the same collectives), except
where a table is per rank. Communication time is the backend call's (what the study behind
the size classes measured); bus bandwidth is ``bytes / time * factor`` as nccl-tests define it
(allreduce ``2(p-1)/p``; allgather ``(p-1)/p`` of the gathered output, ``p-1`` of the input
recorded; reducescatter and alltoall ``(p-1)/p`` of the input; broadcast 1). The
first step (start-up: model building, the initial broadcasts) is left out of the per-step,
fusion and arrival figures whenever later steps exist.

All of these are the engine's collectives. A spatial-parallel job's halo exchanges and group
collectives, outside the engine, have figures of their own (spatial_comm.py); the per-step
figures count their time apart from compute.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hpdl.formatting import format_size, parse_size
from hpdl.profile import schema
from hpdl.profile.spatial_comm import SpatialCommunication, time_by_step

DEFAULT_EDGES = (128 << 10, 16 << 20, 32 << 20, 64 << 20)


def parse_buckets(text: str) -> Tuple[int, ...]:
    """Parse ``--buckets`` (e.g. ``128K,16M,32M,64M``) into ascending class edges in bytes."""
    edges = [parse_size(part) for part in text.split(",") if part.strip()]
    if not edges or any(e <= 0 for e in edges) or sorted(set(edges)) != edges:
        raise ValueError(f"--buckets {text!r}: give increasing positive sizes, e.g. 128K,16M,32M,64M")
    return tuple(edges)


def class_labels(edges: Sequence[int]) -> List[str]:
    """Labels of the classes ``(edge[i-1], edge[i]]``: ``<= 128 KiB``, ``128 KiB-16 MiB``, ..., ``> 64 MiB``."""
    labels = [f"<= {format_size(edges[0])}"]
    labels += [f"{format_size(lo)}-{format_size(hi)}" for lo, hi in zip(edges, edges[1:])]
    return labels + [f"> {format_size(edges[-1])}"]


def class_of(nbytes: int, edges: Sequence[int]) -> int:
    """Index of the size class of a message of ``nbytes``."""
    for i, edge in enumerate(edges):
        if nbytes <= edge:
            return i
    return len(edges)


def bus_factor(kind: str, size: int) -> float:
    """nccl-tests' bus-bandwidth factor of a collective on ``size`` ranks, applied to the bytes
    recorded (this rank's input; 0: not meaningful).

    nccl-tests measure allgather by its gathered output (p times the input), with the factor
    (p-1)/p: on the input that is (p-1). Reducescatter's and alltoall's size is the input
    (the whole buffer each rank sends), with (p-1)/p; broadcast's the buffer, with 1.
    """
    if size < 2:
        return 0.0
    if kind == "allreduce":
        return 2 * (size - 1) / size
    if kind == "allgather":
        return float(size - 1)
    if kind in ("reducescatter", "alltoall"):
        return (size - 1) / size
    return 1.0 if kind == "broadcast" else 0.0


def _percentile(ordered: List[float], q: float) -> float:
    """The ``q`` quantile of ascending ``ordered``, interpolated between neighbours as the median
    is (a lower neighbour alone put the 90th percentile of two values below their median)."""
    position = q * (len(ordered) - 1)
    below = int(position)
    if below + 1 >= len(ordered):
        return float(ordered[-1])
    return float(ordered[below] + (ordered[below + 1] - ordered[below]) * (position - below))


@dataclasses.dataclass
class Row:
    """Calls and time of one group of messages (a size class, a message, a tensor), per rank."""

    label: str
    calls: float = 0.0
    time_us: float = 0.0
    moved: float = 0.0  # bytes times the bus factor, for bus bandwidth
    volume: float = 0.0  # bytes of all calls
    nbytes: int = 0
    share: float = 0.0
    kind: str = ""

    @property
    def mean_us(self) -> float:
        return self.time_us / self.calls if self.calls else 0.0

    @property
    def mean_bytes(self) -> float:
        return self.volume / self.calls if self.calls else 0.0

    @property
    def busbw_gbps(self) -> Optional[float]:
        return self.moved / self.time_us / 1e3 if self.time_us and self.moved else None


@dataclasses.dataclass
class StepStats:
    """Medians over one rank's steps (or all ranks'), in microseconds.

    Compute is the median step minus the median exposed communication and the median spatial
    communication (halo exchanges and group collectives, on the training thread; 0 in a job
    without), not a median of its own, so that the row adds up: compute + exposed + spatial =
    step.
    """

    label: str
    steps: int
    step_us: float
    compute_us: float
    comm_us: float
    exposed_us: float
    # The stepping thread's wait for a core (runnable, not running): None where not recorded.
    core_wait_us: Optional[float] = None
    spatial_us: float = 0.0

    @property
    def exposed_share(self) -> float:
        return self.exposed_us / self.step_us if self.step_us else 0.0

    @property
    def efficiency(self) -> float:
        """compute / step: the step's pace relative to the same compute with no exposed communication."""
        return self.compute_us / self.step_us if self.step_us else 0.0


@dataclasses.dataclass
class RankArrival:
    rank: int
    last: int  # collectives at which this rank arrived last
    mean_late_us: float  # mean time behind the first rank to arrive


@dataclasses.dataclass
class Arrival:
    collectives: int
    median_spread_us: float
    p90_spread_us: float
    max_spread_us: float
    ranks: List[RankArrival]


@dataclasses.dataclass
class RankWaits:
    """One rank's waits at the collectives matched across ranks (totals, µs)."""

    rank: int
    queue_us: float
    negotiate_us: float
    last: int  # collectives this rank joined last (its submission plus its queue wait)
    late_us: float  # at those, how far behind the first rank to join
    late_queue_us: float  # of late_us, what its queue wait beyond the others' explains


@dataclasses.dataclass
class Waits:
    """Negotiation time split by cause, over the collectives matched across ranks.

    A rank joins a collective's negotiation when its engine thread takes the request from its
    queue (submission plus queue wait). The last rank to join has no one left to wait for:
    its negotiation is the round's own cost, and every rank pays up to that much; the rest of
    the ranks' negotiation is waiting for the last one.
    """

    collectives: int
    negotiate_us: float  # all ranks' negotiation
    round_us: float  # of it, each rank's negotiation up to the last joiner's
    ranks: List[RankWaits]

    @property
    def waiting_share(self) -> float:
        """The share of negotiation time spent waiting for a rank that joined later."""
        return 1.0 - self.round_us / self.negotiate_us if self.negotiate_us else 0.0


@dataclasses.dataclass
class Fusion:
    messages_per_step: float
    tensors_per_message: float
    fused_share: float  # of messages carrying more than one tensor
    fill: Optional[float]  # mean fused message / fusion threshold
    max_fill: Optional[float]
    reuse: Optional[float]  # fusion-buffer hits / requests
    threshold: int
    # Autotuned: ``threshold`` is the one in force when the recording ended; messages fused
    # under the thresholds tried before it are measured against it too.
    autotuned: bool = False

    @property
    def buffer(self) -> str:
        """The fusion buffer the fill figures are measured against, in words."""
        text = f"the {format_size(self.threshold)} fusion buffer"
        return text + (" (autotuned: the threshold at the end of the recording)" if self.autotuned else "")


class Analysis:
    """Everything the report shows, computed once from a loaded profile."""

    def __init__(self, profile: Dict[str, Any], edges: Sequence[int] = DEFAULT_EDGES):
        self.profile = profile
        self.job = profile["job"]
        self.ranks = profile["ranks"]
        self.size = int(self.job.get("size", len(self.ranks)))
        self.edges = tuple(edges)
        self.messages = [list(schema.records(r, "messages")) for r in self.ranks]
        self.total_comm_us = sum(m["backend_us"] for ms in self.messages for m in ms) / len(self.ranks)
        self.classes = self._classes()
        self.by_message = self._by_message()
        self.by_tensor = self._by_tensor()
        self.spatial = SpatialCommunication(
            self.ranks, [[s["step"] for s in self.steady(list(schema.records(r, "steps")))] for r in self.ranks])
        self.per_rank_steps = [self._step_stats(f"rank {r['rank']}", [r]) for r in self.ranks]
        self.steps = self._step_stats("all ranks", self.ranks)
        # Nothing between the start of the recording and its end (e.g. init() then shutdown()).
        self.empty = not any(self.messages) and self.steps is None and not self.spatial.present
        matched = self.matched_collectives() if len(self.ranks) > 1 else []
        self.arrival = self._arrival(matched)
        self.waits = self._waits(matched)
        self.fusion = self._fusion()

    def _row(self, rows: Dict[Any, Row], key: Any, label: str, message: Dict[str, Any]) -> None:
        row = rows.setdefault(key, Row(label, nbytes=message["bytes"], kind=message["kind"]))
        n = len(self.ranks)
        row.calls += message["calls"] / n
        row.time_us += message["backend_us"] / n
        row.moved += message["bytes"] * message["calls"] * bus_factor(message["kind"], self.size) / n
        row.volume += message["bytes"] * message["calls"] / n

    def _shares(self, rows: List[Row]) -> List[Row]:
        for row in rows:
            row.share = row.time_us / self.total_comm_us if self.total_comm_us else 0.0
        return rows

    def _classes(self) -> List[Row]:
        labels = class_labels(self.edges)
        rows = {i: Row(label) for i, label in enumerate(labels)}
        for messages in self.messages:
            for m in messages:
                i = class_of(m["bytes"], self.edges)
                self._row(rows, i, labels[i], m)
        return self._shares([rows[i] for i in range(len(labels))])

    def _by_message(self) -> List[Row]:
        rows: Dict[tuple, Row] = {}
        for messages in self.messages:
            for m in messages:
                fused = f", {m['tensors']} tensors" if m["tensors"] > 1 else ""
                label = f"{m['kind']} {format_size(m['bytes'])} {m['dtype']}{fused}"
                self._row(rows, (m["kind"], m["dtype"], m["bytes"], m["tensors"]), label, m)
        return self._shares(sorted(rows.values(), key=lambda r: -r.time_us))

    def _by_tensor(self) -> List[Row]:
        """Per tensor, over the ranks, folded again to one top set of ``TENSOR_ROWS``.

        Each rank kept its own top tensors, so a tensor can have a row on one rank and be folded
        into "(other tensors)" on another; its time would be split between two rows, and the
        union of the ranks' rows is larger than any one rank's. Sets ``tensor_count`` (distinct
        tensors recorded) and ``tensors_folded`` (of those, the ones without a row here).
        """
        from hpdl.profile.recorder import TENSOR_ROWS

        rows: Dict[tuple, Row] = {}
        n = len(self.ranks)
        own_per_rank: List[int] = []
        for rank in self.ranks:
            names = rank["tensors"]
            own = 0
            for t in schema.records(rank, "tensors_time"):
                name = names[t["name"]] if 0 <= t["name"] < len(names) else f"#{t['name']}"
                own += name != schema.OTHER_TENSORS
                row = rows.setdefault((t["kind"], name), Row(f"{name} ({t['kind']})", nbytes=t["bytes"]))
                row.calls += t["calls"] / n
                row.time_us += t["time_us"] / n
            own_per_rank.append(own)
        named = sorted((key for key in rows if key[1] != schema.OTHER_TENSORS), key=lambda key: -rows[key].time_us)
        # A rank's folded tensors are the ones it has no row for; those that another rank has a
        # row for are already counted, the rest were folded on every rank (the ranks run the same
        # collectives, so the largest such remainder is the count).
        folded_everywhere = max((r.get("tensors_folded", 0) - (len(named) - own)
                                 for r, own in zip(self.ranks, own_per_rank)), default=0)
        self.tensor_count = len(named) + max(0, folded_everywhere)
        for key in named[TENSOR_ROWS:]:
            row = rows.pop(key)
            other = rows.setdefault((key[0], schema.OTHER_TENSORS),
                                    Row(f"{schema.OTHER_TENSORS} ({key[0]})", nbytes=row.nbytes))
            other.calls += row.calls
            other.time_us += row.time_us
        self.tensors_folded = self.tensor_count - min(len(named), TENSOR_ROWS)
        return self._shares(sorted(rows.values(), key=lambda r: -r.time_us))

    @staticmethod
    def steady(steps: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """The steps after the start-up step (all of them if there is nothing else)."""
        return [s for s in steps if s["step"] > 0] or steps

    def _step_stats(self, label: str, ranks: List[Dict[str, Any]]) -> Optional[StepStats]:
        steps, spatial = [], []
        for r in ranks:
            mine = self.steady(list(schema.records(r, "steps")))
            by_step = time_by_step(r)
            steps += mine
            spatial += [by_step.get(s["step"], 0.0) for s in mine]
        if not steps:
            return None
        med = lambda values: float(statistics.median(values))  # noqa: E731
        step = med([s["end_us"] - s["start_us"] for s in steps])
        exposed = med([s["blocked_us"] for s in steps])
        waits = [s["core_wait_us"] for s in steps if s["core_wait_us"] is not None]
        return StepStats(label, len(steps), step, step - exposed - med(spatial), med([s["comm_us"] for s in steps]),
                         exposed, med(waits) if waits else None, med(spatial))

    def steady_collectives(self, rank: Dict[str, Any]) -> List[Dict[str, Any]]:
        """The rank's raw collectives outside the start-up step (all of them if there is nothing else)."""
        rows = list(schema.records(rank, "collectives"))
        return [c for c in rows if c["step"] > 0] or rows

    @staticmethod
    def submitted(c: Dict[str, Any]) -> bool:
        """Whether this rank submitted the collective, so that ``ready_us`` is its arrival.

        A rank in ``hvd.join()`` takes part in the others' collectives without submitting them:
        the recorder, seeing no submission, sets its arrival to the backend call's start with
        no queue wait or negotiation. It was waiting in join, not late.
        """
        return not (c["ready_us"] == c["start_us"] and c["queue_us"] == 0 and c["negotiate_us"] == 0)

    def matched_collectives(self) -> List[Dict[int, Dict[str, Any]]]:
        """The steady collectives that more than one rank submitted: per collective, rank -> row."""
        by_key: Dict[Tuple[int, int], Dict[int, Dict[str, Any]]] = {}
        for rank in self.ranks:
            for c in self.steady_collectives(rank):
                if self.submitted(c):
                    by_key.setdefault((c["process_set"], c["seq"]), {})[rank["rank"]] = c
        return [rows for rows in by_key.values() if len(rows) > 1]

    def _arrival(self, collectives: List[Dict[int, Dict[str, Any]]]) -> Optional[Arrival]:
        matched = [{r: c["ready_us"] for r, c in rows.items()} for rows in collectives]
        if not matched:
            return None
        spreads = sorted(max(t.values()) - min(t.values()) for t in matched)
        last = {r["rank"]: 0 for r in self.ranks}
        late = {r["rank"]: [] for r in self.ranks}
        for times in matched:
            first = min(times.values())
            last[max(times, key=times.get)] += 1
            for rank, t in times.items():
                late[rank].append(t - first)
        ranks = [RankArrival(r, last[r], statistics.fmean(late[r]) if late[r] else 0.0) for r in sorted(last)]
        return Arrival(len(matched), float(statistics.median(spreads)), _percentile(spreads, 0.9), spreads[-1], ranks)

    def _waits(self, matched: List[Dict[int, Dict[str, Any]]]) -> Optional[Waits]:
        if not matched:
            return None
        ranks = {r["rank"]: RankWaits(r["rank"], 0.0, 0.0, 0, 0.0, 0.0) for r in self.ranks}
        total = rounds = 0.0
        for rows in matched:
            joined = {r: c["ready_us"] + c["queue_us"] for r, c in rows.items()}
            last = max(joined, key=joined.get)
            round_us = rows[last]["negotiate_us"]
            for r, c in rows.items():
                ranks[r].queue_us += c["queue_us"]
                ranks[r].negotiate_us += c["negotiate_us"]
                total += c["negotiate_us"]
                rounds += min(c["negotiate_us"], round_us)
            late = joined[last] - min(joined.values())
            others_queue = min(c["queue_us"] for r, c in rows.items() if r != last)
            waits = ranks[last]
            waits.last += 1
            waits.late_us += late
            waits.late_queue_us += min(late, max(0.0, rows[last]["queue_us"] - others_queue))
        return Waits(len(matched), total, rounds, [ranks[r] for r in sorted(ranks)])

    def _fusion(self) -> Fusion:
        settings = self.job.get("settings", {})
        threshold = int(settings.get("fusion_threshold", 0))
        per_step, tensors, fused_bytes, count = [], [], [], 0
        for rank in self.ranks:
            per_step += [s["messages"] for s in self.steady(list(schema.records(rank, "steps")))]
            for c in self.steady_collectives(rank):
                count += 1
                tensors.append(c["tensors"])
                if c["tensors"] > 1:
                    fused_bytes.append(c["bytes"])
        hits = sum(r.get("engine", {}).get("fusion_buffer_hits", 0) for r in self.ranks)
        misses = sum(r.get("engine", {}).get("fusion_buffer_misses", 0) for r in self.ranks)
        fill = statistics.fmean(fused_bytes) / threshold if fused_bytes and threshold else None
        return Fusion(
            messages_per_step=float(statistics.median(per_step)) if per_step else 0.0,
            tensors_per_message=statistics.fmean(tensors) if tensors else 0.0,
            fused_share=len(fused_bytes) / count if count else 0.0,
            fill=fill, max_fill=max(fused_bytes) / threshold if fused_bytes and threshold else None,
            reuse=hits / (hits + misses) if hits + misses else None, threshold=threshold,
            autotuned=bool(settings.get("autotune")))

    def latency_points(self) -> List[Tuple[int, float, Optional[float], str]]:
        """(bytes, mean backend latency µs, bus bandwidth GB/s, kind) per distinct message, for plots."""
        return [(row.nbytes, row.mean_us, row.busbw_gbps, row.kind) for row in self.by_message]
