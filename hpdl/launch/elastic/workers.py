"""How the elastic driver starts a worker, asks whether it ended, and ends it.

The driver (driver.py) decides which workers run where and when; a :class:`WorkerStarter`
makes them real. :class:`ProcessWorkers` is `hpdl run --min-np`'s: one process per worker,
started here or through the remote shell, in a session of its own so that ending it ends what
it started. hpdl.ray has its own starter (Ray actors on Ray nodes) behind the same interface,
so both run under one driver and one policy.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from typing import Callable, Dict, Iterable, Optional, Protocol, Sequence, Tuple

from hpdl.launch.rank_watch import ending_words

# Launcher variables of the driver's own environment that would tell a worker another world.
_NOT_PASSED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "PMI_RANK", "PMI_SIZE", "PMI_FD", "PMIX_RANK", "OMPI_COMM_WORLD_RANK",
               "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID")


class WorkerStartError(RuntimeError):
    """A worker could not be started at all; the message is one line naming what failed."""


class WorkerHandle(Protocol):
    """One started worker, as the driver sees it."""

    def poll(self) -> Optional[int]:
        """None while it runs; then its end as a ``subprocess`` return code (0: the training
        returned; a negative code: killed by that signal)."""

    def terminate(self) -> None:
        """Ask it to end (the driver kills it :meth:`kill` a few seconds later if it has not)."""

    def kill(self) -> None:
        """End it now."""

    def ending(self, code: int) -> str:
        """How it ended, in words that follow its name ("ended with exit code 1")."""


class WorkerStarter(Protocol):
    def store_address(self, hosts: Iterable[str]) -> Tuple[str, str]:
        """Where the driver's store listens, and the address workers on ``hosts`` reach it at."""

    def start(self, worker_id: int, host: str, variables: Dict[str, str]) -> WorkerHandle:
        """Start worker ``worker_id`` on ``host`` with ``variables`` (its place in the job) added
        to its environment.

        Raises:
            WorkerStartError: it cannot be started at all (the job cannot go on).
        """


class _Process:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def ending(self, code: int) -> str:
        return ending_words(code)

    def _signal(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)  # the worker and what it started (its session)
        except OSError:
            pass


class ProcessWorkers:
    """`hpdl run`'s workers: ``command`` as a process on its host (here, or over ``remote_shell``)."""

    def __init__(self, command: Sequence[str], env: Dict[str, str], cwd: str, remote_shell: str = "ssh",
                 is_local: Optional[Callable[[str], bool]] = None):
        self.command = list(command)
        self.env = {k: v for k, v in env.items() if k not in _NOT_PASSED}
        self.cwd = cwd
        self.remote_shell = remote_shell
        self._is_local = is_local

    def local(self, host: str) -> bool:
        return self._is_local(host) if self._is_local is not None else False

    def store_address(self, hosts: Iterable[str]) -> Tuple[str, str]:
        import socket

        if all(self.local(h) for h in hosts):
            return "127.0.0.1", "127.0.0.1"
        return "0.0.0.0", socket.gethostname()

    def start(self, worker_id: int, host: str, variables: Dict[str, str]) -> _Process:
        env = dict(self.env)
        env.update(variables)
        env["PYTHONUNBUFFERED"] = self.env.get("PYTHONUNBUFFERED", "1")
        if self.local(host):
            argv, env_for_popen = self.command, env
        else:
            passed = {k: v for k, v in env.items() if k.startswith(("HPDL_", "HOROVOD_", "PYTHON")) or k == "PATH"}
            line = (f"cd {shlex.quote(self.cwd)} && exec env "
                    f"{shlex.join([f'{k}={v}' for k, v in sorted(passed.items())] + self.command)}")
            argv, env_for_popen = [*shlex.split(self.remote_shell), host, line], dict(self.env)
        try:
            proc = subprocess.Popen(argv, env=env_for_popen, cwd=self.cwd, start_new_session=True)
        except OSError as err:
            raise WorkerStartError(f"cannot start {argv[0]}: {err.strerror or err}") from None
        return _Process(proc)
