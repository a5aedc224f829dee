"""Start N ranks with torchrun's variables but no supervising agent, wait for all, exit with the
first non-zero status: a launcher that ends nothing itself, so a job must end on its own.

Usage: python tests/plain_ranks.py N SCRIPT [ARGS...]

Like torchrun's agent, this launcher hosts the rendezvous store itself and the ranks join it as
clients (``TORCHELASTIC_USE_AGENT_STORE``): the store's port stays bound from the moment it is
chosen, so no other job running beside this one can take it before rank 0 listens on it.
"""

import contextlib
import os
import subprocess
import sys
from typing import Dict, Iterator


@contextlib.contextmanager
def hosted_store(n: int) -> Iterator[Dict[str, str]]:
    """Serve a TCP store for an ``n``-rank job; yield the variables that point the ranks at it."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size=n, is_master=True, wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
               "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n)}
    finally:
        del store


def rank_env(base: Dict[str, str], store_env: Dict[str, str], rank: int) -> Dict[str, str]:
    return dict(base, **store_env, RANK=str(rank), LOCAL_RANK=str(rank))


def main() -> int:
    n, argv = int(sys.argv[1]), sys.argv[2:]
    with hosted_store(n) as store_env:
        procs = [subprocess.Popen([sys.executable, *argv], env=rank_env(dict(os.environ), store_env, rank))
                 for rank in range(n)]
        codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
