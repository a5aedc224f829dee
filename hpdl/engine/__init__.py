"""The asynchronous collective engine (see engine.py for the cycle, scheduling.py for when rounds
run, negotiation.py for the agreement between ranks, execution.py, fusion.py and allreduce.py
for running the agreed collectives).

The names below are loaded when first used: a module that needs only the event stream
(``hpdl.engine.events``, read by ``hpdl profile``) does not pay for importing torch.
"""

import importlib
from typing import Any

_WHERE = {"Engine": "engine", "HorovodInternalError": "errors", "Event": "events", "EventBus": "events",
          "Handle": "handle", "Op": "request", "Request": "request", "RequestKind": "request", "Response": "request"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value  # once
    return value
