#!/usr/bin/env bash
# Set up a second virtual environment, .venv-openmpi, whose mpi4py is built against the
# system's Open MPI (Debian: openmpi-bin libopenmpi-dev), for the tests that run jobs under
# Open MPI's mpiexec too. Without Open MPI's compiler wrapper it says why and exits 0: those
# tests then skip with the same reason. Idempotent, like setup.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-openmpi"
python="${PYTHON:-python3}"
torch_spec="${HPDL_TORCH_SPEC:-torch==2.13.0}"
mpicc="$(command -v mpicc.openmpi || true)"

if [ -z "$mpicc" ] || ! command -v mpiexec.openmpi >/dev/null; then
    echo "hpdl setup-openmpi: skipped: Open MPI not installed (mpicc.openmpi/mpiexec.openmpi not found)" >&2
    exit 0
fi
stamp="$venv/.hpdl-setup-stamp"
want="$(cat "$root/pyproject.toml" "$root/scripts/setup-openmpi.sh" | sha256sum | cut -d' ' -f1) $torch_spec $mpicc"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "hpdl setup-openmpi: creating $venv (one-time, a few minutes: mpi4py is compiled)" >&2
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
    "${pip[@]}" --upgrade pip >&2
    "${pip[@]}" "$torch_spec" >&2
    # --no-binary: the wheel on PyPI is linked against its own MPI, not the system's.
    MPICC="$mpicc" "${pip[@]}" --no-binary mpi4py --no-cache-dir mpi4py >&2
    "${pip[@]}" -e "$root[test]" >&2
    echo "$want" > "$stamp"
fi
