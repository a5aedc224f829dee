"""`hpdl bench scaling`: a driver that starts a job per rank count and plots the scaling."""

from __future__ import annotations

import argparse
import json
import os

from hpdl.bench.commands.common import run_keeping_partial


def register(sub) -> None:
    from hpdl.bench.scaling import SYSTEMS

    p = sub.add_parser(
        "scaling",
        help="img/s and scaling efficiency against the number of ranks, hpdl against DDP (starts the jobs)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run `hpdl bench synthetic` at each rank count of --ranks for each system of --systems, in\n"
            "alternating repeats, each job started with `hpdl run`; print img/s and scaling efficiency\n"
            "(against N x the 1-rank figure and against the no-communication ceiling measured in the\n"
            "same job), write the record as JSON and a plot as PNG. Run it from a shell, not under a\n"
            "launcher. On several hosts (-H, or HPDL_HOSTFILE, which `hpdl emulate` sets) the ranks\n"
            "are spread evenly over them.\n\n"
            f"systems: {', '.join(SYSTEMS)}\n\n"
            "examples:\n"
            "  hpdl bench scaling --model edsr-baseline --batch-size 4 --ranks 1,2\n"
            "  hpdl emulate --nodes 2 --rate 1gbit -- hpdl bench scaling --model edsr --batch-size 1 --patch 24 \\\n"
            "      --systems hpdl,hpdl-fp16,ddp,ddp-fp16 --ranks 1,2"
        ),
    )
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts (default 1,2)")
    p.add_argument("--systems", default="hpdl,ddp", help="comma-separated systems (default hpdl,ddp)")
    p.add_argument("--repeats", type=int, default=3, help="alternating repeats of every point (default 3)")
    p.add_argument("-H", "--hosts", default=None, metavar="HOST[:SLOTS],...",
                   help="hosts to spread the ranks over (default: HPDL_HOSTFILE's, else this host)")
    p.add_argument("--json", default="scaling.json", metavar="FILE",
                   help="record to write (default scaling.json); a study that ends early (a job failed, Ctrl-C, "
                        "SIGTERM) writes the runs done so far to it, marked \"complete\": false")
    p.add_argument("--plot", default="scaling.png", metavar="FILE",
                   help="plot to write, PNG unless its extension names another format matplotlib writes "
                        "(default scaling.png)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the --json and --plot files if they exist (also the defaults: a second run in "
                        "the same directory needs it)")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                   help="seconds a job may take before it is ended (default 1800, at most a year)")
    synthetic = p.add_argument_group("passed to every `hpdl bench synthetic` job")
    for flag, kind, default in (("--model", str, "edsr-baseline"), ("--batch-size", int, None), ("--patch", int, None),
                                ("--scale", int, None), ("--num-warmup", int, None), ("--num-iters", int, None),
                                ("--num-batches-per-iter", int, None), ("--threads", int, None),
                                ("--optimizer", str, None), ("--device", str, None), ("--amp", str, None)):
        synthetic.add_argument(flag, type=kind, default=default, help="(default: the synthetic benchmark's)"
                               if default is None else f"(default {default})")
    p.set_defaults(func=run)


def run(args) -> int:
    from hpdl.bench.jobs import plot_format
    from hpdl.bench.scaling import ScalingError, ScalingOptions, ScalingStopped, format_summary, plot, run_scaling
    from hpdl.cli_error import CliError
    from hpdl.launch.hosts import LaunchError, parse_hosts, read_hostfile
    from hpdl.output_files import OutputRule

    try:
        ranks = tuple(int(r) for r in args.ranks.split(","))
    except ValueError:
        raise CliError(f"--ranks takes comma-separated integers, got {args.ranks!r}") from None
    synthetic = []
    for name in ("model", "batch_size", "patch", "scale", "num_warmup", "num_iters", "num_batches_per_iter",
                 "threads", "optimizer", "device", "amp"):
        value = getattr(args, name)
        if value is not None:
            synthetic += [f"--{name.replace('_', '-')}", str(value)]
    try:
        hosts = (parse_hosts(args.hosts) if args.hosts
                 else read_hostfile(os.environ["HPDL_HOSTFILE"]) if os.environ.get("HPDL_HOSTFILE") else None)
        opts = ScalingOptions(ranks=ranks, systems=tuple(s.strip() for s in args.systems.split(",") if s.strip()),
                              repeats=args.repeats, hosts=tuple((h.name, h.slots) for h in hosts.hosts) if hosts else None,
                              synthetic_args=tuple(synthetic), timeout_s=args.timeout)
        # Both outputs are checked before the study's minutes of jobs, not after them.
        outputs = OutputRule(overwrite=args.overwrite, make_directories=False)
        outputs.refuse(args.json, "--json")
        outputs.refuse(args.plot, "--plot")
        if os.path.abspath(args.json) == os.path.abspath(args.plot):
            raise CliError(f"--json and --plot name the same file, {args.json}")
        image_format = plot_format(args.plot)
    except (ValueError, LaunchError) as err:
        raise CliError(str(err)) from None
    record = run_keeping_partial(args, lambda: run_scaling(opts), ScalingError, ScalingStopped)
    print(format_summary(record))
    # Checked again right before each rename: a file made there during the study is not replaced either.
    outputs.write(args.json, lambda f: json.dump(record, f, indent=1), option="--json")
    outputs.write(args.plot, lambda f: plot(record, f, image_format), binary=True, option="--plot")
    print(f"wrote {args.json} and {args.plot}")
    return 0
