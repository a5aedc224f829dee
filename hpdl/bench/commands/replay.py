"""`hpdl bench replay`: a profile's communication pattern run for real through the engine."""

from __future__ import annotations

import argparse
import json


def register(sub) -> None:
    p = sub.add_parser(
        "replay",
        help="a profile's communication run for real through the engine, its compute slept (validates "
             "hpdl profile predict)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Replay the steps of PROFILE (those hpdl profile predict reads, in turn) in the current job: at each\n"
            "gradient's recorded moment in backward, a tensor of its bytes goes to the real engine\n"
            "(allreduce_async_: negotiation, fusion, the backend); the rest of backward and the update are\n"
            "slept, and the optimizer's wait for the gradients is real. Sleeping costs no CPU, so 4-8 ranks fit\n"
            "on 2 cores, on one node or across hpdl emulate nodes. A step's time is the mean over the ranks;\n"
            "the median over --steps timed steps is reported, with the median wait after backward. The engine runs\n"
            "with the job's settings; a note says where they differ from the profile's.\n\n"
            "examples:\n"
            "  hpdl run -np 4 -- hpdl bench replay p.json --steps 10\n"
            "  hpdl emulate --nodes 2 --slots 2 --rate 1gbit --delay 1ms -- hpdl run -np 4 -- hpdl bench replay p.json --json"
        ),
    )
    p.add_argument("profile", metavar="PROFILE", help="a profile written by hpdl run --profile (schema 3 or later)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--fp16", action="store_true", help="the gradients as float16: half the bytes, as "
                                                       "hpdl profile predict's --what-if fp16")
    p.add_argument("--compute-scale", type=float, default=1.0, metavar="X",
                   help="sleep X times each recorded compute time (default 1)")
    p.add_argument("--batch-size", type=int, default=None, help="images per rank per step, to report img/s")
    p.add_argument("--json", action="store_true", help="print the record as JSON instead of text")
    p.set_defaults(func=run)


def run(args) -> int:
    from hpdl.bench.replay import ReplayOptions, format_record, run_replay
    from hpdl.cli_error import CliError
    from hpdl.profile.predict.predictor import step_shapes
    from hpdl.profile.schema import UNUSABLE, ProfileError, load, unusable

    try:  # every rank reads and checks the same file before any meets the others
        opts = ReplayOptions(steps=args.steps, warmup=args.warmup, fp16=args.fp16,
                             compute_scale=args.compute_scale, batch_size=args.batch_size)
        profile = load(args.profile)
    except (ValueError, ProfileError) as err:
        raise CliError(str(err)) from None
    try:
        shapes, recorded = step_shapes(profile, args.profile)
    except ValueError as err:  # PredictError (a ValueError) names the file and what it lacks
        raise CliError(str(err)) from None
    except UNUSABLE as err:
        raise CliError(unusable(args.profile, err)) from None
    record = run_replay(args.profile, shapes, recorded, opts)
    if record is not None:
        print(json.dumps(record, indent=1) if args.json else format_record(record))
    return 0
