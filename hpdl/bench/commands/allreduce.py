"""`hpdl bench allreduce`: OSU-style allreduce latency and bandwidth, inside the current job."""

from __future__ import annotations

import argparse
import json

from hpdl.bench.commands.common import size_option


def register(sub) -> None:
    p = sub.add_parser(
        "allreduce",
        help="OSU-style allreduce latency and bandwidth per message size",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Allreduce latency and bandwidth per message size, following osu_allreduce: sizes\n"
            "doubling from --min-size, warm-up and timed iterations per size (more below 8 KiB),\n"
            "each call timed alone and followed by a barrier; Avg/Min/Max are over ranks of each\n"
            "rank's average; algbw = size/time, busbw = algbw*2(p-1)/p (nccl-tests).\n\n"
            "example:\n  hpdl run -np 2 -- hpdl bench allreduce --paths backend,mpi4py --rounds 5"
        ),
    )
    p.add_argument("--min-size", default="4", help="smallest message, e.g. 4, 1K (default 4 B)")
    p.add_argument("--max-size", default="64M", help="largest message, e.g. 1M, 64M (default 64 MiB)")
    p.add_argument("--dtype", default="float32", help="element type: float32 (default), float64, float16, bfloat16, int32, int64, uint8")
    p.add_argument("--iterations", type=int, default=1000, help="timed iterations up to 8 KiB (default 1000)")
    p.add_argument("--iterations-large", type=int, default=100, help="timed iterations above 8 KiB (default 100)")
    p.add_argument("--warmup", type=int, default=100, help="warm-up iterations up to 8 KiB (default 100)")
    p.add_argument("--warmup-large", type=int, default=10, help="warm-up iterations above 8 KiB (default 10)")
    p.add_argument("--paths", default="backend",
                   help="comma-separated paths measured in one run: backend (hpdl's raw backend "
                        "collective), hierarchical (the same within each node, across nodes, then within "
                        "again), engine (hpdl.torch.allreduce through negotiation and fusion), "
                        "mpi4py (raw mpi4py Allreduce on numpy buffers) (default: backend)")
    p.add_argument("--tensors", type=int, default=1,
                   help="tensors of each size reduced per timed call: one after the other on the raw "
                        "paths, submitted together on the engine path (which fuses them) (default 1)")
    p.add_argument("--rounds", type=int, default=None,
                   help="alternating rounds per size, the median is reported (default 1, or 3 with several paths)")
    p.add_argument("--backend", default=None, help="mpi, gloo or nccl (default: from the launcher or HPDL_BACKEND)")
    p.add_argument("--json", action="store_true", help="print the records as JSON instead of tables")
    p.set_defaults(func=run)


def _allreduce_options(args):
    """Build the validated :class:`AllreduceOptions` from the command line (CliError if invalid)."""
    from hpdl.bench.allreduce import AllreduceOptions
    from hpdl.cli_error import CliError

    min_bytes, max_bytes = size_option("--min-size", args.min_size), size_option("--max-size", args.max_size)
    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    rounds = (3 if len(paths) > 1 else 1) if args.rounds is None else args.rounds
    try:
        return AllreduceOptions(
            min_bytes=min_bytes, max_bytes=max_bytes, dtype=args.dtype,
            iterations_small=args.iterations, iterations_large=args.iterations_large,
            warmup_small=args.warmup, warmup_large=args.warmup_large,
            rounds=rounds, paths=paths, tensors=args.tensors,
        )
    except ValueError as err:
        raise CliError(str(err)) from None



def run(args) -> int:
    from hpdl.bench.allreduce import (MessageMemoryError, bandwidth_ratios, build_paths, format_records,
                                      run_allreduce)
    from hpdl.cli_error import CliError

    from hpdl.comm import CommError
    from hpdl.torch.runtime import job_backend, job_communicator

    opts = _allreduce_options(args)
    try:
        name = job_backend(args.backend)  # checked before any rank communicates
        if "mpi4py" in opts.paths and name != "mpi":
            raise CliError(f"the mpi4py path needs the MPI backend, not {name} (launch with mpiexec)")
        comm = job_communicator(args.backend)  # the raw paths' own; the engine, if used, has another
    except (ValueError, CommError) as err:  # settings, backend, a world of the wrong size
        raise CliError(str(err)) from None
    if "engine" in opts.paths:
        import hpdl.torch as hvd

        hvd.init()
    try:
        records = run_allreduce(opts, comm, build_paths(opts.paths, comm))
    except MessageMemoryError as err:  # on every rank alike: rank 0 reports it
        raise CliError(str(err)) from None
    if comm.rank == 0:
        if args.json:
            record = {"benchmark": "allreduce", "ranks": comm.size, "backend": comm.name,
                      "dtype": args.dtype, "records": records}
            ratios = bandwidth_ratios(records)
            if ratios:  # the table's last one, with several paths
                record["bandwidth_ratio"] = ratios
            print(json.dumps(record, indent=1))
        else:
            print(format_records(records, comm.size, comm.describe(), args.dtype))
    comm.barrier()
    if "engine" in opts.paths:
        import hpdl.torch as hvd

        hvd.shutdown()
    return 0
