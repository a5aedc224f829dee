"""Elastic jobs on Ray: the Ray cluster's alive nodes are the hosts, Ray actors the workers.

``RayExecutor(min_workers=..., max_workers=...)`` runs its function under the same elastic
driver as `hpdl run --min-np` (hpdl/launch/elastic/driver.py: generations, blacklist, reset
limit, the rendezvous on the driver's TCPStore), with the two pieces that differ on Ray:

- :class:`RayNodes`, the host source: every alive Ray node with room for a worker, asked again
  every discovery interval, its slots what its resources hold (``CPU // cpus_per_worker``, and
  the GPUs likewise). A node removed from the cluster is gone from it (its actors die with it),
  a node added is a new host.
- :class:`RayWorkers`, the starter: one actor per worker, pinned to its node, running the
  function once. Its end is read from the actor's call: returned (0), raised (1), died
  (``SIGKILL``'s code, -9), or not started within ``timeout_s`` (1). The driver ends a worker
  with ``ray.kill``.

So a script written for `hvd.elastic.run` (commits, resets, reset callbacks) runs unchanged.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from hpdl.comm.topology import NODE_VARIABLE
from hpdl.launch.elastic.discovery import DiscoveryError
from hpdl.ray.errors import first_line
from hpdl.ray.worker import Failure, RankWorker

# The executor's argument names, for the driver's messages.
RAY_SPELLING = {"min_np": "min_workers", "max_np": "max_workers", "elastic_timeout": "elastic_timeout",
                "reset_limit": "reset_limit"}


class RayNodes:
    """The hosts of an elastic job on Ray: alive nodes, each with the workers its resources hold."""

    def __init__(self, ray, cpus_per_worker: float, gpus_per_worker: float = 0):
        self._ray = ray
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker
        self._node_ids: Dict[str, str] = {}  # host name -> Ray node id

    def find(self) -> Dict[str, int]:
        try:
            nodes = self._ray.nodes()
        except Exception as err:  # noqa: BLE001 - the GCS did not answer: keep the hosts known
            raise DiscoveryError(f"the Ray cluster did not list its nodes: {err}") from None
        hosts: Dict[str, int] = {}
        for node in nodes:
            if not node.get("Alive"):
                continue
            resources = node.get("Resources", {})
            slots = int(resources.get("CPU", 0.0) // self.cpus_per_worker + 1e-9)
            if self.gpus_per_worker:
                slots = min(slots, int(resources.get("GPU", 0.0) // self.gpus_per_worker + 1e-9))
            if slots < 1:
                continue
            # Two raylets of one machine share its address: the node id tells them apart.
            name = f"{node.get('NodeManagerAddress', 'node')}/{node['NodeID'][:8]}"
            self._node_ids[name] = node["NodeID"]
            hosts[name] = slots
        return hosts

    def node_id(self, host: str) -> str:
        return self._node_ids[host]

    def describe(self) -> str:
        per = f"{self.cpus_per_worker:g} CPU" + (f", {self.gpus_per_worker:g} GPU" if self.gpus_per_worker else "")
        return f"the Ray cluster's alive nodes ({per} per worker)"

    def hosts_phrase(self) -> str:
        return self.describe()


class _RayWorker:
    """One worker: its actor, the call that runs the function in it, and how it ended."""

    def __init__(self, ray, actor, started, run, start_timeout_s: float):
        self._ray = ray
        self.actor = actor
        self._started = started  # the actor's first call: answered once it runs
        self._run = run
        self._start_deadline: Optional[float] = time.monotonic() + start_timeout_s
        self._start_timeout_s = start_timeout_s
        self.code: Optional[int] = None
        self.words = ""
        self.result: Any = None

    def poll(self) -> Optional[int]:
        if self.code is None:
            self._look()
        return self.code

    def _look(self) -> None:
        ray = self._ray
        if self._start_deadline is not None:
            ready, _ = ray.wait([self._started], timeout=0)
            if ready:
                self._start_deadline = None
            elif time.monotonic() > self._start_deadline:
                self._end(1, f"did not start within {self._start_timeout_s:g} s (timeout_s): its node has no room "
                             "for it now")
                return
        ready, _ = ray.wait([self._run], timeout=0)
        if not ready:
            return
        try:
            done, value = ray.get(self._run)
        except ray.exceptions.RayActorError as err:
            self._end(-9, f"died with its actor ({first_line(err)})")
            return
        except ray.exceptions.RayError as err:  # the call itself failed (say, fn would not unpickle)
            cause = getattr(err, "cause", None)
            self._end(1, f"failed: {type(cause).__name__}: {first_line(cause)}" if cause is not None
                      else f"failed: {first_line(err)}")
            return
        if done:
            self.result = value
            self._end(0, "returned")
        else:
            failure: Failure = value
            self._end(1, f"raised {failure.type_name}" + (f": {failure.message}" if failure.message else ""))

    def _end(self, code: int, words: str) -> None:
        self.code, self.words = code, words
        self.kill()  # its actor is done: free its resources for the workers to come

    def terminate(self) -> None:
        self.kill()  # a Ray actor has no gentler end than its kill

    def kill(self) -> None:
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - an actor already gone is what is wanted
            pass

    def ending(self, code: int) -> str:
        return self.words or f"ended with code {code}"


class RayWorkers:
    """Start each worker as a Ray actor on its node, running ``fn(*args, **kwargs)`` once."""

    def __init__(self, ray, nodes: RayNodes, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                 env: Mapping[str, str], start_timeout_s: float):
        self._ray = ray
        self.nodes = nodes
        self._fn = ray.put(fn)  # sent once, not with every worker
        self._actor_class = ray.remote(RankWorker)  # made once: each call would register it anew
        self._args = tuple(args)
        self._kwargs = dict(kwargs)
        self.env = dict(env)
        self.start_timeout_s = start_timeout_s
        self.started: Dict[int, _RayWorker] = {}

    def store_address(self, hosts: Iterable[str]) -> Tuple[str, str]:
        return "0.0.0.0", self._ray.util.get_node_ip_address()  # the driver's node, as the workers' reach it

    def start(self, worker_id: int, host: str, variables: Dict[str, str]) -> _RayWorker:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray = self._ray
        node = self.nodes.node_id(host)
        options: Dict[str, Any] = {"num_cpus": self.nodes.cpus_per_worker, "max_restarts": 0,
                                   "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}
        if self.nodes.gpus_per_worker:
            options["num_gpus"] = self.nodes.gpus_per_worker
        actor = self._actor_class.options(**options).remote()
        env = dict(self.env)
        env.update(variables)
        env[NODE_VARIABLE] = node
        started = actor.where.remote()
        actor.configure.remote(env)
        run = actor.execute.remote(self._fn, self._args, self._kwargs)
        worker = _RayWorker(ray, actor, started, run, self.start_timeout_s)
        self.started[worker_id] = worker
        return worker

    def results(self, members: Sequence[Any]) -> Tuple[List[Any], List[Tuple[int, str]]]:
        """The results of ``members`` (the driver's final slots) in rank order, and the
        ``(rank, how it ended)`` of those that did not return."""
        results: List[Any] = []
        failed: List[Tuple[int, str]] = []
        for slot in sorted(members, key=lambda s: s.rank):
            worker = self.started.get(slot.worker)
            if worker is None or worker.poll() != 0:
                failed.append((slot.rank, worker.words if worker is not None else "never started"))
                results.append(None)
            else:
                results.append(worker.result)
        return results, failed

    def end_all(self) -> None:
        for worker in self.started.values():
            if worker.poll() is None:
                worker.kill()
