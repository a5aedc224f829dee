"""Named fabrics for ``--network``: each one's bandwidth and latency, with where the figures come from.

Every bandwidth is *per direction*: what one rank (a GPU, or the node's NIC) can send while it
receives as much at the same time. The allreduce formulas' beta is the inverse of that figure,
because in every step of a ring or tree each rank sends and receives at once; a vendor's
"bidirectional" or "total" figure is twice it. Figures are the signalling peaks after line
coding; what a library reaches (nccl-tests' bus bandwidth) is lower, often 70-90 % of them, so
a prediction from a preset is an upper bound on speed. A measured curve
(``LEVEL=measured:FILE``, curves.py) replaces both figures with what the fabric really did.

Latency is the alpha of the formulas: the cost of one message, paid once per step. For the GPU
fabrics it is the per-step hardware latency of NCCL's own cost model (NVIDIA/nccl,
src/graph/tuning.cc as of 2020, ``hwLat``, Ring with the LL protocol, which NCCL uses for the small
messages where latency matters): NVLink 0.47 us, PCIe 1.0 us, network (InfiniBand) 2.7 us.
NCCL adds a fixed base of about 3.6 us per call, which these models leave out. All latencies are
approximate: they depend on the library, its protocol and the message size.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Mapping

__all__ = ["Preset", "PRESETS", "INTRA", "INTER", "markdown_table"]

# The levels of a network (network.py): among the ranks of one node, and between nodes.
INTRA = "intra"
INTER = "inter"

_GB = 1e9  # decimal units, as vendors, IEEE/IBTA and nccl-tests state bandwidth
_US = 1e-6


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named fabric: its level when named alone, bytes/s per direction, seconds per message."""

    name: str
    level: str  # the level a bare name fills: intra (inside a node) or inter (between nodes)
    bandwidth: float  # bytes per second, per direction
    latency: float  # seconds per message (alpha)
    source: str  # where both figures come from, in one line


def _presets(*presets: Preset) -> Mapping[str, Preset]:
    # Read-only: the table is the module's only data, and no caller may change it for the others.
    return types.MappingProxyType({p.name: p for p in presets})


PRESETS: Mapping[str, Preset] = _presets(
    # NVLink 2.0 on a V100 SXM2 (DGX-1V, "300 GB/s" in NVIDIA's V100 datasheet): 6 links x 25 GB/s
    # per direction = 150 GB/s per direction, 300 GB/s counting both. The ring's beta is per
    # direction, and NCCL lays its rings over all six links, so 150 GB/s is the ceiling of a GPU's
    # ring; on a DGX-1's hybrid cube-mesh a GPU links directly to 4 of the 7 others, so measured
    # bus bandwidth is lower.
    Preset("nvlink2", INTRA, 150 * _GB, 0.47 * _US,
           "NVIDIA Tesla V100 (SXM2): 6 NVLink 2.0 links x 25 GB/s per direction; "
           "latency: NCCL tuning.cc hwLat NVLink, Ring/LL"),
    # PCIe 3.0 x16: 8 GT/s per lane, 128b/130b coding -> 0.985 GB/s per lane per direction, x16.
    Preset("pcie3", INTRA, 8e9 * 128 / 130 / 8 * 16, 1.0 * _US,
           "PCI-SIG PCIe 3.0: 8 GT/s x 16 lanes, 128b/130b = 15.75 GB/s per direction; "
           "latency: NCCL tuning.cc hwLat PCI, Ring/LL"),
    # Ranks of one host through memory (MPI shared memory, gloo over loopback), from hpdl's own
    # measurement on this project's 2-core machine (docs/perf.md, "Allreduce latency and
    # bandwidth, one node", 2026-11-22, MPICH, 2 ranks): a lone 16 MiB raw-backend allreduce in
    # 5663 us is 2.96 GB/s of bus bandwidth; a lone 4 KiB mpi4py allreduce in 13 us is two ring
    # steps of about 6 us. A larger host copies faster; measure it (measured:FILE).
    Preset("shm", INTRA, 3 * _GB, 6 * _US,
           "hpdl bench allreduce, 2 ranks, MPICH shared memory, a 2-core machine: 16 MiB at 2.96 GB/s "
           "bus bandwidth, 4 KiB in 13 us = 2 steps (docs/perf.md, 2026-11-22)"),
    # InfiniBand EDR 4x: 4 lanes x 25.78125 Gbaud, 64b/66b -> 100 Gbit/s of data per direction.
    Preset("ib-edr", INTER, 100e9 / 8, 2.7 * _US,
           "IBTA EDR 4x: 100 Gbit/s per direction = 12.5 GB/s; latency: NCCL tuning.cc hwLat NET, Ring/LL"),
    # InfiniBand HDR 4x (ConnectX-6): 200 Gbit/s per direction.
    Preset("ib-hdr", INTER, 200e9 / 8, 2.7 * _US,
           "IBTA HDR 4x: 200 Gbit/s per direction = 25 GB/s; latency: NCCL tuning.cc hwLat NET, Ring/LL"),
    # Ethernet line rates (IEEE 802.3ae, 802.3by, 802.3ba); TCP/IP headers leave about 94 % of
    # them to data. The latency is an estimate, not a published figure: a small TCP message
    # through two kernels' stacks and a switch costs tens of microseconds, far more than the
    # wire; RDMA over Converged Ethernet is closer to the InfiniBand presets.
    Preset("10gbe", INTER, 10e9 / 8, 25 * _US,
           "IEEE 802.3ae 10 Gbit/s = 1.25 GB/s per direction; latency: estimate for TCP through the kernel"),
    Preset("25gbe", INTER, 25e9 / 8, 25 * _US,
           "IEEE 802.3by 25 Gbit/s = 3.125 GB/s per direction; latency: estimate for TCP through the kernel"),
    Preset("100gbe", INTER, 100e9 / 8, 25 * _US,
           "IEEE 802.3ba 100 Gbit/s = 12.5 GB/s per direction; latency: estimate for TCP through the kernel"),
)


def markdown_table() -> str:
    """The presets as docs/predict.md shows them (a test keeps the two the same)."""
    rows = ["| preset | level | bandwidth per direction | latency | source |", "|---|---|---|---|---|"]
    for p in PRESETS.values():
        rows.append(f"| `{p.name}` | {p.level} | {p.bandwidth / _GB:.4g} GB/s | {p.latency / _US:.3g} us "
                    f"| {p.source} |")
    return "\n".join(rows)
