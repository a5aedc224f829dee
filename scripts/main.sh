#!/usr/bin/env bash
# Set up (if needed) and run the main job on this machine: a 2-rank OSU-style allreduce
# benchmark of hpdl's MPI path beside raw mpi4py. Extra arguments go to `hpdl bench allreduce`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
export OMP_NUM_THREADS=1
exec hpdl run -np 2 -- hpdl bench allreduce --paths backend,mpi4py "$@"
