"""Resampling on a part, exactly as one process resamples the whole map: ``pixel_shuffle``
and nearest upsampling are local, then move whole rows so that the result is split as every
map is; ``pixel_unshuffle`` first takes the blocks of rows its share of the output needs;
bilinear and bicubic upscaling, and downscaling by whole factors, exchange the rows their
output band reads (beyond the image: the border row, as PyTorch clamps its source rows),
then run PyTorch's own interpolation on them.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from hpdl.torch.spatial import band_plans, halo
from hpdl.torch.spatial.context import Context
from hpdl.torch.spatial.geometry import BandPlan, Part, SpatialError, bands, plan_bands
from hpdl.torch.spatial.parts import part_of, tagged


def pixel_shuffle(ctx: Context, func, a: dict):
    x, factor = a["input"], int(a["upscale_factor"])
    return band_plans.regroup(ctx, torch.pixel_shuffle(x, factor), part_of(x), (factor, factor))


@functools.lru_cache(maxsize=4096)
def _unshuffle_plans(length: int, parts: int, factor: int) -> Tuple[BandPlan, ...]:
    """Plans that give each band the input rows of its even share of the output's
    ``length // factor`` rows: ``factor`` input rows an output row."""
    needed = [(factor * a, factor * b) for a, b in bands(length // factor, parts)]
    return tuple(plan_bands(bands(length, parts), needed, length))


def pixel_unshuffle(ctx: Context, func, a: dict):
    """``F.pixel_unshuffle``: each band first takes the blocks of ``factor`` rows (and columns)
    that make its even share of the output, from its neighbours where a block straddles two
    bands, then unshuffles them alone."""
    x, factor = a["input"], int(a["downscale_factor"])
    part = part_of(x)
    plans = []
    for axis in (0, 1):
        length, what = part.length(axis), ("height", "width")[axis]
        if length % factor:
            raise SpatialError(f"{ctx.where()}: pixel_unshuffle expects the {what} to be divisible by "
                               f"downscale_factor {factor}, but the image's is {length}")
        if length // factor < ctx.grid.bands_along(axis):
            raise SpatialError(f"{ctx.where()}: pixel_unshuffle by {factor} makes {length // factor} "
                               f"{('rows', 'columns')[axis]} of {length}, fewer than the "
                               f"{ctx.grid.bands_along(axis)} {('row', 'column')[axis]} bands")
        with band_plans.naming_the_layer(ctx, axis):
            all_plans = _unshuffle_plans(length, ctx.grid.bands_along(axis), factor)
        plans.append(all_plans[part.band[axis]])
    blocks = halo.exchange(x, band_plans.halo_spec(ctx, (plans[0], plans[1]), halo.ZEROS))
    return tagged(torch.pixel_unshuffle(blocks, factor), part.resized(part.height // factor, part.width // factor))


_TAPS = {"bilinear": 1, "bicubic": 2}  # source rows read beyond the nearest, on each side


def _whole_factors(ctx: Context, part: Part, size: Any, scale_factor: Any,
                   recompute: Optional[bool]) -> Tuple[str, Tuple[int, int], Tuple[int, int]]:
    """("up", factors, output lengths) for integer upscaling, ("down", factors, output lengths)
    for downscaling by whole factors (scale 1 / k: PyTorch's source scale is then k exactly);
    any other scale is refused. The output lengths as PyTorch computes them."""
    lengths = (part.height, part.width)
    if size is not None or recompute:
        if size is not None:
            out = band_plans.pair(size)
        else:
            factors = scale_factor if isinstance(scale_factor, (tuple, list)) else (scale_factor, scale_factor)
            out = tuple(int(math.floor(n * float(f))) for n, f in zip(lengths, factors))
        if all(o >= n and o % n == 0 for o, n in zip(out, lengths)):
            return "up", (out[0] // lengths[0], out[1] // lengths[1]), out
        if all(0 < o <= n and n % o == 0 for o, n in zip(out, lengths)):
            return "down", (lengths[0] // out[0], lengths[1] // out[1]), out
        raise SpatialError(f"{ctx.where()}: interpolation of a {part.height} x {part.width} map to {out[0]} x "
                           f"{out[1]} (a scale of {out[0] / part.height:.4g} x {out[1] / part.width:.4g}) is not "
                           "supported in the spatial part (integer upscaling, or downscaling by whole factors)")
    scales = tuple(float(f) for f in (scale_factor if isinstance(scale_factor, (tuple, list))
                                      else (scale_factor, scale_factor)))
    out = tuple(int(math.floor(n * f)) for n, f in zip(lengths, scales))
    if all(f >= 1 and f == int(f) for f in scales):
        return "up", (int(scales[0]), int(scales[1])), out
    if all(0 < f <= 1 and 1 / f == int(1 / f) and o >= 1 for f, o in zip(scales, out)):
        return "down", (int(1 / scales[0]), int(1 / scales[1])), out
    raise SpatialError(f"{ctx.where()}: interpolation by {scales[0]:g} x {scales[1]:g} is not supported in the "
                       "spatial part (integer upscaling, or downscaling by whole factors: 0.5, 1/3, ...)")


def interpolate(ctx: Context, func, a: dict):
    x = a["input"]
    size, scale_factor = a.get("size"), a.get("scale_factor")
    mode, align_corners, antialias = a.get("mode", "nearest"), a.get("align_corners"), a.get("antialias", False)
    part = part_of(x)
    if x.dim() != 4 or mode not in ("nearest", "nearest-exact", "bilinear", "bicubic") or align_corners or antialias:
        detail = f"mode={mode!r}" + (", align_corners=True" if align_corners else "") + \
            (", antialias=True" if antialias else "")
        raise SpatialError(f"{ctx.where()}: interpolation with {detail} is not supported in the spatial part "
                           "(nearest, bilinear or bicubic, integer upscaling or downscaling, align_corners=False)")
    direction, scales, out_lengths = _whole_factors(ctx, part, size, scale_factor, a.get("recompute_scale_factor"))
    if direction == "down":
        return _downscale(ctx, x, part, scales, out_lengths, mode)
    if mode in ("nearest", "nearest-exact"):  # output row o reads row o // s: local, then regrouped
        return band_plans.regroup(ctx, F.interpolate(x, scale_factor=scales, mode=mode), part, scales)
    # Output row o reads rows near (o + 0.5) / s - 0.5; the image's own rows are clamped to its
    # edge, which the replicated fill stands for. The assembled input starts at a whole row,
    # so the local interpolation's coordinates are the global ones shifted by it.
    taps = _TAPS[mode]
    plans, offsets = [], []
    for axis, s in enumerate(scales):
        length, parts = part.length(axis), ctx.grid.bands_along(axis)
        out_bands = bands(s * length, parts)
        needed = [(o0 // s - taps, -(-o1 // s) + taps) for o0, o1 in out_bands]
        all_plans = band_plans.along(ctx, axis, bands(length, parts), needed, length)
        plans.append(all_plans[part.band[axis]])
        o0, o1 = out_bands[part.band[axis]]
        first = needed[part.band[axis]][0]
        offsets.append((o0 - s * first, o1 - o0))
    assembled = halo.exchange(x, band_plans.halo_spec(ctx, (plans[0], plans[1]), halo.REPLICATE))
    out = F.interpolate(assembled, scale_factor=scales, mode=mode, align_corners=False)
    out = out.narrow(2, offsets[0][0], offsets[0][1]).narrow(3, offsets[1][0], offsets[1][1])
    return tagged(out, part.resized(scales[0] * part.height, scales[1] * part.width))


# Downscaling by k: the source rows output row o reads, as offsets from k * o (first, last).
def _read_rows(mode: str, k: int) -> Tuple[int, int]:
    centre = (k - 1) // 2  # the row below (o + 0.5) * k - 0.5, PyTorch's source coordinate
    return {"nearest": (0, 0), "nearest-exact": (k // 2, k // 2), "bilinear": (centre, centre + 1),
            "bicubic": (centre - 1, centre + 2)}[mode]


def _downscale(ctx: Context, x: torch.Tensor, part: Part, factors: Tuple[int, int], out_lengths: Tuple[int, int],
               mode: str) -> torch.Tensor:
    """Downscaling by whole factors k. Each band gets the input rows its output rows read
    (beyond the image: the border row repeated, as PyTorch clamps its source rows), pads them
    locally to whole blocks of k rows from k * (its first output row - whole rows), so that the
    local interpolation's coordinates are the global ones shifted by whole output rows, and
    keeps its own output rows."""
    plans, pads, keep = [], [], []
    for axis, k in enumerate(factors):
        length, parts, what = part.length(axis), ctx.grid.bands_along(axis), ("row", "column")[axis]
        if out_lengths[axis] < parts:
            raise SpatialError(f"{ctx.where()}: the interpolation makes {out_lengths[axis]} {what}s of {length}, "
                               f"fewer than the {parts} {what} bands")
        first, last = _read_rows(mode, k)
        out_bands = bands(out_lengths[axis], parts)
        needed = [(k * o0 + first, k * (o1 - 1) + last + 1) for o0, o1 in out_bands]
        all_plans = band_plans.along(ctx, axis, bands(length, parts), needed, length)
        band = part.band[axis]
        plans.append(all_plans[band])
        (o0, o1), (r0, r1) = out_bands[band], needed[band]
        before, after = max(0, -(-(k * o0 - r0) // k)), max(0, -(-(r1 - k * o1) // k))  # whole output rows
        pads.append((r0 - k * (o0 - before), k * (o1 + after) - r1))
        keep.append((before, o1 - o0, before + (o1 - o0) + after))
    assembled = halo.exchange(x, band_plans.halo_spec(ctx, (plans[0], plans[1]), halo.REPLICATE))
    # The padding rows are read by no output row this band keeps: they only align the coordinates.
    aligned = F.pad(assembled, [pads[1][0], pads[1][1], pads[0][0], pads[0][1]])
    out = F.interpolate(aligned, size=(keep[0][2], keep[1][2]), mode=mode,
                        align_corners=None if mode.startswith("nearest") else False)
    out = out.narrow(2, keep[0][0], keep[0][1]).narrow(3, keep[1][0], keep[1][1])
    return tagged(out, part.resized(out_lengths[0], out_lengths[1]))
