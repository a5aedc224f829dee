"""`hpdl bench`: registered benchmarks. Each runs inside the current job (start it with
`hpdl run -np N -- hpdl bench ...` or a launcher directly) and prints on rank 0 only."""

from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    """Add ``bench`` and its benchmark subcommands."""
    bench = subparsers.add_parser(
        "bench", help="benchmarks: allreduce (OSU-style), synthetic training throughput",
        description="Benchmarks that run inside a job: start them with `hpdl run -np N -- hpdl bench ...`.",
    )
    sub = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    _register_allreduce(sub)
    bench.set_defaults(func=lambda args: bench.print_help() or 2)


def _register_allreduce(sub) -> None:
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
                        "collective), engine (hpdl.torch.allreduce through negotiation and fusion), "
                        "mpi4py (raw mpi4py Allreduce on numpy buffers) (default: backend)")
    p.add_argument("--rounds", type=int, default=None,
                   help="alternating rounds per size, the median is reported (default 1, or 3 with several paths)")
    p.add_argument("--backend", default=None, help="mpi, gloo or nccl (default: from the launcher or HPDL_BACKEND)")
    p.add_argument("--json", action="store_true", help="print the records as JSON instead of tables")
    p.set_defaults(func=_run_allreduce)


def _run_allreduce(args) -> int:
    from hpdl.bench.allreduce import DTYPES, AllreduceOptions, format_records, run_allreduce, build_paths
    from hpdl.bench.stats import parse_size
    from hpdl.cli import CliError

    try:
        min_bytes, max_bytes = parse_size(args.min_size), parse_size(args.max_size)
    except ValueError as err:
        raise CliError(str(err)) from None
    if args.dtype not in DTYPES:
        raise CliError(f"unknown --dtype {args.dtype!r}; choose from {', '.join(DTYPES)}")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if min(args.iterations, args.iterations_large) < 1:
        raise CliError("--iterations and --iterations-large must be at least 1")
    opts = AllreduceOptions(
        min_bytes=min_bytes, max_bytes=max_bytes, dtype=args.dtype,
        iterations_small=args.iterations, iterations_large=args.iterations_large,
        warmup_small=args.warmup, warmup_large=args.warmup_large,
        rounds=args.rounds or (3 if len(paths) > 1 else 1), paths=tuple(paths),
    )
    comm = _benchmark_communicator(args.backend)
    if "engine" in paths:
        import hpdl.torch as hvd

        hvd.init()
    try:
        factories = build_paths(paths, comm)
    except ValueError as err:
        raise CliError(str(err)) from None
    records = run_allreduce(opts, comm, factories)
    if comm.rank == 0:
        if args.json:
            print(json.dumps({"benchmark": "allreduce", "ranks": comm.size, "backend": comm.name,
                              "dtype": args.dtype, "records": records}, indent=1))
        else:
            print(format_records(records, comm.size, comm.describe(), args.dtype))
    comm.barrier()
    if "engine" in paths:
        import hpdl.torch as hvd

        hvd.shutdown()
    return 0


def _benchmark_communicator(backend):
    """A world communicator of its own for the raw paths (the engine, if used, has another)."""
    from hpdl.comm import choose_backend, create_world, discover_topology
    from hpdl.comm.mpi import mpi_available
    from hpdl.config import Settings

    settings = Settings.from_env(backend=backend)
    topo = discover_topology()
    name = choose_backend(settings.backend, topo, mpi_available())
    if name == "mpi":
        from mpi4py import MPI

        return create_world(name, topo, mpi_comm=MPI.COMM_WORLD.Dup())
    return create_world(name, topo, timeout_s=settings.stall_timeout_s)
