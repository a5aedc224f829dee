"""The three ways one agreed batch of allreduces (a fusion plan's batch, fusion.py) runs on
this rank; the executor (execution.py) picks one, starts it and, where the backend runs it in
the background, keeps it in flight until the backend is done.

- :class:`InPlace`: a lone tensor, and any tensor of at least ``HPDL_INPLACE_THRESHOLD``
  bytes, is reduced where it lies (in its output), with no copy: for large tensors the two
  copies through a fusion buffer cost more than the calls that fusion saves (fusion.py).
- :class:`Fused`: several smaller tensors are copied into a fusion buffer, reduced by one
  backend call and copied out, scaled on the way out where that saves a pass over the buffer.
- :class:`Adasum`: each tensor is combined where it lies by Adasum's recursion (adasum.py),
  all of them sharing each level's exchange; no fusion buffer, and it blocks.

Each is built from the batch on this rank: its members' tensors (zeros of the agreed shape
for a rank that has joined), the agreed op and scales. An in-place or fused allreduce's
``begin`` prepares what the backend reduces (copies in, the prescale) and returns it; its
``finish`` runs once the backend is done, maybe rounds later (the postscale, copies out).
Adasum's ``run`` does all of it at once. Either way the results are left in ``outputs``, for
the executor to hand to the handles.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from hpdl.comm import Communicator, ReduceOp
from hpdl.engine import events as ev
from hpdl.engine.adasum import adasum_
from hpdl.engine.fusion import dtype_of
from hpdl.engine.request import Op, Request, Response

BACKEND_OPS = {Op.SUM.value: ReduceOp.SUM, Op.AVERAGE.value: ReduceOp.SUM, Op.MIN.value: ReduceOp.MIN,
               Op.MAX.value: ReduceOp.MAX, Op.PRODUCT.value: ReduceOp.PRODUCT}
AVERAGE = Op.AVERAGE.value
ADASUM = Op.ADASUM.value
_SCALE_ON_COPY_MAX = 16  # fused batches up to this many tensors scale while copying out


def zeros_device(device_type: str, join_device: int) -> torch.device:
    """Where a joined rank makes the zeros it contributes to a tensor on ``device_type`` (the
    agreed signature's): its own GPU, the one ``hvd.join`` recorded (``join_device``; -1: the
    engine thread's current device, GPU 0 unless set), not whichever GPU is current here."""
    if device_type == "cuda" and join_device >= 0:
        return torch.device("cuda", join_device)
    return torch.device(device_type)


def scale_(tensor: torch.Tensor, factor: float, divisor: int = 1) -> None:
    """Multiply in place by ``factor / divisor`` (an Average's divisor is the number of ranks);
    integers are scaled in float64 and truncated toward zero."""
    if (factor == 1.0 and divisor == 1) or tensor.dtype == torch.bool:
        return
    if tensor.dtype.is_floating_point:
        tensor.mul_(factor / divisor)
    else:
        # Divided, not multiplied by 1/divisor: 49 * (1/49) is 0.9999999999999999 in float64,
        # so 49 ranks' average of ones would truncate to 0.
        tensor.copy_(torch.trunc(tensor.double() * factor / divisor))


class Allreduce:
    """One backend allreduce of an agreed batch on this rank (the strategies' common part).

    ``members`` are this rank's requests in batch order (None where it has joined), ``inputs``
    the tensors it contributes and ``outputs`` where the results go (a request's output, else
    its tensor, else the zeros).
    """

    __slots__ = ("batch", "requests", "members", "inputs", "outputs", "dtype", "op", "prescale", "postscale",
                 "divisor", "names", "nbytes", "bus", "rank", "process_set_id", "cycle")
    buffer_key: Optional[tuple] = None  # the fusion buffer it occupies while in flight, if any

    def __init__(self, batch: List[Response], requests: Dict[str, Request], comm: Communicator, join_device: int,
                 bus: ev.EventBus, rank: int, process_set_id: int, cycle: int):
        """
        Args:
            requests: this rank's requests by name (a joined rank has none of the batch's).
            join_device: the GPU of the zeros a joined rank contributes (Executor.set_join_device).
            bus, rank, process_set_id, cycle: what the events of its phases carry.
        """
        first = batch[0].signature
        self.batch = batch
        self.requests = requests
        self.dtype = dtype_of(batch[0])
        self.op = first.op
        self.prescale, self.postscale = first.scales
        self.divisor = comm.size if first.op == AVERAGE else 1
        # One pass over the batch: this runs for every batch, a lone gradient's included.
        members: List[Optional[Request]] = []
        inputs: List[torch.Tensor] = []
        outputs: List[torch.Tensor] = []
        names = []
        nbytes = 0
        for response in batch:
            name = response.name
            names.append(name)
            nbytes += response.nbytes
            request = requests.get(name)
            members.append(request)
            if request is None:  # this rank has joined: contribute zeros of the agreed shape
                zeros = torch.zeros(response.signature.shape, dtype=self.dtype,
                                    device=zeros_device(response.signature.device, join_device))
                inputs.append(zeros)
                outputs.append(zeros)
            else:
                tensor = request.tensor
                inputs.append(tensor)
                output = request.output
                outputs.append(output if output is not None else tensor)
        self.members = members
        self.inputs = inputs
        self.outputs = outputs
        self.names = tuple(names)
        self.nbytes = nbytes
        self.bus = bus
        self.rank = rank
        self.process_set_id = process_set_id
        self.cycle = cycle

    def span(self, phase: str, **fields) -> ev.Span:
        """A span of one of its phases (``with`` it, or the executor enters and ends it)."""
        return ev.Span(self.bus, phase=phase, kind="allreduce", names=self.names, nbytes=self.nbytes,
                       rank=self.rank, process_set_id=self.process_set_id, cycle=self.cycle,
                       fused=len(self.batch), **fields)

    def collective_span(self, comm: Communicator, op_label: str) -> ev.Span:
        """The span of the backend call, with what observers alone need (the profiler's tensor
        sizes), described only when someone observes."""
        if self.bus.active:
            return self.span(ev.COLLECTIVE, op=op_label, sizes=tuple(r.nbytes for r in self.batch),
                             dtype=self.batch[0].signature.dtype, backend=comm.name)
        return self.span(ev.COLLECTIVE, op=op_label)

    def finish(self) -> None:
        """After the backend's reduction (of what ``begin`` returned): leave the results in
        ``outputs``."""
        raise NotImplementedError


class InPlace(Allreduce):
    """One tensor reduced where it lies: in its output, the input copied there first."""

    __slots__ = ()

    def begin(self) -> torch.Tensor:
        """Prepare the tensor the backend reduces; return it."""
        target = self.outputs[0]
        if target is not self.inputs[0]:
            target.copy_(self.inputs[0])
        scale_(target, self.prescale)
        return target

    def finish(self) -> None:
        scale_(self.outputs[0], self.postscale, self.divisor)


class Fused(Allreduce):
    """Several tensors reduced by one call through a fusion buffer."""

    __slots__ = ("buffer", "views", "buffer_key")

    def begin(self, buffer: torch.Tensor, views: List[torch.Tensor], buffer_key: tuple) -> torch.Tensor:
        """Copy the members into ``buffer`` (of exactly their elements, with ``views`` of it
        shaped like them; ``buffer_key`` names it among the executor's), prescaled; return it."""
        self.buffer = buffer
        self.views = views
        self.buffer_key = buffer_key
        inputs = self.inputs
        with self.span(ev.MEMCPY_IN):
            if all(t.dim() == 1 for t in inputs):
                torch.cat(inputs, out=self.buffer)  # one kernel, not a copy per tensor
            else:
                torch._foreach_copy_(self.views, inputs)
        scale_(self.buffer, self.prescale)
        return self.buffer

    def finish(self) -> None:
        # Scaling while copying out saves a pass over the buffer (memory bandwidth is what a CPU
        # rank's compute shares with its engine); one call per tensor only pays off for
        # batches of large tensors.
        factor = self.postscale / self.divisor
        scale_on_copy = factor != 1.0 and self.dtype.is_floating_point and len(self.batch) <= _SCALE_ON_COPY_MAX
        if not scale_on_copy:
            scale_(self.buffer, self.postscale, self.divisor)
        with self.span(ev.MEMCPY_OUT):
            if scale_on_copy:
                for out, view in zip(self.outputs, self.views):
                    torch.mul(view, factor, out=out)
            else:
                torch._foreach_copy_(self.outputs, self.views)


class Adasum(Allreduce):
    """Each tensor combined where it lies (in its output) by Adasum's recursion; blocking."""

    __slots__ = ()

    def run(self, comm: Communicator) -> None:
        """Combine across ``comm`` now: prescale, the recursion's exchanges, postscale."""
        for target, source in zip(self.outputs, self.inputs):
            if target is not source:
                target.copy_(source)
            scale_(target, self.prescale)
        with self.collective_span(comm, f"{comm.name.upper()}_ADASUM"):
            adasum_(comm, self.outputs)
        for target in self.outputs:
            scale_(target, self.postscale, self.divisor)
