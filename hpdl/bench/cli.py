"""`hpdl bench`: registered benchmarks. allreduce and synthetic run inside the current job
(start them with `hpdl run -np N -- hpdl bench ...` or a launcher directly) and print on rank 0
only; scaling is a driver that starts such jobs itself."""

from __future__ import annotations

import argparse
import json
import os
from typing import Tuple


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
    _register_allreduce(sub)
    _register_synthetic(sub)
    _register_scaling(sub)
    _register_spatial(sub)
    _register_pipeline(sub)
    _register_elastic(sub)
    _register_replay(sub)
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
    p.set_defaults(func=_run_allreduce)


def _allreduce_options(args):
    """Build the validated :class:`AllreduceOptions` from the command line (CliError if invalid)."""
    from hpdl.bench.allreduce import AllreduceOptions
    from hpdl.cli_error import CliError

    min_bytes, max_bytes = _size("--min-size", args.min_size), _size("--max-size", args.max_size)
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


def _size(flag: str, text: str) -> int:
    from hpdl.formatting import parse_size
    from hpdl.cli_error import CliError

    try:
        return parse_size(text)
    except ValueError as err:
        raise CliError(f"{flag}: {err}") from None


def _run_allreduce(args) -> int:
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


def _register_synthetic(sub) -> None:
    p = sub.add_parser(
        "synthetic",
        help="training throughput (img/s) on random data, as Horovod's synthetic benchmark",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Training throughput on one fixed random batch (no data loading) with\n"
            "hvd.DistributedOptimizer, as Horovod's pytorch_synthetic_benchmark.py: warm-up batches,\n"
            "then --num-iters timed iterations of --num-batches-per-iter batches; img/sec per rank is\n"
            "the mean over iterations +- 1.96 sigma. --compare alternates hpdl with DistributedDataParallel\n"
            "(ddp: over nccl with a GPU per rank, else gloo), the no-communication ceiling (every rank trains alone, all at once) or\n"
            "lockstep (the ceiling plus a barrier after each backward: the most any synchronous\n"
            "data-parallel method can reach) or profiled (hpdl with the communication profiler on)\n"
            "and reports medians over --repeats runs and the ratios.\n\n"
            "examples:\n"
            "  hpdl run -np 2 -- hpdl bench synthetic --model resnet50 --batch-size 8\n"
            "  mpiexec -n 2 hpdl bench synthetic --model edsr --batch-size 1 --patch 24 --compare ddp,ceiling,lockstep"
        ),
    )
    from hpdl.sr.config import AMP_MODES
    from hpdl.sr.registry import describe_scales, model_names  # the SR models, without importing torch for --help

    models = [name.replace("_", "-") for name in model_names()] + ["resnet50"]
    p.add_argument("--model", default="resnet50", help=f"{', '.join(models)} (default: resnet50)")
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per batch (default 32)")
    # Default None, so that a value given to a model without scale or patch (resnet50) is seen and refused.
    p.add_argument("--scale", type=int, default=None,
                   help=f"upscaling factor of the SR models: {describe_scales(dash=True)} (default 2)")
    p.add_argument("--patch", type=int, default=None, help="LR patch size of the SR models in pixels (default 48)")
    p.add_argument("--num-iters", type=int, default=10, help="timed iterations (default 10)")
    p.add_argument("--num-batches-per-iter", type=int, default=10, help="batches per iteration (default 10)")
    p.add_argument("--num-warmup", "--num-warmup-batches", dest="num_warmup", type=int, default=10,
                   help="untimed warm-up batches (default 10)")
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16 for the allreduce")
    p.add_argument("--device", default="auto",
                   help="auto (this rank's GPU if CUDA is available, else cpu), cpu, cuda or cuda:N; a rank's GPU "
                        "follows its local rank, K ranks per GPU with hpdl run --ranks-per-gpu K (default auto)")
    p.add_argument("--amp", choices=AMP_MODES, default="none",
                   help="mixed precision: the forward under autocast in bfloat16, or in float16 with loss "
                        "scaling (the weights and the allreduced gradients stay float32) (default none)")
    p.add_argument("--overlap-forward", action="store_true",
                   help="hpdl: let the gradients' exchange overlap the next forward "
                        "(DistributedOptimizer(overlap_forward=model); --breakdown counts its wait in forward)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default=None,
                   help="sgd (lr 0.01 x ranks, as Horovod) or adam (lr 1e-4, the EDSR recipe); "
                        "default: adam for the SR models, sgd for resnet50")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank (default 1)")
    p.add_argument("--compare", default="",
                   help="comma-separated baselines to alternate with (the order rotated each repeat; hpdl itself "
                        "always runs, and may be listed): plain (a plain PyTorch loop, no hpdl, no DDP), "
                        "ddp (DistributedDataParallel: over nccl with a GPU per rank, else gloo), "
                        "ceiling (no communication, every rank alone), lockstep (the ceiling with the ranks "
                        "waiting for each other after each backward), profiled (hpdl with the communication "
                        "profiler recording: hpdl/profiled is its cost)")
    p.add_argument("--repeats", type=int, default=5, help="alternating runs per mode with --compare (default 5)")
    p.add_argument("--breakdown", action="store_true",
                   help="also report per rank where a batch's time goes: forward, backward, the wait after "
                        "backward (for the gradients' allreduces, or lockstep's barrier), and the optimizer update; "
                        "and the CPU time per batch of the training thread, hpdl's engine and the backend's threads")
    p.add_argument("--compile", action="store_true",
                   help="run the forward through torch.compile in every mode (DDP: the DDP module compiled); "
                        "the warm-up batches take the compilation")
    p.add_argument("--json", action="store_true", help="print the record as JSON instead of text")
    p.set_defaults(func=_run_synthetic)


def _run_synthetic(args) -> int:
    from hpdl.bench.memory import out_of_memory
    from hpdl.bench.models import benchmark_models, sr_models
    from hpdl.bench.synthetic import SyntheticOptions, device_of, run_synthetic
    from hpdl.cli_error import CliError
    from hpdl.torch.mixed_precision import MixedPrecision

    # Only the values given: SyntheticOptions holds the SR models' defaults (x2, 48 px patches).
    sr_sizes = {name: value for name, value in (("scale", args.scale), ("patch", args.patch)) if value is not None}
    if sr_sizes and args.model in benchmark_models() and args.model not in sr_models():
        flags = " and ".join(f"--{name}" for name in sr_sizes)
        raise CliError(f"{flags} appl{'y' if len(sr_sizes) > 1 else 'ies'} to the SR models "
                       f"({', '.join(sr_models())}), not {args.model}, which trains on 224x224 images")
    try:
        opts = SyntheticOptions(
            model=args.model, batch_size=args.batch_size, **sr_sizes,
            num_iters=args.num_iters, num_batches_per_iter=args.num_batches_per_iter, num_warmup=args.num_warmup,
            fp16_allreduce=args.fp16_allreduce, overlap_forward=args.overlap_forward, optimizer=args.optimizer,
            threads=args.threads,
            compare=tuple(c.strip() for c in args.compare.split(",") if c.strip() and c.strip() != "hpdl"),
            repeats=args.repeats,
            breakdown=args.breakdown, device=args.device, amp=args.amp, compile=args.compile,
        )
        # The device exists and takes the precision: checked before any rank meets the others.
        MixedPrecision(opts.amp, device_of(opts))
    except ValueError as err:
        raise CliError(str(err)) from None
    try:
        record = run_synthetic(opts, json_output=args.json)
    except (MemoryError, RuntimeError) as err:
        if not out_of_memory(err):
            raise
        patch = f" and --patch {opts.patch}" if opts.model in sr_models() else ""
        raise CliError(f"out of memory training {opts.model} with --batch-size {opts.batch_size}{patch}; "
                       f"lower {'them' if patch else 'it'}") from None
    if record is not None and args.json:
        print(json.dumps(record, indent=1))
    return 0


def _register_scaling(sub) -> None:
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
    p.set_defaults(func=_run_scaling)


def _run_scaling(args) -> int:
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
    try:
        record = run_scaling(opts)
    except ScalingError as err:
        raise CliError(f"{err}{_keep_partial(args, err.record)}") from None
    except ScalingStopped as stop:
        raise CliError(f"{stop}{_keep_partial(args, stop.record)}", code=128 + stop.signum) from None
    print(format_summary(record))
    # Checked again right before each rename: a file made there during the study is not replaced either.
    outputs.write(args.json, lambda f: json.dump(record, f, indent=1), option="--json")
    outputs.write(args.plot, lambda f: plot(record, f, image_format), binary=True, option="--plot")
    print(f"wrote {args.json} and {args.plot}")
    return 0


def _keep_partial(args, record) -> str:
    """Write the record of a study that ended early to --json (its runs took minutes each);
    return what to add to the error line about it."""
    from hpdl.output_files import OutputError, OutputRule

    if record is None or not record["runs"]:
        return "; no job had ended, nothing written"
    if args.json is None:
        return f"; the {len(record['runs'])} run(s) done were not written (no --json)"
    try:
        OutputRule(overwrite=args.overwrite, make_directories=False).write(
            args.json, lambda f: json.dump(record, f, indent=1), option="--json")
    except OutputError as err:  # a file made there meanwhile: the study's error comes first
        return f"; the {len(record['runs'])} run(s) done were not written ({err})"
    return f"; wrote the {len(record['runs'])} run(s) done to {args.json} (no plot)"


def _register_spatial(sub) -> None:
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
    p.set_defaults(func=_run_spatial)


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


def _run_spatial(args) -> int:
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
    max_memory = _size("--max-memory", args.max_memory) if args.max_memory is not None else None
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
    try:
        record = run_study(opts)
    except SpatialStudyError as err:
        raise CliError(f"{err}{_keep_partial(args, err.record)}") from None
    except SpatialStudyStopped as stop:
        raise CliError(f"{stop}{_keep_partial(args, stop.record)}", code=128 + stop.signum) from None
    print(format_summary(record))
    # Checked again right before each rename: a file made there during the study is not replaced either.
    if args.json:
        rule.write(args.json, lambda f: json.dump(record, f, indent=1), option="--json")
    if args.plot:
        rule.write(args.plot, lambda f: plot(record, f, image_format), binary=True, option="--plot")
    if outputs:
        print(f"wrote {' and '.join(path for _, path in outputs)}")
    return 0


def _register_pipeline(sub) -> None:
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
    p.set_defaults(func=_run_pipeline)


def _run_pipeline(args) -> int:
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


def _register_elastic(sub) -> None:
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
    p.set_defaults(func=_run_elastic)


def _run_elastic(args) -> int:
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

    try:
        record = run_elastic_bench(opts, progress)
    except ElasticBenchError as err:
        raise CliError(f"{err}{_keep_partial(args, err.record)}") from None
    except ElasticBenchStopped as stop:
        raise CliError(f"{stop}{_keep_partial(args, stop.record)}", code=128 + stop.signum) from None
    print(format_summary(record))
    if args.json:
        rule.write(args.json, lambda f: json.dump(record, f, indent=1), option="--json")
        print(f"wrote {args.json}")
    return 0


def _register_replay(sub) -> None:
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
    p.set_defaults(func=_run_replay)


def _run_replay(args) -> int:
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
