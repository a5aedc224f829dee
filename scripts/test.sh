#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit tests and multi-rank tests under
# mpiexec (1, 2 and 3 ranks) and torchrun. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
exec python -m pytest -q "$@"
