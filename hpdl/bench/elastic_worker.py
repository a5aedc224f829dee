"""The worker of `hpdl bench elastic` (hpdl/bench/elastic.py), started by the elastic driver
under `hpdl run`: it trains one model on one fixed tiny batch, committing after every step, and
logs when each phase of a reset begins and ends.

Each event is one JSON line appended to ``<events>/worker-<id>.jsonl`` with ``time.time()``
(the machine's one clock, which the benchmark's own stamps of a death or a host's appearance
share): ``start`` (the script runs: the interpreter is up), ``imported`` (torch and hpdl),
``built`` (the model and optimizer), ``join`` / ``joined`` (this worker waits for the driver's
next generation / every member has come: around ``Membership.join``), ``init`` (the end of
``hvd.init()``: the process group formed and the engine runs), ``seen`` (the training function
raised HorovodInternalError or HostsUpdatedInterrupt), ``shutdown`` (``hvd.shutdown()`` starts:
its first hook), ``reset`` (the reset callback: the new world is formed, its sync follows),
``resume`` (the training function starts: the state is synced), ``step`` (a step ended; ``t0``
its start) and ``done``. Every event carries the worker, its generation, rank and size then.

The training stops at the step written in the ``--stop`` file, which the benchmark writes
once it has measured what it wanted.
"""

from __future__ import annotations

import time

_STARTED = time.time()  # before the imports: what the interpreter's start costs is before this

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from typing import Any, Optional  # noqa: E402


# The model of the tests: one 3x3 convolution.
TINY = "tiny"


class _Events:
    def __init__(self, folder: str, worker: int):
        self.path = os.path.join(folder, f"worker-{worker}.jsonl")
        self.worker = worker
        self.where = lambda: {}

    def log(self, event: str, t: Optional[float] = None, **fields: Any) -> None:
        row = {"event": event, "t": time.time() if t is None else t, "worker": self.worker, **self.where(), **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def _stop_step(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().strip() or "0")
    except (OSError, ValueError):
        return None


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description="the worker of `hpdl bench elastic` (started by it)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--scale", type=int, default=2)
    parser.add_argument("--patch", type=int, default=8)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--events", required=True, help="folder of the events files")
    parser.add_argument("--stop", required=True, help="file holding the step to stop at")
    args = parser.parse_args(argv)

    worker = int(os.environ.get("HPDL_ELASTIC_WORKER", "-1"))
    events = _Events(args.events, worker)
    events.log("start", t=_STARTED, pid=os.getpid())

    import torch
    import torch.nn.functional as F

    import hpdl.torch as hvd
    from hpdl.bench.models import build_workload
    from hpdl.engine import HorovodInternalError
    from hpdl.torch import membership
    from hpdl.torch.elastic.state import (ModelStateHandler, OptimizerStateHandler, get_handler_registry,
                                          set_handler_registry)
    from hpdl.torch.runtime import ShutdownStage, add_shutdown_hook, add_startup_hook

    events.log("imported")
    torch.set_num_threads(1)
    member = membership.current()
    if member is None:
        raise SystemExit("hpdl bench elastic's worker runs in an elastic job (hpdl run --min-np ...), started by "
                         "hpdl bench elastic")

    def where():
        if member.slot is None:
            return {"gen": member.generation}
        return {"gen": member.generation, "rank": member.slot.rank, "size": member.slot.size}

    events.where = where
    join = member.join

    def timed_join(timeout_s: float):
        events.log("join")
        slot = join(timeout_s)
        events.log("joined")
        return slot

    member.join = timed_join  # this process's membership only: the script's own instrument
    add_startup_hook(lambda: events.log("init"))
    add_shutdown_hook(lambda: events.log("shutdown"), ShutdownStage.FINISH_WORK)  # the first of the first stage

    # The state's sync in parts: the parameters' broadcast, then the optimizer's (the plain objects last).
    class Parameters(ModelStateHandler):
        def sync(self) -> None:
            super().sync()
            events.log("synced", part="parameters")

    class OptimizerState(OptimizerStateHandler):
        def sync(self) -> None:
            super().sync()
            events.log("synced", part="optimizer")

    set_handler_registry([(torch.nn.Module, Parameters), (torch.optim.Optimizer, OptimizerState)]
                         + get_handler_registry())
    torch.manual_seed(0)
    if args.model == TINY:  # for the tests: a step of microseconds
        model = torch.nn.Conv2d(3, 3, 3, padding=1)
        inputs, targets = torch.rand(1, 3, args.patch, args.patch), torch.rand(1, 3, args.patch, args.patch)
    else:
        workload = build_workload(args.model, 1, scale=args.scale, patch=args.patch)
        model, inputs, targets = workload.model, workload.inputs, workload.targets
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    events.log("built", parameters=sum(p.numel() for p in model.parameters()))
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0)
    state.register_reset_callbacks([lambda: events.log("reset")])

    @hvd.elastic.run
    def train(state):
        events.log("resume", step=state.step)
        try:
            while True:
                stop = _stop_step(args.stop)
                if stop is not None and state.step >= stop:
                    return state.step
                started = time.time()
                optimizer.zero_grad()
                F.l1_loss(model(inputs), targets).backward()
                optimizer.step()
                state.step += 1
                events.log("step", t0=started, step=state.step)
                state.commit()
        except HorovodInternalError:
            events.log("seen", kind="failure")
            raise
        except hvd.elastic.HostsUpdatedInterrupt:
            events.log("seen", kind="hosts")
            raise

    train(state)
    hvd.shutdown()
    events.log("done", step=state.step)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
