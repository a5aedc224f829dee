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
