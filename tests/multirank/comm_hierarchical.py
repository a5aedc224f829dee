"""Hierarchical allreduce equals the flat one, on fake node layouts (hosts given explicitly)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import assert_equal, rank_tensor, run_main

from hpdl.comm import ReduceOp, choose_backend, create_world, discover_topology
from hpdl.comm.hierarchical import HierarchicalCommunicator
from hpdl.comm.mpi import mpi_available


def main():
    topo = discover_topology()
    comm = create_world(choose_backend("auto", topo, mpi_available()), topo, timeout_s=60)
    rank, size = comm.rank, comm.size
    layouts = {
        "homogeneous": [f"node{r // 2}" for r in range(size)],          # 2 ranks per node
        "heterogeneous": ["node0"] + ["node1"] * (size - 1),            # 1 + (size-1)
        "one-node": ["node0"] * size,
    }
    for label, hosts in layouts.items():
        hier = HierarchicalCommunicator(comm, hosts)
        for dtype in (torch.float32, torch.float64, torch.int32, torch.bfloat16):
            for op in (ReduceOp.SUM, ReduceOp.MAX):
                for numel in (1, 7, 1000):
                    mine = rank_tensor(rank, (numel,), dtype, seed=numel)
                    expected = rank_tensor(0, (numel,), dtype, seed=numel)
                    for r in range(1, size):
                        other = rank_tensor(r, (numel,), dtype, seed=numel)
                        expected = expected + other if op == ReduceOp.SUM else torch.maximum(expected, other)
                    hier.allreduce(mine, op)
                    assert_equal(mine, expected, f"hierarchical {label} {dtype} {op.value} {numel}")
        hier.close()
    comm.barrier()
    if rank == 0:
        print(f"OK hierarchical allreduce: size={size}")


if __name__ == "__main__":
    run_main(main)
