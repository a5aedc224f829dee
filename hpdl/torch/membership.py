"""This process's place in an elastic job: which generation of the world it is in, and when
that generation has ended.

A worker started by the elastic driver (`hpdl run --min-np ...`) finds the driver's store and
its worker id in its environment (hpdl/comm/rendezvous.py). ``hvd.init()`` then joins the
first generation that lists it (:meth:`Membership.join`) instead of reading a launcher's
ranks, and forms the world through that generation's prefix of the store. While it runs, the
engine asks :meth:`Membership.check` between the polls of every collective's wait, and its
watch thread asks :meth:`lost_reason`, so that a generation ended by the driver (a worker died)
or by another worker (its collective failed) makes this rank's next collective raise
``HorovodInternalError`` instead of waiting for a peer that will not come; this rank's own
failure ends the generation for the others (:meth:`lost`). ``hvd.elastic.run`` then shuts
hpdl down and initializes it again, which joins the next generation.
"""

from __future__ import annotations

import os
import time
from typing import Optional, Tuple

from hpdl.comm import CommError
from hpdl.comm.rendezvous import Rendezvous, Slot, worker_from_environment

_CHECK_EVERY_S = 0.05  # the store is asked at most this often from the waits of collectives
_STORE_TIMEOUT_S = 60.0


class Membership:
    def __init__(self, address: str, worker: int):
        self.address = address
        self.worker = worker
        self.rendezvous = Rendezvous.connect(address, _STORE_TIMEOUT_S)
        self.generation = -1
        self.slot: Optional[Slot] = None
        self._checked_at = 0.0
        self._ended: Optional[str] = None
        # rank 0's count of host changes when this generation formed (every rank holds rank 0's)
        self.updates_seen = 0

    def join(self, timeout_s: float) -> Slot:
        """Wait for the next generation that lists this worker; set Horovod's launcher
        variables to its place in it (scripts written for horovodrun read them).

        Raises:
            NotInWorld: the job goes on without this worker (its host was removed).
            RendezvousError: no generation formed within ``timeout_s``.
        """
        self.generation, self.slot = self.rendezvous.join(self.worker, self.generation, timeout_s)
        self._ended = None
        self._checked_at = 0.0
        os.environ.update(self.slot.horovod_environment())
        return self.slot

    def process_group_store(self):
        return self.rendezvous.process_group_store(self.generation)

    def host_updates(self) -> Tuple[int, bool]:
        return self.rendezvous.host_updates()

    # -- while the generation runs -----------------------------------------------------------

    def lost_reason(self) -> Optional[str]:
        """Why this generation ended, or None while it runs (asks the store)."""
        if self._ended is None and self.generation >= 0:
            try:
                self._ended = self.rendezvous.ended(self.generation)
            except Exception as err:  # noqa: BLE001 - the driver is gone: the job is over
                self._ended = f"the elastic driver's store at {self.address} no longer answers ({err})"
        return self._ended

    def check(self) -> None:
        """A collective's wait hook: raise once this generation has ended."""
        now = time.monotonic()
        if now - self._checked_at < _CHECK_EVERY_S:
            return
        self._checked_at = now
        reason = self.lost_reason()
        if reason is not None:
            raise CommError(f"the world of generation {self.generation} ended: {reason}")

    def lost(self, message: str) -> None:
        """This rank's engine failed: the generation can no longer complete a collective."""
        try:
            self.rendezvous.end(self.generation, message)
        except Exception:  # noqa: BLE001 - the driver sees this worker's end then
            pass

    def leave(self) -> None:
        """The training function returned: this worker takes part in no reset from now on."""
        try:
            self.rendezvous.leave(self.worker, self.generation)
        except Exception:  # noqa: BLE001 - the driver learns it from the exit status as well
            pass


_current: Optional[Membership] = None


def current() -> Optional[Membership]:
    """This process's membership when it is a worker of an elastic job (made on first use), else None."""
    global _current
    if _current is None:
        found = worker_from_environment()
        if found is not None:
            _current = Membership(*found)
    return _current
