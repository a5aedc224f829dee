"""What a profile says of a spatial-parallel job's own communication: the halo exchanges with the
neighbour bands and the spatial groups' collectives (batch norm statistics, global pooling,
gather). They run on the thread that runs the model, outside the engine (no queue, negotiation
or fusion), and the model waits for each: they are not hidden behind compute, so the per-step
figures count their time apart from compute.

Per kind and step: calls, bytes (of a halo exchange, the rows sent and received; of a
collective, its tensor) and time, medians over the steady steps of every rank (a step without
any counts as zero). Per layer (an event's name is the layer's path in the model) and
operation: totals per rank, means over the ranks recorded.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Dict, List, Optional, Sequence

from hpdl.engine.events import GROUP_KINDS, HALO, SPATIAL
from hpdl.profile import schema

KIND_LABELS = {HALO: "halo exchanges", SPATIAL: "group collectives"}


def time_by_step(rank: Dict[str, Any]) -> Dict[int, float]:
    """One rank's spatial communication time per step (every kind), µs."""
    out: Dict[int, float] = {}
    for row in schema.records(rank, "spatial_steps"):
        out[row["step"]] = out.get(row["step"], 0.0) + row["time_us"]
    return out


@dataclasses.dataclass
class KindStats:
    """One kind's figures per step (medians) or, without steps, per rank (totals, ``steps`` 0)."""

    kind: str
    steps: int
    calls: float
    nbytes: float
    time_us: float

    @property
    def label(self) -> str:
        return KIND_LABELS.get(self.kind, self.kind)


@dataclasses.dataclass
class LayerRow:
    """One layer's communication of one operation, totals per rank."""

    kind: str
    name: str
    op: str
    calls: float = 0.0
    volume: float = 0.0  # bytes of all calls
    time_us: float = 0.0
    share: float = 0.0  # of all spatial communication time

    @property
    def label(self) -> str:
        return self.name or "(unnamed)"

    @property
    def bytes_per_call(self) -> float:
        return self.volume / self.calls if self.calls else 0.0

    @property
    def mean_us(self) -> float:
        return self.time_us / self.calls if self.calls else 0.0


class SpatialCommunication:
    """The spatial groups' communication of a profile's ranks.

    Args:
        ranks: the profile's rank objects.
        steady_steps: per rank, the numbers of its steps after start-up (as the per-step table
            takes them); empty lists where no step was recorded.
    """

    def __init__(self, ranks: Sequence[Dict[str, Any]], steady_steps: Sequence[Sequence[int]]):
        self.ranks = list(ranks)
        self.layers = self._layers()
        self.total_us = sum(row.time_us for row in self.layers)
        for row in self.layers:
            row.share = row.time_us / self.total_us if self.total_us else 0.0
        self.layers_folded = max((r.get("layers_folded", 0) for r in self.ranks), default=0)
        self.kinds = self._kinds(steady_steps)

    @property
    def present(self) -> bool:
        """Whether any rank recorded spatial communication."""
        return bool(self.layers)

    @property
    def per_step(self) -> bool:
        """Whether the kinds' figures are per step (else totals per rank: no steps were marked)."""
        return bool(self.kinds) and self.kinds[0].steps > 0

    def _layers(self) -> List[LayerRow]:
        rows: Dict[tuple, LayerRow] = {}
        n = len(self.ranks)
        for rank in self.ranks:
            names = rank["tensors"]
            for t in schema.records(rank, "spatial_layers"):
                name = names[t["name"]] if 0 <= t["name"] < len(names) else f"#{t['name']}"
                row = rows.setdefault((t["kind"], name, t["op"]), LayerRow(t["kind"], name, t["op"]))
                row.calls += t["calls"] / n
                row.volume += t["bytes"] * t["calls"] / n
                row.time_us += t["time_us"] / n
        return sorted(rows.values(), key=lambda r: -r.time_us)

    def _kinds(self, steady_steps: Sequence[Sequence[int]]) -> List[KindStats]:
        kinds = [k for k in GROUP_KINDS if any(row.kind == k for row in self.layers)]
        kinds += sorted({row.kind for row in self.layers} - set(kinds))
        if not any(steady_steps):  # no steps marked: totals per rank
            return [KindStats(k, 0, sum(r.calls for r in self.layers if r.kind == k),
                              sum(r.volume for r in self.layers if r.kind == k),
                              sum(r.time_us for r in self.layers if r.kind == k)) for k in kinds]
        out = []
        for kind in kinds:
            calls, nbytes, times = [], [], []
            for rank, steps in zip(self.ranks, steady_steps):
                recorded = {row["step"]: row for row in schema.records(rank, "spatial_steps") if row["kind"] == kind}
                for step in steps:
                    row = recorded.get(step)
                    calls.append(row["calls"] if row else 0)
                    nbytes.append(row["bytes"] if row else 0)
                    times.append(row["time_us"] if row else 0.0)
            out.append(KindStats(kind, len(times), _median(calls), _median(nbytes), _median(times)))
        return out

    def kind(self, kind: str) -> Optional[KindStats]:
        return next((k for k in self.kinds if k.kind == kind), None)


def _median(values: List[float]) -> float:
    return float(statistics.median(values)) if values else 0.0
