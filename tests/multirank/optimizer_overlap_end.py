"""overlap_forward at the end of training: a rank that ends its loop first shuts down cleanly.

step() does not wait for the gradients with overlap_forward, so rank 0 reaches hvd.shutdown()
while rank 1 (held back before its last backward) still has its last gradients to submit.
Shutdown must let those allreduces finish on every rank first. The argument says what the
script still holds when it shuts down:

- ``kept``: model and optimizer. Shutdown applies the pending updates.
- ``model``: the model only (the optimizer was made and dropped inside a training function).
  The model keeps its optimizer alive, so the last step's update is not lost.

Both print "PARAMS <rank> <checksum>" after checking the parameters against a one-process
reference.

- ``none``: nothing (a training function that returned). The last update is gone with the
  model, but the slower rank's last backward must still succeed; each rank prints
  "DONE <rank>".
"""

from __future__ import annotations

import gc
import sys
from typing import List, Optional
import time

import torch

from _common import run_main
from optimizer_models import batch, flat_params, loss_fn, make_pair, shard

import hpdl.torch as hvd

STEPS = 3


def train(rank: int, size: int):
    """Train with overlap_forward; return the model, its one-process reference and the optimizer."""
    model, reference = make_pair(seed=3)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), overlap_forward=model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        if rank == 1 and step == STEPS - 1:
            time.sleep(1.5)  # rank 0 reaches shutdown first
        loss_fn(model, shard(x, rank, size), shard(y, rank, size)).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_fn(reference, x, y).backward()
        ref_opt.step()
    return model, reference, opt


def main(argv: Optional[List[str]] = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    keep = args[0] if args else "kept"
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model, reference, opt = train(rank, size)
    if keep != "kept":
        del opt
        if keep == "none":
            del model, reference
        gc.collect()
    hvd.shutdown()
    if keep == "none":
        print(f"DONE {rank}", flush=True)
        return
    diff = (flat_params(model) - flat_params(reference)).abs().max().item()
    if diff > 1e-5:
        raise AssertionError(f"rank {rank}: parameters differ from the one-process reference by {diff:.3g}")
    print(f"PARAMS {rank} {flat_params(model).double().sum().item():.12e}", flush=True)


if __name__ == "__main__":
    run_main(main)
