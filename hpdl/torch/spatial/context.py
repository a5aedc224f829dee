"""What the spatial layers of one forward need to know: the group, its communicator, whether
this is a dry run (shapes only, on the meta device) or backward's recomputation of a
checkpointed block, which module of the model is running (for messages and labels), and the
forward's random streams (randomness.py)."""

from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Dict, List, Optional

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from hpdl.torch.spatial.comm import GroupComm
from hpdl.torch.spatial.geometry import Grid


@dataclasses.dataclass
class Context:
    grid: Grid
    rank: int  # in the group
    comm: Optional[GroupComm]  # None: a dry run, no communication
    names: Dict[int, str]  # id(module) -> its path in the model
    recomputing: bool = False  # backward re-runs a checkpointed block: running statistics stay as they are
    # Every parameter's gradient is multiplied by this as the forward uses it (parallel.py: the
    # group size, so that the optimizer's average over all ranks sums over the group).
    grad_scale: float = 1.0
    modules: List[nn.Module] = dataclasses.field(default_factory=list)  # the modules running, outermost first
    random_base: int = 0  # the forward's base of its random streams, the same on every rank of the group
    random_calls: int = 0  # random calls so far in this forward (a checkpointed block's recomputation replays them)
    # A dry run's record of every call on a part (what, where, its arguments as one process
    # reads them): the ranks' records must agree, or the model decides on a part's own size.
    trace: Optional[List[tuple]] = None
    # Backward's recomputation of a checkpointed block: what its inputs were marked as
    # (parts.marks_of), marked again as it starts (tensors saved for backward come back as
    # new, unmarked objects).
    input_parts: Optional[List[tuple]] = None
    # The forward began with gradients on (training): a layer that then runs with them off on
    # tensors that require them has its gradient computed by someone else (dispatch.py).
    builds_graph: bool = False

    @property
    def dry(self) -> bool:
        return self.comm is None

    @property
    def size(self) -> int:
        return self.grid.size

    def where(self) -> str:
        """The running module's path and kind, e.g. ``layer1.0.conv2 (Conv2d)``; ``forward`` outside any."""
        if not self.modules:
            return "the model's forward"
        module = self.modules[-1]
        path = self.names.get(id(module), "")
        return f"{path or '(the model)'} ({type(module).__name__})"

    def label(self) -> str:
        """The running module's path, for the profiler."""
        if not self.modules:
            return "spatial"
        return self.names.get(id(self.modules[-1]), "") or "spatial"


_local = threading.local()


def active() -> Optional[Context]:
    """The context of the spatial forward running on this thread, if any."""
    return getattr(_local, "context", None)


def make_active(ctx: Optional[Context]) -> Optional[Context]:
    """Make ``ctx`` (or None) the context of this thread's spatial forward; returns the one before."""
    previous = active()
    _local.context = ctx
    return previous


def track_modules(model: nn.Module) -> list:
    """Hooks on every module of ``model`` that keep the running module's path in the active
    context, and keep batch norm's batch count when backward recomputes a checkpointed block."""
    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(_entered))
        handles.append(module.register_forward_hook(_left, always_call=True))
    return handles


def _entered(module: nn.Module, inputs) -> None:
    ctx = active()
    if ctx is None:
        return
    ctx.modules.append(module)
    if ctx.recomputing and isinstance(module, _BatchNorm) and module.num_batches_tracked is not None:
        module._hpdl_batches = module.num_batches_tracked.clone()


def _left(module: nn.Module, inputs, output) -> None:
    ctx = active()
    if ctx is None or not ctx.modules:
        return
    failing = sys.exc_info()[1]  # run as the module's forward raised (always_call)
    if failing is not None and not hasattr(failing, "hpdl_where"):  # raised where the mode does not see
        try:
            failing.hpdl_where = ctx.where()
        except AttributeError:  # an exception type without a __dict__
            pass
    if ctx.modules[-1] is module:
        ctx.modules.pop()
    saved = module.__dict__.pop("_hpdl_batches", None)
    if saved is not None:
        module.num_batches_tracked.copy_(saved)
