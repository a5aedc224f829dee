"""Start N ranks with torchrun's variables but no supervising agent, wait for all, exit with the
first non-zero status: a launcher that ends nothing itself, so a job must end on its own.

Usage: python tests/plain_ranks.py N SCRIPT [ARGS...]
"""

import os
import socket
import subprocess
import sys


def main() -> int:
    n, argv = int(sys.argv[1]), sys.argv[2:]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(n):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, *argv], env=env))
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
