"""scripts/measure_handoff.py, scripts/measure_mpi_polling.py, scripts/measure_mpi_progress.py,
scripts/measure_half_reduction.py, scripts/link_use.py and scripts/measure_one_rank.py, whose figures docs/perf-notes/ quotes, still run and report sanely."""

import os
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


PROGRESS = SCRIPT.parent / "measure_mpi_progress.py"


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on PATH (pip install mpich)")
def test_mpi_progress_script_reports_each_setting_once_with_rates():
    out = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(PROGRESS), "--tests", "1,4", "--polls-ms", "0.5",
                          "--size-mb", "0.1", "--count", "4", "--repeats", "1"],
                         capture_output=True, text=True, timeout=120, check=True)
    lines = out.stdout.splitlines()
    assert len(lines) == 4 and lines[1].split() == ["tests", "poll", "ms", "MB/s", "CPU", "ms", "wake-ups"]
    rows = [line.split() for line in lines[2:]]
    assert [(row[0], row[1]) for row in rows] == [("1", "0.5"), ("4", "0.5")]
    assert all(float(row[2]) > 0 for row in rows)


def test_mpi_progress_script_refuses_bad_settings_in_one_line():
    out = subprocess.run([sys.executable, str(PROGRESS), "--tests", "1,0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--tests" in out.stderr and "Traceback" not in out.stderr


HALF = SCRIPT.parent / "measure_half_reduction.py"


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on PATH (pip install mpich)")
def test_half_reduction_script_compares_both_sums_and_finds_them_equal():
    out = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(HALF), "--repeats", "1", "--sizes-mb", "0.5,0.01"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr  # 1 when the two sums differ
    lines = out.stdout.splitlines()
    if "no MPI float16 type" in out.stdout:
        pytest.skip(lines[0])
    assert len(lines) == 4 and lines[1].split() == ["MB", "MPI", "FLOAT16_T", "ms", "torch", "op", "ms", "ratio"]
    assert [float(line.split()[0]) for line in lines[2:]] == [0.5, 0.01]
    assert all(float(value) > 0 for line in lines[2:] for value in line.split()[1:])


def test_half_reduction_script_refuses_bad_sizes_in_one_line():
    out = subprocess.run([sys.executable, str(HALF), "--sizes-mb", "big"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--sizes-mb" in out.stderr and "Traceback" not in out.stderr


LINK_USE = SCRIPT.parent / "link_use.py"


def _profile(rank_starts):
    """Two ranks, four 10 ms steps; per rank, allreduces of 1 MB as (seq, start ms, duration ms)."""
    columns = ["seq", "step", "kind", "bytes", "start_us", "copy_in_us", "backend_us"]
    steps = {"columns": ["step", "start_us", "end_us"], "rows": [[i, i * 10e3, (i + 1) * 10e3] for i in range(4)]}
    ranks = []
    for flights in rank_starts:
        rows = [[seq, int(start // 10), "allreduce", 1_000_000, start * 1e3, 0.0, dur * 1e3]
                for seq, start, dur in flights]
        ranks.append({"collectives": {"columns": columns, "rows": rows}, "steps": steps,
                      "clock_offset_us": 0.0, "clock_offset_applied": True})
    return {"ranks": ranks}


def test_link_use_counts_an_allreduce_from_the_last_rank_to_start():
    module = runpy.run_path(str(LINK_USE))
    # in steps 2 and 3: rank 1 starts each allreduce 2 ms after rank 0; both end together
    rank0 = [(0, 20.0, 6.0), (1, 30.0, 6.0), (2, 33.0, 3.0)]
    rank1 = [(0, 22.0, 4.0), (1, 32.0, 4.0), (2, 33.0, 3.0)]
    result = module["link_use"](_profile([rank0, rank1]))
    assert result["steps"] == 2 and result["step_ms"] == 10.0
    # busy 22-26 and 32-36 ms: 8 of 20 ms; 3 MB in 8 ms
    assert abs(result["busy_share"] - 0.4) < 1e-9
    assert abs(result["rate_mb_s"] - 3e6 / 8e3) < 1e-6
    assert [(a / 1e3, b / 1e3) for a, b in result["gaps"]] == [(26.0, 32.0)]


def test_link_use_refuses_a_file_it_cannot_read_in_one_line(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    out = subprocess.run([sys.executable, str(LINK_USE), str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and str(bad) in out.stderr


ONE_RANK = SCRIPT.parent / "measure_one_rank.py"


def test_one_rank_script_reports_both_models_phase_by_phase_and_the_hooks():
    out = subprocess.run([sys.executable, str(ONE_RANK), "--steps", "2", "--patch", "8", "--batch-size", "1"],
                         capture_output=True, text=True, timeout=180, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = out.stdout.splitlines()
    assert lines[0].startswith("edsr-baseline, batch 1 of 8 px, 1 thread(s), 2 steps each")
    assert [line.split()[0] for line in lines[1:3]] == ["plain", "hpdl"]
    assert 0 < float(lines[3].rsplit(": ", 1)[1]) < 10  # hpdl/plain
    hooks = lines[4].split("the 72 gradient hooks ")[1].split(" ms")[0]
    assert float(hooks) > 0


def test_one_rank_script_refuses_bad_settings_in_one_line():
    out = subprocess.run([sys.executable, str(ONE_RANK), "--steps", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--steps" in out.stderr and "Traceback" not in out.stderr
