"""Rank discovery from each launcher's variables, and backend choice."""

import os
import socket

import pytest

from hpdl.comm import (
    CommError, WorldSizeError, announced_world_size, check_world_size, choose_backend, discover_topology,
    host_identity, topology_from_ranks,
)


def test_single_process():
    topo = discover_topology({})
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size, topo.cross_rank, topo.cross_size) == (0, 1, 0, 1, 0, 1)
    assert topo.launcher == "single"


def test_torchrun():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           "TORCHELASTIC_RUN_ID": "x"}
    topo = discover_topology(env)
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size, topo.cross_rank, topo.cross_size) == (5, 8, 1, 4, 1, 2)
    assert topo.launcher == "torchrun"


def test_open_mpi():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    topo = discover_topology(env)
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size) == (3, 4, 1, 2)
    assert topo.launcher == "mpi-openmpi" and topo.is_mpi_launch and not topo.complete


def test_mvapich2():
    env = {"MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "6", "MV2_COMM_WORLD_LOCAL_RANK": "0",
           "MV2_COMM_WORLD_LOCAL_SIZE": "3"}
    topo = discover_topology(env)
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size, topo.launcher) == (2, 6, 0, 3, "mpi-mvapich2")


def test_mpich_hydra():
    env = {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}
    topo = discover_topology(env)
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size, topo.launcher) == (1, 3, 1, 3, "mpi-pmi")


def test_srun_step():
    env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "6", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "2", "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_TASKS_PER_NODE": "2(x3)"}
    topo = discover_topology(env)
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size, topo.cross_rank, topo.cross_size) == (5, 6, 1, 2, 2, 3)
    assert topo.launcher == "srun"


def test_slurm_batch_script_is_not_a_step():
    # In an sbatch script SLURM_PROCID=0 and SLURM_NTASKS describe the allocation, not us.
    env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)"}
    assert discover_topology(env).launcher == "single"


def test_uneven_slurm_tasks_per_node():
    env = {"SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "5", "SLURM_NODEID": "1", "SLURM_LOCALID": "0",
           "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "4,1"}
    assert discover_topology(env).local_size == 1


def test_bad_integer_names_the_variable():
    with pytest.raises(ValueError, match="PMI_RANK"):
        discover_topology({"PMI_RANK": "x", "PMI_SIZE": "2"})


def test_topology_from_hosts_matches_horovod_cross_groups():
    hosts = ["a", "a", "b", "b", "c"]
    t = topology_from_ranks(3, hosts, "mpi")
    assert (t.local_rank, t.local_size, t.cross_rank, t.cross_size) == (1, 2, 1, 2)
    t = topology_from_ranks(4, hosts, "mpi")
    assert (t.local_rank, t.local_size, t.cross_rank, t.cross_size) == (0, 1, 2, 3)


@pytest.mark.parametrize(
    "requested,launcher_env,mpi,expected",
    [
        ("auto", {"PMI_RANK": "0", "PMI_SIZE": "2"}, True, "mpi"),
        ("auto", {"PMI_RANK": "0", "PMI_SIZE": "2"}, False, "gloo"),
        ("auto", {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, True, "gloo"),
        ("auto", {}, True, "mpi"),
        ("gloo", {"PMI_RANK": "0", "PMI_SIZE": "2"}, True, "gloo"),
        ("torch", {}, True, "gloo"),
    ],
)
def test_choose_backend(requested, launcher_env, mpi, expected):
    assert choose_backend(requested, discover_topology(launcher_env), mpi) == expected


def test_choose_mpi_without_mpi4py_is_a_clear_error():
    with pytest.raises(CommError, match="mpi4py"):
        choose_backend("mpi", discover_topology({}), False)


# --- the world size a launcher announces, checked by hvd.init() ----------------------------

SRUN_STEP = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}


@pytest.mark.parametrize("env, announced", [
    ({}, None),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, (4, "WORLD_SIZE")),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3"}, (3, "OMPI_COMM_WORLD_SIZE")),
    ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "5"}, (5, "MV2_COMM_WORLD_SIZE")),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, (2, "PMI_SIZE")),
    ({"PMIX_RANK": "0", "PMIX_SIZE": "6"}, (6, "PMIX_SIZE")),
    (SRUN_STEP, (2, "SLURM_STEP_NUM_TASKS")),
    # An salloc shell or a batch script: SLURM_NTASKS is the allocation's, not this process's world.
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, None),
    # mpiexec inside an srun step: the launcher that started this process speaks, not the step.
    ({**SRUN_STEP, "SLURM_STEP_NUM_TASKS": "1", "PMI_RANK": "2", "PMI_SIZE": "4"}, (4, "PMI_SIZE")),
    ({**SRUN_STEP, "RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0"}, (8, "WORLD_SIZE")),
])
def test_announced_world_size(env, announced):
    assert announced_world_size(env) == announced


@pytest.mark.parametrize("env, size", [
    ({}, 1), ({}, 3), (SRUN_STEP, 2), ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"}, 1),
])
def test_check_world_size_accepts_the_announced_size_or_no_announcement(env, size):
    check_world_size(size, env)


@pytest.mark.parametrize("env, fragments", [
    (SRUN_STEP, ["world of 1 rank,", "announced 2 (SLURM_STEP_NUM_TASKS=2)", "srun --mpi=pmi2", "srun --mpi=pmix"]),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, ["announced 2 (PMI_SIZE=2)", "mpi4py loads is not the one"]),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, ["announced 2 (WORLD_SIZE=2)", "torchrun starts no MPI world"]),
])
def test_check_world_size_names_both_sizes_the_variable_and_the_cause(env, fragments):
    with pytest.raises(WorldSizeError) as caught:
        check_world_size(1, env)
    assert isinstance(caught.value, ValueError)
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_host_identity_is_the_host_name_and_the_network_namespace():
    identity = host_identity()
    assert identity.split("/")[0] == socket.gethostname()
    if os.path.exists("/proc/self/ns/net"):
        assert identity == f"{socket.gethostname()}/{os.readlink('/proc/self/ns/net')}"
