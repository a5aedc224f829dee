"""Horovod's launcher environment for a rank of `hpdl run`, from what its launcher's variables tell.

horovodrun gives every worker ``HOROVOD_HOSTNAME``, ``HOROVOD_RANK``, ``HOROVOD_SIZE``,
``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE``, ``HOROVOD_CROSS_RANK`` and ``HOROVOD_CROSS_SIZE``,
and scripts written for Horovod read them (to choose a GPU or a shard of the data before
``hvd.init()``, to name a log file). :func:`horovod_environment` gives the ones a rank of `hpdl
run` lacks; :mod:`hpdl.launch.rank_watch`, the parent of every rank's command, adds them.

Horovod's meaning: the local ranks are the ranks on this host; the cross group of a rank is the
hosts that hold a rank of the same local rank, in rank order (on a homogeneous job the cross
rank is the host's index and the cross size the number of hosts).

A variable is given only where the launcher's variables decide it. :func:`discover_topology`
fills the gaps with a guess (local rank 0 of 1, torchrun's hosts all alike) that the backend
corrects later from every rank's host; a script reading a wrong local rank would take another
rank's GPU, while one that finds no variable notices. What each launcher tells:

- torchrun: the local rank and size; the node's index (GROUP_RANK) among GROUP_WORLD_SIZE nodes,
  whose ranks it numbers node after node. Nodes may run different numbers of ranks (`hpdl run -H
  a:4,b:4 -np 6` runs 4 and 2), so the cross rank is the node's index only for local rank 0,
  which every node has, or where torchrun was told that the nodes are alike
  (TORCH_ELASTIC_WORKER_IDENTICAL=1).
- Open MPI, MVAPICH2, MPICH's and Intel MPI's Hydra: the local rank and size, but no index of the
  host (Open MPI's OMPI_COMM_WORLD_NODE_RANK counts processes on the node, not nodes).
- srun: SLURM_LOCALID, the step's tasks on every node (SLURM_STEP_TASKS_PER_NODE) and this node's
  index (SLURM_NODEID), from which the cross rank and size follow, as srun numbers the tasks in
  node order under every distribution but an arbitrary one. These describe the ranks only where
  srun started them (SLURM_PROCID is the rank); an mpiexec inside an allocation starts its own
  daemons with srun, whose variables its ranks inherit.
- on one host (local size = size) the cross rank is 0 of 1 under every launcher.

No launcher's variables at all (a process started by hand) gives nothing: such a process is not
known to be a job of one.
"""

from __future__ import annotations

import socket
from typing import Dict, List, Mapping, NamedTuple, Optional, Tuple

from hpdl.comm.topology import discover_topology, slurm_tasks_per_node

# Each launcher's own (local rank, local size), as discover_topology names the launcher; the
# first pair that is set wins.
_LOCAL_VARIABLES = {
    "torchrun": (("LOCAL_RANK", "LOCAL_WORLD_SIZE"),),
    "mpi-openmpi": (("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),),
    "mpi-mvapich2": (("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),),
    "mpi-pmi": (("MPI_LOCALRANKID", "MPI_LOCALNRANKS"), ("PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE")),
}


class _SlurmStep(NamedTuple):
    local_rank: int
    node: int  # this node's index in the step
    tasks: List[int]  # every node's task count, in node order


def _count(env: Mapping[str, str], name: str) -> Optional[int]:
    """The variable as a count or an index (0 or more); None when unset or not one."""
    try:
        value = int(env.get(name, ""))
    except ValueError:
        return None
    return value if value >= 0 else None


def _launcher_local(env: Mapping[str, str], launcher: str) -> Optional[Tuple[int, int]]:
    for rank_name, size_name in _LOCAL_VARIABLES.get(launcher, ()):
        local_rank, local_size = _count(env, rank_name), _count(env, size_name)
        if local_rank is not None and local_size is not None:
            return local_rank, local_size
    return None


def _slurm_step(env: Mapping[str, str], rank: int, size: int) -> Optional[_SlurmStep]:
    """The layout of the srun step whose tasks are the ranks, or None where srun did not start them."""
    # SLURM_STEP_NUM_TASKS, not SLURM_NTASKS: a batch script's variables describe the allocation.
    if _count(env, "SLURM_PROCID") != rank or _count(env, "SLURM_STEP_NUM_TASKS") != size:
        return None
    local_rank, node = _count(env, "SLURM_LOCALID"), _count(env, "SLURM_NODEID")
    tasks = slurm_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "")))
    if local_rank is None or node is None or tasks is None or sum(tasks) != size or node >= len(tasks) \
            or local_rank >= tasks[node]:
        return None
    nodes = _count(env, "SLURM_STEP_NUM_NODES")
    if nodes is not None and nodes != len(tasks):
        return None
    return _SlurmStep(local_rank, node, tasks)


def _cross(env: Mapping[str, str], launcher: str, local_rank: int, local_size: int, size: int,
           slurm: Optional[_SlurmStep]) -> Optional[Tuple[int, int]]:
    """This rank's cross rank and size where the variables decide them, else None."""
    if local_size == size:  # one host holds every rank
        return 0, 1
    if slurm is not None:
        if env.get("SLURM_DISTRIBUTION", "").startswith("arbitrary"):
            return None  # tasks placed as a host file lists them: node order need not be rank order
        before = sum(1 for tasks in slurm.tasks[:slurm.node] if tasks > local_rank)
        return before, sum(1 for tasks in slurm.tasks if tasks > local_rank)
    if launcher == "torchrun":
        node, nodes = _count(env, "GROUP_RANK"), _count(env, "GROUP_WORLD_SIZE")
        if node is None or nodes is None or node >= nodes:
            return None
        identical = env.get("TORCH_ELASTIC_WORKER_IDENTICAL") == "1" and nodes * local_size == size
        if local_rank == 0 or identical:
            return node, nodes
    return None


def known_layout(env: Mapping[str, str]) -> Dict[str, int]:
    """The Horovod layout variables but the host name, by name, that ``env``'s launcher variables
    decide (see the module's docstring); empty where no launcher's variables are found."""
    try:
        topology = discover_topology(env)
    except ValueError:  # a launcher's variable that is not a number: nothing is sure
        return {}
    rank, size = topology.rank, topology.size
    if topology.launcher == "single" or rank is None or size is None or not 0 <= rank < size:
        return {}
    layout = {"HOROVOD_RANK": rank, "HOROVOD_SIZE": size}
    local = _launcher_local(env, topology.launcher)
    slurm = _slurm_step(env, rank, size)
    if slurm is not None and local is not None and local != (slurm.local_rank, slurm.tasks[slurm.node]):
        slurm = None  # the step's tasks are not the MPI's ranks
    if local is None and slurm is not None:  # srun's own tasks, or MPI ranks through srun's PMI
        local = slurm.local_rank, slurm.tasks[slurm.node]
    if local is None or not 0 <= local[0] < local[1] <= size:
        return layout
    layout.update(HOROVOD_LOCAL_RANK=local[0], HOROVOD_LOCAL_SIZE=local[1])
    cross = _cross(env, topology.launcher, local[0], local[1], size, slurm)
    if cross is not None:
        layout.update(HOROVOD_CROSS_RANK=cross[0], HOROVOD_CROSS_SIZE=cross[1])
    return layout


def horovod_environment(env: Mapping[str, str]) -> Dict[str, str]:
    """The Horovod launcher variables to add to ``env`` for the command of a rank: those its
    launcher's variables decide and ``env`` does not set already (the user's or a launcher's own
    win), and the host name with them."""
    layout = known_layout(env)
    if not layout:
        return {}
    values = {"HOROVOD_HOSTNAME": socket.gethostname(), **{name: str(value) for name, value in layout.items()}}
    return {name: value for name, value in values.items() if name not in env}
