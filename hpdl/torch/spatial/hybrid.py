"""Hybrid parallelism: each image split over S ranks (spatial), D groups of them training on
different images (data parallel), S x D ranks in all.

Consecutive ranks form a spatial group (ranks ``g*S .. g*S + S-1``), so that the halo
exchanges, the most frequent messages, stay on one node where the launcher places
consecutive ranks together. The gradients need nothing more than ``hvd.DistributedOptimizer``
over every rank: SpatialParallel makes each rank's gradients its contribution to its group's
sum, and the average over all ranks is then the replicas' mean (see parallel.py).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

from hpdl.torch import runtime
from hpdl.torch.process_sets import ProcessSet, add_process_set, global_process_set, registered_with
from hpdl.torch.spatial.geometry import SpatialError


@dataclasses.dataclass(frozen=True)
class Layout:
    """This rank's place in an S x D layout.

    ``spatial_set``: the ranks that share this rank's images (give it to SpatialParallel);
    ``data_set``: the ranks that hold the same part of the other groups' images; ``replica``:
    this rank's group (which images it takes: shard the data by ``replica`` of ``data``);
    ``part``: its rank within the group.
    """

    spatial: int
    data: int
    spatial_set: ProcessSet
    data_set: ProcessSet
    replica: int
    part: int


def layout(spatial: int, data: Optional[int] = None) -> Layout:
    """Register the process sets of a ``spatial`` x ``data`` layout of every rank; return this rank's.

    Collective: every rank calls it, with the same numbers. ``data`` defaults to the ranks
    left over (size / spatial). Sets registered by an earlier call are used again.
    """
    size = runtime.size()
    if data is None:
        data = size // spatial if isinstance(spatial, int) and spatial > 0 else 0
    if not all(isinstance(n, int) and n > 0 for n in (spatial, data)) or spatial * data != size:
        raise SpatialError(f"layout(spatial={spatial}, data={data}): expected positive integers whose product is "
                           f"the number of ranks, {size}")
    rank = runtime.rank()
    replica, part = divmod(rank, spatial)
    spatial_sets = [_register([g * spatial + p for p in range(spatial)], size) for g in range(data)]
    data_sets = [_register([g * spatial + p for g in range(data)], size) for p in range(spatial)]
    return Layout(spatial, data, spatial_sets[replica], data_sets[part], replica, part)


def grid(spatial: int, data: Optional[int] = None) -> Layout:
    """Deprecated alias of ``layout(spatial, data)``: its name in hpdl 0.1.0, kept for one release
    (``grid`` is SpatialParallel's rows x columns; docs/spatial.md)."""
    warnings.warn("hpdl.torch.spatial.grid(spatial=S, data=D) is deprecated: call hpdl.torch.spatial.layout(spatial=S, "
                  "data=D) (grid= is SpatialParallel's rows x columns)", DeprecationWarning, stacklevel=2)
    return layout(spatial, data)


def _register(ranks, size: int) -> ProcessSet:
    if len(ranks) == size:
        return global_process_set
    # Every rank sees the same registrations, so every rank takes the same branch.
    return registered_with(ranks) or add_process_set(ranks)
