"""The driver's end of the tasks' connections (``hpdl.spark.channel``): a TCP service for one run.

It accepts one connection per task, checks the run's token, and turns what arrives into
reports for the driver's loop (:class:`TaskReport`) and output lines for the driver's streams. It
can tell every task to stop its rank (a rank failed, the run was cancelled): tasks that
register afterwards (a stage Spark retries) are told not to start theirs.
"""

from __future__ import annotations

import dataclasses
import hmac
import queue
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from hpdl.spark import channel as wire

# A connection that has not proved it knows the token within this time is dropped.
HELLO_TIMEOUT_S = 30.0

REGISTERED = "registered"  # a task runs: {"partition", "attempt", "host", "hostname"}
STARTED = "started"  # its rank's process runs: {"partition", "rank", "local_rank", "pid", "hostname"}
EXITED = "exited"  # its rank ended: the task's EXITED message, plus "partition" and "hostname"


@dataclasses.dataclass(frozen=True)
class TaskReport:
    """What a task said, for the driver's loop: ``kind`` (REGISTERED, STARTED, EXITED) and its fields."""

    kind: str
    data: Dict[str, Any]


class _Task:
    """One task's connection, as the service knows it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()  # sends to it come from the loop's and the handler's threads
        self.partition: Optional[int] = None
        self.host = ""  # its node (host identity), as ranks are placed
        self.hostname = ""  # its host's name, as messages name it
        self.rank: Optional[int] = None

    def send(self, kind: bytes) -> None:
        try:
            with self.lock:
                wire.send_frame(self.sock, kind)
        except wire.ChannelClosed:
            pass  # the task is gone already


class DriverService:
    """Accept the tasks of one run; their reports go to :attr:`reports`, output lines to ``on_output``.

    Args:
        bind_host: the address to listen on (the driver's bind address).
        advertised_host: the address tasks connect to (``spark.driver.host``).
        token: the secret every task sends first.
        on_output: called with ``(rank, "stdout" | "stderr", line)`` from the connection's thread.
    """

    def __init__(self, bind_host: str, advertised_host: str, token: str,
                 on_output: Callable[[int, str, bytes], None]) -> None:
        self._server = socket.create_server((bind_host, 0))
        self.address: Tuple[str, int] = (advertised_host, self._server.getsockname()[1])
        self._token = token.encode()
        self._on_output = on_output
        self.reports: "queue.Queue[TaskReport]" = queue.Queue()
        self._lock = threading.Lock()
        self._tasks: List[_Task] = []
        self._stopping = False
        self._closed = False
        self._threads: List[threading.Thread] = []
        accept = threading.Thread(target=self._accept, name="hpdl-spark-service", daemon=True)
        accept.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return  # closed
            task = _Task(sock)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._tasks.append(task)
                handler = threading.Thread(target=self._serve, args=(task,), name="hpdl-spark-task", daemon=True)
                self._threads.append(handler)
            handler.start()

    def _serve(self, task: _Task) -> None:
        try:
            if self._greet(task):
                self._relay(task)
        except (wire.ChannelClosed, ValueError, KeyError, TypeError):
            pass  # a broken or foreign connection: it ends here
        finally:
            try:
                task.sock.close()
            except OSError:
                pass

    def _greet(self, task: _Task) -> bool:
        task.sock.settimeout(HELLO_TIMEOUT_S)
        kind, payload = wire.recv_frame(task.sock)
        if kind != wire.HELLO:
            return False
        hello = wire.decode_json(payload)
        if not hmac.compare_digest(str(hello.get("token", "")).encode(), self._token):
            return False
        task.sock.settimeout(None)
        task.partition, task.host, task.hostname = int(hello["partition"]), str(hello["host"]), str(hello["hostname"])
        with self._lock:
            go = not self._stopping
        task.send(wire.GO if go else wire.STOP)
        if go:
            self.reports.put(TaskReport(REGISTERED, {"partition": task.partition, "attempt": int(hello["attempt"]),
                                                     "host": task.host, "hostname": task.hostname}))
        return go

    def _relay(self, task: _Task) -> None:
        while True:
            kind, payload = wire.recv_frame(task.sock)
            if kind in (wire.STDOUT, wire.STDERR) and task.rank is not None:
                self._on_output(task.rank, "stdout" if kind == wire.STDOUT else "stderr", payload)
            elif kind == wire.STARTED:
                message = wire.decode_json(payload)
                task.rank = int(message["rank"])
                self.reports.put(TaskReport(STARTED, dict(message, partition=task.partition, hostname=task.hostname)))
            elif kind == wire.EXITED:
                message = wire.decode_json(payload)
                self.reports.put(TaskReport(EXITED, dict(message, partition=task.partition, hostname=task.hostname)))

    def stop_all(self) -> None:
        """Tell every task to end its rank now, and every task that registers later not to start one."""
        with self._lock:
            self._stopping = True
            tasks = list(self._tasks)
        for task in tasks:
            if task.partition is not None:
                task.send(wire.STOP)

    def close(self, drain_s: float = 0.0) -> None:
        """Stop accepting; wait up to ``drain_s`` for the connections to end, then close them.

        Tasks close their connection once their rank's last line and exit are sent, so
        draining first lets every line reach the driver's output before ``run`` returns.
        """
        deadline = time.monotonic() + drain_s
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() (a close alone does not)
        except OSError:
            pass
        self._server.close()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            tasks = list(self._tasks)
        for task in tasks:
            try:
                task.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
