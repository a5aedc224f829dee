"""The op table's calls for the spatial op tests (test_spatial_ops.py, test_spatial_op_layouts.py):
for each entry, calls at every dimension with every kind of argument beside a part, and the
check of one call on a grid against one process: exact (forward, and the input gradient where
asked), refused on every rank alike, or skipped where one process refuses it too; never
silently wrong, never a rank that fails alone.
"""

from __future__ import annotations

import collections.abc
import itertools
import types
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

from hpdl.torch.spatial import ops
from hpdl.torch.spatial.ops import Kind
from hpdl.torch.spatial.parts import channels_last_part_of, part_of
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


def elementwise_calls(f) -> List[Tuple[str, Callable]]:
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


def along_calls(f, dims=DIMS) -> List[Tuple[str, Callable]]:
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


def shape_calls(f) -> List[Tuple[str, Callable]]:
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


def index_calls() -> List[Tuple[str, Callable]]:
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
    calls += STRIDED_SLICES
    calls += [(f"x[{index}] = 0", setting(index, 0.0)) for index in
              [(slice(None), 0), (Ellipsis, 0, slice(None)), (Ellipsis, slice(1, 3), slice(None)), (0,)]]
    return calls


# Slices with a step along the image: space-to-depth by hand (YOLOv5's Focus), subsampling.
STRIDED_SLICES = [
    ("x[..., ::2, ::2]", lambda t: t[..., ::2, ::2]),
    ("Focus", lambda t: _focus(t[..., :6, :])),
    ("x[..., 1:-1:3, :]", lambda t: t[..., 1:-1:3, :]),
    ("x[:, :, 2::4, 1:5:2]", lambda t: t[:, :, 2::4, 1:5:2]),
    ("x[..., ::h, :]", lambda t: t[..., ::t.shape[-2], :]),
    ("x[..., ::0, :]", lambda t: t[..., ::0, :]),
]


def _focus(t):
    """YOLOv5's Focus: each 2x2 block's four pixels as channels, by slicing."""
    return torch.cat([t[..., ::2, ::2], t[..., 1::2, ::2], t[..., ::2, 1::2], t[..., 1::2, 1::2]], 1)


def tied(t):
    """floor(3 t): many equal values, across the bands; the gradient passed to ``t`` as it is."""
    return t + (torch.floor(t.detach() * 3) - t.detach())


def with_nan(t):
    """NaN where ``t`` > 0.85 (in several places, across the bands); the gradient passed to ``t``."""
    return t + torch.where(t.detach() > 0.85, torch.full_like(t, float("nan")), torch.zeros_like(t))


def handler_calls() -> Dict[Any, List[Tuple[str, Callable]]]:
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
                                ("None x 1", lambda t: F.adaptive_avg_pool2d(t, (None, 1))),
                                ("2 x None", lambda t: F.adaptive_avg_pool2d(t, [2, None])),
                                ("row gate", lambda t: t * torch.sigmoid(
                                    F.adaptive_avg_pool2d(t, (None, 1)) - F.adaptive_max_pool2d(t, (None, 1))))],
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
                                ("None x 2", lambda t: F.adaptive_max_pool2d(t, (None, 2))),
                                ("None x 1 indices", lambda t: F.adaptive_max_pool2d(t, (None, 1), return_indices=True)),
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
    calls[F.l1_loss] = [("l1 mean", lambda t: t * F.l1_loss(t, t * t)),
                        ("l1 sum", lambda t: t + F.l1_loss(t * t, t, reduction="sum")),
                        ("l1 none", lambda t: F.l1_loss(t, 1 - t, reduction="none")),
                        ("l1 to another map", lambda t: t * F.l1_loss(t, t[..., :1, :1].expand_as(t)))]
    calls[F.mse_loss] = [("mse mean", lambda t: t * F.mse_loss(t, 1 - t))]
    calls[F.smooth_l1_loss] = [("smooth l1 beta", lambda t: t * F.smooth_l1_loss(t, t * t, beta=0.05))]
    calls[F.huber_loss] = [("huber delta sum", lambda t: t - F.huber_loss(t, 0.5 * t, reduction="sum", delta=0.1))]
    calls[torch.Tensor.norm] = [("(2, 3)", lambda t: t.norm(dim=(2, 3))), ("1", lambda t: t.norm(dim=1)),
                                ("inf ties keepdim", lambda t: t * tied(t - 0.5).norm(float("inf"), (2, 3), True)),
                                ("-inf (1, 2, 3)", lambda t: t.norm(-float("inf"), (1, 2, 3)))]
    calls[torch.any] = [("NaN check", lambda t: t * 2 if torch.isnan(t).any() else t * 3),
                        ("any (2, 3) keepdim", lambda t: torch.any(t > 0.9, (2, 3), keepdim=True)),
                        ("any (1, 2, 3)", lambda t: torch.any(t > 0.99, (1, 2, 3))), ("any 1", lambda t: torch.any(t > 0.9, 1)),
                        ("any 3", lambda t: torch.any(t > 0.9, 3))]
    calls[torch.Tensor.any] = [("any method", lambda t: (t > 0.99).any())]
    calls[torch.all] = [("all (1, 2, 3) keepdim", lambda t: torch.all(t > 0.01, (1, 2, 3), keepdim=True))]
    calls[torch.aminmax] = [("aminmax all", lambda t: t / torch.aminmax(t).max),
                            ("aminmax ties", lambda t: t * sum(torch.aminmax(tied(t)))),
                            ("aminmax 1", lambda t: torch.aminmax(t, dim=1).min),
                            ("aminmax 2", lambda t: torch.aminmax(t, dim=2).max)]
    calls[torch.Tensor.aminmax] = [("aminmax method", lambda t: t - tied(t).aminmax().min),
                                   ("aminmax 0 keepdim", lambda t: t.aminmax(dim=0, keepdim=True).max * t)]
    calls[torch.prod] = [("prod all", lambda t: t * torch.prod(1 + 0.01 * t)),
                         ("prod a zero", lambda t: torch.where(t == t.max(), t - t.max().detach(), 1 + 0.01 * t)
                          .prod() * t),
                         ("prod zeros", lambda t: torch.prod(torch.where(t > 0.9, 0.0, 1 + 0.01 * t)) + t),
                         ("prod 1", lambda t: torch.prod(t, 1)), ("prod 3", lambda t: torch.prod(t, 3))]
    calls[torch.Tensor.prod] = [("prod dtype", lambda t: (1 + 0.01 * t).float().prod(dtype=torch.float64) * t)]
    calls[torch.Tensor.count_nonzero] = [("count method", lambda t: (t > 0.5).count_nonzero((2, 3)))]
    calls[torch.Tensor.nansum] = [("nansum method", lambda t: with_nan(t).nansum((2, 3)))]
    calls[torch.nanmean] = [("nanmean (2, 3)", lambda t: torch.nanmean(with_nan(t), (2, 3)))]
    calls[torch.Tensor.all] = [("finite", lambda t: torch.isfinite(with_nan(t)).all()),
                               ("all (-1, -2)", lambda t: (t > 0.01).all((-1, -2)))]
    calls[torch.count_nonzero] = [("count all", lambda t: torch.count_nonzero(t > 0.5)),
                                  ("count (0, 2, 3)", lambda t: torch.count_nonzero(t > 0.5, (0, 2, 3))),
                                  ("count 2", lambda t: torch.count_nonzero(t > 0.5, 2))]
    calls[torch.nansum] = [("NaN (2, 3)", lambda t: torch.nansum(with_nan(t), (2, 3))),
                           ("NaN all", lambda t: torch.nansum(with_nan(t)))]
    calls[torch.Tensor.nanmean] = [("NaN (2, 3) keepdim", lambda t: t * with_nan(t).nanmean((2, 3), keepdim=True)),
                                   ("NaN (1, 2, 3) dtype", lambda t: with_nan(t).nanmean((1, 2, 3), dtype=torch.float64)),
                                   ("nanmean 1", lambda t: t.nanmean(1))]
    for f in (torch.narrow, torch.Tensor.narrow):
        calls[f] = [(f"{d}, {s}, {n}", lambda t, d=d, s=s, n=n: f(t, d, s, n))
                    for d in DIMS for s, n in ((0, 1), (1, 2), (-2, 2), (0, 5))]
    return calls


def calls_of(func, op, dims=DIMS) -> List[Tuple[str, Callable]]:
    spelled = ops.spelled(func)
    if op.kind is Kind.HANDLER:
        return HANDLER_CALLS[func]
    if op.kind is Kind.INDEX:
        return index_calls()
    if isinstance(func, types.GetSetDescriptorType):  # an attribute
        name = func.__name__
        return [(f"x.{name}", lambda t, name=name: getattr(t, name))]
    in_place = spelled.endswith("_") and not spelled.endswith("__")
    if op.kind in (Kind.ELEMENTWISE, Kind.LIKE, Kind.CONVERT, *RANDOM_KINDS, Kind.REFUSED, Kind.METADATA,
                   Kind.PART_ATTRIBUTE):
        calls = elementwise_calls(func) + [("x, torch.float32", lambda t: func(t, torch.float32)),
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
            calls += along_calls(func, dims)[1:]
        return _in_place(func, calls) if in_place else calls
    if op.kind in (Kind.ALONG, Kind.CONCAT):
        if op.kind is Kind.CONCAT:
            return [(f"[x, y], {d}", lambda t, d=d: func([t, _y(t)], d)) for d in dims] + \
                [("[x, y]", lambda t: func([t, _y(t)])), ("[x, image]", lambda t: func([t, IMAGE.expand_as(t)], 1))]
        calls = along_calls(func, dims)
        return _in_place(func, calls) if in_place else calls
    if op.kind in (Kind.RESHAPE, Kind.EXPAND, Kind.PERMUTE):
        calls = shape_calls(func)
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


HANDLER_CALLS = handler_calls()


def check_call(func, name: str, call: Callable, grid: Tuple[int, int], x: torch.Tensor = X) -> str:
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
    got = assemble([listed(o.value) for o in outcomes])
    expected = listed(expected)
    if not equal(got, expected, loose="y.type" in name):
        raise AssertionError(f"{spelled}({name}) on {grid}: silently wrong: got {brief(got)}, one process "
                             f"{brief(expected)}")
    return "exact"


def listed(value: Any) -> Any:
    """An iterator's items (``iter(x)``), so that they can be compared."""
    return list(value) if isinstance(value, collections.abc.Iterator) else value


def brief(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {list(value.shape)}"
    return repr(value)[:80]


def entries():
    seen = {}
    for func, op in ops.TABLE.items():
        seen.setdefault(ops.spelled(func), (func, op))
    return sorted(seen.items())


def check_the_gradient(func, name: str, call: Callable, grid) -> bool:
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
