"""MPICH's waits sleep rather than spin where a node runs more ranks than it has cores."""

from __future__ import annotations

import pytest

from hpdl.comm import mpi


def _hydra(ranks_here: int, **extra: str) -> dict:
    """The variables MPICH's mpiexec (Hydra) gives rank 0 of ``ranks_here`` ranks on this node."""
    return {"PMI_RANK": "0", "PMI_SIZE": str(ranks_here), "MPI_LOCALRANKID": "0",
            "MPI_LOCALNRANKS": str(ranks_here), **extra}


@pytest.mark.parametrize("ranks_here,cores,expected", [(3, 2, "1"), (2, 2, None), (1, 8, None), (16, 8, "1")])
def test_heavy_yield_is_asked_for_only_where_the_ranks_outnumber_the_cores(monkeypatch, ranks_here, cores, expected):
    monkeypatch.setattr(mpi.os, "cpu_count", lambda: cores)
    env = _hydra(ranks_here)
    mpi.sleep_in_waits_when_ranks_outnumber_cores(env)
    assert env.get(mpi.HEAVY_YIELD) == expected


@pytest.mark.parametrize("chosen", ["0", "1"])
def test_the_users_choice_is_kept(monkeypatch, chosen):
    monkeypatch.setattr(mpi.os, "cpu_count", lambda: 1)
    env = _hydra(4, **{mpi.HEAVY_YIELD: chosen})
    mpi.sleep_in_waits_when_ranks_outnumber_cores(env)
    assert env[mpi.HEAVY_YIELD] == chosen


def test_ranks_counted_per_node_not_in_the_whole_job(monkeypatch):
    # Open MPI's variables: 8 ranks in the job, 2 on this node of 4 cores.
    monkeypatch.setattr(mpi.os, "cpu_count", lambda: 4)
    env = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    mpi.sleep_in_waits_when_ranks_outnumber_cores(env)
    assert mpi.HEAVY_YIELD not in env


def test_a_process_started_without_a_launcher_is_left_alone(monkeypatch):
    monkeypatch.setattr(mpi.os, "cpu_count", lambda: 1)
    env = {"PATH": "/usr/bin"}
    mpi.sleep_in_waits_when_ranks_outnumber_cores(env)
    assert env == {"PATH": "/usr/bin"}
