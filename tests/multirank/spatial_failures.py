"""A failure on one rank of a spatial group never leaves the others waiting in the group's own
communication (halo exchanges, the group's allreduces and allgathers): the job ends, and each
waiting rank says in one line what it was doing and why.

Usage: spatial_failures.py HOW WHEN MODEL
- HOW: raise (an exception, as a bad sample makes), stall (asleep in C code, time.sleep) or
  skip-backward (no loss.backward(), as a rank that skips a step with a non-finite loss of its
  part, but optimizer.step() all the same: WHEN is before-backward);
- WHEN, at step 2 on rank 0: between-steps (before the forward), in-forward (just before the
  model's last spatial layer: conv2, pool or bn), before-backward (after the forward) or
  in-backward (when the gradient of the last layer's output comes, before that layer's backward);
- MODEL: conv (two Conv2d(padding=1): halo exchanges), pool (global pooling: the group's
  allreduce) or bn (BatchNorm2d in training mode: the group's allgather).

Every rank splits each image into row bands. Rank 0 prints "FAILING at <unix time>" just before
it fails, so that the test measures how long the job took to end from there. The ranks step with
hvd.DistributedOptimizer, whose allreduces the failing rank skips for the others' to wait in.
"""

from __future__ import annotations

import collections
import sys
import time

import torch
from torch import nn

import hpdl.torch as hvd
from hpdl.torch import spatial

FAIL_STEP = 2
LAST_SPATIAL_LAYER = {"conv": "conv2", "pool": "pool", "bn": "bn"}  # where in-forward fails: just before it


def build(model: str) -> nn.Module:
    layers = {
        "conv": [("conv1", nn.Conv2d(3, 4, 3, padding=1)), ("relu", nn.ReLU()),
                 ("conv2", nn.Conv2d(4, 3, 3, padding=1))],
        "pool": [("conv1", nn.Conv2d(3, 4, 3, padding=1)), ("pool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten()),
                 ("fc", nn.Linear(4, 2))],
        "bn": [("conv1", nn.Conv2d(3, 4, 3, padding=1)), ("bn", nn.BatchNorm2d(4))],
    }[model]
    return nn.Sequential(collections.OrderedDict(layers))


def fail(how: str) -> None:
    print(f"FAILING at {time.time():.3f}", flush=True)
    if how == "raise":
        raise RuntimeError("a bad sample on rank 0")
    time.sleep(1000)  # in C code: no exception raised for this thread can reach it


def main() -> None:
    how, when, model_name = sys.argv[1:4]
    hvd.init()
    torch.manual_seed(0)
    model = build(model_name)
    failing = hvd.rank() == 0
    step = 0
    if failing and when == "in-forward":
        last = getattr(model, LAST_SPATIAL_LAYER[model_name])
        last.register_forward_pre_hook(lambda _module, inputs: fail(how) if step == FAIL_STEP and
                                       inputs[0].device.type != "meta" else None)
    if failing and when == "in-backward":
        def fail_in_its_backward(_module, _inputs, output) -> None:
            if step == FAIL_STEP and output.device.type != "meta":
                output.register_hook(lambda _grad: fail(how))

        getattr(model, LAST_SPATIAL_LAYER[model_name]).register_forward_hook(fail_in_its_backward)
    net = spatial.SpatialParallel(model)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01),
                                         named_parameters=net.named_parameters())
    x = torch.rand(2, 3, 12, 10, generator=torch.Generator().manual_seed(1))
    for step in range(4):
        if failing and step == FAIL_STEP and when == "between-steps":
            fail(how)
        optimizer.zero_grad()
        out = net(net.scatter(x))
        loss = out.square().mean()
        if failing and step == FAIL_STEP and how == "skip-backward":
            print(f"FAILING at {time.time():.3f}", flush=True)
        else:
            if failing and step == FAIL_STEP and when == "before-backward":
                fail(how)
            loss.backward()
        optimizer.step()
    print(f"rank {hvd.rank()} finished every step", flush=True)


if __name__ == "__main__":
    main()
