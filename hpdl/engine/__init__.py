"""The asynchronous collective engine (see engine.py for the cycle, scheduling.py for when rounds
run, negotiation.py for the agreement between ranks, execution.py, fusion.py and allreduce.py
for running the agreed collectives)."""

from hpdl.engine.engine import Engine
from hpdl.engine.errors import HorovodInternalError
from hpdl.engine.events import Event, EventBus
from hpdl.engine.handle import Handle
from hpdl.engine.request import Op, Request, RequestKind, Response

__all__ = ["Engine", "Event", "EventBus", "Handle", "HorovodInternalError", "Op", "Request", "RequestKind", "Response"]
