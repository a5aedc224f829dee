"""The engine on CUDA tensors (tests/test_gpu.py): every collective on this rank's GPU against a
reference computed on the CPU, fusion through the CUDA fusion buffer, a CPU tensor beside them,
a caller on a side stream, and a joined rank's zeros. Prints "OK gpu engine: backend=... gpu=...".

Usage: gpu_engine.py [--device cuda|cpu] (under torchrun, one rank per GPU over nccl, or several
sharing one over gloo; on the CPU, which has no streams, it checks the same references)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import assert_equal, device_arg, rank_device, rank_tensor, run_main

import hpdl.torch as hvd
from hpdl.torch import runtime

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.int16,
          torch.uint8, torch.bool]


def summed(shape, dtype, size, seed=0):
    parts = [rank_tensor(r, shape, dtype, seed) for r in range(size)]
    if dtype == torch.bool:
        return torch.stack(parts).any(0)
    out = parts[0].clone()
    for part in parts[1:]:
        out = out + part
    return out.to(dtype)


def check_allreduce(device, rank, size):
    for dtype in DTYPES:
        mine = rank_tensor(rank, (5, 3), dtype).to(device)
        out = hvd.allreduce(mine, op=hvd.Sum, name=f"gpu.sum.{dtype}")
        assert out.device == device, f"allreduce of {dtype} came back on {out.device}"
        assert_equal(out.cpu(), summed((5, 3), dtype, size), f"allreduce sum {dtype}")
    # Twenty small tensors at once: fused through the fusion buffer on this GPU.
    handles = [hvd.allreduce_async(rank_tensor(rank, (7, 2), torch.float32, seed=i).to(device), name=f"gpu.fused.{i}")
               for i in range(20)]
    for i, handle in enumerate(handles):
        assert_equal(hvd.synchronize(handle).cpu(), summed((7, 2), torch.float32, size, seed=i) / size,
                     f"fused average {i}")
    # A tensor above the in-place threshold (1 MiB): reduced where it lies.
    big = torch.full((400_000,), float(rank + 1), device=device)
    hvd.allreduce_(big, op=hvd.Sum, name="gpu.inplace")
    assert bool((big == size * (size + 1) / 2).all()), "in-place allreduce of a large tensor"
    # A CPU tensor beside them (under nccl it travels over gloo).
    assert_equal(hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Max, name="gpu.cpu-beside"),
                 torch.tensor([float(size - 1)]), "a CPU tensor's allreduce")


def check_other_collectives(device, rank, size):
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.int16):
        parts = [rank_tensor(r, (r + 1, 3), dtype) for r in range(size)]
        gathered = hvd.allgather(parts[rank].to(device), name=f"gpu.allgather.{dtype}")
        assert_equal(gathered.cpu(), torch.cat(parts), f"allgather {dtype}")
        root = size - 1
        sent = rank_tensor(root, (4,), dtype, seed=5)
        got = hvd.broadcast(rank_tensor(rank, (4,), dtype, seed=5).to(device), root, name=f"gpu.broadcast.{dtype}")
        assert_equal(got.cpu(), sent, f"broadcast {dtype}")
        rows = [rank_tensor(r, (size * 2, 2), dtype, seed=9) for r in range(size)]
        out, received = hvd.alltoall(rows[rank].to(device), splits=[2] * size, name=f"gpu.alltoall.{dtype}")
        expected = torch.cat([rows[r][rank * 2:(rank + 1) * 2] for r in range(size)])
        assert_equal(out.cpu(), expected, f"alltoall {dtype}")
        assert received.tolist() == [2] * size
        full = [rank_tensor(r, (size * 3, 2), dtype, seed=11) for r in range(size)]
        total = summed((size * 3, 2), dtype, size, seed=11)
        scattered = hvd.reducescatter(full[rank].to(device), op=hvd.Sum, name=f"gpu.reducescatter.{dtype}")
        assert_equal(scattered.cpu(), total[rank * 3:(rank + 1) * 3], f"reducescatter {dtype}")


def check_side_stream(device, rank, size):
    # The caller computes on a stream of its own, slowly: the engine must read the tensor only
    # after it is written, and the caller read the result only after the engine wrote it.
    stream = torch.cuda.Stream(device)
    data = torch.zeros(1 << 20, device=device)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)  # tens of milliseconds of GPU time before the write
        data.fill_(float(rank + 1))
        result = hvd.allreduce(data, op=hvd.Sum, name="gpu.side-stream")
        doubled = result * 2  # queued on the side stream, after the engine's writes
    torch.cuda.synchronize(device)
    expected = size * (size + 1)
    assert bool((doubled == expected).all()), f"side stream: got {doubled[:4].tolist()}, expected {expected}"


def check_join(device, rank, size):
    # The last rank reduces one more tensor than the others, who have joined: their zeros go to
    # their own GPU, where the other tensors of the batch are.
    if rank == size - 1:
        extra = torch.full((3,), 5.0, device=device)
        assert_equal(hvd.allreduce(extra, op=hvd.Sum, name="gpu.after-join").cpu(), torch.full((3,), 5.0),
                     "an allreduce that the other ranks joined")
    assert hvd.join() == size - 1


def main() -> None:
    device_name = "cuda" if "--device" not in sys.argv else device_arg(sys.argv)
    hvd.init()
    device = rank_device(device_name)
    rank, size = hvd.rank(), hvd.size()
    check_allreduce(device, rank, size)
    check_other_collectives(device, rank, size)
    if device.type == "cuda":
        check_side_stream(device, rank, size)
    check_join(device, rank, size)
    backend = runtime.backend_name()
    hvd.shutdown()
    if rank == 0:
        print(f"OK gpu engine: backend={backend} size={size} device={device}", flush=True)


if __name__ == "__main__":
    run_main(main)
