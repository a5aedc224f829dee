"""Time of a spatial group's own communication on the healthy path: one halo exchange of a strip
with the neighbour, and one sum of a small vector over the group (batch norm's statistics).

The spatial group's waits check, between their polls, whether the engine has stopped and how
long they have waited (hpdl/torch/spatial/comm.py); this measures that the check costs the
healthy path nothing. Every rank exchanges a strip with the next and the previous rank (in a
ring: two peers from 3 ranks on), as row bands do.

Usage (docs/spatial.md quotes the figures; run it on the code before and after a change):
    mpiexec -n 2 python scripts/measure_halo_exchange.py [--size-kib 64] [--calls 200] [--rounds 5]
    torchrun --nproc-per-node 2 --standalone scripts/measure_halo_exchange.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import List, Optional

import torch

import hpdl.torch as hvd
from hpdl.torch.spatial.comm import group_communicator


def per_call_us(call, calls: int) -> float:
    """The median of ``calls`` timed calls of ``call()``, in microseconds (after a barrier)."""
    hvd.allreduce(torch.zeros(1), name="measure.barrier")
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-kib", type=int, default=64, help="strip size (default: 64 KiB, float32)")
    parser.add_argument("--calls", type=int, default=200, help="calls per round (their median is the round's)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (the median of their medians is reported)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    hvd.init()
    group = group_communicator(hvd.global_process_set)
    peers = sorted({(group.rank + 1) % group.size, (group.rank - 1) % group.size} - {group.rank})
    strip = torch.randn(args.size_kib * 1024 // 4)
    sends = [(peer, strip) for peer in peers]
    receives = [(peer, torch.empty_like(strip)) for peer in peers]
    statistics_vector = torch.randn(64, dtype=torch.float64)

    def exchange() -> None:
        group.exchange(sends, receives, "measure.halo")

    def allreduce() -> None:
        group.allreduce_sum(statistics_vector.clone(), "measure.sum")

    for what, call in ((f"halo exchange of {args.size_kib} KiB", exchange), ("allreduce_sum of 64 float64", allreduce)):
        per_round = [per_call_us(call, args.calls) for _ in range(args.rounds)]
        if hvd.rank() == 0:
            print(f"{what} on {hvd.size()} ranks ({group.comm.name}): median {statistics.median(per_round):.1f} us "
                  f"per call (rounds {min(per_round):.1f}-{max(per_round):.1f}; {args.rounds} rounds of "
                  f"{args.calls} calls)", flush=True)
    group.close()
    hvd.shutdown()


if __name__ == "__main__":
    main()
