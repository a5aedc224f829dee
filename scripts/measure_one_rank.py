"""Where one rank's step under hpdl costs more than a plain PyTorch loop's, phase by phase.

A plain model and an hpdl-wrapped twin (DistributedOptimizer, 1 rank) train in one process,
step for step in turn (the order flipped every step), so that both see the same machine: the
median of each phase and of the training thread's CPU time, and the paired ratio of the step
times. Then, on the hpdl model alone, the time spent in DistributedOptimizer's gradient hooks
and in the engine's submit() per step, timed from inside.

Usage (docs/perf-notes/one-rank.md quotes the figures):
    OMP_NUM_THREADS=1 python scripts/measure_one_rank.py [--model edsr-baseline] [--steps 40]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def _step(model, optimizer, workload, distributed: bool):
    cpu, start = time.thread_time(), time.perf_counter()
    optimizer.zero_grad()
    loss = workload.loss(model(workload.inputs), workload.targets)
    forward = time.perf_counter()
    loss.backward()
    backward = time.perf_counter()
    if distributed:
        optimizer.synchronize()
    waited = time.perf_counter()
    if distributed:
        with optimizer.skip_synchronize():
            optimizer.step()
    else:
        optimizer.step()
    end = time.perf_counter()
    return (forward - start, backward - forward, waited - backward, end - waited, end - start,
            time.thread_time() - cpu)


def _timed(fn, totals, key):
    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - began
    return wrapper


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, got {text!r}")
    return value


def main() -> None:
    from hpdl.bench.models import benchmark_models

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="edsr-baseline", choices=benchmark_models())
    parser.add_argument("--batch-size", type=_positive, default=2, help="images per step (default 2)")
    parser.add_argument("--patch", type=_positive, default=24, help="LR patch size of the SR models (default 24)")
    parser.add_argument("--steps", type=_positive, default=40, help="timed steps of each model (default 40)")
    args = parser.parse_args()

    import hpdl.torch as hvd
    from hpdl.bench.models import build_workload
    from hpdl.torch import runtime

    hvd.init()
    workload = build_workload(args.model, args.batch_size, scale=2, patch=args.patch)
    plain = workload.model
    wrapped = copy.deepcopy(plain)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-4)
    hpdl_opt = hvd.DistributedOptimizer(torch.optim.Adam(wrapped.parameters(), lr=1e-4),
                                        named_parameters=wrapped.named_parameters())
    modes = [("plain", plain, plain_opt, False), ("hpdl", wrapped, hpdl_opt, True)]
    rows = {"plain": [], "hpdl": []}
    for i in range(args.steps + 5):
        for name, model, optimizer, distributed in (modes if i % 2 else modes[::-1]):
            row = _step(model, optimizer, workload, distributed)
            if i >= 5:
                rows[name].append(row)
    print(f"{args.model}, batch {args.batch_size} of {args.patch} px, {torch.get_num_threads()} thread(s), "
          f"{args.steps} steps each, ms (median):")
    for name, got in rows.items():
        med = [statistics.median(r[k] for r in got) * 1e3 for k in range(6)]
        print(f"  {name:5s} forward {med[0]:.1f}  backward {med[1]:.1f}  wait {med[2]:.2f}  update {med[3]:.1f}  "
              f"step {med[4]:.1f}  training thread CPU {med[5]:.1f}")
    paired = statistics.median(p[4] / h[4] for p, h in zip(rows["plain"], rows["hpdl"]))
    print(f"  hpdl/plain img/s (median of the paired steps' ratios): {paired:.3f}")

    totals = {"hooks": 0.0, "engine submit": 0.0}
    cls = type(hpdl_opt)
    original = cls._grad_ready
    cls._grad_ready = _timed(original, totals, "hooks")
    engine = runtime.engine()
    engine.submit = _timed(engine.submit, totals, "engine submit")
    try:
        for i in range(args.steps + 3):
            if i == 3:
                totals = dict.fromkeys(totals, 0.0)
                cls._grad_ready = _timed(original, totals, "hooks")
                engine.submit = _timed(type(engine).submit.__get__(engine), totals, "engine submit")
            _step(wrapped, hpdl_opt, workload, True)
    finally:
        cls._grad_ready = original
    hooks = sum(1 for p in wrapped.parameters() if p.requires_grad)
    print(f"  in the training thread per hpdl step: the {hooks} gradient hooks {totals['hooks'] / args.steps * 1e3:.2f} ms, "
          f"of which the engine's submit() {totals['engine submit'] / args.steps * 1e3:.2f} ms")
    hvd.shutdown()


if __name__ == "__main__":
    main()
