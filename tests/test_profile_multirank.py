"""The profiler on real jobs: recording without code changes, from code, across shutdown/init,
on the failure path, and the report, timeline and HTML page of a real profile."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from hpdl.profile import schema
from hpdl.profile.recorder import core_wait_ns
from ranks import ROOT, SCRIPTS, run_ranks

pytestmark = pytest.mark.multirank


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "hpdl", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=120)


def _rows(rank: dict, table: str) -> list:
    return list(schema.records(rank, table))


@pytest.fixture(scope="module")
def edsr_profile(tmp_path_factory):
    """An unchanged EDSR-baseline Horovod script, profiled by HPDL_PROFILE alone (a relative path)."""
    if shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not found (pip install 'hpdl[mpi]')")
    cwd = tmp_path_factory.mktemp("edsr")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HPDL_PROFILE": "p.json"}
    result = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(SCRIPTS / "profile_train.py"), "5"],
                            capture_output=True, text=True, cwd=cwd, env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "p.json"


def test_environment_variable_records_every_rank_of_an_unchanged_script(edsr_profile):
    data = schema.load(str(edsr_profile))
    assert data["version"] == schema.VERSION and data["job"]["size"] == 2 and data["job"]["missing_ranks"] == []
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for rank in data["ranks"]:
        steps = _rows(rank, "steps")
        assert [s["step"] for s in steps] == [0, 1, 2, 3, 4]  # one per optimizer.step()
        assert all(s["end_us"] > s["start_us"] and s["blocked_us"] >= 0 for s in steps)
        if core_wait_ns() is not None:  # Linux: the training thread's wait for a core, every step
            assert all(s["core_wait_us"] is not None and s["core_wait_us"] >= 0 for s in steps)
        grads = [c for c in _rows(rank, "collectives") if c["kind"] == "allreduce"]
        # Every gradient reduced once per step, with its bytes; fused messages carry several.
        names = rank["tensors"]
        reduced = [names[i] for c in grads for i in c["names"]]
        assert len(reduced) == 5 * len(set(reduced)) and all(n.startswith("allreduce.") for n in reduced)
        for c in grads:
            assert c["bytes"] == sum(c["sizes"]) and c["tensors"] == len(c["names"]) == len(c["sizes"])
            assert c["backend"] == "mpi" and c["dtype"] == "float32" and c["backend_us"] > 0
            assert min(c["queue_us"], c["negotiate_us"], c["copy_in_us"], c["copy_out_us"]) >= 0
            assert (c["copy_in_us"] > 0) == (c["tensors"] > 1)  # a lone tensor is reduced where it lies
        assert any(c["tensors"] > 1 for c in grads)


def test_report_shows_size_classes_and_exposed_communication(edsr_profile, tmp_path):
    html = tmp_path / "report.html"
    result = _cli("profile", "report", str(edsr_profile), "--html", str(html))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for label in ("<= 128 KiB", "128 KiB-16 MiB", "16 MiB-32 MiB", "32 MiB-64 MiB", "> 64 MiB"):
        assert f"\n{label} " in out, out
    assert "exposed comm ms" in out and "efficiency" in out and "Findings" in out
    assert "exposed communication is" in out  # a finding tied to the step's numbers
    page = html.read_text()
    assert page.count("<svg") >= 4 and "<script" not in page


def test_custom_buckets_relabel_the_classes(edsr_profile):
    out = _cli("profile", "report", str(edsr_profile), "--buckets", "1K,1M").stdout
    assert "\n<= 1 KiB " in out and "\n1 KiB-1 MiB " in out and "\n> 1 MiB " in out


def test_timeline_has_one_track_per_rank_with_phases(edsr_profile, tmp_path):
    trace = tmp_path / "trace.json"
    assert _cli("profile", "timeline", str(edsr_profile), "-o", str(trace)).returncode == 0
    events = json.loads(trace.read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(processes) == [0, 1] and processes[1].startswith("rank 1")
    names = {e["name"] for e in events}
    assert {"compute", "copy in", "MPI_ALLREDUCE", "copy out", "queue wait", "negotiation"} <= names


def test_compare_puts_two_runs_side_by_side(edsr_profile):
    result = _cli("profile", "compare", str(edsr_profile), str(edsr_profile))
    assert result.returncode == 0, result.stderr
    assert "+0%" in result.stdout and "efficiency estimate" in result.stdout


def test_start_stop_profile_step_and_a_subscription_across_shutdown_and_init(tmp_path):
    path = tmp_path / "api.json"
    out = run_ranks("profile_api.py", 2, "mpiexec", args=["api", str(path)]).stdout
    data = schema.load(str(path))
    for rank in data["ranks"]:
        assert len(_rows(rank, "steps")) == 3  # hvd.profile_step() between start and stop only
        names = {rank["tensors"][i] for c in _rows(rank, "collectives") for i in c["names"]}
        assert names == {"grad.0", "grad.1", "grad.2"}
    assert "SUBSCRIBER second_engine_names=['again.0', 'again.1', 'again.2']" in out


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_recording_survives_shutdown_and_init(tmp_path, launcher):
    path = tmp_path / "survive.json"
    run_ranks("profile_api.py", 2, launcher, args=["survive", str(path)], env={"HPDL_PROFILE": str(path)})
    data = schema.load(str(path))
    assert data["job"]["backend"] == ("mpi" if launcher == "mpiexec" else "gloo")
    for rank in data["ranks"]:
        assert len(_rows(rank, "steps")) == 5  # both init() spans, written at the last shutdown
        assert sum(m["calls"] * m["tensors"] for m in _rows(rank, "messages") if m["kind"] == "allreduce") == 15


def test_failed_engine_writes_parts_and_rank_0_merges_them(tmp_path):
    path = tmp_path / "abort.json"
    env = {"HPDL_STALL_WARNING": "1", "HPDL_STALL_TIMEOUT": "3"}
    result = run_ranks("profile_api.py", 2, "mpiexec", args=["abort", str(path)], env=env, timeout=90,
                       expect_ok=False)
    out = result.stdout
    assert out.count("RAISED") == 2, out
    assert result.returncode != 0  # after the failure the job is aborted, not finalized
    assert "at shutdown failed" not in result.stderr, result.stderr[-3000:]  # the failure path raises nothing
    data = schema.load(str(path))
    assert [r["rank"] for r in data["ranks"]] == [0, 1] and data["job"]["missing_ranks"] == []
    assert all(len(_rows(r, "steps")) == 2 for r in data["ranks"])
    assert not list(tmp_path.glob("abort.json.rank*"))  # merged parts are removed


def test_rank_reaching_shutdown_after_rank_0_gave_up_joins_the_file(tmp_path):
    path = tmp_path / "late.json"
    run_ranks("profile_api.py", 2, "mpiexec", args=["late", str(path)], timeout=90)
    data = schema.load(str(path))
    assert [r["rank"] for r in data["ranks"]] == [0, 1] and data["job"]["missing_ranks"] == []
    assert all(len(_rows(r, "steps")) == 2 for r in data["ranks"])
    assert not list(tmp_path.glob("late.json.rank*"))


def test_rank_dying_from_an_exception_ends_the_job_promptly_with_both_parts(tmp_path):
    # HPDL_STALL_TIMEOUT keeps its default (30 min): a gather at the dying rank's exit would hang.
    path = tmp_path / "crash.json"
    result = run_ranks("profile_api.py", 2, "mpiexec", args=["crash", str(path)], timeout=60, expect_ok=False)
    assert result.returncode != 0
    assert "rank 1 fails" in result.stderr
    assert "at shutdown failed" not in result.stderr, result.stderr[-3000:]
    data = schema.load(str(path))
    assert [r["rank"] for r in data["ranks"]] == [0, 1] and data["job"]["missing_ranks"] == []
    assert all(len(_rows(r, "steps")) == 2 for r in data["ranks"])
    assert not list(tmp_path.glob("crash.json.rank*"))


def test_rank_ended_by_sigterm_leaves_its_part_and_the_job_ends_promptly(tmp_path):
    # SIGTERM's default action ends the process at once: the recording of every rank was lost.
    path = tmp_path / "term.json"
    result = run_ranks("profile_api.py", 2, "mpiexec", args=["term", str(path)], timeout=60, expect_ok=False)
    assert result.returncode != 0
    assert "at shutdown failed" not in result.stderr, result.stderr[-3000:]
    data = schema.load(str(path))
    assert [r["rank"] for r in data["ranks"]] == [0, 1] and data["job"]["missing_ranks"] == []
    assert all(len(_rows(r, "steps")) == 2 for r in data["ranks"])
    assert not list(tmp_path.glob("term.json.rank*"))
