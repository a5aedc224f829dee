"""overlap_forward at the end of training: a rank that ends its loop first shuts down cleanly.

step() does not wait for the gradients with overlap_forward, so rank 0 reaches hvd.shutdown()
while rank 1 (held back before its last backward) still has its last gradients to submit.
Shutdown applies the pending updates first, so both ranks end with the same, fully updated
parameters; each prints "PARAMS <rank> <checksum>" after shutdown.
"""

from __future__ import annotations

import time

import torch

from _common import run_main
from optimizer_models import batch, flat_params, loss_fn, make_pair, shard

import hpdl.torch as hvd

STEPS = 3


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
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
    hvd.shutdown()
    diff = (flat_params(model) - flat_params(reference)).abs().max().item()
    if diff > 1e-5:
        raise AssertionError(f"rank {rank}: parameters differ from the one-process reference by {diff:.3g}")
    print(f"PARAMS {rank} {flat_params(model).double().sum().item():.12e}", flush=True)


if __name__ == "__main__":
    run_main(main)
