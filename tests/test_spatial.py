"""Spatial parallelism: the band arithmetic and the dispatch in one process (dry runs, no
communication), then exactness against one process and the refusals on several ranks."""

from __future__ import annotations

import math
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpdl.torch as hvd
from hpdl.torch import spatial
from hpdl.torch.spatial import dispatch
from hpdl.torch.spatial.context import Context, track_modules
from hpdl.torch.spatial.geometry import Grid, Part, SpatialError, ThinBand, Window, bands, plan_bands
from hpdl.torch.spatial.parts import part_of, tagged
from ranks import SCRIPTS, run_ranks, shared_job

# -- bands and plans -----------------------------------------------------------------------


def test_bands_split_evenly_with_the_earlier_bands_larger():
    assert bands(97, 2) == [(0, 49), (49, 97)]
    assert bands(10, 3) == [(0, 4), (4, 7), (7, 10)]
    for length in range(1, 40):
        for parts in range(1, 6):
            spans = bands(length, parts)
            assert spans[0][0] == 0 and spans[-1][1] == length
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            sizes = [b - a for a, b in spans]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("kernel,stride,padding,dilation,ceil_mode", [
    (3, 1, 1, 1, False), (7, 2, 3, 1, False), (1, 2, 0, 1, False), (3, 2, 1, 1, True), (2, 2, 0, 1, True),
    (3, 3, 1, 2, False), (5, 2, 2, 1, True), (3, 2, 0, 1, True)])
def test_window_output_length_is_pytorchs(kernel, stride, padding, dilation, ceil_mode):
    window = Window(kernel, stride, padding, padding, dilation, ceil_mode)
    for length in range(max(1, dilation * (kernel - 1) + 1 - 2 * padding), 40):
        x = torch.zeros(1, 1, length, 1)
        expected = F.max_pool2d(x, (kernel, 1), (stride, 1), (padding, 0), (dilation, 1), ceil_mode).shape[2] \
            if padding <= kernel // 2 else None
        if expected is not None:
            assert window.output_length(length) == expected, (length, window)


def simulate(length: int, parts: int, window: Window) -> None:
    """Assemble every band's window input from its plan, with the neighbours' sends, and compare
    with the rows the window reads in one process (fill: -1)."""
    image = list(range(length))
    out_length = window.output_length(length)
    owned = bands(length, parts)
    needed = [window.needed(b) for b in bands(out_length, parts)]
    plans = plan_bands(owned, needed, length)
    for b, plan in enumerate(plans):
        (h0, h1), (a, z) = owned[b], needed[b]
        mine = image[h0:h1]
        from_prev = image[owned[b - 1][0]:owned[b - 1][1]][slice(*plans[b - 1].send_after)] if b > 0 else []
        from_next = image[owned[b + 1][0]:owned[b + 1][1]][slice(*plans[b + 1].send_before)] if b + 1 < parts else []
        assert len(from_prev) == plan.recv_before and len(from_next) == plan.recv_after
        assembled = [-1] * plan.fill_before + from_prev + mine[slice(*plan.keep)] + from_next + [-1] * plan.fill_after
        assert assembled == [image[i] if 0 <= i < length else -1 for i in range(a, z)], (b, plan)
        assert plan.assembled_length() == z - a


def check_random_plans(check, wanted: int = 400, draws: int = 1000) -> None:
    """Run ``check(length, parts, window)`` on ``wanted`` random cases that can be planned, out
    of at most ``draws``: a plan_bands that refused (ThinBand) nearly everything fails the test,
    with its last reason, instead of spinning to pytest's timeout."""
    rng = random.Random(0)
    tried, refused, empty, reason = 0, 0, 0, None
    for _ in range(draws):
        kernel, stride, dilation = rng.choice([1, 2, 3, 5, 7]), rng.choice([1, 2, 3]), rng.choice([1, 1, 2])
        padding = rng.randint(0, (dilation * (kernel - 1)) // 2 + 1)
        window = Window(kernel, stride, padding, rng.choice([padding, padding + 1]), dilation)
        length, parts = rng.randint(1, 60), rng.randint(1, 5)
        if window.output_length(length) < 1:
            empty += 1
            continue
        try:
            check(length, parts, window)
        except ThinBand as err:
            refused, reason = refused + 1, f"length {length}, {parts} parts, {window}: {err}"
            continue
        tried += 1
        if tried == wanted:
            return
    pytest.fail(f"only {tried} of {draws} random windows could be planned ({wanted} wanted): {refused} refused "
                f"as thin bands, {empty} with no output; the last refusal: {reason}")


def test_plans_give_every_band_exactly_the_rows_its_window_reads():
    check_random_plans(simulate)


def test_a_planner_that_refuses_everything_fails_the_random_check_naming_why():
    def refuse(length, parts, window):
        plan_bands(bands(5, 5), [(b - 2, b + 3) for b in range(5)], 5)  # 5x5 kernel on 1-row bands

    with pytest.raises(pytest.fail.Exception, match=r"only 0 of 50 random windows .* last refusal: length \d+, "
                                                     r"\d+ parts, Window\(.*\): row band \d of 5"):
        check_random_plans(refuse, draws=50)


def test_a_band_thinner_than_the_halo_is_refused_naming_it():
    with pytest.raises(ThinBand) as err:
        plan_bands(bands(5, 5), [(b - 2, b + 3) for b in range(5)], 5)  # 5x5 kernel on 1-row bands
    assert "band 2 of 5" in str(err.value) or "band 1 of 5" in str(err.value)


def test_regrouping_moves_rows_to_the_even_split():
    owned = [(0, 98), (98, 194)]  # pixel shuffle x2 of 49 + 48 rows
    plans = plan_bands(owned, bands(194, 2), 194)
    assert plans[0].keep == (0, 97) and plans[0].send_after == (97, 98)
    assert plans[1].recv_before == 1 and plans[1].keep == (0, 96)


# -- the dispatch, dry (meta tensors, no communication) ------------------------------------


def dry_forward(model: nn.Module, height: int, width: int, grid=(2, 1), rank: int = 0) -> torch.Tensor:
    part = Part(Grid(*grid), rank, height, width)
    x = tagged(torch.empty((1, 3) + part.local_size, device="meta"), part)
    ctx = Context(part.grid, rank, None, {id(m): name for name, m in model.named_modules()})
    track_modules(model)
    state = {n: t.to("meta") for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    with dispatch.running(ctx), torch.no_grad():
        return torch.func.functional_call(model, state, (x,))


class Functional(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.body = body

    def forward(self, x):
        return self.body(self.conv(x))


@pytest.mark.parametrize("body,refusal", [
    (lambda x: F.layer_norm(x, x.shape[1:]), "F.layer_norm"),
    (lambda x: F.linear(x, torch.ones(3, x.shape[-1], device=x.device)), "F.linear"),
    (lambda x: torch.flatten(x, 1), "flatten that changes the image dimensions"),
    (lambda x: x[..., 0], "indexing that selects rows or columns"),
    (lambda x: F.pad(x, (-1, 1, 0, 0), mode="reflect"), "with mode='reflect' and a negative amount"),
    (lambda x: torch.roll(x, 1, 2), "roll along an image dimension"),
    (lambda x: x.softmax(2), "softmax along an image dimension"),
    (lambda x: x.mean(2), "mean over one image dimension only"),
    (lambda x: x.transpose(2, 3), "transpose that moves the image dimensions"),
    (lambda x: F.interpolate(x, scale_factor=1.5, mode="area"), "interpolation with mode='area'"),
    (lambda x: F.adaptive_avg_pool2d(x, (1, None)), "adaptive average pooling to (1, None) is not supported"),
    (lambda x: F.max_pool2d(x, 2, return_indices=True), "F.max_pool2d_with_indices"),
    (lambda x: F.dropout1d(x[0]), "dropout1d"),
])
def test_calls_that_cannot_run_on_a_part_are_refused_naming_the_module(body, refusal):
    model = Functional(nn.Sequential())
    model.body = _Lambda(body)
    with pytest.raises(SpatialError) as err:
        dry_forward(model, 20, 16)
    assert str(err.value).startswith("body (_Lambda): ") and refusal in str(err.value), str(err.value)


@pytest.mark.parametrize("pad,grid,size,refusal", [
    (nn.ReflectionPad2d(3), (3, 1), (9, 8), "a reflect pad of 3 rows reads the 3 rows next to the border one, but "
                                            "the first row band holds 3: split the image into fewer row bands"),
    (nn.ReflectionPad2d(3), (1, 2), (9, 7), "a reflect pad of 3 columns reads the 3 columns next to the border one, "
                                            "but the last column band holds 3"),
    (nn.ReflectionPad2d(4), (3, 1), (9, 8), "a reflect pad of 4 rows reads the 4 rows next to the border one, but "
                                            "the first row band holds 3"),
    (nn.ReplicationPad2d(10), (3, 1), (9, 8), "a replicate pad wider than the border row band is not supported"),
    (nn.CircularPad2d((0, 0, 1, 5)), (3, 1), (10, 8), "a circular pad of 5 rows reads the image's first 5 rows, but "
                                                      "the first row band holds 4"),
    (nn.CircularPad2d((0, 0, 4, 0)), (3, 1), (10, 8), "a circular pad of 4 rows reads the image's last 4 rows, but "
                                                      "the last row band holds 3"),
    (nn.CircularPad2d((4, 0, 0, 0)), (1, 3), (4, 4), "a circular pad wider than the border column band"),
])
def test_a_pad_copying_border_rows_beyond_the_border_band_is_refused_in_one_line(pad, grid, size, refusal):
    model = nn.Sequential(nn.Conv2d(3, 3, 1), pad)
    with pytest.raises(SpatialError) as err:
        spatial.check_split(model, (1, 3) + size, grid)
    assert str(err.value).startswith(f"1 ({type(pad).__name__}): {refusal}"), str(err.value)
    spatial.check_split(model, (1, 3) + size, (1, 1))  # one band: one process's pad


class _Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("body,shape", [
    (lambda x: x + x * 2, (1, 4, 10, 16)),
    (lambda x: torch.cat([x, x.relu()], 1), (1, 8, 10, 16)),
    (lambda x: x[:, :2], (1, 2, 10, 16)),
    (lambda x: x.softmax(1), (1, 4, 10, 16)),
    (lambda x: F.interpolate(x, scale_factor=2, mode="bicubic"), (1, 4, 20, 32)),
    (lambda x: nn.PixelShuffle(2)(x), (1, 1, 20, 32)),
    (lambda x: x.view(1, 2, 2, 10, 16).sum(1), (1, 2, 10, 16)),
])
def test_element_wise_and_channel_calls_keep_the_part(body, shape):
    out = dry_forward(Functional(_Lambda(body)), 20, 16)
    assert tuple(out.shape) == shape and part_of(out) is not None


def test_a_model_with_parameters_not_made_yet_is_refused_with_the_recipe():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Sequential(nn.LazyConv2d(2, 3, padding=1)))
    with pytest.raises(SpatialError, match=r"^1\.0 \(LazyConv2d\): its parameters are not made yet \(a lazy module "
                                           r"makes them at its first call\): run the model once on a small input"):
        spatial.check_split(model, (1, 3, 20, 16), (2, 1))
    model(torch.zeros(1, 3, 4, 4))  # made: then it splits
    spatial.check_split(model, (1, 3, 20, 16), (2, 1))


def test_a_compiled_model_is_refused_before_anything_runs_naming_the_module():
    # Before, dynamo's own error surfaced from the first forward ("... is already tracked for mutation").
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 3, 1))
    with pytest.raises(SpatialError, match=r"^\(the model\) \(OptimizedModule\): a module compiled with "
                                           r"torch.compile \(or .compile\(\)\) cannot be split"):
        spatial.check_split(torch.compile(model), (1, 3, 20, 16), (2, 1))
    model[1].compile()  # in place
    with pytest.raises(SpatialError, match=r"^1 \(Conv2d\): a module compiled with torch.compile"):
        spatial.check_split(model, (1, 3, 20, 16), (2, 1))


def test_the_dry_run_gets_through_what_a_forward_does_besides_layers_and_leaves_the_model_as_it_was():
    # Batch norm's cumulative average reads its batch count as a float, a value read as a
    # number takes a branch, a cache is made at the first call, tensors made on the CPU meet
    # the parts (a mean subtracted): on the meta device, each failed ("PyTorch refused: ...;
    # the image may be too small"), and the cache stayed a meta tensor.
    sys.path.insert(0, str(SCRIPTS))
    import spatial_models

    model = spatial_models.Quirks()
    spatial.check_split(model, (2, 3, 20, 16), (2, 2))
    assert model.scale is None and model.bn.num_batches_tracked.item() == 0
    model(torch.zeros(2, 3, 8, 8))  # the real forward keeps its cache: the next dry run uses it on meta
    spatial.check_split(model, (2, 3, 20, 16), (2, 2))
    assert model.scale is not None and not model.scale.is_meta and model.bn.num_batches_tracked.item() == 1


class _CountedSteps(nn.Module):
    """A schedule kept in containers on the module (a step counter in a dict, a history list):
    the forward changes them in place, and branches on them."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.extra = nn.Conv2d(2, 2, 3, padding=1)
        self.state = {"step": 0, "seen": [], "sizes": set()}

    def forward(self, x):
        self.state["step"] += 1
        self.state["seen"].append(self.state["step"])
        self.state["sizes"].add(x.shape[-1])
        y = self.conv(x)
        return self.extra(y) if self.state["step"] == 2 else y / (1.0 + self.state["step"])


def test_the_dry_run_puts_back_what_the_model_keeps_in_dicts_lists_and_sets_in_place():
    # Each rank's dry run advanced the counter (the rank that also dry-runs the whole image once
    # more): the ranks' temperatures differed, silently, and a branch on the counter ran a layer
    # on one rank only, whose halo exchange waited for the stall timeout.
    model = _CountedSteps()
    state, seen, sizes = model.state, model.state["seen"], model.state["sizes"]
    spatial.check_split(model, (1, 2, 12, 8), (2, 2))
    assert model.state is state and state["seen"] is seen and state["sizes"] is sizes
    assert state == {"step": 0, "seen": [], "sizes": set()}
    model(torch.zeros(1, 2, 12, 8))
    spatial.check_split(model, (1, 2, 12, 8), (2, 1))
    assert state == {"step": 1, "seen": [1], "sizes": {8}}


@pytest.mark.parametrize("body", [
    lambda y: F.interpolate(y, size=(int(0.5 * y.shape[-2]), int(0.5 * y.shape[-1]))),  # a shape (1, 2, 3, 4)
    lambda y: F.interpolate(y, size=(int(y.shape[-2] * 0.5), int(y.shape[-1] * 0.5))),
    lambda y: y * (float(y.sum()) / y.numel()),
    lambda y: y * (1.0 * y.shape[-2] / y.shape[-1]),
    lambda y: y / float(np.sqrt(y.shape[-2])),
    lambda y: y * len(range(y.shape[-2])),
    # A torch.Size multiplies its plain values: the number meets only the replicated sum, or
    # makes a tensor of its own, where no part was there to tell (silently wrong before).
    lambda y: y - y.sum((2, 3), keepdim=True) / y.shape[2:].numel(),
    lambda y: y * torch.tensor(float(y.shape[-2:].numel())),
    lambda y: y - y.sum((2, 3), keepdim=True) / np.prod(y.shape[2:]),  # a numpy integer
], ids=["int(0.5 * h)", "int(h * 0.5)", "float / numel", "1.0 * h / w", "numpy.sqrt(h)", "range(h)",
        "sum / shape.numel()", "tensor(shape.numel())", "sum / numpy.prod(shape)"])
def test_a_number_computed_from_a_parts_own_length_is_refused_on_equal_bands_too(body):
    # 12 rows on 2 bands: 6 and 6, alike on every rank, so comparing the ranks showed nothing;
    # each computed with the part's 6 where one process has 12, silently (a wrong value, or
    # the output's shape (1, 2, 3, 4) where one process's is (1, 2, 6, 4)).
    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), _Lambda(body))
    with pytest.raises(SpatialError, match=r"^the model's forward computes with a part's own lengths: at call \d+, one "
                                           r"process on the whole image calls .* where a part calls"):
        spatial.check_split(model, (1, 2, 12, 8), (2, 1))


def test_a_number_computed_from_a_parts_own_length_on_unequal_bands_is_refused_naming_the_ranks():
    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), _Lambda(lambda y: y * int(y.shape[-2])))
    with pytest.raises(SpatialError, match=r"^the model's forward runs differently on the ranks' parts: at call 3 on a "
                                           r"part, group rank 0 calls Tensor.mul\(7\) in 1 \(_Lambda\) where group "
                                           r"rank 1 calls Tensor.mul\(6\) in 1 \(_Lambda\); it decides on a part's own "
                                           r"size: Python reads a part's own length"):
        spatial.check_split(model, (1, 2, 13, 8), (2, 1))


@pytest.mark.parametrize("body", [
    lambda y: F.interpolate(y, size=(y.shape[-2] // 2, round(y.shape[-1] * 0.5))),
    lambda y: y * (y.shape[-2] * 1.0) / math.sqrt(y.shape[-1]),
    lambda y: y * (y.sum() / y.numel()),
], ids=["h // 2, round(w * 0.5)", "h * 1.0, math.sqrt(w)", "on tensors"])
def test_numbers_computed_from_the_whole_images_lengths_run(body):
    spatial.check_split(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), _Lambda(body)), (1, 2, 12, 8), (2, 1))


@pytest.mark.parametrize("norm", [nn.SyncBatchNorm, hvd.SyncBatchNorm], ids=["torch", "hpdl"])
def test_a_sync_batch_norm_is_refused_before_anything_runs_naming_it(norm):
    # hpdl's was refused at its first call on a part ("Tensor.new_tensor is not supported"), and
    # PyTorch's under torchrun blamed the image's size (its kernels need a GPU): batch norm here
    # already takes the whole image's statistics.
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), norm(4))
    with pytest.raises(SpatialError, match=r"^1 \(SyncBatchNorm\): a SyncBatchNorm cannot be split: use nn.BatchNorm2d"):
        spatial.check_split(model, (1, 3, 20, 16), (2, 1))


def test_the_dry_run_runs_pytorchs_hooks_and_leaves_out_the_users_own():
    # A hook keeping values saw the dry run's meta tensors: "PyTorch refused: Cannot copy out of
    # meta tensor; no data!; the image may be too small for 2x2 bands". Spectral norm's pre-hook
    # (PyTorch's own) makes the weight, and must run.
    seen = []
    model = nn.Sequential(nn.utils.spectral_norm(nn.Conv2d(3, 4, 3, padding=1)), nn.ReLU())
    model[1].register_forward_hook(lambda _m, _i, out: seen.append(out.numpy()))
    model[0].register_forward_pre_hook(lambda _m, inputs: seen.append(inputs[0].numpy()))
    counting = nn.modules.module.register_module_forward_hook(lambda m, _i, _o: seen.append(type(m).__name__))
    try:
        spatial.check_split(model, (1, 3, 20, 16), (2, 2))
        assert seen == []
        with torch.no_grad():
            model(torch.zeros(1, 3, 8, 8))  # the hooks are all still there
    finally:
        counting.remove()
    assert len(seen) == 2 + 3


def test_global_pooling_makes_a_replicated_result():
    out = dry_forward(Functional(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))), 20, 16)
    assert tuple(out.shape) == (1, 2) and part_of(out) is None


def test_layout_is_spatial_by_data_and_grid_is_its_deprecated_name(monkeypatch):
    from hpdl.torch import process_sets, runtime, spatial

    monkeypatch.setattr(runtime, "size", lambda: 1)
    monkeypatch.setattr(runtime, "rank", lambda: 0)
    one = spatial.layout(spatial=1)  # one rank: the global set on both sides, nothing to register
    assert (one.spatial, one.data, one.replica, one.part) == (1, 1, 0, 0)
    assert one.spatial_set is one.data_set is process_sets.global_process_set
    with pytest.warns(DeprecationWarning, match=r"spatial\.layout\(spatial=S, data=D\)"):
        assert spatial.grid(spatial=1, data=1) == one
    with pytest.raises(SpatialError, match=r"^layout\(spatial=2, data=0\): expected positive integers"):
        spatial.layout(spatial=2)


# -- several ranks -------------------------------------------------------------------------

EXACTNESS = [
    ("mpiexec", 2, "2x1", ["resnet-small:97x83", "edsr-baseline:21x17", "srresnet:21x17",
                           "resnet-small:97x83:checkpoint", "edsr-baseline:21x17:checkpoint", "unet:37x29",
                           "unet-crop:37x29:checkpoint", "seghead:64x32"]),
    ("mpiexec", 3, "3x1", ["resnet-small:97x83", "edsr-baseline:23x19", "unet:37x29", "masked:17x8", "unbatched:17x8",
                           "quirks:17x8", "borders:17x8", "unshuffle:22x10", "pooled:17x8", "multiscale:24x12",
                           "deeplab:29x19", "pyramid:23x17", "cbam:17x13", "nnunet:23x17",
                           "nnunet:18x13:checkpoint", "handnorm:17x13", "convnext:17x13", "rowgate:17x13",
                           "minmax:17x13", "customfn:17x13", "focus:22x14"]),
    ("mpiexec", 4, "2x2", ["resnet-small:97x83", "edsr-baseline:21x17", "unet:37x29", "seghead:64x32", "masked:17x11",
                           "unbatched:17x11", "quirks:17x11", "borders:17x11",
                           "unshuffle:22x14", "pooled:17x11", "multiscale:24x18", "deeplab:29x22", "pyramid:23x17",
                           "cbam:17x13", "nnunet:23x17", "handnorm:17x13", "convnext:18x14:checkpoint",
                           "customfn:17x13", "focus:22x14"]),
    ("torchrun", 2, "2x1", ["resnet-small:97x83", "edsr-baseline:21x17", "unet-crop:37x29", "borders:17x8",
                            "cbam:17x13", "nnunet:23x17", "handnorm:17x13"]),
    ("mpiexec", 2, "1x2", ["unet-crop:37x29", "seghead:32x64", "borders:17x11", "deeplab:13x29:checkpoint"]),
    # Open MPI's halo exchanges, a middle band with two neighbours; the models are MPICH's above.
    ("openmpi", 3, "3x1", ["edsr-baseline:23x19"]),
]


@pytest.mark.multirank
@pytest.mark.parametrize("launcher,n,grid,cases", EXACTNESS, ids=[f"{l}-{g}" for l, _, g, _ in EXACTNESS])
def test_spatial_parallel_equals_one_process_in_float64(launcher, n, grid, cases):
    result = run_ranks("spatial_exactness.py", n, launcher, args=[grid, *cases], timeout=600)
    for case in cases:
        model, size, *flags = case.split(":")
        assert f"OK spatial {model} {size} {grid}" + (" checkpoint" if flags else "") in result.stdout, result.stdout


@pytest.mark.gpu
@pytest.mark.multirank
@pytest.mark.parametrize("n,env", [(1, {"HPDL_BACKEND": "nccl"}), (2, {"HPDL_RANKS_PER_GPU": "2"})],
                         ids=["nccl-1", "gloo-2-on-one-gpu"])
def test_spatial_parallel_on_cuda_equals_one_process(n, env):
    cases = ["resnet-small:97x83", "edsr-baseline:21x17", "srresnet:21x17:checkpoint", "borders:21x17",
             "deeplab:29x19", "cbam:17x13"]
    result = run_ranks("spatial_exactness.py", n, "torchrun", args=["--device", "cuda", f"{n}x1", *cases], env=env,
                       timeout=300)
    for case in cases:
        assert f"OK spatial {case.split(':')[0]} {case.split(':')[1]} {n}x1" in result.stdout, result.stdout
    assert "on cuda" in result.stdout


@pytest.mark.multirank
@pytest.mark.slow
def test_resnet50_and_edsr_split_equal_one_process():
    result = run_ranks("spatial_exactness.py", 2, "mpiexec", args=["2x1", "resnet50:128x40", "edsr:12x10"],
                       timeout=900)
    assert "OK spatial resnet50 128x40 2x1" in result.stdout and "OK spatial edsr 12x10 2x1" in result.stdout


@pytest.mark.multirank
def test_hybrid_spatial_by_data_equals_plain_data_parallelism():
    result = run_ranks("spatial_hybrid.py", 4, "mpiexec", args=["resnet-small:97x83", "edsr-baseline:21x17"],
                       timeout=600)
    assert "OK spatial hybrid resnet-small 97x83" in result.stdout
    assert "OK spatial hybrid edsr-baseline 21x17" in result.stdout


_THREE_RANK_CHECKS = ["defects", "thin", "thin-strided", "inputs", "dropout", "lifetime", "double-backward",
                      "gather-replicated", "own-graph", "content", "wrapping", "calls",
                      "parameters", "hooks"]


def _checks_on_three_ranks():
    """One job of 3 ranks for the tests below: the defects, the refusals of thin bands and of
    inputs that differ, dropout's masks, and SpatialParallel's lifetime."""
    return shared_job("spatial_checks.py " + " ".join(_THREE_RANK_CHECKS), lambda: run_ranks(
        "spatial_checks.py", 3, "mpiexec", args=_THREE_RANK_CHECKS, timeout=300))


def _checks_on_two_ranks():
    return shared_job("spatial_checks.py unsupported sizes calls parameters", lambda: run_ranks(
        "spatial_checks.py", 2, "torchrun", args=["unsupported", "sizes", "calls", "parameters"], timeout=300))


@pytest.mark.multirank
def test_the_published_implementations_defects_are_absent():
    result = _checks_on_three_ranks()
    for name in ("halo backward", "batch norm statistics", "weight gradients summed over parts"):
        assert f"OK defects: {name}" in result.stdout, result.stdout


@pytest.mark.multirank
def test_a_grid_too_fine_for_the_image_is_refused_on_every_rank():
    result = _checks_on_three_ranks()
    assert "OK thin: layer3.0.downsample.0 (Conv2d): row band 3 of 3" in result.stdout, result.stdout
    assert "use an image at least" in result.stdout and "or at most 2 row bands" in result.stdout


@pytest.mark.multirank
def test_unsupported_layers_are_refused_before_any_halo_moves():
    result = _checks_on_two_ranks()
    assert "OK unsupported: block.1 (LayerNorm): F.layer_norm is not supported" in result.stdout, result.stdout
    assert "OK unsupported: 1 (RMSNorm): F.rms_norm is not supported" in result.stdout, result.stdout


@pytest.mark.multirank
def test_a_band_too_thin_for_strided_convolutions_is_refused_alike_and_check_split_agrees():
    result = _checks_on_three_ranks()
    assert "OK thin-strided 24: 3 (Conv2d): row band 1 of 3" in result.stdout, result.stdout
    assert "OK thin-strided 20: 3 (Conv2d): row band 3 of 3 would hold none" in result.stdout, result.stdout


@pytest.mark.multirank
def test_a_size_computed_from_a_parts_shape_is_the_whole_images():
    result = _checks_on_two_ranks()
    assert "OK sizes: 37 x 8 to 2h + 1 x 2w = 75 x 16, as one process" in result.stdout, result.stdout


@pytest.mark.multirank
def test_the_users_forward_hooks_run_once_per_forward_on_the_parts():
    # They ran once per part more, in the dry run, where a hook keeping values failed and the
    # failure was blamed on the image's size.
    out = _checks_on_three_ranks().stdout
    assert "OK hooks: once per forward, a whole-image mean as one process's" in out, out
    assert "OK hooks reading a part: (the model) (Sequential): Tensor.numpy is not supported in the spatial part" in out


@pytest.mark.multirank
@pytest.mark.parametrize("job", ["two ranks, gloo", "three ranks, MPI"])
def test_collective_calls_made_on_some_ranks_only_are_refused_alike_naming_each_ranks_call(job):
    # Without the check, rank 0's whole_mean paired with the others' forward check: it logged a
    # wrong loss, then the others failed on rank 0's numbers read as image sizes.
    result = _checks_on_two_ranks() if job.startswith("two") else _checks_on_three_ranks()
    others = "group rank 1: {call}" + ("; group rank 2: {call}" if job.startswith("three") else "")
    common = "): the model's forward and backward, net.gather and net.whole_mean are collective over the group"
    for check, first, call in (("gather", "net.gather of 816 values", "the model's forward"),
                               ("whole_mean", "net.whole_mean", "the model's forward"),
                               ("before backward", "net.gather of 816 values", "the start of a backward"),
                               ("other maps", "net.gather of 816 values", "net.gather of 216 values")):
        expected = (f"OK calls {check}: the ranks of the spatial group made different calls (group rank 0: {first}; "
                    + others.format(call=call) + common)
        assert expected in result.stdout, result.stdout
    assert "OK calls: the group works after the refusals" in result.stdout


@pytest.mark.multirank
@pytest.mark.parametrize("job", ["two ranks, gloo", "three ranks, MPI"])
def test_ranks_holding_different_parameters_are_refused_alike_naming_the_parameter(job):
    # Before, each of these trained silently wrong: every band computed with its rank's weights.
    result = _checks_on_two_ranks() if job.startswith("two") else _checks_on_three_ranks()
    last = "group rank 1 has" if job.startswith("two") else "group rank 2 has"
    others = "group rank 1 has" if job.startswith("two") else "group ranks 1, 2 have"
    for check, ranks, name in (("not broadcast", last, "0.weight"), ("plain optimizer", others, "0.weight"),
                               ("loaded alone", others, "2.bias")):
        expected = (f"OK parameters {check}: the ranks of the spatial group hold different parameters: {ranks} other "
                    f"values than group rank 0 in {name}: every rank of the group must compute with the same model: "
                    "broadcast it from one rank after making or loading it (hvd.broadcast_parameters(")
        assert expected in result.stdout, result.stdout
    assert "OK parameters: broadcast, the group runs" in result.stdout


@pytest.mark.multirank
def test_inputs_that_are_not_the_groups_parts_of_one_image_are_refused_on_every_rank():
    result = _checks_on_three_ranks()
    assert "OK inputs whole: SpatialParallel's input must be this rank's part of the image" in result.stdout
    assert "OK inputs twice: scatter: this tensor is already a part of a 17 x 8 image" in result.stdout
    for what, rank0 in (("height", "18 x 8 image with leading dimensions [2, 3], float64"),
                        ("width", "17 x 9 image with leading dimensions [2, 3], float64"),
                        ("batch", "17 x 8 image with leading dimensions [3, 3], float64"),
                        ("dtype", "17 x 8 image with leading dimensions [2, 3], float32")):
        assert (f"OK inputs {what}: the ranks of the spatial group got different inputs (group rank 0: a part of a "
                f"{rank0}") in result.stdout, result.stdout
    assert ("OK inputs grad mode: the ranks of the spatial group got different inputs (group rank 0: a part of a "
            "17 x 8 image with leading dimensions [2, 3], float64 on cpu, under no_grad; group rank 1: a part of a "
            "17 x 8 image with leading dimensions [2, 3], float64 on cpu; ") in result.stdout, result.stdout
    assert "in the same grad mode" in result.stdout
    assert ("OK inputs requires_grad: the ranks of the spatial group got different inputs (group rank 0: a part of "
            "a 17 x 8 image with leading dimensions [2, 3], float64 on cpu, requiring grad; group rank 1: a part of a "
            "17 x 8 image with leading dimensions [2, 3], float64 on cpu; ") in result.stdout, result.stdout
    assert "OK inputs: the group works after the refusals" in result.stdout


@pytest.mark.multirank
def test_parts_of_different_images_of_one_size_are_refused_on_every_rank():
    result = _checks_on_three_ranks()
    for what, ranks in (("another sample", "rank 2 has"), ("flipped", "rank 1 has"), ("swapped", "rank 1 has"),
                        ("a batch ahead", "ranks 1, 2 have")):
        assert (f"OK content {what}: the ranks of the spatial group scattered different images of the same size: "
                f"group {ranks} other pixels than group rank 0") in result.stdout, result.stdout
    assert "OK content: copies equal up to rounding run" in result.stdout


@pytest.mark.multirank
def test_different_further_inputs_are_refused_on_every_rank_and_a_whole_one_runs():
    result = _checks_on_three_ranks()
    for what, where in (("mask", "rank 1 has other values in argument 2"),
                        ("whole", "rank 2 has other values in keyword argument scale")):
        assert (f"OK content further {what}: the ranks of the spatial group passed the model different further "
                f"inputs: group {where} than group rank 0") in result.stdout, result.stdout
    assert ("OK content further count: the ranks of the spatial group got different inputs (group rank 0: a part of "
            "a 17 x 8 image with leading dimensions [2, 3], float64 on cpu, and 2 further tensor inputs; group rank 1: "
            "a part of a 17 x 8 image with leading dimensions [2, 3], float64 on cpu, and 1 further tensor input; "
            ) in result.stdout, result.stdout
    assert "OK content: the same further inputs run" in result.stdout  # a whole tensor input (the dry run's too)


@pytest.mark.multirank
def test_a_target_scattered_differently_is_refused_before_its_gradients_move():
    result = _checks_on_three_ranks()
    for what, when in (("before", "before this forward"), ("after", "between the forward and its backward")):
        assert (f"OK content target {what}: the ranks of the spatial group scattered different tensors besides the "
                f"model's inputs {when} (a loss's target): in the first of them, group rank 1 has other values than "
                "group rank 0") in result.stdout, result.stdout
    assert "OK content: the same targets train" in result.stdout


@pytest.mark.multirank
def test_a_wrapper_made_differently_on_some_rank_is_refused_on_every_rank():
    result = _checks_on_three_ranks()
    start = "the ranks of the spatial group made SpatialParallel differently"
    for what, described in (
            ("grid", "group rank 0: grid (1, 3); group rank 1: grid (3, 1); group rank 2: grid (3, 1)"),
            ("loss_reduction", "group rank 0: loss_reduction 'mean'; group rank 1: loss_reduction 'mean'; "
                               "group rank 2: loss_reduction 'sum'"),
            ("checkpoint", "group rank 0: 0 checkpointed blocks (00000000); group rank 1: 1 checkpointed blocks"),
            ("model", "group rank 0: a model of 168 parameters (structure "),
            ("dtype", "group rank 0: a model of 168 parameters (structure ")):
        assert f"OK wrapping {what}: {start} ({described}" in result.stdout, result.stdout
    assert "OK wrapping: a wrapper made alike runs after the refusals" in result.stdout
    assert "must make it alike: the same model (its modules, and its parameters' shapes and types), grid" \
        in result.stdout


@pytest.mark.multirank
def test_a_backward_that_builds_a_graph_is_refused_on_every_rank():
    result = _checks_on_three_ranks()
    assert ("OK double backward: layer 2: a backward that builds a graph (create_graph=True, as a gradient penalty "
            "or a Hessian-vector product needs) is not supported through a spatial layer") in result.stdout, result.stdout
    assert "OK double backward: first-order gradients still exact" in result.stdout


@pytest.mark.multirank
def test_backward_passes_the_model_computes_itself_are_refused_in_training():
    result = _checks_on_three_ranks()
    for how, where in (("function", "(the model) (_OwnGraph)"), ("checkpoint", "conv (Conv2d)")):
        assert (f"OK own graph {how}: {where}: F.conv2d is not supported in the spatial part (it runs with gradients "
                "off on tensors that require them, as inside a torch.autograd.Function's forward or a "
                "torch.utils.checkpoint of the model's own") in result.stdout, result.stdout
    assert ("OK own graph checkpoint-non-reentrant: conv (Conv2d): F.conv2d is not supported in the spatial part (it "
            "runs inside a torch.utils.checkpoint of the model's own (use_reentrant=False), whose backward would "
            "recompute it on the part without its neighbours' rows") in result.stdout, result.stdout
    assert "OK own graph: evaluation under no_grad runs" in result.stdout


@pytest.mark.multirank
def test_gathering_a_replicated_output_gives_it_back():
    assert "OK gather replicated: (3, 2)" in _checks_on_three_ranks().stdout


@pytest.mark.multirank
def test_dropout_draws_each_bands_own_mask_reproducibly():
    result = _checks_on_three_ranks()
    assert "OK dropout: each band its own mask, the same for the same seed, replayed by checkpointing" in result.stdout


@pytest.mark.multirank
def test_spatial_parallel_leaves_the_model_as_it_was_when_closed():
    result = _checks_on_three_ranks()
    assert "OK lifetime: 200 made and closed, the model as it was" in result.stdout, result.stdout


@pytest.mark.multirank
def test_a_refusal_that_ends_the_program_is_one_line_per_rank():
    result = run_ranks("spatial_checks.py", 3, "mpiexec", args=["uncaught"], timeout=120, expect_ok=False)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "F.layer_norm is not supported" in line]
    assert sorted(lines) == [f"hpdl: rank {r}: 1 (LayerNorm): F.layer_norm is not supported in the spatial part "
                             "(it normalizes over each sample's pixels, which this rank holds only part of; over the "
                             "channels alone, after x.permute(0, 2, 3, 1), it runs)"
                             for r in range(3)], result.stderr
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.multirank
@pytest.mark.parametrize("what,message", [
    ("grid", "grid=(4, 1): expected (rows, cols) of positive integers whose product is the process set's size, 3"),
    ("script", "0 (RecursiveScriptModule): a TorchScript module (torch.jit.script or torch.jit.trace) cannot be "
               "split; wrap the module it was made from")])
def test_a_wrapper_refused_at_construction_is_one_line_per_rank(what, message):
    result = run_ranks("spatial_checks.py", 3, "mpiexec", args=["uncaught", what], timeout=120, expect_ok=False)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if message in line]
    assert sorted(lines) == [f"hpdl: rank {r}: {message}" for r in range(3)], result.stderr
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.multirank
def test_the_group_checks_measurement_runs_and_reports_every_check():
    script = Path(__file__).resolve().parents[1] / "scripts" / "measure_group_checks.py"
    out = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(script), "--calls", "5", "--rounds", "3"],
                         capture_output=True, text=True, timeout=240, check=True)
    lines = out.stdout.strip().splitlines()
    for name, line in zip(("EDSR-baseline", "EDSR", "ResNet-50"), lines):
        assert re.fullmatch(rf"the parameters' fingerprint of {name} \([\d.]+ M values\): [\d.]+ ms", line), line
    for check, line in zip(("calls", "targets", "parameters"), lines[3:]):
        alone = r"alone \d+ us \(median of 5\); " if check != "parameters" else ""
        assert re.fullmatch(rf"2 ranks, {check}: {alone}a step [\d.]+ ms with it, [\d.]+ ms without \(medians of 1 "
                            r"alternating rounds\)", line), out.stdout + out.stderr
    assert len(lines) == 6, out.stdout

