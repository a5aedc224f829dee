"""Where each rank sits when an engine starts the ranks (Spark's barrier tasks, Ray's actors),
and the environment its process starts with.

Pure functions of what the ranks' hosts are (and rank 0's address and port), so they are
tested without Spark or Ray. Under Spark every task computes the same placement from the same
gathered list, so no task needs to ask another; under Ray the executor computes it.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from hpdl.comm.topology import Topology, topology_from_ranks

# The launcher name of a rank's topology here. Its process reads the same placement from
# torchrun's variables (RANK, LOCAL_RANK, ...), which hpdl.comm.topology understands.
LAUNCHER = "spark"


@dataclasses.dataclass(frozen=True)
class Placement:
    """The rank of every partition of the barrier stage, and the node of every rank."""

    ranks: Tuple[int, ...]  # ranks[partition]
    hosts: Tuple[str, ...]  # hosts[rank]: host identity (hpdl.comm.topology.host_identity)

    def topology(self, partition: int) -> Topology:
        """The rank, local and cross ranks of ``partition``'s rank."""
        return topology_from_ranks(self.ranks[partition], self.hosts, LAUNCHER)

    def node_gpus(self, partition: int, partition_gpus: Sequence[Sequence[str]]) -> List[str]:
        """The GPUs Spark gave the tasks of ``partition``'s node, in local-rank order, each once.

        A rank sees these (``CUDA_VISIBLE_DEVICES``), so that GPU ``local_rank`` of the node is
        the one Spark gave its own task, as Horovod's ``torch.cuda.set_device(hvd.local_rank())``
        expects, and NCCL sees one GPU per rank of the node. A GPU that Spark gave several tasks
        (fractional amounts) is listed once: those ranks then share it, and hpdl connects them
        over gloo, as NCCL refuses two ranks on one GPU.

        Args:
            partition_gpus: each partition's GPU addresses, in partition order.
        """
        node = self.hosts[self.ranks[partition]]
        by_rank = sorted((rank, p) for p, rank in enumerate(self.ranks) if self.hosts[rank] == node)
        gpus: List[str] = []
        for _, member in by_rank:
            gpus.extend(g for g in partition_gpus[member] if g not in gpus)
        return gpus


def place_ranks(partition_hosts: Sequence[str]) -> Placement:
    """Number the ranks so that each node's ranks are consecutive, partition 0 being rank 0.

    Nodes come in the order of their first partition, and a node's ranks in partition order,
    as Horovod groups its ranks by host hash: a node's ranks then form one block, which
    hierarchical allreduce and the local ranks assume, and rank 0 is the task whose address
    every rank meets at.

    Args:
        partition_hosts: the host identity of each partition's task, in partition order.
    """
    nodes: Dict[str, List[int]] = {}
    for partition, host in enumerate(partition_hosts):
        nodes.setdefault(host, []).append(partition)
    order = [partition for members in nodes.values() for partition in members]
    ranks = [0] * len(order)
    for rank, partition in enumerate(order):
        ranks[partition] = rank
    return Placement(tuple(ranks), tuple(partition_hosts[p] for p in order))


def rank_variables(topology: Topology, master_addr: str, master_port: int) -> Dict[str, str]:
    """torchrun's variables for one rank: what ``hvd.init()`` (and torch.distributed's ``env://``) read."""
    return {
        "RANK": str(topology.rank),
        "WORLD_SIZE": str(topology.size),
        "LOCAL_RANK": str(topology.local_rank),
        "LOCAL_WORLD_SIZE": str(topology.local_size),
        "GROUP_RANK": str(topology.cross_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def rank_environment(
    task_env: Mapping[str, str],
    topology: Topology,
    master_addr: str,
    master_port: int,
    *,
    driver_settings: Mapping[str, str],
    user_env: Mapping[str, str],
    gpus: Sequence[str] = (),
    cpus: Optional[int] = None,
    interfaces: Mapping[str, str],
) -> Dict[str, str]:
    """The environment of one rank's process, from the weakest source to the strongest.

    Args:
        task_env: the Spark task's own environment (the executor's).
        driver_settings: the driver's ``HPDL_*`` and Horovod variables, so that the settings a
            job is run with do not depend on how the executors were started.
        user_env: ``run(env=...)``.
        gpus: the GPUs the rank sees (``Placement.node_gpus``); none: the variable is left as it is.
        cpus: the CPUs Spark gave the task (``spark.task.cpus``): the rank's threads, unless a
            thread count is set already.
        interfaces: the network interface variables of ``run(nics=...)``.
    """
    env = dict(task_env)
    env.update(driver_settings)
    # Output reaches the driver as the rank writes it, not when a pipe's buffer fills.
    env.setdefault("PYTHONUNBUFFERED", "1")
    if cpus and "OMP_NUM_THREADS" not in env and "OMP_NUM_THREADS" not in user_env:
        env["OMP_NUM_THREADS"] = str(cpus)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    env.update(interfaces)
    env.update(user_env)
    env.update(rank_variables(topology, master_addr, master_port))
    return env
