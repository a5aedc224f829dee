"""A task of the barrier stage: place its rank, start the rank's process, watch it, report.

Runs inside Spark's Python worker on an executor. The steps:

1. tell the driver it runs (the driver's start timeout ends here) and learn whether to go on;
2. ``allGather`` every task's host identity and GPUs, and the port partition 0 picked on its
   address for the ranks to meet at (as Spark's TorchDistributor does);
3. start the rank as a child process (``python -m hpdl.spark.rank``) in a session of its own,
   with torchrun's variables for its place, and forward its output lines to the driver;
4. wait until it exits, or until the driver says stop or goes away: then end it, and every
   process it started, at once;
5. return its result to Spark, or fail the task naming the rank.

A rank never outlives its task: it dies with the worker (see ``rank.die_with_parent``), and
the task kills the rank's whole session before it returns, whatever happened.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Deque, Dict, Iterator, List, Optional, Tuple

from hpdl.comm.topology import host_identity
from hpdl.spark import channel as wire
from hpdl.spark import rank as rank_module
from hpdl.launch.placement import place_ranks, rank_environment

# Lines of a rank's stderr kept to explain its failure.
TAIL_LINES = 20
# How long the output of a rank that ended may take to drain (a process it started and left
# behind may hold its pipes open; the session kill ends that one).
DRAIN_S = 5.0


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What every task of one run gets from the driver (inside the task's closure)."""

    driver: Tuple[str, int]
    token: str
    payload: bytes  # cloudpickle of (fn, args, kwargs)
    driver_settings: Dict[str, str]
    user_env: Dict[str, str]
    interfaces: Dict[str, str]
    executable: Optional[str]


class RankProcessError(RuntimeError):
    """A rank's process failed; the message names the rank (raised to fail the Spark task)."""


def run_task(spec: TaskSpec, _rows: Iterator) -> Iterator[Tuple[int, bytes]]:
    """The ``mapPartitions`` function of the barrier stage: yields ``(rank, pickled result)``."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    partition = context.partitionId()
    host = host_identity()
    driver = wire.TaskChannel(spec.driver)
    try:
        if not wire.hello(driver, spec.token, partition, context.attemptNumber(), host):
            return  # the run is over (a retried stage after a failure): start nothing
        master_addr = context.getTaskInfos()[0].address.rsplit(":", 1)[0]
        port = _free_port(master_addr) if partition == 0 else 0
        mine = {"host": host, "port": port, "gpus": _gpu_addresses(context)}
        gathered = [json.loads(m) for m in context.allGather(json.dumps(mine))]
        placement = place_ranks([g["host"] for g in gathered])
        topology = placement.topology(partition)
        env = rank_environment(
            os.environ, topology, master_addr, gathered[0]["port"],
            driver_settings=spec.driver_settings, user_env=spec.user_env,
            gpus=placement.node_gpus(partition, [g["gpus"] for g in gathered]), cpus=context.cpus(),
            interfaces=spec.interfaces,
        )
        result = _RankProcess(spec, topology.rank, env, driver).run(topology.local_rank)
    finally:
        driver.close()
    if result is not None:
        yield topology.rank, result


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def _gpu_addresses(context) -> List[str]:
    resources = context.resources()
    gpu = resources.get("gpu")
    return list(gpu.addresses) if gpu is not None else []


class _RankProcess:
    """One rank's process, its output forwarded to the driver, ended on the driver's word."""

    def __init__(self, spec: TaskSpec, rank: int, env: Dict[str, str], driver: wire.TaskChannel) -> None:
        self.spec, self.rank, self.env, self.driver = spec, rank, env, driver
        self.tail: Deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.stopped = threading.Event()  # the driver said stop, or is gone
        self.process: Optional[subprocess.Popen] = None
        # Set once the session was ended after the rank was reaped: its id may be reused later.
        self.finished = False

    def run(self, local_rank: int) -> Optional[bytes]:
        """Run the rank; return its pickled result, or None when it failed and the driver knows why.

        A failure the driver was told of ends the task normally: the driver raises it, with
        the rank's traceback, and ends the run. Failing the Spark task as well would only make
        Spark log every task's stack and retry the stage, restarting training from scratch.
        A failure the driver could not be told of fails the task, so that Spark reports it.
        """
        workdir = tempfile.mkdtemp(prefix=f"hpdl-spark-rank{self.rank}-")
        try:
            with open(os.path.join(workdir, rank_module.PAYLOAD), "wb") as out:
                out.write(self.spec.payload)
            with open(os.path.join(workdir, rank_module.SYS_PATH), "w") as out:
                json.dump([p for p in sys.path if p], out)
            if not self._start(workdir):
                return None  # it could not start, and the driver was told why
            self.driver.send_json(wire.STARTED, {"rank": self.rank, "local_rank": local_rank,
                                                 "pid": self.process.pid})
            readers = [self._forward(self.process.stdout, wire.STDOUT),
                       self._forward(self.process.stderr, wire.STDERR)]
            threading.Thread(target=self._listen, name="hpdl-spark-driver", daemon=True).start()
            code = self.process.wait()
            self._end_session()  # whatever the rank started and left behind
            for reader in readers:
                reader.join(DRAIN_S)
            return self._outcome(workdir, code)
        finally:
            self._end_session()
            self.finished = True
            shutil.rmtree(workdir, ignore_errors=True)

    def _start(self, workdir: str) -> bool:
        executable = self.spec.executable or sys.executable
        argv = [executable, "-m", "hpdl.spark.rank", workdir, str(os.getpid())]
        try:
            # A session of its own: the rank and whatever it starts can be ended together, and a
            # Ctrl-C meant for a terminal's foreground job never reaches it directly.
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, env=self.env, start_new_session=True)
        except OSError as err:
            message = f"cannot start {executable}: {err.strerror or err}"
            if not self._report(None, None, message, stopped=False):
                raise RankProcessError(f"rank {self.rank} could not start: {message}") from None
            return False
        return True

    def _forward(self, pipe, kind: bytes) -> threading.Thread:
        def forward() -> None:
            for line in iter(pipe.readline, b""):
                if kind == wire.STDERR:
                    self.tail.append(line.decode("utf-8", "replace").rstrip("\n"))
                try:
                    self.driver.send_line(kind, line)
                except wire.ChannelClosed:
                    self._stop()  # the driver is gone: nobody wants this rank any more
            pipe.close()

        thread = threading.Thread(target=forward, name=f"hpdl-spark-{kind.decode()}", daemon=True)
        thread.start()
        return thread

    def _listen(self) -> None:
        """End the rank when the driver says stop or the connection drops."""
        try:
            while True:
                kind, _ = self.driver.receive()
                if kind == wire.STOP:
                    break
        except wire.ChannelClosed:
            pass
        self._stop()

    def _stop(self) -> None:
        self.stopped.set()
        self._end_session()

    def _end_session(self) -> None:
        process = self.process
        if process is None or self.finished:
            return
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the session is empty already

    def _outcome(self, workdir: str, code: int) -> Optional[bytes]:
        result_path = os.path.join(workdir, rank_module.RESULT)
        if code == 0 and os.path.exists(result_path):
            with open(result_path, "rb") as result:
                data = result.read()
            self._report(0, None, None, stopped=False)
            return data
        raised = _read_exception(os.path.join(workdir, rank_module.ERROR))
        exit_code, signal_number = (code, None) if code >= 0 else (None, -code)
        # A rank that raised failed on its own, even when the driver's stop killed it as it exited
        # (another rank's report of the same failure may have come first).
        stopped = self.stopped.is_set() and raised is None
        if self._report(exit_code, signal_number, None, stopped, raised):
            return None
        raise RankProcessError(describe_exit(f"rank {self.rank}", exit_code, signal_number,
                                             raised and raised.get("traceback"), list(self.tail), stopped,
                                             exception=exception_line(*_type_and_message(raised))))

    def _report(self, exit_code: Optional[int], signal_number: Optional[int], error: Optional[str],
                stopped: bool, raised: Optional[Dict[str, Any]] = None) -> bool:
        """Tell the driver how the rank ended; return whether it could be told.

        ``error``: why it could not start; ``raised``: its exception (rank.exception_record), whose
        traceback goes as ``error``. ``at``: when it failed (its exception's time, else now).
        """
        raised = raised or {}
        try:
            self.driver.send_json(wire.EXITED, {
                "rank": self.rank, "exit_code": exit_code, "signal": signal_number,
                "error": raised.get("traceback", error), "exception_type": raised.get("type"),
                "message": raised.get("message"), "secondary": bool(raised.get("secondary")),
                "at": raised.get("at", time.time()), "tail": list(self.tail), "stopped": stopped})
        except wire.ChannelClosed:
            return False
        return True


def _read_exception(path: str) -> Optional[Dict[str, Any]]:
    """The rank's exception as rank.exception_record wrote it, or None when it raised none."""
    try:
        with open(path, "rb") as data:
            text = data.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    return record if isinstance(record, dict) else {"traceback": text}


def _type_and_message(raised: Optional[Dict[str, Any]]) -> Tuple[Optional[str], Optional[str]]:
    return (raised.get("type"), raised.get("message")) if raised else (None, None)


def exception_line(type_name: Optional[str], message: Optional[str]) -> Optional[str]:
    """``Type: message`` of a rank's exception (its message's first line), or None without a type."""
    if not type_name:
        return None
    lines = (message or "").strip().splitlines()
    return f"{type_name}: {lines[0]}" if lines else type_name


def describe_exit(who: str, exit_code: Optional[int], signal_number: Optional[int], error: Optional[str],
                  tail: List[str], stopped: bool, lines: int = 10, exception: Optional[str] = None) -> str:
    """One message for a rank that did not return: how it ended and the last lines that say why.

    Args:
        who: the rank as the message names it ("rank 1", "rank 1 (on node2)").
        exit_code: its exit status (None: a signal ended it, or it never started).
        error: the traceback of its exception (or why it could not start).
        tail: the last lines of its stderr, shown when there is no traceback.
        exception: its exception as ``Type: message`` (exception_line), named first: it raised,
            however its process then ended.
    """
    if stopped:
        return f"{who} was stopped: the run ended (another rank failed, or it was cancelled)"
    if exception is not None:
        how = f"{who} raised {exception}"
    elif signal_number is not None:
        try:
            name = signal.Signals(signal_number).name
        except ValueError:
            name = f"signal {signal_number}"
        how = f"{who} was killed by {name}"
    elif exit_code is None:
        return f"{who} could not start: {error or 'no reason given'}"
    elif error is not None:
        how = f"{who} raised an exception"
    else:
        how = f"{who} exited with status {exit_code}"
    detail = (error or "").rstrip("\n").splitlines() or tail
    if not detail:
        return f"{how} (it printed nothing on stderr)"
    return f"{how}; last lines of its {'traceback' if error else 'stderr'}:\n" + "\n".join(
        "    " + line for line in detail[-lines:])
