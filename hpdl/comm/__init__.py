"""Communication backends behind one small interface, and rank discovery.

Names are imported on first use, so that rank discovery (``hpdl.comm.topology``, pure Python)
can be used without loading torch, as the command line does to decide which rank reports.
"""

import importlib

_WHERE = {
    "CommError": "base", "Communicator": "base", "InFlight": "base", "ReduceOp": "base", "even_split": "base",
    "choose_backend": "select", "create_world": "select",
    "Topology": "topology", "WorldSizeError": "topology", "announced_world_size": "topology",
    "check_world_size": "topology", "discover_topology": "topology", "host_identity": "topology",
    "topology_from_ranks": "topology",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'hpdl.comm' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hpdl.comm.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
