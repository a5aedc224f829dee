"""Run agreed responses on the backend: fused allreduces and the other collectives.

Called on the engine thread with the responses of one negotiation, in the agreed order; every
member runs the same backend calls in the same order. Each phase emits an event.

Allreduces run in the background (torch.distributed's gloo and nccl run collectives on threads
of their own; MPI's non-blocking calls progress when the engine polls them between rounds):
the executor starts them, keeps them in flight and finishes them (scaling, copying out,
completing handles) once the backend is done, so the engine thread negotiates the next
gradients while the link is busy with the previous ones. Without this, every negotiation
round and every call's start-up leaves the network idle between gradients, which costs most
where the network is slowest (across nodes).
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Callable, Dict, List, Optional

import torch

from hpdl.comm import Communicator, InFlight, ReduceOp, even_split
from hpdl.engine import events as ev
from hpdl.engine.adasum import adasum_
from hpdl.engine.clock import SYSTEM_CLOCK, Clock
from hpdl.engine.errors import HorovodInternalError
from hpdl.engine.fusion import FusionBuffers, dtype_of, plan_fusion
from hpdl.engine.request import Op, Request, RequestKind, Response

_BACKEND_OPS = {Op.SUM.value: ReduceOp.SUM, Op.AVERAGE.value: ReduceOp.SUM, Op.MIN.value: ReduceOp.MIN,
                Op.MAX.value: ReduceOp.MAX, Op.PRODUCT.value: ReduceOp.PRODUCT}


_VIEW_CACHE_SIZE = 256
_FUSION_SLOTS = 2  # fusion buffers per dtype and device: one filling while one is in flight
_SCALE_ON_COPY_MAX = 16  # fused batches up to this many tensors scale while copying out
_AVERAGE = Op.AVERAGE.value
_ADASUM = Op.ADASUM.value
_ENGINE_KINDS = (RequestKind.JOIN, RequestKind.ADD_PROCESS_SET, RequestKind.REMOVE_PROCESS_SET,
                 RequestKind.SPLIT_COMMUNICATOR)


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


class _Flight:
    """An allreduce the backend runs in the background, and what finishes it on this rank."""

    __slots__ = ("flight", "span", "finish", "batch", "requests", "process_set_id", "cycle", "buffer_key",
                 "started", "nbytes", "done_us")
    # ``finish`` completes the handles and tells observers (DONE).

    def __init__(self, flight: InFlight, span: ev.Span, finish: Callable[[], None], batch: List[Response],
                 requests: Dict[str, Request], process_set_id: int, cycle: int, buffer_key: Optional[tuple],
                 started: float):
        self.flight = flight
        self.span = span
        self.finish = finish
        self.batch = batch
        self.requests = requests
        self.process_set_id = process_set_id
        self.cycle = cycle
        self.buffer_key = buffer_key  # the fusion buffer it occupies, if any
        self.started = started  # clock time (the engine's watch compares it)
        self.nbytes = sum(r.nbytes for r in batch)
        self.done_us: Optional[float] = None  # when the backend finished it (its thread's clock)


class Executor:
    """Carries out responses for one engine; owns the fusion buffers and the counters."""

    def __init__(self, bus: ev.EventBus, rank: int, fusion_threshold: int, inplace_threshold: int = 0,
                 background: bool = True, on_done: Optional[Callable[[], None]] = None,
                 clock: Clock = SYSTEM_CLOCK):
        """
        Args:
            background: keep allreduces in flight where the backend runs them in the
                background (HPDL_BACKGROUND_COLLECTIVES); else every call blocks.
            on_done: called from the backend's thread when a collective in flight is done
                (the engine wakes to finish it).
            clock: when collectives in flight started is read from it (the engine's clock).
        """
        self.bus = bus
        self.rank = rank
        self.fusion_threshold = fusion_threshold
        self.inplace_threshold = inplace_threshold
        self.background = background
        self._on_done = on_done
        self._clock = clock
        self.in_flight: "collections.deque[_Flight]" = collections.deque()
        self._in_flight_lock = threading.Lock()  # the watch thread may fail them meanwhile
        self.in_flight_bytes = 0
        # Per process set, when its backend finished the last collective in flight: it runs
        # them in order, so a collective's own time starts there, not when it was queued.
        self._backend_free_us: Dict[int, float] = {}
        self.buffers = FusionBuffers()
        self.join_device = -1  # the GPU of the zeros this rank contributes once joined (hvd.join)
        self._view_cache: Dict[tuple, List[torch.Tensor]] = {}
        self.backend_calls = 0
        self.fused_calls = 0  # backend allreduces that carried more than one tensor
        self.tensors_reduced = 0
        self.bytes_reduced = 0

    def run(self, comm: Communicator, process_set_id: int, responses: List[Response],
            requests: Dict[str, Request], cycle: int,
            special: Callable[[Response, Optional[Request]], None]) -> None:
        """Run ``responses``; complete the handles of this rank's requests.

        Args:
            requests: this rank's requests by name (a joined rank has none); each carries its
                handle.
            special: runs responses the engine itself handles (join, process sets).
        """
        allreduces: List[Response] = []
        others: List[Response] = []
        for response in responses:
            if response.error is not None:
                request = requests.get(response.name)
                if request is not None:
                    request.handle.set_error(HorovodInternalError(response.error))
            elif response.kind is RequestKind.ALLREDUCE:
                allreduces.append(response)
            else:
                others.append(response)
        for batch in plan_fusion(allreduces, self.fusion_threshold, self.inplace_threshold):
            try:
                self._allreduce(comm, process_set_id, batch, requests, cycle)
            except Exception as err:  # a failed backend call fails its requests, not the engine
                self._fail(batch, requests, err)
                self._done(batch, process_set_id, cycle)
        for response in others:
            request = requests.get(response.name)
            try:
                if response.kind in _ENGINE_KINDS:
                    special(response, request)
                elif request is not None:
                    self._other(comm, process_set_id, response, request, cycle)
            except Exception as err:
                self._fail([response], requests, err)
            self._done([response], process_set_id, cycle)
        for response in responses:  # errors agreed in negotiation: done at once
            if response.error is not None:
                self._done([response], process_set_id, cycle)

    def _done(self, batch: List[Response], process_set_id: int, cycle: int) -> None:
        """Tell observers that ``batch`` has completed on this rank."""
        if self.bus.active:
            t = ev.now_us()
            for response in batch:
                self.bus.emit(ev.Event(ev.DONE, response.kind.value, (response.name,), t, rank=self.rank,
                                       process_set_id=process_set_id, cycle=cycle))

    @staticmethod
    def _fail(batch: List[Response], requests: Dict[str, Request], err: Exception) -> None:
        for response in batch:
            request = requests.get(response.name)
            if request is not None:
                request.handle.set_error(HorovodInternalError(
                    f"{response.kind.value} of tensor {response.name!r} failed: {err}"))

    # -- collectives in flight --------------------------------------------------------------

    def complete(self, block: bool = False, until: Optional[_Flight] = None) -> None:
        """Finish the collectives in flight that are done, in the order they started.

        Args:
            block: wait for all of them.
            until: wait for the ones up to this one.
        """
        in_flight = self.in_flight
        while True:
            with self._in_flight_lock:
                if not in_flight:
                    return
                head = in_flight[0]
                if not (block or until is not None) and not head.flight.done():
                    return
                in_flight.popleft()
                self.in_flight_bytes -= head.nbytes
            try:
                head.flight.wait()
                self._end_span(head)
                head.finish()
            except Exception as err:  # a failed backend call fails its requests, not the engine
                self._fail(head.batch, head.requests, err)
                self._done(head.batch, head.process_set_id, head.cycle)
            if head is until:
                return

    def _end_span(self, flight: _Flight) -> None:
        """Emit a background collective's COLLECTIVE event: from when the backend was free of
        the ones before it (or its start, if later) to when it finished, where the backend
        runs them in order. Time spent queued behind earlier collectives is not this one's
        (summing queued times would count the same seconds of the network several times
        over). Collectives that progress side by side (MPI's) are timed from their start."""
        span = flight.span
        if span.start is None:
            return
        end = flight.done_us if flight.done_us is not None else ev.now_us()
        key = flight.process_set_id
        begin = span.start
        if flight.flight.runs_in_order:
            begin = max(begin, min(self._backend_free_us.get(key, 0.0), end))
        self._backend_free_us[key] = end
        self.bus.emit(ev.Event(time_us=begin, duration_us=end - begin, **span.fields))

    def _flight_done(self, flight: _Flight) -> None:
        """From the backend's thread: note when ``flight`` finished; wake the engine."""
        flight.done_us = ev.now_us()
        if self._on_done is not None:
            self._on_done()

    def poll_interval_s(self) -> float:
        """How often the collectives in flight must be polled (see :meth:`poll`); 0: never."""
        try:  # the watch thread may empty the queue meanwhile (fail_in_flight)
            return self.in_flight[0].flight.poll_interval_s
        except IndexError:
            return 0.0

    def poll(self) -> None:
        """Let a backend that progresses only inside its calls move the collectives in flight;
        the oldest tells when it is done (they finish in order)."""
        try:
            head = self.in_flight[0]
        except IndexError:
            return
        head.flight.done()

    def oldest_in_flight(self) -> Optional[float]:
        """When the oldest collective still in flight started (clock time), if any."""
        in_flight = self.in_flight
        return in_flight[0].started if in_flight else None

    def fail_in_flight(self, error: BaseException) -> None:
        """Give up on the collectives in flight: their handles raise ``error``."""
        with self._in_flight_lock:
            flights = list(self.in_flight)
            self.in_flight.clear()
            self.in_flight_bytes = 0
        # Per process set, when its backend finished the last collective in flight: it runs
        # them in order, so a collective's own time starts there, not when it was queued.
        self._backend_free_us: Dict[int, float] = {}
        for head in flights:
            for response in head.batch:
                request = head.requests.get(response.name)
                if request is not None:
                    request.handle.set_error(error)

    def _launch(self, comm: Communicator, tensor: torch.Tensor, op: ReduceOp, span: ev.Span,
                finish: Callable[[], None], batch: List[Response], requests: Dict[str, Request],
                ps: int, cycle: int, buffer_key: Optional[tuple] = None) -> None:
        """Start the allreduce of ``tensor``; run ``finish`` once it is done (now, if it blocked)."""
        span.__enter__()
        flight = comm.allreduce_start(tensor, op) if self.background else None
        if flight is None:
            comm.allreduce(tensor, op)
        elif not flight.done():
            entry = _Flight(flight, span, finish, batch, requests, ps, cycle, buffer_key, self._clock.monotonic())
            with self._in_flight_lock:
                self.in_flight.append(entry)
                self.in_flight_bytes += entry.nbytes
            flight.on_done(functools.partial(self._flight_done, entry))
            return
        else:
            flight.wait()
        span.__exit__(None, None, None)
        finish()

    def _free_buffer(self, dtype: torch.dtype, device: torch.device) -> tuple:
        """The key of a fusion buffer for ``dtype`` on ``device`` that no collective in flight
        uses: a free one of the ``_FUSION_SLOTS``, else the oldest's once it has finished.

        Two buffers let the next fused message be copied in and started while the previous one
        is still on the wire, so the link never waits for a copy; with one, each fused message
        would wait for the one before it to finish.
        """
        with self._in_flight_lock:
            flights = [f for f in self.in_flight if f.buffer_key is not None and f.buffer_key[:2] == (dtype, str(device))]
        busy = {f.buffer_key for f in flights}
        for slot in range(_FUSION_SLOTS):
            key = (dtype, str(device), slot)
            if key not in busy:
                return key
        self.complete(until=flights[0])
        return flights[0].buffer_key

    # -- allreduce -------------------------------------------------------------------------

    def _allreduce(self, comm: Communicator, ps: int, batch: List[Response], requests: Dict[str, Request],
                   cycle: int) -> None:
        first = batch[0].signature
        dtype = dtype_of(batch[0])
        op_name = first.op
        prescale, postscale = first.scales
        divisor = comm.size if op_name == _AVERAGE else 1
        outputs: List[torch.Tensor] = []
        inputs: List[torch.Tensor] = []
        members: List[Optional[Request]] = []
        for response in batch:
            request = requests.get(response.name)
            members.append(request)
            if request is None:  # this rank has joined: contribute zeros of the agreed shape
                zeros = torch.zeros(response.signature.shape, dtype=dtype,
                                    device=zeros_device(response.signature.device, self.join_device))
                inputs.append(zeros)
                outputs.append(zeros)
            else:
                inputs.append(request.tensor)
                outputs.append(request.output if request.output is not None else request.tensor)
        nbytes = sum(r.nbytes for r in batch)
        bus = self.bus
        names = tuple(r.name for r in batch)
        op_label = f"{comm.name.upper()}_ALLREDUCE"
        # What observers alone need (the profiler's tensor sizes), built only when observed.
        described = {"sizes": tuple(r.nbytes for r in batch), "dtype": first.dtype,
                     "backend": comm.name} if bus.active else {}
        if op_name == _ADASUM:
            # Adasum combines tensor by tensor where they lie: no fusion buffer.
            for target, source in zip(outputs, inputs):
                if target is not source:
                    target.copy_(source)
                scale_(target, prescale)
            with ev.Span(bus, phase=ev.COLLECTIVE, kind="allreduce", names=names, nbytes=nbytes,
                         op=f"{comm.name.upper()}_ADASUM", rank=self.rank, process_set_id=ps, cycle=cycle,
                         fused=len(batch), **described):
                adasum_(comm, outputs)
            for target in outputs:
                scale_(target, postscale, divisor)
            self._complete(members, outputs, batch, ps, cycle)
        elif len(batch) == 1:
            # One tensor: reduce it where it lies, no fusion-buffer copies.
            target = outputs[0]
            if target is not inputs[0]:
                target.copy_(inputs[0])
            scale_(target, prescale)

            def finish_alone() -> None:
                scale_(target, postscale, divisor)
                self._complete(members, outputs, batch, ps, cycle)

            span = ev.Span(bus, phase=ev.COLLECTIVE, kind="allreduce", names=names, nbytes=nbytes, op=op_label,
                           rank=self.rank, process_set_id=ps, cycle=cycle, fused=1, **described)
            self._launch(comm, target, _BACKEND_OPS[op_name], span, finish_alone, batch, requests, ps, cycle)
        else:
            total = sum(r.numel for r in batch)
            buffer_key = self._free_buffer(dtype, inputs[0].device)
            buffer = self.buffers.get(dtype, inputs[0].device, total, self.fusion_threshold, slot=buffer_key[2])
            views = self._views(buffer, batch, names)
            with ev.Span(bus, phase=ev.MEMCPY_IN, kind="allreduce", names=names, nbytes=nbytes,
                         rank=self.rank, process_set_id=ps, cycle=cycle, fused=len(batch)):
                if all(t.dim() == 1 for t in inputs):
                    torch.cat(inputs, out=buffer)  # one kernel: three times faster than 200 copies
                else:
                    torch._foreach_copy_(views, inputs)
            scale_(buffer, prescale)

            def finish_fused() -> None:
                # Scaling while copying out saves a pass over the buffer (memory bandwidth is
                # what a CPU rank's compute shares with its engine); one call per tensor only
                # pays off for batches of large tensors.
                factor = postscale / divisor
                scale_on_copy = factor != 1.0 and dtype.is_floating_point and len(batch) <= _SCALE_ON_COPY_MAX
                if not scale_on_copy:
                    scale_(buffer, postscale, divisor)
                with ev.Span(bus, phase=ev.MEMCPY_OUT, kind="allreduce", names=names, nbytes=nbytes,
                             rank=self.rank, process_set_id=ps, cycle=cycle, fused=len(batch)):
                    if scale_on_copy:
                        for out, view in zip(outputs, views):
                            torch.mul(view, factor, out=out)
                    else:
                        torch._foreach_copy_(outputs, views)
                self._complete(members, outputs, batch, ps, cycle)

            span = ev.Span(bus, phase=ev.COLLECTIVE, kind="allreduce", names=names, nbytes=nbytes, op=op_label,
                           rank=self.rank, process_set_id=ps, cycle=cycle, fused=len(batch), **described)
            self.fused_calls += 1
            self._launch(comm, buffer, _BACKEND_OPS[op_name], span, finish_fused, batch, requests, ps, cycle,
                         buffer_key)
        self.backend_calls += 1
        self.tensors_reduced += len(batch)
        self.bytes_reduced += nbytes

    def _complete(self, members: List[Optional[Request]], outputs: List[torch.Tensor], batch: List[Response],
                  ps: int, cycle: int) -> None:
        for request, out in zip(members, outputs):
            if request is not None:
                request.handle.set_result(out)
        self._done(batch, ps, cycle)

    def _views(self, buffer: torch.Tensor, batch: List[Response], names: tuple) -> List[torch.Tensor]:
        """Views of the fusion buffer shaped like the batch's tensors, cached per batch layout.

        Training repeats the same batches step after step; making 200 views costs as much as
        copying 3 MB, so they are made once. The key holds the buffer's address and every
        member's name and shape, so a changed layout never reuses stale views.
        """
        key = (buffer.data_ptr(), names, tuple(r.signature.shape for r in batch))
        views = self._view_cache.get(key)
        if views is None:
            views, offset = [], 0
            for response in batch:
                views.append(buffer[offset:offset + response.numel].view(response.signature.shape))
                offset += response.numel
            if len(self._view_cache) >= _VIEW_CACHE_SIZE:
                self._view_cache.pop(next(iter(self._view_cache)))
            self._view_cache[key] = views
        return views

    def _other(self, comm: Communicator, ps: int, response: Response, request: Request, cycle: int) -> None:
        kind = response.kind
        tensor = request.tensor
        nbytes = request.nbytes
        label = f"{comm.name.upper()}_{kind.value.upper()}"
        described = {"sizes": (nbytes,), "dtype": response.signature.dtype or "",
                     "backend": comm.name} if self.bus.active else {}
        span = ev.Span(self.bus, phase=ev.COLLECTIVE, kind=kind.value, names=(response.name,), nbytes=nbytes,
                       op=label, rank=self.rank, process_set_id=ps, cycle=cycle, **described)
        result = None
        with span:
            if kind == RequestKind.ALLGATHER:
                first_dims = [sig.shape[0] for sig in response.signatures]
                result = comm.allgather(tensor, first_dims=first_dims)
            elif kind == RequestKind.BROADCAST:
                out = request.output if request.output is not None else tensor
                if out is not tensor:
                    out.copy_(tensor)
                comm.broadcast(out, response.signature.root)
                result = out
            elif kind == RequestKind.ALLTOALL:
                def splits_of(sig):
                    splits = sig.splits
                    return list(splits) if splits is not None else even_split(sig.shape[0], comm.size)

                mine = splits_of(response.signatures[comm.rank])
                received = [splits_of(sig)[comm.rank] for sig in response.signatures]
                out, recv = comm.alltoall(tensor, mine, received)
                result = (out, torch.tensor(recv, dtype=torch.int32))
            elif kind == RequestKind.REDUCESCATTER:
                prescale, postscale = response.signature.scales
                op_name = response.signature.op
                divisor = comm.size if op_name == _AVERAGE else 1
                source = tensor
                if prescale != 1.0:
                    source = tensor.clone()
                    scale_(source, prescale)
                result = comm.reduce_scatter(source, _BACKEND_OPS[op_name], even_split(tensor.shape[0], comm.size))
                scale_(result, postscale, divisor)
            elif kind == RequestKind.BARRIER:
                comm.barrier()
            else:  # pragma: no cover - every kind is dispatched above
                raise HorovodInternalError(f"unknown request kind {kind}")
        self.backend_calls += 1
        request.handle.set_result(result)

    def stats(self) -> Dict[str, int]:
        return {
            "backend_calls": self.backend_calls, "fused_calls": self.fused_calls,
            "tensors_reduced": self.tensors_reduced, "bytes_reduced": self.bytes_reduced,
            "fusion_buffer_hits": self.buffers.hits, "fusion_buffer_misses": self.buffers.misses,
            "fusion_buffer_bytes": self.buffers.allocated_bytes,
        }
