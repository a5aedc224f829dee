"""hvd.elastic: what a TorchState keeps through handlers, and a plain object it cannot send.

Modes (the arguments; several run one after another in the same job, each with its own
hvd.init() and hvd.shutdown()):
  scheduler    an LR scheduler of a DistributedOptimizer, further on rank 0: run() gives every
               rank rank 0's; commit/restore bring back the committed one.
  unpicklable  a plain object that does not pickle (it holds a weak reference): run() raises on
               every rank, naming its keyword and the handler registry; with the handler
               docs/api.md shows, it is kept by its state_dict and every rank gets rank 0's.
"""

from __future__ import annotations

import os
import sys
import textwrap
import weakref
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import run_main

import hpdl.torch as hvd

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"


class Tracker:
    """Something a script keeps beside its model, holding a weak reference to it."""

    def __init__(self, model, value):
        self.model = weakref.ref(model)
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def register_the_documented_handler() -> None:
    """Run docs/api.md's handler example, as a script would (it registers its handler)."""
    text = DOCS.read_text()
    blocks = [block.split("```", 1)[0] for block in text.split("```python")[1:]]
    example = next(block for block in blocks if "class StateDictHandler" in block)
    exec(textwrap.dedent(example), {"Tracker": Tracker})  # noqa: S102 - the documented code itself


def scheduler_mode():
    hvd.init()
    rank = hvd.rank()
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3 if rank == 0 else rank + 5):  # rank 0 at epoch 3, the others elsewhere
        scheduler.step()

    @hvd.elastic.run
    def train(state):
        assert state.scheduler.last_epoch == 3, state.scheduler.state_dict()
        state.scheduler.step()
        state.commit()
        state.scheduler.step()
        state.restore()
        return state.scheduler.last_epoch

    state = hvd.elastic.TorchState(model, opt, scheduler=scheduler, epoch=0)
    assert train(state) == 4
    hvd.shutdown()
    print(f"OK elastic scheduler: rank={rank}")


def unpicklable_mode():
    hvd.init()
    rank = hvd.rank()
    model = torch.nn.Linear(2, 1)

    @hvd.elastic.run
    def train(state):
        return state.tracker.value

    state = hvd.elastic.TorchState(model, tracker=Tracker(model, rank), epoch=0)
    try:
        train(state)
    except ValueError as err:
        message = str(err)
    else:
        raise AssertionError("an object that cannot be pickled was sent")
    assert "\n" not in message, message
    assert "tracker: cannot serialize Tracker object: TypeError: cannot pickle 'weakref" in message, message
    assert "hvd.elastic.state.get_handler_registry()" in message and "docs/api.md" in message, message
    print(f"rank {rank} error: {message}", flush=True)

    register_the_documented_handler()
    state = hvd.elastic.TorchState(model, tracker=Tracker(model, 10 + rank), epoch=0)
    assert train(state) == 10  # rank 0's, on every rank
    state.tracker.value = 20
    state.commit()
    state.tracker.value = 30
    state.restore()
    assert state.tracker.value == 20
    hvd.shutdown()
    print(f"OK elastic unpicklable: rank={rank}")


if __name__ == "__main__":
    modes = {"scheduler": scheduler_mode, "unpicklable": unpicklable_mode}
    run_main(lambda: [modes[mode]() for mode in sys.argv[1:]])
