"""`hpdl bench spatial`: spatial parallelism's memory and throughput against one rank."""

from __future__ import annotations

import argparse
import json
import os
from typing import Tuple

from hpdl.bench.commands.common import run_keeping_partial, size_option


def register(sub) -> None:
    p = sub.add_parser(
        "spatial",
        help="one image split over 1, 2, 4 ranks (SpatialParallel): img/s, memory per rank, halos, efficiency "
             "against the no-communication bound (starts the jobs)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Train --model on one image (--batch-size images of --image pixels, the SR models' LR size)\n"
            "split over the ranks with hpdl.torch.spatial.SpatialParallel, at each rank count of --ranks\n"
            "(in row bands, or the --grid of that size). Each point is a job started with `hpdl run -np N`\n"
            "(run this from a shell, not under a launcher), whose real training steps alternate, round by\n"
            "round, with the no-communication bound: a copy of the model in\n"
            "SpatialParallel.no_communication(), each rank computing its band alone (halos left at zero,\n"
            "no collectives). Prints per point: img/s, the bound's img/s and the efficiency (bound's step\n"
            "time / real step time), a rank's CPU time per real step over the bound's (the work the\n"
            "communication adds, apart from waiting: steady on a busy machine), the memory per rank (the\n"
            "most any rank held above its start during the real steps, measured by the kernel: VmHWM),\n"
            "its ratio to 1 rank's, the peak resident set, and the halo exchanges' bytes and time and the\n"
            "group collectives' time per step.\n\n"
            "--max-memory SIZE is enforced: each rank may allocate SIZE beyond what it held at its start\n"
            "(RLIMIT_DATA); a point whose step needs more is reported as not fitting, and the study goes on.\n\n"
            "examples:\n"
            "  hpdl bench spatial --model edsr-baseline --image 512 --ranks 1,2,4 --json s.json --plot s.png\n"
            "  hpdl bench spatial --model resnet50 --image 448 --ranks 4 --grid 2x2 --checkpoint\n"
            "  hpdl bench spatial --model edsr-baseline --image 512 --ranks 1,4 --max-memory 1.5G"
        ),
    )
    from hpdl.sr.registry import model_names

    models = [name.replace("_", "-") for name in model_names()] + ["resnet50"]
    p.add_argument("--model", default="edsr-baseline", help=f"{', '.join(models)} (default edsr-baseline)")
    p.add_argument("--image", default=None, metavar="H[xW]",
                   help="input size in pixels, the SR models' low-resolution input (default 256, resnet50 224)")
    p.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts (default 1,2,4)")
    p.add_argument("--grid", default=None, metavar="RxC[,RxC...]",
                   help="grids to run: R row bands by C column bands, R*C among --ranks (default: each rank count "
                        "in row bands)")
    p.add_argument("--batch-size", type=int, default=1, help="images per step, each split over the ranks (default 1)")
    p.add_argument("--scale", type=int, default=None, help="upscaling factor of the SR models (default 2)")
    p.add_argument("--checkpoint", action="store_true",
                   help="recompute each block's activations in backward (SpatialParallel(checkpoint=True))")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed real and bound steps first (default 1)")
    p.add_argument("--steps", type=int, default=1, help="steps per round (default 1)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of real and bound steps (default 3)")
    p.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="memory each rank may allocate beyond what it held at its start, e.g. 1.5G (enforced; "
                        "with --device cuda, the GPU memory PyTorch's allocator may take)")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda",
                   help="cpu (default), or cuda: each rank on its node's GPU, ranks sharing the GPUs where there "
                        "are more ranks than GPUs (hpdl run --ranks-per-gpu); the memory is then the GPU's")
    p.add_argument("--allocator", default="release", metavar="release|keep|default",
                   help="release (default): the jobs' malloc maps every block of 1 MiB or more on its own and "
                        "returns it when freed (MALLOC_MMAP_THRESHOLD_=1048576), so that feature maps freed out of "
                        "order do not leave its heap fragmented: the memory a step needs, at the cost of fresh "
                        "zeroed pages for every map; keep: every block from the heap, never given back "
                        "(MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_): the fastest step, fragmentation included "
                        "in the memory; default: glibc's own (MALLOC_* variables set already win)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the record as JSON")
    p.add_argument("--plot", default=None, metavar="FILE",
                   help="write img/s and memory per rank against ranks, PNG unless the extension names another format")
    p.add_argument("--overwrite", action="store_true", help="replace the --json and --plot files if they exist")
    p.add_argument("--timeout", type=float, default=3600.0, metavar="S",
                   help="seconds a job may take before it is ended (default 3600, at most a year)")
    p.set_defaults(func=run)


def _pair(option: str, text: str, square: bool) -> Tuple[int, int]:
    """``512`` (square only) or ``512x256`` as two integers; CliError naming the option otherwise."""
    from hpdl.cli_error import CliError

    parts = text.lower().split("x")
    try:
        if len(parts) == 1 and square:
            return int(parts[0]), int(parts[0])
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    except ValueError:
        pass
    form = "H or HxW" if square else "RxC"
    raise CliError(f"{option} takes {form} in whole numbers, got {text!r}")


def run(args) -> int:
    from hpdl.bench.jobs import plot_format
    from hpdl.bench.models import sr_models
    from hpdl.bench.spatial_study import (SpatialStudyError, SpatialStudyOptions, SpatialStudyStopped,
                                          check_layouts, format_summary, plot, run_study)
    from hpdl.cli_error import CliError
    from hpdl.output_files import OutputRule

    try:
        ranks = tuple(int(r) for r in args.ranks.split(","))
    except ValueError:
        raise CliError(f"--ranks takes comma-separated integers, got {args.ranks!r}") from None
    grids = tuple(_pair("--grid", g, square=False) for g in args.grid.split(",")) if args.grid else ()
    image = _pair("--image", args.image, square=True) if args.image else None
    if args.scale is not None and args.model not in sr_models():
        raise CliError(f"--scale applies to the SR models ({', '.join(sr_models())}), not {args.model}")
    max_memory = size_option("--max-memory", args.max_memory) if args.max_memory is not None else None
    try:
        opts = SpatialStudyOptions(model=args.model, image=image, ranks=ranks, grids=grids, batch_size=args.batch_size,
                                   scale=2 if args.scale is None else args.scale, checkpoint=args.checkpoint,
                                   threads=args.threads, warmup=args.warmup, steps=args.steps, rounds=args.rounds,
                                   max_memory=max_memory, allocator=args.allocator, timeout_s=args.timeout,
                                   device=args.device)
        # Outputs and layouts are checked before the study's minutes of jobs, not after them.
        outputs = [(flag, path) for flag, path in (("--json", args.json), ("--plot", args.plot)) if path]
        rule = OutputRule(overwrite=args.overwrite, make_directories=False)
        for flag, path in outputs:
            rule.refuse(path, flag)
        if args.json and args.plot and os.path.abspath(args.json) == os.path.abspath(args.plot):
            raise CliError(f"--json and --plot name the same file, {args.json}")
        image_format = plot_format(args.plot) if args.plot else None
        check_layouts(opts)
    except ValueError as err:
        raise CliError(str(err)) from None
    record = run_keeping_partial(args, lambda: run_study(opts), SpatialStudyError, SpatialStudyStopped)
    print(format_summary(record))
    # Checked again right before each rename: a file made there during the study is not replaced either.
    if args.json:
        rule.write(args.json, lambda f: json.dump(record, f, indent=1), option="--json")
    if args.plot:
        rule.write(args.plot, lambda f: plot(record, f, image_format), binary=True, option="--plot")
    if outputs:
        print(f"wrote {' and '.join(path for _, path in outputs)}")
    return 0
