"""The snapshot on disk that lets ``hvd.elastic.run`` go on from its last commit under
torchrun's elastic agent, which restarts every worker process of the job on any failure or
membership change (docs/elastic.md, "Under torchrun's elastic agent").

Only this module knows the files: where they live, how one is written and read, which one is
this job's. What goes in one is the state's business (``common.py``); this module keeps it as
it is given.

One directory per torchrun job, named after its run id (``TORCHELASTIC_RUN_ID``, torchrun's
``--rdzv-id``): ``<HPDL_ELASTIC_SNAPSHOT_DIR or the temp dir>/hpdl-elastic-<run id>/``, made
readable by this user alone (the files are pickles, loaded as such). In it, local rank 0 of
each node keeps one file per training function, ``<host>.<function>.pt``, written atomically
at every commit (a temp file renamed over it, so a kill mid-write leaves the previous one).
The host in the name keeps the copies node-local even where the directory is shared.

torchrun's default run id is ``none``, the same for every job started without ``--rdzv-id``,
so a file also records the torchrun agent (its process id and start time, from /proc) that
started the worker which wrote it: a file of another agent, that is of an earlier job whose
workers failed for good, is not restored.
"""

from __future__ import annotations

import io
import os
import re
import socket
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Set

import torch

from hpdl.atomic_file import atomic_write, remove_stale_temp_files
from hpdl.torch import membership
from hpdl.torch.runtime import is_initialized, local_rank, settings

__all__ = ["JobSnapshots", "Snapshot", "agent_identity", "job_directory", "this_job", "warn_once"]

RUN_ID_VARIABLE = "TORCHELASTIC_RUN_ID"
_FORMAT = 1
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class Snapshot:
    """One file's content: the commit it was written at and the state's payload."""

    def __init__(self, commits: int, payload: Dict[str, Any], data: bytes):
        self.commits = commits
        self.payload = payload
        self.data = data  # the file's bytes, for the ranks of other nodes that hold none


class JobSnapshots:
    """This node's snapshots of one torchrun job (one directory), for one training function.

    Args:
        directory: the job's directory.
        run_id: torchrun's run id, recorded in each file and checked when it is read.
        agent: the torchrun agent's identity (:func:`agent_identity`), likewise; None where it
            cannot be told (no /proc), then any agent's file is taken.
        writer: whether this process writes (local rank 0) and removes the files.
        function: the training function's qualified name.
        host: this node's name in the file's name.
    """

    def __init__(self, directory: Path, run_id: str, agent: Optional[str], writer: bool, function: str,
                 host: Optional[str] = None):
        self.directory = Path(directory)
        self.run_id = run_id
        self.agent = agent
        self.writer = writer
        self.function = function
        host = socket.gethostname() if host is None else host
        self.path = self.directory / f"{_safe(host)}.{_safe(function)}.pt"

    def write(self, commits: int, payload: Dict[str, Any]) -> None:
        """Keep ``payload`` as the state of commit ``commits`` (atomically; the writer only).

        Raises:
            OSError: the directory or file cannot be written (the directory is another user's).
            Exception: the payload cannot be pickled.
        """
        if not self.writer:
            return
        record = {"format": _FORMAT, "run_id": self.run_id, "agent": self.agent, "function": self.function,
                  "commits": commits, "state": payload}
        self._make_directory()
        atomic_write(self.path, lambda f: torch.save(record, f))

    def read(self) -> Optional[Snapshot]:
        """This node's snapshot of the function, or None when there is none that this job wrote
        (another job's, or a file that cannot be read, is said once on stderr by local rank 0)."""
        try:
            self._check_directory()
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            self._say(f"hpdl: the elastic snapshot {self.path} cannot be read ({err}); the training starts from "
                      "the script's state")
            return None
        try:
            record = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        except Exception as err:  # noqa: BLE001 - whatever the unpickling raises, the file is unusable
            self._say(f"hpdl: the elastic snapshot {self.path} cannot be loaded ({type(err).__name__}: {err}); the "
                      "training starts from the script's state")
            return None
        why = self._foreign(record)
        if why is not None:
            self._say(f"hpdl: the elastic snapshot {self.path} is not this job's ({why}); the training starts from "
                      f"the script's state (give each torchrun job its own --rdzv-id)")
            return None
        return Snapshot(int(record["commits"]), record["state"], data)

    @staticmethod
    def parse(data: bytes) -> Snapshot:
        """A snapshot from another node's file's bytes (sent by the rank that read them)."""
        record = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        return Snapshot(int(record["commits"]), record["state"], data)

    def remove(self) -> None:
        """Remove this function's file and, once it holds no other, the job's directory (the
        writer only)."""
        if not self.writer:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as err:
            warn_once(f"hpdl: the elastic snapshot {self.path} cannot be removed ({err})")
            return
        remove_stale_temp_files(self.directory)
        try:
            self.directory.rmdir()
        except OSError:
            pass  # another function's file, another node's (a shared directory), or gone already

    def _foreign(self, record: Any) -> Optional[str]:
        if not isinstance(record, dict) or record.get("format") != _FORMAT:
            return "an unknown format"
        if record.get("run_id") != self.run_id:
            return f"run id {record.get('run_id')!r}"
        if record.get("function") != self.function:
            return f"function {record.get('function')!r}"
        if self.agent is not None and record.get("agent") is not None and record["agent"] != self.agent:
            return "written under another torchrun agent: an earlier job with the same run id"
        return None

    def _make_directory(self) -> None:
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.directory.mkdir(mode=0o700)
        except FileExistsError:
            pass
        self._check_directory()

    def _check_directory(self) -> None:
        """Refuse a directory another user could have written to (its pickles would run their code)."""
        try:
            info = os.lstat(self.directory)
        except FileNotFoundError:
            raise FileNotFoundError(str(self.directory)) from None
        if not stat.S_ISDIR(info.st_mode) or (hasattr(os, "getuid") and info.st_uid != os.getuid()) \
                or info.st_mode & 0o022:
            raise PermissionError(f"{self.directory} is not a directory of this user's that only it can write "
                                  f"(remove it, or set HPDL_ELASTIC_SNAPSHOT_DIR)")

    def _say(self, message: str) -> None:
        if self.writer:
            warn_once(message)


def job_directory(run_id: str, base: str = "") -> Path:
    """The directory of the torchrun job ``run_id``: under ``base``, else the temp dir."""
    return Path(base or tempfile.gettempdir()) / f"hpdl-elastic-{_safe(run_id)}"


def this_job(function: str) -> Optional[JobSnapshots]:
    """The snapshots of ``function`` in this process's torchrun job, or None where none are
    kept: not a worker of torchrun's agent, a worker of hpdl's own elastic driver (whose workers
    survive a change of the world), hpdl not initialized, or ``HPDL_ELASTIC_SNAPSHOT=0``."""
    run_id = os.environ.get(RUN_ID_VARIABLE)
    if not run_id or membership.current() is not None or not is_initialized():
        return None
    config = settings()
    if not config.elastic_snapshot:
        return None
    return JobSnapshots(job_directory(run_id, config.elastic_snapshot_dir), run_id, agent_identity(),
                        writer=local_rank() == 0, function=function)


def agent_identity() -> Optional[str]:
    """The torchrun agent that started this worker, as ``<pid>:<start time>``: the nearest
    ancestor process started without ``TORCHELASTIC_RUN_ID`` (a wrapper between the agent and
    the script, as `hpdl run`'s, has it); None where /proc cannot tell."""
    pid = os.getppid()
    for _ in range(16):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        if not any(entry.startswith(RUN_ID_VARIABLE.encode() + b"=") for entry in environ):
            return f"{pid}:{fields[19]}"  # field 22 of stat, the start time (fields[0] is field 3)
        pid = int(fields[1])  # the parent
        if pid <= 1:
            return None
    return None


_warned: Set[str] = set()


def warn_once(message: str) -> None:
    """Say ``message`` on stderr, once per process."""
    if message in _warned:
        return
    _warned.add(message)
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def _safe(name: str) -> str:
    """``name`` as one safe component of a file name."""
    return _UNSAFE.sub("_", name)[:120] or "_"
