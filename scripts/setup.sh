#!/usr/bin/env bash
# Set up a virtual environment in .venv with hpdl and everything its jobs and tests need.
# Idempotent: a stamp of this script and pyproject.toml skips the work when nothing changed.
# Source it (". scripts/setup.sh") to get the environment activated in the calling shell.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${HPDL_VENV:-$root/.venv}"
python="${PYTHON:-python3}"

# A bare `torch` requirement resolves to a multi-GB CUDA build; on a CPU-only x86-64 machine
# the CPU build is enough, and this pinned version is the one the package index of the
# machines this project runs on serves as a CPU build. HPDL_TORCH_SPEC overrides (e.g.
# "torch==2.13.0+cpu" with PyTorch's CPU index configured for pip, or "torch").
torch_spec="${HPDL_TORCH_SPEC:-torch==2.13.0}"

stamp="$venv/.hpdl-setup-stamp"
want="$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" | sha256sum | cut -d' ' -f1) $torch_spec"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "hpdl setup: creating $venv (one-time, about a minute)" >&2
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "$torch_spec" >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$root[mpi,sr,test,profile,spark,ray]" >&2
    echo "$want" > "$stamp"
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"
