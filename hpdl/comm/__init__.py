"""Communication backends behind one small interface, and rank discovery."""

from hpdl.comm.base import CommError, Communicator, ReduceOp, even_split
from hpdl.comm.select import choose_backend, create_world
from hpdl.comm.topology import (
    Topology, WorldSizeError, announced_world_size, check_world_size, discover_topology, topology_from_ranks,
)

__all__ = [
    "CommError",
    "Communicator",
    "ReduceOp",
    "Topology",
    "WorldSizeError",
    "announced_world_size",
    "check_world_size",
    "choose_backend",
    "create_world",
    "discover_topology",
    "even_split",
    "topology_from_ranks",
]
