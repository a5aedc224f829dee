"""The torch.distributed backend: gloo on CPU tensors, nccl on CUDA tensors.

Control messages (the engine's negotiation, object exchange) always travel over a gloo group on
the CPU, so an nccl job never puts tiny host-side messages through CUDA. Under nccl, CPU
tensors (a metric, an optimizer's step count) travel over a gloo group of their own beside it,
since NCCL moves device memory only; gloo carries CUDA tensors too (through host memory), as
ranks that share one GPU need.

CUDA streams: the engine thread issues everything on the default stream of each device (it
never sets another), where hpdl.torch has ordered the callers' work before it (mpi_ops).
torch.distributed's collectives wait for the issuing thread's current stream when they are
started, and ``work.wait()`` makes that stream wait for the collective, on the GPU, without
blocking the host. An nccl allreduce is therefore finished, for the engine, once it is
started: what follows it (scaling, copying out of the fusion buffer) is queued behind it on the
same stream. Waiting on the host until the GPU is done (``work.is_completed()``) would cost a
poll per collective, and NCCL's future reports completion when the work is queued, not done,
so nothing would wake the engine when it is.

A communicator given a ``wait_hook`` (a spatial group's) makes its gloo calls on a thread of its
own (``_GlooCaller``) and waits for them in timed waits, calling the hook between them: gloo's
point-to-point works cannot be polled, nor waited for with a timeout without breaking the group.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import gc
import os
import queue
import threading
import time
from typing import Any, Callable, List, NoReturn, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hpdl.comm.base import CommError, Communicator, InFlight, ReduceOp, even_split

_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BOR: dist.ReduceOp.BOR,
}
# Booleans are reduced as bytes: any() is max, all() is min.
_BOOL_OPS = {
    ReduceOp.SUM: ReduceOp.MAX, ReduceOp.MAX: ReduceOp.MAX, ReduceOp.BOR: ReduceOp.MAX,
    ReduceOp.PRODUCT: ReduceOp.MIN, ReduceOp.MIN: ReduceOp.MIN, ReduceOp.BAND: ReduceOp.MIN,
}
# Neither gloo nor NCCL has int16: reduce it widened (wrap-around on narrowing matches int16
# arithmetic) and move it as bytes.
_WIDEN = {torch.int16: torch.int32}
# How often an interruptible wait (Communicator.wait_hook) calls the hook; the wait itself ends
# as soon as the call does (its end wakes the caller).
_HOOK_INTERVAL_S = 0.01


def _as_rows_of_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """View a contiguous tensor as (rows, bytes per row) uint8, for pure data movement."""
    rows = tensor.shape[0] if tensor.dim() else 1
    row_numel = 1
    for d in tensor.shape[1:]:
        row_numel *= d
    # The row length given, not -1: a tensor of no rows (an allgather or alltoall of 0 rows
    # from some rank) has no elements from which to infer it.
    return tensor.reshape(rows, row_numel).view(torch.uint8)


def _from_rows_of_bytes(data: torch.Tensor, like: torch.Tensor, rows: int) -> torch.Tensor:
    # Flattened first: rows of no bytes have a stride torch cannot view as a wider type.
    return data.reshape(-1).view(like.dtype).reshape((rows,) + tuple(like.shape[1:]))


def init_process_group(backend: str, rank: int, size: int, timeout_s: float, store=None) -> None:
    """Initialise torch.distributed's default group unless the user already did.

    Rendezvous follows torch's ``env://`` convention (MASTER_ADDR, MASTER_PORT). Under an MPI
    launcher that sets neither, rank 0's host name and a free port are shared through MPI.

    A group created here is destroyed at interpreter exit (after ``hvd.shutdown()``, which
    atexit runs first since it is registered later): left to the C++ static destructors, gloo
    aborts the process ("terminate called without an active exception") in about one exit in
    ten on a loaded machine. It outlives ``shutdown()`` so that ``init()`` can run again.

    ``store``: meet through it (an elastic job's generation: hpdl/comm/rendezvous.py) instead.
    """
    if dist.is_initialized():
        return
    if not _exit_registered:
        atexit.register(_destroy_default_group)
        _exit_registered.append(True)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
        return
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent hosts the store, and keeps it when it restarts the workers: meet
            # under keys of this world's own (see _world_prefix).
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timeout)
            prefix = _world_prefix(store, rank, size, timeout_s)
            dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=size,
                                    timeout=timeout)
            return
        # torchrun (or the user) set up the rendezvous.
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size, timeout=timeout)
        return
    if size == 1:
        addr, port = "127.0.0.1", _free_port()
    else:
        addr, port = _rendezvous_through_mpi(rank)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size, timeout=timeout)


_WORLD_KEYS = "hpdl/world/"
_PREFIX_POLL_S = 0.01


def _world_prefix(store, rank: int, size: int, timeout_s: float) -> str:
    """A prefix of the store's keys that this world's ranks alone use.

    torchrun's agent (torch 2.5 and later, c10d rendezvous) keeps the store it hosts for its
    workers when it restarts them after a failure or a change of nodes, and torch's ``env://``
    no longer puts the restart in the keys (pytorch#135712): the restarted workers would meet
    their predecessors' addresses there, and gloo fails to connect or hangs. Every key a
    world's ranks read may be such a leftover, except keys named after something new: so rank
    0 draws a token, each other rank a nonce, which it announces under its rank; rank 0
    answers every nonce it reads with the token (under a key named by the nonce, which only
    this world's rank 0 can have read), until each rank has confirmed the token under a key
    named by it.
    """
    import secrets

    deadline = time.monotonic() + timeout_s
    if rank != 0:
        nonce = secrets.token_hex(8)
        store.set(f"{_WORLD_KEYS}hello/{rank}", nonce)
        answer = f"{_WORLD_KEYS}welcome/{nonce}"
        store.wait([answer], datetime.timedelta(seconds=timeout_s))
        token = store.get(answer).decode()
        store.set(f"{_WORLD_KEYS}{token}/ready/{rank}", "1")
        return f"{_WORLD_KEYS}{token}/"
    token = secrets.token_hex(8)
    answered = {}  # rank -> the nonce answered last
    waiting = set(range(1, size))
    while waiting:
        for other in sorted(waiting):
            hello = f"{_WORLD_KEYS}hello/{other}"
            if store.check([hello]):
                nonce = store.get(hello).decode()
                if answered.get(other) != nonce:
                    store.set(f"{_WORLD_KEYS}welcome/{nonce}", token)
                    answered[other] = nonce
            if store.check([f"{_WORLD_KEYS}{token}/ready/{other}"]):
                waiting.discard(other)
        if waiting:
            if time.monotonic() > deadline:
                raise CommError(f"ranks {sorted(waiting)} did not join rank 0 in torchrun's store within "
                                f"{timeout_s:g} s")
            time.sleep(_PREFIX_POLL_S)
    return f"{_WORLD_KEYS}{token}/"


_exit_registered: List[bool] = []
# Groups left with a call in them (an elastic job's generation that ended under a collective):
# never shut down, since shutting gloo down under a call in flight aborts the process at exit
# ("terminate called without an active exception"); the calls end at their timeout, or when
# the peer's process does.
_ABANDONED_GROUPS: List[Any] = []
_ABANDONED_WORKS: List[Any] = []  # and their works (their tensors), for the same reason
# How _poll waits: this many yields, then sleeps growing by the step, up to the most.
_SPINS = 50
_POLL_STEP_S = 0.00005
_POLL_MAX_S = 0.001


def leave_world() -> None:
    """Destroy the default group now (an elastic job's worker leaving its generation), so that
    the next ``init_process_group`` forms the next one; groups with an abandoned call in them
    are kept, not shut down (see ``_ABANDONED_GROUPS``)."""
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken generation's group; the next one is what matters
        pass


def _keep_unshut(group) -> None:
    """Take ``group`` out of torch's registry of groups to shut down, and keep it alive for
    good: not even the interpreter's finalization frees it (a reference no one releases), since
    its destructor, with a gloo thread still in the abandoned call, aborts the process."""
    _ABANDONED_GROUPS.append(group)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    names = getattr(dist.distributed_c10d._world, "pg_names", None)  # noqa: SLF001 - see _ABANDONED_GROUPS
    if names is not None:
        names.pop(group, None)


def _destroy_default_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # exiting anyway; a failed tear-down must not mask the exit status
            pass
        # A group still held in a reference cycle would be freed by the collection that runs
        # during interpreter finalization, where its worker threads can no longer take the GIL
        # to release their last tensors (and abort the process). Collect now, while they can.
        gc.collect()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _rendezvous_through_mpi(rank: int) -> Tuple[str, int]:
    from hpdl.comm.mpi import MPI

    if MPI is None:  # mpi4py absent, or without an MPI library
        raise CommError(
            "torch.distributed needs MASTER_ADDR and MASTER_PORT (torchrun sets them); "
            "set them or launch with torchrun"
        )
    import socket

    info = (socket.gethostname(), _free_port()) if rank == 0 else None
    return MPI.COMM_WORLD.bcast(info, root=0)


class _WorkInFlight(InFlight):
    """A torch.distributed work object as an :class:`InFlight`."""

    __slots__ = ("_work",)

    def __init__(self, work):
        self._work = work

    def done(self) -> bool:
        return self._work.is_completed()

    def wait(self) -> None:
        self._work.wait()

    def on_done(self, callback) -> None:
        self._work.get_future().add_done_callback(lambda _future: callback())


class _Call:
    """A call that :class:`_GlooCaller` makes: ``done`` (a lock held until then) is released once it
    has returned, with the ``error`` it raised, if any. (A lock, not an Event: the caller's
    timed acquire wakes the moment it is released, with less of the GIL's back and forth.)"""

    __slots__ = ("run", "done", "error")

    def __init__(self, run: Callable[[], Any]):
        self.run = run
        self.done = threading.Lock()
        self.done.acquire()
        self.error: Optional[BaseException] = None


class _GlooCaller:
    """A thread that makes gloo's blocking calls for a caller that must stay interruptible
    (``Communicator.wait_hook``), while the caller waits for it in timed waits, calling its hook
    between them.

    gloo's point-to-point works cannot be polled (``is_completed()`` turns true only inside
    ``wait()``, and a ``wait(timeout)`` that times out breaks every connection of the group), and
    a collective started with ``async_op`` costs more than a blocking one made on this thread
    (measured: scripts/measure_halo_exchange.py). A call the caller abandons keeps this thread,
    and its tensors alive, until it ends or the process does; the job is ending then.
    """

    def __init__(self):
        self._calls: "queue.SimpleQueue[Optional[_Call]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="hpdl-gloo-caller", daemon=True)
        self._thread.start()

    def call(self, run: Callable[[], Any]) -> _Call:
        call = _Call(run)
        self._calls.put(call)
        return call

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            try:
                call.run()
            except Exception as err:  # noqa: BLE001 - handed to the caller, which raises it
                call.error = err
            call.run = None  # no reference to a transfer's tensors outlives it (see _destroy_default_group)
            call.done.release()
            del call

    def close(self) -> None:
        self._calls.put(None)
        self._thread.join(1.0)  # an abandoned call may hold it: not waited for longer


class TorchCommunicator(Communicator):
    """A communicator over a torch.distributed process group."""

    def __init__(self, backend: str = "gloo", group=None, control_group=None, cpu_group=None):
        if not dist.is_initialized():
            raise CommError("torch.distributed is not initialised")
        self.name = backend
        self._group = group if group is not None else dist.group.WORLD
        self._is_world = group is None
        if control_group is None and self._is_world:
            # Negotiation gets a gloo group of its own, also under gloo: its small messages
            # must not queue behind the data collectives running in the background.
            control_group = dist.new_group(backend="gloo")
        self._control = control_group if control_group is not None else self._group
        if cpu_group is None and self._is_world and backend == "nccl":
            cpu_group = dist.new_group(backend="gloo")  # NCCL moves device memory only
        # Where CPU tensors' collectives run: the data group itself, but gloo's beside nccl.
        self._cpu = cpu_group if cpu_group is not None else self._group
        self._rank = dist.get_rank(self._group)
        self._size = dist.get_world_size(self._group)
        self._probes = 0
        self._gloo_caller: Optional[_GlooCaller] = None  # made on the first interruptible call
        # Interruptible collectives are started and polled rather than made on the gloo caller's
        # thread (an elastic job's world, whose abandoned calls must need no Python thread).
        self.polls_works = False
        self._abandoned = False  # a call was left running when wait_hook raised

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def process_group(self):
        """The torch.distributed process group of this communicator (e.g. for DDP)."""
        return self._group

    @property
    def size(self) -> int:
        return self._size

    def _global(self, group_rank: int) -> int:
        return group_rank if self._is_world else dist.get_global_rank(self._group, group_rank)

    def _data_group(self, tensor: torch.Tensor):
        """The group that carries ``tensor``'s data collectives: gloo's for CPU tensors under nccl."""
        return self._cpu if tensor.device.type == "cpu" else self._group

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        if self.wait_hook is not None and tensor.is_cuda and self.name == "gloo":
            on_host = tensor.cpu()  # gloo's calls are made on another thread: no stream of this one's
            self.allreduce(on_host, op)
            tensor.copy_(on_host)
            return
        self._allreduce(tensor, op, self._data_group(tensor))

    def allreduce_control(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        self._allreduce(tensor, op, self._control)

    def _allreduce(self, tensor: torch.Tensor, op: ReduceOp, group) -> None:
        if tensor.dtype == torch.bool:
            as_bytes = tensor.to(torch.uint8)
            self._all_reduce(as_bytes, _OPS[_BOOL_OPS[op]], group)
            tensor.copy_(as_bytes.bool())
            return
        if op in (ReduceOp.BAND, ReduceOp.BOR) and tensor.dtype.is_floating_point:
            raise CommError(f"bitwise reduction {op.value} is not defined for {tensor.dtype}")
        if tensor.dtype in _WIDEN:
            wide = tensor.to(_WIDEN[tensor.dtype])
            self._all_reduce(wide, _OPS[op], group)
            tensor.copy_(wide)
            return
        self._all_reduce(tensor, _OPS[op], group)

    def _all_reduce(self, tensor: torch.Tensor, op, group) -> None:
        self._blocking(group, lambda async_op: dist.all_reduce(tensor, op=op, group=group, async_op=async_op))

    def _all_gather(self, parts: List[torch.Tensor], tensor: torch.Tensor, group) -> None:
        self._blocking(group, lambda async_op: dist.all_gather(parts, tensor, group=group, async_op=async_op))

    def _blocking(self, group, call: Callable[[bool], Any]) -> None:
        """Make the collective ``call(async_op)`` on ``group`` and return once it is done: here,
        or interruptibly where a ``wait_hook`` is given and the group is gloo's (started and
        polled where ``polls_works``, else on the gloo caller's thread)."""
        if self.wait_hook is None or not self._gloo_group(group):
            call(False)
        elif self.polls_works:
            self._poll(call(True))
        else:
            self._interruptibly(lambda: call(False))

    def _poll(self, work) -> None:
        """Wait for ``work`` by polling it, calling ``wait_hook`` between polls; raise its error.
        Should the hook raise, the work is abandoned to gloo's own threads, which need no
        Python: a call that ends while the interpreter finalizes cannot abort the process, as
        a Python thread's return into a finalizing interpreter does ("terminate called without
        an active exception")."""
        polls = 0
        while not work.is_completed():
            try:
                self.wait_hook()
            except BaseException:
                self._abandoned = True
                _ABANDONED_WORKS.append(work)
                raise
            polls += 1
            # A collective of small messages ends within microseconds: yield at first, then
            # sleep longer, up to a millisecond, as it goes on.
            time.sleep(0 if polls < _SPINS else min(_POLL_MAX_S, _POLL_STEP_S * (polls - _SPINS)))
        work.wait()  # done: raises the collective's error, if any

    def _gloo_group(self, group) -> bool:
        """Whether ``group`` is one of gloo's: every group under gloo; under nccl, all but the data
        group, whose device tensors' calls only queue work on the caller's stream (the host does
        not wait, so there is nothing to interrupt), and must be made from the caller's thread."""
        return self.name == "gloo" or group is not self._group

    def _interruptibly(self, run: Callable[[], Any]) -> None:
        """Make gloo's blocking calls ``run()`` on the gloo caller's thread, calling ``wait_hook``
        between timed waits for them; raise their error. Should the hook raise, the calls are
        abandoned (their tensors kept alive by the thread that is still in them)."""
        if self._gloo_caller is None:
            self._gloo_caller = _GlooCaller()
        call = self._gloo_caller.call(run)
        while not call.done.acquire(timeout=_HOOK_INTERVAL_S):
            try:
                self.wait_hook()
            except BaseException:
                self._abandoned = True
                raise
        if call.error is not None:
            raise call.error

    background_collectives = True

    def allreduce_start(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> InFlight:
        """Start the allreduce on the backend's own threads (gloo's workers, nccl's stream);
        the conversions of :meth:`_allreduce` (bool, int16) run blocking, and so does every
        allreduce of a communicator with a ``wait_hook`` (a gloo work cannot be waited for
        interruptibly)."""
        if (tensor.dtype == torch.bool or op in (ReduceOp.BAND, ReduceOp.BOR)
                or tensor.dtype in _WIDEN or (self.wait_hook is not None and self._gloo_for(tensor))):
            return super().allreduce_start(tensor, op)
        if not self._gloo_for(tensor):
            # nccl: started and waited for on the engine's stream, which queues what follows
            # behind it on the GPU; the host does not wait (see the module docstring).
            return super().allreduce_start(tensor, op)
        return _WorkInFlight(dist.all_reduce(tensor, op=_OPS[op], group=self._data_group(tensor), async_op=True))

    def _gloo_for(self, tensor: torch.Tensor) -> bool:
        """Whether gloo carries ``tensor``: every tensor under gloo, CPU tensors under nccl."""
        return self.name == "gloo" or tensor.device.type == "cpu"

    def _movable(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype not in _WIDEN

    def allgather(self, tensor: torch.Tensor, first_dims: Optional[Sequence[int]] = None) -> torch.Tensor:
        if tensor.dim() == 0:
            raise CommError("allgather needs a tensor of at least one dimension")
        if self.wait_hook is not None and tensor.is_cuda and self.name == "gloo":
            return self.allgather(tensor.cpu(), first_dims).to(tensor.device)  # as allreduce does
        group = self._control if tensor.device.type == "cpu" else self._group
        if first_dims is None:
            mine = torch.tensor([tensor.shape[0]], dtype=torch.int64)
            dims = [torch.empty_like(mine) for _ in range(self._size)]
            self._all_gather(dims, mine, self._control)
            first_dims = [int(d.item()) for d in dims]
        if not self._movable(tensor):
            gathered = self.allgather(_as_rows_of_bytes(tensor), first_dims)
            return _from_rows_of_bytes(gathered, tensor, sum(first_dims))
        longest = max(first_dims) if first_dims else 0
        send = tensor
        if tensor.shape[0] < longest:  # gloo gathers equal shapes only: pad, then trim
            pad = torch.zeros((longest - tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
            send = torch.cat([tensor, pad])
        parts = [torch.empty_like(send) for _ in range(self._size)]
        self._all_gather(parts, send.contiguous(), group)
        return torch.cat([p[:n] for p, n in zip(parts, first_dims)])

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        if not self._movable(tensor):
            self.broadcast(_as_rows_of_bytes(tensor), root)
            return
        group = self._group if tensor.device.type != "cpu" or self._control is self._group else self._control
        self._blocking(group, lambda async_op: dist.broadcast(tensor, src=self._global(root), group=group,
                                                              async_op=async_op))

    def alltoall(
        self, tensor: torch.Tensor, splits: Sequence[int], recv_splits: Optional[Sequence[int]] = None
    ) -> Tuple[torch.Tensor, List[int]]:
        splits = [int(s) for s in splits]
        if recv_splits is None:
            sent = torch.tensor(splits, dtype=torch.int64)
            received = torch.empty(self._size, dtype=torch.int64)
            self._blocking(self._control, lambda async_op: dist.all_to_all_single(
                received, sent, group=self._control, async_op=async_op))
            recv_splits = received.tolist()
        recv_splits = [int(s) for s in recv_splits]
        if not self._movable(tensor):
            out, _ = self.alltoall(_as_rows_of_bytes(tensor), splits, recv_splits)
            return _from_rows_of_bytes(out, tensor, sum(recv_splits)), recv_splits
        out = torch.empty((sum(recv_splits),) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        group = self._data_group(tensor)
        self._blocking(group, lambda async_op: dist.all_to_all_single(out, tensor, recv_splits, splits, group=group,
                                                                      async_op=async_op))
        return out, recv_splits

    def reduce_scatter(
        self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, counts: Optional[Sequence[int]] = None
    ) -> torch.Tensor:
        counts = list(counts) if counts is not None else even_split(tensor.shape[0], self._size)
        start = sum(counts[: self._rank])
        if not self._gloo_for(tensor) and tensor.dtype != torch.bool and tensor.dtype not in _WIDEN:
            inputs = list(torch.split(tensor, counts))
            out = torch.empty_like(inputs[self._rank])
            dist.reduce_scatter(out, [t.contiguous() for t in inputs], op=_OPS[op], group=self._group)
            return out
        # gloo has no reduce-scatter (nor NCCL one of bool and int16, which _allreduce converts):
        # reduce everything, keep this rank's block.
        reduced = tensor.clone()
        self._allreduce(reduced, op, self._data_group(tensor))
        return reduced[start : start + counts[self._rank]].clone()

    def exchange(self, sends: Sequence[Tuple[int, torch.Tensor]],
                 receives: Sequence[Tuple[int, torch.Tensor]]) -> None:
        # gloo moves host memory only: device tensors travel through host copies. Under nccl,
        # CPU tensors go over the gloo group beside it (one batch takes one group).
        staged = self.name == "gloo"
        tensors = [t for _, t in list(sends) + list(receives)]
        group = self._data_group(tensors[0]) if tensors else self._group
        landing = [(peer, t, t.cpu() if staged and t.is_cuda else t) for peer, t in receives]
        ops = [dist.P2POp(dist.irecv, buf, self._global(peer), group=group) for peer, _t, buf in landing]
        ops += [dist.P2POp(dist.isend, (t.cpu() if staged and t.is_cuda else t).contiguous(), self._global(peer),
                           group=group) for peer, t in sends]
        if ops:
            if self.wait_hook is None or not self._gloo_group(group):
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            else:
                self._interruptibly(lambda: [work.wait() for work in dist.batch_isend_irecv(ops)])
        for _peer, tensor, buf in landing:
            if buf is not tensor:
                tensor.copy_(buf)

    def barrier(self) -> None:
        self._blocking(self._control, lambda async_op: dist.barrier(group=self._control, async_op=async_op))

    def split(self, ranks: Sequence[int]) -> Optional["TorchCommunicator"]:
        # dist.new_group is collective over the whole world: only a group of every rank (the
        # world, or a copy of it) can make sub-groups.
        if not self._is_world and self._size != dist.get_world_size():
            raise CommError("torch.distributed creates sub-groups only from a group of every rank")
        members = sorted(set(int(r) for r in ranks))
        global_members = [self._global(r) for r in members]
        group = dist.new_group(global_members, backend=self.name)
        control = dist.new_group(global_members, backend="gloo")
        cpu = dist.new_group(global_members, backend="gloo") if self.name == "nccl" else None
        # A rank's new_group returns once its own connections are made, while a peer may still
        # be completing its side of them: a rank left out, which closes its world next
        # (init(comm=...)), would cut the connections under that peer ("Connection closed by
        # peer" in gloo's connectFullMesh). Every rank has made every group past this point.
        self.allreduce_control(torch.zeros(1), ReduceOp.SUM)
        if self._rank not in members:
            return None
        return TorchCommunicator(self.name, group=group, control_group=control, cpu_group=cpu)

    def unanswering(self, wait_s: float) -> Optional[List[int]]:
        # The process group is broken after a failure; the rendezvous store (on the first host)
        # still answers: every rank leaves a key, and those whose key has not come are lost.
        # A rank that cannot reach the store cannot tell (None).
        try:
            store = dist.distributed_c10d._get_default_store()
            self._probes += 1
            # Each group its own keys: the engine's world and a spatial group may both check.
            members = "world" if self._is_world else ",".join(str(self._global(r)) for r in range(self._size))
            prefix = f"hpdl/alive/{members}/{self._probes}/"
            store.set_timeout(datetime.timedelta(seconds=max(wait_s, 1.0)))
            store.set(prefix + str(self._global(self._rank)), "1")
            missing = [r for r in range(self._size) if r != self._rank]
            deadline = time.monotonic() + wait_s
            while missing and time.monotonic() < deadline:
                missing = [r for r in missing if not store.check([prefix + str(self._global(r))])]
                time.sleep(0.05)
            return missing
        except Exception:  # the store is out of reach too
            return None

    def close(self) -> None:
        if self._gloo_caller is not None:
            if not self._abandoned:  # else the thread is in the abandoned call: not waited for
                self._gloo_caller.close()
            self._gloo_caller = None
        groups = (self._group, self._control, self._cpu)
        if self._abandoned:
            for group in {id(g): g for g in groups if g is not None}.values():
                _keep_unshut(group)
            self._group = self._control = self._cpu = None
            return
        # The default group outlives this communicator (init_process_group); the groups made
        # for it, the world's control group included, end with it: each holds sockets and
        # threads, which every init()/shutdown() cycle would otherwise add to.
        for group in {id(g): g for g in groups if g is not None and g is not dist.group.WORLD}.values():
            try:
                dist.destroy_process_group(group)
            except Exception:  # the world group may already be gone at shutdown
                pass
        # Drop every reference to the process groups, so that destroying them (for the world
        # group: at interpreter exit, see init_process_group) really frees them, which joins
        # gloo's worker threads while Python still runs. A group kept alive into interpreter
        # finalization lets a worker release its last collective's tensors there: that needs
        # the GIL, which a finalizing interpreter no longer grants (the thread is ended, and
        # C++ aborts: "terminate called without an active exception").
        self._group = self._control = self._cpu = None

    def abort(self, code: int) -> NoReturn:
        if self.name == "nccl":
            try:  # abort the communicators, so no kernel waits on the GPU for a lost peer
                dist.distributed_c10d._abort_process_group()
            except Exception:  # ending anyway
                pass
        # gloo has nothing to abort: its peers see the connection close and fail at once.
        os._exit(code)

    def describe(self) -> str:
        return f"{self.name} (torch.distributed, torch {torch.__version__})"
