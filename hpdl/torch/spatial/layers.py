"""The operations of a CNN's spatial part, computed on one rank's part of each feature map
exactly as one process computes them on the whole.

Each handler takes the arguments of the PyTorch function it replaces (``F.conv2d``,
``F.max_pool2d``, ``F.batch_norm``, ...) by name, as the dispatch mode binds them (lengths read
from a part already the whole image's), and returns this rank's part of the result, marked
with its :class:`Part`:

- window operations (convolution, pooling) exchange the
  rows and columns their output band reads (halo.py), then run PyTorch's own operation with
  no padding: fill beyond the image stands for it;
- resampling (``pixel_shuffle``, ``pixel_unshuffle``, interpolation) is in resampling.py, and
  where each band's rows come from (the plans, the exchange's spec) in band_plans.py;
- transposed convolutions exchange the input rows their output band gathers from, then crop;
- crops and pads (``x[..., a:b, :]``, ``narrow``, ``F.pad``) are a shifted window of the
  image: each output band takes its rows from the input bands, fill beyond the image; a
  slice's step is a one-pixel window with that stride;
- normalization (batch, group and instance norm) is in normalization.py, and reductions over
  the whole image to a replicated result (global and adaptive pooling, sums, maxima,
  variances) in reductions.py.

Gradient bookkeeping (what ``SpatialParallel`` relies on): a part's gradient is exact on its
owner once the halo gradients have come back.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from hpdl.torch.spatial import band_plans, halo, reductions
from hpdl.torch.spatial.comm import refuse_graph_in_backward
from hpdl.torch.spatial.context import Context
from hpdl.torch.spatial.geometry import BandPlan, SpatialError, Window, bands
from hpdl.torch.spatial.parts import part_of, tagged


# -- convolution ---------------------------------------------------------------------------

class HaloConv2d(torch.autograd.Function):
    """A convolution of the band's window input. Keeps only its own input and the received
    strips for backward (not the assembled window input, which would double the activations'
    memory), and computes the gradients with the convolution's own backward kernel."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec: halo.HaloSpec, stride, dilation, groups):
        assembled, row_strips, col_strips = halo.receive_both(x, spec)
        ctx.save_for_backward(x, weight, *row_strips, *col_strips)
        ctx.spec, ctx.stride, ctx.dilation, ctx.groups = spec, stride, dilation, groups
        ctx.has_bias = bias is not None
        return F.conv2d(assembled, weight, bias, stride, 0, dilation, groups)

    @staticmethod
    def backward(ctx, grad_output):
        refuse_graph_in_backward(ctx.spec.label)
        x, weight, row_before, row_after, col_before, col_after = ctx.saved_tensors
        spec = ctx.spec
        assembled = halo.assemble_both(x, spec, (row_before, row_after), (col_before, col_after))
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
        grad_in, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad_output.contiguous(), assembled, weight, [weight.shape[0]] if ctx.has_bias else None,
            list(ctx.stride), [0, 0], list(ctx.dilation), False, [0, 0], ctx.groups, mask)
        if grad_in is not None:
            grad_in = halo.adjoint_both(grad_in, spec, tuple(x.shape[-2:]))
        return grad_in, grad_weight, grad_bias if ctx.has_bias else None, None, None, None, None


class BandConv2d(torch.autograd.Function):
    """A stride-1 convolution whose band reads ``p`` rows beyond each of its ends and needs
    nothing else (row bands; a 1 x 1 grid): PyTorch's convolution of the band alone with its own
    zero padding, then the received rows' contributions added to its first and last ``p``
    output rows, each a convolution of a strip ``3p`` rows high (the received rows, then zeros
    for the band's own, whose part the first convolution has). Exact (convolution is linear in
    its input), and no window input is assembled: no copy of the band, in forward or backward.
    Keeps its own input and the received strips for backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, spec: halo.HaloSpec, padding: Tuple[int, int], groups: int):
        row_dim = x.dim() - 2
        before, after = halo.receive(x, row_dim, spec.rows, spec.row_peers, spec.comm, spec.label)
        out = F.conv2d(x, weight, bias, 1, padding, 1, groups)
        p = padding[0]
        for strip, rows in ((before, out.narrow(row_dim, 0, p)), (after, out.narrow(row_dim, out.shape[row_dim] - p, p))):
            if strip is not None:
                rows.add_(F.conv2d(_strip_slab(strip, p, strip is before), weight, None, 1, (0, padding[1]), 1, groups))
        ctx.save_for_backward(x, weight, before, after)
        ctx.spec, ctx.padding, ctx.groups, ctx.has_bias = spec, padding, groups, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_output):
        refuse_graph_in_backward(ctx.spec.label)
        x, weight, before, after = ctx.saved_tensors
        p, q = ctx.padding
        grad_output = grad_output.contiguous()
        row_dim = grad_output.dim() - 2
        needs_input, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        mask = [needs_input, needs_weight, ctx.has_bias and ctx.needs_input_grad[2]]
        grad_in, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad_output, x, weight, [weight.shape[0]] if ctx.has_bias else None, [1, 1], [p, q], [1, 1], False,
            [0, 0], ctx.groups, mask)
        strip_grads = []
        for strip, first in ((before, True), (after, False)):
            if strip is None:
                strip_grads.append(None)
                continue
            rows = grad_output.narrow(row_dim, 0 if first else grad_output.shape[row_dim] - p, p).contiguous()
            grad_slab, grad_w, _ = torch.ops.aten.convolution_backward(
                rows, _strip_slab(strip, p, first), weight, None, [1, 1], [0, q], [1, 1], False, [0, 0], ctx.groups,
                [needs_input, needs_weight, False])
            if grad_w is not None:
                grad_weight += grad_w
            strip_grads.append(grad_slab.narrow(row_dim, 0 if first else 2 * p, p) if needs_input else None)
        if needs_input:  # the strips' gradients go back to their owners; theirs come here
            spec = ctx.spec
            halo.give_back(grad_in, row_dim, spec.rows, spec.row_peers, spec.comm, tuple(strip_grads), spec.label)
        return grad_in, grad_weight, grad_bias if ctx.has_bias else None, None, None, None


def _strip_slab(strip: torch.Tensor, p: int, first: bool) -> torch.Tensor:
    """``p`` received rows and ``2p`` rows of zeros where the band's own rows are (before them
    for the strip after the band): the rows whose windows reach the strip, without the band."""
    row_dim = strip.dim() - 2
    zeros = strip.new_zeros(strip.shape[:row_dim] + (2 * p,) + strip.shape[row_dim + 1:])
    return torch.cat([strip, zeros] if first else [zeros, strip], row_dim)


def _band_padding(spec: halo.HaloSpec, windows: Tuple[Window, Window], rows: int) -> Optional[Tuple[int, int]]:
    """The padding with which :class:`BandConv2d` computes this rank's part, or None where it
    cannot: a stride-1, undilated window of ``p`` rows on each side (``q`` columns), whose rows
    come from the band itself plus ``p`` on each end, each from a neighbour or fill; whose
    columns are the band's own plus ``q`` of fill (row bands); and a band of ``2p`` rows or more."""
    (row_window, col_window), plans = windows, (spec.rows, spec.cols)
    if any(w.stride != 1 or w.dilation != 1 or w.pad_before != w.pad_after for w in windows):
        return None
    p, q = row_window.pad_before, col_window.pad_before
    if row_window.kernel != 2 * p + 1 or col_window.kernel != 2 * q + 1 or rows < 2 * p:
        return None
    cols = spec.cols
    if cols.recv_before or cols.recv_after or cols.send_before[1] > cols.send_before[0] \
            or cols.send_after[1] > cols.send_after[0] or cols.keep != (0, cols.owned) \
            or (cols.fill_before, cols.fill_after) != (q, q):
        return None
    r = plans[0]
    if r.keep != (0, r.owned) or any((fill, recv) not in ((p, 0), (0, p))
                                     for fill, recv in ((r.fill_before, r.recv_before), (r.fill_after, r.recv_after))):
        return None
    return p, q


def _unbatched(layer, ctx: Context, func, a: dict):
    """``layer`` of an unbatched input (C, H, W), which PyTorch's convolutions take: as a batch
    of one (the halo plans and the backward kernels are written for (N, C, H, W)); None for a
    batched input."""
    x = a["input"]
    if x.dim() != 3:
        return None
    out = layer(ctx, func, {**a, "input": tagged(x.unsqueeze(0), part_of(x))})
    return tagged(out.squeeze(0), part_of(out))


def _as_autocast_runs_it(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
    """A convolution's tensors in autocast's lower precision where autocast is on for their
    device, as autocast runs a convolution: the spatial convolutions are autograd functions of
    their own, which autocast does not reach into, and their backward needs what they saved in
    the type the forward computed in (the halos then move in that type too). The casts are
    differentiable: the parameters' gradients come back in their own type."""
    device = x.device.type
    if device == "meta" or not x.is_floating_point() or not torch.is_autocast_enabled(device):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device)
    weight, bias = (t.to(dtype) if t is not None and t.is_floating_point() else t for t in (weight, bias))
    return tagged(x.to(dtype), part_of(x)), weight, bias


def conv2d(ctx: Context, func, a: dict):
    unbatched = _unbatched(conv2d, ctx, func, a)
    if unbatched is not None:
        return unbatched
    x, weight, bias = _as_autocast_runs_it(a["input"], a["weight"], a["bias"])
    stride, padding = band_plans.pair(a["stride"]), a["padding"]
    dilation, groups = band_plans.pair(a["dilation"]), a["groups"]
    part = part_of(x)
    kernel = tuple(weight.shape[-2:])
    if padding == "valid":
        pads = ((0, 0), (0, 0))
    elif padding == "same":  # stride 1 only (PyTorch's rule); the odd extra row goes after
        pads = tuple((d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2) for k, d in zip(kernel, dilation))
    else:
        pads = tuple((p, p) for p in band_plans.pair(padding))
    windows = tuple(Window(k, s, pb, pa, d) for k, s, (pb, pa), d in zip(kernel, stride, pads, dilation))
    spec, out_part = band_plans.window_spec(ctx, part, windows, halo.ZEROS)
    if ctx.dry:
        return tagged(F.conv2d(halo.receive_both(x, spec)[0], weight, bias, stride, 0, dilation, groups), out_part)
    padding = _band_padding(spec, windows, part.local_size[0])
    if padding is not None:
        return tagged(BandConv2d.apply(x, weight, bias, spec, padding, groups), out_part)
    return tagged(HaloConv2d.apply(x, weight, bias, spec, stride, dilation, groups), out_part)


def conv_transpose2d(ctx: Context, func, a: dict):
    """A transposed convolution: output row ``o`` gathers input rows ``i`` with
    ``i * stride + k * dilation = o + padding``; the band's output rows gather from a range of
    input rows, which the band receives (zeros beyond the image add nothing), then PyTorch's
    own transposed convolution of them (no padding) and a crop to the band's rows."""
    unbatched = _unbatched(conv_transpose2d, ctx, func, a)
    if unbatched is not None:
        return unbatched
    x, weight, bias = _as_autocast_runs_it(a["input"], a["weight"], a["bias"])
    stride, padding, extra = band_plans.pair(a["stride"]), band_plans.pair(a["padding"]), band_plans.pair(a["output_padding"])
    dilation, groups = band_plans.pair(a["dilation"]), a["groups"]
    part = part_of(x)
    kernel = tuple(weight.shape[-2:])
    plans, crops, out_lengths, output_padding = [], [], [], []
    for axis in (0, 1):
        length, parts = part.length(axis), ctx.grid.bands_along(axis)
        k, s, p, d = kernel[axis], stride[axis], padding[axis], dilation[axis]
        out_length = (length - 1) * s - 2 * p + d * (k - 1) + extra[axis] + 1
        out_bands = bands(out_length, parts)
        needed = []
        for o0, o1 in out_bands:
            first = -(-(o0 + p - d * (k - 1)) // s)
            last = (o1 - 1 + p) // s + 1
            needed.append((first, max(last, first + 1)))
        all_plans = band_plans.along(ctx, axis, bands(length, parts), needed, length)
        band = part.band[axis]
        (o0, o1), (first, last) = out_bands[band], needed[band]
        start = o0 + p - first * s  # the band's first output row in the local transposed convolution
        made = (last - first - 1) * s + d * (k - 1) + 1
        short = max(0, start + (o1 - o0) - made)  # rows no input reaches (bias only): PyTorch's output_padding
        if short >= max(s, d):
            raise SpatialError(f"{ctx.where()}: this transposed convolution is not supported in the spatial part "
                               f"(output rows beyond its inputs' reach)")
        plans.append(all_plans[band])
        crops.append((start, o1 - o0))
        out_lengths.append(out_length)
        output_padding.append(short)
    assembled = halo.exchange(x, band_plans.halo_spec(ctx, (plans[0], plans[1]), halo.ZEROS))
    out = F.conv_transpose2d(assembled, weight, bias, stride, 0, tuple(output_padding), groups, dilation)
    out = out.narrow(-2, crops[0][0], crops[0][1]).narrow(-1, crops[1][0], crops[1][1])
    return tagged(out, part.resized(out_lengths[0], out_lengths[1]))


# -- crops and pads ------------------------------------------------------------------------

def _region(ctx: Context, x: torch.Tensor, spans: Tuple[Optional[Tuple[int, int]], Optional[Tuple[int, int]]],
            fill: Any) -> torch.Tensor:
    """The map whose row ``o`` is the input's row ``o + offset`` (for ``(offset, length)`` of
    ``spans``: rows, then columns; None keeps an axis), fill beyond the image: a crop, a pad, or
    both. Each output band receives its rows from the input bands that hold them."""
    part = part_of(x)
    plans, out_lengths = [], []
    for axis, span in enumerate(spans):
        length, parts = part.length(axis), ctx.grid.bands_along(axis)
        offset, out_length = span if span is not None else (0, length)
        what = "row" if axis == 0 else "column"
        if out_length < parts:
            raise SpatialError(f"{ctx.where()}: the result has {out_length} {what}s, fewer than the {parts} "
                               f"{what} bands")
        needed = [(o0 + offset, o1 + offset) for o0, o1 in bands(out_length, parts)]
        all_plans = band_plans.along(ctx, axis, bands(length, parts), needed, length)
        if fill in (halo.REPLICATE, halo.REFLECT):
            _refuse_border_copies_beyond_the_border_bands(ctx, fill, all_plans, bands(length, parts), what)
        plans.append(all_plans[part.band[axis]])
        out_lengths.append(out_length)
    out = halo.exchange(x, band_plans.halo_spec(ctx, (plans[0], plans[1]), fill))
    if out is x:  # the band holds its result already: a new tensor, since its part differs
        out = x.view_as(x)
    return tagged(out, part.resized(out_lengths[0], out_lengths[1]))


def _refuse_border_copies_beyond_the_border_bands(ctx: Context, fill: str, plans, owned, what: str) -> None:
    """A replicate or reflect pad copies rows at the image's border, which only the border band
    holds: refuse a pad wider than the border band (a replicate pad wider than it would reach
    the next band; a reflect pad of p rows reads the p rows after the border row)."""
    if any((p.fill_before and b > 0) or (p.fill_after and b < len(plans) - 1) for b, p in enumerate(plans)):
        raise SpatialError(f"{ctx.where()}: a {fill} pad wider than the border {what} band is not supported in the "
                           f"spatial part: split the image into fewer {what} bands")
    if fill == halo.REFLECT:
        first, last = owned[0][1] - owned[0][0], owned[-1][1] - owned[-1][0]
        for border, pad, rows in (("first", plans[0].fill_before, first), ("last", plans[-1].fill_after, last)):
            if pad >= rows:
                raise SpatialError(f"{ctx.where()}: a reflect pad of {pad} {what}s reads the {pad} {what}s next to "
                                   f"the border one, but the {border} {what} band holds {rows}: split the image "
                                   f"into fewer {what} bands")


def _slice_extent(s: Optional[slice], length: int) -> Optional[Tuple[int, int]]:
    """A slice of the whole image's ``length`` rows as (offset, rows), None where it keeps all."""
    if s is None:
        return None
    start, stop, _ = slice(s.start, s.stop).indices(length)
    span = (start, max(0, stop - start))
    return None if span == (0, length) else span


def crop(ctx: Context, x: torch.Tensor, rows: Optional[slice], cols: Optional[slice]) -> torch.Tensor:
    """``x[..., rows, cols]`` for slices of the whole image (bounds as one process reads them).

    A slice with a step (``x[..., ::2, ::2]``, space-to-depth written by hand) is the
    contiguous crop, then a window of one pixel moved by the step: each output band receives
    the rows it picks from, as a strided pooling's does."""
    part = part_of(x)
    spans = (_slice_extent(rows, part.height), _slice_extent(cols, part.width))
    if spans != (None, None):
        x = _region(ctx, x, spans, halo.ZEROS)
    steps = tuple(1 if s is None or s.step is None else int(s.step) for s in (rows, cols))
    if steps == (1, 1):
        return x
    windows = tuple(Window(1, step) for step in steps)
    spec, out_part = band_plans.window_spec(ctx, part_of(x), windows, halo.ZEROS)
    return tagged(halo.exchange(x, spec)[..., ::steps[0], ::steps[1]], out_part)


def narrow(ctx: Context, func, a: dict):
    x, dim, start, length = a["input"], a["dim"], a["start"], a["length"]
    ndim = x.dim()
    if isinstance(start, torch.Tensor):
        start = int(start.item())
    d = int(dim) % ndim
    if d < ndim - 2:
        return tagged(torch.narrow(x, d, start, length), part_of(x))
    whole = part_of(x).length(d - (ndim - 2))
    start = start + whole if start < 0 else start
    window = slice(start, start + length)
    return crop(ctx, x, window if d == ndim - 2 else None, window if d == ndim - 1 else None)


def pad(ctx: Context, func, a: dict):
    """``F.pad``: the image's dimensions padded (or cropped, by negative amounts) as one process
    pads the whole image; the batch and channel dimensions padded as they are."""
    x, amounts, mode, value = a["input"], list(a["pad"]), a["mode"], a["value"]
    image = (amounts + [0] * 4)[:4]  # left, right, top, bottom
    rest = amounts[4:]
    if any(image):
        copies = ("replicate", "reflect", "circular")  # modes that copy the image's own rows
        if mode not in ("constant",) + copies or (mode in copies and min(image) < 0):
            raise SpatialError(f"{ctx.where()}: F.pad of the image dimensions with mode={mode!r}"
                               f"{' and a negative amount' if mode in copies else ''} is not supported in the "
                               "spatial part (constant, replicate, reflect or circular)")
        left, right, top, bottom = image
        if mode == "circular":
            x = _circular(ctx, _circular(ctx, x, 0, top, bottom), 1, left, right)
        else:
            fill = {"replicate": halo.REPLICATE, "reflect": halo.REFLECT}.get(mode) or (
                float(value) if value else halo.ZEROS)
            part = part_of(x)
            x = _region(ctx, x, ((-top, part.height + top + bottom), (-left, part.width + left + right)), fill)
    if any(rest):
        x = tagged(F.pad(x, [0, 0, 0, 0] + rest, mode=mode, value=value), part_of(x))
    return x


def _circular(ctx: Context, x: torch.Tensor, axis: int, before: int, after: int) -> torch.Tensor:
    """A circular pad along ``axis`` (0: rows, 1: columns): the first band's ``before`` pad
    rows are the image's last rows, the last band's ``after`` rows its first ones, which the
    far border band sends (:class:`halo.CircularPad`); the bands between take their
    neighbours' rows as for any pad."""
    if not (before or after):
        return x
    part = part_of(x)
    length, parts = part.length(axis), ctx.grid.bands_along(axis)
    what = "row" if axis == 0 else "column"
    owned, out = bands(length, parts), bands(length + before + after, parts)
    if before > out[0][1] - out[0][0] or after > out[-1][1] - out[-1][0]:
        raise SpatialError(f"{ctx.where()}: a circular pad wider than the border {what} band is not supported in "
                           f"the spatial part: split the image into fewer {what} bands")
    for pad, far, (h0, h1) in ((before, "last", owned[-1]), (after, "first", owned[0])):
        if pad > h1 - h0:
            raise SpatialError(f"{ctx.where()}: a circular pad of {pad} {what}s reads the image's {far} {pad} "
                               f"{what}s, but the {far} {what} band holds {h1 - h0}: split the image into fewer "
                               f"{what} bands")
    span = (-before, length + before + after)
    # The neighbours' rows as for a zero pad; at the borders, the zeros are replaced below.
    padded = _region(ctx, x, (span, None) if axis == 0 else (None, span), halo.ZEROS)
    band = part.band[axis]
    first, last = band == 0, band == parts - 1
    if not (first or last):
        return padded
    spec = halo.WrapSpec(x.dim() - 2 + axis, before, after, first, last, ctx.grid.far_border(ctx.rank, axis),
                         ctx.comm, ctx.label())
    return tagged(halo.circular_pad(x, padded, spec), part_of(padded))


# -- pooling -------------------------------------------------------------------------------

def max_pool2d(ctx: Context, func, a: dict):
    x = a["input"]
    kernel = band_plans.pair(a["kernel_size"])
    stride = a.get("stride")
    stride = kernel if stride is None or stride == [] or stride == () else band_plans.pair(stride)
    padding, dilation = band_plans.pair(a.get("padding", 0)), band_plans.pair(a.get("dilation", 1))
    ceil_mode, return_indices = a.get("ceil_mode", False), a.get("return_indices", False)
    if return_indices:
        raise SpatialError(f"{ctx.where()}: max pooling with return_indices=True is not supported in the spatial "
                           "part (the indices would be local to each rank's part)")
    if _the_whole_image(part_of(x), kernel, padding) and dilation == (1, 1):
        return reductions.window_over_the_image(ctx, x, maximum=True)
    windows = tuple(Window(k, s, p, p, d, bool(ceil_mode)) for k, s, p, d in zip(kernel, stride, padding, dilation))
    spec, out_part = band_plans.window_spec(ctx, part_of(x), windows, halo.NEG_INF)
    return tagged(F.max_pool2d(halo.exchange(x, spec), kernel, stride, 0, dilation), out_part)


def avg_pool2d(ctx: Context, func, a: dict):
    x = a["input"]
    kernel = band_plans.pair(a["kernel_size"])
    stride = a.get("stride")
    stride = kernel if stride is None or stride == [] or stride == () else band_plans.pair(stride)
    padding, ceil_mode = band_plans.pair(a.get("padding", 0)), a.get("ceil_mode", False)
    count_include_pad, divisor = a.get("count_include_pad", True), a.get("divisor_override")
    if _the_whole_image(part_of(x), kernel, padding):
        return reductions.window_over_the_image(ctx, x, maximum=False, divisor=divisor)
    windows = tuple(Window(k, s, p, p, ceil_mode=bool(ceil_mode)) for k, s, p in zip(kernel, stride, padding))
    spec, out_part = band_plans.window_spec(ctx, part_of(x), windows, halo.ZEROS)
    out = F.avg_pool2d(halo.exchange(x, spec), kernel, stride, 0, False, True, divisor)
    if divisor is None and ((not count_include_pad and any(padding)) or ceil_mode):
        # PyTorch divides by the pixels of each window that count: inside the image, or with
        # count_include_pad inside the image and its padding (a ceil_mode window reaching
        # beyond the padding counts only what it covers of them).
        counted = padding if count_include_pad else (0, 0)
        out = out / F.avg_pool2d(_counted_pixels(x, spec, counted), kernel, stride, 0, False, True)
    return tagged(out, out_part)


def _the_whole_image(part, kernel: Tuple[int, int], padding: Tuple[int, int]) -> bool:
    """Whether a pooling window of ``kernel`` is the whole image (one output pixel, of every
    input pixel): on row bands, all but one band would get no output row."""
    return tuple(kernel) == (part.height, part.width) and tuple(padding) == (0, 0)


def lp_pool2d(ctx: Context, func, a: dict):
    """LP pooling as PyTorch's F.lp_pool2d computes it: average pooling of the input's p-th
    powers, times the window's size, to the power 1/p; for p = +-inf, max pooling of the
    magnitudes (negated for -inf)."""
    x, p, kernel = a["input"], a["norm_type"], a["kernel_size"]
    part = part_of(x)
    pooled = {"kernel_size": kernel, "stride": a.get("stride"), "ceil_mode": a.get("ceil_mode", False)}
    if p in (math.inf, -math.inf):
        sign = 1.0 if p > 0 else -1.0
        out = max_pool2d(ctx, F.max_pool2d, dict(pooled, input=tagged(sign * x.abs(), part)))
        return tagged(sign * out, part_of(out))
    out = avg_pool2d(ctx, F.avg_pool2d, dict(pooled, input=tagged(x.pow(p), part)))
    kh, kw = band_plans.pair(kernel)
    return tagged((torch.sign(out) * F.relu(torch.abs(out))).mul(kw * kh).pow(1.0 / p), part_of(out))


def _counted_pixels(x: torch.Tensor, spec: halo.HaloSpec, padding: Tuple[int, int]) -> torch.Tensor:
    """The band's window input as a 1 x 1 map: 1 on pixels of the image (own or received) and on
    the ``padding`` (rows, columns) next to it, 0 on fill beyond. A pixel counts when both its
    row and its column do: the fill rows a neighbour sends with its columns (the corners of a
    2-D grid) are fill there too."""
    h, w = x.shape[-2:]

    def counted(plan: BandPlan, own: int, pad: int) -> torch.Tensor:
        if plan.moves_nothing:
            return x.new_ones(own)
        held = plan.recv_before + (plan.keep[1] - plan.keep[0]) + plan.recv_after
        before, after = min(plan.fill_before, pad), min(plan.fill_after, pad)
        return torch.cat([x.new_zeros(plan.fill_before - before), x.new_ones(before + held + after),
                          x.new_zeros(plan.fill_after - after)])

    rows, cols = counted(spec.rows, h, padding[0]), counted(spec.cols, w, padding[1])
    return (rows[:, None] * cols[None, :]).view(1, 1, rows.numel(), cols.numel())
