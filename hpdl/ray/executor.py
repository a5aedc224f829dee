"""``hpdl.ray.RayExecutor``: Horovod's ``horovod.ray.RayExecutor``, its ranks Ray actors.

``start()`` reserves a placement group (PACK for ``num_workers``, one bundle per host with
STRICT_SPREAD for ``num_hosts``, or the group the caller runs in), starts one actor per rank in
it, numbers the ranks so that each Ray node's are consecutive (local and cross ranks are the
node's, as hpdl.spark numbers its tasks), and gives each torchrun's variables for its place,
rank 0's address and a port there to meet at. ``hvd.init()`` in a function the executor runs
then joins the others over gloo (nccl with GPUs).

``run(fn)`` runs ``fn`` on every rank and returns their results in rank order. The first rank
whose function raises ends the run: hpdl is shut down on that rank (so the others' collectives
end with hpdl's error at once), the other ranks get ``RaySettings.failure_grace_s`` to end, the
ones still running are killed with their actors, and :class:`~hpdl.ray.WorkerFailedError`
names the rank that failed first and its error. An actor or node that dies does the same.
Ctrl-C in the driver kills every actor. After a failure the executor must be started again.

With ``min_workers`` or ``max_workers`` the job is elastic (elastic.py): ``run(fn)`` drives
``fn``'s workers under hpdl's elastic driver, on the Ray cluster's alive nodes; a worker or node
lost shrinks the world, a node added grows it, and ``run`` returns the results of the world the
training returned in.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from hpdl.ray.errors import PlacementError, RayMissingError, WorkerFailedError, first_line
from hpdl.ray.worker import Failure, RankWorker
from hpdl.comm.topology import NODE_VARIABLE
from hpdl.launch.placement import Placement, place_ranks, rank_variables

# The driver's variables every rank gets, so that a job's settings do not depend on how Ray
# started its workers (as hpdl.spark passes them to its ranks).
SETTING_PREFIXES = ("HPDL_", "HOROVOD_")


def _ray():
    try:
        import ray
    except ImportError:
        raise RayMissingError() from None
    return ray


@dataclasses.dataclass(frozen=True)
class RaySettings:
    """What ``RayExecutor.create_settings`` makes (Horovod's names where they apply).

    ``timeout_s``: seconds the workers may take to start and report where they run;
    ``placement_group_timeout_s``: seconds the cluster may take to hold the placement group;
    ``failure_grace_s``: seconds the other ranks get to end after one failed, before they are
    killed; ``nics``: network interfaces for the ranks' traffic (gloo's and NCCL's variables).
    """

    timeout_s: float = 30.0
    placement_group_timeout_s: float = 100.0
    failure_grace_s: float = 30.0
    nics: Tuple[str, ...] = ()
    discovery_interval_s: float = 1.0  # elastic: how often the alive nodes are asked again
    verbose: bool = False  # elastic: a line for every generation, the first too

    def __post_init__(self) -> None:
        for name in ("timeout_s", "placement_group_timeout_s", "failure_grace_s", "discovery_interval_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be above 0 seconds, got {value!r}")


class RayExecutor:
    """Run hpdl ranks as Ray actors; the signature is Horovod's ``horovod.ray.RayExecutor``."""

    @staticmethod
    def create_settings(timeout_s: float = 30, ssh_identity_file: Optional[str] = None, ssh_str: Optional[str] = None,
                        placement_group_timeout_s: float = 100, nics: Optional[Sequence[str]] = None,
                        failure_grace_s: float = 30, discovery_interval_s: float = 1,
                        verbose: bool = False) -> RaySettings:
        """Horovod's ``create_settings``; the ssh arguments are accepted and unused (Ray, not
        ssh, reaches the hosts)."""
        return RaySettings(float(timeout_s), float(placement_group_timeout_s), float(failure_grace_s),
                           tuple(nics or ()), float(discovery_interval_s), bool(verbose))

    def __init__(self, settings: Optional[RaySettings] = None, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: int = 1, cpus_per_worker: float = 1,
                 use_gpu: bool = False, gpus_per_worker: Optional[float] = None,
                 use_current_placement_group: bool = True, min_workers: Optional[int] = None,
                 max_workers: Optional[int] = None, reset_limit: Optional[int] = None,
                 cooldown_range: Optional[Tuple[int, int]] = None, elastic_timeout: float = 600,
                 override_discovery: bool = True) -> None:
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host), ("min_workers", min_workers),
                            ("max_workers", max_workers)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}")
        self.elastic = min_workers is not None or max_workers is not None
        if self.elastic:
            self._check_elastic(num_workers, num_hosts, min_workers, max_workers, reset_limit, cooldown_range,
                                elastic_timeout)
            min_workers = min_workers if min_workers is not None else 1
            num_workers = num_workers if num_workers is not None else min_workers
        elif (num_workers is None) == (num_hosts is None):
            raise ValueError("RayExecutor takes num_workers or num_hosts (with num_workers_per_host), one of them")
        if not cpus_per_worker > 0:
            raise ValueError(f"cpus_per_worker must be above 0, got {cpus_per_worker!r}")
        if gpus_per_worker is not None and not use_gpu:
            raise ValueError("gpus_per_worker is given but use_gpu is False")
        self.settings = settings if settings is not None else RaySettings()
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.num_workers = num_workers if num_workers is not None else num_hosts * num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker if gpus_per_worker is not None else 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.reset_limit = reset_limit
        self.cooldown_range = (float(cooldown_range[0]), float(cooldown_range[1])) if cooldown_range else None
        self.elastic_timeout = float(elastic_timeout)
        self._started_elastic = False
        self._extra_env: Dict[str, str] = {}
        self._workers: List[Any] = []  # actor handles, in rank order
        self._group = None  # the placement group this executor made (removed at shutdown)
        self._placement: Optional[Placement] = None

    @staticmethod
    def _check_elastic(num_workers, num_hosts, min_workers, max_workers, reset_limit, cooldown_range,
                       elastic_timeout) -> None:
        if num_hosts is not None:
            raise ValueError("RayExecutor(num_hosts=...) with min_workers/max_workers: an elastic job's hosts are the "
                             "Ray cluster's alive nodes; give num_workers (the workers at the start) or neither")
        low = min_workers if min_workers is not None else 1
        high = max_workers if max_workers is not None else 1 << 30
        start = num_workers if num_workers is not None else low
        if low > high:
            raise ValueError(f"min_workers {low} is above max_workers {high}")
        if not low <= start <= high:
            raise ValueError(f"num_workers {start} is outside min_workers {low} and max_workers "
                             f"{high if high < 1 << 30 else 'unbounded'}")
        if reset_limit is not None and (not isinstance(reset_limit, int) or reset_limit < 0):
            raise ValueError(f"reset_limit must be a whole number of at least 0, got {reset_limit!r}")
        if cooldown_range is not None:
            if len(cooldown_range) != 2 or not 0 <= cooldown_range[0] <= cooldown_range[1]:
                raise ValueError(f"cooldown_range must be (low, high) seconds with 0 <= low <= high, got "
                                 f"{cooldown_range!r}")
        if not elastic_timeout > 0:
            raise ValueError(f"elastic_timeout must be above 0 seconds, got {elastic_timeout!r}")

    # -- starting -------------------------------------------------------------------------------

    def start(self, executable_cls: Optional[type] = None, executable_args: Optional[Sequence[Any]] = None,
              executable_kwargs: Optional[Mapping[str, Any]] = None,
              extra_env_vars: Optional[Mapping[str, str]] = None) -> None:
        """Reserve the placement group, start the ranks' actors and give each its place.

        Raises:
            PlacementError: the cluster does not hold the group within the settings' timeout,
                naming what was asked and what the cluster has.
            WorkerFailedError: an actor did not start, or ``executable_cls`` raised in one.
        """
        ray = _ray()
        if self._workers or self._started_elastic:
            raise RuntimeError("RayExecutor.start(): already started; call shutdown() first")
        if not ray.is_initialized():
            ray.init()
        if self.elastic:  # the workers start with each run, on the nodes alive then
            if executable_cls is not None:
                raise ValueError("RayExecutor.start(executable_cls=...) with min_workers/max_workers: an elastic "
                                 "job's workers start and end with each run(); keep the state in run's function")
            self._extra_env = dict(extra_env_vars or {})
            self._started_elastic = True
            return
        try:
            self._start(ray, executable_cls, executable_args or (), executable_kwargs or {}, extra_env_vars or {})
        except BaseException:
            self.shutdown()
            raise

    def _bundles(self) -> Tuple[List[Dict[str, float]], str, List[int]]:
        """The placement group's bundles, strategy, and each worker's bundle."""
        per_worker = self._per_worker()
        if self.num_hosts is not None:
            per_host = {k: v * self.num_workers_per_host for k, v in per_worker.items()}
            return ([dict(per_host) for _ in range(self.num_hosts)], "STRICT_SPREAD",
                    [i // self.num_workers_per_host for i in range(self.num_workers)])
        return [dict(per_worker) for _ in range(self.num_workers)], "PACK", list(range(self.num_workers))

    def _reserve(self, ray) -> Tuple[Any, List[int]]:
        from ray.util.placement_group import get_current_placement_group, placement_group

        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None:
            count = len(current.bundle_specs)
            return current, [i % count for i in range(self.num_workers)]
        bundles, strategy, of_worker = self._bundles()
        group = placement_group(bundles, strategy=strategy)
        self._group = group
        try:
            ray.get(group.ready(), timeout=self.settings.placement_group_timeout_s)
        except ray.exceptions.GetTimeoutError:
            asked = f"{len(bundles)} bundle(s) of {_resources(bundles[0])} ({strategy})"
            raise PlacementError(f"the Ray cluster did not hold {asked} within {self.settings.placement_group_timeout_s:g} s "
                                 f"(placement_group_timeout_s); it has {_cluster(ray)}") from None
        return group, of_worker

    def _start(self, ray, cls, args, kwargs, extra_env) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group, of_worker = self._reserve(ray)
        actor = ray.remote(RankWorker)
        options: Dict[str, Any] = {"num_cpus": self.cpus_per_worker, "max_restarts": 0}
        if self.gpus_per_worker:
            options["num_gpus"] = self.gpus_per_worker
        workers = [actor.options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=of_worker[i])).remote()
                   for i in range(self.num_workers)]
        self._workers = workers  # in start order until placed: shutdown() ends them either way
        try:
            where = ray.get([w.where.remote() for w in workers], timeout=self.settings.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WorkerFailedError(f"the {self.num_workers} worker(s) did not all start within "
                                    f"{self.settings.timeout_s:g} s (timeout_s); the cluster has {_cluster(ray)}") from None
        except ray.exceptions.RayActorError as err:
            raise WorkerFailedError(f"a worker did not start: {first_line(err)}") from None
        placement = place_ranks([w["node"] for w in where])
        ranked = [workers[p] for p in sorted(range(len(workers)), key=lambda p: placement.ranks[p])]
        rank0 = placement.ranks.index(0)
        address = where[rank0]["address"]
        port = ray.get(workers[rank0].free_port.remote(address), timeout=self.settings.timeout_s)
        settings = self._worker_env(extra_env)
        gpus = [w["gpus"] for w in where]
        configured = []
        for partition, worker in enumerate(workers):
            env = dict(settings)
            node_gpus = placement.node_gpus(partition, gpus)
            if node_gpus and "CUDA_VISIBLE_DEVICES" not in extra_env:  # GPU local_rank: the one Ray gave this rank
                env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
            env.update(rank_variables(placement.topology(partition), address, port))
            env[NODE_VARIABLE] = where[partition]["node"]  # hpdl's nodes are Ray's
            configured.append(worker.configure.remote(env))
        ray.get(configured, timeout=self.settings.timeout_s)
        self._workers, self._placement = ranked, placement
        self._results([w.start_state.remote(cls, args, kwargs) for w in ranked], "executable_cls")

    # -- running --------------------------------------------------------------------------------

    @property
    def workers(self) -> List[Any]:
        """The ranks' actor handles, in rank order."""
        return list(self._workers)

    def run(self, fn: Callable[..., Any], args: Optional[Sequence[Any]] = None,
            kwargs: Optional[Mapping[str, Any]] = None, callbacks: Optional[Sequence[Callable[[Any], None]]] = None) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``callbacks`` are called with rank 0's result once every rank has ended (Horovod calls
        them with what rank 0 logs as it goes; here they see its result).

        Raises:
            WorkerFailedError: a rank's function raised or its actor died, naming the rank.
        """
        if self.elastic:
            results = self._run_elastic(fn, args, kwargs)
        else:
            self._require_started()
            results = self._results([w.execute.remote(fn, tuple(args or ()), dict(kwargs or {}))
                                     for w in self._workers], getattr(fn, "__name__", "fn"))
        for callback in callbacks or ():
            callback(results[0])
        return results

    def run_remote(self, fn: Callable[..., Any], args: Optional[Sequence[Any]] = None,
                   kwargs: Optional[Mapping[str, Any]] = None) -> List[Any]:
        """Start ``fn(*args, **kwargs)`` on every rank; return Ray object refs, in rank order.

        Each ref holds ``(True, result)`` or ``(False, Failure)``: the caller waits for them
        (``ray.get``) and ends a failed run itself (``shutdown()``).
        """
        self._require_started("run_remote")
        return [w.execute.remote(fn, tuple(args or ()), dict(kwargs or {})) for w in self._workers]

    def execute(self, fn: Callable[[Any], Any], callbacks: Optional[Sequence[Callable[[Any], None]]] = None) -> List[Any]:
        """Run ``fn(executable)`` on every rank, ``executable`` being the rank's instance of
        ``start``'s ``executable_cls`` (None without one); results in rank order."""
        self._require_started("execute")
        results = self._results([w.execute_on_state.remote(fn) for w in self._workers], getattr(fn, "__name__", "fn"))
        for callback in callbacks or ():
            callback(results[0])
        return results

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(executable)`` on rank 0 only; return its result."""
        self._require_started("execute_single")
        return self._results([self._workers[0].execute_on_state.remote(fn)], getattr(fn, "__name__", "fn"))[0]

    def _run_elastic(self, fn: Callable[..., Any], args: Optional[Sequence[Any]],
                     kwargs: Optional[Mapping[str, Any]]) -> List[Any]:
        """``run`` of an elastic job: hpdl's elastic driver, with Ray's nodes and actors."""
        import signal

        from hpdl.launch.elastic.discovery import DiscoveryError
        from hpdl.launch.elastic.driver import ElasticDriver, ElasticJobError, ElasticOptions
        from hpdl.ray.elastic import RAY_SPELLING, RayNodes, RayWorkers

        if not self._started_elastic:
            raise RuntimeError("RayExecutor: not started (call start() first)")
        ray = _ray()
        nodes = RayNodes(ray, self.cpus_per_worker, self.gpus_per_worker)
        options = ElasticOptions(
            np=self.num_workers, min_np=self.min_workers, max_np=self.max_workers if self.max_workers else 1 << 30,
            hosts=nodes, elastic_timeout_s=self.elastic_timeout, reset_limit=self.reset_limit,
            cooldown_range_s=self.cooldown_range, discovery_interval_s=self.settings.discovery_interval_s,
            verbose=self.settings.verbose, speaker="hpdl.ray", spelling=RAY_SPELLING)
        workers = RayWorkers(ray, nodes, fn, tuple(args or ()), dict(kwargs or {}),
                             self._worker_env(self._extra_env), self.settings.timeout_s)
        driver = ElasticDriver(options, workers)
        what = getattr(fn, "__name__", "fn")
        try:
            driver.run_job()
        except DiscoveryError:
            raise PlacementError(f"no Ray node holds a worker of {_resources(self._per_worker())}; the cluster has "
                                 f"{_cluster(ray)}") from None
        except ElasticJobError as err:
            if driver.ending_signal == signal.SIGINT:
                raise KeyboardInterrupt from None
            raise WorkerFailedError(f"{what}: {err}") from None
        finally:
            workers.end_all()
        results, failed = workers.results(driver.final_members)
        if failed:
            rank, words = failed[0]
            raise WorkerFailedError(f"{what} returned on some ranks, but rank {rank} {words}", rank)
        return results

    def _per_worker(self) -> Dict[str, float]:
        per_worker = {"CPU": float(self.cpus_per_worker)}
        if self.gpus_per_worker:
            per_worker["GPU"] = float(self.gpus_per_worker)
        return per_worker

    def _worker_env(self, extra_env: Mapping[str, str]) -> Dict[str, str]:
        """What every rank's environment gets beside its place: the driver's settings, the
        interfaces of ``nics``, the caller's ``extra_env_vars``."""
        env = {k: v for k, v in os.environ.items() if k.startswith(SETTING_PREFIXES)}
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.settings.nics:
            names = ",".join(self.settings.nics)
            env.update(GLOO_SOCKET_IFNAME=names, NCCL_SOCKET_IFNAME=names)
        env.update(extra_env)
        return env

    def shutdown(self) -> None:
        """End every rank's actor and release the placement group this executor made."""
        ray = _ray()
        self._started_elastic = False
        workers, self._workers = self._workers, []
        for worker in workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # noqa: BLE001 - an actor already gone is what is wanted
                pass
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._group)
            except Exception:  # noqa: BLE001 - a group already removed
                pass
            self._group = None
        self._placement = None

    # -- failures -------------------------------------------------------------------------------

    def _require_started(self, what: str = "run") -> None:
        if self.elastic and what != "run":
            raise RuntimeError(f"RayExecutor.{what}() with min_workers/max_workers: an elastic job's workers "
                               "start and end with each run(); use run()")
        if not self._workers:
            raise RuntimeError("RayExecutor: not started (call start() first; after a failure, start() again)")

    def _results(self, refs: List[Any], what: str) -> List[Any]:
        """Every rank's result, in rank order; the first failure ends every rank and is raised."""
        ray = _ray()
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: List[Any] = [None] * len(refs)
        failures: List[Tuple[float, int, str, bool]] = []  # (when seen, rank, line, consequence)
        deadline: Optional[float] = None
        try:
            while pending:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
                if not ready:  # the grace after a failure has passed: the rest are stuck
                    break
                for ref in ready:
                    rank = pending.pop(ref)
                    failure = self._outcome(ray, ref, rank, results)
                    if failure is not None:
                        failures.append((time.monotonic(), rank) + failure)
                        if deadline is None:
                            deadline = time.monotonic() + self.settings.failure_grace_s
        except BaseException:  # Ctrl-C, SIGTERM: no actor outlives the driver's run
            self.shutdown()
            raise
        if not failures:
            return results
        stuck = sorted(pending.values())
        self.shutdown()  # the ranks still running wait for peers that ended: end them all
        causes = [f for f in failures if not f[3]] or failures
        _, rank, line, _ = causes[0]
        also = f"; rank(s) {', '.join(map(str, stuck))} still running were ended" if stuck else ""
        raise WorkerFailedError(f"{what} failed on rank {rank}: {line}{also}", rank)

    @staticmethod
    def _outcome(ray, ref, rank: int, results: List[Any]) -> Optional[Tuple[str, bool]]:
        """Store the rank's result; return (line, consequence) if it failed."""
        try:
            done, value = ray.get(ref)
        except ray.exceptions.RayActorError as err:
            return f"its actor died ({first_line(err)})", False
        except ray.exceptions.RayTaskError as err:  # the call itself failed (say, fn would not unpickle)
            cause = getattr(err, "cause", None)
            return (f"{type(cause).__name__}: {first_line(cause)}" if cause is not None else first_line(err)), False
        except ray.exceptions.RayError as err:
            return first_line(err), False
        if done:
            results[rank] = value
            return None
        failure: Failure = value
        return (f"{failure.type_name}: {failure.message}" if failure.message else failure.type_name), failure.consequence


def _resources(bundle: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(bundle.items())) + "}"


def _cluster(ray) -> str:
    alive = [n for n in ray.nodes() if n.get("Alive")]
    total = ray.cluster_resources()
    free = ray.available_resources()
    shown = {k: total[k] for k in ("CPU", "GPU") if k in total}
    return (f"{len(alive)} node(s), {_resources(shown)} in all, "
            f"{_resources({k: free.get(k, 0.0) for k in shown})} free")
