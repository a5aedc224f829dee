"""Spatial and hybrid parallelism: one image split across the ranks of a group (row and column
bands), every layer exact to one process in forward and backward; combined with data
parallelism over groups (``layout``). See docs/spatial.md.

    import hpdl.torch as hvd
    from hpdl.torch import spatial
    hvd.init()
    net = spatial.SpatialParallel(model, grid=(2, 1))
    y_part = net(net.scatter(x))
"""

from hpdl.torch.spatial.geometry import SpatialError, bands
from hpdl.torch.spatial.hybrid import Layout, grid, layout  # grid: layout's deprecated name
from hpdl.torch.spatial.parallel import SpatialParallel, check_split

__all__ = ["Layout", "SpatialError", "SpatialParallel", "bands", "check_split", "grid", "layout"]
