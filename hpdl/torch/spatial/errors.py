"""How spatial parallelism's errors reach a user: one line per rank, not a traceback on each.

Two kinds end a spatial job: a refusal (:class:`~hpdl.torch.spatial.geometry.SpatialError`:
a layer, a call or an input that cannot be split exactly), decided alike on every rank of the
group; and a failure of the group's own communication (:class:`GroupCommError`: a peer that
raised, exited or stalled), which ends the whole job. Each message says everything: the rank,
the layer or the call, the cause and what to do. So when one ends the program, this rank
prints that one line instead of a traceback (on every rank, with the same frames: 183 lines
at 3 ranks), through ``sys.excepthook``; anything else is left to the hook before it.
"""

from __future__ import annotations

import sys

from hpdl.engine.errors import HorovodInternalError
from hpdl.torch import runtime
from hpdl.torch.spatial.geometry import SpatialError


class GroupCommError(HorovodInternalError):
    """A spatial group's halo exchange or collective cannot complete (a peer raised, exited or
    stalled): the job is ending. Its message is the one line, naming the rank, the layer and
    the cause. A ``HorovodInternalError``, as the engine's own failures are."""


_installed = False


def report_in_one_line() -> None:
    """Print a SpatialError or GroupCommError that ends the program as one line (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def hook(kind, err, tb):
        if isinstance(err, SpatialError):
            who = f"rank {runtime.rank()}" if runtime.is_initialized() else "spatial"
            sys.stderr.write(f"hpdl: {who}: {err}\n")
        elif isinstance(err, GroupCommError):
            sys.stderr.write(f"{err}\n")
        else:
            previous(kind, err, tb)
            return
        sys.stderr.flush()

    sys.excepthook = hook
