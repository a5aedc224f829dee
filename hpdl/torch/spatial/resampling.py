"""Resampling on a part, exactly as one process resamples the whole map: ``pixel_shuffle``
and nearest upsampling are local, then move whole rows so that the result is split as every
map is; ``pixel_unshuffle`` first takes the blocks of rows its share of the output needs;
bilinear and bicubic upscaling, and downscaling by whole factors, exchange the rows their
output band reads (beyond the image: the border row, as PyTorch clamps its source rows),
then run PyTorch's own interpolation on them. Any other size or scale, and
``align_corners=True``, exchange the rows their output band reads and sum them with the taps
PyTorch's kernel weights them with (taps.py); so does a whole tensor resampled to a size read
from a part (a pooled 1 x 1 branch brought back to the map's size), which becomes a part.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from hpdl.torch.spatial import band_plans, halo, layers, taps
from hpdl.torch.spatial.context import Context
from hpdl.torch.spatial.geometry import BandPlan, Part, SpatialError, bands, plan_bands
from hpdl.torch.spatial.lengths import COLS, ROWS, PartLength
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


def _whole_factors(part: Part, size: Any, scale_factor: Any,
                   recompute: Optional[bool]) -> Optional[Tuple[str, Tuple[int, int], Tuple[int, int]]]:
    """("up", factors, output lengths) for integer upscaling, ("down", factors, output lengths)
    for downscaling by whole factors (scale 1 / k: PyTorch's source scale is then k exactly);
    None for any other scale. The output lengths as PyTorch computes them."""
    lengths = (part.height, part.width)
    if size is not None or recompute:
        out = _output_lengths(lengths, size, scale_factor)
        if all(o >= n and o % n == 0 for o, n in zip(out, lengths)):
            return "up", (out[0] // lengths[0], out[1] // lengths[1]), out
        if all(0 < o <= n and n % o == 0 for o, n in zip(out, lengths)):
            return "down", (lengths[0] // out[0], lengths[1] // out[1]), out
        return None
    scales = tuple(float(f) for f in (scale_factor if isinstance(scale_factor, (tuple, list))
                                      else (scale_factor, scale_factor)))
    out = _output_lengths(lengths, None, scales)
    if all(f >= 1 and f == int(f) for f in scales):
        return "up", (int(scales[0]), int(scales[1])), out
    if all(0 < f <= 1 and 1 / f == int(1 / f) and o >= 1 for f, o in zip(scales, out)):
        return "down", (int(1 / scales[0]), int(1 / scales[1])), out
    return None


def _output_lengths(lengths: Tuple[int, int], size: Any, scale_factor: Any) -> Tuple[int, int]:
    """An interpolation's output lengths as PyTorch computes them: ``size``, else each length
    times its scale, rounded down."""
    if size is not None:
        return band_plans.pair(size)
    factors = scale_factor if isinstance(scale_factor, (tuple, list)) else (scale_factor, scale_factor)
    return tuple(int(math.floor(n * float(f))) for n, f in zip(lengths, factors))


_MODES = ("nearest", "nearest-exact", "bilinear", "bicubic")


def _refuse_unsupported(ctx: Context, x: torch.Tensor, a: dict, modes: Tuple[str, ...] = _MODES) -> None:
    mode, align_corners, antialias = a.get("mode", "nearest"), a.get("align_corners"), a.get("antialias", False)
    if mode in ("nearest", "nearest-exact", "area") and align_corners is not None:  # as one process refuses it
        raise ValueError("align_corners option can only be set with the interpolating modes: "
                         "linear | bilinear | bicubic | trilinear")
    if x.dim() != 4 or mode not in modes or antialias:
        detail = f"mode={mode!r}" + (", antialias=True" if antialias else "") + \
            ("" if x.dim() == 4 else f" of a {x.dim()}-dimensional tensor")
        raise SpatialError(f"{ctx.where()}: interpolation with {detail} is not supported in the spatial part "
                           f"({', '.join(modes[:-1])} or {modes[-1]}, without antialias, of (N, C, H, W))")


def interpolate(ctx: Context, func, a: dict):
    x = a["input"]
    size, scale_factor = a.get("size"), a.get("scale_factor")
    mode, align_corners = a.get("mode", "nearest"), a.get("align_corners")
    part = part_of(x)
    _refuse_unsupported(ctx, x, a, _MODES + ("area",))
    if mode == "area":
        return _area(ctx, func, x, part, a)
    whole = None if align_corners else _whole_factors(part, size, scale_factor, a.get("recompute_scale_factor"))
    if whole is None:
        return _by_taps(ctx, x, part, a)
    direction, scales, out_lengths = whole
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


def _area(ctx: Context, func, x: torch.Tensor, part: Part, a: dict) -> torch.Tensor:
    """``mode="area"``: PyTorch's adaptive average pooling to the output size. By whole factors
    that is average pooling over k x k blocks (downscaling), or each pixel repeated as nearest
    repeats it (upscaling); any other size would average windows of varying length, refused."""
    lengths = (part.height, part.width)
    out = _output_lengths(lengths, a.get("size"), a.get("scale_factor"))
    if all(0 < o <= n and n % o == 0 for o, n in zip(out, lengths)):
        blocks = (lengths[0] // out[0], lengths[1] // out[1])
        return layers.avg_pool2d(ctx, F.avg_pool2d, {"input": x, "kernel_size": blocks, "stride": blocks})
    if all(o >= n and o % n == 0 for o, n in zip(out, lengths)):
        return interpolate(ctx, func, {"input": x, "size": out, "mode": "nearest"})
    raise SpatialError(f"{ctx.where()}: interpolation with mode='area' from {lengths[0]} x {lengths[1]} to "
                       f"{out[0]} x {out[1]} is not supported in the spatial part (only by whole factors: its "
                       "windows would differ in length)")


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


# -- any size or scale: the taps of PyTorch's kernel ----------------------------------------

def _resample_rows(probe: torch.Tensor, size: Optional[int], scale: Optional[float], mode: str,
                   align_corners: Optional[bool], recompute: Optional[bool]) -> torch.Tensor:
    """The model's interpolation along the rows of ``probe`` (its one column left as it is)."""
    return F.interpolate(probe, size=None if size is None else (size, 1),
                         scale_factor=None if scale is None else (scale, 1.0), mode=mode,
                         align_corners=None if mode.startswith("nearest") else bool(align_corners),
                         recompute_scale_factor=recompute)


def taps_of(x: torch.Tensor, lengths: Tuple[int, int], a: dict) -> Tuple[taps.Taps, taps.Taps]:
    """The taps along rows and columns of the call ``a`` on a map of ``lengths``, read in the
    type and on the device ``x`` computes in (on the CPU for a dry run's meta tensor)."""
    size, scale_factor, mode = a.get("size"), a.get("scale_factor"), a.get("mode", "nearest")
    sizes = band_plans.pair(size) if size is not None else (None, None)
    scales = (None, None) if scale_factor is None else tuple(float(f) for f in (
        scale_factor if isinstance(scale_factor, (tuple, list)) else (scale_factor, scale_factor)))
    device = "cpu" if x.is_meta else str(x.device)
    found = []
    for axis in (0, 1):
        found.append(taps.read(_resample_rows, lengths[axis], taps.probe_dtype(x.dtype), device, mode,
                               size=sizes[axis], scale=scales[axis], align_corners=a.get("align_corners"),
                               recompute=a.get("recompute_scale_factor")))
    return found[0], found[1]


def _by_taps(ctx: Context, x: torch.Tensor, part: Part, a: dict) -> torch.Tensor:
    """Each band gets the input rows its output rows read, then sums them with the taps."""
    rows, cols = taps_of(x, (part.height, part.width), a)
    plans, keep = [], []
    for axis, along in enumerate((rows, cols)):
        length, parts, what = part.length(axis), ctx.grid.bands_along(axis), ("row", "column")[axis]
        if along.outputs < parts:
            raise SpatialError(f"{ctx.where()}: the interpolation makes {along.outputs} {what}s of {length}, "
                               f"fewer than the {parts} {what} bands")
        out_bands = bands(along.outputs, parts)
        needed = [along.reads(o0, o1) for o0, o1 in out_bands]
        band = part.band[axis]
        plans.append(band_plans.along(ctx, axis, bands(length, parts), needed, length)[band])
        keep.append((*out_bands[band], needed[band][0]))
    assembled = halo.exchange(x, band_plans.halo_spec(ctx, (plans[0], plans[1]), halo.REPLICATE))
    out = taps.resample(assembled, rows, cols, keep[0], keep[1])
    return tagged(out, part.resized(rows.outputs, cols.outputs))


def onto_part(ctx: Context, a: dict) -> Optional[torch.Tensor]:
    """A whole tensor (the same on every rank: a pooled branch, a small learned map)
    interpolated to a size read from a part (``size=x.shape[-2:]``): this rank's part of the
    result, computed from the whole input's rows its output rows read; None where the size is
    not a part's (the result is then the whole map one process makes)."""
    x, size = a["input"], a.get("size")
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not isinstance(size, (tuple, list)) or len(size) != 2:
        return None
    rows_length, cols_length = size
    if not (isinstance(rows_length, PartLength) and isinstance(cols_length, PartLength) and rows_length.exact
            and cols_length.exact and rows_length.axis == ROWS and cols_length.axis == COLS):
        return None
    _refuse_unsupported(ctx, x, a)
    if ctx.dry:  # shapes only, as the parts' (a tensor the model holds outside its modules stays where it is)
        x = x.to("meta")
    whole = Part(ctx.grid, ctx.rank, rows_length.whole, cols_length.whole)
    a = dict(a, size=(whole.height, whole.width))
    rows, cols = taps_of(x, tuple(x.shape[-2:]), a)
    out = taps.resample(x, rows, cols, (*whole.rows, 0), (*whole.cols, 0))
    return tagged(out, whole)
