"""How fast MPI sums float16 itself (``MPI.FLOAT16_T``, where the library has it) against the
user-defined operation hpdl's MPI backend uses, which sums the raw 16-bit words with torch
(hpdl/comm/mpi.py: ``_mpi_op``). Both must give the same bits.

Usage (docs/perf-notes/edsr-baseline-step.md quotes the figures):
    hpdl run -np 2 -- python scripts/measure_half_reduction.py [--repeats 5] [--sizes-mb 40,2.5,0.125]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from mpi4py import MPI

from hpdl.comm import ReduceOp
from hpdl.comm.mpi import _mpi_op


def best_ms(comm, send, recv, datatype, op, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        comm.Allreduce([send, datatype], [recv, datatype], op=op)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="calls per size and method; the best is shown")
    parser.add_argument("--sizes-mb", default="40,2.5,0.125", help="message sizes in MB, comma-separated")
    args = parser.parse_args()
    try:
        sizes_mb = [float(s) for s in args.sizes_mb.split(",")]
        if not sizes_mb or min(sizes_mb) <= 0:
            raise ValueError
    except ValueError:
        parser.error(f"--sizes-mb: expected positive numbers separated by commas, got {args.sizes_mb!r}")
    comm = MPI.COMM_WORLD
    native = getattr(MPI, "FLOAT16_T", MPI.DATATYPE_NULL)
    if native == MPI.DATATYPE_NULL:
        if comm.rank == 0:
            print(f"{MPI.Get_library_version().splitlines()[0].strip()}: no MPI float16 type; nothing to compare")
        return 0

    hpdl_op = _mpi_op(torch.float16, ReduceOp.SUM)  # the operation the engine's allreduces use
    torch.manual_seed(comm.rank)
    data = torch.randn(max(1, int(max(sizes_mb) * 1e6 / 2))).half()
    out_native, out_torch = torch.empty_like(data), torch.empty_like(data)
    if comm.rank == 0:
        print(f"# {' '.join(MPI.Get_library_version().split()[:3])}, {comm.size} ranks: float16 allreduce (sum), "
              f"best of {args.repeats}")
        print(f"{'MB':>8} {'MPI FLOAT16_T ms':>17} {'torch op ms':>12} {'ratio':>7}")
    for size_mb in sizes_mb:
        n = max(1, int(size_mb * 1e6 / 2))
        send = data[:n].view(torch.int16).numpy()
        t_native = best_ms(comm, send, out_native[:n].view(torch.int16).numpy(), native, MPI.SUM, args.repeats)
        t_torch = best_ms(comm, send, out_torch[:n].view(torch.int16).numpy(), MPI.UINT16_T, hpdl_op, args.repeats)
        if not torch.equal(out_native[:n], out_torch[:n]):
            print(f"rank {comm.rank}: the two sums differ at {size_mb} MB", file=sys.stderr)
            return 1
        if comm.rank == 0:
            # significant digits, not places: a ratio or a time below 0.05 never prints as 0.0
            print(f"{size_mb:8.3f} {t_native:17.3g} {t_torch:12.3g} {t_native / t_torch:7.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
