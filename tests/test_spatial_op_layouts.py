"""The op table's calls on parts of other layouts than (N, C, H, W), against one process:
exact, or refused on every rank alike. A channels-last part (ConvNeXt's x.permute(0, 2, 3, 1):
the image dimensions the two before the last) takes every call of the table's harness
(spatial_op_calls.py) and those of ConvNeXt's blocks; an unbatched (C, H, W) part, whose
dimension 1 is the rows, the element-wise calls.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F

from hpdl.torch.spatial.ops import Kind
from spatial_op_calls import (GRIDS, IDENTITY, RANDOM_KINDS, calls_of, check_call, check_the_gradient, entries)


_gen = torch.Generator().manual_seed(1)
CHANNEL_WEIGHTS = torch.linspace(0.5, 1.5, 3, dtype=torch.float64)  # a layer scale: constant over the image
IMAGE_CL = torch.rand(7, 6, 3, generator=_gen, dtype=torch.float64)  # a whole map, channels last: refused
LINEAR_W = torch.rand(5, 3, generator=_gen, dtype=torch.float64)
DIMS_LAST = [1, 2, -1]  # rows and columns (the image's), and the channels; the batch is as above


def _last(t):
    return t.permute(0, 2, 3, 1)


def _channels_last_calls(func, op) -> List[Tuple[str, Callable]]:
    """Every call of the table's harness, on the part moved channels last; and, for the calls that
    work on the channels there, the calls ConvNeXt's blocks make."""
    calls = [(f"last: {name}", lambda t, call=call: call(_last(t))) for name, call in calls_of(func, op, DIMS_LAST)]
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
    for spelled, (func, op) in entries():
        if op.kind is not kind:
            continue
        gradients = 0
        for name, call in _channels_last_calls(func, op):
            for grid in GRIDS:
                result = check_call(func, name, call, grid)
                outcomes.setdefault(f"{spelled}({name})", []).append(result)
                # The backward of a call on each pixel is the pixel's own: two calls of each
                # function show it (float32 beside float64 is compared loosely, forward only).
                if result == "exact" and op.kind not in RANDOM_KINDS and spelled not in IDENTITY \
                        and "y.type" not in name and gradients < 2:
                    gradients += check_the_gradient(func, name, call, grid)
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
             "F.layer_norm(last: layer_norm (w, C))", "torch.matmul(last: w @ x)",
             "torch.prelu(last: prelu per channel)",
             "Tensor.reshape(last: x, -1)", "F.conv2d(last: pad 1)", "F.linear(last: linear of a part's weight)",
             "Tensor.new_zeros(last: shape)", "Tensor.new_tensor(last: a part's values)"}
    assert not never & exact, f"computed on a channels-last part, where they read the image: {sorted(never & exact)}"


def test_every_element_wise_call_on_an_unbatched_part_is_exact_or_refused_alike():
    """On a (C, H, W) part, dimension 1 is the rows: a call across it (LocalResponseNorm's window,
    a channel shuffle) would work across the bands; exact or refused alike, as on any part."""
    x = torch.rand(2, 4, 6, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    names = {"x", "x, 3", "x, 2", "x, y", "x, const", "x, image", "x, weight per channel"}
    outcomes: Dict[str, List[str]] = {}
    for spelled, (func, op) in entries():
        if op.kind is Kind.ELEMENTWISE:
            for name, call in calls_of(func, op) + [("x, 2", lambda t, f=func: f(t, 2))]:
                if name in names:
                    for grid in GRIDS:
                        result = check_call(func, name, lambda t, call=call: call(t[0]), grid, x)
                        outcomes.setdefault(f"{spelled}({name})", []).append(result)
    exact = {call for call, results in outcomes.items() if "exact" in results}
    assert {"torch.tanh(x)", "Tensor.add(x, y)", "Tensor.mul(x, 2)"} <= exact
    assert not {"F.local_response_norm(x, 3)", "torch.channel_shuffle(x, 2)"} & exact
