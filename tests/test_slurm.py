"""`hpdl run` inside a real Slurm allocation, on a one-node cluster this module starts.

The cluster keeps Debian's default MpiDefault=none, under which a plain ``srun`` starts every
MPICH task as a world of its own: the case `hpdl run` must get right (by passing srun the MPI
plugin) and ``hvd.init()`` must refuse when forced into it. munged, slurmctld and slurmd run
in the foreground as children of this module, with their files in a temporary directory and
ports of their own, and are stopped at the end whatever happened. Everything started for the
cluster, its jobs included, carries the cluster's SLURM_CONF in its environment, which is how
leftovers are found. Needs root and Debian's slurm-wlm and munge (installed by .ci/run);
skips, saying why, without them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

from hpdl.launch.process_tree import kill_tree, processes_with_env
from ranks import ROOT, SCRIPTS

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

_PROGRAMS = ("munged", "slurmctld", "slurmd", "salloc", "srun", "sinfo", "scontrol")
# The line goes out in one write: srun relays the two tasks' output as it comes, and print()'s
# separate write of the newline (unbuffered output) could land after the other task's line.
_JOB = """\
import sys

import hpdl.torch as hvd

hvd.init()
sys.stdout.write(f"rank {hvd.rank()} of {hvd.size()}\\n")
sys.stdout.flush()
hvd.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _first_job_id() -> int:
    """A job id no earlier cluster of this machine gave: MPICH names a job's node-local shared
    memory after its PMI name (the job and step id, "1.0"), and a segment a killed job left in
    /dev/shm is opened again by the next job of that id, which then fails in MPI_Init ("failed
    to unpack address"). A real cluster never repeats an id; each test cluster starts afresh."""
    return 1_000_000 + (time.time_ns() // 1_000_000) % 60_000_000


def _slurm_conf(tmp: Path, host: str) -> str:
    cpus = max(2, os.cpu_count() or 1)
    return f"""\
FirstJobId={_first_job_id()}
ClusterName=hpdltest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={tmp}/munge.socket
CryptoType=crypto/munge
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """A running one-node cluster: its environment for client commands, and its daemons."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.conf = tmp / "slurm.conf"
        self.tag = f"SLURM_CONF={self.conf}"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.daemons: List[subprocess.Popen] = []

    def start(self) -> None:
        """Start munged, slurmctld and slurmd; skip the module, with their logs, if they fail."""
        for sub in ("state", "spool"):
            (self.tmp / sub).mkdir()
        key = self.tmp / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.conf.write_text(_slurm_conf(self.tmp, socket.gethostname().split(".")[0]))
        self._daemon(["munged", "--foreground", "--force", f"--socket={self.tmp}/munge.socket",
                      f"--key-file={key}", f"--pid-file={self.tmp}/munged.pid",
                      f"--seed-file={self.tmp}/munge.seed", f"--log-file={self.tmp}/munged.log"])
        self._wait(lambda: (self.tmp / "munge.socket").exists(), "munged made no socket")
        self._daemon(["slurmctld", "-D", "-f", str(self.conf)])
        self._daemon(["slurmd", "-D", "-f", str(self.conf)])
        self._wait(self._node_idle, "the node did not become idle")

    def _daemon(self, argv: List[str]) -> None:
        log = open(self.tmp / f"{argv[0]}.out", "wb")
        self.daemons.append(subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True))
        log.close()

    def _node_idle(self) -> bool:
        done = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True, timeout=30)
        return done.stdout.strip() == "idle"

    def _wait(self, ready, what: str, seconds: float = 60) -> None:
        deadline = time.monotonic() + seconds
        while not ready():
            dead = [d.args[0] for d in self.daemons if d.poll() is not None]
            if dead or time.monotonic() > deadline:
                pytest.skip(f"cannot start a Slurm cluster here: {what}{' (' + ', '.join(dead) + ' exited)' if dead else ''}"
                            f"\n{self.logs()}")
            time.sleep(0.5)

    def logs(self) -> str:
        """The tail of every daemon's log, for messages."""
        parts = []
        for log in sorted(self.tmp.glob("*.out")) + sorted(self.tmp.glob("*.log")):
            parts.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(parts)

    def stop(self) -> List[int]:
        """Stop the daemons and anything of the cluster's still running; return what had to be killed."""
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                kill_tree(daemon.pid)
                daemon.wait()
        deadline = time.monotonic() + 10
        while processes_with_env(self.tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = processes_with_env(self.tag)
        for pid in left:
            kill_tree(pid)
        return left


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    missing = [p for p in _PROGRAMS if shutil.which(p) is None]
    if missing:
        pytest.skip(f"Slurm is not installed here (no {', '.join(missing)}); as root: apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root to start tasks in this test's cluster")
    tmp = Path(tmp_path_factory.mktemp("slurm"))
    running = Cluster(tmp)
    try:
        running.start()
        yield running
    finally:
        left = running.stop()
    assert not left, f"the Slurm cluster left processes running: {left}"


def salloc_run(cluster: Cluster, job: Path, *run_args: str, timeout: float = 180,
               np: Optional[int] = 2) -> subprocess.CompletedProcess:
    """``salloc -n 2 hpdl run -np NP RUN_ARGS -- python JOB`` in the cluster (no -np when NP is None);
    fail on timeout or leftovers."""
    env = {k: v for k, v in cluster.env.items() if not k.startswith(("HPDL_", "SLURM_")) or k == "SLURM_CONF"}
    env.update({"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    np_args = [] if np is None else ["-np", str(np)]
    argv = ["salloc", "-n", "2", "--time=5", sys.executable, "-m", "hpdl", "run", *np_args, *run_args,
            "--", "python", str(job)]
    before = set(processes_with_env(cluster.tag))
    proc = subprocess.Popen(argv, env=env, cwd=str(job.parent), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(argv)} did not end within {timeout}s\n{out}\n{err}\n{cluster.logs()}")
    # The tasks are slurmstepd's children, not salloc's: look for them by the cluster's tag.
    deadline = time.monotonic() + 10
    while set(processes_with_env(cluster.tag)) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    left = sorted(set(processes_with_env(cluster.tag)) - before)
    for pid in left:
        kill_tree(pid)
    assert not left, f"{' '.join(argv)} left processes running: {left}\n{err}"
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.fixture
def job(tmp_path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(_JOB)
    return path


def _ranks(stdout: str) -> List[str]:
    return sorted(line for line in stdout.splitlines() if line.startswith("rank "))


def test_dry_run_passes_srun_the_mpi_plugin(cluster, job):
    result = salloc_run(cluster, job, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert (f"srun --ntasks 2 --kill-on-bad-exit=1 --mpi=pmi2 {sys.executable} -m hpdl.launch.rank_watch -- "
            f"python {job}") in result.stdout


@pytest.mark.parametrize("run_args", [(), ("--backend", "gloo")], ids=["mpi", "gloo"])
def test_two_ranks_form_one_world(cluster, job, run_args):
    result = salloc_run(cluster, job, *run_args)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{cluster.logs()}"
    assert _ranks(result.stdout) == ["rank 0 of 2", "rank 1 of 2"], result.stdout + result.stderr


@pytest.mark.parametrize("run_args", [(), ("--backend", "gloo"), ("--launcher", "mpiexec")],
                         ids=["srun", "gloo", "mpiexec"])
def test_without_np_every_launcher_starts_the_allocations_tasks(cluster, job, run_args):
    result = salloc_run(cluster, job, *run_args, np=None)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{cluster.logs()}"
    assert _ranks(result.stdout) == ["rank 0 of 2", "rank 1 of 2"], result.stdout + result.stderr


def test_srun_without_mpi_plugin_is_refused(cluster, job):
    result = salloc_run(cluster, job, "--mpi-args=--mpi=none")
    assert result.returncode != 0 and _ranks(result.stdout) == []
    refusal = "but the launcher announced 2 (SLURM_STEP_NUM_TASKS=2); likely cause: srun started the tasks"
    # Every task refuses; the first to exit ends the step (srun --kill-on-bad-exit), so the
    # other's line may not be printed before it is ended.
    assert 1 <= result.stderr.count(refusal) <= 2, result.stderr


# Rank 1 dies of a signal after hvd.init(), while rank 0 goes on into an allreduce with it.
_DIES = """\
import os
import signal

import torch

import hpdl.torch as hvd

hvd.init()
if hvd.rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
hvd.allreduce(torch.ones(1))
hvd.shutdown()
"""


def test_a_task_that_dies_ends_the_job(cluster, tmp_path):
    # srun's default leaves the other task waiting in the allreduce until the stall timeout.
    job = tmp_path / "dies.py"
    job.write_text(_DIES)
    started = time.monotonic()
    result = salloc_run(cluster, job, timeout=60)
    assert result.returncode != 0, result.stderr
    assert time.monotonic() - started < 45, result.stderr
    # The task lost is named, once: the other one srun ended is not.
    reports = [line for line in result.stderr.splitlines() if line.startswith("hpdl run: rank ")]
    assert reports == [f"hpdl run: rank 1 (host {socket.gethostname()}) was killed by signal 9 (SIGKILL)"], \
        result.stderr


def test_the_elastic_handler_of_a_survivor_sees_the_committed_state(cluster, tmp_path):
    # srun ends the survivors of a failed task with SIGTERM, and with SIGKILL only KillWait later:
    # during hvd.elastic.run, SIGTERM fails their collectives as a lost peer would.
    job = tmp_path / "elastic_lost.py"
    job.write_text(f"import sys\nsys.path.insert(0, {str(SCRIPTS)!r})\nimport elastic_api\nelastic_api.lost_mode()\n")
    result = salloc_run(cluster, job, timeout=120)
    assert result.returncode != 0
    assert "rank 0 caught: batch=3 " in result.stdout, result.stdout + result.stderr[-3000:]
