"""One rank of ``hpdl.spark.run``: ``python -m hpdl.spark.rank WORKDIR PARENT_PID``.

The Spark task starts this process and watches it. It runs in a process of its own, never in
Spark's Python worker: Spark reuses its workers from job to job, and a rank run inside one
would inherit the previous run's process group and report the previous run's rank.

``WORKDIR`` holds what the task wrote (``payload``: ``fn``, its arguments and keyword
arguments, by cloudpickle; ``sys_path``: the worker's import path, so that modules Spark
ships with ``addPyFile`` import here too). The rank writes ``result`` (its return value, by
cloudpickle) or ``error`` (its exception: type, message, traceback, when it was raised, and
whether it is hpdl's error for a job another rank ended, as JSON) there, and prints the
traceback to its stderr as well, which reaches the driver's output prefixed with the rank.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import List, Optional

PAYLOAD = "payload"
SYS_PATH = "sys_path"
RESULT = "result"
ERROR = "error"
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """End this process when the task that started it ends, however it ends.

    On Linux the kernel sends SIGKILL when the parent dies (PR_SET_PDEATHSIG), even when Spark
    kills the task's worker with SIGKILL. Elsewhere a thread checks the parent every second. A
    parent already gone before this ran (the kernel signal would never come) ends it at once.
    """
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent_pid:
        os._exit(1)
    if not armed:
        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, name="hpdl-spark-parent-watch", daemon=True).start()


def _write(path: str, data: bytes) -> None:
    # Renamed into place: the task never reads half a result from a rank killed mid-write.
    partial = path + ".partial"
    with open(partial, "wb") as out:
        out.write(data)
    os.replace(partial, path)


def _exit_code(code: object) -> Optional[int]:
    """The status of ``sys.exit(code)``: None for a clean exit (0 or None)."""
    if code is None or code == 0:
        return None
    return code if isinstance(code, int) else 1


def exception_record(err: BaseException, text: str) -> dict:
    """What the driver needs of a rank's exception, for ``error``: its type and message as the
    traceback's last line names them, the traceback ``text``, when it was caught (this host's
    clock), and whether it is ``secondary``.

    A rank whose own code raised is where a run failed; hpdl then raises HorovodInternalError on
    every other rank ("hpdl has been shut down (rank 1 ... exited)", a lost peer, a stall), and
    that rank may exit and be reported first. The class is known by name: this module runs
    before hpdl.torch is imported, and the spark layer does not import the engine.
    """
    cls = type(err)
    name = cls.__qualname__ if cls.__module__ in ("builtins", "__main__") else f"{cls.__module__}.{cls.__qualname__}"
    secondary = any(c.__name__ == "HorovodInternalError" and c.__module__.startswith("hpdl.") for c in cls.__mro__)
    try:
        message = str(err)
    except Exception:  # noqa: BLE001 - its __str__ failed: the traceback says as much
        message = f"<{name} whose message cannot be printed>"
    return {"type": name, "message": message, "traceback": text, "at": time.time(), "secondary": secondary}


def run(workdir: str) -> int:
    """Load and call ``fn``; write its result or its traceback; return the exit status."""
    import cloudpickle

    with open(os.path.join(workdir, SYS_PATH)) as paths:
        sys.path.extend(p for p in json.load(paths) if p not in sys.path)
    try:
        with open(os.path.join(workdir, PAYLOAD), "rb") as payload:
            fn, args, kwargs = cloudpickle.load(payload)
        try:
            value = fn(*args, **kwargs)
        except SystemExit as stop:
            code = _exit_code(stop.code)
            if code is not None:
                sys.stderr.write(f"fn called sys.exit({stop.code!r})\n")
                return code
            value = None
        try:
            data = cloudpickle.dumps(value)
        except Exception as err:
            raise TypeError(f"the value fn returned ({type(value).__name__}) cannot be pickled: {err}") from None
    except BaseException as err:
        # From fn's own frame on: the frame of this function that called it says nothing.
        tb = err.__traceback__.tb_next if err.__traceback__ is not None else None
        text = "".join(traceback.format_exception(type(err), err, tb or err.__traceback__))
        sys.stderr.write(text)
        sys.stderr.flush()
        _write(os.path.join(workdir, ERROR), json.dumps(exception_record(err, text)).encode("utf-8", "replace"))
        return 1
    _write(os.path.join(workdir, RESULT), data)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        sys.stderr.write("usage: python -m hpdl.spark.rank WORKDIR PARENT_PID (started by hpdl.spark.run)\n")
        return 2
    die_with_parent(int(args[1]))
    return run(args[0])


if __name__ == "__main__":
    sys.exit(main())
