"""Mixed precision on N ranks equals one process on the whole batch (tests/test_mixed_precision_multirank.py,
tests/test_gpu.py).

For bf16 and fp16 (hpdl/torch/mixed_precision.py around a DistributedOptimizer) against one
process with autocast and, for fp16, the scaler's own recipe: after every step the parameters
are close to the reference's and bitwise equal across ranks, and the loss scales are the same.
Step 2 overflows on the last rank only: its averaged gradients overflow on every rank, so every
rank skips that update and halves the scale, as the reference does. Prints "OK amp <mode>".

Usage: mixed_precision.py [--device cpu|cuda]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import device_arg, rank_device, run_main
from optimizer_models import assert_close, assert_ranks_equal, batch, loss_fn, make_pair, shard

import hpdl.torch as hvd
from hpdl.torch.mixed_precision import MixedPrecision

STEPS = 4
OVERFLOW_STEP = 2


def run(mode: str, device: torch.device) -> None:
    rank, size = hvd.rank(), hvd.size()
    model, reference = make_pair(seed=3)
    model.to(device)
    reference.to(device)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                         named_parameters=model.named_parameters())
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    mine, theirs = MixedPrecision(mode, device), MixedPrecision(mode, device)
    for step in range(STEPS):
        x, y = (t.to(device) for t in batch(step))
        overflow = float("inf") if step == OVERFLOW_STEP and mode == "fp16" else 1.0
        optimizer.zero_grad()
        with mine.autocast():
            loss = loss_fn(model, shard(x, rank, size), shard(y, rank, size))
        mine.backward(loss * (overflow if rank == size - 1 else 1.0))
        mine.step(optimizer)

        ref_optimizer.zero_grad()
        with theirs.autocast():
            ref_loss = loss_fn(reference, x, y)
        theirs.backward(ref_loss * overflow)
        theirs.step(ref_optimizer)

        what = f"amp {mode} step {step}"
        if mine.scale() != theirs.scale():
            raise AssertionError(f"{what}: loss scale {mine.scale()}, one process's {theirs.scale()}")
        # 16-bit forwards of a shard and of the whole batch round differently.
        assert_close(model, reference, what, rtol=2e-2, atol=2e-3)
        assert_ranks_equal(model, f"amp.{mode}.{step}")


def main() -> None:
    device_name = device_arg(sys.argv)
    hvd.init()
    device = rank_device(device_name)
    for mode in ("bf16", "fp16"):
        run(mode, device)
        if hvd.rank() == 0:
            print(f"OK amp {mode}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    run_main(main)
