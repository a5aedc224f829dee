"""The runtime of ``hpdl.torch``: init/shutdown, topology queries, build queries.

One :class:`_State` holds everything that ``init()`` creates (settings, topology, the world
communicator and the engine); ``shutdown()`` releases it so that ``init()`` can run again.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import enum
import logging
import os
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List, NoReturn, Optional, Sequence, Union

import torch

from hpdl import rank_exit
from hpdl.comm import Communicator, Topology, choose_backend, create_world, discover_topology
from hpdl.comm.devices import check_gpu_index, gpu_index, ranks_share_gpus
from hpdl.comm.topology import WorldSizeError, check_world_size
from hpdl.comm.mpi import MPI, mpi_available
from hpdl.config import Settings, horovod_variables_ignored, settings_given
from hpdl.engine import Engine, abort
from hpdl.engine.autotune import Autotuner
from hpdl.engine import events as ev
from hpdl.torch import membership
from hpdl.torch import process_sets as _process_sets

log = logging.getLogger("hpdl")


@dataclasses.dataclass
class _State:
    settings: Settings
    topology: Topology
    comm: Communicator
    engine: Engine
    homogeneous: bool
    # With init(comm=[ranks]): the job's communicator ``comm`` was split from, closed after it.
    parent: Optional[Communicator] = None


_state: Optional[_State] = None
_lock = threading.Lock()
_atexit_registered = False


class ShutdownStage(enum.IntEnum):
    """When a shutdown hook runs: every hook of a stage, in the order they were added, before
    any hook of the next stage; all of them while the engine still runs."""

    # The job's own collectives still in flight, which the peers take part in: overlap_forward's
    # last updates, the allreduces of optimizers gone with their model.
    FINISH_WORK = 0
    # Observers that gather and write what they recorded (the profile): after the job's own
    # collectives, so that the record holds them and its gather does not wait behind them.
    WRITE_RECORDS = 1
    # What holds communicators of its own split from the job's (spatial groups): released last,
    # after the records that may include its traffic.
    RELEASE = 2


class ShutdownError(RuntimeError):
    """What a shutdown hook could not do (the profile's last write), raised by shutdown() once
    hpdl has stopped all the same: the job must fail, naming what was lost.

    A hook raises it with its own message; any other exception of a hook becomes one too.
    """


_shutdown_hooks: Dict[ShutdownStage, List[Callable[[], None]]] = {stage: [] for stage in ShutdownStage}


def add_shutdown_hook(hook: Callable[[], None], stage: ShutdownStage) -> None:
    """Call ``hook()`` at each shutdown() of this process, in ``stage``'s turn, before the engine stops.

    A hook added again keeps its place. Every rank's hooks run at its own shutdown(); a hook
    that submits collectives must be added on every rank.
    """
    if not any(hook in hooks for hooks in _shutdown_hooks.values()):
        _shutdown_hooks[stage].append(hook)


def remove_shutdown_hook(hook: Callable[[], None]) -> None:
    """Stop calling ``hook`` at shutdown (nothing when it was not added)."""
    for hooks in _shutdown_hooks.values():
        if hook in hooks:
            hooks.remove(hook)


_startup_hooks: List[Callable[[], None]] = []


def add_startup_hook(hook: Callable[[], None]) -> None:
    """Call ``hook()`` at the end of each init() of this process, once the engine runs and the
    process sets given to init() are registered; hooks run in the order they were added.

    What starts with hpdl without this module importing it registers here (the profiler, for
    ``HPDL_PROFILE``), as what stops with it adds a shutdown hook. A hook added again keeps its
    place. Every rank's hooks run at its own init(); a hook that submits collectives must be
    added on every rank. An exception of a hook is raised by init(), hpdl staying initialized.
    """
    if hook not in _startup_hooks:
        _startup_hooks.append(hook)


def _require() -> _State:
    if _state is None:
        raise ValueError("hpdl has not been initialized; use hvd.init().")
    return _state


def init(comm: Union[None, Sequence[int], Any] = None, process_sets: Union[None, str, Sequence[Any]] = None,
         backend: Optional[str] = None) -> None:
    """Start hpdl on this process: discover the job, connect the backend, start the engine.

    Every rank of the job calls it. It reads the settings (``HPDL_*`` variables, Horovod's aliases)
    once, forms the world from what the launcher announced (``mpiexec``, ``srun``, ``torchrun``,
    ``hpdl run``), checks its size against the launcher's, and starts the engine thread that
    negotiates and runs every collective. A second call while initialized does nothing, as in
    Horovod; after ``shutdown()`` it starts hpdl again.

    Args:
        comm: None (every rank of the job), a list of ranks to run on (every process of the job
            must call init with the same list; the ranks outside it raise), or an mpi4py
            communicator (used as it is: its size is not checked against the launcher's).
        process_sets: ProcessSet objects to register now (``"dynamic"`` is accepted: sets can
            always be added later).
        backend: "mpi", "gloo", "nccl" or "torch" (gloo on CPU, nccl with CUDA); default from
            ``HPDL_BACKEND`` or the launcher.

    Raises:
        hpdl.config.SettingsError: an ``HPDL_*`` variable that hpdl does not know, or a value out
            of its range; or a backend that cannot run with this installation (a ``ValueError``).
        hpdl.comm.WorldSizeError: the world's size is not the one the launcher announced, as when
            srun starts MPICH ranks without ``--mpi=pmi2`` (a ``ValueError``, on every rank).
        ValueError: this rank is not in the list ``comm``, or a process set cannot be registered.

    Where the ranks do not all meet within ``HPDL_START_TIMEOUT`` seconds (when set), the process
    prints one line saying so and exits with status 1.
    """
    global _state, _atexit_registered
    with _lock:
        if _state is not None:
            return  # as Horovod: a second init() is a no-op
        settings = Settings.from_env(backend=backend)
        member = membership.current()
        mpi_comm = None
        if comm is not None and not isinstance(comm, (list, tuple, range)):
            mpi_comm = comm  # an mpi4py communicator
        if member is not None:
            if comm is not None:
                raise ValueError("an elastic job's world is the driver's: init(comm=...) cannot choose its ranks")
            # Nothing to bound: the join waits for the driver's generation, up to the elastic timeout.
            world, topology = _join_elastic(settings, member)
        else:
            topology = discover_topology()
            # The launcher's world is checked against the size it announced; a user's comm is not it.
            with _ranks_meet_within(settings.start_timeout_s):
                world = _connect(settings, topology, mpi_comm, check_size=mpi_comm is None)
        parent = None
        if isinstance(comm, (list, tuple, range)):
            sub = world.split(list(comm))
            if sub is None:
                world.close()
                raise ValueError(f"rank {topology.rank} is not in the ranks given to init(comm={list(comm)})")
            parent, world = world, sub
        # Everything that talks to the world communicator from this thread happens before the
        # engine starts: afterwards the engine thread alone uses it.
        if member is not None:  # the driver's hosts: names of one machine stay hosts of their own
            local_rank, local_size, cross_rank, cross_size = (topology.local_rank, topology.local_size,
                                                              topology.cross_rank, topology.cross_size)
        else:
            local_rank, local_size, cross_rank, cross_size = world.node_layout()
        topology = Topology(world.rank, world.size, local_rank, local_size, cross_rank, cross_size, topology.launcher)
        homogeneous = len(set(world.allgather_object(local_size))) == 1
        data_comm = None
        if settings.hierarchical_allreduce:
            from hpdl.comm.hierarchical import HierarchicalCommunicator

            data_comm = HierarchicalCommunicator(world, world.host_names())
        nice = settings.resolve_engine_nice(local_size, torch.get_num_threads(), os.cpu_count() or 1,
                                            torch.cuda.is_available())
        autotuner = _autotuner(settings) if settings.autotune and world.rank == 0 else None
        engine = Engine(settings, world, data_comm, thread_nice=nice, autotuner=autotuner, resets=member)
        _state = _State(settings, topology, world, engine, homogeneous, parent)
        if topology.rank == 0:
            for name in horovod_variables_ignored():
                sys.stderr.write(f"hpdl: warning: {name} is set but not honoured by hpdl; ignoring it\n")
        if settings.timeline:
            engine.start_timeline(settings.timeline, settings.timeline_mark_cycles)
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True
    if process_sets not in (None, "dynamic"):
        for ps in process_sets:
            _process_sets.add_process_set(ps)
    for hook in list(_startup_hooks):
        hook()


def _join_elastic(settings: Settings, member: "membership.Membership") -> "tuple[Communicator, Topology]":
    """Join the elastic job's next generation and form its world (over torch.distributed: an
    MPI world cannot change its size)."""
    if settings.backend == "mpi":
        raise ValueError("HPDL_BACKEND=mpi in an elastic job: an MPI world cannot change its size; use gloo, nccl "
                         "or torch")
    slot = member.join(_elastic_timeout_s())
    cuda = torch.cuda.is_available()
    name = "nccl" if settings.backend == "nccl" or (settings.backend in ("auto", "torch") and cuda) else "gloo"
    topology = Topology(slot.rank, slot.size, slot.local_rank, slot.local_size, slot.cross_rank, slot.cross_size,
                        "hpdl-elastic")
    world = create_world(name, topology, timeout_s=settings.stall_timeout_s, store=member.process_group_store())
    # Every wait of the world's collectives asks whether the generation still runs.
    world.wait_hook = member.check
    world.polls_works = True  # no Python thread left in a call a reset abandons (torch_dist._poll)
    if topology.rank == 0:
        member.updates_seen = member.host_updates()[0]
    member.updates_seen = world.allgather_object(member.updates_seen)[0]  # rank 0's, on every rank
    return world, topology


def _elastic_timeout_s() -> float:
    """How long a worker waits for a generation that lists it (the driver's --elastic-timeout, a
    little longer: the driver, which ends the job then, says why)."""
    try:
        return float(os.environ.get("HPDL_ELASTIC_TIMEOUT", "600")) + 30.0
    except ValueError:
        return 630.0


def _autotuner(settings: Settings) -> Autotuner:
    """Rank 0's autotuner; the knobs the user set stay as they are (as in Horovod)."""
    given = set(settings_given())
    fixed = [name for name in ("fusion_threshold", "cycle_time_ms") if name in given]
    if len(fixed) == 2:
        sys.stderr.write("hpdl: warning: HPDL_AUTOTUNE has nothing to tune: HPDL_FUSION_THRESHOLD and "
                         "HPDL_CYCLE_TIME are both set\n")
    return Autotuner(settings.fusion_threshold, settings.cycle_time_ms, fixed,
                     warmup_samples=settings.autotune_warmup_samples,
                     steps_per_sample=settings.autotune_steps_per_sample,
                     max_samples=settings.autotune_bayes_opt_max_samples,
                     noise=settings.autotune_gaussian_process_noise, log_path=settings.autotune_log,
                     hierarchical_allreduce=settings.hierarchical_allreduce,
                     cache_enabled=settings.cache_capacity > 0)


@contextlib.contextmanager
def _ranks_meet_within(seconds: float) -> Iterator[None]:
    """End this process with one clear line if the block (the ranks' rendezvous) outlasts ``seconds``."""
    if seconds <= 0:
        yield
        return
    # A rendezvous waiting for a rank that never started blocks in C code, out of reach of an
    # exception: the timer ends the process instead.
    timer = threading.Timer(seconds, _start_timed_out, args=(seconds,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _start_timed_out(seconds: float) -> None:
    sys.stderr.write(f"hpdl: error: the ranks did not all meet within {seconds:g} s of hvd.init() "
                     "(HPDL_START_TIMEOUT); did every rank start?\n")
    sys.stderr.flush()
    os._exit(1)


def _connect(settings: Settings, topology: Topology, mpi_comm: Any = None, check_size: bool = True) -> Communicator:
    """Choose the backend and connect every rank: the one place that does both.

    Under MPI the communicator is a duplicate of its own, so that other MPI calls on the same
    ranks (the user's, a benchmark's) never interleave with the ones made on it.
    """
    name = choose_backend("mpi" if mpi_comm is not None else settings.backend, topology, mpi_available(),
                          cuda=torch.cuda.is_available(), shared_gpus=_shared_gpus(settings, topology))
    if name == "mpi":
        mpi_comm = (mpi_comm if mpi_comm is not None else MPI.COMM_WORLD).Dup()
    aware = None if settings.mpi_cuda_aware == "auto" else settings.mpi_cuda_aware == "1"
    world = create_world(name, topology, timeout_s=settings.stall_timeout_s, mpi_comm=mpi_comm, cuda_aware=aware)
    if check_size:
        try:
            check_world_size(world.size, os.environ)
        except WorldSizeError:
            world.close()
            raise
    return world


def job_backend(backend: Optional[str] = None) -> str:
    """Return the backend a job started here would use ("mpi", "gloo", "nccl"), without connecting.

    One of the tools beside the engine that docs/api.md documents, for benchmarks and tools.

    Args:
        backend: as for ``init()``; default from HPDL_BACKEND or the launcher.
    """
    topology = discover_topology()
    settings = Settings.from_env(backend=backend)
    return choose_backend(settings.backend, topology, mpi_available(), cuda=torch.cuda.is_available(),
                          shared_gpus=_shared_gpus(settings, topology))


def _shared_gpus(settings: Settings, topology: Topology) -> bool:
    """Whether ranks of this node share a GPU (then nccl cannot connect them)."""
    return torch.cuda.is_available() and ranks_share_gpus(settings.ranks_per_gpu, topology.local_size,
                                                           torch.cuda.device_count())


def job_communicator(backend: Optional[str] = None) -> Communicator:
    """Return a communicator of every rank of the job, apart from hpdl's engine.

    A tool beside the engine (docs/api.md), for benchmarks and tools that time the backend
    itself or synchronise the ranks around hpdl: its collectives never interleave with the
    engine's (under torch.distributed it is a group of its own: two threads issuing
    collectives on one gloo group may pair them differently on each rank). Collective: every
    rank calls it. Close it when done.

    Raises:
        WorldSizeError: the world has another size than the launcher announced.
    """
    world = _connect(Settings.from_env(backend=backend), discover_topology())
    if world.name == "mpi":
        return world
    own = world.split(list(range(world.size)))
    world.close()
    return own


def shutdown() -> None:
    """Stop hpdl on this process (and the engines of the others); init() may be called again.

    Raises:
        ShutdownError: a shutdown hook failed (the profile could not be written), naming what
            was lost; hpdl has stopped all the same. After a failure of the engine the hooks'
            failures are logged instead: the job ends as a failed one anyway.
    """
    global _state
    if _state is None:
        return
    failures = _run_shutdown_hooks()
    with _lock:
        state, _state = _state, None
    if state is not None:
        _stop(state)
    if failures:
        if abort.failed():
            _log_failures(failures)
        else:
            raise ShutdownError("; ".join(failures))


def _stop(state: _State) -> None:
    state.engine.shutdown()
    data_comm = state.engine.process_set_data_comm(0)
    if data_comm is not state.comm:
        data_comm.close()
    state.comm.close()
    if membership.current() is not None:
        # The next init() forms the next generation's world: this one goes now, not at exit.
        from hpdl.comm.torch_dist import leave_world

        leave_world()
    if state.parent is not None:  # else each init(comm=[...]) would hold MPI communicators for good
        state.parent.close()
    _process_sets.forget_registered()


def _run_shutdown_hooks() -> List[str]:
    """Call every shutdown hook in its stage's turn; return what failed, one message each.

    A failing hook does not stop the others: shutting down must go on.
    """
    failures = []
    for stage in ShutdownStage:
        for hook in list(_shutdown_hooks[stage]):
            try:
                hook()
            except ShutdownError as err:
                failures.append(str(err))
            except Exception as err:  # noqa: BLE001 - every hook runs; the failure is reported after
                failures.append(f"{getattr(hook, '__qualname__', hook)} at shutdown failed: "
                                f"{type(err).__name__}: {err}")
    return failures


def _log_failures(failures: List[str]) -> None:
    for failure in failures:
        log.error("hpdl: %s", failure)


def _at_exit() -> None:
    # After a failure that ended the engine, a normal exit would wait for a peer that may never
    # come (MPI_Finalize); the error has been printed by now, so the job is aborted instead,
    # once the hooks (the profiler's last write) have had their turn.
    if abort.failed():
        if _state is not None:
            _log_failures(_run_shutdown_hooks())
        abort.abort_if_failed()
    try:
        shutdown()
    except ShutdownError as err:
        _exit_failed(str(err))


def _exit_failed(message: str) -> NoReturn:
    """End this process with exit code 1 after ``message``, from an exit handler.

    An exception raised in an atexit handler is printed and the exit code stays 0, which would
    report a job that lost its profile as a success; so the process ends here, once the error
    line is printed (and noted for `hpdl run`'s rank watch, as Python's own exit would).
    """
    sys.stderr.write(f"hpdl: error: {message}\n")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not keep the process alive
            pass
    rank_exit.note()
    os._exit(1)


def is_initialized() -> bool:
    """Return whether ``init()`` has run on this process (and ``shutdown()`` has not since)."""
    return _state is not None


def engine() -> Engine:
    """Return the running engine (for the profiler, the autotuner's parameters and benchmarks).

    Raises:
        ValueError: hpdl is not initialized (``hvd.init()`` has not run, or ``shutdown()`` has).
    """
    return _require().engine


def settings() -> Settings:
    """Return the settings the running hpdl read at ``init()`` (``hpdl.config.Settings``).

    Raises:
        ValueError: hpdl is not initialized (``hvd.init()`` has not run, or ``shutdown()`` has).
    """
    return _require().settings


def size() -> int:
    """Return the number of ranks in the job.

    Raises:
        ValueError: hpdl is not initialized (``hvd.init()`` has not run, or ``shutdown()`` has).
    """
    return _require().topology.size


def rank() -> int:
    """Return this process's rank in the job, 0 to ``size() - 1``.

    Raises:
        ValueError: hpdl is not initialized (``hvd.init()`` has not run, or ``shutdown()`` has).
    """
    return _require().topology.rank


def local_size() -> int:
    """Return the number of ranks on this process's node.

    Raises:
        ValueError: hpdl is not initialized (``hvd.init()`` has not run, or ``shutdown()`` has).
    """
    return _require().topology.local_size


def local_rank() -> int:
    """Return this process's rank among the ranks of its node, 0 to ``local_size() - 1``.

    Raises:
        ValueError: hpdl is not initialized (``hvd.init()`` has not run, or ``shutdown()`` has).
    """
    return _require().topology.local_rank


def local_gpu() -> int:
    """Return the index of this rank's GPU on its node, for ``torch.cuda.set_device(hvd.local_gpu())``.

    ``local_rank()`` with one rank per GPU (Horovod's ``set_device(hvd.local_rank())``), and
    ``local_rank() // K`` with K ranks per GPU (``HPDL_RANKS_PER_GPU``, ``hpdl run
    --ranks-per-gpu K``). Without CUDA it is the index the rank would use.

    Raises:
        ValueError: hpdl is not initialized.
        hpdl.comm.devices.DeviceError: this node has no such GPU (a ``ValueError``; the message
            says what to change).
    """
    state = _require()
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count:
        return check_gpu_index(state.topology.local_rank, state.settings.ranks_per_gpu, count)
    return gpu_index(state.topology.local_rank, state.settings.ranks_per_gpu)


def cross_size() -> int:
    """Return the number of ranks with this process's local rank across the nodes.

    On a homogeneous job (the same number of ranks on every node) it is the number of nodes.

    Raises:
        ValueError: hpdl is not initialized (``hvd.init()`` has not run, or ``shutdown()`` has).
    """
    return _require().topology.cross_size


def cross_rank() -> int:
    """Return this process's rank among the ranks with its local rank across the nodes.

    On a homogeneous job it is the index of this process's node.

    Raises:
        ValueError: hpdl is not initialized (``hvd.init()`` has not run, or ``shutdown()`` has).
    """
    return _require().topology.cross_rank


def is_homogeneous() -> bool:
    """Return whether every node runs the same number of ranks.

    Raises:
        ValueError: hpdl is not initialized (``hvd.init()`` has not run, or ``shutdown()`` has).
    """
    return _require().homogeneous


def backend_name() -> str:
    """Return the backend the engine runs on: "mpi", "gloo" or "nccl".

    Raises:
        ValueError: hpdl is not initialized (``hvd.init()`` has not run, or ``shutdown()`` has).
    """
    return _require().comm.name


# -- build queries, as Horovod's (callables returning bool; nccl_built an int version) ------

def mpi_built() -> bool:
    """Return whether MPI can be used: mpi4py imports (and so an MPI library was found).

    Answers without ``init()``, as Horovod's; ``mpi_enabled()`` says whether a running job uses it.
    """
    return mpi_available()


def mpi_enabled() -> bool:
    """Return whether the running hpdl talks through MPI (False before ``init()``, as in Horovod)."""
    return _state is not None and _state.comm.name == "mpi"


def gloo_built() -> bool:
    """Return whether gloo can be used: torch.distributed with its gloo backend.

    Answers without ``init()``; ``gloo_enabled()`` says whether a running job uses it.
    """
    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


def gloo_enabled() -> bool:
    """Return whether the running hpdl talks through gloo (False before ``init()``, as in Horovod)."""
    return _state is not None and _state.comm.name == "gloo"


def nccl_built() -> int:
    """Return NCCL's version as an int (2.18.3 is 21803), 0 when torch has no NCCL, as Horovod's.

    Returns:
        ``major * 10000 + minor * 100 + patch``; 1 when torch has NCCL but cannot say which
        version; 0 without it. Answers without ``init()``.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return 0
    try:
        major, minor, patch = torch.cuda.nccl.version()
        return major * 10000 + minor * 100 + patch
    except Exception:
        return 1


def mpi_threads_supported() -> bool:
    """Return whether MPI was initialized with ``MPI_THREAD_MULTIPLE`` (False without MPI), as Horovod's.

    mpi4py asks for it by default, at its import.
    """
    return MPI is not None and MPI.Query_thread() == MPI.THREAD_MULTIPLE


def cuda_built() -> bool:
    """Return whether this torch was built with CUDA (whether or not a GPU is present)."""
    return torch.backends.cuda.is_built() if hasattr(torch.backends, "cuda") else False


def rocm_built() -> bool:
    """Return whether this torch was built with ROCm (HIP)."""
    return getattr(torch.version, "hip", None) is not None


def ddl_built() -> bool:
    """Return False: hpdl has no IBM DDL backend (Horovod's query, kept for scripts that ask)."""
    return False


def ccl_built() -> bool:
    """Return False: hpdl has no oneCCL backend (Horovod's query, kept for scripts that ask)."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Write rank 0's engine events to ``file_path`` as a Chrome trace until ``stop_timeline()``.

    Only rank 0 writes: on the other ranks the call does nothing, so every rank may make it.
    A timeline already running is stopped first. ``HPDL_TIMELINE`` starts one at ``init()``.

    Args:
        file_path: The trace to write (open it in chrome://tracing or Perfetto); missing
            directories are made.
        mark_cycles: Also mark each of the engine's cycles.

    Raises:
        ValueError: hpdl is not initialized, or rank 0 cannot write the file (naming it and why).
    """
    _require().engine.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop the timeline started by ``start_timeline()`` or ``HPDL_TIMELINE`` and close its file.

    Raises:
        ValueError: hpdl is not initialized (``hvd.init()`` has not run, or ``shutdown()`` has).
    """
    _require().engine.stop_timeline()


def profile_step() -> None:
    """Mark the end of a training step in the profile (DistributedOptimizer.step() does; loops without it call this)."""
    state = _state
    if state is not None:
        ev.mark_step(state.engine.bus, state.topology.rank)
