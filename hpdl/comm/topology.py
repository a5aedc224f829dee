"""Discover this process's place in the job: rank, size, local and cross ranks.

One function, :func:`discover_topology`, reads the variables that launchers set (torchrun,
Open MPI, MVAPICH2, MPICH/Hydra and Intel MPI through PMI, Slurm's srun) and falls back to a
single process. Where the environment does not tell the node layout (MPICH's Hydra gives no
cross rank, for instance), :func:`topology_from_ranks` completes it from each rank's host,
which the backend learns by asking MPI (split by shared memory) or by an allgather.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from typing import List, Mapping, Optional, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this process sits: global, node-local (``local_*``) and across-node (``cross_*``)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: Optional[int]
    cross_size: Optional[int]
    launcher: str  # "torchrun", "mpi-openmpi", "mpi-mvapich2", "mpi-pmi", "srun" or "single"

    @property
    def is_mpi_launch(self) -> bool:
        return self.launcher.startswith("mpi") or self.launcher == "srun"

    @property
    def complete(self) -> bool:
        return self.cross_rank is not None and self.cross_size is not None


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return None


def slurm_tasks_per_node(tasks_per_node: str) -> Optional[List[int]]:
    """Every node's task count, in node order, from Slurm's compressed form (``"2(x3),1"`` is
    ``[2, 2, 2, 1]``); None where the text is not of that form."""
    counts: List[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            return None
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> Optional[int]:
    """Tasks on node ``node_id`` from Slurm's compressed form, e.g. ``"2(x3),1"``."""
    counts = slurm_tasks_per_node(tasks_per_node)
    return counts[node_id] if counts is not None and 0 <= node_id < len(counts) else None


def discover_topology(env: Optional[Mapping[str, str]] = None) -> Topology:
    """Return the topology that the launcher's environment variables describe.

    Args:
        env: the environment to read (default ``os.environ``).
    """
    env = os.environ if env is None else env

    # torchrun (torch.distributed.run) and anything that follows its convention.
    if "RANK" in env and "WORLD_SIZE" in env and ("LOCAL_RANK" in env or "TORCHELASTIC_RUN_ID" in env):
        rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK") or 0
        local_size = _int(env, "LOCAL_WORLD_SIZE") or size
        cross_rank = _int(env, "GROUP_RANK")
        cross_size = size // local_size if size % local_size == 0 else None
        return Topology(rank, size, local_rank, local_size, cross_rank, cross_size, "torchrun")

    # Open MPI (mpirun / mpiexec / prterun).
    if "OMPI_COMM_WORLD_RANK" in env:
        return Topology(
            _int(env, "OMPI_COMM_WORLD_RANK"),
            _int(env, "OMPI_COMM_WORLD_SIZE"),
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") or 0,
            _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") or 1,
            None,
            None,
            "mpi-openmpi",
        )

    # MVAPICH2 (mpirun_rsh or its Hydra).
    if "MV2_COMM_WORLD_RANK" in env:
        return Topology(
            _int(env, "MV2_COMM_WORLD_RANK"),
            _int(env, "MV2_COMM_WORLD_SIZE"),
            _int(env, "MV2_COMM_WORLD_LOCAL_RANK") or 0,
            _int(env, "MV2_COMM_WORLD_LOCAL_SIZE") or 1,
            None,
            None,
            "mpi-mvapich2",
        )

    # MPICH / Intel MPI (Hydra, PMI-1 or PMI-2) and PMIx-based launchers.
    if "PMI_RANK" in env or "PMIX_RANK" in env:
        rank = _int(env, "PMI_RANK", "PMIX_RANK")
        size = _int(env, "PMI_SIZE", "PMIX_SIZE")
        if size is None:
            size = _int(env, "SLURM_STEP_NUM_TASKS")
        local_rank = _int(env, "MPI_LOCALRANKID", "PMIX_LOCAL_RANK")
        local_size = _int(env, "MPI_LOCALNRANKS", "PMIX_LOCAL_SIZE")
        if size is not None:
            return Topology(
                rank,
                size,
                local_rank if local_rank is not None else 0,
                local_size if local_size is not None else 1,
                None,
                None,
                "mpi-pmi",
            )

    # Slurm's srun. SLURM_STEP_NUM_TASKS is set for job steps only, not in the batch script,
    # where SLURM_PROCID=0 and SLURM_NTASKS describe the allocation, not this process.
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        rank, size = _int(env, "SLURM_PROCID"), _int(env, "SLURM_STEP_NUM_TASKS")
        node_id = _int(env, "SLURM_NODEID") or 0
        nodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
        local_size = _slurm_tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "")), node_id)
        return Topology(
            rank,
            size,
            _int(env, "SLURM_LOCALID") or 0,
            local_size or 1,
            node_id,
            nodes,
            "srun",
        )

    return Topology(0, 1, 0, 1, 0, 1, "single")


class WorldSizeError(ValueError):
    """The world a backend formed is not the size that the launcher announced."""


# The variable in which each launcher (as :func:`discover_topology` names it) announces the
# world size. Slurm's SLURM_NTASKS is not among them: in a batch script or an salloc shell it
# describes the allocation, where a plain ``python job.py`` is rightly a world of one.
_SIZE_VARIABLES = {
    "torchrun": ("WORLD_SIZE",),
    "mpi-openmpi": ("OMPI_COMM_WORLD_SIZE",),
    "mpi-mvapich2": ("MV2_COMM_WORLD_SIZE",),
    "mpi-pmi": ("PMI_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS"),
    "srun": ("SLURM_STEP_NUM_TASKS",),
}
_LIKELY_CAUSES = {
    "SLURM_STEP_NUM_TASKS": "srun started the tasks without an MPI plugin that their MPI understands, so each "
    "began a world of its own: start them with `srun --mpi=pmi2` (MPICH, Intel MPI, MVAPICH2) or "
    "`srun --mpi=pmix` (Open MPI), or with `hpdl run`, which passes the plugin",
    "WORLD_SIZE": "torchrun starts no MPI world, so backend mpi gives every rank a world of its own: "
    "use backend gloo under torchrun, or start the ranks with mpiexec",
}
_MPI_MISMATCH = ("the MPI library that mpi4py loads is not the one whose launcher started the ranks (for example "
                 "mpi4py built for Open MPI under MPICH's mpiexec): start them with the mpiexec of mpi4py's MPI")


def announced_world_size(env: Mapping[str, str]) -> Optional[Tuple[int, str]]:
    """Return the world size that the launcher announced and the variable holding it, or None."""
    topology = discover_topology(env)
    for name in _SIZE_VARIABLES.get(topology.launcher, ()):
        if env.get(name):
            return topology.size, name
    return None


def check_world_size(size: int, env: Mapping[str, str]) -> None:
    """Raise :class:`WorldSizeError` when a world of ``size`` ranks is not the launcher's.

    Args:
        size: the size of the world communicator the backend formed.
        env: the launcher's environment (normally ``os.environ``).
    """
    announced = announced_world_size(env)
    if announced is None or announced[0] == size:
        return
    expected, name = announced
    raise WorldSizeError(
        f"this process is in a world of {size} rank{'s' if size != 1 else ''}, but the launcher announced {expected} "
        f"({name}={env[name]}); likely cause: {_LIKELY_CAUSES.get(name, _MPI_MISMATCH)}"
    )


# A launcher that knows the nodes better than host names do sets this (hpdl.ray: Ray's node
# id, so that two raylets of one machine are two nodes, as Ray places them).
NODE_VARIABLE = "HPDL_NODE_ID"


def host_identity() -> str:
    """Return the node this process runs on, as ranks are grouped into nodes.

    The host name plus, where Linux shows it, the network namespace (as Horovod's host hash):
    two containers of one machine that share its host name but each have a network of their
    own reach each other only over the network, not through loopback or shared memory, so
    they are two nodes. ``HPDL_NODE_ID``, where the launcher sets it, is added: ranks with
    different ids are different nodes.
    """
    given = os.environ.get(NODE_VARIABLE)
    name = socket.gethostname() + (f"/{given}" if given else "")
    try:
        namespace = os.readlink("/proc/self/ns/net")  # "net:[4026531840]"
    except OSError:  # not Linux, or /proc not mounted
        return name
    return f"{name}/{namespace}"


def topology_from_ranks(rank: int, hosts: Sequence[str], launcher: str) -> Topology:
    """Complete a topology from the host of every rank (``hosts[r]`` is rank r's node).

    As in Horovod, local ranks count within a node in rank order, and the cross group of a
    rank holds the ranks with the same local rank on every node (so on a homogeneous job the
    cross rank is the node's index and the cross size the number of nodes).
    """
    local_ranks: List[int] = []
    seen: dict = {}
    for host in hosts:
        local_ranks.append(seen.get(host, 0))
        seen[host] = local_ranks[-1] + 1
    mine = local_ranks[rank]
    cross_peers = [r for r, lr in enumerate(local_ranks) if lr == mine]
    return Topology(
        rank=rank,
        size=len(hosts),
        local_rank=mine,
        local_size=seen[hosts[rank]],
        cross_rank=cross_peers.index(rank),
        cross_size=len(cross_peers),
        launcher=launcher,
    )
