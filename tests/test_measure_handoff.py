"""scripts/measure_handoff.py and scripts/measure_mpi_polling.py, whose figures docs/perf.md
quotes, still run and report sanely."""

import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "measure_handoff.py"


def test_handoff_round_trips_are_ordered_percentiles():
    module = runpy.run_path(str(SCRIPT))
    median, p10, p90 = module["handoff_round_trips"](rounds=100)
    assert 0 < p10 <= median <= p90


def test_script_prints_one_line_per_rank_without_mpiexec():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.startswith("rank 0 of 1: thread hand-off round trip median ")


POLLING = SCRIPT.parent / "measure_mpi_polling.py"


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on PATH (pip install mpich)")
def test_mpi_polling_script_reports_every_kind_of_wait_once():
    out = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(POLLING), "--busy", "--size-kib", "64",
                          "--calls", "3"], capture_output=True, text=True, timeout=120, check=True)
    lines = out.stdout.splitlines()
    assert len(lines) == 4 and lines[0].startswith("64 KiB allreduce, busy core, blocking wait: median ")
    assert [line.split(": median")[0].rsplit(", ", 1)[1] for line in lines[1:]] == [
        "polled every 0.5 ms", "polled every 0.1 ms", "polled every 2 ms"]
