"""The progress bars of ``hpdl sr train``, ``eval`` and ``upscale``: one rule for all three.

tqdm redraws its bar with a carriage return. On a terminal that is one line that changes; where
stderr is a pipe or a file (``hpdl sr eval ... 2>&1 | tail``, a batch system's log) every redraw
stays, so there a bar draws nothing for its first ``LOG_INTERVAL`` seconds and then once per
``LOG_INTERVAL``: work shorter than that leaves no frame, longer work a line of life every so
often. ``enabled=False`` (``--no-progress``, ``progress=false``) draws nothing anywhere.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, Optional

__all__ = ["LOG_INTERVAL", "progress_bar"]

LOG_INTERVAL = 30.0  # seconds between redraws (and before the first) where stderr is not a terminal
_TERMINAL_INTERVAL = 0.5  # seconds between redraws on a terminal


def progress_bar(iterable: Optional[Iterable] = None, *, total: Optional[int] = None, desc: str, unit: str,
                 enabled: bool = True, initial: int = 0, delay: float = 0.0) -> Any:
    """A tqdm bar on stderr, drawn as the rule above says.

    Args:
        iterable: what to iterate (None: a bar advanced with ``update``).
        enabled: False draws nothing (the bar still counts, so ``update`` may be called).
        delay: seconds before a bar first appears on a terminal (short work stays quiet).
    """
    from tqdm import tqdm

    terminal = sys.stderr.isatty()
    return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, disable=not enabled,
                dynamic_ncols=True, file=sys.stderr, mininterval=_TERMINAL_INTERVAL if terminal else LOG_INTERVAL,
                delay=delay if terminal else max(delay, LOG_INTERVAL))
