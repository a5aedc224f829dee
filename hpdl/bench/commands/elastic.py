"""`hpdl bench elastic`: the cost of an elastic job's resets."""

from __future__ import annotations

import argparse
import json

from hpdl.bench.commands.common import run_keeping_partial


def register(sub) -> None:
    p = sub.add_parser(
        "elastic",
        help="elastic jobs: from a worker's death, and from a host's appearance, to the new world's first step, "
             "phase by phase (starts the jobs)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "For each --model and --workers N, start one elastic job (`hpdl run -np N --min-np N-1 --max-np N\n"
            "--host-discovery-script ...`) on this machine's names as hosts (localhost, 127.0.0.1, 127.0.0.2, ...,\n"
            "one slot each), training the model on one batch of one tiny LR patch per step (CPU, one thread per\n"
            "worker), a commit after every step. Each round: SIGKILL the worker of the highest rank, time the\n"
            "death -> the first step of the world of N-1 ended; then make the discovery script list a new host,\n"
            "time its appearance -> the first step of the world of N ended. Run it from a shell, not under a\n"
            "launcher.\n\n"
            "The workers log when each phase begins (time.time(), the clock the benchmark stamps the death and\n"
            "the host with); a phase ends when the last worker of the new world has passed it, so the phases\n"
            "add up to the total. After a death: detect (the survivors' collectives raise HorovodInternalError),\n"
            "restore (the last commit), shutdown, wait (for the driver's next generation and all its members),\n"
            "init (the process group, the engine), sync (rank 0's state broadcast), first_step. After a host\n"
            "appears: discover (the driver runs the script every --discovery-interval and publishes the\n"
            "generation), notice (the survivors' next commit raises HostsUpdatedInterrupt), shutdown, wait\n"
            "(mostly for the new worker: its interpreter, imports, model; shown apart), init, sync, first_step.\n"
            "Prints medians over --rounds per point, one progress line per round and job on stderr; --json\n"
            "writes every round.\n\n"
            "The default run (both models at 2, 4 and 8 workers, 1 round) takes about 4-5 minutes on 2 cores;\n"
            "--rounds 3 about 9 (figures and where the time goes: docs/elastic.md, \"How fast a reset is\").\n\n"
            "examples:\n"
            "  hpdl bench elastic --model edsr-baseline --workers 2\n"
            "  hpdl bench elastic --model edsr-baseline,edsr --workers 2,4,8 --rounds 3 --json elastic.json"
        ),
    )
    from hpdl.sr.registry import model_names

    models = [name.replace("_", "-") for name in model_names()]
    p.add_argument("--model", default="edsr-baseline,edsr",
                   help=f"comma-separated models among {', '.join(models)} (tiny: one convolution, for tests) "
                        "(default edsr-baseline,edsr)")
    p.add_argument("--workers", default="2,4,8", help="comma-separated worker counts, each at least 2 (default 2,4,8)")
    p.add_argument("--rounds", type=int, default=1, help="deaths and host appearances per job; medians are "
                                                         "reported (default 1)")
    p.add_argument("--steps", type=int, default=2, help="steps each world does before the next change (default 2)")
    p.add_argument("--scale", type=int, default=2, help="upscaling factor (default 2)")
    p.add_argument("--patch", type=int, default=8, help="LR patch size in pixels, batch 1 (default 8)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="sgd: the state synced is the parameters; adam: its two moments besides, three times "
                        "as many bytes (default sgd)")
    p.add_argument("--discovery-interval", type=float, default=1.0, metavar="S",
                   help="seconds between the driver's runs of the discovery script, HPDL_ELASTIC_DISCOVERY_INTERVAL "
                        "of the jobs (default 1, Horovod's)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the record, every round, as JSON")
    p.add_argument("--overwrite", action="store_true", help="replace the --json file if it exists")
    p.add_argument("--timeout", type=float, default=900.0, metavar="S",
                   help="seconds a job may take before it is ended (default 900, at most a year)")
    p.set_defaults(func=run)


def run(args) -> int:
    import sys

    from hpdl.bench.elastic import ElasticBenchError, ElasticBenchOptions, ElasticBenchStopped, format_summary, \
        run_elastic_bench
    from hpdl.cli_error import CliError
    from hpdl.output_files import OutputRule

    try:
        workers = tuple(int(w) for w in args.workers.split(","))
    except ValueError:
        raise CliError(f"--workers takes comma-separated integers, got {args.workers!r}") from None
    try:
        opts = ElasticBenchOptions(models=tuple(m.strip() for m in args.model.split(",") if m.strip()),
                                   workers=workers, rounds=args.rounds, steps=args.steps, scale=args.scale,
                                   patch=args.patch, optimizer=args.optimizer,
                                   discovery_interval_s=args.discovery_interval, timeout_s=args.timeout)
        rule = OutputRule(overwrite=args.overwrite, make_directories=False)
        if args.json:  # checked before the jobs' minutes, and again right before the rename
            rule.refuse(args.json, "--json")
    except ValueError as err:
        raise CliError(str(err)) from None

    def progress(line: str) -> None:
        sys.stderr.write(f"hpdl bench elastic: {line}\n")
        sys.stderr.flush()

    record = run_keeping_partial(args, lambda: run_elastic_bench(opts, progress), ElasticBenchError, ElasticBenchStopped)
    print(format_summary(record))
    if args.json:
        rule.write(args.json, lambda f: json.dump(record, f, indent=1), option="--json")
        print(f"wrote {args.json}")
    return 0
