"""``hpdl sr``: train super-resolution models, evaluate checkpoints, upscale images, export weights.

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

from hpdl.cli_error import CliError
from hpdl.output_files import OutputRule
from hpdl.sr.cli_options import (add_device, add_max_pixels, add_no_progress, add_res_scale, check_max_pixels, guarded,
                                 print_notes, require_sr_extra, warnings_in_one_line)
from hpdl.sr.config import DEFAULT_MAX_PIXELS

__all__ = ["DEFAULT_MAX_PIXELS", "register"]


def register(subparsers: Any) -> None:
    """Add ``hpdl sr`` and its subcommands."""
    from hpdl.sr.registry import model_names  # no torch: cheap enough for --help
    from hpdl.sr.upscale_cli import register_upscale

    sr = subparsers.add_parser(
        "sr",
        help=f"super-resolution ({', '.join(model_names())}): train, evaluate, upscale, export weights",
        description=f"Super-resolution with the models {', '.join(model_names())}: train, evaluate "
        "checkpoints on DIV2K, benchmark sets, image folders or the embedded photos, upscale images "
        "of any size, and export weights for BasicSR or EDSR-PyTorch.",
    )
    sr.set_defaults(func=lambda args: _print_help(sr))
    sr_sub = sr.add_subparsers(dest="sr_command", metavar="SUBCOMMAND")
    _register_train(sr_sub)
    _register_eval(sr_sub)
    register_upscale(sr_sub)
    _register_export(sr_sub)


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _register_train(sr_sub: Any) -> None:
    from hpdl.sr.config import config_names  # no torch: cheap enough for --help
    from hpdl.sr.registry import describe_scales, model_names

    p = sr_sub.add_parser(
        "train",
        help="train a model data-parallel, each patch split over S ranks with spatial=S (alone or under hpdl run / "
        "mpiexec / srun / torchrun)",
        description=f"Train a model (model= one of {', '.join(model_names())}; scale= {describe_scales()}) "
        "from a YAML config (a packaged name such as 'demo', "
        "'edsr_baseline_x2', or a path) with KEY=VALUE overrides, e.g. "
        "'hpdl run -np 2 -- hpdl sr train --config demo total_updates=500'. Rank 0 writes into "
        "OUT_DIR (the out_dir= key, e.g. runs/demo for demo): last.pt (resumable), model.pt (weights), CSV logs, "
        "curves.png and a summary. spatial=S splits each patch over groups of S ranks (docs/sr.md). An OUT_DIR "
        "holding an earlier run is refused: continue it with resume=auto, or start over with overwrite=true.",
        epilog=f"packaged configs: {', '.join(config_names())}. The keys and their meaning: "
        "TrainConfig in hpdl/sr/config.py.",
    )
    p.add_argument("--config", required=True, help="packaged config name or YAML file")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="settings that replace the config's")
    p.add_argument("--resume", metavar="PATH", help="continue from a checkpoint; 'auto': OUT_DIR/last.pt if present")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    p.set_defaults(func=_run_train, sr_modules=("yaml", "tqdm", "PIL"))


def _run_train(args: argparse.Namespace) -> int:
    # Every rank runs this; rank 0 alone reports. Errors in input reach all ranks alike (the
    # trainer makes sure of that), so the other ranks can exit quietly with the same status.
    from hpdl.comm import discover_topology
    from hpdl.sr.config import ConfigError, load_config
    from hpdl.sr.errors import CheckpointError, ModelMismatchError, SRDataError, TrainError

    reporter = discover_topology().rank == 0
    try:
        require_sr_extra(args)
    except CliError:  # every rank misses the same module: rank 0 says so
        if not reporter:
            raise SystemExit(2) from None
        raise
    try:
        overrides = list(args.overrides) + ([f"resume={args.resume}"] if args.resume else [])
        cfg = load_config(args.config, overrides)
        # Only now the trainer's imports (torch): a mistyped key is answered at once.
        from hpdl.sr.train import format_summary, json_ready, train

        # With --json, stdout carries the summary alone: progress notes go to stderr.
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext(), \
                warnings_in_one_line(visible=reporter):
            summary = train(cfg)
    except (ConfigError, TrainError, SRDataError, CheckpointError, ModelMismatchError) as err:
        if not reporter:
            raise SystemExit(2) from None
        raise CliError(str(err)) from None
    except OSError as err:
        where = f"{err.filename}: " if err.filename else ""
        raise CliError(f"{where}{err.strerror or err}") from None
    if reporter:
        print(json.dumps(json_ready(summary), indent=2) if args.json else format_summary(summary), flush=True)
    return 0


def _register_eval(sr_sub: Any) -> None:
    from hpdl.sr.registry import known_scales

    p = sr_sub.add_parser(
        "eval",
        help="measure PSNR/SSIM of a checkpoint (and of bicubic) on one or more datasets",
        description="Measure PSNR and SSIM of a checkpoint and of bicubic upscaling. DATA is "
        "'embedded' (scikit-image photos, held-out split), a DIV2K root (images 801-900), a "
        "benchmark set (EDSR-PyTorch's HR/ + LR_bicubic/X<s>/ or BasicSR's GTmod12/ + LRbicx<s>/), "
        "an HR/ or GT/ folder beside an LR/ or LQ/ folder, "
        "or a folder of HR images (LR made by MATLAB-compatible bicubic), or several joined by '+' "
        "(Set5+Set14+B100+Urban100), scored in one table.",
    )
    p.add_argument("--ckpt", required=True, help="checkpoint (.pt) written by hpdl, or EDSR-PyTorch or BasicSR weights")
    p.add_argument("--data", default="embedded", help="dataset folder(s) joined by '+', or 'embedded' (default)")
    p.add_argument("--data-root", metavar="DIR",
                   help="where to look for sets given by name (DIR/NAME or DIR/benchmark/NAME)")
    p.add_argument("--scale", type=int, choices=known_scales(), help="expected scale (default: the checkpoint's)")
    p.add_argument(
        "--space",
        choices=("y", "rgb"),
        help="measure on Y (shave scale) or RGB (shave scale+6); default rgb for DIV2K, y otherwise",
    )
    p.add_argument("--downscaler", choices=("matlab", "torch"), default="matlab",
                   help="how LR is made where a dataset has none: matlab (imresize, as the published "
                   "benchmarks; default) or torch (antialiased bicubic)")
    p.add_argument("--self-ensemble", action="store_true", help="average the 8 flips/transposes (EDSR+)")
    p.add_argument("--tile", type=int, help="run the model in tiles of TILE LR pixels, each seeing all the input its "
                   "output needs (bounds memory; float rounding may still move a few 8-bit values by one level "
                   "against whole images: docs/sr.md; default: whole images)")
    p.add_argument("--range", dest="index_range", help="DIV2K image numbers, e.g. 801-900 (DIV2K sets only)")
    p.add_argument("--on-bad-image", choices=("fail", "skip"), default="fail",
                   help="on an image that cannot be decoded, or is too small for the scale or to measure: fail "
                   "(default) or skip it with a warning")
    p.add_argument("--cache-dir", help="decode cache and embedded photos (default $XDG_CACHE_HOME/hpdl/sr, else "
                   "~/.cache/hpdl/sr)")
    p.add_argument("--save-results", metavar="DIR",
                   help="write every SR image as DIR/<set>/<image>_x<s>_SR.png")
    p.add_argument("--grid", metavar="PNG",
                   help="write a grid of centre crops: LR (nearest), bicubic, SR, HR side by side")
    p.add_argument("--grid-images", metavar="NAMES",
                   help="comma-separated image names for --grid (default: the first 4 of the first set)")
    p.add_argument("--grid-crop", type=int, default=96, metavar="N", help="crop side in HR pixels (default 96)")
    p.add_argument("--overwrite", action="store_true", help="replace existing result images and grid")
    add_max_pixels(p, "refuse image files of more pixels than this")
    add_device(p)
    add_res_scale(p)
    p.add_argument("--json", action="store_true", help="print the records as JSON instead of a table")
    add_no_progress(p, "images")
    p.set_defaults(func=guarded(_run_eval), sr_modules=("tqdm", "PIL"))


def _register_export(sr_sub: Any) -> None:
    p = sr_sub.add_parser(
        "export",
        help="write a checkpoint's weights as BasicSR or EDSR-PyTorch read them",
        description="Write the weights of a checkpoint in another project's format: 'basicsr' "
        "({'params': ...} with BasicSR's key names; its EDSR takes the DIV2K mean from its options) "
        "or 'edsr-pytorch' (a bare state dict, EDSR only).",
    )
    p.add_argument("output", help="file to write (.pth)")
    p.add_argument("--ckpt", required=True, help="checkpoint (.pt) written by hpdl, or EDSR-PyTorch or BasicSR weights")
    p.add_argument("--to", required=True, choices=("basicsr", "edsr-pytorch"), help="format to write")
    p.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists (never the checkpoint)")
    add_res_scale(p)
    p.set_defaults(func=guarded(_run_export), sr_modules=())


def _run_export(args: argparse.Namespace) -> int:
    guard = OutputRule([("checkpoint", args.ckpt)], args.overwrite)
    guard.refuse(args.output)

    import torch

    from hpdl.atomic_file import atomic_write
    from hpdl.sr.checkpoint import load_model
    from hpdl.sr.weights import WeightsError, export_weights, res_scale_note

    model, checkpoint = load_model(args.ckpt, res_scale=args.res_scale)
    print_notes(checkpoint)
    try:
        exported = export_weights(model.state_dict(), model.config, args.to)
    except WeightsError as err:
        raise CliError(f"{args.ckpt}: {err}") from None
    atomic_write(args.output, lambda f: torch.save(exported, f), check_target=guard.check_before_rename(args.output))
    print(f"wrote {args.output}: {model.config.describe()} as {args.to} weights")
    note = res_scale_note(model.config, args.to)
    if note:
        print(f"hpdl: note: {note}", file=sys.stderr, flush=True)
    return 0


def _run_eval(args: argparse.Namespace) -> int:
    from hpdl.sr.config import resolve_device
    from hpdl.sr.datasets import parse_range, split_sets
    from hpdl.sr.images import output_format

    if args.tile is not None and args.tile < 1:
        raise CliError(f"--tile must be >= 1, got {args.tile}")
    if args.grid_crop < 1:
        raise CliError(f"--grid-crop must be >= 1, got {args.grid_crop}")
    check_max_pixels(args)
    for option, value in (("--save-results", args.save_results), ("--grid", args.grid)):
        if value == "":
            raise CliError(f"{option}: empty path")
    try:
        index_range = parse_range(args.index_range) if args.index_range else None
    except ValueError as err:
        raise CliError(f"--range: {err}") from None
    if not args.data:
        raise CliError("--data is empty: give a dataset folder, several joined by '+', or 'embedded'")
    sets = split_sets(args.data, args.data_root)
    if index_range is not None:
        _refuse_range_outside_div2k(sets)
    if args.grid:
        OutputRule([("checkpoint", args.ckpt)], args.overwrite).refuse(args.grid)
        output_format(args.grid)
    if args.save_results:
        OutputRule().refuse_directory(args.save_results)
        _refuse_results_in_sets(args.save_results, sets, args.cache_dir)
        if not args.overwrite:
            _refuse_earlier_results(args.save_results, [name for name, _ in sets])
    device = resolve_device(args.device, "--device")

    from hpdl.sr.checkpoint import load_model
    from hpdl.sr.datasets import build_val_dataset
    from hpdl.sr.evaluation import evaluate, format_sets_table, format_table, keep_measurable

    model, checkpoint = load_model(args.ckpt, scale=args.scale, device=device, res_scale=args.res_scale)
    print_notes(checkpoint)
    # Every set is found and checked, and the grid's images too, before any is scored.
    opened = [(name, data, build_val_dataset(
        data, model.scale, cache_dir=args.cache_dir, index_range=index_range, on_bad_image=args.on_bad_image,
        max_pixels=args.max_pixels, downscaler=args.downscaler)) for name, data in sets]
    spaces = [args.space or ("rgb" if pairs.layout == "div2k" else "y") for _, _, pairs in opened]
    opened = [(name, data, keep_measurable(pairs, model.scale, space, args.on_bad_image))
              for (name, data, pairs), space in zip(opened, spaces)]
    grid_images = _grid_images(args, opened) if args.grid else []
    # Now that the sets are open, their image files are inputs the outputs must not replace either.
    guard = OutputRule([("checkpoint", args.ckpt)] + _set_files(opened), args.overwrite)
    if args.grid:
        guard.refuse(args.grid)
    from hpdl.sr.threads import use_threads

    use_threads(ranks_on_node=1)  # one process's work: the rule of every command (threads.py)
    scored = []
    for (name, data, pairs), space in zip(opened, spaces):
        saver = _result_saver(args, name, model.scale, guard) if args.save_results else None
        result = evaluate(model, pairs, model.scale, space, self_ensemble=args.self_ensemble, tile=args.tile,
                          progress=args.progress, on_output=saver)
        scored.append((name, data, pairs, result))
    if args.grid:
        _write_grid(args, model, grid_images, guard)
    if args.json:
        record = {"checkpoint": str(args.ckpt), "model": model.config.name, "scale": model.scale,
                  "downscaler": args.downscaler,
                  "sets": [{"name": name, "data": str(data), "layout": pairs.layout, **result.to_dict()}
                           for name, data, pairs, result in scored]}
        print(json.dumps(record, indent=2, allow_nan=True))
    elif len(scored) == 1:
        name, data, pairs, result = scored[0]
        print(f"{model.config.describe()} on {data} ({len(pairs)} images)")
        print(format_table(result))
    else:
        print(f"{model.config.describe()}, x{model.scale}" + (", self-ensemble x8" if args.self_ensemble else ""))
        print(format_sets_table([(name, result) for name, _, _, result in scored]))
    return 0


def _refuse_range_outside_div2k(sets: list) -> None:
    """Refuse ``--range`` for a set that is not DIV2K: only DIV2K's images are numbered, and
    scoring every image of the set instead of the ones asked for would give another mean."""
    from hpdl.sr.datasets import detect_layout

    for _, data in sets:
        layout = detect_layout(data)
        if layout != "div2k":
            raise CliError(f"--range: {data} is not DIV2K (its layout is {layout}); only DIV2K's images are "
                           "numbered: leave --range out to score the whole set")


def _set_files(opened: list) -> list:
    """``("input image", path)`` of every image file of the opened sets: HR and, in a set's folder, LR."""
    from hpdl.sr.images import list_images

    files = [path for _, _, pairs in opened for path in map(pairs.source, range(len(pairs)))]
    for _, data, _ in opened:
        if os.path.isdir(data):
            files += list_images(data)
    return [("input image", path) for path in files]


def _result_saver(args: argparse.Namespace, set_name: str, scale: int,
                  guard: OutputRule) -> Callable[[str, Any], None]:
    """Return a function that writes one SR output as ``DIR/<set>/<image>_x<s>_SR.png``."""
    from pathlib import Path

    from hpdl.sr.images import write_image
    from hpdl.sr.metrics import quantize

    folder = Path(args.save_results) / set_name

    def save(name: str, sr: Any) -> None:
        path = folder / f"{name}_x{scale}_SR.png"
        write_image(path, quantize(sr).byte().permute(1, 2, 0).cpu().numpy(),
                    check_target=guard.check_before_rename(path))

    return save


def _refuse_earlier_results(directory: str, set_names: list) -> None:
    """Refuse, before any work, to write SR images where earlier ones are, unless ``--overwrite``."""
    from pathlib import Path

    # Resolved as the writes will be once the missing directories exist ("missing/../results").
    resolved = Path(os.path.realpath(directory))
    for name in set_names:
        earlier = sorted((resolved / name).rglob("*_SR.png")) if (resolved / name).is_dir() else []
        if earlier:
            raise CliError(f"{earlier[0]}: --save-results would replace earlier results; pass --overwrite "
                           "or choose another directory")


def _refuse_results_in_sets(directory: str, sets: list, cache_dir: Any) -> None:
    """Refuse, before any work, SR images written into a set being evaluated (``DIR/<set>`` is or is
    inside its folder): the next evaluation of that folder would score them as HR images."""
    from pathlib import Path

    from hpdl.sr.images import default_cache_dir

    folders = [(data, Path(os.path.realpath(Path(cache_dir) if cache_dir else default_cache_dir()) / "embedded")
                if data == "embedded" else Path(os.path.realpath(data))) for _, data in sets]
    for name, _ in sets:
        # Resolved as the writes will be once the missing directories exist ("missing/../results").
        target = Path(os.path.realpath(Path(directory) / name))
        for data, folder in folders:
            if target == folder or folder in target.parents:
                raise CliError(f"--save-results {directory}: would write the SR images into the input set {data} "
                               f"({target}); give a directory outside the sets")


def _grid_images(args: argparse.Namespace, opened: list) -> list:
    """Return ``(pairs, index)`` of every image --grid shows: --grid-images, or the first 4 of the first set."""
    first = opened[0][2]
    if not args.grid_images:
        return [(first, i) for i in range(min(4, len(first)))]
    chosen = []
    for name in args.grid_images.split(","):
        where = next(((pairs, pairs.names.index(name)) for _, _, pairs in opened if name in pairs.names), None)
        if where is None:
            raise CliError(f"--grid-images: no image named {name!r} in {args.data} (e.g. {', '.join(first.names[:6])})")
        chosen.append(where)
    return chosen


def _write_grid(args: argparse.Namespace, model: Any, images: list, guard: OutputRule) -> None:
    from hpdl.sr.figures import sample_crops, sample_grid
    from hpdl.sr.images import write_image

    samples = [sample for pairs, i in images for sample in sample_crops(model, pairs, [i], args.grid_crop)]
    write_image(args.grid, sample_grid(samples), check_target=guard.check_before_rename(args.grid))
    # The crops as drawn: --grid-crop rounded down to whole LR pixels and cut to each image.
    sizes = list(dict.fromkeys(f"{s.hr.shape[1]}x{s.hr.shape[0]}" for s in samples))
    asked = f"{args.grid_crop}x{args.grid_crop}"
    cut = "" if sizes == [asked] else f" (--grid-crop {args.grid_crop} cut to whole LR pixels and to the images)"
    print(f"wrote {args.grid}: {len(samples)} crops of {', '.join(sizes)} px{cut}", file=sys.stderr)
