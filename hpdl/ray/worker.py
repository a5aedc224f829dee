"""One rank of a ``RayExecutor``: a Ray actor, a process of its own for the executor's life.

The driver asks where it runs (its Ray node, address and GPUs), gives it torchrun's variables
for its place, and calls functions in it. A function that raises is answered with a
:class:`Failure` instead of Ray's wrapped exception, after hpdl (if the function started it)
is shut down on this rank, so that the other ranks' collectives end at once with hpdl's own
error rather than waiting for a peer that will never come.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import traceback
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class Failure:
    """What a rank's function raised: its type, message and traceback, and whether it is hpdl's
    error for a job another rank ended (a consequence, not the cause)."""

    type_name: str
    message: str
    traceback: str
    consequence: bool


def _end_hpdl() -> None:
    """Shut hpdl down on this rank if the function left it running: the others' collectives
    then raise at once (hpdl tells every rank that one shut down)."""
    try:
        import hpdl.torch as hvd

        if hvd.is_initialized():
            hvd.shutdown()
    except Exception:  # noqa: BLE001 - the function's own error is the one to report
        pass


def call(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Tuple[bool, Any]:
    """``(True, fn(*args, **kwargs))``, or ``(False, Failure)`` if it raised."""
    try:
        return True, fn(*args, **kwargs)
    except SystemExit as err:
        if err.code in (None, 0):  # ended as a process ends well (an elastic worker left out of the world)
            _end_hpdl()
            return True, None
        return _failed(err)
    except BaseException as err:  # noqa: BLE001 - every failure goes back to the driver
        return _failed(err)


def _failed(err: BaseException) -> Tuple[bool, Failure]:
    """``(False, Failure)`` for what ``err`` says, once hpdl is shut down on this rank (called
    while ``err`` is being handled, for its traceback)."""
    from hpdl.engine import HorovodInternalError

    failure = Failure(type(err).__name__, str(err).strip().splitlines()[0] if str(err).strip() else "",
                      traceback.format_exc(), isinstance(err, HorovodInternalError))
    _end_hpdl()
    return False, failure


class RankWorker:
    """The actor's class (made remote by the executor, with its resources and placement)."""

    def __init__(self) -> None:
        self.state: Any = None

    def where(self) -> Dict[str, Any]:
        """The Ray node this actor runs on, its address, and the GPUs Ray gave it."""
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "address": ray.util.get_node_ip_address(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def free_port(self, address: str) -> int:
        """A port free on ``address`` now, for the ranks to meet at (rank 0's)."""
        with socket.socket() as s:
            s.bind((address, 0))
            return s.getsockname()[1]

    def configure(self, env: Mapping[str, str]) -> None:
        """Set this rank's variables (its place, the driver's settings, the user's)."""
        os.environ.update(env)

    def start_state(self, cls: Optional[type], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Tuple[bool, Any]:
        """Make the object ``execute`` passes to its functions (Horovod's ``executable_cls``)."""
        if cls is None:
            return True, None
        done, value = call(cls, args, kwargs)
        if done:
            self.state = value
        return done, None if done else value

    def execute(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Tuple[bool, Any]:
        """Run ``fn(*args, **kwargs)`` here."""
        return call(fn, args, kwargs)

    def execute_on_state(self, fn: Callable[[Any], Any]) -> Tuple[bool, Any]:
        """Run ``fn(state)`` here."""
        return call(fn, (self.state,), {})
