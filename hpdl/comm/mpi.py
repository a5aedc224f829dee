"""The MPI backend, through mpi4py: any MPI (MPICH, Open MPI, MVAPICH2, Intel MPI).

CPU tensors are handed to MPI without a copy: the MPI call reads and writes the tensor's own
memory through a byte view. CUDA tensors go to MPI directly when the library is CUDA-aware,
otherwise through a pinned host buffer. MPI has no float16 or bfloat16 reductions, so those
use user-defined operations that reduce the raw 16-bit words with torch. Where some peer is
on another node the engine's allreduces run non-blocking and polled; among the ranks of one
node they block (``background_collectives``). A communicator given a ``wait_hook`` (a spatial
group's) runs its collectives non-blocking, tested in a tight loop as the blocking calls wait,
and calls the hook meanwhile; its point-to-point transfers are polled politely, as always.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any, Callable, Dict, List, MutableMapping, NoReturn, Optional, Sequence, Tuple

import numpy as np
import torch

from hpdl.comm import objects
from hpdl.comm.base import CommError, Communicator, InFlight, ReduceOp, even_split

NOT_INSTALLED = "mpi4py is not installed: pip install 'hpdl[mpi]'"

# MPICH's setting (read once, in MPI_Init) for how its blocking calls wait for a late peer.
HEAVY_YIELD = "MPIR_CVAR_ENABLE_HEAVY_YIELD"


def sleep_in_waits_when_ranks_outnumber_cores(env: MutableMapping[str, str] = os.environ) -> None:
    """Ask MPICH to sleep rather than spin in its waits where this node runs more ranks than it
    has cores, unless the user chose (``MPIR_CVAR_ENABLE_HEAVY_YIELD`` set either way).

    MPICH's blocking calls (MPI_Init, an allreduce among the ranks of one node) spin, yielding
    the core between polls with sched_yield, which the scheduler hands straight back: a rank
    waiting for a peer that has no core takes the core that peer needs. Open MPI ignores the
    variable. Read from the launcher's variables (the node's rank count) and set before mpi4py
    starts MPI, here: a program that started MPI before importing hpdl keeps MPICH's default.
    """
    if HEAVY_YIELD in env:
        return
    from hpdl.comm.topology import discover_topology

    try:
        local_size = discover_topology(env).local_size
    except ValueError:  # the launcher's variables are unreadable: hvd.init() says so
        return
    if local_size > (os.cpu_count() or 1):
        env[HEAVY_YIELD] = "1"


sleep_in_waits_when_ranks_outnumber_cores()
try:  # mpi4py is an optional dependency (extra "mpi").
    from mpi4py import MPI
    _MISSING = NOT_INSTALLED
except ImportError:  # pragma: no cover - exercised where mpi4py is absent
    MPI = None
    _MISSING = NOT_INSTALLED
except RuntimeError as _err:
    # mpi4py 4's wheels load the MPI library when MPI is imported, and raise this where none is
    # installed (mpi4py without an MPI runtime, as on machines that train with nccl alone):
    # hpdl then runs without MPI, as if mpi4py were absent.
    MPI = None
    _MISSING = f"mpi4py is installed but found no MPI library ({str(_err).splitlines()[0]}): pip install mpich"


if MPI is not None and MPI.Is_initialized():  # a rank leaving on an error ends the job (mpi_exit.py)
    from hpdl import rank_exit
    from hpdl.comm import mpi_exit

    mpi_exit.install(MPI)
    rank_exit.note_mpi_started()  # for `hpdl run`: the launcher counts this rank now


def mpi_available() -> bool:
    """Return whether mpi4py imports (and so an MPI library was found)."""
    return MPI is not None


def mpi_missing_reason() -> Optional[str]:
    """Why MPI cannot be used here (mpi4py absent, or without an MPI library), or None when it can."""
    return None if MPI is not None else _MISSING


def mpi_library_version() -> str:
    """Return the first line of the MPI library's version string, e.g. 'MPICH Version: 4.2'."""
    if MPI is None:
        return ""
    return " ".join(MPI.Get_library_version().splitlines()[0].split())


def mpi_flavour() -> str:
    """Return 'MPICH', 'Open MPI', 'MVAPICH2', 'Intel MPI' or 'MPI' from the library version."""
    text = mpi_library_version()
    for key, name in (("MVAPICH", "MVAPICH2"), ("Intel", "Intel MPI"), ("Open MPI", "Open MPI"), ("MPICH", "MPICH")):
        if key in text:
            return name
    return "MPI"


def mpi_cuda_aware() -> bool:
    """Return whether the MPI library reports CUDA support at run time (MPIX_Query_cuda_support)."""
    if MPI is None:
        return False
    try:
        # The extension module's handle resolves symbols of the libmpi it links against.
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (AttributeError, OSError):
        return False  # Open MPI < 4 or a library without the extension: assume not.
    query.restype = ctypes.c_int
    return bool(query())


# --- datatypes and operations -------------------------------------------------------------

def _mpi_types() -> Dict[torch.dtype, Any]:
    return {
        torch.float32: MPI.FLOAT,
        torch.float64: MPI.DOUBLE,
        torch.int8: MPI.INT8_T,
        torch.uint8: MPI.UINT8_T,
        torch.int16: MPI.INT16_T,
        torch.int32: MPI.INT32_T,
        torch.int64: MPI.INT64_T,
        torch.bool: MPI.C_BOOL,
        # Half types travel as 16-bit words and are reduced by the operations below. Not
        # MPI.FLOAT16_T where the library has it: MPICH's own float16 sum is much slower than
        # torch's (measured: scripts/measure_half_reduction.py, docs/perf-notes/); bfloat16
        # it lacks.
        torch.float16: MPI.UINT16_T,
        torch.bfloat16: MPI.UINT16_T,
    }


_HALF = (torch.float16, torch.bfloat16)
_NAN_AWARE = (torch.float32, torch.float64)
_TORCH_REDUCE = {
    ReduceOp.SUM: torch.Tensor.add_,
    ReduceOp.PRODUCT: torch.Tensor.mul_,
    ReduceOp.MIN: lambda a, b: torch.minimum(a, b, out=a),
    ReduceOp.MAX: lambda a, b: torch.maximum(a, b, out=a),
}


def _make_torch_op(dtype: torch.dtype, op: ReduceOp):
    """An MPI operation that reduces with torch's own arithmetic on ``dtype``'s values."""
    reduce = _TORCH_REDUCE[op]

    def apply(inbuf, inoutbuf, datatype) -> None:
        # inoutbuf = inbuf (op) inoutbuf, on the values themselves.
        into = torch.frombuffer(inoutbuf, dtype=dtype)
        reduce(into, torch.frombuffer(inbuf, dtype=dtype))

    return MPI.Op.Create(apply, commute=True)


_op_cache: Dict[Tuple[torch.dtype, ReduceOp], Any] = {}


def _mpi_op(dtype: torch.dtype, op: ReduceOp):
    key = (dtype, op)
    if key in _op_cache:
        return _op_cache[key]
    if dtype in _HALF:
        if op in (ReduceOp.BAND, ReduceOp.BOR):
            raise CommError(f"bitwise reduction {op.value} is not defined for {dtype}")
        result = _make_torch_op(dtype, op)
    elif dtype in _NAN_AWARE and op in (ReduceOp.MIN, ReduceOp.MAX):
        # MPI's MIN and MAX of floats compare with < and >, which a NaN never passes: the
        # result depends on where the NaN sits in the reduction, and ranks can end up with
        # different values (a NaN on one, a number on the other). torch.minimum and maximum
        # propagate NaN, as gloo and one process do.
        result = _make_torch_op(dtype, op)
    elif dtype == torch.bool:
        # Sum and max of booleans are "any", product and min are "all" (as torch computes them).
        result = {ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR, ReduceOp.BOR: MPI.LOR,
                  ReduceOp.PRODUCT: MPI.LAND, ReduceOp.MIN: MPI.LAND, ReduceOp.BAND: MPI.LAND}[op]
    else:
        if op in (ReduceOp.BAND, ReduceOp.BOR) and dtype.is_floating_point:
            raise CommError(f"bitwise reduction {op.value} is not defined for {dtype}")
        result = {ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
                  ReduceOp.PRODUCT: MPI.PROD, ReduceOp.BAND: MPI.BAND, ReduceOp.BOR: MPI.BOR}[op]
    _op_cache[key] = result
    return result


def _wait_politely(request, max_sleep: Optional[float] = None,
                   between: Optional[Callable[[], None]] = None) -> None:
    """Complete a non-blocking MPI request without occupying a core while the peers are late.

    On a machine with as many cores as ranks, a spinning wait steals the core that this rank's
    compute thread needs. Peers usually arrive within microseconds, so the request is first
    polled in a tight loop for a short budget (each Test also drives MPI's progress; a
    ``sleep(0)`` here would hand the core away, to get it back only at the scheduler's
    pleasure); then a back-off of real
    sleeps, up to ``max_sleep``, takes over, calling ``between`` (if given) after each.
    """
    deadline = time.perf_counter() + _SPIN_SECONDS
    while not request.Test():
        if time.perf_counter() > deadline:
            break
    else:
        return
    delay = 5e-5
    longest = _MAX_SLEEP if max_sleep is None else max_sleep
    while not request.Test():
        time.sleep(delay)
        delay = min(delay * 2, longest)
        if between is not None:
            between()


def _wait_spinning(request, between: Callable[[], None], every_s: float) -> None:
    """Complete a non-blocking MPI request as MPI's blocking calls wait, testing it in a tight
    loop, and call ``between`` every ``every_s`` meanwhile.

    For a collective that replaces a blocking one (a spatial group's, Communicator.wait_hook):
    among ranks that share memory it progresses only inside MPI's calls on every rank, so a
    rank that sleeps between its tests delays the others, and a group whose ranks take turns
    at being late would pay a sleep on every call (measured: scripts/measure_halo_exchange.py).
    """
    next_call = time.perf_counter() + every_s
    while not request.Test():
        now = time.perf_counter()
        if now >= next_call:
            between()
            next_call = now + every_s


_SPIN_SECONDS = 1e-4
# Each wake-up costs CPU time taken from the compute; a late peer (its engine thread
# descheduled by the compute) is better waited for with few, longer sleeps.
_MAX_SLEEP = 2e-3
# While allreduces are in flight, MPI is called at least this often (the engine's polls, and
# any wait meanwhile): they move only inside MPI's calls, and a longer gap lets the socket
# buffers run dry; a round that slept _MAX_SLEEP at a time while waiting for a late peer held
# every transfer under way. Polling at this interval beside a busy compute thread beat both
# longer intervals and a blocking wait that spins on the shared core (measured:
# scripts/measure_mpi_polling.py, docs/perf-notes/).
POLL_INTERVAL_S = 5e-4
# How often a wait that spins (_wait_spinning) calls its hook: often enough for a prompt end,
# rarely enough to cost the spin nothing.
_HOOK_INTERVAL_S = 0.01


_EXCHANGE_TAG = 7  # point-to-point transfers (Communicator.exchange); nothing else sends on these


class _AllOf:
    """Several MPI requests waited for as one (``Test`` is ``Testall``)."""

    __slots__ = ("_requests",)

    def __init__(self, requests):
        self._requests = requests

    def Test(self) -> bool:  # noqa: N802 - mpi4py's spelling, for _wait_politely
        return MPI.Request.Testall(self._requests)


class _PolledInFlight(InFlight):
    """A non-blocking MPI collective. MPI moves data only inside its calls (over TCP, no
    thread of its own), so the engine thread polls it between rounds, sleeping in between:
    the kernel's socket buffers carry the bytes meanwhile, and the core is left to the
    compute instead of spinning in a blocking call."""

    poll_interval_s = POLL_INTERVAL_S
    runs_in_order = False
    __slots__ = ("_request", "_callback", "_done", "_owner")

    def __init__(self, request, owner: "MPICommunicator"):
        self._request = request
        self._callback = None
        self._done = False
        self._owner = owner
        owner.in_flight += 1

    def done(self) -> bool:
        if not self._done and self._request.Test():
            self._done = True
            self._owner.in_flight -= 1
            if self._callback is not None:
                self._callback()
        return self._done

    def wait(self) -> None:
        if not self._done:
            _wait_politely(self._request, POLL_INTERVAL_S)
            self.done()

    def on_done(self, callback) -> None:
        self._callback = callback
        self.done()


class MPICommunicator(Communicator):
    """A communicator over an mpi4py ``Intracomm``."""

    name = "mpi"
    runs_in_order = False

    def __init__(self, comm=None, cuda_aware: Optional[bool] = None):
        if MPI is None:
            raise CommError("the MPI backend needs mpi4py: pip install 'hpdl[mpi]' (or mpi4py built against your MPI)")
        self._comm = MPI.COMM_WORLD if comm is None else comm
        self._rank = self._comm.Get_rank()
        self._size = self._comm.Get_size()
        self._types = _mpi_types()
        self.cuda_aware = mpi_cuda_aware() if cuda_aware is None else cuda_aware
        self._pinned: Dict[torch.dtype, torch.Tensor] = {}  # host staging for CUDA tensors (_pinned_buffer)
        # For the liveness check after a failure: a communicator of its own (collective to
        # create, so made now), where no half-finished collective of the engine's is pending.
        self._probe = self._comm.Dup()
        # The engine's negotiation runs here, apart from the data: the engine may start the
        # collectives it has agreed while a round waits (control_wait_hook), and collectives on
        # one communicator must start in the same order on every rank.
        self._control = self._comm.Dup()
        # Allreduces run in flight, polled, only where some peer is on another node: there the
        # bytes cross a network whose kernel buffers carry them between polls. Among ranks
        # that share memory MPI copies through shared memory only inside its calls, so a
        # polled allreduce moves a little at each poll, and a blocking one, which copies at
        # memory speed, is faster (measured: docs/perf-notes/).
        node = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self._rank)
        self.background_collectives = node.Get_size() < self._size
        node.Free()
        self._probes = 0
        self.in_flight = 0  # started allreduces not yet seen done (they progress when polled)
        # The buffers of transfers abandoned when wait_hook raised: MPI may still read or write
        # them (a send, a collective cannot be cancelled), so they live as long as the communicator.
        self._abandoned: List[Any] = []

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def mpi_comm(self):
        """The underlying mpi4py communicator."""
        return self._comm

    # -- buffers ---------------------------------------------------------------------------

    def _spec(self, tensor: torch.Tensor, count: Optional[int] = None):
        """An mpi4py buffer spec [memory, count, datatype] over the tensor's own storage."""
        if not tensor.is_contiguous():
            raise CommError("MPI backend needs contiguous tensors")
        mpitype = self._types.get(tensor.dtype)
        if mpitype is None:
            raise CommError(f"dtype {tensor.dtype} is not supported by the MPI backend")
        n = tensor.numel() if count is None else count
        if tensor.numel() == 0:
            return [np.empty(0, dtype=np.uint8), 0, mpitype]
        return [self._raw(tensor), n, mpitype]

    def _host_staging(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """For a CUDA tensor and an MPI that is not CUDA-aware, a pinned host copy (else None).

        The copy waits for the tensor on the engine's stream (a device-to-host copy into
        pinned memory returns once done); a CUDA-aware MPI reads device memory outside any
        stream, so the stream is waited for first.
        """
        if not tensor.is_cuda or self.cuda_aware:
            if tensor.is_cuda:
                torch.cuda.current_stream(tensor.device).synchronize()
            return None
        host = self._pinned_buffer(tensor.dtype, tensor.numel())
        host.copy_(tensor.reshape(-1))
        return host

    def _pinned_buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """``numel`` elements of the pinned host buffer of ``dtype``, grown to the largest asked for.

        One buffer per dtype, not one per size: fused batches take many sizes, and page-locked
        memory kept for each would grow without bound.
        """
        buffer = self._pinned.get(dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(max(numel, 2 * (buffer.numel() if buffer is not None else 0)), dtype=dtype,
                                 pin_memory=True)
            self._pinned[dtype] = buffer
        return buffer[:numel]

    def _staged_send_and_output(self, tensor: torch.Tensor, out_shape: Tuple[int, ...]):
        """For a collective with a new output: the buffer to send (``tensor``, or its pinned host
        copy where MPI cannot read device memory) and an empty output where MPI can write it
        (moved to ``tensor``'s device by the caller)."""
        device = "cpu" if tensor.is_cuda and not self.cuda_aware else tensor.device
        out = torch.empty(out_shape, dtype=tensor.dtype, device=device)
        send = self._host_staging(tensor)
        return (tensor if send is None else send), out

    def _run_on_host(self, tensor: torch.Tensor, fn) -> None:
        staged = self._host_staging(tensor)
        if staged is None:
            fn(tensor)
        else:
            fn(staged)
            tensor.copy_(staged.view_as(tensor))

    # -- collectives -----------------------------------------------------------------------

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        mpi_op = _mpi_op(tensor.dtype, op)
        if self.wait_hook is None:
            self._run_on_host(tensor, lambda t: self._comm.Allreduce(MPI.IN_PLACE, self._spec(t), op=mpi_op))
        else:
            self._run_on_host(tensor, lambda t: self._wait_interruptibly(
                self._comm.Iallreduce(MPI.IN_PLACE, self._spec(t), op=mpi_op), keep=(t,), spin=True))

    def allreduce_start(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> InFlight:
        """Start a non-blocking allreduce (``MPI_Iallreduce``) that the engine completes by
        polling; device memory MPI cannot read goes the blocking way, through host staging."""
        if (tensor.is_cuda and not self.cuda_aware) or not self.background_collectives:
            return super().allreduce_start(tensor, op)
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()
        request = self._comm.Iallreduce(MPI.IN_PLACE, self._spec(tensor), op=_mpi_op(tensor.dtype, op))
        return _PolledInFlight(request, self)

    def allreduce_control(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        request = self._control.Iallreduce(MPI.IN_PLACE, self._spec(tensor), op=_mpi_op(tensor.dtype, op))
        self._wait_control(request)

    def allgather_object_control(self, obj: Any) -> List[Any]:
        payload = np.frombuffer(objects.dumps(obj), dtype=np.uint8)
        counts = np.zeros(self._size, dtype=np.int64)
        self._wait_control(self._control.Iallgather(np.array([payload.size], dtype=np.int64), counts))
        received = np.empty(int(counts.sum()), dtype=np.uint8)
        sizes = [int(c) for c in counts]
        displs = [sum(sizes[:r]) for r in range(self._size)]
        self._wait_control(self._control.Iallgatherv(payload, [received, sizes, displs, MPI.BYTE]))
        return [objects.loads(received[d:d + c].tobytes()) for d, c in zip(displs, sizes)]

    def _wait_control(self, request) -> None:
        _wait_politely(request, POLL_INTERVAL_S if self.in_flight else _MAX_SLEEP, self.control_wait_hook)

    def unanswering(self, wait_s: float) -> Optional[List[int]]:
        # Every rank sends a word to every other and listens for theirs: a peer whose word has
        # not come within wait_s is dead or cut off (its send cannot be waited for: left behind).
        self._probes += 1
        tag = self._probes
        peers = [r for r in range(self._size) if r != self._rank]
        words = {r: np.zeros(1, dtype=np.int64) for r in peers}
        receives = {r: self._probe.Irecv(words[r], source=r, tag=tag) for r in peers}
        mine = np.array([self._rank], dtype=np.int64)
        for r in peers:
            try:
                self._probe.Isend(mine, dest=r, tag=tag)
            except MPI.Exception:
                pass
        deadline = time.monotonic() + wait_s
        missing = set(peers)
        while missing and time.monotonic() < deadline:
            for r in list(missing):
                try:
                    if receives[r].Test():
                        missing.discard(r)
                except MPI.Exception:
                    pass  # an error from that peer's connection: it stays missing
            time.sleep(0.01)
        for r in missing:
            try:
                receives[r].Cancel()
            except MPI.Exception:
                pass
        return sorted(missing)

    def allgather(self, tensor: torch.Tensor, first_dims: Optional[Sequence[int]] = None) -> torch.Tensor:
        if tensor.dim() == 0:
            raise CommError("allgather needs a tensor of at least one dimension")
        if first_dims is None:
            first_dims = self._exchange_ints([tensor.shape[0]])
        row = _row_numel(tensor)
        counts = [d * row for d in first_dims]
        displs = np.cumsum([0] + counts[:-1]).tolist()
        send, out = self._staged_send_and_output(tensor, (sum(first_dims),) + tuple(tensor.shape[1:]))
        send = send.contiguous()
        received = [self._raw(out), (counts, displs), self._types[tensor.dtype]]
        if self.wait_hook is None:
            self._comm.Allgatherv(self._spec(send), received)
        else:
            self._wait_interruptibly(self._comm.Iallgatherv(self._spec(send), received), keep=(send, out), spin=True)
        return out.to(tensor.device)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        self._run_on_host(tensor, lambda t: self._comm.Bcast(self._spec(t), root=root))

    def alltoall(
        self, tensor: torch.Tensor, splits: Sequence[int], recv_splits: Optional[Sequence[int]] = None
    ) -> Tuple[torch.Tensor, List[int]]:
        splits = [int(s) for s in splits]
        if recv_splits is None:
            sent = np.array(splits, dtype=np.int64)
            received = np.empty(self._size, dtype=np.int64)
            self._comm.Alltoall(sent, received)
            recv_splits = received.tolist()
        recv_splits = [int(s) for s in recv_splits]
        row = _row_numel(tensor)
        send, out = self._staged_send_and_output(tensor, (sum(recv_splits),) + tuple(tensor.shape[1:]))
        mpitype = self._types[tensor.dtype]
        scounts = [s * row for s in splits]
        rcounts = [s * row for s in recv_splits]
        self._comm.Alltoallv(
            [self._raw(send), (scounts, np.cumsum([0] + scounts[:-1]).tolist()), mpitype],
            [self._raw(out), (rcounts, np.cumsum([0] + rcounts[:-1]).tolist()), mpitype],
        )
        return out.to(tensor.device), recv_splits

    def reduce_scatter(
        self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, counts: Optional[Sequence[int]] = None
    ) -> torch.Tensor:
        counts = list(counts) if counts is not None else even_split(tensor.shape[0], self._size)
        row = _row_numel(tensor)
        send, out = self._staged_send_and_output(tensor, (counts[self._rank],) + tuple(tensor.shape[1:]))
        mpitype = self._types[tensor.dtype]
        self._comm.Reduce_scatter(
            [self._raw(send), send.numel(), mpitype],
            [self._raw(out), out.numel(), mpitype],
            [c * row for c in counts],
            op=_mpi_op(tensor.dtype, op),
        )
        return out.to(tensor.device)

    def exchange(self, sends: Sequence[Tuple[int, torch.Tensor]],
                 receives: Sequence[Tuple[int, torch.Tensor]]) -> None:
        # Device memory that MPI cannot read travels through host copies of its own (not the
        # cached staging buffers: two transfers of one size may be under way at once).
        stage = any(t.is_cuda for _, t in list(sends) + list(receives)) and not self.cuda_aware
        if any(t.is_cuda for _, t in sends) and not stage:
            torch.cuda.current_stream().synchronize()
        landing = [(peer, t, torch.empty(t.shape, dtype=t.dtype, pin_memory=True) if stage and t.is_cuda else t)
                   for peer, t in receives]
        requests = [self._comm.Irecv(self._spec(buf), source=peer, tag=_EXCHANGE_TAG) for peer, _t, buf in landing]
        outgoing = [(peer, t.cpu() if stage and t.is_cuda else t.contiguous()) for peer, t in sends]
        receiving = list(requests)
        requests += [self._comm.Isend(self._spec(t), dest=peer, tag=_EXCHANGE_TAG) for peer, t in outgoing]
        if requests:
            self._wait_interruptibly(_AllOf(requests), keep=(landing, outgoing), cancel=receiving)
        for _peer, tensor, buf in landing:
            if buf is not tensor:
                tensor.copy_(buf)

    def _wait_interruptibly(self, request, keep: Any, cancel: Sequence[Any] = (), spin: bool = False) -> None:
        """Wait for ``request``, calling ``wait_hook`` (if set) meanwhile: spinning as the blocking
        collective it replaces would (``spin``), else politely, as point-to-point transfers
        always have. Should the hook raise, the transfer is abandoned: the receives of ``cancel``
        are cancelled, so that nothing lands later, and ``keep`` (every buffer MPI may still
        read or write) lives on with the communicator."""
        try:
            if spin:
                _wait_spinning(request, self.wait_hook, _HOOK_INTERVAL_S)
            else:
                _wait_politely(request, POLL_INTERVAL_S, self.wait_hook)
        except BaseException:
            for receive in cancel:
                try:
                    receive.Cancel()
                    receive.Test()  # completes the cancelled receive (MPI_Finalize would count it pending)
                except MPI.Exception:  # done already, or the connection is gone
                    pass
            self._abandoned.append(keep)
            raise

    def barrier(self) -> None:
        self._comm.Barrier()

    def split(self, ranks: Sequence[int]) -> Optional["MPICommunicator"]:
        members = sorted(set(int(r) for r in ranks))
        color = 0 if self._rank in members else MPI.UNDEFINED
        sub = self._comm.Split(color, members.index(self._rank) if self._rank in members else 0)
        if sub == MPI.COMM_NULL:
            return None
        return MPICommunicator(sub, cuda_aware=self.cuda_aware)

    def node_layout(self) -> Tuple[int, int, int, int]:
        # As Horovod does: ranks sharing memory form the node; same local rank forms the cross group.
        local = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self._rank)
        cross = self._comm.Split(local.Get_rank(), self._rank)
        layout = (local.Get_rank(), local.Get_size(), cross.Get_rank(), cross.Get_size())
        local.Free()
        cross.Free()
        return layout

    def close(self) -> None:
        if MPI.Is_finalized():  # at interpreter exit, after mpi4py's MPI_Finalize: nothing left to free
            return
        for comm in (self._comm, self._probe, self._control):
            if comm not in (MPI.COMM_WORLD, MPI.COMM_SELF) and comm != MPI.COMM_NULL:
                try:
                    comm.Free()
                except MPI.Exception:
                    pass
        self._pinned.clear()

    def abort(self, code: int) -> NoReturn:
        # On the world communicator, whatever group this is: the launcher then ends every rank,
        # including one blocked in C code that no exception can reach.
        MPI.COMM_WORLD.Abort(code)
        os._exit(code)  # pragma: no cover - MPI_Abort does not return

    def describe(self) -> str:
        aware = "CUDA-aware" if self.cuda_aware else "not CUDA-aware"
        return f"mpi ({mpi_library_version()}, {aware})"

    # -- helpers ---------------------------------------------------------------------------

    def _raw(self, tensor: torch.Tensor):
        """The tensor's bytes for mpi4py: a NumPy view of host memory, or a CUDA tensor of bytes
        (through ``__cuda_array_interface__``, which torch refuses for bfloat16 and for tensors
        that require grad; the MPI datatype passed beside it says what the bytes hold)."""
        if tensor.numel() == 0:
            return np.empty(0, dtype=np.uint8)
        raw = tensor.detach().reshape(-1).view(torch.uint8)
        return raw if tensor.is_cuda else raw.numpy()

    def _exchange_ints(self, values: List[int]) -> List[int]:
        sent = np.array(values, dtype=np.int64)
        out = np.empty(len(values) * self._size, dtype=np.int64)
        if self.wait_hook is None:
            self._comm.Allgather(sent, out)
        else:
            self._wait_interruptibly(self._comm.Iallgather(sent, out), keep=(sent, out), spin=True)
        return out.tolist()


def _row_numel(tensor: torch.Tensor) -> int:
    """Elements per row along dim 0 (1 for a 0-d or 1-d tensor)."""
    n = 1
    for d in tensor.shape[1:]:
        n *= d
    return n
