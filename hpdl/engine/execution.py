"""Run agreed responses on the backend: allreduces (each batch of the fusion plan in place,
fused or by Adasum, allreduce.py) and the other collectives.

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

from hpdl.comm import Communicator, InFlight, even_split
from hpdl.engine import events as ev
from hpdl.engine.allreduce import ADASUM, AVERAGE, BACKEND_OPS, Adasum, Allreduce, Fused, InPlace, scale_
from hpdl.engine.clock import SYSTEM_CLOCK, Clock
from hpdl.engine.errors import HorovodInternalError
from hpdl.engine.fusion import FusionBuffers, plan_fusion
from hpdl.engine.request import Request, RequestKind, Response

_VIEW_CACHE_SIZE = 256
_FUSION_SLOTS = 2  # fusion buffers per dtype and device: one filling while one is in flight


class _Flight:
    """An allreduce the backend runs in the background: the backend's handle on it, the span
    of its backend call, and the allreduce that finishes on this rank once it is done."""

    __slots__ = ("flight", "span", "allreduce", "started", "nbytes", "done_us")

    def __init__(self, flight: InFlight, span: ev.Span, allreduce: Allreduce, started: float):
        self.flight = flight
        self.span = span
        self.allreduce = allreduce
        self.started = started  # clock time (the engine's watch compares it)
        self.nbytes = allreduce.nbytes
        self.done_us: Optional[float] = None  # when the backend finished it (its thread's clock)


class Executor:
    """Carries out responses for one engine; owns the collectives in flight, the fusion buffers
    and threshold, the device of a joined rank's zeros, and the counters."""

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
        self._fusion_threshold = fusion_threshold
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
        self._join_device = -1  # the GPU of the zeros this rank contributes once joined (hvd.join)
        self._view_cache: Dict[tuple, List[torch.Tensor]] = {}
        self.backend_calls = 0
        self.fused_calls = 0  # backend allreduces that carried more than one tensor
        self.tensors_reduced = 0
        self.bytes_reduced = 0

    @property
    def fusion_threshold(self) -> int:
        """The most bytes fused into one backend call (autotuning changes it, :meth:`retune`)."""
        return self._fusion_threshold

    def retune(self, fusion_threshold: int) -> None:
        """Fuse up to ``fusion_threshold`` bytes per backend call from the next batch on (rank 0's
        autotuner chose it; every rank applies it in the same round)."""
        self._fusion_threshold = fusion_threshold

    @property
    def join_device(self) -> int:
        """The GPU of the zeros this rank contributes once joined (-1: the current one)."""
        return self._join_device

    def set_join_device(self, device: int) -> None:
        """This rank has joined (hvd.join): the zeros it contributes to CUDA allreduces go on GPU
        ``device`` (-1: the current one)."""
        self._join_device = device

    def run(self, comm: Communicator, process_set_id: int, responses: List[Response],
            requests: Dict[str, Request], cycle: int) -> None:
        """Run the collectives of ``responses``; complete the handles of this rank's requests.
        Those the members agreed not to run (``error``) fail here; requests that change the
        engine itself (``RequestKind.controls_engine``) are the engine's, never given here.

        Args:
            requests: this rank's requests by name (a joined rank has none); each carries its
                handle.
        """
        allreduces: List[Response] = []
        others: List[Response] = []
        for response in responses:
            if response.error is not None:
                request = requests.get(response.name)
                if request is not None:
                    request.handle.set_error(response.refused())
            elif response.kind is RequestKind.ALLREDUCE:
                allreduces.append(response)
            else:
                others.append(response)
        for batch in plan_fusion(allreduces, self._fusion_threshold, self.inplace_threshold):
            try:
                self._allreduce(comm, process_set_id, batch, requests, cycle)
            except Exception as err:  # a failed backend call fails its requests, not the engine
                self._fail(batch, requests, err)
                self._done(batch, process_set_id, cycle)
        for response in others:
            request = requests.get(response.name)
            try:
                if request is not None:
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
            allreduce = head.allreduce
            try:
                head.flight.wait()
                self._end_span(head)
                allreduce.finish()
                self._complete(allreduce)
            except Exception as err:  # a failed backend call fails its requests, not the engine
                self._fail(allreduce.batch, allreduce.requests, err)
                self._done(allreduce.batch, allreduce.process_set_id, allreduce.cycle)
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
        key = flight.allreduce.process_set_id
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
        for head in flights:
            for request in head.allreduce.members:
                if request is not None:
                    request.handle.set_error(error)

    def _launch(self, comm: Communicator, allreduce: Allreduce, tensor: torch.Tensor) -> None:
        """Start the backend's allreduce of ``tensor`` (what ``allreduce`` began); finish and
        complete ``allreduce`` once it is done (now, if it blocked)."""
        span = allreduce.collective_span(comm, f"{comm.name.upper()}_ALLREDUCE")
        span.__enter__()
        op = BACKEND_OPS[allreduce.op]
        flight = comm.allreduce_start(tensor, op) if self.background else None
        if flight is None:
            comm.allreduce(tensor, op)
        elif not flight.done():
            entry = _Flight(flight, span, allreduce, self._clock.monotonic())
            with self._in_flight_lock:
                self.in_flight.append(entry)
                self.in_flight_bytes += entry.nbytes
            flight.on_done(functools.partial(self._flight_done, entry))
            return
        else:
            flight.wait()
        span.__exit__(None, None, None)
        allreduce.finish()
        self._complete(allreduce)

    def _free_buffer(self, dtype: torch.dtype, device: torch.device) -> tuple:
        """The key of a fusion buffer for ``dtype`` on ``device`` that no collective in flight
        uses: a free one of the ``_FUSION_SLOTS``, else the oldest's once it has finished.

        Two buffers let the next fused message be copied in and started while the previous one
        is still on the wire, so the link never waits for a copy; with one, each fused message
        would wait for the one before it to finish.
        """
        with self._in_flight_lock:
            flights = [f for f in self.in_flight
                       if f.allreduce.buffer_key is not None and f.allreduce.buffer_key[:2] == (dtype, str(device))]
        busy = {f.allreduce.buffer_key for f in flights}
        for slot in range(_FUSION_SLOTS):
            key = (dtype, str(device), slot)
            if key not in busy:
                return key
        self.complete(until=flights[0])
        return flights[0].allreduce.buffer_key

    # -- allreduce -------------------------------------------------------------------------

    def _allreduce(self, comm: Communicator, ps: int, batch: List[Response], requests: Dict[str, Request],
                   cycle: int) -> None:
        """Run one batch of the fusion plan: by Adasum, in place (a lone tensor) or fused."""
        on = (comm, self._join_device, self.bus, self.rank, ps, cycle)
        if batch[0].signature.op == ADASUM:
            allreduce = Adasum(batch, requests, *on)
            allreduce.run(comm)
            self._complete(allreduce)
        elif len(batch) == 1:
            allreduce = InPlace(batch, requests, *on)
            self._launch(comm, allreduce, allreduce.begin())
        else:
            allreduce = fused = Fused(batch, requests, *on)
            key = self._free_buffer(fused.dtype, fused.inputs[0].device)
            buffer = self.buffers.get(fused.dtype, fused.inputs[0].device, sum(r.numel for r in batch),
                                      self._fusion_threshold, slot=key[2])
            self.fused_calls += 1
            self._launch(comm, fused, fused.begin(buffer, self._views(buffer, batch, fused.names), key))
        self.backend_calls += 1
        self.tensors_reduced += len(batch)
        self.bytes_reduced += allreduce.nbytes

    def _complete(self, allreduce: Allreduce) -> None:
        """Hand ``allreduce``'s results to its handles; tell observers it is done."""
        for request, out in zip(allreduce.members, allreduce.outputs):
            if request is not None:
                request.handle.set_result(out)
        self._done(allreduce.batch, allreduce.process_set_id, allreduce.cycle)

    def _views(self, buffer: torch.Tensor, batch: List[Response], names: tuple) -> List[torch.Tensor]:
        """Views of the fusion buffer shaped like the batch's tensors, cached per batch layout.

        Training repeats the same batches step after step, and making a view costs Python
        time per tensor, on the engine thread, at every step, so they are made once. The key
        holds the buffer's address and every member's name and shape, so a changed layout
        never reuses stale views.
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
                divisor = comm.size if op_name == AVERAGE else 1
                source = tensor
                if prescale != 1.0:
                    source = tensor.clone()
                    scale_(source, prescale)
                result = comm.reduce_scatter(source, BACKEND_OPS[op_name], even_split(tensor.shape[0], comm.size))
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
