"""``hvd.elastic``: Horovod's elastic training API.

Horovod's elastic scripts keep their training state in a ``State`` (``TorchState(model,
optimizer, epoch=0, ...)``), wrap their training function in ``@hvd.elastic.run``, call
``state.commit()`` every few batches, and read their data through an ``ElasticSampler`` that
records what each batch consumed.

In an elastic job (`hpdl run --min-np ...`, docs/elastic.md) workers leave and join while it
runs, with Horovod's semantics: a worker that fails makes every survivor's next collective
raise ``HorovodInternalError``; ``run`` then restores the last commit, shuts hpdl down and
initializes it again, which joins the driver's next generation of the world (the survivors,
oldest first, so rank 0 is one of them), calls the reset callbacks and sends rank 0's state
to every rank. Hosts added or removed by the driver make ``commit()`` raise
``HostsUpdatedInterrupt`` on every rank at the same commit: the same reset, without the
rollback, and without the sync when hosts were only removed. A worker the new world leaves
out (its host removed) ends with status 0.

In a job whose ranks are fixed (any other launcher), ``run`` sends rank 0's state to every
rank before the function starts, ``commit`` / ``restore`` keep and bring back a copy in
memory, and a lost rank ends the whole job (docs/api.md, "A failed job ends"): ``run`` restores
the last commit before the error propagates, so a handler in the script (saving a checkpoint,
say) sees the committed state rather than a half-finished batch.

Under torchrun's own elastic agent (``torchrun --nnodes=1:2 --rdzv-backend=c10d
--max-restarts K``), which restarts every worker process on a failure or a change of nodes,
``commit()`` also keeps the state on disk (local rank 0 of each node, atomically, under
``<temp dir>/hpdl-elastic-<run id>/``), and ``run`` first loads the newest commit any node kept
into every rank (``snapshot``; docs/elastic.md, "Under torchrun's elastic agent"), so the
restarted job goes on from its last commit; the files go when the function returns.
``HPDL_ELASTIC_SNAPSHOT=0`` turns this off; nothing is written under any other launcher.

Where a rank is lost, the launchers that let the survivors live a little end them with
SIGTERM at once (torchrun, srun, Open MPI's mpiexec; SIGKILL follows 30 s, KillWait or 1 s
later), often before the survivors' collectives have failed. So while the function runs, SIGTERM (unless
the script handles it itself) fails the engine as a lost peer would: the survivors' collectives
raise ``HorovodInternalError`` and the handler runs. MPICH's mpiexec ends them with SIGKILL,
which nothing can catch.

The modules follow Horovod's layout: ``state`` (TorchState and its handlers, whose registry a
script may extend), ``sampler`` (ElasticSampler); State and ObjectState are Horovod's
``horovod.common.elastic`` ones (``common``); ``snapshot`` keeps commits on disk under torchrun's
agent.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterator, List

from hpdl.engine import HorovodInternalError
from hpdl.torch.elastic.common import HostsUpdatedInterrupt, ObjectState, State, forget_snapshot, resume_from_snapshot
from hpdl.torch.elastic.sampler import ElasticSampler
from hpdl.torch.elastic.state import TorchState
from hpdl.comm.rendezvous import NotInWorld
from hpdl.torch import membership
from hpdl.torch.runtime import engine, init, is_initialized, shutdown

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func(state, ...)`` from rank 0's state, as Horovod's ``hvd.elastic.run``.

    Every rank first receives rank 0's state (``state.sync()``), so all start from the same
    point. In an elastic job, a failed collective (``HorovodInternalError``) restores the last
    commit and a ``HostsUpdatedInterrupt`` keeps the state as it is; either way the world is
    formed again (``hvd.shutdown()``, ``hvd.init()``), the reset callbacks run, and the state is
    synced again (unless the interrupt says ``skip_sync``) before the function starts again.
    Where the ranks are fixed, a failed collective restores the last commit and propagates,
    and an interrupt the script raised starts the function again on the same ranks. Under
    torchrun's elastic agent, the first sync is preceded by loading the newest commit kept on
    disk by the job's earlier workers, if any (see the module's docstring).
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        with _sigterm_fails_the_collectives():
            # Under torchrun's elastic agent: the last commit of this job's earlier workers.
            resume_from_snapshot(state, f"{func.__module__}.{func.__qualname__}")
            skip_sync = False
            while True:
                try:
                    if not skip_sync:  # a worker lost during the sync is a failure like any other
                        state.sync()
                    result = func(state, *args, **kwargs)
                except HorovodInternalError:
                    state.restore()
                    if membership.current() is None:
                        raise
                    skip_sync = False
                except HostsUpdatedInterrupt as interrupt:
                    skip_sync = interrupt.skip_sync
                else:
                    forget_snapshot(state)
                    member = membership.current()
                    if member is not None:
                        member.leave()
                    return result
                _form_the_world_again()
                state.on_reset()

    return wrapper


def _form_the_world_again() -> None:
    """Leave this world and join the elastic driver's next one (where the ranks are fixed, the
    same one stays). A worker the next world leaves out ends here, with status 0."""
    if membership.current() is None:
        return
    shutdown()
    try:
        init()
    except NotInWorld:
        sys.stderr.write(f"hpdl: worker {membership.current().worker} is not in the job's new world (its host was "
                         "removed); it ends\n")
        sys.stderr.flush()
        raise SystemExit(0) from None


# What the collectives raise once SIGTERM has come during ``run``.
SIGTERM_REASON = "the launcher is ending the job (SIGTERM): a rank was lost, or the job was stopped"


@contextlib.contextmanager
def _sigterm_fails_the_collectives() -> Iterator[None]:
    """While the body runs, SIGTERM fails the engine as a lost peer would (see the module
    docstring); SIGTERM keeps its handler where the script set one, or where this is not the
    main thread (which alone may set handlers)."""
    # In an elastic job SIGTERM comes from the driver, which is ending this worker: it ends.
    if threading.current_thread() is not threading.main_thread() or membership.current() is not None or \
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
