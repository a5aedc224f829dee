"""``hvd.elastic``: Horovod's elastic training API, for a job whose ranks stay the same.

Horovod's elastic scripts keep their training state in a ``State`` (``TorchState(model,
optimizer, epoch=0, ...)``), wrap their training function in ``@hvd.elastic.run``, call
``state.commit()`` every few batches, and read their data through an ``ElasticSampler`` that
records what each batch consumed. Under Horovod's elastic driver (``horovodrun --min-np``),
ranks may then leave or join: the survivors restore the last committed state, the world is
formed again, and rank 0's state is sent to every rank.

hpdl runs these scripts unchanged, with the ranks its launcher started: ``run`` sends rank 0's
state to every rank before the function starts (so every rank begins from the same model,
optimizer, sampler position and counters), ``commit`` / ``restore`` keep and bring back a copy
in memory, and the sampler partitions the epoch's remaining indices over the ranks as Horovod's
does. What it does not do is change the set of ranks: no driver discovers hosts, so hpdl never
raises ``HostsUpdatedInterrupt`` (a script may), and a lost rank ends the whole job as without
elastic (docs/api.md, "A failed job ends"). ``run`` then restores the last committed state
before the error propagates, so a handler in the script (saving a checkpoint, say) sees the
committed state rather than a half-finished batch. The launcher's elastic options stay refused.

Where a rank is lost, the launchers that let the survivors live a little end them with
SIGTERM at once (torchrun, srun, Open MPI's mpiexec; SIGKILL follows 30 s, KillWait or 1 s
later), often before the survivors' collectives have failed. So while the function runs, SIGTERM (unless
the script handles it itself) fails the engine as a lost peer would: the survivors' collectives
raise ``HorovodInternalError`` and the handler runs. MPICH's mpiexec ends them with SIGKILL,
which nothing can catch.

The modules follow Horovod's layout: ``state`` (TorchState and its handlers, whose registry a
script may extend), ``sampler`` (ElasticSampler); State and ObjectState are Horovod's
``horovod.common.elastic`` ones (``common``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
from typing import Any, Callable, Iterator, List

from hpdl.engine import HorovodInternalError
from hpdl.torch.elastic.common import HostsUpdatedInterrupt, ObjectState, State
from hpdl.torch.elastic.sampler import ElasticSampler
from hpdl.torch.elastic.state import TorchState
from hpdl.torch.runtime import engine, is_initialized

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func(state, ...)`` from rank 0's state, as Horovod's ``hvd.elastic.run``.

    Every rank first receives rank 0's state (``state.sync()``), so all start from the same
    point. A ``HostsUpdatedInterrupt`` raised by the function (Horovod's driver raises it from
    ``commit``; here only the script can) starts it again as in Horovod: the reset callbacks
    run, then the state is synced again unless the interrupt says ``skip_sync``. The ranks
    never change here: when a collective fails (a rank or node lost, or SIGTERM while it
    runs), the last committed state is restored and the error propagates, and the job ends as
    any failed hpdl job does.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        with _sigterm_fails_the_collectives():
            skip_sync = False
            while True:
                if not skip_sync:
                    state.sync()
                try:
                    return func(state, *args, **kwargs)
                except HorovodInternalError:
                    state.restore()
                    raise
                except HostsUpdatedInterrupt as interrupt:
                    skip_sync = interrupt.skip_sync
                state.on_reset()

    return wrapper


# What the collectives raise once SIGTERM has come during ``run``.
SIGTERM_REASON = "the launcher is ending the job (SIGTERM): a rank was lost, or the job was stopped"


@contextlib.contextmanager
def _sigterm_fails_the_collectives() -> Iterator[None]:
    """While the body runs, SIGTERM fails the engine as a lost peer would (see the module
    docstring); SIGTERM keeps its handler where the script set one, or where this is not the
    main thread (which alone may set handlers)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    _sigterms.clear()
    signal.signal(signal.SIGTERM, _end_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


_sigterms: List[int] = []  # the SIGTERMs received while run's function runs


def _end_on_sigterm(signum: int, _frame: Any) -> None:
    # A second one (srun signals both hpdl run's rank parent and the rank, which then passes
    # the first on) may interrupt the first's handler: it returns at once, before taking any
    # lock the first may hold.
    if _sigterms:
        return
    _sigterms.append(signum)
    if is_initialized() and engine().request_end(SIGTERM_REASON):
        return
    # No engine to fail: end as SIGTERM ends a process by default.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
