"""Every entry of the spatial op table, called on a split tensor at every dimension and on both
grid directions, against one process: exact (forward, and backward where it has a gradient),
or refused on every rank alike with one SpatialError; never silently wrong, never a rank that
fails alone. Anything not in the table is refused before it runs.

The group is simulated in one process (tests/spatial_sim.py: a thread per rank); the
multi-rank tests check the same layers over the real communicators.
"""

from __future__ import annotations

import collections.abc
import itertools
import math
import re
import types
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F

from hpdl.torch.spatial import dispatch, ops, ops_table, resampling
from hpdl.torch.spatial.context import Context
from hpdl.torch.spatial.geometry import Grid, Part, SpatialError
from hpdl.torch.spatial.ops import Kind
from hpdl.torch.spatial.parts import channels_last_part_of, part_of, tagged
from spatial_sim import assemble, assemble_gradients, equal, one_process_gradient, refused_alike, run_parts

GRIDS = [(2, 1), (1, 2)]
DIMS = [0, 1, 2, 3, -1, -2]
SHAPE = (2, 3, 7, 6)  # 7 rows and 6 columns: uneven bands on 2 ranks one way, even the other

_gen = torch.Generator().manual_seed(0)
X = torch.rand(SHAPE, generator=_gen, dtype=torch.float64) * 0.8 + 0.1
CONST = torch.full((3, 1, 1), 0.7, dtype=torch.float64)  # constant along the image: fine beside a part
IMAGE = torch.rand(7, 6, generator=_gen, dtype=torch.float64)  # a replicated image-sized tensor: refused
WHOLE = torch.rand(SHAPE, generator=_gen, dtype=torch.float64)  # a whole map, the same on every rank: refused

# Read the object, not the values: their results differ between any two tensors.
IDENTITY = {"Tensor.data_ptr", "Tensor.untyped_storage", "Tensor.__hash__", "Tensor.__repr__", "Tensor.__format__",
            "Tensor.__reduce_ex__", "Tensor.__deepcopy__", "Tensor.register_hook", "Tensor.retain_grad",
            "Tensor.backward", "Tensor.__setstate__", "x._cdata", "x._version", "x.grad_fn", "x._grad_fn",
            "x._base", "x.output_nr", "x._backward_hooks", "x._post_accumulate_grad_hooks", "Tensor._is_view",
            "Tensor.is_set_to", "Tensor.dim_order", "x.is_leaf", "x.requires_grad", "x.retains_grad"}
# Their values are not defined (torch.empty): only the shape and the part are compared.
UNDEFINED_VALUES = ("empty",)
# They need a GPU; or restore a pickled tensor, which no model does in its forward.
NEEDS_A_GPU = {"Tensor.cuda", "Tensor.pin_memory"}
NOT_IN_A_FORWARD = {"Tensor.__setstate__"}
# Random: their numbers are each band's own (test_spatial.py checks them); here only that they run.
RANDOM_KINDS = (Kind.RANDOM, Kind.RANDOM_CHANNELS)


def _y(t):  # another part of the same map
    return t * 0.5 + 0.25


def _ints(t):
    return (t * 10).long()


def _bools(t):
    return t > 0.5


def _elementwise_calls(f) -> List[Tuple[str, Callable]]:
    return [
        ("x", lambda t: f(t)), ("x, y", lambda t: f(t, _y(t))), ("x, 0.5", lambda t: f(t, 0.5)),
        ("x, const", lambda t: f(t, CONST)), ("x, image", lambda t: f(t, IMAGE)), ("const, x", lambda t: f(CONST, t)),
        ("x, y, y", lambda t: f(t, _y(t), _y(t))), ("x, y, 0.5", lambda t: f(t, _y(t), 0.5)),
        ("x, 0.2, 0.6", lambda t: f(t, 0.2, 0.6)), ("ints", lambda t: f(_ints(t))),
        ("ints, ints", lambda t: f(_ints(t), _ints(_y(t)))), ("ints, 2", lambda t: f(_ints(t), 2)),
        ("bools", lambda t: f(_bools(t))), ("bools, bools", lambda t: f(_bools(t), _bools(_y(t)))),
        ("mask, x, y", lambda t: f(_bools(t), t, _y(t))), ("x, mask, 0", lambda t: f(t, _bools(t), 0.0)),
        ("2.0, x", lambda t: f(2.0, t)),
        ("2, 3", lambda t: f(2, 3)), ("10, (2, 3)", lambda t: f(10, (2, 3))), ("5", lambda t: f(5)),
        ("0., 1., (2,)", lambda t: f(0.0, 1.0, (2,))), ("probabilities, 2", lambda t: f(torch.ones(4) / 4, 2)),
        ("x, 3", lambda t: f(t, 3)), ("x, weight per channel", lambda t: f(t, torch.full((3,), 0.25, dtype=t.dtype))),
    ]


def _in_place(f, calls):
    return [(name, (lambda call: lambda t: call(t.clone()))(call)) for name, call in calls]


def _along_calls(f, dims=DIMS) -> List[Tuple[str, Callable]]:
    calls = [("x", lambda t: f(t))]
    for d in dims:
        calls += [
            (f"x, {d}", lambda t, d=d: f(t, d)), (f"x, dim={d}", lambda t, d=d: f(t, dim=d)),
            (f"x, 1, {d}", lambda t, d=d: f(t, 1, d)), (f"x, 2, {d}", lambda t, d=d: f(t, 2, d)),
            (f"x, [{d}]", lambda t, d=d: f(t, [d])), (f"x, {d}, 0", lambda t, d=d: f(t, d, 0)),
            (f"x, 0.5, {d}", lambda t, d=d: f(t, 0.5, d)),
            (f"x, {d}, idx", lambda t, d=d: f(t, d, torch.tensor([0, 1]))),
            (f"x, {d}, idx, src", lambda t, d=d: f(t, d, torch.zeros_like(t, dtype=torch.long), _y(t))),
            (f"x, {d}, idx, src, sum", lambda t, d=d: f(t, d, torch.zeros_like(t, dtype=torch.long), _y(t), "sum")),
            (f"x, {d}, idx like x", lambda t, d=d: f(t, d, torch.zeros_like(t, dtype=torch.long))),
            # a whole map read by a part's index: each band would read the map's first rows
            (f"whole, {d}, idx of x", lambda t, d=d: f(WHOLE, d, (t * 2).long())),
            # an index and a source of one pixel: the image's first (a scatter writes it alone)
            (f"x, {d}, idx 1x1, src 1x1", lambda t, d=d: f(t, d, torch.zeros((2, 1, 1, 1), dtype=torch.long),
                                                           torch.full((2, 1, 1, 1), 9.0, dtype=t.dtype))),
            (f"x, {d}, 2, 1", lambda t, d=d: f(t, d, 2, 1)), (f"x, 0.5, {d}, True", lambda t, d=d: f(t, 0.5, True)),
            (f"x, {d}, idx1, 0.5", lambda t, d=d: f(t, d, torch.tensor([0]), 0.5)),
            (f"x, {d}, idx1, src1", lambda t, d=d: f(t, d, torch.tensor([0]), t.narrow(d, 0, 1))),
            (f"x, idx, {d}", lambda t, d=d: f(t, torch.zeros_like(t, dtype=torch.long), d)),
            (f"bools, {d}", lambda t, d=d: f(_bools(t), d)), (f"ints, {d}", lambda t, d=d: f(_ints(t), d)),
            (f"x, y, {d}", lambda t, d=d: f(t, _y(t), d)), (f"x, y, dim={d}", lambda t, d=d: f(t, _y(t), dim=d)),
            (f"x, 2, dim={d}", lambda t, d=d: f(t, 2, dim=d)), (f"x, 1, dim={d}", lambda t, d=d: f(t, 1, dim=d)),
            (f"x, [1, rest], {d}", lambda t, d=d: f(t, [1, t.shape[d] - 1], d)),
            (f"x, 1, [{d}, other]", lambda t, d=d: f(t, 1, [d, (d + 1) % 4])),
            (f"x, p=2, dim={d}", lambda t, d=d: f(t, p=2, dim=d)),
            (f"x, 0.5, dim={d}", lambda t, d=d: f(t, 0.5, dim=d)),
        ]
    return calls


def _shape_calls(f) -> List[Tuple[str, Callable]]:
    calls = [("x", lambda t: f(t)), ("x, y", lambda t: f(t, _y(t))), ("const, x", lambda t: f(CONST, t)),
             ("x, (n, h, w)", lambda t: f(t, t.shape[0] * t.shape[1], t.shape[2], t.shape[3])),
             ("x, (b, c, h, w)", lambda t: f(t, t.shape)), ("x, -1", lambda t: f(t, -1)),
             ("x, (b, -1)", lambda t: f(t, t.shape[0], -1)),
             ("x, (b, 3, 1, h, w)", lambda t: f(t, t.shape[0], 3, 1, t.shape[2], t.shape[3])),
             ("x, 1, (3, 1)", lambda t: f(t, 1, (3, 1))), ("x, 2, (h, 1)", lambda t: f(t, 2, (t.shape[2], 1))),
             ("x, 0, 1", lambda t: f(t, 0, 1)), ("x, 1, 2", lambda t: f(t, 1, 2)), ("x, 2, 3", lambda t: f(t, 2, 3)),
             ("x, 1, 2, 1, 1", lambda t: f(t, 1, 2, 1, 1)), ("x, 1, 1, 2, 1", lambda t: f(t, 1, 1, 2, 1)),
             ("x, (2, 2, 3, h, w)", lambda t: f(t, 2, 2, 3, t.shape[2], t.shape[3])),
             ("x[:, :1], (-1, 3, -1, -1)", lambda t: f(t[:, :1], -1, 3, -1, -1)),
             ("x, (1, 2, 1, 1)", lambda t: f(t, (1, 2, 1, 1)))]
    for d in DIMS + [4, -5]:
        calls += [(f"x, {d}", lambda t, d=d: f(t, d)), (f"x[:1], {d}", lambda t, d=d: f(t[:1], d))]
    for a, b in itertools.permutations(range(4), 2):
        calls.append((f"x, {a}, {b}", lambda t, a=a, b=b: f(t, a, b)))
    for order in itertools.permutations(range(4)):
        calls.append((f"x, {order}", lambda t, order=order: f(t, order)))
    return calls


def _index_calls() -> List[Tuple[str, Callable]]:
    def setting(index, value):
        def call(t):
            u = t.clone()
            u[index] = value
            return u
        return call

    gets = [(0,), (slice(None), 1), (Ellipsis, slice(1, 3), slice(None)), (Ellipsis, slice(None), slice(2, None)),
            (slice(None), slice(None), slice(1, -1)), (Ellipsis, 0), (Ellipsis, slice(None, None, 2), slice(None)),
            (slice(None), [0, 2]), (None,), (Ellipsis, None), (slice(None), None), (0, Ellipsis, slice(0, 1)),
            (Ellipsis, slice(-3, None), slice(None, -1)), (Ellipsis, slice(5, 100), slice(None)),
            (Ellipsis, slice(0, 0), slice(None)), (torch.tensor([1, 0]),)]
    calls = [(f"x[{index}]", lambda t, index=index: t[index]) for index in gets]
    calls += [("x[mask]", lambda t: t[t > 0.5]),
              ("x[..., :h - 1, :]", lambda t: t[..., :t.shape[-2] - 1, :]),
              ("x[..., :h, :w]", lambda t: t[..., :t.shape[-2], :t.shape[-1]]),
              ("x[..., 1:w, :]", lambda t: t[..., 1:t.shape[-1], :])]
    calls += [(f"x[{index}] = 0", setting(index, 0.0)) for index in
              [(slice(None), 0), (Ellipsis, 0, slice(None)), (Ellipsis, slice(1, 3), slice(None)), (0,)]]
    return calls


def tied(t):
    """floor(3 t): many equal values, across the bands; the gradient passed to ``t`` as it is."""
    return t + (torch.floor(t.detach() * 3) - t.detach())


def with_nan(t):
    """NaN where ``t`` > 0.85 (in several places, across the bands); the gradient passed to ``t``."""
    return t + torch.where(t.detach() > 0.85, torch.full_like(t, float("nan")), torch.zeros_like(t))


def _handler_calls() -> Dict[Any, List[Tuple[str, Callable]]]:
    w = torch.rand(4, 3, 3, 3, generator=_gen, dtype=torch.float64)
    wt = torch.rand(3, 2, 3, 3, generator=_gen, dtype=torch.float64)
    wt2 = torch.rand(3, 2, 2, 2, generator=_gen, dtype=torch.float64)
    b = torch.rand(4, generator=_gen, dtype=torch.float64)
    rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    four = lambda t: torch.cat([t, t[:, :1]], 1)  # noqa: E731 - four channels for pixel_shuffle
    calls = {
        torch.conv2d: [("pad 1", lambda t: F.conv2d(t, w, b, padding=1)), ("stride 2", lambda t: F.conv2d(t, w, stride=2)),
                       ("dilation 2", lambda t: F.conv2d(t, w, padding=2, dilation=2)),
                       ("same", lambda t: F.conv2d(t, w, padding="same")),
                       ("groups", lambda t: F.conv2d(t, w[:3, :1], groups=3, padding=1))],
        torch.conv_transpose2d: [
            ("3x3 s1 p1", lambda t: F.conv_transpose2d(t, wt, padding=1)),
            ("3x3 s2 p1 op1", lambda t: F.conv_transpose2d(t, wt, stride=2, padding=1, output_padding=1)),
            ("2x2 s2", lambda t: F.conv_transpose2d(t, wt2, stride=2)),
            ("3x3 s2 bias", lambda t: F.conv_transpose2d(t, wt, torch.ones(2, dtype=torch.float64), stride=2)),
            ("3x3 s3 d2", lambda t: F.conv_transpose2d(t, wt, stride=3, dilation=2)),
            ("groups", lambda t: F.conv_transpose2d(t, wt[:, :1], stride=2, groups=3))],
        F.max_pool2d: [("2", lambda t: F.max_pool2d(t, 2)), ("3 s1 p1", lambda t: F.max_pool2d(t, 3, 1, 1)),
                       ("ceil", lambda t: F.max_pool2d(t, 3, 2, ceil_mode=True)),
                       ("indices", lambda t: F.max_pool2d(t, 2, return_indices=True)),
                       ("max whole image ties", lambda t: F.max_pool2d(tied(t), t.shape[-2:]))],
        torch.max_pool2d: [("2", lambda t: torch.max_pool2d(t, 2))],
        F.lp_pool2d: [("lp 2 of 3 s2", lambda t: F.lp_pool2d(t, 2, 3, 2)),
                      ("lp 1.5 of 2 x 3 ceil", lambda t: F.lp_pool2d(t, 1.5, (2, 3), ceil_mode=True)),
                      ("lp inf of 2", lambda t: F.lp_pool2d(t, float("inf"), 2)),
                      ("lp -inf of 3 s1", lambda t: F.lp_pool2d(t, -float("inf"), 3, 1))],
        F.avg_pool2d: [("2", lambda t: F.avg_pool2d(t, 2)), ("3 s1 p1", lambda t: F.avg_pool2d(t, 3, 1, 1)),
                       ("no pad count", lambda t: F.avg_pool2d(t, 3, 1, 1, count_include_pad=False)),
                       ("divisor", lambda t: F.avg_pool2d(t, 3, 2, 1, divisor_override=2)),
                       ("ceil", lambda t: F.avg_pool2d(t, 2, ceil_mode=True)),
                       ("ceil 3 s2 p1", lambda t: F.avg_pool2d(t, 3, 2, 1, ceil_mode=True)),
                       ("ceil 4 s3 p2 no pad count", lambda t: F.avg_pool2d(t, 4, 3, 2, ceil_mode=True,
                                                                            count_include_pad=False)),
                       ("ceil 3 s2 divisor", lambda t: F.avg_pool2d(t, 3, 2, ceil_mode=True, divisor_override=5)),
                       ("avg whole image", lambda t: F.avg_pool2d(t, t.size()[2:])),
                       ("avg whole image divisor", lambda t: F.avg_pool2d(t, (7, 6), divisor_override=5))],
        F.batch_norm: [("train", lambda t: F.batch_norm(t, rm.clone(), rv.clone(), training=True)),
                       ("eval", lambda t: F.batch_norm(t, rm, rv))],
        F.adaptive_avg_pool2d: [("1", lambda t: F.adaptive_avg_pool2d(t, 1)),
                                ("2", lambda t: F.adaptive_avg_pool2d(t, 2)),
                                ("3 x 2", lambda t: F.adaptive_avg_pool2d(t, (3, 2))),
                                ("5 x 4 (overlapping windows)", lambda t: F.adaptive_avg_pool2d(t, (5, 4))),
                                ("9 x 8 (more than the image)", lambda t: F.adaptive_avg_pool2d(t, (9, 8))),
                                ("None x 1", lambda t: F.adaptive_avg_pool2d(t, (None, 1)))],
        # Ties (values floor(3 t), the gradient passed to t as it is): the first maximum in the
        # whole image's row-major order takes max pooling's gradient; amax shares it evenly.
        F.group_norm: [("3 groups", lambda t: F.group_norm(t, 3)), ("1 group affine", lambda t: F.group_norm(
                           t, 1, torch.linspace(0.5, 1.5, 3, dtype=t.dtype), torch.linspace(-1, 1, 3, dtype=t.dtype))),
                       ("2 groups of 3 channels", lambda t: F.group_norm(t, 2))],
        F.instance_norm: [("plain", lambda t: F.instance_norm(t)),
                          ("affine", lambda t: F.instance_norm(t, weight=torch.linspace(0.5, 1.5, 3, dtype=t.dtype),
                                                               bias=torch.linspace(-1, 1, 3, dtype=t.dtype))),
                          ("running", lambda t: F.instance_norm(t, rm.clone(), rv.clone(), momentum=0.3)),
                          ("eval", lambda t: F.instance_norm(t, rm, rv, use_input_stats=False))],
        torch.var: [("(2, 3)", lambda t: torch.var(t, (2, 3))), ("(1, 2, 3) biased", lambda t: torch.var(t, (1, 2, 3),
                                                                                                   correction=0)),
                    ("(-1, -2) keepdim", lambda t: torch.var(t, (-1, -2), keepdim=True)), ("all", lambda t: torch.var(t)),
                    ("1", lambda t: torch.var(t, 1)), ("2", lambda t: torch.var(t, 2))],
        torch.Tensor.var: [("(2, 3) unbiased=False", lambda t: t.var((2, 3), unbiased=False))],
        torch.std: [("(2, 3) keepdim", lambda t: torch.std(t, (2, 3), keepdim=True)),
                    ("AdaIN", lambda t: (t - t.mean((2, 3), keepdim=True)) / torch.std(t, (2, 3), keepdim=True))],
        torch.Tensor.std: [("(2, 3)", lambda t: t.std((2, 3))), ("0", lambda t: t.std(0))],
        torch.var_mean: [("(2, 3)", lambda t: torch.var_mean(t, (2, 3))),
                         ("(0, 2, 3) keepdim", lambda t: torch.var_mean(t, (0, 2, 3), keepdim=True))],
        torch.std_mean: [("(2, 3) correction 2", lambda t: torch.std_mean(t, (2, 3), correction=2))],
        F.adaptive_max_pool2d: [("1", lambda t: F.adaptive_max_pool2d(t, 1)),
                                ("(1, 1) ties", lambda t: F.adaptive_max_pool2d(tied(t), (1, 1))),
                                ("NaN", lambda t: F.adaptive_max_pool2d(with_nan(t), 1)),
                                ("2", lambda t: F.adaptive_max_pool2d(t, 2)),
                                ("indices", lambda t: F.adaptive_max_pool2d(t, 1, return_indices=True))],
        torch.amax: [("(2, 3)", lambda t: torch.amax(t, (2, 3))), ("(-1, -2) keepdim", lambda t: torch.amax(t, (-1, -2), True)),
                     ("(1, 2, 3) ties", lambda t: torch.amax(tied(t), (1, 2, 3))), ("all", lambda t: torch.amax(t)),
                     ("2", lambda t: torch.amax(t, 2)), ("1", lambda t: torch.amax(t, 1))],
        torch.Tensor.amax: [("(2, 3) ties", lambda t: tied(t).amax((2, 3))), ("NaN", lambda t: with_nan(t).amax())],
        torch.amin: [("(2, 3)", lambda t: torch.amin(t, (2, 3))), ("(1, 2, 3) ties", lambda t: torch.amin(tied(t), (1, 2, 3))),
                     ("all NaN", lambda t: torch.amin(with_nan(t))), ("dim 1", lambda t: torch.amin(t, 1)),
                     ("dim 3", lambda t: torch.amin(t, 3))],
        torch.Tensor.amin: [("(-2, -1) keepdim ties", lambda t: tied(t).amin((-2, -1), keepdim=True))],
        torch.pixel_shuffle: [("2", lambda t: F.pixel_shuffle(four(t), 2))],
        # 6 x 6 and 6 x 4 of the 7 x 6 image: blocks straddling the bands of 2 ranks (3 output rows
        # of 6 input rows: 2 and 1, from bands of 3 and 3).
        torch.pixel_unshuffle: [("2", lambda t: F.pixel_unshuffle(t[..., :6, :], 2)),
                                ("3", lambda t: F.pixel_unshuffle(t[..., :6, :], 3)),
                                ("2 of 6 x 4", lambda t: F.pixel_unshuffle(t[..., :6, :4], 2)),
                                ("2 of 2 x 2", lambda t: F.pixel_unshuffle(t[..., :2, :2], 2))],
        F.interpolate: [("nearest 2", lambda t: F.interpolate(t, scale_factor=2)),
                        ("bilinear 3", lambda t: F.interpolate(t, scale_factor=3, mode="bilinear")),
                        ("bicubic 2", lambda t: F.interpolate(t, scale_factor=2, mode="bicubic")),
                        ("size from shape", lambda t: F.interpolate(t, size=(t.shape[-2] * 2, t.shape[-1] * 2),
                                                                     mode="bilinear")),
                        ("size of the map", lambda t: F.interpolate(t, size=t.shape[-2:], mode="bilinear")),
                        ("size 2h+1", lambda t: F.interpolate(t, size=(2 * t.shape[-2] + 1, 2 * t.shape[-1]))),
                        ("size 14 x 12", lambda t: F.interpolate(t, size=(14, 12), mode="bilinear")),
                        ("1.5", lambda t: F.interpolate(t, scale_factor=1.5)),
                        ("nearest 0.5", lambda t: F.interpolate(t, scale_factor=0.5)),
                        ("nearest-exact 1/3", lambda t: F.interpolate(t, scale_factor=1 / 3, mode="nearest-exact")),
                        ("bilinear 0.5", lambda t: F.interpolate(t, scale_factor=0.5, mode="bilinear")),
                        ("bicubic 0.5 x 1", lambda t: F.interpolate(t, scale_factor=(0.5, 1.0), mode="bicubic")),
                        ("bilinear to 3 x 2", lambda t: F.interpolate(t[..., :6, :], size=(3, 2), mode="bilinear")),
                        ("bilinear to 3 x 3 of 7 x 6", lambda t: F.interpolate(t, size=(3, 3), mode="bilinear")),
                        ("align", lambda t: F.interpolate(t, scale_factor=2, mode="bilinear", align_corners=True)),
                        ("bilinear 1.5", lambda t: F.interpolate(t, scale_factor=1.5, mode="bilinear")),
                        ("bicubic 1.7 x 2.5", lambda t: F.interpolate(t, scale_factor=(1.7, 2.5), mode="bicubic")),
                        ("nearest-exact 1.3", lambda t: F.interpolate(t, scale_factor=1.3, mode="nearest-exact")),
                        ("nearest to 11 x 9", lambda t: F.interpolate(t, size=(11, 9))),
                        ("bilinear to 5 x 4", lambda t: F.interpolate(t, size=(5, 4), mode="bilinear")),
                        ("bicubic to 4 x 5", lambda t: F.interpolate(t, size=(4, 5), mode="bicubic")),
                        ("bilinear 0.6 recomputed", lambda t: F.interpolate(t, scale_factor=0.6, mode="bilinear",
                                                                            recompute_scale_factor=True)),
                        ("align to 13 x 10", lambda t: F.interpolate(t, size=(13, 10), mode="bilinear",
                                                                     align_corners=True)),
                        ("align bicubic to 5 x 3", lambda t: F.interpolate(t, size=(5, 3), mode="bicubic",
                                                                           align_corners=True)),
                        ("align bicubic 2", lambda t: F.interpolate(t, scale_factor=2, mode="bicubic",
                                                                    align_corners=True)),
                        ("to 2 x 1", lambda t: F.interpolate(t, size=(2, 1), mode="bilinear")),
                        ("antialias", lambda t: F.interpolate(t, size=(4, 3), mode="bilinear", antialias=True)),
                        ("area", lambda t: F.interpolate(t, size=(4, 3), mode="area")),
                        ("area 1 x 0.5", lambda t: F.interpolate(t, scale_factor=(1, 0.5), mode="area")),
                        ("area 2 x 3", lambda t: F.interpolate(t, scale_factor=(2, 3), mode="area"))],
        F.pad: [("zeros 1", lambda t: F.pad(t, (1, 1, 1, 1))), ("value 2 uneven", lambda t: F.pad(t, (0, 2, 1, 0), value=2.0)),
                ("crop -1", lambda t: F.pad(t, (-1, 0, 0, -1))), ("replicate", lambda t: F.pad(t, (1, 2, 2, 1),
                                                                                               mode="replicate")),
                ("reflect", lambda t: F.pad(t, (1, 1, 1, 1), mode="reflect")),
                ("reflect 2 uneven", lambda t: F.pad(t, (2, 0, 1, 2), mode="reflect")),
                ("circular", lambda t: F.pad(t, (1, 1, 1, 1), mode="circular")),
                ("circular uneven", lambda t: F.pad(t, (0, 2, 2, 1), mode="circular")),
                ("reflect -1", lambda t: F.pad(t, (-1, 1, 1, 1), mode="reflect")),
                ("channels", lambda t: F.pad(t, (0, 0, 0, 0, 1, 1))),
                ("diff of shapes", lambda t: F.pad(t, [(t.shape[-1] + 2 - t.shape[-1]) // 2, 1, 0, 1]))],
    }
    calls[torch.mean] = [("(2, 3)", lambda t: torch.mean(t, (2, 3))), ("1", lambda t: torch.mean(t, 1)),
                         ("2", lambda t: torch.mean(t, 2)), ("all", lambda t: torch.mean(t)),
                         ("keepdim", lambda t: torch.mean(t, (-1, -2), keepdim=True))]
    calls[torch.Tensor.mean] = [("(2, 3)", lambda t: t.mean((2, 3))), ("1", lambda t: t.mean(1))]
    calls[torch.sum] = [("(2, 3)", lambda t: torch.sum(t, (2, 3))), ("0", lambda t: torch.sum(t, 0)),
                        ("3", lambda t: torch.sum(t, 3)), ("all", lambda t: torch.sum(t))]
    calls[torch.Tensor.sum] = [("(2, 3)", lambda t: t.sum((2, 3))), ("1 keepdim", lambda t: t.sum(1, keepdim=True)),
                               ("3 keepdim", lambda t: t.sum(3, keepdim=True)),
                               ("2 keepdim", lambda t: t.sum(-2, keepdim=True) * 2),
                               ("IMDN's mean", lambda t: t.sum(3, keepdim=True).sum(2, keepdim=True) / (t.size(2) * t.size(3))),
                               ("(1, 3) keepdim, then 2", lambda t: t.sum((1, 3), keepdim=True).mean(2, keepdim=True)),
                               ("dtype", lambda t: t.sum(dtype=torch.float32))]
    no_first_channel = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64).view(1, 3, 1, 1)  # a norm of 0
    calls[torch.linalg.vector_norm] = [
        ("(2, 3)", lambda t: torch.linalg.vector_norm(t, dim=(2, 3))),
        ("1 over all", lambda t: torch.linalg.vector_norm(t - 0.5, 1)),
        ("0.5 (-1, -2) keepdim", lambda t: torch.linalg.vector_norm(t - 0.5, 0.5, (-1, -2), keepdim=True)),
        ("3 of a map of zeros", lambda t: torch.linalg.vector_norm(t * no_first_channel, 3, (2, 3))),
        ("1.5 (1, 2, 3)", lambda t: torch.linalg.vector_norm(t, 1.5, (1, 2, 3))),
        ("inf", lambda t: torch.linalg.vector_norm(t, float("inf"), (2, 3))), ("1", lambda t: torch.linalg.vector_norm(t, 2, 1)),
        ("2", lambda t: torch.linalg.vector_norm(t, 2, 2))]
    calls[torch.norm] = [("p=2 (2, 3) keepdim", lambda t: t * torch.norm(t * no_first_channel, p=2, dim=(2, 3), keepdim=True)),
                         ("fro", lambda t: torch.norm(t)), ("nuc", lambda t: torch.norm(t, "nuc", (2, 3)))]
    calls[torch.logsumexp] = [("lse (2, 3)", lambda t: torch.logsumexp(t * 5, (2, 3))),
                              ("lse (1, 2, 3) keepdim", lambda t: t * torch.logsumexp(t, (1, 2, 3), keepdim=True)),
                              ("lse of -inf and inf", lambda t: torch.logsumexp(t.masked_fill(t > 0.8, float("inf"))
                                                                                .masked_fill(t < 0.3, -float("inf")),
                                                                                (-2, -1))),
                              ("lse 1", lambda t: torch.logsumexp(t, 1)), ("lse 3", lambda t: torch.logsumexp(t, 3))]
    calls[torch.Tensor.logsumexp] = [("lse method", lambda t: t.logsumexp((2, 3)))]
    calls[torch.Tensor.norm] = [("(2, 3)", lambda t: t.norm(dim=(2, 3))), ("1", lambda t: t.norm(dim=1))]
    for f in (torch.narrow, torch.Tensor.narrow):
        calls[f] = [(f"{d}, {s}, {n}", lambda t, d=d, s=s, n=n: f(t, d, s, n))
                    for d in DIMS for s, n in ((0, 1), (1, 2), (-2, 2), (0, 5))]
    return calls


def _calls(func, op, dims=DIMS) -> List[Tuple[str, Callable]]:
    spelled = ops.spelled(func)
    if op.kind is Kind.HANDLER:
        return HANDLER_CALLS[func]
    if op.kind is Kind.INDEX:
        return _index_calls()
    if isinstance(func, types.GetSetDescriptorType):  # an attribute
        name = func.__name__
        return [(f"x.{name}", lambda t, name=name: getattr(t, name))]
    in_place = spelled.endswith("_") and not spelled.endswith("__")
    if op.kind in (Kind.ELEMENTWISE, Kind.LIKE, Kind.CONVERT, *RANDOM_KINDS, Kind.REFUSED, Kind.METADATA,
                   Kind.PART_ATTRIBUTE):
        calls = _elementwise_calls(func) + [("x, torch.float32", lambda t: func(t, torch.float32)),
                                            ("x, {}", lambda t: func(t, {})), ("x, ''", lambda t: func(t, "")),
                                            ("x needing grad, hook", lambda t: func(t.detach().requires_grad_(),
                                                                                    lambda g: g)),
                                            ("x needing grad", lambda t: func(t.detach().requires_grad_())),
                                            ("x * 1, ones", lambda t: func(t.detach().requires_grad_() * 1,
                                                                           torch.ones_like(t))),
                                            ("x, y.type", lambda t: func(t, _y(t).float())),
                                            ("x, shape", lambda t: func(t, t.shape[1:])),
                                            ("x, 3, 3", lambda t: func(t, torch.ones(3, t.shape[-1],
                                                                                     dtype=t.dtype)))]
        if op.kind is not Kind.ELEMENTWISE:  # element-wise calls take no dimension
            calls += _along_calls(func, dims)[1:]
        return _in_place(func, calls) if in_place else calls
    if op.kind in (Kind.ALONG, Kind.CONCAT):
        if op.kind is Kind.CONCAT:
            return [(f"[x, y], {d}", lambda t, d=d: func([t, _y(t)], d)) for d in dims] + \
                [("[x, y]", lambda t: func([t, _y(t)])), ("[x, image]", lambda t: func([t, IMAGE.expand_as(t)], 1))]
        calls = _along_calls(func, dims)
        return _in_place(func, calls) if in_place else calls
    if op.kind in (Kind.RESHAPE, Kind.EXPAND, Kind.PERMUTE):
        calls = _shape_calls(func)
        return _in_place(func, calls) if in_place else calls
    if op.kind is Kind.SHAPE:
        return [("x", lambda t: func(t))] + [(f"x, {d}", lambda t, d=d: func(t, d)) for d in dims]
    if op.kind in (Kind.NEW, Kind.FACTORY):
        first = (lambda t: (t,)) if op.kind is Kind.NEW else (lambda t: ())
        return [("shape", lambda t: func(*first(t), t.shape)),
                ("h, w", lambda t: func(*first(t), t.shape[-2], t.shape[-1])),
                ("2, 3", lambda t: func(*first(t), 2, 3)), ("h", lambda t: func(*first(t), t.shape[-2])),
                ("data", lambda t: func(*first(t), [[0.4], [0.5]])), ("a part's values", lambda t: func(*first(t), t)),
                ("w, h", lambda t: func(*first(t), t.shape[-1], t.shape[-2])),
                ("shape, 2.0", lambda t: func(*first(t), t.shape, 2.0)),
                ("(2, 3), 2.0", lambda t: func(*first(t), (2, 3), 2.0))]
    raise AssertionError(f"no calls for {spelled} ({op.kind})")


HANDLER_CALLS = _handler_calls()


def _check_call(func, name: str, call: Callable, grid: Tuple[int, int], x: torch.Tensor = X) -> str:
    """'skip' (one process refuses the call too), 'exact' or 'refused'; raise when neither."""
    spelled = ops.spelled(func)
    try:
        expected = call(x.clone())
    except Exception:  # noqa: BLE001 - not a call one process makes: no comparison
        return "skip"
    outcomes = run_parts(grid, call, x)
    errors = [o.error for o in outcomes]
    if all(e is not None for e in errors):
        message = refused_alike(outcomes)
        if message is None:
            raise AssertionError(f"{spelled}({name}) on {grid}: not refused alike on every rank: "
                                 + "; ".join(f"{type(e).__name__}: {e}" for e in errors))
        return "refused"
    if any(e is not None for e in errors):
        raise AssertionError(f"{spelled}({name}) on {grid}: some ranks failed, others did not: "
                             + "; ".join("ok" if e is None else f"{type(e).__name__}: {e}" for e in errors))
    op = ops.lookup(func)
    if op.kind in RANDOM_KINDS:  # replicated random numbers: the same on every rank
        values = [o.value for o in outcomes]
        if isinstance(values[0], torch.Tensor) and part_of(values[0]) is None \
                and channels_last_part_of(values[0]) is None:
            assert all(torch.equal(v, values[0]) for v in values), f"{spelled}({name}) on {grid}: ranks drew differently"
        return "exact"
    if spelled in IDENTITY or any(word in spelled for word in UNDEFINED_VALUES):
        return "exact"
    got = assemble([_listed(o.value) for o in outcomes])
    expected = _listed(expected)
    if not equal(got, expected, loose="y.type" in name):
        raise AssertionError(f"{spelled}({name}) on {grid}: silently wrong: got {_brief(got)}, one process "
                             f"{_brief(expected)}")
    return "exact"


def _listed(value: Any) -> Any:
    """An iterator's items (``iter(x)``), so that they can be compared."""
    return list(value) if isinstance(value, collections.abc.Iterator) else value


def _brief(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {list(value.shape)}"
    return repr(value)[:80]


def _entries():
    seen = {}
    for func, op in ops.TABLE.items():
        seen.setdefault(ops.spelled(func), (func, op))
    return sorted(seen.items())


@pytest.mark.parametrize("kind", [k for k in Kind], ids=[k.value for k in Kind])
def test_every_table_entry_is_exact_or_refused_alike_on_every_dimension_and_grid(kind):
    tried: Dict[str, List[str]] = {}
    for spelled, (func, op) in _entries():
        if op.kind is not kind:
            continue
        results = tried.setdefault(spelled, [])
        for name, call in _calls(func, op):
            for grid in GRIDS:
                results.append(_check_call(func, name, call, grid))
    untried = [s for s, r in tried.items()
               if all(x == "skip" for x in r) and s not in NEEDS_A_GPU | NOT_IN_A_FORWARD and kind is not Kind.REFUSED]
    assert not untried, f"no call of these ran in one process, so nothing was checked: {untried}"
    if kind in (Kind.ELEMENTWISE, Kind.CONVERT, Kind.LIKE, Kind.SHAPE, Kind.METADATA, *RANDOM_KINDS):
        never_exact = [s for s, r in tried.items() if "exact" not in r and s not in NEEDS_A_GPU | NOT_IN_A_FORWARD]
        assert not never_exact, f"refused in every call, though the kind runs on a part: {never_exact}"
    if kind is Kind.REFUSED:  # whatever the arguments: refused before it runs
        assert all("exact" not in r for r in tried.values())
        for spelled, (func, op) in _entries():
            if op.kind is Kind.REFUSED:
                with pytest.raises(SpatialError, match=re.escape(f"is not supported in the spatial part ({op.why}")):
                    _call_on_a_part(func)


# -- the same calls on a channels-last part (ConvNeXt's x.permute(0, 2, 3, 1)) -------------------

CHANNEL_WEIGHTS = torch.linspace(0.5, 1.5, 3, dtype=torch.float64)  # a layer scale: constant over the image
IMAGE_CL = torch.rand(7, 6, 3, generator=_gen, dtype=torch.float64)  # a whole map, channels last: refused
LINEAR_W = torch.rand(5, 3, generator=_gen, dtype=torch.float64)
DIMS_LAST = [1, 2, -1]  # rows and columns (the image's), and the channels; the batch is as above


def _last(t):
    return t.permute(0, 2, 3, 1)


def _channels_last_calls(func, op) -> List[Tuple[str, Callable]]:
    """Every call of the table's harness, on the part moved channels last; and, for the calls that
    work on the channels there, the calls ConvNeXt's blocks make."""
    calls = [(f"last: {name}", lambda t, call=call: call(_last(t))) for name, call in _calls(func, op, DIMS_LAST)]
    if op.kind is Kind.ELEMENTWISE:
        calls += [("last: x, channel weights", lambda t: func(_last(t), CHANNEL_WEIGHTS)),
                  ("last: x, image", lambda t: func(_last(t), IMAGE_CL))]
    calls += [(f"last: {name}", lambda t, call=call: call(_last(t))) for name, call in _CHANNELS_LAST.get(func, [])]
    return calls


_CHANNELS_LAST = {
    F.layer_norm: [("layer_norm (C,)", lambda t: F.layer_norm(t, (3,), CHANNEL_WEIGHTS, CHANNEL_WEIGHTS)),
                   ("layer_norm (w, C)", lambda t: F.layer_norm(t, t.shape[-2:]))],
    F.linear: [("linear", lambda t: F.linear(t, LINEAR_W, LINEAR_W[:, 0])),
               ("linear of a part's weight", lambda t: F.linear(LINEAR_W[:, :3].T.contiguous(), t[0, 0]))],
    torch.matmul: [("x @ w", lambda t: t @ LINEAR_W.T), ("w @ x", lambda t: LINEAR_W[:, :6] @ t),
                   ("matmul(x, w)", lambda t: torch.matmul(t, LINEAR_W.T))],
    torch.mean: [("mean(-1, keepdim)", lambda t: torch.mean(t, -1, keepdim=True)), ("mean(-1)", lambda t: t.mean(-1)),
                 ("mean((1, 2))", lambda t: t.mean((1, 2))), ("mean(1)", lambda t: t.mean(1)),
                 ("x * mean((1, 2), keepdim)", lambda t: t * t.mean((1, 2), keepdim=True))],
    torch.norm: [("GRN", lambda t: t * torch.norm(t, p=2, dim=(1, 2), keepdim=True)),
                 ("norm(dim=-1)", lambda t: torch.norm(t, dim=-1))],
    torch.var: [("var(-1, keepdim)", lambda t: torch.var(t, -1, keepdim=True, correction=0))],
    torch.amax: [("amax(-1)", lambda t: t.amax(-1)), ("amax(0)", lambda t: torch.amax(t, 0))],
    torch.prelu: [("prelu of one weight", lambda t: F.prelu(t, CHANNEL_WEIGHTS[:1])),
              ("prelu per channel", lambda t: F.prelu(t, CHANNEL_WEIGHTS))],
}
if hasattr(F, "rms_norm"):
    _CHANNELS_LAST[F.rms_norm] = [("rms_norm (C,)", lambda t: F.rms_norm(t, (3,), CHANNEL_WEIGHTS))]


@pytest.mark.parametrize("kind", [k for k in Kind], ids=[k.value for k in Kind])
def test_every_table_entry_on_a_channels_last_part_is_exact_or_refused_alike(kind):
    """After x.permute(0, 2, 3, 1) the image dimensions are the two before the last: every call
    either computes there what one process computes (forward, and the input's gradient), or is
    refused on every rank alike."""
    outcomes: Dict[str, List[str]] = {}
    for spelled, (func, op) in _entries():
        if op.kind is not kind:
            continue
        gradients = 0
        for name, call in _channels_last_calls(func, op):
            for grid in GRIDS:
                result = _check_call(func, name, call, grid)
                outcomes.setdefault(f"{spelled}({name})", []).append(result)
                # The backward of a call on each pixel is the pixel's own: two calls of each
                # function show it (float32 beside float64 is compared loosely, forward only).
                if result == "exact" and op.kind not in RANDOM_KINDS and spelled not in IDENTITY \
                        and "y.type" not in name and gradients < 2:
                    gradients += _check_the_gradient(func, name, call, grid)
    exact = {call for call, results in outcomes.items() if "exact" in results}
    expected = {
        Kind.ELEMENTWISE: {"Tensor.add(last: x, channel weights)", "torch.tanh(last: x)", "F.gelu(last: x)",
                           "torch.prelu(last: prelu of one weight)"},
        Kind.PERMUTE: {"Tensor.permute(last: x, (0, 3, 1, 2))", "Tensor.permute(last: x, (0, 1, 2, 3))"},
        Kind.ALONG: {"F.softmax(last: x, -1)", "Tensor.chunk(last: x, 2, -1)"},
        Kind.CONCAT: {"torch.cat(last: [x, y], -1)"},
        Kind.NEW: {"Tensor.new_zeros(last: 2, 3)", "Tensor.new_tensor(last: data)"},
        Kind.HANDLER: {"torch.mean(last: mean(-1, keepdim))", "torch.mean(last: mean(-1))",
                       "torch.amax(last: amax(-1))", "torch.mean(last: mean((1, 2)))",
                       "torch.mean(last: x * mean((1, 2), keepdim))", "torch.norm(last: GRN)",
                       "torch.norm(last: norm(dim=-1))"},
        Kind.REFUSED: {"F.layer_norm(last: layer_norm (C,))", "F.linear(last: linear)", "torch.matmul(last: x @ w)"},
    }.get(kind, set())
    assert expected <= exact, f"refused, though they work on each pixel's channels: {sorted(expected - exact)}"
    never = {"Tensor.add(last: x, image)", "F.local_response_norm(last: x, 3)", "F.dropout2d(last: x)",
             "F.softmax(last: x, 1)", "Tensor.permute(last: x, (0, 2, 1, 3))", "torch.mean(last: mean(1))",
             "F.layer_norm(last: layer_norm (w, C))", "torch.matmul(last: w @ x)", "torch.prelu(last: prelu per channel)",
             "Tensor.reshape(last: x, -1)", "F.conv2d(last: pad 1)", "F.linear(last: linear of a part's weight)",
             "Tensor.new_zeros(last: shape)", "Tensor.new_tensor(last: a part's values)"}
    assert not never & exact, f"computed on a channels-last part, where they read the image: {sorted(never & exact)}"


def test_every_element_wise_call_on_an_unbatched_part_is_exact_or_refused_alike():
    """On a (C, H, W) part, dimension 1 is the rows: a call across it (LocalResponseNorm's window,
    a channel shuffle) would work across the bands; exact or refused alike, as on any part."""
    x = torch.rand(2, 4, 6, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    names = {"x", "x, 3", "x, 2", "x, y", "x, const", "x, image", "x, weight per channel"}
    outcomes: Dict[str, List[str]] = {}
    for spelled, (func, op) in _entries():
        if op.kind is Kind.ELEMENTWISE:
            for name, call in _calls(func, op) + [("x, 2", lambda t, f=func: f(t, 2))]:
                if name in names:
                    for grid in GRIDS:
                        result = _check_call(func, name, lambda t, call=call: call(t[0]), grid, x)
                        outcomes.setdefault(f"{spelled}({name})", []).append(result)
    exact = {call for call, results in outcomes.items() if "exact" in results}
    assert {"torch.tanh(x)", "Tensor.add(x, y)", "Tensor.mul(x, 2)"} <= exact
    assert not {"F.local_response_norm(x, 3)", "torch.channel_shuffle(x, 2)"} & exact


def _check_the_gradient(func, name: str, call: Callable, grid) -> bool:
    """Whether the input's gradient was compared (and found the same): one process has one."""
    try:
        expected = one_process_gradient(call, X)
    except RuntimeError:  # one process has no gradient either (in place on a view of a leaf)
        return False
    if expected is None:
        return False
    outcomes = run_parts(grid, call, X, backward=True)
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    got = assemble_gradients(outcomes, grid, X.shape)
    assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12, equal_nan=True), \
        f"{ops.spelled(func)}({name}) on {grid}: the input gradient differs by {(got - expected).abs().max()}"
    return True


def test_the_handlers_and_crops_are_exact_forward_and_backward_on_a_2x2_grid_too():
    for func, calls in HANDLER_CALLS.items():
        for name, call in calls:
            for grid in GRIDS + [(2, 2)]:
                result = _check_call(func, name, call, grid)
                if result != "exact" or not X.is_floating_point():
                    continue
                expected = one_process_gradient(call, X)
                if expected is None:
                    continue
                outcomes = run_parts(grid, call, X, backward=True)
                assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
                got = assemble_gradients(outcomes, grid, X.shape)
                assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12, equal_nan=True), \
                    f"{ops.spelled(func)}({name}) on {grid}: the input gradient differs by {(got - expected).abs().max()}"


@pytest.mark.parametrize("call,grid,status", [
    ("no pad count", (1, 2), "exact"), ("no pad count", (2, 2), "exact"),
    ("size from shape", (2, 1), "exact"), ("size of the map", (1, 2), "exact"),
    ("size 2h+1", (2, 1), "exact"), ("1.5", (2, 1), "exact"), ("bicubic 1.7 x 2.5", (2, 2), "exact"),
    ("align to 13 x 10", (2, 1), "exact"), ("align bicubic 2", (1, 2), "exact"), ("to 2 x 1", (2, 1), "exact"),
    ("antialias", (2, 1), "refused"), ("area", (1, 2), "refused"), ("area 1 x 0.5", (2, 2), "exact"),
    ("area 2 x 3", (2, 1), "exact"), ("lp 1.5 of 2 x 3 ceil", (2, 2), "exact"), ("lp -inf of 3 s1", (2, 1), "exact"),
    ("5 x 4 (overlapping windows)", (2, 2), "exact"), ("None x 1", (2, 1), "refused"),
    ("3x3 s2 p1 op1", (2, 1), "exact"), ("2x2 s2", (2, 2), "exact"),
    ("diff of shapes", (2, 1), "exact"), ("replicate", (1, 2), "exact"), ("crop -1", (2, 2), "exact"),
    ("reflect", (2, 1), "exact"), ("reflect 2 uneven", (2, 2), "exact"), ("circular", (2, 1), "exact"),
    ("circular uneven", (2, 2), "exact"), ("reflect -1", (2, 1), "refused"),
    ("2 of 6 x 4", (2, 2), "exact"), ("3", (2, 1), "exact"), ("2 of 2 x 2", (2, 1), "refused"),
    ("ceil 3 s2 p1", (2, 2), "exact"), ("ceil 4 s3 p2 no pad count", (2, 1), "exact"),
    ("ceil 3 s2 divisor", (1, 2), "exact"), ("bilinear 0.5", (2, 2), "exact"), ("bicubic 0.5 x 1", (2, 1), "exact"),
    ("bilinear to 3 x 3 of 7 x 6", (2, 1), "exact"),
    ("lse (2, 3)", (2, 1), "exact"), ("lse (1, 2, 3) keepdim", (2, 2), "exact"), ("lse 3", (1, 2), "refused"),
    ("avg whole image", (2, 1), "exact"), ("avg whole image divisor", (1, 2), "exact"),
    ("max whole image ties", (2, 1), "exact"), ("IMDN's mean", (2, 1), "exact"), ("IMDN's mean", (1, 2), "refused"), ("3 keepdim", (2, 1), "exact"),
    ("2 keepdim", (1, 2), "exact"), ("2 keepdim", (2, 1), "refused"), ("(1, 3) keepdim, then 2", (2, 1), "exact"),
])
def test_what_the_reported_cases_do_now(call, grid, status):
    for func, calls in HANDLER_CALLS.items():
        for name, fn in calls:
            if name == call:
                assert _check_call(func, name, fn, grid) == status
                return
    raise AssertionError(f"no call named {call}")


def test_the_reported_silent_cases_are_exact_now():
    # AvgPool2d(count_include_pad=False) on 9 x 16 over (1, 2): the divisor at the band edge.
    x = torch.randn(1, 2, 9, 16, dtype=torch.float64)
    pool = lambda t: F.avg_pool2d(t, 3, 1, 1, count_include_pad=False)  # noqa: E731
    got = assemble([o.value for o in run_parts((1, 2), pool, x)])
    assert torch.allclose(got, pool(x), atol=1e-12)
    # narrow and select along a split dimension: a crop, or refused; never a replicated part.
    y = torch.randn(1, 2, 8, 6, dtype=torch.float64)
    got = assemble([o.value for o in run_parts((1, 2), lambda t: t.narrow(3, 0, 2), y)])
    assert torch.equal(got, y.narrow(3, 0, 2))
    got = assemble([o.value for o in run_parts((1, 2), lambda t: torch.narrow(t, 3, 1, 4), y)])
    assert torch.equal(got, y.narrow(3, 1, 4))
    assert refused_alike(run_parts((1, 2), lambda t: t.select(3, 0), y)) is not None


def test_a_size_read_from_the_input_is_the_whole_images():
    # A segmentation head: size = x.shape[-2:], three stride-2 convs, a 1x1 head, upsampled back.
    convs = [torch.randn(4, c, 3, 3, dtype=torch.float64) for c in (2, 4, 4)]
    head = torch.randn(3, 4, 1, 1, dtype=torch.float64)

    def segment(t):
        size = t.shape[-2:]
        for w in convs:
            t = F.conv2d(t, w, stride=2, padding=1)
        return F.interpolate(F.conv2d(t, head), size=size, mode="bilinear")

    x = torch.randn(1, 2, 64, 32, dtype=torch.float64)
    got = assemble([o.value for o in run_parts((2, 1), segment, x)])
    assert tuple(got.shape) == (1, 3, 64, 32)
    assert torch.allclose(got, segment(x), atol=1e-12)


def test_an_interpolation_to_any_size_is_exact_and_an_unsupported_one_names_its_mode():
    x = torch.randn(1, 1, 64, 32, dtype=torch.float64)
    # 64 rows to 24 (a scale of 0.375): not a whole factor; PyTorch's own taps, band by band.
    for call in (lambda t: F.interpolate(t[..., ::1, :], size=(24, 32)),
                 lambda t: F.interpolate(t, size=(24, 45), mode="bicubic", align_corners=True)):
        assert torch.allclose(assemble([o.value for o in run_parts((2, 1), call, x)]), call(x), atol=1e-12)
    outcomes = run_parts((2, 1), lambda t: F.interpolate(t, size=(24, 32), mode="bilinear", antialias=True), x)
    assert "interpolation with mode='bilinear', antialias=True is not supported" in refused_alike(outcomes)
    # As one process: align_corners with nearest is PyTorch's own error.
    outcomes = run_parts((2, 1), lambda t: F.interpolate(t, size=(24, 32), align_corners=False), x)
    assert all("align_corners option can only be set" in str(o.error) for o in outcomes)


def test_a_whole_tensor_interpolated_to_a_size_read_from_a_part_becomes_that_part():
    # DeepLab's ASPP pooling branch: pooled to 1 x 1 (replicated), a 1x1 convolution, brought
    # back to the map's size, concatenated with the map.
    w = torch.randn(2, 3, 1, 1, dtype=torch.float64)
    small = torch.randn(2, 2, 3, 2, dtype=torch.float64)  # a small map of each sample, resized to the image

    def branch(t):
        pooled = F.conv2d(F.adaptive_avg_pool2d(t, 1), w)
        return torch.cat([t, F.interpolate(pooled, size=t.shape[-2:], mode="bilinear", align_corners=False),
                          F.interpolate(small, size=t.shape[-2:], mode="bicubic", align_corners=True)], 1)

    x = torch.randn(2, 3, 13, 9, dtype=torch.float64)
    for grid in GRIDS + [(2, 2)]:
        outcomes = run_parts(grid, branch, x)
        assert all(part_of(o.value) is not None for o in outcomes)
        assert torch.allclose(assemble([o.value for o in outcomes]), branch(x), atol=1e-12)


def test_the_whole_images_max_and_min_are_exact_forward_and_backward():
    # x / x.max(): its gradient shared evenly among the values equal to the maximum (the NaNs,
    # where it is NaN), whichever band holds them.
    for call in (lambda t: t / t.max(), lambda t: t - torch.min(t), lambda t: tied(t).max() * t,
                 lambda t: with_nan(t).max(), lambda t: tied(t).min(), lambda t: (t > 0.5).max().to(t.dtype) * t):
        expected = call(X)
        for grid in GRIDS + [(2, 2)]:
            got = assemble([o.value for o in run_parts(grid, call, X)])
            assert torch.allclose(got, expected, rtol=1e-13, equal_nan=True)
            gradient = assemble_gradients(run_parts(grid, call, X, backward=True), grid, X.shape)
            assert torch.allclose(gradient, one_process_gradient(call, X), rtol=1e-10, atol=1e-12, equal_nan=True)


def test_a_tensor_converted_like_a_part_is_that_tensor_converted():
    # SwinIR's and HAT's forward: self.mean = self.mean.type_as(x), then x - self.mean.
    mean = torch.tensor([0.4, 0.5, 0.6]).view(1, 3, 1, 1)
    x = torch.randn(2, 3, 9, 6, dtype=torch.float64)
    for call in (lambda t: t - mean.type_as(t), lambda t: t - mean.to(t), lambda t: (t - mean.type_as(t)).mean((2, 3)),
                 lambda t: t * t.new_tensor([1.0, 2.0, 3.0]).view(1, 3, 1, 1)):
        for grid in GRIDS:
            outcomes = run_parts(grid, call, x)
            assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
            assert torch.allclose(assemble([o.value for o in outcomes]), call(x), atol=1e-12)
    # A copy of a part's values made by new_tensor would pass for a whole tensor.
    assert "new_tensor of a part's values" in refused_alike(run_parts((2, 1), lambda t: t.new_tensor(t) + t, x))


def test_lengths_read_from_a_part_compare_and_compute_as_the_whole_images():
    x = torch.randn(1, 1, 9, 6, dtype=torch.float64)

    def read(t):
        h, w = t.shape[-2:]
        return (h == 9, w == 6, t.size(2) == 9, t.numel() == 54, (2 * h + 1) == 19, h > 5, t.shape == x.shape,
                t.sum() / t.numel())

    results = [o.value for o in run_parts((2, 1), read, x)]
    for result in results:
        assert result[:7] == (True,) * 7
        assert torch.allclose(result[7], x.mean())


def test_lengths_made_floats_are_the_whole_images():
    # On equal bands every rank computes the same from its part's own numbers: nothing would
    # refuse ``float(h * w)`` or ``math.sqrt(h)`` that gave them, and the result would be off.
    x = torch.randn(1, 1, 8, 6, dtype=torch.float64)

    def read(t):
        h, w = t.shape[-2:]
        return (float(h * w), math.sqrt(h), float(h / 3), math.log2(w), t.sum() / float(t.numel()),
                math.floor(h / 3), int(h / 3))

    for result in (o.value for o in run_parts((2, 1), read, x)):
        assert result[:4] == (48.0, math.sqrt(8), 8 / 3, math.log2(6))
        assert torch.allclose(result[4], x.mean())
        assert result[5] == 2  # compares as the whole's floor; the part's own is 1


def _call_on_a_part(func) -> Any:
    """``func`` called by the spatial mode on a part, with no other argument."""
    part = Part(Grid(2, 1), 0, 8, 6)
    x = tagged(torch.zeros(1, 2, 4, 6), part)
    ctx = Context(part.grid, 0, None, {})
    return dispatch.SpatialMode(ctx).__torch_function__(func, (torch.Tensor,), (x,), {})


def test_calls_outside_the_table_are_refused_before_they_run():
    candidates = []
    for namespace in (torch, torch.Tensor, F, torch.fft, torch.linalg, torch.special):
        for name in dir(namespace):
            func = getattr(namespace, name, None)
            if callable(func) and not isinstance(func, type) and ops.lookup(func) is None and not name.startswith("_"):
                candidates.append(func)
    assert len(candidates) > 300
    for func in candidates:
        with pytest.raises(SpatialError, match="is not supported in the spatial part"):
            _call_on_a_part(func)


@pytest.mark.parametrize("func, written", [
    (torch.linalg.matrix_norm, "torch.linalg.matrix_norm"), (torch.fft.fft2, "torch.fft.fft2"),
    (torch.special.erf, "torch.special.erf"), (F.conv2d, "F.conv2d"), (torch.Tensor.narrow, "Tensor.narrow"),
])
def test_a_refusal_names_the_call_as_the_user_writes_it(func, written):
    # torch.linalg.matrix_norm is torch._C._linalg's linalg_matrix_norm, which no user writes.
    assert ops.spelled(func) == written
    if ops.lookup(func) is None:
        with pytest.raises(SpatialError, match=rf"{re.escape(written)} is not supported in the spatial part"):
            _call_on_a_part(func)


def test_the_documents_list_of_calls_is_the_op_table():
    text = (Path(__file__).resolve().parents[1] / "docs" / "spatial.md").read_text(encoding="utf-8")
    section = ops_table.document_section(text)
    assert section, "docs/spatial.md has no section made from the op table"
    assert section == ops_table.section_lines(), (
        "docs/spatial.md's list of calls differs from the op table in hpdl/torch/spatial/ops.py; "
        "`python -m hpdl.torch.spatial.ops_table --write docs/spatial.md` rewrites it")
    assert ops_table.replace_section(text) == text


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_taps_read_off_pytorchs_kernel_give_its_output(dtype):
    # Sizes and scales of every kind: up, down, equal, 1 row, scale factors with and without
    # recomputation, both align_corners; nearest in float32 arithmetic whatever the type.
    cases = [(n, call) for n in (1, 2, 7, 97, 1000) for call in (
        {"size": (3 * n + 2, 1), "mode": "nearest"}, {"size": (max(n // 3, 1), 1), "mode": "nearest-exact"},
        {"size": (n, 1), "mode": "bilinear", "align_corners": False},
        {"scale_factor": (1.37, 1.0), "mode": "bilinear", "align_corners": True},
        {"scale_factor": (2.4, 1.0), "mode": "bicubic", "align_corners": False, "recompute_scale_factor": True},
        {"size": (2 * n + 1, 1), "mode": "bicubic", "align_corners": True},
        {"scale_factor": (0.77, 1.0), "mode": "nearest"}) if n * call.get("scale_factor", (1,))[0] >= 1]
    for n, call in cases:
        x = torch.randn(2, 3, n, 1, dtype=dtype)
        expected = F.interpolate(x, **call)
        rows, _ = resampling.taps_of(x, (n, 1), call)
        got = rows.apply(x, 2, 0, rows.outputs, 0)
        assert torch.allclose(got, expected, rtol=0, atol=(1e-13 if dtype == torch.float64 else 1e-5)), (n, call)


def test_convolutions_under_autocast_run_as_autocast_runs_them_forward_and_backward():
    # Autocast casts a convolution's tensors to bfloat16; the spatial convolutions (autograd
    # functions of their own) did not, and their backward failed on bfloat16 gradients of
    # float32 inputs. A band convolution, a strided one with a halo, and a transposed one.
    gen = torch.Generator().manual_seed(3)
    # Weights that require a gradient, as parameters do: their backward failed on mixed types.
    w1, w2 = torch.randn(4, 3, 3, 3, generator=gen), torch.randn(4, 4, 3, 3, generator=gen)
    w3 = torch.randn(4, 3, 2, 2, generator=gen)
    for w in (w1, w2, w3):
        w.requires_grad_()

    def net(t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            # tanh, not relu: a pixel near 0 that rounds to the other side flips relu's gradient.
            y = F.conv2d(F.conv2d(t, w1, padding=1).tanh(), w2, stride=2, padding=1)
            return F.conv_transpose2d(y, w3, stride=2)

    x = torch.randn(2, 3, 12, 10, generator=gen)
    expected = net(x)
    for grid in GRIDS + [(2, 2)]:
        outcomes = run_parts(grid, net, x, backward=True)
        assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
        got = assemble([o.value for o in outcomes])
        assert got.dtype == expected.dtype == torch.bfloat16
        # bfloat16 keeps 8 bits: a band's convolution rounds its parts in another order.
        relative = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
        assert relative < 1e-2, relative
        gradient = assemble_gradients(outcomes, grid, x.shape)
        one = one_process_gradient(net, x).double()
        relative = ((gradient - one).norm() / one.norm()).item()
        assert relative < 1e-2, relative
