"""``hpdl.spark.run``: Horovod's ``horovod.spark.run``, on ranks in a barrier stage of Spark.

This module checks the arguments and hands over to the driver (``hpdl.spark.driver``), which
runs the stage whose tasks (``hpdl.spark.task``) start the ranks (``hpdl.spark.rank``).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, TextIO

from hpdl.config import YEAR_S, Settings

# Why MPI is refused: said once, where it is refused.
MPI_REFUSED = (
    "MPI under Spark is not supported: mpiexec has to start every rank itself (through ssh or its "
    "own daemon on each host), while here Spark starts, places and watches the ranks as its tasks "
    "and offers mpiexec no way onto its executors. The ranks talk over gloo (nccl with GPUs), which "
    "needs nothing but TCP between the executors; leave use_mpi unset (or pass use_gloo=True)"
)


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Mapping[str, Any]] = None,
        num_proc: Optional[int] = None, start_timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None, stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None,
        verbose: int = 1, use_mpi: Optional[bool] = None, use_gloo: Optional[bool] = None,
        extra_mpi_args: Optional[str] = None, nics: Optional[Iterable[str]] = None,
        prefix_output_with_timestamp: bool = False, executable: Optional[str] = None) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` ranks in Spark; return every rank's result, in rank order.

    Each rank is one task of a barrier stage of the active SparkContext (Spark starts all of
    them together, or none), and runs ``fn`` in a process of its own, a child of its task that
    dies with it. Inside ``fn``, ``hvd.init()`` (``import hpdl.torch as hvd``) joins the
    others: rank, size, local and cross ranks come from the tasks' hosts (host name and network
    namespace), the backend is gloo on CPUs and nccl where Spark gave the tasks GPUs (a rank's
    ``CUDA_VISIBLE_DEVICES`` lists its node's, so that GPU ``hvd.local_rank()`` is the one its
    own task was given). ``fn``, its arguments and its result travel
    by cloudpickle, so functions and classes defined in the driver's script work.

    Each rank's stdout and stderr reach the driver's, every line prefixed with the rank
    (``[1]<stdout>:...``). The first rank that fails ends the run: the stage is cancelled, every
    other rank ends, and :class:`~hpdl.spark.RankFailedError` names the rank and the last lines
    of its traceback. Ctrl-C in the driver ends every rank as well.

    Args:
        fn: the function each rank runs.
        args: its positional arguments.
        kwargs: its keyword arguments.
        num_proc: the number of ranks (default: the SparkContext's default parallelism).
        start_timeout: seconds Spark may take to give the stage ``num_proc`` free task slots and
            start every task (default ``HPDL_SPARK_START_TIMEOUT`` or
            ``HOROVOD_SPARK_START_TIMEOUT``, else 600); past it,
            :class:`~hpdl.spark.SlotsUnavailableError` names the slots wanted and found.
        env: variables added to each rank's environment (which is its task's, plus the driver's
            ``HPDL_*`` and ``HOROVOD_*`` settings).
        stdout: where the ranks' stdout goes (default ``sys.stdout``).
        stderr: where the ranks' stderr and the run's own messages go (default ``sys.stderr``).
        verbose: 0 quiet, 1 one line as the run starts, 2 also each task and rank as they go.
        use_mpi: True is refused (ValueError): see ``MPI_REFUSED``.
        use_gloo: True or None: the ranks use gloo (nccl with GPUs); False asks for MPI (refused).
        extra_mpi_args: accepted for Horovod's signature; with no MPI there is nothing to pass them to
            (a warning says so).
        nics: network interfaces the ranks' traffic keeps to (gloo's and NCCL's ``*_SOCKET_IFNAME``).
        prefix_output_with_timestamp: put the local time in front of every forwarded line.
        executable: the Python that runs each rank on the executors (default: the task's own,
            the interpreter Spark runs its Python workers with, ``PYSPARK_PYTHON``).

    Returns:
        the value ``fn`` returned on each rank, rank 0's first.

    Raises:
        ValueError: an argument that cannot work (MPI asked for, a non-positive ``num_proc``, ...).
        hpdl.spark.SlotsUnavailableError: the ranks did not all start within ``start_timeout``.
        hpdl.spark.RankFailedError: a rank raised, exited or was killed.
        hpdl.spark.SparkRunError: Spark failed the stage for another reason.
    """
    if use_mpi or use_gloo is False:
        asked = "use_mpi=True" if use_mpi else "use_gloo=False (MPI)"
        raise ValueError(f"hpdl.spark.run({asked}): {MPI_REFUSED}")
    if not callable(fn):
        raise TypeError(f"hpdl.spark.run: fn must be callable, got {type(fn).__name__}")
    if verbose not in (0, 1, 2):
        raise ValueError(f"hpdl.spark.run: verbose must be 0, 1 or 2, got {verbose!r}")
    timeout_s = _start_timeout(start_timeout)
    from_default = num_proc is None
    if not from_default:
        _num_proc(num_proc)
    user_env = _environment(env)
    interfaces = _interfaces(nics)
    if executable is not None and (not isinstance(executable, str) or not executable):
        raise ValueError(f"hpdl.spark.run: executable must name a Python interpreter, got {executable!r}")
    payload = _pickled(fn, tuple(args), dict(kwargs or {}))
    sc = _active_context()
    num_proc = _num_proc(sc.defaultParallelism) if from_default else num_proc

    from hpdl.spark.driver import RankOutput, SparkRun

    log = stderr or sys.stderr
    if verbose and extra_mpi_args:
        log.write(f"hpdl.spark: warning: extra_mpi_args={extra_mpi_args!r} is ignored: the ranks run over gloo, "
                  "not MPI\n")
    job = SparkRun(
        sc, num_proc, timeout_s, payload,
        driver_settings={k: v for k, v in os.environ.items() if k.startswith(("HPDL_", "HOROVOD_"))},
        user_env=user_env, interfaces=interfaces, executable=executable,
        output=RankOutput(stdout or sys.stdout, stderr or sys.stderr, bool(prefix_output_with_timestamp)),
        log=log, verbose=verbose,
    )
    job.say(1, f"running {num_proc} rank{'s' if num_proc != 1 else ''} in a barrier stage"
               f"{' (num_proc: the default parallelism)' if from_default else ''}")
    return job.execute()


def _start_timeout(start_timeout: Optional[float]) -> float:
    # The settings are read (and every HPDL_* variable checked) even when the argument is given.
    default = Settings.from_env().spark_start_timeout_s
    if start_timeout is None:
        return default
    if isinstance(start_timeout, bool) or not isinstance(start_timeout, (int, float)) \
            or not math.isfinite(start_timeout) or not 0 < start_timeout <= YEAR_S:
        raise ValueError(f"hpdl.spark.run: start_timeout must be a number of seconds above 0 and at most a year, "
                         f"got {start_timeout!r}")
    return float(start_timeout)


def _active_context():
    try:
        from pyspark import SparkContext
    except ImportError:
        raise ImportError("hpdl.spark.run needs pyspark: pip install 'hpdl[spark]'") from None
    sc = SparkContext._active_spark_context
    if sc is None:
        raise ValueError("hpdl.spark.run needs an active SparkContext: start a SparkSession first (a Spark Connect "
                         "session has no SparkContext, so it cannot run barrier stages from Python)")
    return sc


def _num_proc(num_proc: Any) -> int:
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"hpdl.spark.run: num_proc must be a whole number of ranks, at least 1, got {num_proc!r}")
    return num_proc


def _environment(env: Optional[Mapping[str, str]]) -> Dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise ValueError(f"hpdl.spark.run: env must be a mapping of variable names to values, got {type(env).__name__}")
    bad = [k for k, v in env.items() if not isinstance(k, str) or not k or "=" in k or not isinstance(v, str)]
    if bad:
        raise ValueError(f"hpdl.spark.run: env[{bad[0]!r}]: names and values must be strings (a name without '=')")
    return dict(env)


def _interfaces(nics: Optional[Iterable[str]]) -> Dict[str, str]:
    if not nics:
        return {}
    names = [nics] if isinstance(nics, str) else list(nics)
    if not names or any(not isinstance(n, str) or not n.strip() or "," in n for n in names):
        raise ValueError(f"hpdl.spark.run: nics must name network interfaces, such as ['eth0'], got {nics!r}")
    from hpdl.launch.horovodrun import interface_env

    return interface_env(",".join(sorted(set(n.strip() for n in names))))


def _pickled(fn: Callable[..., Any], args: tuple, kwargs: Dict[str, Any]) -> bytes:
    import cloudpickle

    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as err:
        raise TypeError(f"hpdl.spark.run: fn and its arguments must be picklable by cloudpickle: "
                        f"{type(err).__name__}: {err}") from None
