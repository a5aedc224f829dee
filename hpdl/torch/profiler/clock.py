"""Clock offsets between ranks, estimated with a few ping-pongs through the engine.

Ranks on one host read one clock; across hosts the clocks differ by an offset that would
shift one rank's arrival times against another's. Each round, rank 0 broadcasts its clock
reading (every rank notes ``received - sent`` = offset + latency out) and then every rank's
reading is gathered (rank 0 notes ``received - sent`` = latency back - offset); with the
smallest of each over the rounds (the least delayed exchanges), the offset is half their
difference, as NTP estimates it.
"""

from __future__ import annotations

import dataclasses
import socket
from typing import List

import torch

from hpdl.engine.events import now_us
from hpdl.torch import runtime
from hpdl.torch.mpi_ops import allgather, broadcast_
from hpdl.torch.object_ops import allgather_object

ROUNDS = 8


@dataclasses.dataclass(frozen=True)
class JobClock:
    """The job's time origin (rank 0's clock, µs since the epoch) and each rank's offset to it."""

    origin_us: float
    offsets_us: List[float]
    hosts: List[str]

    def applied_offset(self, rank: int) -> float:
        """The offset to subtract from ``rank``'s clock: 0 on rank 0's host, which shares its clock."""
        return self.offsets_us[rank] if self.hosts[rank] != self.hosts[0] else 0.0


def estimate(rounds: int = ROUNDS) -> JobClock:
    """Measure every rank's clock offset to rank 0 (a collective: every rank must call it)."""
    rank, size = runtime.rank(), runtime.size()
    hosts = allgather_object(socket.gethostname(), name="hpdl.profile.hosts")
    out_delays: List[float] = []
    back_delays: List[List[float]] = [[] for _ in range(size)]
    origin = 0.0
    for i in range(rounds):
        sent = torch.tensor([now_us()], dtype=torch.float64)
        broadcast_(sent, root_rank=0, name=f"hpdl.profile.clock.{i}.out")
        out_delays.append(now_us() - sent.item())
        origin = origin or sent.item()
        readings = allgather(torch.tensor([now_us()], dtype=torch.float64), name=f"hpdl.profile.clock.{i}.back")
        received = now_us()
        for r, reading in enumerate(readings.tolist()):
            back_delays[r].append(received - reading)
    # Only rank 0's return delays mean anything: it shares them.
    back = torch.tensor([min(d) for d in back_delays], dtype=torch.float64)
    broadcast_(back, root_rank=0, name="hpdl.profile.clock.back")
    mine = 0.0 if rank == 0 else (min(out_delays) - back[rank].item()) / 2
    offsets = allgather(torch.tensor([mine], dtype=torch.float64), name="hpdl.profile.clock.offsets").tolist()
    return JobClock(origin, offsets, list(hosts))
