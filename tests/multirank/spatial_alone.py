"""SpatialParallel.no_communication(), the measuring tool of `hpdl bench spatial`'s bound: each
rank computes its band alone, with halos of zeros and its own statistics, sending nothing.

Usage: spatial_alone.py (on 2 or more ranks, row bands).
"""

from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import run_main
from torch import nn

import hpdl.torch as hvd
from hpdl.engine import events as ev
from hpdl.torch import spatial


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 29, 11, generator=gen, dtype=torch.float64)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))
    model = model.double()
    net = spatial.SpatialParallel(copy.deepcopy(model))
    seen = []
    observer = lambda event: seen.append(event.kind) if event.kind in ev.GROUP_KINDS else None  # noqa: E731
    ev.subscribe(observer)

    # Alone: the band computed as one process computes it on the band by itself (zero padding
    # where the neighbours' rows would be, batch statistics of the band), forward and backward.
    part = net.scatter(x).requires_grad_()
    with net.no_communication():
        out = net(part)
        out.square().sum().backward()
    band = part.detach().clone().requires_grad_()
    alone = copy.deepcopy(model)
    expected = alone(band)
    expected.square().sum().backward()
    share = net.part(29, 11).numel_share  # the output's gradient is weighted by the band's share
    assert relative(out.detach(), expected.detach()) < 1e-12, "the band alone differs from one process on the band"
    assert relative(part.grad, share * band.grad) < 1e-12, "the input gradient alone differs"
    assert seen == [], f"no_communication() communicated: {seen}"
    print(f"OK alone: rank {rank} computed its band alone")

    # Not collective: one rank alone while the others wait for nothing.
    if rank == 0:
        with net.no_communication():
            net(net.scatter(x))
    hvd.barrier()
    print(f"OK alone: rank {rank} ran alone while the others did not")

    # Afterwards, communication again: the whole image's result, as one process computes it.
    whole = net.gather(net(net.scatter(x)).detach())
    reference = copy.deepcopy(model)(x).detach()
    assert relative(whole, reference) < 1e-12, "after no_communication() the result is not one process's"
    assert ev.HALO in seen and ev.SPATIAL in seen, seen
    ev.unsubscribe(observer)
    print(f"OK alone: rank {rank} communicates again")
    hvd.shutdown()


if __name__ == "__main__":
    run_main(main)
