"""Every entry of the spatial op table, called on a split tensor at every dimension and on both
grid directions, against one process: exact (forward, and backward where it has a gradient),
or refused on every rank alike with one SpatialError; never silently wrong, never a rank that
fails alone. Anything not in the table is refused before it runs. (The same calls on parts of
other layouts, channels last and unbatched: test_spatial_op_layouts.py; the calls themselves:
spatial_op_calls.py.)

The group is simulated in one process (tests/spatial_sim.py: a thread per rank); the
multi-rank tests check the same layers over the real communicators.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F

from hpdl.torch.spatial import dispatch, ops, ops_table, resampling
from hpdl.torch.spatial.context import Context
from hpdl.torch.spatial.geometry import Grid, Part, SpatialError
from hpdl.torch.spatial.ops import Kind
from hpdl.torch.spatial.parts import part_of, tagged
from spatial_op_calls import (GRIDS, HANDLER_CALLS, NEEDS_A_GPU, NOT_IN_A_FORWARD, RANDOM_KINDS, STRIDED_SLICES, X,
                              calls_of,
                              check_call, check_the_gradient, entries, tied, with_nan)
from spatial_sim import assemble, assemble_gradients, one_process_gradient, refused_alike, run_parts


@pytest.mark.parametrize("kind", [k for k in Kind], ids=[k.value for k in Kind])
def test_every_table_entry_is_exact_or_refused_alike_on_every_dimension_and_grid(kind):
    tried: Dict[str, List[str]] = {}
    for spelled, (func, op) in entries():
        if op.kind is not kind:
            continue
        results = tried.setdefault(spelled, [])
        for name, call in calls_of(func, op):
            for grid in GRIDS:
                results.append(check_call(func, name, call, grid))
    untried = [s for s, r in tried.items()
               if all(x == "skip" for x in r) and s not in NEEDS_A_GPU | NOT_IN_A_FORWARD and kind is not Kind.REFUSED]
    assert not untried, f"no call of these ran in one process, so nothing was checked: {untried}"
    if kind in (Kind.ELEMENTWISE, Kind.CONVERT, Kind.LIKE, Kind.SHAPE, Kind.METADATA, *RANDOM_KINDS):
        never_exact = [s for s, r in tried.items() if "exact" not in r and s not in NEEDS_A_GPU | NOT_IN_A_FORWARD]
        assert not never_exact, f"refused in every call, though the kind runs on a part: {never_exact}"
    if kind is Kind.REFUSED:  # whatever the arguments: refused before it runs
        assert all("exact" not in r for r in tried.values())
        for spelled, (func, op) in entries():
            if op.kind is Kind.REFUSED:
                with pytest.raises(SpatialError, match=re.escape(f"is not supported in the spatial part ({op.why}")):
                    _call_on_a_part(func)


def test_the_handlers_and_crops_are_exact_forward_and_backward_on_a_2x2_grid_too():
    for func, calls in HANDLER_CALLS.items():
        for name, call in calls:
            for grid in GRIDS + [(2, 2)]:
                if check_call(func, name, call, grid) == "exact":
                    check_the_gradient(func, name, call, grid)


@pytest.mark.parametrize("grid", GRIDS + [(2, 2), (3, 1), (1, 3)])
def test_slices_with_a_step_along_the_image_are_exact_forward_and_backward(grid):
    # Each output band receives the rows it picks from its neighbours: 7 rows on 3 bands
    # picked every 2nd, 3rd or 4th row, from an offset, land unevenly on the bands.
    outcomes = {name: check_call(torch.Tensor.__getitem__, name, call, grid) for name, call in STRIDED_SLICES}
    expected = {}
    for name, call in STRIDED_SLICES:
        try:
            rows, cols = call(X).shape[-2:]
        except ValueError:  # one process refuses a step of 0 (and so does each rank)
            expected[name] = "skip"
            continue
        # Refused only where the result has fewer rows or columns than there are bands.
        expected[name] = "refused" if rows < grid[0] or cols < grid[1] else "exact"
    assert outcomes == expected
    assert list(expected.values()).count("exact") >= 2
    for name, call in STRIDED_SLICES:
        if outcomes[name] == "exact":
            assert check_the_gradient(torch.Tensor.__getitem__, name, call, grid), name


@pytest.mark.parametrize("call,grid,status", [
    ("no pad count", (1, 2), "exact"), ("no pad count", (2, 2), "exact"),
    ("size from shape", (2, 1), "exact"), ("size of the map", (1, 2), "exact"),
    ("size 2h+1", (2, 1), "exact"), ("1.5", (2, 1), "exact"), ("bicubic 1.7 x 2.5", (2, 2), "exact"),
    ("align to 13 x 10", (2, 1), "exact"), ("align bicubic 2", (1, 2), "exact"), ("to 2 x 1", (2, 1), "exact"),
    ("antialias", (2, 1), "refused"), ("area", (1, 2), "refused"), ("area 1 x 0.5", (2, 2), "exact"),
    ("area 2 x 3", (2, 1), "exact"), ("lp 1.5 of 2 x 3 ceil", (2, 2), "exact"), ("lp -inf of 3 s1", (2, 1), "exact"),
    ("5 x 4 (overlapping windows)", (2, 2), "exact"), ("None x 1", (2, 1), "exact"), ("None x 1", (1, 2), "refused"),
    ("2 x None", (1, 2), "exact"), ("2 x None", (2, 2), "refused"), ("row gate", (2, 1), "exact"),
    ("None x 2", (2, 1), "exact"), ("None x 2", (2, 2), "refused"), ("None x 1 indices", (2, 1), "refused"),
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
    ("max whole image ties", (2, 1), "exact"), ("IMDN's mean", (2, 1), "exact"), ("IMDN's mean", (1, 2), "refused"),
    ("3 keepdim", (2, 1), "exact"), ("NaN check", (2, 2), "exact"), ("any (2, 3) keepdim", (2, 2), "exact"),
    ("any 3", (1, 2), "refused"), ("finite", (2, 1), "exact"), ("count all", (1, 2), "exact"),
    ("count 2", (2, 2), "refused"),
    ("NaN (2, 3)", (2, 2), "exact"), ("NaN (2, 3) keepdim", (2, 1), "exact"), ("inf ties keepdim", (2, 2), "exact"),
    ("-inf (1, 2, 3)", (1, 2), "exact"), ("inf", (2, 1), "exact"),
    ("2 keepdim", (1, 2), "exact"), ("2 keepdim", (2, 1), "refused"), ("(1, 3) keepdim, then 2", (2, 1), "exact"),
    ("aminmax all", (2, 2), "exact"), ("aminmax ties", (2, 1), "exact"), ("aminmax method", (1, 2), "exact"),
    ("aminmax 0 keepdim", (2, 2), "exact"), ("aminmax 2", (2, 1), "refused"),
    ("prod all", (2, 2), "exact"), ("prod a zero", (2, 1), "exact"), ("prod a zero", (1, 2), "exact"),
    ("prod zeros", (2, 2), "exact"), ("prod dtype", (2, 1), "exact"), ("prod 1", (2, 2), "exact"),
    ("prod 3", (1, 2), "refused"),
])
def test_what_the_reported_cases_do_now(call, grid, status):
    for func, calls in HANDLER_CALLS.items():
        for name, fn in calls:
            if name == call:
                assert check_call(func, name, fn, grid) == status
                return
    raise AssertionError(f"no call named {call}")


BROADCASTS = {  # a part of a map of length 1 along one image dimension beside the part
    "x * row means": lambda t: t * t.mean(3, keepdim=True),
    "row sums * x": lambda t: t.sum(3, keepdim=True) * torch.sigmoid(t),
    "where(x, row means)": lambda t: torch.where(t > 0.5, t, t.mean(-1, keepdim=True)),
    "addcmul(x, row means, x)": lambda t: torch.addcmul(t, t.mean(3, keepdim=True), t),
    "x *= row means": lambda t: (t * 1).mul_(t.mean(3, keepdim=True)),
    "x - column means": lambda t: t - t.mean(2, keepdim=True),
    "row means + column means": lambda t: t.mean(3, keepdim=True) + t.mean(2, keepdim=True),
}


@pytest.mark.parametrize("call,grid,status", [
    (call, grid, "exact" if ("column" not in call and grid[1] == 1 or "row" not in call and grid[0] == 1)
     else "refused") for call in BROADCASTS for grid in ((2, 1), (1, 2), (2, 2))])
def test_parts_broadcast_along_an_image_dimension_the_grid_does_not_split(call, grid, status):
    # Each rank holds whole rows on row bands: its own column of row means spreads along its own
    # rows as one process spreads the whole column; where the columns are split too, refused.
    assert check_call(torch.mul, call, BROADCASTS[call], grid) == status
    if status == "exact":
        assert check_the_gradient(torch.mul, call, BROADCASTS[call], grid)


def test_parts_that_cannot_broadcast_band_by_band_are_refused_naming_both_sizes():
    x = torch.randn(1, 2, 8, 6, dtype=torch.float64)
    outcomes = run_parts((2, 1), lambda t: t * F.avg_pool2d(t, 2), x)
    assert "Tensor.mul of parts of maps of different sizes is not supported in the spatial part (8 x 6 and 4 x 3; " \
        "parts broadcast only along an image dimension the grid does not split)" in refused_alike(outcomes)


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


def test_parts_given_by_keyword_in_a_list_are_parts():
    # torch.cat(tensors=[...]) made a tensor no one took for a part: the next convolution ran on
    # the bare band, and the output passed for the whole image.
    weight = torch.randn(2, 2 * X.shape[1], 3, 3, dtype=X.dtype)
    for call in (lambda t: F.conv2d(torch.cat(tensors=[t, 2 * t], dim=1), weight, padding=1),
                 lambda t: F.conv2d(torch.stack(tensors=(t, t * t), dim=1).flatten(1, 2), weight, padding=1)):
        for grid in GRIDS + [(2, 2)]:
            outcomes = run_parts(grid, call, X, backward=True)
            assert torch.allclose(assemble([o.value for o in outcomes]), call(X), rtol=1e-12)
            gradient = assemble_gradients(outcomes, grid, X.shape)
            assert torch.allclose(gradient, one_process_gradient(call, X), rtol=1e-12, atol=1e-14)


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


def test_the_whole_images_max_and_min_are_exact_forward_and_backward():  # and aminmax's
    # x / x.max(): its gradient shared evenly among the values equal to the maximum (the NaNs,
    # where it is NaN), whichever band holds them.
    for call in (lambda t: t / t.max(), lambda t: t - torch.min(t), lambda t: tied(t).max() * t,
                 lambda t: with_nan(t).max(), lambda t: tied(t).min(), lambda t: (t > 0.5).max().to(t.dtype) * t,
                 lambda t: t * sum(torch.aminmax(tied(t)))):
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


class _SwishOwnBackward(torch.autograd.Function):  # a memory-efficient Swish: pixel by pixel
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * s * (1 + x * (1 - s))


class _ReversedGradient(torch.autograd.Function):  # a domain classifier's gradient reversal
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -0.5 * grad


class _BiasOwnBackward(torch.autograd.Function):  # its bias's gradient a sum over the image
    @staticmethod
    def forward(ctx, x, bias):
        return x + bias.view(1, -1, 1, 1)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.0, grad.sum((0, 2, 3))


class _SmoothedGradient(torch.autograd.Function):  # its backward reads the neighbours' pixels
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        kernel = torch.ones(grad.shape[1], 1, 3, 3, dtype=grad.dtype) / 9
        return F.conv2d(grad, kernel, padding=1, groups=grad.shape[1])


class _CenteredGradient(torch.autograd.Function):  # its backward subtracts the image's mean gradient
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return grad - grad.sum((2, 3), keepdim=True) / (grad.shape[-2] * grad.shape[-1])


class _NormalizedGradient(torch.autograd.Function):  # its backward divides by the gradient's norm
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return grad / grad.norm()


_PYTORCHS_APPLY = torch.autograd.Function.__dict__["apply"]


def test_a_models_own_autograd_function_is_exact_where_its_backward_works_pixel_by_pixel_and_refused_elsewhere():
    bias = torch.randn(X.shape[1], dtype=X.dtype, requires_grad=True)
    for call in (lambda t: _SwishOwnBackward.apply(t) * t, lambda t: _ReversedGradient.apply(t * t),
                 lambda t: _BiasOwnBackward.apply(t, bias)):
        for grid in GRIDS + [(2, 2)]:
            outcomes = run_parts(grid, call, X, backward=True)
            assert torch.allclose(assemble([o.value for o in outcomes]), call(X), rtol=1e-13)
            gradient = assemble_gradients(outcomes, grid, X.shape)
            assert torch.allclose(gradient, one_process_gradient(call, X), rtol=1e-12, atol=1e-14)
    # Computed from the part's pixels alone, these were silently wrong (the smoothing at the
    # bands' edges, the centring by each part's own mean): refused on every rank, naming the
    # Function and the call.
    for function, call in ((_SmoothedGradient, "F.conv2d of a part"),
                           (_CenteredGradient, "Tensor.sub of the part's pixels with a sum over the part"),
                           (_NormalizedGradient, "Tensor.norm of a part")):
        for grid in GRIDS:
            refused = refused_alike(run_parts(grid, lambda t: function.apply(t) * t, X, backward=True))
            assert refused is not None and refused.startswith(
                f"{function.__name__}.backward (a torch.autograd.Function of the model's own, given a part): {call} "
                "is not supported: its backward runs on the part alone"), refused
    # Wrapped only while a spatial forward runs: PyTorch's own again after.
    assert torch.autograd.Function.__dict__["apply"] is _PYTORCHS_APPLY


def test_a_part_flattened_is_reduced_over_the_whole_image_and_refused_as_a_sequence():
    # x.view(b, c, -1).mean(-1) (squeeze-and-excitation written by hand) was refused at the view;
    # a flattened part holds the part's pixels, so only a reduction over them is the image's.
    n, c = X.shape[:2]
    for call in (lambda t: t * t.flatten(2).mean(-1)[..., None, None],
                 lambda t: t - t.view(n, c, -1).amax(dim=2, keepdim=True).unsqueeze(-1),
                 lambda t: t * torch.sum(t.reshape(n, c, t.shape[2] * t.shape[3]), -1).view(n, c, 1, 1),
                 lambda t: t * (t.flatten(2).amin(-1).sum() / t.flatten(2).shape[-1])):
        for grid in GRIDS + [(2, 2)]:
            outcomes = run_parts(grid, call, X, backward=True)
            assert torch.allclose(assemble([o.value for o in outcomes]), call(X), rtol=1e-12)
            gradient = assemble_gradients(outcomes, grid, X.shape)
            assert torch.allclose(gradient, one_process_gradient(call, X), rtol=1e-12, atol=1e-14)
    for call, written in ((lambda t: torch.softmax(t.flatten(2), -1).view_as(t), "torch.softmax"),
                          (lambda t: t.flatten(2).permute(0, 2, 1).sum(), "Tensor.permute"),
                          (lambda t: t * t.flatten(2).mean(1).view(n, 1, *t.shape[-2:]), "Tensor.mean")):
        refused = refused_alike(run_parts((2, 1), call, X, backward=True))
        assert refused is not None and f"{written} of a part flattened (x.flatten(2), x.view(n, c, -1)) is not " \
                                       "supported" in refused, refused
