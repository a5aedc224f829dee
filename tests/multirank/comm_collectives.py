"""Every backend collective on every dtype against a single-process reference."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import ALL_DTYPES, assert_equal, rank_tensor, run_main

from hpdl.comm import ReduceOp, choose_backend, create_world, discover_topology, even_split
from hpdl.comm.mpi import mpi_available


def reference_reduce(tensors, op: ReduceOp) -> torch.Tensor:
    dtype = tensors[0].dtype
    if dtype == torch.bool:
        stack = torch.stack(tensors)
        return stack.any(0) if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR) else stack.all(0)
    # Reduce in order, in the tensor's own dtype (pairwise rounding as the backends do).
    out = tensors[0].clone()
    for t in tensors[1:]:
        if op == ReduceOp.SUM:
            out = out + t
        elif op == ReduceOp.PRODUCT:
            out = out * t
        elif op == ReduceOp.MIN:
            out = torch.minimum(out, t)
        elif op == ReduceOp.MAX:
            out = torch.maximum(out, t)
        elif op == ReduceOp.BAND:
            out = out & t
        elif op == ReduceOp.BOR:
            out = out | t
    return out


def interruptible(comm, rank: int, size: int) -> None:
    """With a wait hook (a spatial group's communicator): the same results from the waits that
    call it (non-blocking collectives polled, gloo's transfers waited for on a thread of their
    own); under MPI, a transfer that cannot complete is abandoned when the hook raises, its
    receive cancelled, and the communicator still works."""
    calls = []
    comm.wait_hook = lambda: calls.append(1)
    for dtype in ALL_DTYPES:
        for op in (ReduceOp.SUM, ReduceOp.MAX):
            mine = rank_tensor(rank, (257,), dtype, seed=17)
            t = mine.clone()
            comm.allreduce(t, op)
            assert_equal(t, reference_reduce([rank_tensor(r, (257,), dtype, seed=17) for r in range(size)], op),
                         f"interruptible allreduce {op.value} {dtype}")
        parts = [rank_tensor(r, (r + 1, 3), dtype, seed=19) for r in range(size)]
        assert_equal(comm.allgather(parts[rank]), torch.cat(parts), f"interruptible allgather {dtype}")
        assert_equal(comm.allgather(parts[rank], first_dims=[r + 1 for r in range(size)]), torch.cat(parts),
                     f"interruptible allgather known dims {dtype}")
    # A ring of halo-like transfers: to the next rank, from the previous one.
    strip = rank_tensor(rank, (64, 1024), torch.float32, seed=23)
    landing = torch.empty_like(strip)
    comm.exchange([((rank + 1) % size, strip)], [((rank - 1) % size, landing)])
    assert_equal(landing, rank_tensor((rank - 1) % size, (64, 1024), torch.float32, seed=23), "interruptible exchange")
    if comm.name == "mpi":
        def give_up():
            calls.append(1)
            if len(calls) >= 3:
                raise TimeoutError("given up")

        calls.clear()
        comm.wait_hook = give_up
        abandoned = torch.zeros(4)
        try:
            comm.exchange([], [(rank, abandoned)])  # a message this rank never sends itself
            raise AssertionError("the exchange that cannot complete returned")
        except TimeoutError:
            pass
        assert len(calls) == 3, calls
        comm.wait_hook = None
        landing = torch.zeros(4)
        comm.exchange([(rank, torch.ones(4))], [(rank, landing)])
        assert landing.tolist() == [1.0] * 4 and abandoned.tolist() == [0.0] * 4, (landing, abandoned)
    comm.wait_hook = None


def main() -> None:
    topo = discover_topology()
    backend = choose_backend(os.environ.get("HPDL_BACKEND", "auto"), topo, mpi_available())
    comm = create_world(backend, topo, timeout_s=60)
    rank, size = comm.rank, comm.size
    assert (rank, size) == (topo.rank, topo.size), (rank, size, topo)

    for dtype in ALL_DTYPES:
        ops = [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
        if not dtype.is_floating_point:
            ops += [ReduceOp.BAND, ReduceOp.BOR]
        for op in ops:
            for shape in [(5,), (3, 4), (0,), (1000,)]:
                mine = rank_tensor(rank, shape, dtype, seed=len(op.value) * 13 + ord(op.value[0]))
                expected = reference_reduce([rank_tensor(r, shape, dtype, seed=len(op.value) * 13 + ord(op.value[0])) for r in range(size)], op)
                t = mine.clone()
                comm.allreduce(t, op)
                assert_equal(t, expected, f"allreduce {op.value} {dtype} {shape}")
                # started in the background (gloo's threads; MPI's non-blocking call, which
                # progresses only when polled): the same result once done
                t = mine.clone()
                flight = comm.allreduce_start(t, op)
                if flight.poll_interval_s:
                    while not flight.done():
                        time.sleep(flight.poll_interval_s)
                flight.wait()
                assert_equal(t, expected, f"allreduce_start {op.value} {dtype} {shape}")
                # the control allreduce (the engine's negotiation vectors, the benchmarks'
                # barriers): over gloo, small ones are gathered and reduced on every rank
                t = mine.clone()
                comm.allreduce_control(t, op)
                assert_equal(t, expected, f"allreduce_control {op.value} {dtype} {shape}")

        if dtype.is_floating_point and size > 1:
            # A NaN on one rank: every rank gets NaN from MIN and MAX, as one process (torch.minimum
            # and maximum) and gloo give; MPI's own MIN and MAX left it to the NaN's place in the
            # reduction, and the ranks disagreed.
            for op in (ReduceOp.MIN, ReduceOp.MAX):
                for flavour in ("allreduce", "allreduce_control"):
                    t = torch.tensor([float("nan") if rank == 0 else 1.0, 2.0], dtype=dtype)
                    getattr(comm, flavour)(t, op)
                    assert torch.isnan(t[0]) and t[1].item() == 2.0, f"{flavour} {op.value} {dtype} with a NaN: {t}"

        # allgather with different first dims
        first = [r + 1 for r in range(size)]
        parts = [rank_tensor(r, (first[r], 3), dtype, seed=7) for r in range(size)]
        assert_equal(comm.allgather(parts[rank]), torch.cat(parts), f"allgather {dtype}")
        assert_equal(comm.allgather(parts[rank], first_dims=first), torch.cat(parts), f"allgather known dims {dtype}")

        # broadcast from every root
        for root in range(size):
            t = rank_tensor(rank, (2, 5), dtype, seed=3)
            comm.broadcast(t, root)
            assert_equal(t, rank_tensor(root, (2, 5), dtype, seed=3), f"broadcast root {root} {dtype}")

        # alltoall with splits: rank r sends (r + d) % 3 rows to rank d
        def splits_of(r):
            return [(r + d) % 3 for d in range(size)]

        def payload(r):
            return rank_tensor(r, (sum(splits_of(r)), 2), dtype, seed=11)

        out, recv = comm.alltoall(payload(rank), splits_of(rank))
        expected_parts = []
        for src in range(size):
            offsets = [0] + torch.tensor(splits_of(src)).cumsum(0).tolist()
            expected_parts.append(payload(src)[offsets[rank]: offsets[rank + 1]])
        assert recv == [splits_of(src)[rank] for src in range(size)], recv
        assert_equal(out, torch.cat(expected_parts), f"alltoall {dtype}")

        # reduce-scatter (sum), uneven rows
        rows = 2 * size + 1
        full = [rank_tensor(r, (rows, 3), dtype, seed=5) for r in range(size)]
        reduced = reference_reduce(full, ReduceOp.SUM)
        counts = even_split(rows, size)
        start = sum(counts[:rank])
        assert_equal(comm.reduce_scatter(full[rank].clone()), reduced[start:start + counts[rank]], f"reduce_scatter {dtype}")

    interruptible(comm, rank, size)

    # objects, barrier, sub-groups
    assert comm.allgather_object({"rank": rank}) == [{"rank": r} for r in range(size)]
    assert comm.broadcast_object(("hello", rank), 0) == ("hello", 0)
    comm.barrier()
    sub_ranks = [r for r in range(size) if r % 2 == 0]
    sub = comm.split(sub_ranks)
    if rank in sub_ranks:
        assert sub is not None and sub.size == len(sub_ranks) and sub.rank == sub_ranks.index(rank)
        t = torch.tensor([float(rank)])
        sub.allreduce(t)
        assert t.item() == float(sum(sub_ranks)), t
        sub.barrier()
    else:
        assert sub is None
    # All ranks on this host: MPI's allreduces block (shared memory moves only inside MPI's
    # calls, fastest in a blocking one); gloo's run on its own threads.
    assert comm.background_collectives == (comm.name != "mpi"), (comm.name, comm.background_collectives)
    local_rank, local_size, cross_rank, cross_size = comm.node_layout()
    assert (local_rank, local_size, cross_rank, cross_size) == (rank, size, 0, 1), (local_rank, local_size, cross_rank, cross_size)
    comm.barrier()
    if rank == 0:
        print(f"OK comm collectives: backend={comm.name} size={size}")


if __name__ == "__main__":
    run_main(main)
