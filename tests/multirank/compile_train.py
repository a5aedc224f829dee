"""A model compiled with torch.compile trains under hvd.DistributedOptimizer as the eager model does.

Every rank builds one small network twice from the same seed (float64), compiles one copy
(inductor on CPU), and trains both through DistributedOptimizer on the same rank-specific
batches; after every step the compiled copy's parameters equal the eager copy's (to float64
rounding: inductor may fuse and reorder a sum) and are bitwise equal across ranks. Scenarios
(argv, default all): plain, passes2 (backward_passes_per_step=2), overlap (overlap_forward).
Prints "OK compile <scenario>" per scenario.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from _common import run_main

import hpdl.torch as hvd

STEPS = 3


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 3, 3, padding=1)).double()


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    return torch.randn(2, 3, 12, 12, generator=g, dtype=torch.float64)


def _train(model: nn.Module, forward, scenario: str, tag: str):
    passes = 2 if scenario == "passes2" else 1
    kwargs = {"overlap_forward": model} if scenario == "overlap" else {}
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                         named_parameters=[(f"{tag}.{n}", p) for n, p in model.named_parameters()],
                                         backward_passes_per_step=passes, **kwargs)
    snapshots = []
    for step in range(STEPS):
        optimizer.zero_grad()
        for part in range(passes):
            x = _batch(step * passes + part)
            loss = ((forward(x) - x) ** 2).mean()
            loss.backward()
        optimizer.step()
        if scenario == "overlap":
            forward(_batch(0))  # the next forward waits for the updates (overlap_forward)
        snapshots.append([p.detach().clone() for p in model.parameters()])
    return snapshots


def _check(scenario: str) -> None:
    torch._dynamo.reset()  # each scenario compiles its own model afresh
    eager = _net()
    compiled_model = _net()
    compiled = torch.compile(compiled_model)
    expected = _train(eager, eager, scenario, f"eager-{scenario}")
    got = _train(compiled_model, compiled, scenario, f"compiled-{scenario}")
    for step, (want, have) in enumerate(zip(expected, got)):
        for i, (w, h) in enumerate(zip(want, have)):
            if not torch.allclose(w, h, rtol=1e-10, atol=1e-12):
                raise AssertionError(f"{scenario}: step {step} parameter {i}: compiled differs from eager by "
                                     f"{(w - h).abs().max().item():.3g}")
            gathered = hvd.allgather(h.reshape(1, -1), name=f"check.{scenario}.{step}.{i}")
            if not all(torch.equal(gathered[0], row) for row in gathered):
                raise AssertionError(f"{scenario}: step {step} parameter {i} differs across ranks")
    if hvd.rank() == 0:
        print(f"OK compile {scenario}", flush=True)


def _main() -> None:
    hvd.init()
    for scenario in sys.argv[1:] or ["plain", "passes2", "overlap"]:
        _check(scenario)
    hvd.shutdown()


if __name__ == "__main__":
    run_main(_main)
