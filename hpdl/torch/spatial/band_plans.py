"""Where each band's rows come from for a layer of the spatial part: the plans along rows and
columns (geometry.plan_bands) for a layer's windows, for rows moved to the even split, or for
any rows a handler needs, and the halo exchange's spec on this rank. A band too thin for a
layer is refused naming the layer (ThinBand).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, List, Tuple

import torch

from hpdl.torch.spatial import halo
from hpdl.torch.spatial.context import Context
from hpdl.torch.spatial.geometry import BandPlan, Part, ThinBand, Window, bands, plan_bands
from hpdl.torch.spatial.parts import tagged


def pair(value: Any) -> Tuple[int, int]:
    """A layer's argument for (rows, columns): one number for both, or a sequence."""
    if isinstance(value, (tuple, list)):
        return (int(value[0]), int(value[-1])) if len(value) else (0, 0)
    return int(value), int(value)


@functools.lru_cache(maxsize=4096)
def window_plans(length: int, parts: int, window: Window) -> Tuple[int, Tuple[BandPlan, ...]]:
    """The output length and every band's plan for ``window`` along one dimension."""
    out_length = window.output_length(length)
    out_bands = bands(out_length, parts)
    return out_length, tuple(plan_bands(bands(length, parts), [window.needed(b) for b in out_bands], length))


@functools.lru_cache(maxsize=4096)
def _regroup_plans(owned: Tuple[Tuple[int, int], ...], length: int) -> Tuple[BandPlan, ...]:
    """Plans that move rows from ``owned`` bands to the even split of ``length`` rows."""
    return tuple(plan_bands(owned, bands(length, len(owned)), length))


@contextlib.contextmanager
def naming_the_layer(ctx: Context, axis: int) -> Iterator[None]:
    """A band too thin found inside names the running layer and the axis (0: rows, 1: columns)."""
    try:
        yield
    except ThinBand as thin:
        thin.layer, thin.axis = ctx.where(), axis
        raise


def along(ctx: Context, axis: int, owned, needed, length: int) -> List[BandPlan]:
    """plan_bands along ``axis`` for the running layer (a band too thin names it)."""
    with naming_the_layer(ctx, axis):
        return plan_bands(owned, needed, length)


def halo_spec(ctx: Context, plans: Tuple[BandPlan, BandPlan], fill: str) -> halo.HaloSpec:
    """This rank's halo exchange for its (rows, columns) ``plans``, with ``fill`` beyond the image."""
    return halo.HaloSpec(rows=plans[0], cols=plans[1], row_peers=ctx.grid.neighbours(ctx.rank, 0),
                         col_peers=ctx.grid.neighbours(ctx.rank, 1), fill=fill, comm=ctx.comm, label=ctx.label())


def window_spec(ctx: Context, part: Part, windows: Tuple[Window, Window], fill: str) -> Tuple[halo.HaloSpec, Part]:
    """The exchange ``windows`` (rows, columns) need on this rank, and the output's part."""
    lengths, plans = [], []
    for axis, window in enumerate(windows):
        with naming_the_layer(ctx, axis):
            out_length, all_plans = window_plans(part.length(axis), ctx.grid.bands_along(axis), window)
        lengths.append(out_length)
        plans.append(all_plans[part.band[axis]])
    return halo_spec(ctx, (plans[0], plans[1]), fill), part.resized(lengths[0], lengths[1])


def regroup(ctx: Context, y: torch.Tensor, part: Part, factors: Tuple[int, int]) -> torch.Tensor:
    """``y``, this rank's rows and columns of a map ``factors`` times ``part``'s size that a
    local operation made (rows ``factor * band``), moved to the even split of that map."""
    plans = []
    for axis, factor in enumerate(factors):
        owned = tuple((factor * a, factor * b) for a, b in bands(part.length(axis), ctx.grid.bands_along(axis)))
        plans.append(_regroup_plans(owned, factor * part.length(axis))[part.band[axis]])
    out = halo.exchange(y, halo_spec(ctx, (plans[0], plans[1]), halo.ZEROS))
    return tagged(out, part.resized(factors[0] * part.height, factors[1] * part.width))
