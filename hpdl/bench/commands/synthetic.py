"""`hpdl bench synthetic`: training throughput on synthetic data, inside the current job."""

from __future__ import annotations

import argparse
import json


def register(sub) -> None:
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
    p.set_defaults(func=run)


def run(args) -> int:
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
