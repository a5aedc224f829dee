"""Across real (emulated) nodes: the topology is discovered, and hierarchical allreduce through
the API equals the reference for every dtype and op, alone and fused.

Run with HPDL_HIERARCHICAL_ALLREDUCE=1 on 2 nodes x 2 ranks; prints "OK hierarchical nodes".
"""

from __future__ import annotations

import os
import socket
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _common import ALL_DTYPES, assert_equal, rank_tensor, run_main
from torch_api import reduce_ref

import hpdl.torch as hvd
from hpdl.torch import runtime


def check_topology(rank: int, size: int) -> None:
    hosts = hvd.allgather_object(socket.gethostname())
    nodes = list(dict.fromkeys(hosts))
    assert len(nodes) == 2, f"expected 2 nodes, ranks ran on {hosts}"
    node = nodes.index(hosts[rank])
    same = [r for r in range(size) if hosts[r] == hosts[rank]]
    assert (hvd.local_rank(), hvd.local_size()) == (same.index(rank), len(same)), (rank, hosts)
    assert (hvd.cross_rank(), hvd.cross_size()) == (node, len(nodes)), (rank, hosts)
    if rank == 0:
        print(f"topology: {hosts}", flush=True)
        # Peers on another node: the world's allreduces run in flight (polled, over MPI).
        print(f"background collectives: {runtime._require().comm.background_collectives}", flush=True)


def check_allreduce(rank: int, size: int) -> None:
    for dtype in ALL_DTYPES:
        ops = (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product)
        for op in ops:
            seed = 1 + ops.index(op)
            for numel in (1, 7, 1000, 50_001):  # fewer elements than ranks, uneven shards, large
                everyone = [rank_tensor(r, (numel,), dtype, seed) for r in range(size)]
                expected = reduce_ref(everyone, op)
                out = hvd.allreduce(everyone[rank], op=op, name=f"h.{dtype}.{op}.{numel}")
                assert_equal(out, expected, f"hierarchical {dtype} {op} {numel}")
            # Several at once: fused into one buffer, reduced hierarchically as one.
            group = [rank_tensor(rank, (n,), dtype, seed) for n in (3, 64, 5)]
            refs = [reduce_ref([rank_tensor(r, (n,), dtype, seed) for r in range(size)], op) for n in (3, 64, 5)]
            for out, ref in zip(hvd.grouped_allreduce(group, op=op, name=f"g.{dtype}.{op}"), refs):
                assert_equal(out, ref, f"hierarchical fused {dtype} {op}")


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    assert os.environ.get("HPDL_HIERARCHICAL_ALLREDUCE") == "1"
    check_topology(rank, size)
    check_allreduce(rank, size)
    hvd.shutdown()
    if rank == 0:
        print(f"OK hierarchical nodes: size={size}", flush=True)


if __name__ == "__main__":
    run_main(main)
