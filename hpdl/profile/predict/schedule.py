"""One training step's gradients replayed through the engine's own policy, on a simulated clock.

A data-parallel step, as the engine sees it on one rank: the gradients become ready during
backward (each at its recorded moment, its bytes known), the optimizer then waits for all of
them, and the step ends when the last allreduce has ended and the update has run. Which
allreduces run when, and fused how, is the engine's decision, so it is taken here by the
engine's own code, not a copy of it: the :class:`~hpdl.engine.scheduling.Scheduler` (rounds,
gathering, pacing) on a clock whose time passes only as this simulation says, and
:func:`~hpdl.engine.fusion.plan_fusion` (the fusion threshold, the in-place threshold). A
change to the engine's policy changes the prediction.

What is modelled, and what is not:
- every rank is alike (data parallelism): a round agrees every request pending on this rank,
  since every rank submits the same gradients at about the same moment; a round costs the
  negotiation's time (a small allreduce at the job's scale) before its collectives start, and
  the engine's one thread runs one round at a time: what is submitted meanwhile waits for the
  next round;
- with ``collectives_block`` (MPI among the ranks of one node, where the engine runs each
  allreduce as a blocking call: hpdl/comm/mpi.py) the engine's thread is also busy while each
  collective runs, so the requests made meanwhile gather into the next round; otherwise
  (across nodes, gloo, NCCL) collectives run in the background and rounds go on beside them;
- the backend runs collectives one after another (gloo's and nccl's queues), each taking the
  time the network model gives for its bytes (``allreduce_seconds``);
- compute does not slow down while communication runs (the GPU case); on CPU-bound nodes the
  engine's CPU time would come out of the compute, which this does not count.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Callable, Dict, List, Optional, Tuple

import torch

from hpdl.config import Settings
from hpdl.engine.clock import Clock
from hpdl.engine.fusion import plan_fusion
from hpdl.engine.request import Request, RequestKind, Response
from hpdl.engine.scheduling import Scheduler


@dataclasses.dataclass(frozen=True)
class Gradient:
    """One gradient of a step: its name, bytes, and when backward made it (s from the step's start)."""

    name: str
    nbytes: int
    ready_s: float


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What one step does apart from communication, as recorded (or scaled to another device)."""

    gradients: Tuple[Gradient, ...]
    backward_end_s: float  # when the optimizer starts waiting for the gradients
    update_s: float = 0.0  # the optimizer's update, after the last allreduce ended


@dataclasses.dataclass(frozen=True)
class Collective:
    """An allreduce the engine ran: its members, bytes, and when it started and ended."""

    names: Tuple[str, ...]
    nbytes: int
    start_s: float
    end_s: float


@dataclasses.dataclass(frozen=True)
class StepResult:
    step_s: float  # the whole step
    exposed_s: float  # the time the optimizer waited for communication after backward
    collectives: Tuple[Collective, ...]
    rounds: int


class SimulatedClock(Clock):
    """A clock whose time passes only when the simulation sets it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.monotonic = lambda: self.now  # an instance attribute, as Clock's is a plain function


class _PendingSet:
    """What the scheduler reads of a process set: its pending requests, in arrival order."""

    def __init__(self) -> None:
        self.pending: Dict[str, Request] = {}


def _request(gradient: Gradient, bytes_to_come: int, arrival: float) -> Request:
    # A tensor of the gradient's bytes that holds no memory: the engine's classes read its size,
    # dtype and device only.
    tensor = torch.empty(max(1, gradient.nbytes // 4), dtype=torch.float32, device="meta")
    request = Request(RequestKind.ALLREDUCE, gradient.name, tensor=tensor, bytes_to_come=bytes_to_come)
    request.arrival = arrival
    return request


def simulate_step(shape: StepShape, settings: Settings, allreduce_seconds: Callable[[int], float],
                  negotiation_s: float, stall_check_s: float = 60.0, collectives_block: bool = False) -> StepResult:
    """Replay ``shape``'s gradients through the engine's scheduling and fusion; return when the
    step ends and what ran.

    Args:
        allreduce_seconds: the time of one allreduce of so many bytes at the job's scale.
        negotiation_s: the time of a round's negotiation before its collectives start.
        collectives_block: the engine's thread runs each collective to its end (MPI within a
            node) instead of leaving it to the backend.
    """
    clock = SimulatedClock()
    scheduler = Scheduler(settings, clock)
    process_set = _PendingSet()
    gradients = sorted(shape.gradients, key=lambda g: g.ready_s)
    total = sum(g.nbytes for g in gradients)
    submissions = []  # (time, order, gradient, bytes still to come after it)
    made = 0
    for order, gradient in enumerate(gradients):
        made += gradient.nbytes
        submissions.append((gradient.ready_s, order, gradient, total - made))
    heapq.heapify(submissions)
    collectives: List[Collective] = []
    backend_free = 0.0
    rounds = 0
    round_due: Optional[float] = None  # when the engine thread runs its next round
    engine_free = 0.0  # when the engine thread ends its round (the negotiation, blocking collectives)
    waiting = False  # the optimizer waits (backward ended)

    def run_round(now: float) -> None:
        nonlocal backend_free, rounds, round_due, engine_free
        rounds += 1
        scheduler.end_gathering()
        agreed = list(process_set.pending.values())
        process_set.pending.clear()
        responses = [Response(r.name, r.kind, (r.signature(),)) for r in agreed]
        started = now + negotiation_s
        for batch in plan_fusion(responses, settings.fusion_threshold, settings.inplace_threshold):
            nbytes = sum(r.nbytes for r in batch)
            start = max(started, backend_free)
            end = start + allreduce_seconds(nbytes)
            backend_free = end
            collectives.append(Collective(tuple(r.name for r in batch), nbytes, start, end))
        engine_free = backend_free if collectives_block else started
        scheduler.after_round(hot=False, idle=not process_set.pending)
        round_due = None

    def want_round(now: float) -> None:
        """The engine thread wakes: gather if the policy says so, else run a round now."""
        nonlocal round_due
        until = scheduler.gather_until([process_set], backlogged=False, shutting_down=False,
                                       stall_check_s=stall_check_s)
        round_due = max(engine_free, now if until is None else until)

    while submissions or process_set.pending:
        next_submission = submissions[0][0] if submissions else None
        wait_at = shape.backward_end_s if not waiting else None
        candidates = [t for t in (next_submission, round_due, wait_at) if t is not None]
        if not candidates:  # requests pending, no round due: the engine's pause brings one
            round_due = max(engine_free, clock.now + scheduler.cycle_s)
            continue
        clock.now = now = max(clock.now, min(candidates))
        if next_submission is not None and next_submission <= now:  # submissions first at a tie
            _, _, gradient, to_come = heapq.heappop(submissions)
            request = _request(gradient, to_come, now)
            process_set.pending[request.name] = request
            if scheduler.round_for_submission(request):
                want_round(now)
        elif wait_at is not None and wait_at <= now:
            waiting = True  # the optimizer waits: a gathering is cut short
            if process_set.pending and scheduler.round_for_waiter(None):
                round_due = max(engine_free, now)
        elif round_due is not None and round_due <= now:
            run_round(now)
    end_of_communication = max((c.end_s for c in collectives), default=0.0)
    exposed = max(0.0, end_of_communication - shape.backward_end_s)
    step = max(shape.backward_end_s, end_of_communication) + shape.update_s
    return StepResult(step, exposed, tuple(collectives), rounds)

