"""Training on patches split over groups of ranks: ``hpdl run -np 4 -- hpdl sr train ... spatial=2``.

With ``spatial=S`` the job's ranks form groups of S consecutive ranks (``hpdl.torch.spatial.layout``):
every rank of a group takes the same patches, its replica's shard of each epoch, and holds one
row band of each (``SpatialParallel``), so a patch too large for one process's memory, or a
whole image, trains on S of them; the size / S groups are data-parallel replicas. The loss is
written on the rank's part as on the whole patch, and SpatialParallel's weighting and
DistributedOptimizer's average make the updates those of plain data parallelism over the
replicas on whole patches (docs/spatial.md, "The training contract"). The model itself is not
touched: checkpoints, validation and the moving average see the plain model, as without it.

``spatial=1`` trains on whole patches through the same interface (``WholePatches``), so the
training loop reads the same either way.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

import hpdl.torch as hvd
from hpdl.sr.errors import TrainError
from hpdl.torch import spatial

__all__ = ["WholePatches", "patch_forward", "spatial_layout"]


class WholePatches:
    """A model's forward on whole patches, with SpatialParallel's interface: nothing is split.

    ``compiled``: the forward runs through ``torch.compile(model)`` (the optimizer, its hooks and
    the checkpoints stay on ``model``'s own parameters).
    """

    def __init__(self, model: nn.Module, compiled: bool = False) -> None:
        self.module = model
        self._forward = torch.compile(model) if compiled else model

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    def whole_mean(self, value: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        return value.detach()


def spatial_layout(spatial_ranks: int) -> Optional[spatial.Layout]:
    """Register the process sets of groups of ``spatial_ranks`` (collective); None for 1.

    Raises TrainError, on every rank alike, when they do not divide the job's ranks.
    """
    size = hvd.size()
    if size % spatial_ranks:
        ranks = f"the {size} ranks of this job do not" if size > 1 else "the 1 rank of this job does not"
        raise TrainError(f"spatial={spatial_ranks}: {ranks} form groups of {spatial_ranks} "
                         "(the ranks must be a multiple of spatial)")
    if spatial_ranks == 1:
        return None
    return spatial.layout(spatial=spatial_ranks, data=size // spatial_ranks)


def patch_forward(model: nn.Module, layout: Optional[spatial.Layout], patch_size: int,
                  compiled: bool = False) -> Any:
    """The forward the training loop runs: on this rank's band of each patch (``layout``), or on
    whole patches. Collective with a layout.

    A patch that S bands cannot split (too few rows, a band thinner than a layer's halo) is
    refused now, with the layer's own message, on every rank alike: before out_dir is touched.
    """
    if layout is None:
        return WholePatches(model, compiled)
    net = spatial.SpatialParallel(model, process_set=layout.spatial_set)
    # Shapes only, every rank's band in this process, as the first forward checks them (the ranks'
    # parameters are not broadcast yet: a forward would be refused for that).
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    try:
        spatial.check_split(model, (1, 3, patch_size, patch_size), (net.grid.rows, net.grid.cols), dtype)
    except spatial.SpatialError as err:
        net.close()
        raise TrainError(f"spatial={layout.spatial} cannot split patches of patch_size={patch_size}: {err}") from None
    return net
