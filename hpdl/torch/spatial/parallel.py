"""SpatialParallel: a model trained (or run) on images split across the ranks of a group.

Every rank of the group holds one part of each image (geometry.py: row bands x column bands)
and runs the model's own forward on it (dispatch.py); the result is exactly what one process
computes on the whole image, forward and backward.

The training contract, and the gradient bookkeeping that makes it hold:

- A loss written on the rank's own part of the output as one process writes it on the whole
  (a mean over pixels: ``F.l1_loss(y_part, net.scatter(target))``) is that part's share of the
  whole loss when weighted by the part's share of the pixels: the output's gradient is
  weighted so (``loss_reduction="sum"``: not weighted). A model ending in global pooling
  returns the same (replicated) result on every rank, and the same loss there counts once:
  its gradient is divided by the group size. So every rank's gradients are its own
  contribution to the one-process gradients, and a part's input gradient is exact.
- Every parameter's gradient is then the sum of the ranks' contributions; the optimizer
  averages over all ranks (``hvd.DistributedOptimizer``), so each use of a parameter in the
  forward multiplies its gradient by the group size: the average over the group is the sum.
  Across data-parallel replicas (``hybrid.grid``) the same average is the replicas' mean, as in
  plain data parallelism.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Iterable, Iterator, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from hpdl.torch.process_sets import ProcessSet, global_process_set
from hpdl.torch.spatial import dispatch
from hpdl.torch.spatial.comm import GroupComm, group_communicator
from hpdl.torch.spatial.context import Context
from hpdl.torch.spatial.geometry import Grid, Part, SpatialError, ThinBand
from hpdl.torch.spatial.parts import part_of, tagged

__all__ = ["SpatialParallel", "check_split"]

_LOSS_REDUCTIONS = ("mean", "sum")
_SEARCH_LIMIT = 4096  # image sizes tried when suggesting one that fits


class SpatialParallel(nn.Module):
    """Run ``module`` on images split over the ranks of ``process_set``.

    Args:
        module: the model, used as it is (its forward, its modules, its parameters).
        grid: ``(R, C)``: R row bands and C column bands, R * C = the set's size (default: all
            ranks of the set in row bands).
        process_set: the ranks that share each image (default: every rank).
        checkpoint: recompute activations in backward instead of keeping them (GEMS's
            memory-aware training): True for every block (a module with children inside an
            ``nn.Sequential`` or ``nn.ModuleList``: ResNet's bottlenecks, EDSR's residual
            blocks), or the paths of the modules to recompute.
        loss_reduction: how the loss reduces the output's pixels: ``"mean"`` (default; the
            loss on a part is weighted by its share of the pixels) or ``"sum"``.

    Making it is collective over every rank of the job: each passes its own set (hybrid.grid
    makes them). Raises SpatialError for a layout that does not fit the set.
    """

    def __init__(self, module: nn.Module, grid: Optional[Sequence[int]] = None,
                 process_set: ProcessSet = global_process_set, checkpoint: Union[bool, Iterable[str]] = False,
                 loss_reduction: str = "mean"):
        super().__init__()
        size = process_set.size()
        layout = (size, 1) if grid is None else tuple(grid)
        if len(layout) != 2 or any(not isinstance(n, int) or n < 1 for n in layout) or layout[0] * layout[1] != size:
            raise SpatialError(f"grid={grid!r}: expected (rows, cols) of positive integers whose product is the "
                               f"process set's size, {size}")
        if loss_reduction not in _LOSS_REDUCTIONS:
            raise SpatialError(f"loss_reduction={loss_reduction!r}: expected one of {', '.join(_LOSS_REDUCTIONS)}")
        self.module = module
        self.grid = Grid(*layout)
        self.process_set = process_set
        self.loss_reduction = loss_reduction
        self._comm: GroupComm = group_communicator(process_set)
        self._rank = self._comm.rank
        self._names = {id(m): name for name, m in module.named_modules()}
        self._hooks = dispatch.track_modules(module)
        self._checked: set = set()
        if checkpoint:
            self._checkpoint(checkpoint)

    # -- measuring -------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_communication(self) -> Iterator[None]:
        """A measuring tool: within the block this rank computes its part alone, as fast as it
        can, with no communication at all: the halos it would receive are zeros, the group's
        sums are its own, its gathers hold its own values (and zeros for the others'). The
        results are wrong; the time is the bound of the real steps (``hpdl bench spatial``).
        Run forward and backward inside it. Not collective: each rank may use it alone.
        """
        previous, self._comm.communicating = self._comm.communicating, False
        try:
            yield
        finally:
            self._comm.communicating = previous

    # -- parts -----------------------------------------------------------------------------

    def part(self, height: int, width: int) -> Part:
        """This rank's part of a map of ``height`` x ``width``."""
        if height < self.grid.rows or width < self.grid.cols:
            raise SpatialError(f"a {height} x {width} image cannot be split into {self.grid} bands")
        return Part(self.grid, self._rank, height, width)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``x`` (..., H, W), the same tensor on every rank of the group."""
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise SpatialError(f"scatter expects a tensor (..., H, W), got {_describe(x)}")
        part = self.part(x.shape[-2], x.shape[-1])
        (r0, r1), (c0, c1) = part.rows, part.cols
        return tagged(x[..., r0:r1, c0:c1].contiguous(), part)

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """The whole of a map whose parts the ranks hold, on every rank (for results: no gradient)."""
        part = self._part_of(y)
        lead = tuple(y.shape[:-2])
        pieces = [Part(self.grid, r, part.height, part.width) for r in range(self.grid.size)]
        counts = [_numel(lead) * p.local_size[0] * p.local_size[1] for p in pieces]
        flat = self._comm.allgather(y.detach().reshape(-1), counts, "gather")
        whole = y.new_empty(lead + (part.height, part.width))
        for piece, chunk in zip(pieces, torch.split(flat, counts)):
            (r0, r1), (c0, c1) = piece.rows, piece.cols
            whole[..., r0:r1, c0:c1] = chunk.view(lead + piece.local_size)
        return whole

    def whole_mean(self, value: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """The whole map's value of a mean taken over this rank's ``part`` of it (a loss such as
        ``F.l1_loss(y_part, t_part)``), the same on every rank of the group; no gradient."""
        share = self._part_of(part).numel_share
        total = (value.detach().to(torch.float64) * share).reshape(1).clone()
        return self._comm.allreduce_sum(total, "whole_mean")[0].to(value.dtype)

    def _part_of(self, x: torch.Tensor) -> Part:
        """The part ``x`` holds: its mark, or else found from every rank's size (collective)."""
        part = part_of(x)
        if part is not None:
            return part
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise SpatialError(f"expected a part of a map (..., h, w), got {_describe(x)}")
        mine = torch.tensor([x.shape[-2], x.shape[-1], _numel(tuple(x.shape[:-2]))], dtype=torch.int64)
        sizes = self._comm.allgather(mine.unsqueeze(0), [1] * self.grid.size, "sizes").tolist()
        height = sum(sizes[self.grid.rank_at(i, 0)][0] for i in range(self.grid.rows))
        width = sum(sizes[self.grid.rank_at(0, j)][1] for j in range(self.grid.cols))
        for rank, (h, w, lead) in enumerate(sizes):
            expected = Part(self.grid, rank, height, width).local_size if height and width else None
            if (h, w) != expected or lead != sizes[0][2]:
                raise SpatialError(f"the ranks' parts do not make one map: rank {rank} of the group holds "
                                   f"{h} x {w} (x {lead}), where a {height} x {width} map split into {self.grid} "
                                   f"bands gives it {expected} (x {sizes[0][2]}); use scatter() to split inputs")
        part = Part(self.grid, self._rank, height, width)
        tagged(x, part)
        return part

    # -- forward ---------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """This rank's part of the output, or for a model ending in global pooling, the whole
        output (the same on every rank of the group)."""
        part = self._part_of(x)
        key = (tuple(x.shape), x.dtype, part.height, part.width, self.module.training)
        if key not in self._checked:
            self._check(part, x, args, kwargs)
            self._checked.add(key)
        ctx = Context(self.grid, self._rank, self._comm, self._names, grad_scale=float(self.grid.size))
        with dispatch.running(ctx):
            out = self.module(x, *args, **kwargs)
        return _map_tensors(out, self._weigh)

    def _weigh(self, out: torch.Tensor) -> torch.Tensor:
        part = part_of(out)
        if part is None:  # replicated: the same loss on every rank counts once
            return dispatch.scale_gradient(out, 1.0 / self.grid.size)
        share = part.numel_share if self.loss_reduction == "mean" else 1.0
        return tagged(dispatch.scale_gradient(out, share), part)

    # -- checks before any work ------------------------------------------------------------

    def _check(self, part: Part, x: torch.Tensor, args, kwargs) -> None:
        """Run the forward on the meta device (shapes only, no communication): an unsupported
        layer or a band too thin for a layer is refused on every rank before any work."""
        _check(self.module, self._names, part, x, args, kwargs)

    # -- memory ----------------------------------------------------------------------------

    def _checkpoint(self, which: Union[bool, Iterable[str]]) -> None:
        modules = dict(self.module.named_modules())
        if which is True:
            blocks, inside = [], set()
            for name, module in modules.items():
                if isinstance(module, (nn.Sequential, nn.ModuleList)) and name not in inside:
                    for child_name, child in module.named_children():
                        path = f"{name}.{child_name}" if name else child_name
                        if any(True for _ in child.children()):
                            blocks.append(path)
                            inside.update(n for n in modules if n.startswith(path + "."))
                            inside.add(path)
        else:
            blocks = list(which)
            missing = [b for b in blocks if b not in modules]
            if missing:
                raise SpatialError(f"checkpoint: the model has no module {missing[0]!r}")
        for path in blocks:
            block = modules[path]
            block.forward = _recomputed_in_backward(block.forward)
        self.checkpointed = blocks


def check_split(module: nn.Module, shape: Sequence[int], grid: Sequence[int] = (1, 1),
                dtype: torch.dtype = torch.float32) -> None:
    """Refuse, in this process, what SpatialParallel's first forward would refuse on every rank:
    raise :class:`SpatialError` when ``module`` cannot run on inputs of ``shape`` (..., H, W)
    split into ``grid`` (rows, cols) bands (a layer it does not support, a band thinner than a
    layer's halo), naming the layer and what would fit. Shapes only (the meta device): no
    communication, no ``hvd.init()``, no memory for activations.
    """
    layout = tuple(grid)
    if len(layout) != 2 or any(not isinstance(n, int) or n < 1 for n in layout):
        raise SpatialError(f"grid={grid!r}: expected (rows, cols) of positive integers")
    height, width = int(shape[-2]), int(shape[-1])
    if height < layout[0] or width < layout[1]:
        raise SpatialError(f"a {height} x {width} image cannot be split into {layout[0]}x{layout[1]} bands")
    names = {id(m): name for name, m in module.named_modules()}
    x = torch.empty(tuple(shape), dtype=dtype, device="meta")
    handles = dispatch.track_modules(module)  # the running module's path, for the messages
    try:
        _check(module, names, Part(Grid(*layout), 0, height, width), x, (), {})
    finally:
        for handle in handles:
            handle.remove()


def _check(module: nn.Module, names, part: Part, x: torch.Tensor, args, kwargs) -> None:
    try:
        _dry_run(module, names, part, x, args, kwargs)
    except ThinBand as thin:
        raise SpatialError(f"{thin}; {_fits_instead(module, names, part, x, thin.axis)}") from None


def _dry_run(module: nn.Module, names, part: Part, x: torch.Tensor, args, kwargs) -> None:
    state = {name: t.to("meta") for name, t in itertools.chain(module.named_parameters(), module.named_buffers())}
    meta = tagged(torch.empty(x.shape[:-2] + part.local_size, dtype=x.dtype, device="meta"), part)
    ctx = Context(part.grid, part.rank, None, names)
    with dispatch.running(ctx), torch.no_grad():
        torch.func.functional_call(module, state, (meta,) + tuple(args), kwargs)


def _fits(module: nn.Module, names, part: Part, x: torch.Tensor) -> bool:
    try:
        _dry_run(module, names, part, x, (), {})
    except ThinBand:
        return False
    return True


def _fits_instead(module: nn.Module, names, part: Part, x: torch.Tensor, axis: int) -> str:
    """The smallest image, and the largest grid, that would work (a sentence)."""
    what = ("height", "row") if axis == 0 else ("width", "column")
    length = part.length(axis)
    smallest = _first_fitting(length + 1, length + _SEARCH_LIMIT,
                              lambda n: _fits(module, names, _resized_part(part, axis, n), x))
    parts = part.grid.bands_along(axis)
    largest = next((k for k in range(parts - 1, 0, -1)
                    if _fits(module, names, _regridded_part(part, axis, k), x)), None)
    extent = "high" if axis == 0 else "wide"
    options = []
    if smallest is not None:
        options.append(f"an image at least {smallest} pixels {extent}")
    if largest is not None:
        options.append(f"at most {largest} {what[1]} band" + ("s" if largest > 1 else ""))
    return (f"an image {length} pixels {extent} is too small for {parts} {what[1]} bands: use "
            + (" or ".join(options) if options else f"another model (no {what[0]} up to "
                                                     f"{length + _SEARCH_LIMIT} works)"))


def _resized_part(part: Part, axis: int, length: int) -> Part:
    return part.resized(length, part.width) if axis == 0 else part.resized(part.height, length)


def _regridded_part(part: Part, axis: int, bands: int) -> Part:
    grid = Grid(bands, part.grid.cols) if axis == 0 else Grid(part.grid.rows, bands)
    return dataclasses.replace(part, grid=grid, rank=0)


def _first_fitting(low: int, high: int, fits) -> Optional[int]:
    """The smallest n in [low, high) for which ``fits(n)``, searched in growing steps then halving
    (a dry run per try: a few dozen, not thousands); None when none fits."""
    step, last_misfit = 1, low - 1
    n = low
    while n < high and not fits(n):
        last_misfit, n, step = n, n + step, step * 2
    if n >= high:
        return None
    while n - last_misfit > 1:
        middle = (last_misfit + n) // 2
        if fits(middle):
            n = middle
        else:
            last_misfit = middle
    return n


def _recomputed_in_backward(forward):
    """``forward``, recomputed in backward (torch.utils.checkpoint) under the spatial mode again:
    the recomputation exchanges the same halos, in the same order on every rank, and leaves
    batch norm's running statistics as the forward left them."""

    def run(*args: Any, **kwargs: Any) -> Any:
        ctx = dispatch.active()
        if ctx is None or ctx.dry or ctx.recomputing or not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        parts = [part_of(a) for a in args]
        stack = list(ctx.modules)

        def block(*inputs: Any) -> Any:
            for value, part in zip(inputs, parts):
                if part is not None:
                    tagged(value, part)
            return forward(*inputs, **kwargs)

        def contexts():
            again = dataclasses.replace(ctx, recomputing=True, modules=list(stack))
            return contextlib.nullcontext(), dispatch.running(again)

        return torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False, context_fn=contexts)

    return run


def _map_tensors(value: Any, fn) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return type(value).__name__
