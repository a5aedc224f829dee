"""Spatial parallelism's refusals and the published implementations' defects, on several ranks.

Usage: spatial_checks.py CHECK [CHECK ...], each in turn in the same job; a CHECK is one of:
- defects: the three defects found in public spatial-parallel code, each shown absent here and
  shown to matter (the defective computation differs from one process): a halo exchange
  without backward (the neighbours' gradient contributions dropped), batch norm with each
  part's own statistics, and weight gradients averaged over the parts instead of summed;
- thin: an image too small for the grid is refused on every rank with the same message,
  naming the layer and the band, and what would fit;
- unsupported: a layer that cannot run on parts is refused on every rank, naming its path in
  the model, before any halo moves.
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
        self.block = nn.Sequential(nn.ReLU(), nn.GroupNorm(2, 4))

    def forward(self, x):
        return self.block(self.conv(x))


def unsupported() -> None:
    exchanges = []
    original = GroupComm.exchange
    GroupComm.exchange = lambda self, *a, **k: (exchanges.append(1), original(self, *a, **k))[1]
    for model, path in ((Normed(), "block.1 (GroupNorm)"),
                        (nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Upsample(scale_factor=2, mode="bilinear",
                                                                                   align_corners=True)), "1 (Upsample)")):
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


def print_ok(text: str) -> None:
    if hvd.rank() == 0:
        print(f"OK {text}", flush=True)


def main() -> None:
    hvd.init()
    for check in sys.argv[1:]:
        {"defects": defects, "thin": thin, "unsupported": unsupported}[check]()
    hvd.shutdown()


if __name__ == "__main__":
    run_main(main)
