"""N ranks, each training on its shard of a batch, equal one process training on the whole batch.

For every scenario, after every step: the parameters agree with a one-process reference (to
float32 tolerance, looser with 16-bit compression) and are bitwise equal across ranks. Odd
ranks list their parameters and compute the two branches in the other order, so gradients
reach the engine in a different order than on even ranks.

Usage: optimizer_equivalence.py [--device cpu|cuda] [--priority-window BYTES] [scenario ...]
(default: all); prints "OK <scenario>". With --priority-window, the overlap scenarios then run
again in the same job under HPDL_PRIORITY_WINDOW=BYTES (a fresh engine: settings are read at
hvd.init()) and print "OK <scenario> priority-window=BYTES". On cuda every rank trains on its
GPU (hvd.local_gpu()), ranks sharing one if so.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Dict, List, Optional

import torch

from _common import device_arg, engine_with, option_arg, rank_device, run_main
from optimizer_models import assert_close, assert_ranks_equal, batch, loss_fn, make_pair, params_for, shard

import hpdl.torch as hvd

STEPS = 4


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    optimizer: Callable[..., torch.optim.Optimizer]  # optimizer(params, summed_over) (see sgd, adam)
    op: Any = hvd.Average
    backward_passes: int = 1
    set_passes: bool = False  # built with 1, then set_backward_passes_per_step(backward_passes)
    compression: Any = hvd.Compression.none
    predivide: float = 1.0
    groups: Optional[str] = None  # "int" or "list"
    named: bool = True
    overlap: bool = False  # overlap_forward=model: updates wait for the next forward
    scheduler: bool = False  # an lr scheduler stepped right after every optimizer step
    reverse_odd: bool = True
    rtol: float = 1e-5
    atol: float = 1e-6


def sgd(params, summed_over=1):
    # With op=Sum the gradient is summed_over times the average: divide lr to match.
    return torch.optim.SGD(params, lr=0.1 / summed_over, momentum=0.9)


def adam(params, summed_over=1):
    # Adam is invariant to the gradient's scale except through eps: scale eps with it. eps is
    # well above float32 noise: Adam's first steps are about lr * sign(grad), and a gradient
    # entry that is zero up to rounding could otherwise flip sign between the two runs.
    return torch.optim.Adam(params, lr=0.01, eps=1e-4 * summed_over)


SCENARIOS: List[Scenario] = [
    Scenario("sgd-average", sgd),
    Scenario("sgd-sum", sgd, op=hvd.Sum),
    Scenario("adam-average", adam),
    Scenario("adam-sum", adam, op=hvd.Sum),
    Scenario("sgd-accumulate2", sgd, backward_passes=2),
    Scenario("adam-accumulate2", adam, backward_passes=2),
    Scenario("sgd-accumulate2-set", sgd, backward_passes=2, set_passes=True),
    Scenario("sgd-fp16", sgd, compression=hvd.Compression.fp16, rtol=1e-2, atol=1e-3),
    Scenario("adam-bf16", adam, compression=hvd.Compression.bf16, rtol=2e-2, atol=5e-3),
    Scenario("sgd-predivide", sgd, predivide=2.0),
    Scenario("sgd-groups-int", sgd, groups="int"),
    Scenario("adam-groups-list", adam, groups="list"),
    Scenario("sgd-unnamed", sgd, named=False, reverse_odd=False),
    Scenario("sgd-overlap", sgd, overlap=True),
    Scenario("adam-overlap", adam, overlap=True),
    Scenario("adam-sum-overlap", adam, op=hvd.Sum, overlap=True),
    Scenario("sgd-fp16-overlap", sgd, compression=hvd.Compression.fp16, overlap=True, rtol=1e-2, atol=1e-3),
    Scenario("adam-overlap-scheduler", adam, overlap=True, scheduler=True),
]


def run_scenario(sc: Scenario, device: torch.device) -> None:
    rank, size = hvd.rank(), hvd.size()
    reverse = sc.reverse_odd and rank % 2 == 1
    model, reference = make_pair(seed=7, reverse=reverse)
    model.to(device)
    reference.to(device)
    # On a GPU the whole batch and its shards run other kernels: float32 sums in other orders.
    rtol, atol = (sc.rtol, sc.atol) if device.type == "cpu" else (10 * sc.rtol, 10 * sc.atol)
    summed_over = size if sc.op == hvd.Sum else 1
    groups: Any = None
    if sc.groups == "int":
        groups = 3
    elif sc.groups == "list":
        groups = [[model.stem.weight, model.stem.bias], [model.right.weight, model.left.weight, model.head.bias]]
        if reverse:
            groups = [g[::-1] for g in groups[::-1]]
    named = list(model.named_parameters())
    if reverse:
        named = named[::-1]
    opt = hvd.DistributedOptimizer(
        sc.optimizer(params_for(model, reverse), summed_over), named_parameters=named if sc.named else None,
        compression=sc.compression, backward_passes_per_step=1 if sc.set_passes else sc.backward_passes, op=sc.op,
        gradient_predivide_factor=sc.predivide, groups=groups, overlap_forward=model if sc.overlap else None)
    if sc.set_passes:
        opt.set_backward_passes_per_step(sc.backward_passes)
    ref_opt = sc.optimizer(list(reference.parameters()))
    schedulers = ([torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref_opt)]
                  if sc.scheduler else [])

    for step in range(STEPS):
        x, y = (t.to(device) for t in batch(step))
        opt.zero_grad()
        xs, ys = shard(x, rank, size), shard(y, rank, size)
        k = sc.backward_passes
        for micro in range(k):  # equal micro-batches, each loss scaled by 1/k: their mean
            (loss_fn(model, shard(xs, micro, k), shard(ys, micro, k)) / k).backward()
        opt.step()

        ref_opt.zero_grad()
        loss_fn(reference, x, y).backward()
        ref_opt.step()
        for scheduler in schedulers:  # before the deferred update is applied, with overlap
            scheduler.step()

        what = f"{sc.name} step {step}"
        if sc.overlap:
            # The update waits for the next forward (which runs next step) or state_dict():
            # before it the parameters are the previous step's; the last step reads them
            # through state_dict(), the others leave them to the forward.
            if step < STEPS - 1:
                continue
            model.state_dict()
        assert_close(model, reference, what, rtol, atol)
        assert_ranks_equal(model, f"{sc.name}.{step}")


def main(argv: Optional[List[str]] = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    device_name = device_arg(args)
    window = option_arg(args, "--priority-window")
    hvd.init()
    device = rank_device(device_name)
    wanted = args or [s.name for s in SCENARIOS]
    by_name: Dict[str, Scenario] = {s.name: s for s in SCENARIOS}
    for name in wanted:
        run_scenario(by_name[name], device)
        if hvd.rank() == 0:
            print(f"OK {name}", flush=True)
    hvd.shutdown()
    if window is not None:
        with engine_with({"HPDL_PRIORITY_WINDOW": window}):
            for name in [n for n in wanted if "overlap" in n]:
                run_scenario(by_name[name], device)
                if hvd.rank() == 0:
                    print(f"OK {name} priority-window={window}", flush=True)


if __name__ == "__main__":
    run_main(main)
