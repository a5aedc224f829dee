"""Spatial parallelism's refusals and the published implementations' defects, on several ranks.

Usage: spatial_checks.py CHECK [CHECK ...], each in turn in the same job; a CHECK is one of:
- defects: the three defects found in public spatial-parallel code, each shown absent here and
  shown to matter (the defective computation differs from one process): a halo exchange
  without backward (the neighbours' gradient contributions dropped), batch norm with each
  part's own statistics, and weight gradients averaged over the parts instead of summed;
- thin: an image too small for the grid is refused on every rank with the same message,
  naming the layer and the band, and what would fit;
- unsupported: a layer that cannot run on parts is refused on every rank, naming its path in
  the model, before any halo moves;
- thin-strided: four stride-2 3x3 convolutions on 24 and 20 rows over the ranks: the first
  forward and check_split refuse alike on every rank (the thinnest band decided it, not each
  rank's own);
- sizes: an interpolation to a size computed from a part's shape (2h + 1 rows: 37 to 75, not a
  whole factor) is the whole image's, as one process computes it (on 37 rows the parts differ:
  19 and 18);
- inputs: the whole image instead of a part, a part scattered twice, and parts that differ
  between ranks (height, width, batch, dtype) are refused on every rank, in one line;
- dropout: each band draws its own mask (ranks seeded alike), the same again for the same seed,
  and a checkpointed block's recomputation replays it; Dropout2d drops the same channels on
  every band; noise made to a part's lengths (``torch.randn(b, c, h, w)``) is drawn as
  ``randn_like`` draws it;
- calls: net.gather and net.whole_mean on rank 0 alone (the others at their next forward, or at
  their backward), and gathers of different maps, are refused alike on every rank, naming each
  rank's call; the group works afterwards;
- parameters: a rank whose model was not broadcast, ranks stepped by a plain optimizer, and a
  checkpoint loaded on rank 0 alone are refused alike on every rank, naming the parameter;
- hooks: forward hooks of the user's own run once per forward, on the real parts (not in the
  dry run: a hook keeping values failed there on the meta device, blamed on the image's size),
  a whole-image mean read in one equals one process's, and one reading a part's values as an
  array is refused alike, naming the layer;
- lifetime: 200 SpatialParallel made and closed leave the model as it was (no hooks, no
  forward of its own), a closed one refuses to run, and shutdown closes the ones left open.

With "uncaught" as the only CHECK, a refusal ends the program (not caught): each rank prints it
in one line, without a traceback.
"""

from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch
import torch.nn.functional as F
from _common import run_main
from spatial_models import build
from torch import nn

import hpdl.torch as hvd
from hpdl.torch import spatial
from hpdl.torch.spatial.comm import GroupComm


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def whole_input_gradient(net, layer, x, target):
    """The input gradient of ``layer`` on the whole image: one process's, and the spatial one gathered."""
    x_ref = x.clone().requires_grad_()
    F.mse_loss(layer(x_ref), target).backward()
    x_whole = x.clone().requires_grad_()
    F.mse_loss(net(net.scatter(x_whole)), net.scatter(target)).backward()
    return x_ref.grad, hvd.allreduce(x_whole.grad, op=hvd.Sum, name="defects.xgrad")


def defects() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 13, 9, generator=gen, dtype=torch.float64)  # 13 rows: unequal bands

    # 1. The halo's backward: rows next to a band's border read the neighbour's rows, so part
    # of their gradient is computed on the neighbour and must come back.
    conv = nn.Conv2d(3, 4, 3, padding=1).double()
    net = spatial.SpatialParallel(copy.deepcopy(conv))
    target = torch.randn(2, 4, 13, 9, generator=gen, dtype=torch.float64)
    expected, got = whole_input_gradient(net, conv, x, target)
    assert relative(got, expected) < 1e-12, f"input gradient differs by {relative(got, expected):.2g}"
    # Without the returned contributions (what a forward-only halo gives), the border rows differ.
    own = net.part(13, 9).rows
    forward_only = _forward_only_halo_gradient(conv, x, target, own)
    assert relative(forward_only, expected[..., own[0]:own[1], :]) > 1e-3, "a forward-only halo would not differ"
    print_ok("defects: halo backward")

    # 2. Batch norm over the whole image, not each part's: parts with different content.
    bn = nn.BatchNorm2d(3).double()
    net = spatial.SpatialParallel(copy.deepcopy(bn))
    skewed = x + torch.linspace(0, 4, 13, dtype=torch.float64).view(1, 1, 13, 1)
    out = net.gather(net(net.scatter(skewed)))
    expected = bn(skewed)
    assert relative(out, expected) < 1e-12, f"batch norm differs by {relative(out, expected):.2g}"
    assert relative(net.module.running_var, bn.running_var) < 1e-12, "running variance differs"
    per_part = nn.BatchNorm2d(3).double()(net.scatter(skewed))
    assert relative(per_part, expected[..., own[0]:own[1], :]) > 1e-2, "per-part statistics would not differ"
    print_ok("defects: batch norm statistics")

    # 3. Weight gradients summed over the parts (then averaged over replicas by the optimizer).
    conv = nn.Conv2d(3, 4, 3, padding=1).double()
    model = copy.deepcopy(conv)
    net = spatial.SpatialParallel(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), named_parameters=net.named_parameters())
    F.mse_loss(conv(x), target).backward()
    F.mse_loss(net(net.scatter(x)), net.scatter(target)).backward()
    opt.synchronize()
    assert relative(model.weight.grad, conv.weight.grad) < 1e-12, "weight gradient differs"
    averaged = model.weight.grad / hvd.size()  # what dividing the summed gradients by the part count gives
    assert relative(averaged, conv.weight.grad) > 0.1, "averaging would not differ"
    print_ok("defects: weight gradients summed over parts")


def _forward_only_halo_gradient(conv, x, target, own):
    """This rank's input gradient when the halo has no backward (MPI4DL's conv_spatial): the
    conv runs on the part padded with its neighbours' rows taken as constants."""
    top = x[..., own[0] - 1:own[0], :] if own[0] > 0 else x.new_zeros(x.shape[0], x.shape[1], 1, x.shape[3])
    bottom = x[..., own[1]:own[1] + 1, :] if own[1] < x.shape[2] else x.new_zeros(x.shape[0], x.shape[1], 1, x.shape[3])
    part = x[..., own[0]:own[1], :].clone().requires_grad_()
    windows = torch.cat([top, part, bottom], dim=2)
    out = F.conv2d(windows, conv.weight, conv.bias, padding=(0, 1))
    share = (own[1] - own[0]) / x.shape[2]
    (F.mse_loss(out, target[..., own[0]:own[1], :]) * share).backward()
    return part.grad


def thin() -> None:
    model = build("resnet-small").double()
    net = spatial.SpatialParallel(model, grid=(hvd.size(), 1))
    try:
        net(net.scatter(torch.randn(1, 3, 20, 20, dtype=torch.float64)))
    except spatial.SpatialError as err:
        message = str(err)
    else:
        raise AssertionError("a 20-row image on 3 row bands of resnet-small was not refused")
    everyone = hvd.allgather_object(message)
    assert len(set(everyone)) == 1, f"the ranks' messages differ: {everyone}"
    print_ok(f"thin: {message}")


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.block = nn.Sequential(nn.ReLU(), nn.LayerNorm(16))

    def forward(self, x):
        return self.block(self.conv(x))


def unsupported() -> None:
    exchanges = []
    original = GroupComm.exchange
    GroupComm.exchange = lambda self, *a, **k: (exchanges.append(1), original(self, *a, **k))[1]
    for model, path in ((Normed(), "block.1 (LayerNorm)"),
                        (nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.RMSNorm(16)), "1 (RMSNorm)")):
        net = spatial.SpatialParallel(model)
        try:
            net(net.scatter(torch.randn(1, 3, 16, 16)))
        except spatial.SpatialError as err:
            message = str(err)
        else:
            raise AssertionError(f"{type(model).__name__} was not refused")
        assert message.startswith(path), message
        assert not exchanges, "halos moved before the refusal"
        print_ok(f"unsupported: {message}")


def refusal_of(run) -> str:
    """The SpatialError ``run()`` raises, the same on every rank (checked), or fail."""
    try:
        run()
    except spatial.SpatialError as err:
        message = str(err)
    else:
        raise AssertionError("not refused")
    everyone = hvd.allgather_object(message)
    assert len(set(everyone)) == 1, f"the ranks' refusals differ: {everyone}"
    return message


def thin_strided() -> None:
    model = nn.Sequential(*[nn.Conv2d(3, 3, 3, stride=2, padding=p) for p in (1, 0, 1, 0)]).double()
    net = spatial.SpatialParallel(model)
    for height in (24, 20):
        x = torch.randn(1, 3, height, 40, dtype=torch.float64)
        message = refusal_of(lambda: net(net.scatter(x)))
        try:
            spatial.check_split(model, x.shape, (hvd.size(), 1), torch.float64)
        except spatial.SpatialError as err:
            assert str(err) == message, f"check_split said {err}, the forward {message}"
        else:
            raise AssertionError("check_split accepted what the forward refused")
        print_ok(f"thin-strided {height}: {message}")
    net.close()


class _Upsampled(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        h, w = x.shape[-2:]
        return F.interpolate(self.conv(x), size=(2 * h + 1, 2 * w))


def sizes() -> None:
    torch.manual_seed(0)  # the same model and image on every rank
    model = _Upsampled().double()
    net = spatial.SpatialParallel(copy.deepcopy(model))
    x = torch.randn(1, 3, 37, 8, dtype=torch.float64)
    out = net.gather(net(net.scatter(x)))
    expected = model(x)
    assert out.shape == expected.shape == (1, 3, 75, 16), (out.shape, expected.shape)
    assert torch.allclose(out, expected, rtol=0, atol=1e-12), (out - expected).abs().max()
    print_ok("sizes: 37 x 8 to 2h + 1 x 2w = 75 x 16, as one process")
    net.close()


def inputs() -> None:
    torch.manual_seed(0)  # the same model and image on every rank
    net = spatial.SpatialParallel(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1)).double())
    x = torch.randn(2, 3, 17, 8, dtype=torch.float64)
    print_ok(f"inputs whole: {refusal_of(lambda: net(x))}")
    print_ok(f"inputs twice: {refusal_of(lambda: net(net.scatter(net.scatter(x))))}")
    rank = hvd.rank()
    variants = {
        "height": torch.randn(2, 3, 17 + (rank == 0), 8, dtype=torch.float64),
        "width": torch.randn(2, 3, 17, 8 + (rank == 0), dtype=torch.float64),
        "batch": torch.randn(2 + (rank == 0), 3, 17, 8, dtype=torch.float64),
        "dtype": torch.randn(2, 3, 17, 8, dtype=torch.float64 if rank else torch.float32),
    }
    for what, image in variants.items():
        model = net if what != "dtype" else spatial.SpatialParallel(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1)))
        print_ok(f"inputs {what}: {refusal_of(lambda: model(model.scatter(image)))}")
    # The same image, but rank 0 alone builds no graph, or alone wants the input's gradient:
    # the backward halo exchanges would pair wrongly and wait until the stall timeout.
    def without_grad_on_rank_0():
        with torch.set_grad_enabled(rank != 0):
            net(net.scatter(x))

    print_ok(f"inputs grad mode: {refusal_of(without_grad_on_rank_0)}")
    print_ok(f"inputs requires_grad: {refusal_of(lambda: net(net.scatter(x).requires_grad_(rank == 0)))}")
    # the group goes on after a refusal: the next forward runs
    with torch.no_grad():
        out = net.gather(net(net.scatter(x)))
        assert torch.allclose(out, net.module(x)), "the forward after the refusals differs from one process"
    print_ok("inputs: the group works after the refusals")
    net.close()


def content() -> None:
    # Parts of the same size, but some rank's image is another: each would compute on its own
    # image's part, and the halo exchanges would pair up all the same.
    torch.manual_seed(0)
    net = spatial.SpatialParallel(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1)).double())
    batches = [torch.randn(2, 3, 17, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
               for s in range(3)]
    rank = hvd.rank()
    variants = {
        "another sample": batches[0] if rank != 2 else batches[2],
        "flipped": batches[0] if rank != 1 else batches[0].flip(-1),
        "swapped": batches[0] if rank != 1 else batches[0].flip(0),
        "a batch ahead": batches[min(rank, 1)],
    }
    for what, image in variants.items():
        print_ok(f"content {what}: {refusal_of(lambda: net(net.scatter(image)))}")
    # The same image up to rounding (a resize computed on each rank's GPU) is the same image.
    rounded = batches[0] * (1 + 1e-12 * rank)
    with torch.no_grad():
        out = net.gather(net(net.scatter(rounded)))
    assert torch.allclose(out, net.module(batches[0]), rtol=1e-9), "the forward of rounded copies differs"
    print_ok("content: copies equal up to rounding run")
    net.close()
    # The model's further inputs: a mask scattered beside the image, a whole tensor.
    net = spatial.SpatialParallel(_MaskedScaled().double())
    image, mask = batches[0], (batches[1] > 0).double()
    scale = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    variants = {
        "mask": lambda: net(net.scatter(image), net.scatter(mask if rank != 1 else mask.flip(-2)), scale=scale),
        "whole": lambda: net(net.scatter(image), net.scatter(mask), scale=scale if rank != 2 else scale + 1),
        "count": lambda: net(net.scatter(image), net.scatter(mask), **({"scale": scale} if rank != 1 else {})),
    }
    for what, run in variants.items():
        print_ok(f"content further {what}: {refusal_of(run)}")
    with torch.no_grad():
        out = net.gather(net(net.scatter(image), net.scatter(mask), scale=scale))
    assert torch.allclose(out, net.module(image, mask, scale=scale)), "the same further inputs give another forward"
    print_ok("content: the same further inputs run")
    net.close()
    # A loss's target, scattered before the forward or after it: compared before the forward
    # runs, or at the start of its backward, before any gradient moves.
    net = spatial.SpatialParallel(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1)).double())
    target = batches[1] if rank != 1 else batches[1].flip(-1)

    def target_first():
        t = net.scatter(target)
        F.mse_loss(net(net.scatter(image)), t).backward()

    def target_after():
        y = net(net.scatter(image))
        F.mse_loss(y, net.scatter(target)).backward()

    print_ok(f"content target before: {refusal_of(target_first)}")
    print_ok(f"content target after: {refusal_of(target_after)}")
    y = net(net.scatter(image))
    loss = F.mse_loss(y, net.scatter(batches[1]))
    loss.backward()
    with torch.no_grad():
        assert torch.allclose(net.whole_mean(loss, y), F.mse_loss(net.module(image), batches[1])), "another loss"
    print_ok("content: the same targets train")
    net.close()


class _MaskedScaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x, mask, scale=None):
        y = self.conv(x * mask)
        return y if scale is None else y * scale.view(1, -1, 1, 1)


def wrapping() -> None:
    # One rank wraps differently: another grid paired the halo exchanges wrongly (rank 1
    # computed on a wrong halo and finished, rank 0 waited), another model or loss reduction
    # gives other gradients, other checkpointed blocks other exchanges in backward.
    rank, size = hvd.rank(), hvd.size()

    def model(width=3):
        return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.Sequential(nn.Conv2d(width, 3, 3, padding=1)))

    variants = {
        "grid": lambda: spatial.SpatialParallel(model(), grid=(size, 1) if rank else (1, size)),
        "loss_reduction": lambda: spatial.SpatialParallel(model(), loss_reduction="sum" if rank == 2 else "mean"),
        "checkpoint": lambda: spatial.SpatialParallel(model(), checkpoint=rank == 1),
        "model": lambda: spatial.SpatialParallel(model(4 if rank == 1 else 3)),
        "dtype": lambda: spatial.SpatialParallel(model().double() if rank == 1 else model()),
    }
    for what, make in variants.items():
        print_ok(f"wrapping {what}: {refusal_of(make)}")
    torch.manual_seed(0)  # the variants drew differently on each rank
    net = spatial.SpatialParallel(model().double())
    x = torch.randn(1, 3, 17, 8, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(net.gather(net(net.scatter(x))), net.module(x)), "the wrapper made alike differs"
    print_ok("wrapping: a wrapper made alike runs after the refusals")
    net.close()


def dropout() -> None:
    torch.manual_seed(0)  # every rank alike, as for identical initialisation
    net = spatial.SpatialParallel(nn.Dropout(0.5))
    ones = torch.ones(1, 1, 8 * hvd.size(), 6)

    def masks(seed: int):
        torch.manual_seed(seed)
        return net.gather(net(net.scatter(ones)))

    first = masks(1)
    bands = first.view(hvd.size(), 8, 6)
    assert set(first.unique().tolist()) <= {0.0, 2.0}, first.unique()
    assert all(not torch.equal(bands[0], bands[b]) for b in range(1, hvd.size())), "bands share their mask"
    assert torch.equal(masks(1), first), "the same seed drew other masks"
    assert not torch.equal(masks(2), first), "another seed drew the same masks"
    dropped = (first == 0).double().mean().item()
    assert 0.25 < dropped < 0.75, f"{dropped:.2f} of the pixels dropped, for p = 0.5"
    net.close()
    # Dropout2d drops whole channels of the whole image: one draw for the group, the same
    # channels on every band (each band choosing its own would drop a channel in some bands only).
    net = spatial.SpatialParallel(nn.Dropout2d(0.5))
    many = torch.ones(4, 16, 8 * hvd.size(), 6)
    torch.manual_seed(6)
    kept = net.gather(net(net.scatter(many)))
    per_map = kept.flatten(2)
    assert torch.equal(per_map.amin(-1), per_map.amax(-1)), "a channel was dropped in some bands only"
    assert 0.25 < (per_map[..., 0] == 0).double().mean().item() < 0.75, "Dropout2d(0.5) dropped too few or too many"
    torch.manual_seed(6)
    assert torch.equal(net.gather(net(net.scatter(many))), kept), "the same seed dropped other channels"
    net.close()
    # Noise made to a part's lengths (``torch.randn(b, c, h, w)``, as a StyleGAN layer adds it) is
    # drawn as randn_like draws it: each band its own, never one pattern repeated down the image.
    drawn = {}
    for how in ("randn", "randn_like"):
        net = spatial.SpatialParallel(_Noisy(how))
        torch.manual_seed(5)
        drawn[how] = net.gather(net(net.scatter(ones)))
        net.close()
    assert torch.equal(drawn["randn"], drawn["randn_like"]), "torch.randn of a part's lengths drew otherwise"
    noise = drawn["randn"].view(hvd.size(), 8, 6)
    assert all(not torch.equal(noise[0], noise[b]) for b in range(1, hvd.size())), "bands share their noise"
    # A checkpointed block recomputes the same mask in backward: its gradients are those of the
    # forward's mask (the block without checkpointing, the same seed, gives the same).
    grads = []
    for checkpoint in (False, True):
        torch.manual_seed(3)
        block = nn.Sequential(nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Dropout(0.5)))
        net = spatial.SpatialParallel(block.double(), checkpoint=checkpoint)
        x = torch.randn(1, 1, 8 * hvd.size(), 6, dtype=torch.float64)
        torch.manual_seed(4)
        out = net(net.scatter(x))
        out.sum().backward()
        grads.append((net.gather(out.detach()), block[0][0].weight.grad.clone()))
        net.close()
    assert torch.equal(grads[0][0], grads[1][0]) and torch.allclose(grads[0][1], grads[1][1], atol=1e-12), \
        "the checkpointed block's recomputation drew another mask"
    print_ok("dropout: each band its own mask, the same for the same seed, replayed by checkpointing")


class _Noisy(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, x):
        b, c, h, w = x.shape
        return x + (torch.randn(b, c, h, w) if self.how == "randn" else torch.randn_like(x))


def double_backward() -> None:
    # A gradient penalty: the backward of the input gradient would differentiate each rank's
    # halo exchanges as its own arithmetic (parameter gradients 20-80 % off); it is refused.
    torch.manual_seed(0)
    net = spatial.SpatialParallel(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(),
                                                nn.Conv2d(4, 1, 3, padding=1)).double())
    x = torch.randn(2, 3, 17, 8, dtype=torch.float64)

    def penalty():
        part = net.scatter(x).requires_grad_()
        grad, = torch.autograd.grad(net(part).square().mean(), part, create_graph=True)
        grad.square().sum().backward()

    print_ok(f"double backward: {refusal_of(penalty)}")
    # A first-order backward after the refusal still runs and agrees with one process.
    part = net.scatter(x).requires_grad_()
    grad, = torch.autograd.grad(net(part).square().mean(), part)
    whole = x.clone().requires_grad_()
    expected, = torch.autograd.grad(net.module(whole).square().mean(), whole)
    assert torch.allclose(net.gather(grad), expected, rtol=1e-10, atol=1e-14), "the first-order gradient differs"
    print_ok("double backward: first-order gradients still exact")
    net.close()


def gather_replicated() -> None:
    # A classifier's logits are whole on every rank: gathering them gives them back, not the
    # ranks' copies side by side as the parts of a map (a 3 x 2 "map" of 3 x 2 copies).
    torch.manual_seed(0)
    net = spatial.SpatialParallel(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1),
                                                nn.Flatten(), nn.Linear(4, 2)).double())
    x = torch.randn(3, 3, 17, 8, dtype=torch.float64)
    logits = net(net.scatter(x))
    gathered = net.gather(logits)
    assert gathered.shape == (3, 2) and torch.allclose(gathered, net.module(x), rtol=1e-10), gathered.shape
    print_ok(f"gather replicated: {tuple(gathered.shape)}")
    net.close()


class _OwnConv(torch.autograd.Function):
    """A convolution with a backward of its own (PyTorch's "extending autograd" example)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.conv2d(x, weight, padding=1)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return (torch.nn.grad.conv2d_input(x.shape, weight, grad, padding=1),
                torch.nn.grad.conv2d_weight(x, weight.shape, grad, padding=1))


class _OwnGraph(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        if self.how == "function":
            return _OwnConv.apply(x, self.conv.weight)
        return torch.utils.checkpoint.checkpoint(self.conv, x, use_reentrant=self.how == "checkpoint")


def own_graph() -> None:
    # Backward passes the model computes itself would run its layers on the bare part (weight
    # gradients 50 % off): refused in training; the same models run under no_grad.
    import torch.utils.checkpoint  # noqa: F401 - torch.utils.checkpoint.checkpoint above
    torch.manual_seed(0)
    x = torch.randn(2, 3, 17, 8, dtype=torch.float64)
    for how in ("function", "checkpoint", "checkpoint-non-reentrant"):
        net = spatial.SpatialParallel(_OwnGraph(how).double())
        print_ok(f"own graph {how}: {refusal_of(lambda: net(net.scatter(x).requires_grad_()))}")
        with torch.no_grad():
            out = net.gather(net(net.scatter(x)))
        assert torch.allclose(out, net.module(x), rtol=1e-12, atol=1e-14), how
        net.close()
    print_ok("own graph: evaluation under no_grad runs")


def lifetime() -> None:
    model = build("edsr-baseline")
    before = {name: (dict(m._forward_pre_hooks), dict(m._forward_hooks), "forward" in m.__dict__)
              for name, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for i in range(200):
        net = spatial.SpatialParallel(model, checkpoint=True)
        if i % 2:
            net.close()
        else:
            with net:
                pass
        assert net.closed
    after = {name: (dict(m._forward_pre_hooks), dict(m._forward_hooks), "forward" in m.__dict__)
             for name, m in model.named_modules()}
    assert after == before, "the model kept hooks or a forward of SpatialParallel's"
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    refused = refusal_of(lambda: net(net.scatter(torch.zeros(1, 3, 8, 8))))
    assert "closed" in refused, refused
    left_open = spatial.SpatialParallel(model, checkpoint=True)
    hvd.shutdown()
    assert left_open.closed, "shutdown left a SpatialParallel open"
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    hvd.init()
    print_ok("lifetime: 200 made and closed, the model as it was")


def uncaught(what: str) -> None:
    """A refusal that ends the program: SpatialParallel's own one line on each rank (from the
    first forward, or from the wrapper's construction)."""
    model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.LayerNorm(16))
    if what == "grid":
        spatial.SpatialParallel(model, grid=(hvd.size() + 1, 1))
    elif what == "script":
        spatial.SpatialParallel(nn.Sequential(torch.jit.script(nn.Conv2d(3, 3, 3, padding=1))))
    else:
        net = spatial.SpatialParallel(model)
        net(net.scatter(torch.randn(1, 3, 16, 16)))


def calls() -> None:
    net = spatial.SpatialParallel(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1)).double())
    x = torch.randn(2, 3, 17, 8, dtype=torch.float64)
    y = net(net.scatter(x))
    alone = hvd.rank() == 0  # the others go on to their next forward, or their backward
    print_ok(f"calls gather: {refusal_of(lambda: net.gather(y) if alone else net(net.scatter(x)))}")
    print_ok(f"calls whole_mean: {refusal_of(lambda: net.whole_mean(y.mean(), y) if alone else net(net.scatter(x)))}")

    def gather_before_backward():
        out = net(net.scatter(x))
        if alone:
            net.gather(out)
        out.sum().backward()

    print_ok(f"calls before backward: {refusal_of(gather_before_backward)}")
    other = net.scatter(torch.randn(1, 3, 9, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    print_ok(f"calls other maps: {refusal_of(lambda: net.gather(y if alone else other))}")
    whole = net.gather(net(net.scatter(x)))
    assert torch.allclose(whole, net.module(x), rtol=0, atol=1e-12)
    print_ok("calls: the group works after the refusals")
    net.close()


def parameters() -> None:
    x = torch.randn(2, 3, 17, 8, dtype=torch.float64)

    def made(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 3, 3, padding=1)).double()

    # Made with another seed on the last rank, not broadcast: refused at the first forward.
    net = spatial.SpatialParallel(made(1 if hvd.rank() == hvd.size() - 1 else 0))
    print_ok(f"parameters not broadcast: {refusal_of(lambda: net(net.scatter(x)))}")
    net.close()
    # Stepped by a plain optimizer: each rank by its own part's gradient; refused at the next forward.
    net = spatial.SpatialParallel(made(0))
    plain = torch.optim.SGD(net.parameters(), lr=0.1)
    net(net.scatter(x)).square().mean().backward()
    plain.step()
    print_ok(f"parameters plain optimizer: {refusal_of(lambda: net(net.scatter(x)))}")
    net.close()
    # A checkpoint loaded on rank 0 alone (a later parameter), and then broadcast: refused, then run.
    net = spatial.SpatialParallel(made(0))
    net(net.scatter(x))
    if hvd.rank() == 0:
        state = net.module.state_dict()
        state["2.bias"] = state["2.bias"] + 1
        net.module.load_state_dict(state)
    print_ok(f"parameters loaded alone: {refusal_of(lambda: net(net.scatter(x)))}")
    hvd.broadcast_parameters(net.module.state_dict(), root_rank=0)
    net(net.scatter(x))
    print_ok("parameters: broadcast, the group runs")
    net.close()


def hooks() -> None:
    # Spectral norm's pre-hook (PyTorch's own) makes the weight: it runs in the dry run too.
    model = nn.Sequential(nn.utils.spectral_norm(nn.Conv2d(3, 4, 3, padding=1)), nn.ReLU(),
                          nn.Conv2d(4, 3, 3, padding=1)).double().eval()
    x = torch.randn(2, 3, 17, 8, dtype=torch.float64)
    with torch.no_grad():
        expected = model[1](model[0](x)).mean().item()
    means, calls = [], []
    model[1].register_forward_hook(lambda _m, _i, out: means.append(out.mean().item()))
    counting = nn.modules.module.register_module_forward_hook(lambda m, _i, _o: calls.append(type(m).__name__))
    try:
        net = spatial.SpatialParallel(model)
        for _ in range(2):
            net(net.scatter(x))
    finally:
        counting.remove()
    assert len(means) == 2 and all(abs(m - expected) <= 1e-12 * abs(expected) for m in means), (means, expected)
    assert sorted(calls) == sorted(["SpatialParallel", "Sequential", "Conv2d", "ReLU", "Conv2d"] * 2), calls
    print_ok("hooks: once per forward, a whole-image mean as one process's")
    model[2].register_forward_hook(lambda _m, _i, out: out.detach().cpu().numpy())
    print_ok(f"hooks reading a part: {refusal_of(lambda: net(net.scatter(x)))}")
    net.close()


def print_ok(text: str) -> None:
    if hvd.rank() == 0:
        print(f"OK {text}", flush=True)


CHECKS = {"defects": defects, "thin": thin, "unsupported": unsupported, "thin-strided": thin_strided,
          "sizes": sizes, "inputs": inputs, "dropout": dropout, "lifetime": lifetime,
          "double-backward": double_backward, "gather-replicated": gather_replicated,
          "own-graph": own_graph, "content": content, "wrapping": wrapping, "calls": calls,
          "parameters": parameters, "hooks": hooks}


def main() -> None:
    hvd.init()
    for check in sys.argv[1:]:
        torch.manual_seed(0)  # every rank draws the same model and image (the group compares its images)
        CHECKS[check]()
    hvd.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "uncaught":
        hvd.init()
        torch.manual_seed(0)
        uncaught(sys.argv[2] if len(sys.argv) > 2 else "forward")
    else:
        run_main(main)
