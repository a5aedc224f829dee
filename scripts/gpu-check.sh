#!/usr/bin/env bash
# Validate hpdl on a GPU machine in one command, with no install step: the machine's own Python
# (python3, or PYTHON) runs the checkout through PYTHONPATH. Under 8 minutes; the log and a JSON
# summary go to $OUT, else gpu-check-out/ (docs/gpu.md). Without a CUDA device it says so in one
# line and exits 0. Arguments go to scripts/gpu_check.py (--list, --steps, --budget, --out).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
if ! command -v "$python" >/dev/null 2>&1; then
    echo "gpu-check: no $python on PATH (set PYTHON to the interpreter that has PyTorch); nothing run" >&2
    exit 1
fi
cd "$root" || exit 1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" "$root/scripts/gpu_check.py" "$@"
