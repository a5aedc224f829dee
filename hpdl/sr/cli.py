"""``hpdl sr``: train EDSR, evaluate checkpoints and upscale images.

torch and the ``hpdl.sr`` modules are imported inside the handlers so that ``hpdl --help``
stays fast, and after the checks that need no torch, so that a bad command line fails at once.
Every bad input ends as one ``CliError`` line naming the file, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any, Callable

from hpdl.cli import CliError

__all__ = ["DEFAULT_MAX_PIXELS", "register"]

# A small file can declare a huge image. The default keeps the x4 output of the largest input
# allowed (3 bytes a pixel, 16x the input's pixels) under 1 GB, and an evaluated image's float
# copies (HR, output, bicubic) within a few GB.
DEFAULT_MAX_PIXELS = 20_000_000


def register(subparsers: Any) -> None:
    """Add ``hpdl sr`` and its subcommands."""
    sr = subparsers.add_parser(
        "sr",
        help="super-resolution with EDSR: evaluate, upscale (and train)",
        description="EDSR super-resolution: evaluate checkpoints on DIV2K, benchmark sets, "
        "image folders or the embedded photos, and upscale images of any size.",
    )
    sr.set_defaults(func=lambda args: _print_help(sr))
    sr_sub = sr.add_subparsers(dest="sr_command", metavar="SUBCOMMAND")
    _register_train(sr_sub)
    _register_eval(sr_sub)
    _register_upscale(sr_sub)


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _register_train(sr_sub: Any) -> None:
    from hpdl.sr.config import config_names  # no torch: cheap enough for --help

    p = sr_sub.add_parser(
        "train",
        help="train EDSR data-parallel (alone or under hpdl run / mpiexec / srun / torchrun)",
        description="Train EDSR from a YAML config (a packaged name such as 'demo', "
        "'edsr_baseline_x2', or a path) with KEY=VALUE overrides, e.g. "
        "'hpdl run -np 2 -- hpdl sr train --config demo total_updates=500'. Rank 0 writes "
        "OUT_DIR/last.pt (resumable), OUT_DIR/model.pt (weights), CSV logs and a summary. An OUT_DIR "
        "holding an earlier run is refused: continue it with resume=auto, or start over with overwrite=true.",
        epilog=f"packaged configs: {', '.join(config_names())}. The keys and their meaning: "
        "TrainConfig in hpdl/sr/config.py.",
    )
    p.add_argument("--config", required=True, help="packaged config name or YAML file")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="settings that replace the config's")
    p.add_argument("--resume", metavar="PATH", help="continue from a checkpoint; 'auto': OUT_DIR/last.pt if present")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    p.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    # Every rank runs this; rank 0 alone reports. Errors in input reach all ranks alike (the
    # trainer makes sure of that), so the other ranks can exit quietly with the same status.
    from hpdl.comm import discover_topology
    from hpdl.sr.config import ConfigError, load_config
    from hpdl.sr.errors import CheckpointError, ModelMismatchError, SRDataError
    from hpdl.sr.train import TrainError, format_summary, train

    reporter = discover_topology().rank == 0
    try:
        overrides = list(args.overrides) + ([f"resume={args.resume}"] if args.resume else [])
        cfg = load_config(args.config, overrides)
        # With --json, stdout carries the summary alone: progress notes go to stderr.
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            summary = train(cfg)
    except (ConfigError, TrainError, SRDataError, CheckpointError, ModelMismatchError) as err:
        if not reporter:
            raise SystemExit(2) from None
        raise CliError(str(err)) from None
    except OSError as err:
        where = f"{err.filename}: " if err.filename else ""
        raise CliError(f"{where}{err.strerror or err}") from None
    if reporter:
        print(json.dumps(summary, indent=2) if args.json else format_summary(summary), flush=True)
    return 0


def _register_eval(sr_sub: Any) -> None:
    p = sr_sub.add_parser(
        "eval",
        help="measure PSNR/SSIM of a checkpoint (and of bicubic) on a dataset",
        description="Measure PSNR and SSIM of a checkpoint and of bicubic upscaling. DATA is "
        "'embedded' (scikit-image photos, held-out split), a DIV2K root (images 801-900), a "
        "benchmark set (HR/ + LR_bicubic/X<s>/) or a folder of HR images (LR made by bicubic).",
    )
    p.add_argument("--ckpt", required=True, help="checkpoint (.pt) written by hpdl, or an EDSR state dict")
    p.add_argument("--data", default="embedded", help="dataset folder or 'embedded' (default)")
    p.add_argument("--scale", type=int, choices=(2, 3, 4), help="expected scale (default: the checkpoint's)")
    p.add_argument(
        "--space",
        choices=("y", "rgb"),
        help="measure on Y (shave scale) or RGB (shave scale+6); default rgb for DIV2K, y otherwise",
    )
    p.add_argument("--self-ensemble", action="store_true", help="average the 8 flips/transposes (EDSR+)")
    p.add_argument("--tile", type=int, help="run the model in exact tiles of N LR pixels (bounds memory)")
    p.add_argument("--range", dest="index_range", help="DIV2K image numbers, e.g. 801-900")
    p.add_argument("--on-bad-image", choices=("fail", "skip"), default="fail",
                   help="on an undecodable image: fail (default) or skip it with a warning")
    p.add_argument("--cache-dir", help="decode cache and embedded photos (default ~/.cache/hpdl/sr)")
    _add_max_pixels(p, "refuse image files of more pixels than this")
    _add_device(p)
    p.add_argument("--json", action="store_true", help="print the records as JSON instead of a table")
    p.set_defaults(func=_guarded(_run_eval))


def _register_upscale(sr_sub: Any) -> None:
    p = sr_sub.add_parser(
        "upscale",
        help="super-resolve one image of any size",
        description="Super-resolve an image with a checkpoint, in exact overlapping tiles.",
    )
    p.add_argument("input", help="input (LR) image")
    p.add_argument("output", help="output image (.png recommended)")
    p.add_argument("--ckpt", required=True, help="checkpoint (.pt) written by hpdl, or an EDSR state dict")
    p.add_argument("--tile", type=int, default=256, help="tile size in LR pixels; 0 = whole image (default 256)")
    p.add_argument("--self-ensemble", action="store_true", help="average the 8 flips/transposes (EDSR+)")
    p.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists (never the input)")
    _add_max_pixels(p, "refuse an input image of more pixels than this")
    _add_device(p)
    p.set_defaults(func=_guarded(_run_upscale))


def _add_max_pixels(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS, metavar="N",
                   help=f"{what} (default {DEFAULT_MAX_PIXELS:,})")


def _add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (default: cuda if available, else cpu), cpu, cuda or cuda:N")


def _guarded(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    # The sr errors' messages already name the file; OSError covers unwritable outputs.
    def run(args: argparse.Namespace) -> int:
        from hpdl.sr.config import ConfigError
        from hpdl.sr.errors import CheckpointError, ModelMismatchError, SRDataError

        try:
            return handler(args)
        except (SRDataError, CheckpointError, ModelMismatchError, ConfigError) as err:
            raise CliError(str(err)) from None
        except OSError as err:
            where = f"{err.filename}: " if err.filename else ""
            raise CliError(f"{where}{err.strerror or err}") from None

    return run


def _check_max_pixels(args: argparse.Namespace) -> None:
    if args.max_pixels < 1:
        raise CliError(f"--max-pixels must be >= 1, got {args.max_pixels}")


def _run_eval(args: argparse.Namespace) -> int:
    from hpdl.sr.config import resolve_device
    from hpdl.sr.datasets import parse_range

    if args.tile is not None and args.tile < 1:
        raise CliError(f"--tile must be >= 1, got {args.tile}")
    _check_max_pixels(args)
    try:
        index_range = parse_range(args.index_range) if args.index_range else None
    except ValueError as err:
        raise CliError(f"--range: {err}") from None
    device = resolve_device(args.device, "--device")

    from hpdl.sr.checkpoint import load_model
    from hpdl.sr.datasets import build_val_dataset
    from hpdl.sr.evaluate import evaluate, format_table

    model, _ = load_model(args.ckpt, scale=args.scale, device=device)
    pairs = build_val_dataset(
        args.data, model.scale, cache_dir=args.cache_dir, index_range=index_range,
        on_bad_image=args.on_bad_image, max_pixels=args.max_pixels,
    )
    space = args.space or ("rgb" if pairs.layout == "div2k" else "y")
    result = evaluate(
        model, pairs, model.scale, space, self_ensemble=args.self_ensemble, tile=args.tile,
        progress=True,
    )
    if args.json:
        record = result.to_dict()
        record.update(checkpoint=str(args.ckpt), data=str(args.data), model=model.config.name)
        print(json.dumps(record, indent=2, allow_nan=True))
    else:
        print(f"{model.config.describe()} on {args.data} ({len(pairs)} images)")
        print(format_table(result))
    return 0


def _run_upscale(args: argparse.Namespace) -> int:
    from hpdl.sr.config import resolve_device
    from hpdl.sr.images import output_format, read_image, write_image

    if args.tile < 0:
        raise CliError(f"--tile must be >= 0, got {args.tile}")
    _check_max_pixels(args)
    # Everything about the output is checked before minutes of inference, not after.
    output_format(args.output)
    _refuse_output(args.input, args.output, args.overwrite)
    image = read_image(args.input, max_pixels=args.max_pixels)
    device = resolve_device(args.device, "--device")

    from hpdl.sr.checkpoint import load_model
    from hpdl.sr.upscale import upscale_image

    model, _ = load_model(args.ckpt, device=device)
    out = upscale_image(model, image, tile=args.tile or None, ensemble=args.self_ensemble, progress=True)
    write_image(args.output, out)
    (h, w), (sh, sw) = image.shape[:2], out.shape[:2]
    print(f"wrote {args.output}: {sw}x{sh} (x{model.scale} of {w}x{h})")
    return 0


def _refuse_output(source: str, output: str, overwrite: bool) -> None:
    """Refuse to write over the input (also through a link), or over any file without ``--overwrite``."""
    if not os.path.lexists(output):
        return
    try:
        same = os.path.samefile(source, output)
    except OSError:  # the input is missing (reported when it is read) or the output a dangling link
        same = False
    if same:
        raise CliError(f"{output}: is the input image {source}; write the result to another file")
    if not overwrite:
        raise CliError(f"{output}: already exists; pass --overwrite to replace it")
