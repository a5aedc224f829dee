"""`hpdl bench`: registered benchmarks. allreduce and synthetic run inside the current job
(start them with `hpdl run -np N -- hpdl bench ...` or a launcher directly) and print on rank 0
only; scaling is a driver that starts such jobs itself."""

from __future__ import annotations

from hpdl.bench.commands import allreduce, elastic, pipeline, replay, scaling, spatial, synthetic


def register(subparsers) -> None:
    """Add ``bench`` and its benchmark subcommands."""
    bench = subparsers.add_parser(
        "bench", help="benchmarks: allreduce (OSU-style), synthetic training throughput, scaling studies, SR data "
                      "pipeline, elastic resets, a profile's communication replayed",
        description="allreduce and synthetic run inside a job: start them with `hpdl run -np N -- hpdl bench ...` "
        "or a launcher, as replay. scaling, spatial and elastic start their jobs themselves: run them from a shell. pipeline "
        "runs in one process.",
    )
    sub = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    allreduce.register(sub)
    synthetic.register(sub)
    scaling.register(sub)
    spatial.register(sub)
    pipeline.register(sub)
    elastic.register(sub)
    replay.register(sub)
    bench.set_defaults(func=lambda args: bench.print_help() or 2)

