"""The connection between a rank's Spark task and the driver: framed messages over TCP.

Spark gives a task no way to talk to the driver while it runs (accumulators arrive when it
ends, and a task's own output stays in its executor's log), so each task opens one TCP
connection to a small service on the driver (``hpdl.spark.service``). Over it the task says
that it started (which bounds the start timeout), streams its rank's output line by line and
reports how the rank ended; the driver can tell it to stop its rank at once (another rank
failed, the run was cancelled). A connection that drops means the other side is gone: the
task then ends its rank, and the driver counts the task as ended.

A frame is one kind byte, a 4-byte big-endian length and the payload. Control messages are
JSON, output frames raw bytes: the driver never unpickles what arrives, and a connection is
read only after its first frame proved it knows the run's secret token.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from typing import Any, Dict, Tuple

# Task -> driver.
HELLO = b"H"  # {"token", "partition", "attempt", "host", "hostname", "pid"}: the task runs
STARTED = b"S"  # {"rank", "local_rank", "pid"}: the rank's process runs
STDOUT = b"O"  # one line of the rank's stdout
STDERR = b"E"  # one line of the rank's stderr
EXITED = b"X"  # {"rank", "exit_code", "signal", "error", "tail", "stopped"}: how the rank ended
# Driver -> task.
GO = b"G"  # answer to HELLO: start the rank
STOP = b"Q"  # end the rank now (or do not start it)

_HEADER = struct.Struct("!cI")
# A line longer than this is cut into frames of it; a larger frame is a corrupt connection.
MAX_FRAME = 1 << 20
CONNECT_TIMEOUT_S = 30.0


class ChannelClosed(ConnectionError):
    """The other side closed the connection (or it broke)."""


def send_frame(sock: socket.socket, kind: bytes, payload: bytes = b"") -> None:
    """Send one frame; ``ChannelClosed`` if the connection is gone."""
    if len(payload) > MAX_FRAME:
        raise ValueError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME}")
    try:
        sock.sendall(_HEADER.pack(kind, len(payload)) + payload)
    except OSError as err:
        raise ChannelClosed(str(err)) from None


def _read_exactly(sock: socket.socket, count: int) -> bytes:
    chunks, left = [], count
    while left:
        try:
            chunk = sock.recv(min(left, 1 << 16))
        except OSError as err:
            raise ChannelClosed(str(err)) from None
        if not chunk:
            raise ChannelClosed("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> Tuple[bytes, bytes]:
    """Read one frame: ``(kind, payload)``; ``ChannelClosed`` at the end of the connection."""
    kind, length = _HEADER.unpack(_read_exactly(sock, _HEADER.size))
    if length > MAX_FRAME:
        raise ChannelClosed(f"frame of {length} bytes announced (at most {MAX_FRAME}): not an hpdl.spark peer")
    return kind, _read_exactly(sock, length) if length else b""


def decode_json(payload: bytes) -> Dict[str, Any]:
    message = json.loads(payload.decode())
    if not isinstance(message, dict):
        raise ValueError("expected a JSON object")
    return message


class TaskChannel:
    """The task's end: one connection to the driver, sendable from several threads."""

    def __init__(self, address: Tuple[str, int], timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        try:
            self._sock = socket.create_connection(address, timeout=timeout_s)
        except OSError as err:
            raise ChannelClosed(f"cannot reach the hpdl.spark driver at {address[0]}:{address[1]}: {err}") from None
        self._sock.settimeout(None)
        self._lock = threading.Lock()

    def send(self, kind: bytes, payload: bytes = b"") -> None:
        with self._lock:
            send_frame(self._sock, kind, payload)

    def send_json(self, kind: bytes, message: Dict[str, Any]) -> None:
        self.send(kind, json.dumps(message).encode())

    def send_line(self, kind: bytes, line: bytes) -> None:
        """Send one output line, cut into frames if it is longer than a frame holds."""
        for start in range(0, max(len(line), 1), MAX_FRAME):
            self.send(kind, line[start:start + MAX_FRAME])

    def receive(self) -> Tuple[bytes, bytes]:
        return recv_frame(self._sock)

    def close(self) -> None:
        # shutdown first: it wakes a thread blocked reading this socket and sends the driver its
        # end of file now (a close alone does neither while another thread is inside recv()).
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def hello(channel: TaskChannel, token: str, partition: int, attempt: int, host: str) -> bool:
    """Register with the driver; return whether it wants the rank started (GO) or not (STOP).

    Args:
        host: the task's node (``hpdl.comm.topology.host_identity``).
    """
    channel.send_json(HELLO, {"token": token, "partition": partition, "attempt": attempt, "host": host,
                              "hostname": socket.gethostname(), "pid": os.getpid()})
    kind, _ = channel.receive()
    return kind == GO
