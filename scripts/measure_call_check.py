"""Cost of the check that every rank of a spatial group makes the same collective call (first in
each forward, backward, net.gather and net.whole_mean: one allgather of two numbers): the check
alone, and a training step of a small convolutional model with and without it (two checks a
step: the forward's and the backward's), alternating, in one run.

Usage (docs/spatial.md quotes the figures):
    mpiexec -n 2 python scripts/measure_call_check.py [--calls 250] [--rounds 12]
    torchrun --nproc-per-node 2 --standalone scripts/measure_call_check.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

import hpdl.torch as hvd
from hpdl.torch import spatial
from hpdl.torch.spatial import agreement


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=250, help="timed calls of the check alone (default: 250)")
    parser.add_argument("--rounds", type=int, default=12, help="alternating rounds of 5 steps (default: 12)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)  # every rank the same image and target
    net = spatial.SpatialParallel(nn.Sequential(*[nn.Conv2d(16, 16, 3, padding=1) for _ in range(8)]))
    x, target = torch.randn(2, 16, 64, 64), torch.randn(2, 16, 64, 64)

    alone = []
    for _ in range(args.calls + 20):
        started = time.perf_counter()
        net._agree_on_call("forward")
        alone.append(time.perf_counter() - started)

    checking = agreement.on_call
    times = {"with": [], "without": []}
    for r in range(args.rounds):
        for mode in ("with", "without") if r % 2 else ("without", "with"):
            agreement.on_call = checking if mode == "with" else (lambda comm, call, values=0: None)
            started = time.perf_counter()
            for _ in range(5):
                y = net(net.scatter(x))
                F.mse_loss(y, net.scatter(target)).backward()
            times[mode].append((time.perf_counter() - started) / 5)
    agreement.on_call = checking
    if hvd.rank() == 0:
        with_, without = statistics.median(times["with"][2:]), statistics.median(times["without"][2:])
        print(f"{hvd.size()} ranks: the check alone {statistics.median(alone[20:]) * 1e6:.0f} us (median of "
              f"{args.calls}); a step {with_ * 1e3:.2f} ms with it, {without * 1e3:.2f} ms without "
              f"(medians of {args.rounds - 2} alternating rounds)")
    net.close()


if __name__ == "__main__":
    main()
