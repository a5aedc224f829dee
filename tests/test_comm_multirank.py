"""Backend collectives on several ranks, under mpiexec (MPI) and torchrun (gloo)."""

import pytest

from ranks import LAYOUT_IDS, LAYOUTS, run_ranks

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("launcher,n", LAYOUTS, ids=LAYOUT_IDS)
def test_every_collective_every_dtype(launcher, n):
    result = run_ranks("comm_collectives.py", n, launcher)
    assert "OK comm collectives" in result.stdout


def test_gloo_backend_under_mpiexec():
    # HPDL_BACKEND overrides the automatic choice; rendezvous goes through MPI.
    result = run_ranks("comm_collectives.py", 2, "mpiexec", env={"HPDL_BACKEND": "gloo"})
    assert "backend=gloo" in result.stdout


@pytest.mark.parametrize("launcher,n", [("mpiexec", 3), ("mpiexec", 4), ("torchrun", 4)])
def test_hierarchical_allreduce_matches_flat(launcher, n):
    result = run_ranks("comm_hierarchical.py", n, launcher)
    assert "OK hierarchical allreduce" in result.stdout


def test_hierarchical_setting_runs_the_api():
    result = run_ranks("engine_behaviour.py", 2, "mpiexec", env={"HPDL_HIERARCHICAL_ALLREDUCE": "1"})
    assert "OK engine behaviour" in result.stdout
