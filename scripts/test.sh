#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit tests and multi-rank tests under
# mpiexec (1, 2 and 3 ranks) and torchrun. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
# Test files run side by side in HPDL_TEST_WORKERS processes (default 3; 0 runs them in this one):
# a file's tests stay together in one worker (--dist loadfile), so the jobs and clusters a file
# shares among its tests start once.
workers="${HPDL_TEST_WORKERS:-3}"
# Hundreds of processes import hpdl and the tests' rank scripts; where PYTHONDONTWRITEBYTECODE is
# set (as on the development machine) each compiled every module from source again (0.15-0.25 s of
# CPU apiece). Bytecode written once here is read by all of them, and redone where a source changes.
python -m compileall -q hpdl tests >/dev/null
# Not a setting of hpdl, which refuses HPDL_* variables it does not know: the jobs must not see it.
unset HPDL_TEST_WORKERS
# The workers and their jobs' ranks together run more threads than this machine has cores: an
# OpenMP thread that waits then sleeps instead of spinning, which took the cores from the others
# (a bf16 training test beside two busy processes: 14.8 s of CPU spinning, 6.8 s sleeping).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
# Likewise MPICH's blocking waits (MPI_Init, the engine's collectives among the ranks of one
# node): a rank waiting for a peer that has no core spins, yielding the core with sched_yield,
# which the scheduler hands straight back; with heavy yield it sleeps instead. hpdl asks for it
# where a job's ranks outnumber the cores (hpdl/comm/mpi.py); here every job shares the cores with
# the other workers' jobs, so all of them do (test_spatial, test_torch_multirank and
# test_multinode: 824 s of CPU and 448 s spinning, 736 s and 406 s sleeping). Open MPI ignores it.
export MPIR_CVAR_ENABLE_HEAVY_YIELD="${MPIR_CVAR_ENABLE_HEAVY_YIELD:-1}"
if [ "$workers" = 0 ]; then
    exec python -m pytest -q "$@"
fi
exec python -m pytest -q -n "$workers" --dist loadfile --durations=20 "$@"
