"""``hpdl sr upscale``: one image, of any size, by one process or by every rank of a job (``--spatial``).

Everything about the input and the output is checked before any work (``_open_upscale``), and
the result goes through the writers of hpdl.sr.images (``_write_upscaled``) whoever computed
it: under ``--spatial``, rank 0 does both, and every rank computes its band of the rows of
tiles (hpdl/sr/spatial_upscale.py), so that the file is the one-process upscale's, byte for byte.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from hpdl.cli_error import CliError
from hpdl.output_files import OutputRule
from hpdl.sr.cli_options import (add_device, add_max_pixels, add_no_progress, add_res_scale, check_max_pixels, guarded,
                                 print_notes, sr_errors_as_cli_errors)

__all__ = ["SPATIAL_STALL_S", "register_upscale", "spatial_stall_settings"]

# The stall check (a warning after 60 s, the job ended after 30 min) is for a rank that stopped
# submitting collectives. Under --spatial a rank's exchange waits for the other ranks' rows of
# tiles, minutes each on a CPU (a row of 24 tiles of EDSR-baseline took 3 minutes on one thread,
# and --self-ensemble is 8 times that), and the ranks that finish first wait for the others'
# last rows: the check would warn of a stall in every long upscale, and end a wide one. Unless
# the job sets the check itself, --spatial warns only when it ends the job, after a week.
SPATIAL_STALL_S = 7 * 24 * 3600
_STALL_VARIABLES = ("HPDL_STALL_WARNING", "HPDL_STALL_TIMEOUT", "HOROVOD_STALL_CHECK_TIME_SECONDS",
                    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "HOROVOD_STALL_CHECK_DISABLE")


def spatial_stall_settings(env: Any) -> dict:
    """The variables ``upscale --spatial`` sets before ``hvd.init()``: the stall check's, when ``env`` sets
    none of them (``SPATIAL_STALL_S``), else none."""
    if any(name in env for name in _STALL_VARIABLES):
        return {}
    return {"HPDL_STALL_WARNING": str(SPATIAL_STALL_S), "HPDL_STALL_TIMEOUT": str(SPATIAL_STALL_S)}


def register_upscale(sr_sub: Any) -> None:
    """Add ``hpdl sr upscale`` to the subcommands of ``hpdl sr``."""
    p = sr_sub.add_parser(
        "upscale",
        help="super-resolve one image of any size",
        description="Super-resolve an image with a checkpoint, in overlapping tiles that each see all the input "
        "their output needs, so that seams do not show; float rounding (the convolution kernels add in another "
        "order for other extents) may still move a few 8-bit values by one level against --tile 0 (docs/sr.md).",
    )
    p.add_argument("input", help="input (LR) image")
    p.add_argument("output", help="output image (.png recommended)")
    p.add_argument("--ckpt", required=True, help="checkpoint (.pt) written by hpdl, or EDSR-PyTorch or BasicSR weights")
    p.add_argument("--tile", type=int, default=256, help="tile size in LR pixels; 0 = whole image (default 256)")
    p.add_argument("--self-ensemble", action="store_true", help="average the 8 flips/transposes (EDSR+)")
    p.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists (never the input)")
    p.add_argument("--spatial", action="store_true",
                   help="under a launcher of several ranks (hpdl run -np 4 -- hpdl sr upscale ... --spatial), split the "
                   "rows of tiles into one band per rank, each rank computing its tiles with their full margins as "
                   "one process does: the output file has the same bytes as the one-process upscale with the same "
                   "--tile; rank 0 reads the input and the checkpoint and writes the output (docs/sr.md)")
    add_max_pixels(p, "refuse an input image of more pixels than this")
    add_device(p)
    add_res_scale(p)
    add_no_progress(p, "tiles")
    p.set_defaults(func=guarded(_run_upscale), sr_modules=("tqdm", "PIL"))



def _run_upscale(args: argparse.Namespace) -> int:
    if args.spatial:
        return _run_upscale_spatial(args)
    picture, model, guard = _open_upscale(args)
    from hpdl.sr.inference import upscale_image
    from hpdl.sr.threads import use_threads

    use_threads(ranks_on_node=1)  # one process's work: the rule of every command (threads.py)

    out = upscale_image(model, picture.rgb, tile=args.tile or None, ensemble=args.self_ensemble,
                        progress=args.progress)
    return _write_upscaled(args, picture, model.scale, out, guard)


def _open_upscale(args: argparse.Namespace, device: Any = None) -> tuple:
    """Check the command line and the output, read the picture and load the model, before any
    work; return ``(picture, model, output guard)``. ``device``: the model's (default: --device)."""
    from hpdl.sr.config import resolve_device
    from hpdl.sr.images import output_format, read_picture

    if args.tile < 0:
        raise CliError(f"--tile must be >= 0, got {args.tile}")
    if args.spatial and args.tile == 0:
        raise CliError("--spatial splits the rows of tiles over the ranks, and --tile 0 makes the whole image "
                       "one tile: give a tile size (--tile 256)")
    check_max_pixels(args)
    # Everything about the output is checked before minutes of inference, not after.
    guard = OutputRule([("input image", args.input)], args.overwrite)
    guard.refuse(args.output)
    fmt = output_format(args.output)
    picture = _output_picture(args, read_picture(args.input, max_pixels=args.max_pixels), fmt)
    device = device if device is not None else resolve_device(args.device, "--device")

    from hpdl.sr.checkpoint import load_model

    model, checkpoint = load_model(args.ckpt, device=device, res_scale=args.res_scale)
    print_notes(checkpoint)
    return picture, model, guard


def _write_upscaled(args: argparse.Namespace, picture: Any, scale: int, out: Any, guard: OutputRule) -> int:
    """Write the upscaled picture (gray kept gray, transparency enlarged beside it) and say so."""
    import numpy as np

    from hpdl.sr.images import write_image
    from hpdl.sr.inference import upscale_alpha

    if picture.gray:
        from PIL import Image

        # The network's colours of a gray input are its error: the output keeps the input's channels.
        out = np.asarray(Image.fromarray(out).convert("L"))
    if picture.alpha is not None:
        out = np.dstack([out, upscale_alpha(picture.alpha, scale, tile=args.tile or None)])
    write_image(args.output, out, check_target=guard.check_before_rename(args.output), icc_profile=picture.icc_profile)
    (h, w), (sh, sw) = picture.rgb.shape[:2], out.shape[:2]
    print(f"wrote {args.output}: {sw}x{sh} (x{scale} of {w}x{h})")
    return 0


def _run_upscale_spatial(args: argparse.Namespace) -> int:
    """The upscale on every rank of the job, each computing a band of the rows of tiles; rank 0
    reads, checks and writes as the one-process upscale does (hpdl/sr/spatial_upscale.py)."""
    import hpdl.torch as hvd
    from hpdl.sr.config import resolve_device
    from hpdl.sr.models import build_model_from_config
    from hpdl.sr.spatial_upscale import idle_ranks, upscale_image_in_bands
    from hpdl.sr.threads import use_threads

    os.environ.update(spatial_stall_settings(os.environ))
    hvd.init()
    use_threads()  # the ranks of a node share its cores, as training's ranks do (threads.py)
    # Rank 0 alone reads the input and the checkpoint (they need not be on the other nodes) and
    # refuses bad input before any work; every rank then ends with its one line and status.
    picture = model = guard = None
    plan, refusal = None, None
    if hvd.rank() == 0:
        try:
            with sr_errors_as_cli_errors():
                picture, model, guard = _open_upscale(args, device="cpu")
            plan = {"config": model.config.to_dict(), "shape": picture.rgb.shape[:2], "scale": model.scale}
        except CliError as err:
            refusal = (str(err), err.code)
    plan, refusal = hvd.broadcast_object((plan, refusal), 0, name="upscale.plan")
    if refusal is not None:
        raise CliError(*refusal)
    device_errors = hvd.allgather_object(_device_error(args.device, hvd.local_gpu), name="upscale.device")
    failed = [(rank, error) for rank, error in enumerate(device_errors) if error is not None]
    if failed:
        raise CliError(f"rank {failed[0][0]}: {failed[0][1]}" if len(failed) < len(device_errors) else failed[0][1])
    if model is None:
        model = build_model_from_config(plan["config"]).eval()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    model = model.to(resolve_device(args.device, "--device", hvd.local_gpu))
    idle = idle_ranks(plan["shape"][0], args.tile, hvd.size())
    if idle and hvd.rank() == 0:
        print(f"hpdl: note: {args.input}: {hvd.size() - idle} rows of tiles for {hvd.size()} ranks: "
              f"{idle} {'rank has' if idle == 1 else 'ranks have'} nothing to do; a smaller --tile splits the image "
              "finer", file=sys.stderr, flush=True)
    out = upscale_image_in_bands(model, picture.rgb if picture is not None else None, plan["shape"], plan["scale"],
                                 tile=args.tile, ensemble=args.self_ensemble, progress=args.progress)
    if hvd.rank() != 0:
        return 0
    return _write_upscaled(args, picture, plan["scale"], out, guard)


def _device_error(name: str, local_gpu: Callable[[], int]) -> Any:
    """Why this rank cannot use --device ``name`` (one line), or None."""
    from hpdl.sr.config import ConfigError, resolve_device

    try:
        resolve_device(name, "--device", local_gpu)
    except ConfigError as err:
        return str(err)
    return None


def _output_picture(args: argparse.Namespace, picture: Any, fmt: str) -> Any:
    """Fit what the input shows to what the output's format holds, or refuse before any work.

    An alpha channel with no transparent pixel is dropped (nothing is lost); real transparency
    is kept, or the command is refused rather than writing an image that lost it. Gray is
    written as RGB where the format cannot hold gray.
    """
    import dataclasses

    from hpdl.sr.images import writer_keeps

    if picture.frames > 1:
        print(f"hpdl: note: {args.input}: holds {picture.frames} frames; only the first is upscaled",
              file=sys.stderr, flush=True)
    if picture.colour_note:
        print(f"hpdl: note: {args.input}: {picture.colour_note}", file=sys.stderr, flush=True)
    if picture.orientation != 1:
        print(f"hpdl: note: {args.input}: turned upright by its EXIF orientation ({picture.orientation}), as "
              "viewers show it; the output has no orientation tag", file=sys.stderr, flush=True)
    if picture.alpha is not None and bool((picture.alpha == 255).all()):
        picture = dataclasses.replace(picture, alpha=None)
    if picture.gray and not writer_keeps(fmt, picture.mode):
        # Written as RGB, which a gray profile does not describe.
        picture = dataclasses.replace(picture, gray=False, icc_profile=None)
    if picture.alpha is not None and not writer_keeps(fmt, picture.mode):
        raise CliError(f"{args.output}: Pillow's {fmt} writer cannot keep the transparency of {args.input}; "
                       "write .png, .webp or .tif")
    return picture
