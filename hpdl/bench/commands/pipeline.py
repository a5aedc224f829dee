"""`hpdl bench pipeline`: the SR data pipeline against the model's step, in one process."""

from __future__ import annotations

import argparse
import json


def register(sub) -> None:
    p = sub.add_parser(
        "pipeline",
        help="can the SR data pipeline feed training? patches/s delivered against img/s trained (one process)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Measure, in this process, the patches/s that hpdl.sr's training DataLoader delivers\n"
            "(--workers worker processes, random crops and flips of --data) and the img/s that one\n"
            "training thread of --model consumes (forward, L1 loss and backward on random patches of the\n"
            "same size); medians of --repeats timed runs. If the first is not many times the second\n"
            "times the ranks per node, data loading will slow training.\n\n"
            "example:\n  hpdl bench pipeline --data embedded --scale 2"
        ),
    )
    p.add_argument("--data", default="embedded",
                   help="training images: 'embedded' (photos shipped with scikit-image), a folder, or DIV2K (default embedded)")
    p.add_argument("--scale", type=int, default=2, help="upscaling factor (default 2)")
    p.add_argument("--model", default="edsr_baseline", help="model whose training speed to measure (default edsr_baseline)")
    p.add_argument("--patch", type=int, default=48, help="LR patch size in pixels (default 48)")
    p.add_argument("--batch-size", type=int, default=16, help="patches per loader batch (default 16)")
    p.add_argument("--model-batch-size", type=int, default=4, help="images per training step (default 4)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (default 2)")
    p.add_argument("--batches", type=int, default=100, help="loader batches per timed run (default 100)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each (default 3)")
    p.add_argument("--cache-dir", default=None,
                   help="where decoded images are cached (default $XDG_CACHE_HOME/hpdl/sr, else ~/.cache/hpdl/sr)")
    p.add_argument("--json", action="store_true", help="print the two records as JSON instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    from hpdl.bench.memory import out_of_memory
    from hpdl.cli_error import CliError
    from hpdl.sr.config import ConfigError
    from hpdl.sr.errors import SRDataError
    from hpdl.sr.models import make_config
    from hpdl.sr.throughput import measure_model, measure_pipeline

    for name in ("scale", "patch", "batch_size", "model_batch_size", "batches", "repeats"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.workers < 0:
        raise CliError(f"--workers must be >= 0, got {args.workers}")
    try:
        make_config(args.model, args.scale)  # a misspelt model fails before the pipeline's minute
        records = [
            measure_pipeline(args.data, args.scale, patch_size=args.patch, batch_size=args.batch_size,
                             num_workers=args.workers, batches=args.batches, repeats=args.repeats,
                             cache_dir=args.cache_dir),
            measure_model(args.model, args.scale, patch_size=args.patch, batch_size=args.model_batch_size,
                          repeats=args.repeats),
        ]
    except (SRDataError, ConfigError, ValueError) as err:
        raise CliError(str(err)) from None
    except OSError as err:
        raise CliError(f"{getattr(err, 'filename', None) or args.data}: {err.strerror or err}") from None
    except (MemoryError, RuntimeError) as err:
        if not out_of_memory(err):
            raise
        raise CliError(f"out of memory with --batch-size {args.batch_size}, --model-batch-size "
                       f"{args.model_batch_size} and --patch {args.patch}; lower them") from None
    if args.json:
        print(json.dumps(records, indent=2))
        return 0
    for r in records:
        print(f"{r['what']:<40} {r['median']:10.1f} {r['unit']:<10} (min {r['min']:.1f}, max {r['max']:.1f})")
    print(f"the pipeline delivers {records[0]['median'] / records[1]['median']:.0f}x what one training thread consumes")
    return 0
