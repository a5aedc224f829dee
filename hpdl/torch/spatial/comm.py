"""A spatial group's own communicator: the halo exchanges and the group's few collectives.

Every spatial group gets a communicator of its own, apart from the engine's: the engine's
collectives run on its background thread while the training thread (or autograd's, in
backward) exchanges halos, and two threads must never issue collectives on one communicator
(MPI would interleave them, gloo might pair them differently on each rank). It is split from
the world on the engine thread, the only thread that may use the world communicator, in the
same order on every rank. Each exchange and collective is timed and reported to the running
engine's event bus (kind ``halo`` or ``spatial``), so that ``hpdl profile`` and the timeline
show it.

The engine's failure and stall detection does not see these waits, so they watch for
themselves: between its polls each one checks whether the engine still runs (a peer that
raised and exited, or called ``hvd.shutdown()``, stops every rank's engine; a lost one fails it)
and how long it has waited (``HPDL_STALL_TIMEOUT``). Then it ends the whole job
(``Engine.end_job``: without it, this rank's exit would wait for the peer in ``MPI_Finalize``,
its transfers still under way) and raises one line naming this rank, the layer and its peers,
and the cause. docs/spatial.md, "How it works", gives the bounds.

A measuring tool: with ``communicating`` off, nothing is sent or received (received strips are
zeros, a sum is this rank's alone, a gather holds this rank's values in its place and zeros
elsewhere), so that each rank computes its band alone, as fast as it can: the bound that
``hpdl bench spatial`` measures the real steps against (``SpatialParallel.no_communication``).
"""

from __future__ import annotations

import itertools
import time
from typing import List, NoReturn, Optional, Sequence, Tuple

import torch

from hpdl.comm.base import Communicator, ReduceOp
from hpdl.engine import abort
from hpdl.engine import events as ev
from hpdl.engine.blocked import BLOCKED, Wait
from hpdl.engine.errors import HorovodInternalError
from hpdl.engine.request import Request, RequestKind
from hpdl.torch import runtime
from hpdl.torch.object_ops import allgather_object
from hpdl.torch.process_sets import ProcessSet
from hpdl.torch.spatial.errors import GroupCommError, report_in_one_line
from hpdl.torch.spatial.geometry import SpatialError

HALO = ev.HALO  # event kind of a halo exchange
SPATIAL = ev.SPATIAL  # event kind of a spatial group's collective (BatchNorm statistics, global pooling, gather)

_splits = itertools.count()  # names of the split requests: every rank makes the same calls

# After the engine has stopped, how long a transfer may still complete: a peer that finished its
# side of the last exchange and then shut down has sent what this rank still receives.
_STOP_GRACE_S = 0.1
# After the backend's error (a peer's connection closed), how long to wait for the engine to say
# why: a peer that shuts down (or exits through Python) closes its group's connections first,
# and its engine stops every rank's in the round after (within the idle engine's pause).
_VERDICT_WAIT_S = 1.0
# After a stall or an unexplained error, how long the ranks of the group listen for each other,
# to name the ones lost (within the abort's grace period, which runs meanwhile).
_LIVENESS_WAIT_S = 1.0
_STALLED = "has not completed in {limit:g} s (HPDL_STALL_TIMEOUT): a rank has died, is stuck, or runs a different step"


Transfers = Sequence[Tuple[int, torch.Tensor]]  # (group rank of the peer, tensor)


class _Waiting:
    """What a call of the group is waiting for, for the messages of its failure."""

    __slots__ = ("operation", "label", "sends", "receives", "since", "stopped_at", "blocked")

    def __init__(self, operation: str, label: str, since: float, sends: Transfers = (), receives: Transfers = ()):
        self.operation = operation  # "halo exchange", "allreduce" or "allgather"
        self.label = label
        self.since = since
        self.sends = sends  # an exchange's (peer, tensor) pairs
        self.receives = receives
        self.stopped_at: Optional[float] = None  # when the wait first found the engine stopped
        self.blocked: Optional[int] = None  # its key in BLOCKED, once it has had to wait


def refuse_graph_in_backward(label: str) -> None:
    """Refuse a backward that builds a graph (``create_graph=True``: a gradient penalty, a
    Hessian-vector product) through a spatial layer whose backward communicates (a halo
    exchange, a group's sum): autograd would differentiate the backward as this rank's own
    arithmetic, without the peers' share, and give silently wrong second-order gradients.
    Every rank reaches the same layer's backward first, so every rank refuses alike."""
    if torch.is_grad_enabled():
        raise SpatialError(f"layer {label}: a backward that builds a graph (create_graph=True, as a gradient penalty "
                           "or a Hessian-vector product needs) is not supported through a spatial layer, whose "
                           "backward exchanges with the other ranks; compute such terms outside SpatialParallel")


class GroupComm:
    """The communicator of one spatial group, for the thread that runs the model.

    No wait of the group's outlives the job's ability to go on: between its polls each one checks
    whether the engine still runs (a peer that shut down, exited or failed stops it) and how long
    it has waited; then it ends the whole job (``Engine.end_job``) and raises, in one line, what
    it was doing, with whom, and why (:class:`~hpdl.torch.spatial.errors.GroupCommError`, a
    ``HorovodInternalError``). The group is unusable afterwards.
    """

    def __init__(self, comm: Communicator, process_set_id: int, world_ranks: Sequence[int], stall_timeout_s: float,
                 serial: int = 0):
        """``serial``: the group's number among those made, the same on each of its ranks."""
        self.comm = comm
        self.process_set_id = process_set_id
        self.rank = comm.rank
        self.size = comm.size
        self.world_ranks = tuple(world_ranks)  # of the group's ranks, in group rank order
        self.stall_timeout_s = stall_timeout_s
        self._world_rank = self.world_ranks[self.rank]
        # Its calls, counted for the engine's search for waits that can never end
        # (hpdl/engine/blocked.py): a call's number is the count before it, the same on every
        # rank (each makes every call, one with nothing to send too); BLOCKED.completed says how
        # many this rank has completed (less one, until the next, after one with nothing to send).
        self._key = (serial, self.world_ranks)
        self._calls = 0
        self.communicating = True  # off: a measuring tool, see the module's docstring
        self._waiting: Optional[_Waiting] = None
        self._unusable: Optional[str] = None  # why every call raises: the group is closed, or a wait failed
        self._abandoned = False  # a wait failed with transfers under way
        self._closed = False
        comm.wait_hook = self._between_polls
        report_in_one_line()

    def exchange(self, sends: Transfers, receives: Transfers, label: str) -> None:
        """Send and receive halo rows with the neighbours (group ranks), reported as one ``halo`` event."""
        self._calls += 1
        if not sends and not receives:
            return
        self._check_usable()
        if not self.communicating:
            for _, strip in receives:
                strip.zero_()
            return
        start = time.perf_counter()
        self._waiting = _Waiting("halo exchange", label, start, sends, receives)
        try:
            self.comm.exchange(sends, receives)
        except HorovodInternalError:
            raise  # the wait gave up (_give_up): its line
        except Exception as err:  # noqa: BLE001 - becomes the one line naming the layer and the cause
            self._failed(err)
        finally:
            self._done()
        self._report(HALO, label, start, "SENDRECV", [t for _, t in sends] + [t for _, t in receives])

    def allreduce_sum(self, tensor: torch.Tensor, label: str) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place (contiguous); returns it."""
        self._calls += 1
        self._check_usable()
        if not self.communicating:
            return tensor
        start = time.perf_counter()
        self._waiting = _Waiting("allreduce", label, start)
        try:
            self.comm.allreduce(tensor, ReduceOp.SUM)
        except HorovodInternalError:
            raise  # the wait gave up (_give_up): its line
        except Exception as err:  # noqa: BLE001
            self._failed(err)
        finally:
            self._done()
        self._report(SPATIAL, label, start, "ALLREDUCE", [tensor])
        return tensor

    def allgather(self, tensor: torch.Tensor, first_dims: Optional[Sequence[int]], label: str) -> torch.Tensor:
        """Every member's ``tensor`` concatenated along dim 0, in group rank order."""
        self._calls += 1
        self._check_usable()
        if not self.communicating:
            return self._alone(tensor, first_dims)
        start = time.perf_counter()
        self._waiting = _Waiting("allgather", label, start)
        try:
            out = self.comm.allgather(tensor.contiguous(), first_dims)
        except HorovodInternalError:
            raise  # the wait gave up (_give_up): its line
        except Exception as err:  # noqa: BLE001
            self._failed(err)
        finally:
            self._done()
        self._report(SPATIAL, label, start, "ALLGATHER", [tensor])
        return out

    def _done(self) -> None:
        """The call's wait is over (completed or given up)."""
        waiting, self._waiting = self._waiting, None
        if waiting is not None and waiting.blocked is not None:
            BLOCKED.end(waiting.blocked)
        BLOCKED.completed[self._key] = self._calls

    def _alone(self, tensor: torch.Tensor, first_dims: Optional[Sequence[int]]) -> torch.Tensor:
        """What a gather holds without communication: this rank's rows in their place, zeros elsewhere."""
        dims = list(first_dims) if first_dims is not None else [tensor.shape[0]] * self.size
        out = tensor.new_zeros((sum(dims),) + tuple(tensor.shape[1:]))
        out.narrow(0, sum(dims[:self.rank]), dims[self.rank]).copy_(tensor)
        return out

    def _report(self, kind: str, label: str, start: float, op: str, tensors: List[torch.Tensor]) -> None:
        # The running engine's bus, read now: an engine's bus ends with it (hvd.shutdown(), hvd.init()).
        try:
            bus = runtime.engine().bus
        except ValueError:  # hpdl is not initialized (any more): no one to report to
            return
        if not bus.active:
            return
        elapsed_us = (time.perf_counter() - start) * 1e6
        sizes = tuple(t.numel() * t.element_size() for t in tensors)
        bus.emit(ev.Event(ev.COLLECTIVE, kind, (label,), ev.now_us() - elapsed_us, elapsed_us,
                          nbytes=sum(sizes), op=op, rank=self._world_rank,
                          process_set_id=self.process_set_id, sizes=sizes,
                          dtype=str(tensors[0].dtype).replace("torch.", "") if tensors else "",
                          backend=self.comm.name))

    # -- failures --------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._unusable is not None:
            raise GroupCommError(self._unusable)

    def _between_polls(self) -> None:
        """The communicator's ``wait_hook``: give up the wait when the engine has stopped (after
        :data:`_STOP_GRACE_S`, for a transfer whose last bytes are on their way) or when it has
        lasted the stall timeout."""
        waiting = self._waiting
        if waiting is None:
            return
        if waiting.blocked is None:  # it has to wait: tell the engine what for (blocked.py)
            peers = {p for p, _ in waiting.sends} | {p for p, _ in waiting.receives}  # an exchange's; else all
            needs = tuple(r for i, r in enumerate(self.world_ranks) if i != self.rank and (not peers or i in peers))
            waiting.blocked = BLOCKED.begin(Wait(self._waiting_text(waiting).__str__, BLOCKED.submissions,
                                                 needs=needs, call=(self._key, self._calls - 1)))
        now = time.perf_counter()
        reason = _engine_stop_reason()
        if reason is not None:
            if waiting.stopped_at is None:
                waiting.stopped_at = now
            elif now - waiting.stopped_at > _STOP_GRACE_S:
                self._give_up(waiting, f"cannot complete: {reason}")
        if now - waiting.since > self.stall_timeout_s:
            self._give_up(waiting, _STALLED.format(limit=self.stall_timeout_s), name_lost=True)

    def _failed(self, err: Exception) -> NoReturn:
        """The backend raised in a call of the group (a peer's connection closed, gloo's own
        timeout): end the job and raise the one line, with the engine's reason where it has one."""
        waiting = self._waiting
        if _engine_stop_reason() is None and time.perf_counter() - waiting.since >= self.stall_timeout_s:
            self._give_up(waiting, _STALLED.format(limit=self.stall_timeout_s), name_lost=True)
        deadline = time.perf_counter() + _VERDICT_WAIT_S
        reason = _engine_stop_reason()
        while reason is None and time.perf_counter() < deadline:
            time.sleep(0.01)
            reason = _engine_stop_reason()
        if reason is not None:
            self._give_up(waiting, f"cannot complete: {reason}")
        first_line = (str(err).strip().splitlines() or [""])[0]
        self._give_up(waiting, f"failed: {type(err).__name__}: {first_line}", name_lost=True)

    def _give_up(self, waiting: _Waiting, outcome: str, name_lost: bool = False) -> NoReturn:
        """End the job (every rank ends within the abort's grace period) and raise the one line."""
        reason = f"{self._waiting_text(waiting)} {outcome}"
        self._unusable = message = f"hpdl: rank {self._world_rank}: {reason}"
        self._abandoned = True
        try:
            runtime.engine().end_job(reason)
        except ValueError:  # hpdl was shut down on this rank meanwhile: the job must end all the same
            abort.arm(self.comm, self._world_rank, reason, stalled=False)
        if name_lost:  # after the end is armed: the grace period runs meanwhile
            self._unusable = message = message + self._lost()
        raise GroupCommError(message) from None  # the backend's error, if any, is in the line

    def _waiting_text(self, waiting: _Waiting) -> str:
        """What the call was doing, e.g. ``the halo exchange of layer body.0 with group rank 0 (world rank 0)``."""
        phase = " in backward" if _in_backward() else ""
        if waiting.sends or waiting.receives:
            peers = sorted({peer for peer, _ in waiting.sends} | {peer for peer, _ in waiting.receives})
            return f"the {waiting.operation} of layer {waiting.label}{phase} with {self._ranks_text(peers)}"
        return (f"the spatial group's {waiting.operation} of {waiting.label}{phase} "
                f"(world ranks {', '.join(str(r) for r in self.world_ranks)})")

    def _ranks_text(self, group_ranks: Sequence[int]) -> str:
        plural = "s" if len(group_ranks) != 1 else ""
        return (f"group rank{plural} {', '.join(str(r) for r in group_ranks)} "
                f"(world rank{plural} {', '.join(str(self.world_ranks[r]) for r in group_ranks)})")

    def _lost(self) -> str:
        """The group's ranks that do not answer a liveness check, as words for the message."""
        try:
            lost = self.comm.unanswering(_LIVENESS_WAIT_S)
        except Exception:  # noqa: BLE001 - the failure is reported all the same
            return ""
        if not lost:
            return ""
        names = ", ".join(str(self.world_ranks[r]) for r in lost)
        return f" (lost: rank {names} does not answer)" if len(lost) == 1 else f" (lost: ranks {names} do not answer)"

    def close(self) -> None:
        """Release the group's communicator. Idempotent, and safe after ``hvd.shutdown()``; every
        later call of the group raises."""
        if self._closed:
            return
        self._closed = True
        self.comm.wait_hook = None
        if self._unusable is None:
            self._unusable = f"hpdl: rank {self._world_rank}: this spatial group's communicator has been closed"
        if self._abandoned:
            # Transfers under way may still use the communicator's buffers and threads; the job
            # is ending (its end is armed), and they end with the process.
            return
        self.comm.close()


def _engine_stop_reason() -> Optional[str]:
    """Why the running engine no longer runs (a peer shut down, exited or failed), or None while it runs."""
    try:
        engine = runtime.engine()
    except ValueError:
        return "hpdl has been shut down on this rank (hvd.shutdown())"
    return engine.stop_reason


def _in_backward() -> bool:
    """Whether autograd's backward is running this call (the exchange of a layer's backward)."""
    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError:  # a torch without it: the message says nothing of it
        return False


def group_communicator(process_set: ProcessSet) -> GroupComm:
    """Make the communicator of this rank's spatial group ``process_set``.

    Collective over every rank of the job: each passes its own group. The groups must not
    overlap. Every group is split, in the same order on every rank, each rank keeping its own.
    """
    ranks = process_set.ranks
    if not ranks or process_set.rank() is None:
        raise SpatialError(f"rank {runtime.rank()} is not a member of its spatial process set {process_set}")
    groups = sorted(set(tuple(g) for g in allgather_object(tuple(ranks), name="spatial.groups")))
    seen = {}
    for group in groups:
        for r in group:
            if r in seen:
                raise SpatialError(f"rank {r} is in two spatial groups, {list(seen[r])} and {list(group)}: "
                                   "every rank belongs to one group")
            seen[r] = group
    engine = runtime.engine()
    call = next(_splits)
    mine, my_group = None, ()
    for index, group in enumerate(groups):
        request = Request(RequestKind.SPLIT_COMMUNICATOR, f"spatial.split.{call}.{index}", ranks=group)
        comm = engine.submit(request).wait()
        if comm is not None:
            mine, my_group = comm, sorted(group)  # the split's ranks, in the order of their group ranks
    set_id = process_set.process_set_id if process_set.process_set_id is not None else 0
    return GroupComm(mine, set_id, my_group, engine.settings.stall_timeout_s, serial=call)
