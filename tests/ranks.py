"""Run a script on several ranks under a real launcher, with a timeout so a hang fails."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Hashable, Optional, Sequence

import pytest

from hpdl.launch.process_tree import kill_tree

_snapshots: list = []


def _snapshot_dir() -> str:
    """A directory for the elastic snapshots the session's torchrun jobs write, removed at exit
    (a job that fails on purpose leaves its snapshot, as a failed job should)."""
    if not _snapshots:
        import atexit
        import tempfile

        _snapshots.append(tempfile.mkdtemp(prefix="hpdl-test-snapshots-"))
        atexit.register(shutil.rmtree, _snapshots[0], True)
    return _snapshots[0]

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "multirank"

# (launcher, ranks) combinations every multi-rank test runs under: an odd count catches
# ring off-by-ones, torchrun exercises the gloo backend.
LAYOUTS = [("mpiexec", 1), ("mpiexec", 2), ("mpiexec", 3), ("torchrun", 2)]
LAYOUT_IDS = [f"{launcher}-{n}" for launcher, n in LAYOUTS]

# The second MPI family: Open MPI's mpiexec with mpi4py built against it in .venv-openmpi
# (scripts/setup-openmpi.sh), for a representative subset of the multi-rank tests. Three ranks:
# an odd count, where the ranks' paths differ most; a few tests run two (the layouts above have
# both counts under MPICH).
OPENMPI_VENV = ROOT / ".venv-openmpi"
OPENMPI_LAYOUTS = [("openmpi", 3)]
OPENMPI_LAYOUT_IDS = [f"{launcher}-{n}" for launcher, n in OPENMPI_LAYOUTS]


def openmpi_missing() -> Optional[str]:
    """Why jobs cannot run under Open MPI here, or None when they can."""
    if shutil.which("mpiexec.openmpi") is None:
        return "Open MPI is not installed (Debian: apt-get install openmpi-bin libopenmpi-dev)"
    if not (OPENMPI_VENV / ".hpdl-setup-stamp").exists():
        return f"{OPENMPI_VENV.name} is not set up (bash scripts/setup-openmpi.sh builds mpi4py against Open MPI)"
    return None


_shared_jobs: Dict[Hashable, Any] = {}


def shared_job(key: Hashable, start: Callable[[], Any]) -> Any:
    """What ``start()`` returns, run once for every test that asks under ``key``: one job's
    start-up (the ranks' imports) for the checks of several tests. Its skip, failure or timeout
    is kept too, and raised in each of them."""
    if key not in _shared_jobs:
        try:
            _shared_jobs[key] = start()
        except BaseException as outcome:  # noqa: BLE001 - pytest's skip and fail outcomes
            _shared_jobs[key] = outcome
    if isinstance(_shared_jobs[key], BaseException):
        raise _shared_jobs[key]
    return _shared_jobs[key]


def launch_argv(launcher: str, n: int, script: Sequence[str]) -> list:
    """The argv that starts ``script`` on ``n`` ranks under ``launcher``."""
    if launcher == "mpiexec":
        return ["mpiexec", "-n", str(n), sys.executable, *script]
    if launcher == "openmpi":
        # More ranks than cores need --oversubscribe; root needs --allow-run-as-root.
        return ["mpiexec.openmpi", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", str(n),
                str(OPENMPI_VENV / "bin" / "python"), *script]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--standalone", *script]
    raise ValueError(launcher)


def run_plain_ranks(script: str, n: int, args: Sequence[str] = (), env: Optional[Dict[str, str]] = None,
                    timeout: float = 120) -> list:
    """Start ``n`` processes with torchrun's variables but no supervising agent (which would
    kill the survivors of a dead rank before they can report); return their CompletedProcesses."""
    from plain_ranks import hosted_store, rank_env

    with hosted_store(n) as store_env:
        procs = []
        for rank in range(n):
            full_env = dict(os.environ)
            for key in [k for k in full_env if k.startswith("HPDL_") and k not in ("HPDL_VENV", "HPDL_TORCH_SPEC")]:
                del full_env[key]
            full_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})
            full_env.update(env or {})
            procs.append(subprocess.Popen([sys.executable, str(SCRIPTS / script), *args],
                                          env=rank_env(full_env, store_env, rank), cwd=str(ROOT),
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          start_new_session=True))
        return _collect(procs, script, timeout)


def _collect(procs: list, script: str, timeout: float) -> list:
    """Wait for every process; on a timeout kill them all and fail the test."""
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            pytest.fail(f"{script}: a rank did not finish within {timeout}s")
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def run_ranks(
    script: str,
    n: int,
    launcher: str = "mpiexec",
    args: Sequence[str] = (),
    env: Optional[Dict[str, str]] = None,
    timeout: float = 120,
    expect_ok: bool = True,
) -> subprocess.CompletedProcess:
    """Run tests/multirank/``script`` on ``n`` ranks; fail the test on timeout or (if expected) error."""
    if launcher == "mpiexec" and shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not found (pip install 'hpdl[mpi]')")
    if launcher == "openmpi" and openmpi_missing():
        pytest.skip(openmpi_missing())
    full_env = dict(os.environ)
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})
    for key in [k for k in full_env if k.startswith("HPDL_") and k not in ("HPDL_VENV", "HPDL_TORCH_SPEC")]:
        del full_env[key]
    full_env["HPDL_TEST_TIMEOUT"] = str(timeout)
    # torchrun jobs keep hvd.elastic snapshots: in a directory of the test session, not /tmp's.
    full_env["HPDL_ELASTIC_SNAPSHOT_DIR"] = _snapshot_dir()
    full_env.update(env or {})
    argv = launch_argv(launcher, n, [str(SCRIPTS / script), *args])
    proc = subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(ROOT), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"{script} on {n} ranks ({launcher}) did not finish within {timeout}s\n{out[-3000:]}\n{err[-3000:]}")
    result = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    if expect_ok and proc.returncode != 0:
        pytest.fail(f"{script} on {n} ranks ({launcher}) exited {proc.returncode}\n{out[-3000:]}\n{err[-5000:]}")
    return result
