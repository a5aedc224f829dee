"""Cost of the checks a spatial group makes at every training step, each alone and in a training
step of a small convolutional model with and without it (alternating, in one run):

- calls: every rank makes the same collective call (first in each forward and backward, and in
  net.gather and net.whole_mean): one allgather of two numbers;
- targets: at the start of each backward, what the ranks scattered since the forward (a loss's
  target): one small allgather;
- parameters: each forward's fingerprint of the model's parameters (compared in the forward's
  own gather); alone, it is timed on rank 0 for EDSR-baseline, EDSR and ResNet-50 on one thread.

Usage (docs/spatial.md quotes the figures):
    mpiexec -n 2 python scripts/measure_group_checks.py [--calls 250] [--rounds 12]
    torchrun --nproc-per-node 2 --standalone scripts/measure_group_checks.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

import hpdl.torch as hvd
from hpdl.bench.models import resnet50
from hpdl.sr.models import build_model
from hpdl.torch import spatial
from hpdl.torch.spatial import agreement, fingerprint

CHECKS = ("calls", "targets", "parameters")


def _median_us(run: Callable[[], None], calls: int, prepare: Callable[[], object] = lambda: None) -> float:
    times = []
    for _ in range(calls + 20):  # the first 20 warm up
        prepare()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times[20:]) * 1e6


def _switched_off(check: str) -> Dict[str, object]:
    """The module attributes that turn ``check`` off, and what they are with it on."""
    return {"calls": (agreement, "on_call", lambda comm, call, values=0: None),
            "targets": (agreement, "first_gradient_of", lambda out, action: None),
            "parameters": (fingerprint, "of_parameters", lambda parameters: [])}[check]


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=250, help="timed calls of each check alone (default: 250)")
    parser.add_argument("--rounds", type=int, default=12, help="alternating rounds of 5 steps (default: 12)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)  # every rank the same model, image and target
    net = spatial.SpatialParallel(nn.Sequential(*[nn.Conv2d(16, 16, 3, padding=1) for _ in range(8)]))
    x, target = torch.randn(2, 16, 64, 64), torch.randn(2, 16, 64, 64)

    alone = {"calls": _median_us(lambda: net._agree_on_call("forward"), args.calls),
             "targets": _median_us(net._agree_on_later_scatters, args.calls, prepare=lambda: net.scatter(target))}
    steps = {}
    for check in CHECKS:
        module, name, off = _switched_off(check)
        on = getattr(module, name)
        times = {"with": [], "without": []}
        for r in range(args.rounds):
            for mode in ("with", "without") if r % 2 else ("without", "with"):
                setattr(module, name, on if mode == "with" else off)
                started = time.perf_counter()
                for _ in range(5):
                    y = net(net.scatter(x))
                    F.mse_loss(y, net.scatter(target)).backward()
                times[mode].append((time.perf_counter() - started) / 5)
                net._scattered.clear()  # the steps without the targets' check left their targets
        setattr(module, name, on)
        steps[check] = (statistics.median(times["with"][2:]), statistics.median(times["without"][2:]))
    net.close()
    if hvd.rank() != 0:
        return
    for name, model in (("EDSR-baseline", build_model("edsr-baseline", 2)), ("EDSR", build_model("edsr", 2)),
                        ("ResNet-50", resnet50(num_classes=1000))):
        parameters = list(model.parameters())
        count = sum(p.numel() for p in parameters)
        took = _median_us(lambda: fingerprint.summary(fingerprint.of_parameters(parameters)), 5)
        print(f"the parameters' fingerprint of {name} ({count / 1e6:.1f} M values): {took / 1e3:.2f} ms")
    for check in CHECKS:
        with_, without = steps[check]
        cost = f"alone {alone[check]:.0f} us (median of {args.calls}); " if check in alone else ""
        print(f"{hvd.size()} ranks, {check}: {cost}a step {with_ * 1e3:.2f} ms with it, {without * 1e3:.2f} ms without "
              f"(medians of {args.rounds - 2} alternating rounds)")


if __name__ == "__main__":
    main()
