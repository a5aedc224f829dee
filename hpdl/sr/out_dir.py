"""A training run's out_dir: what marks an earlier run there, and the lock a live run holds.

Rank 0 owns out_dir. A run refuses one holding an earlier run unless told to continue it
(``resume=auto``) or start over (``overwrite=true``), and refuses one a live run holds: two
runs writing one out_dir would interleave their logs and replace each other's checkpoints.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import Any, Dict, List, Optional

from hpdl.atomic_file import atomic_write, make_directories
from hpdl.sr.config import TrainConfig
from hpdl.sr.train_state import say

# What a run writes into out_dir: any of them there means an earlier run.
RUN_FILES = ("last.pt", "model.pt", "train_log.csv", "val_log.csv", "summary.json", "config.yaml", "curves.png")

# The file rank 0 locks in out_dir while a run lives (not a run file: it never means an earlier run).
LOCK_FILE = ".hpdl-sr-train.lock"

# The settings a run used before a resume changed them: config.until-update-<N>.yaml.
EARLIER_CONFIGS = "config.until-update-*.yaml"

# Settings that say how a run was started, not what it does: a resume does not count them as
# changes, and config.yaml keeps the run's own (a resume's resume=auto would make the file,
# given to --config, resume whatever out_dir it is used with).
START_KEYS = ("resume", "overwrite", "pretrained", "progress")


def earlier_run(out_dir: Path) -> List[str]:
    # Resolved as mkdir will make it mean: "missing/../run" is "run", whose files a run would replace.
    resolved = Path(os.path.realpath(out_dir))
    return [name for name in RUN_FILES if (resolved / name).exists()]


def earlier_run_refusal(out_dir: Path, cfg: TrainConfig) -> Optional[str]:
    """On rank 0: why ``out_dir`` cannot be used (it holds an earlier run, neither resumed nor overwritten)."""
    earlier = earlier_run(out_dir)
    resolved = Path(os.path.realpath(out_dir))
    # Neither resumed, nor removed by overwrite, nor replaced: the run would fail at its first
    # write, after truncating the earlier run's logs.
    blocking = [name for name in earlier if (resolved / name).is_dir()]
    if blocking:
        return (f"out_dir={out_dir}: {blocking[0]} is a directory, where a run writes a file; "
                "move it away or choose another out_dir")
    if not earlier or cfg.overwrite:
        return None
    if cfg.resume is None:
        return (f"out_dir={out_dir} holds an earlier run ({', '.join(earlier)}); continue it with resume=auto "
                "or start over with overwrite=true")
    if cfg.resume == "auto" and "last.pt" not in earlier:
        # It stopped before its first checkpoint: starting afresh would replace its files unasked.
        return (f"out_dir={out_dir} holds an earlier run ({', '.join(earlier)}) but no last.pt, so resume=auto "
                "has nothing to continue; start over with overwrite=true instead")
    return None


def prepare_out_dir(out_dir: Path, cfg: TrainConfig, lock: "OutDirLock") -> Optional[str]:
    """On rank 0: create and lock ``out_dir``; with ``overwrite``, first remove the earlier run's files.

    Returns why it cannot be used instead: another run holds it, or (for an out_dir made or
    filled since ``_join`` looked) it now holds an earlier run. The check under the lock is the
    one that counts: two runs started at once in a missing out_dir both passed the first one.
    """
    try:
        make_directories(out_dir)
    except NotADirectoryError as err:
        return f"out_dir={out_dir}: {err.strerror}"
    refusal = lock.refusal(existing_only=False) or earlier_run_refusal(out_dir, cfg)
    if refusal is not None:
        return refusal
    if cfg.overwrite:
        # Nothing of the earlier run may be taken for this one's: resume=auto picking up its
        # last.pt after this run stopped early, TensorBoard showing its curves.
        resolved = Path(os.path.realpath(out_dir))  # the files _earlier_run found
        for name in earlier_run(out_dir):
            (resolved / name).unlink()
        for earlier_config in resolved.glob(EARLIER_CONFIGS):
            earlier_config.unlink()
        shutil.rmtree(resolved / "tb", ignore_errors=True)
    return None


class OutDirLock:
    """Rank 0's exclusive lock on out_dir: ``flock`` on ``out_dir/LOCK_FILE``, held until the run ends.

    The kernel releases it when the process dies, however it dies, so a killed run never blocks
    its resume. The lock file stays (removing it would let a third run lock a new file while a
    second one waits on the old); it records who holds it, for the refusal.
    """

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self._file: Optional[Any] = None
        self._signed = False  # whether the lock file names this process
        self._unlockable = False  # the file system has no locks

    def __enter__(self) -> "OutDirLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._file is not None:
            self._file.close()  # closing releases the lock
            self._file = None

    def refusal(self, existing_only: bool) -> Optional[str]:
        """Take the lock (if not held yet); return why out_dir cannot be used if another process holds it.

        ``existing_only``: only look, creating and writing nothing (the run may yet be refused):
        take the lock if its file exists. Otherwise create it if need be, and sign it.
        """
        path = Path(os.path.realpath(self.out_dir)) / LOCK_FILE  # the directory _earlier_run looks in
        if self._file is None and not self._unlockable:
            if existing_only and not path.is_file():
                return None  # no run has locked it: the check where out_dir is made takes the lock
            import fcntl

            f = open(path, "r" if existing_only else "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip()
                f.close()
                return (f"out_dir={self.out_dir} is in use by another training run"
                        f"{f' ({holder})' if holder else ''}; wait for it to end or choose another out_dir")
            except OSError as err:  # a file system without locks: train unprotected rather than not at all
                f.close()
                self._unlockable = True
                say(f"note: cannot lock {path} ({err.strerror}): a second run started in this out_dir "
                    "would not be refused")
                return None
            self._file = f
        if not existing_only and not self._signed and self._file is not None:
            # Through another handle: the lock belongs to the open file, not to its content.
            path.write_text(f"pid {os.getpid()} on {socket.gethostname()}\n")
            self._signed = True
        return None


def write_config(out_dir: Path, config: Dict[str, Any], resumed_at: Optional[int]) -> Optional[str]:
    """On rank 0: record in ``out_dir/config.yaml`` the settings the run trains with.

    A resumed run (``resumed_at``: its update) that changes settings keeps the file it replaces
    as ``config.until-update-<resumed_at>.yaml``, so out_dir tells which settings made which
    part of the run; one that changes nothing leaves it alone. Returns that file's name, if kept.
    """
    path = out_dir / "config.yaml"
    before = _read_config(path) if resumed_at is not None else None
    if before is not None:
        config = {**config, **{k: before[k] for k in START_KEYS if k in before}}
        if config == before:
            return None
    kept = None
    if before is not None:
        kept = f"config.until-update-{resumed_at}.yaml"
        atomic_write(out_dir / kept, lambda f: f.write(_yaml(before)))
    atomic_write(path, lambda f: f.write(_yaml(config)))
    return kept


def _read_config(path: Path) -> Optional[Dict[str, Any]]:
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None  # missing or damaged: replaced by the settings now in effect
    return loaded if isinstance(loaded, dict) else None


def _yaml(config: Dict[str, Any]) -> bytes:
    import yaml

    return yaml.safe_dump(config, sort_keys=False).encode("utf-8")
