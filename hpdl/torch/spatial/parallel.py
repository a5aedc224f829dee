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
import weakref
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from hpdl.torch import runtime
from hpdl.torch.process_sets import ProcessSet, global_process_set
from hpdl.torch.spatial import agreement, dispatch, fingerprint, gradient_scale, randomness, split_check
from hpdl.torch.spatial.comm import GroupComm, group_communicator
from hpdl.torch.spatial.context import Context, active, track_modules
from hpdl.torch.spatial.errors import report_in_one_line
from hpdl.torch.spatial.geometry import Grid, Part, SpatialError
from hpdl.torch.spatial.parts import (channels_last_part_of, flattened_part_of, is_replicated, map_tensors,
                                      mark_replicated, marked, marks_of, part_of, tagged)
from hpdl.torch.spatial.split_check import check_split

__all__ = ["SpatialParallel", "check_split"]

_LOSS_REDUCTIONS = ("mean", "sum")
_open: "weakref.WeakSet[SpatialParallel]" = weakref.WeakSet()  # closed at hpdl's shutdown


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

    It adds hooks to ``module`` (the running layer's path, checkpointing) and holds a
    communicator of the group's own: :meth:`close` (or ``with SpatialParallel(...) as net:``,
    or hpdl's shutdown) removes them and leaves ``module`` as it was.
    """

    def __init__(self, module: nn.Module, grid: Optional[Sequence[int]] = None,
                 process_set: ProcessSet = global_process_set, checkpoint: Union[bool, Iterable[str]] = False,
                 loss_reduction: str = "mean"):
        super().__init__()
        report_in_one_line()  # the refusals below end the program in one line too
        size = process_set.size()
        layout = (size, 1) if grid is None else tuple(grid)
        if len(layout) != 2 or any(not isinstance(n, int) or n < 1 for n in layout) or layout[0] * layout[1] != size:
            raise SpatialError(f"grid={grid!r}: expected (rows, cols) of positive integers whose product is the "
                               f"process set's size, {size}")
        if loss_reduction not in _LOSS_REDUCTIONS:
            raise SpatialError(f"loss_reduction={loss_reduction!r}: expected one of {', '.join(_LOSS_REDUCTIONS)}")
        blocks = _checkpointed_blocks(module, checkpoint) if checkpoint else []
        dispatch.refuse_unsplittable_modules(module)
        self.module = module
        self.grid = Grid(*layout)
        self.process_set = process_set
        self.loss_reduction = loss_reduction
        self._comm: Optional[GroupComm] = group_communicator(process_set)
        self._rank = self._comm.rank
        try:
            agreement.on_wrapping(self._comm, self.grid, loss_reduction, _LOSS_REDUCTIONS, blocks, module)
        except SpatialError:
            self._comm.close()
            self._comm = None
            raise
        self._names = {id(m): name for name, m in module.named_modules()}
        # The fingerprints of what scatter made that no forward took as its input yet (a
        # loss's target): compared across the group at the next forward, or at the start of
        # the backward of the forward before it, whichever comes first.
        self._scattered: List[Optional[torch.Tensor]] = []
        self._hooks = track_modules(module)
        self._checked: set = set()
        self.checkpointed = blocks
        modules = dict(module.named_modules())
        for path in blocks:
            self._hooks += _Checkpoint(modules[path]).handles
        _open.add(self)
        runtime.add_shutdown_hook(_close_open, runtime.ShutdownStage.RELEASE)

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the hooks this wrapper put on the model and release the group's communicator.

        The model is left as it was; this wrapper can no longer run. Idempotent; hpdl's
        shutdown closes every wrapper still open.
        """
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.close()
        _open.discard(self)

    @property
    def closed(self) -> bool:
        return self._comm is None

    def __enter__(self) -> "SpatialParallel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _group(self) -> GroupComm:
        if self._comm is None:
            raise SpatialError("this SpatialParallel has been closed (close(), or hpdl's shutdown): make a new one")
        return self._comm

    # -- measuring -------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_communication(self) -> Iterator[None]:
        """A measuring tool: within the block this rank computes its part alone, as fast as it
        can, with no communication at all: the halos it would receive are zeros, the group's
        sums are its own, its gathers hold its own values (and zeros for the others'). The
        results are wrong; the time is the bound of the real steps (``hpdl bench spatial``).
        Run forward and backward inside it. Not collective: each rank may use it alone.
        """
        comm = self._group()
        previous, comm.communicating = comm.communicating, False
        try:
            yield
        finally:
            comm.communicating = previous

    # -- parts -----------------------------------------------------------------------------

    def part(self, height: int, width: int) -> Part:
        """This rank's part of a map of ``height`` x ``width``."""
        if height < self.grid.rows or width < self.grid.cols:
            raise SpatialError(f"a {height} x {width} image cannot be split into {self.grid} bands")
        return Part(self.grid, self._rank, height, width)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``x`` (..., H, W), the same tensor on every rank of the group."""
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise SpatialError(f"scatter expects a tensor (..., H, W), got {_value_text(x)}")
        held = part_of(x)
        if held is not None:
            raise SpatialError(f"scatter: this tensor is already a part of a {held.height} x {held.width} image "
                               "(scatter or mark made it): scatter the whole image, once")
        part = self.part(x.shape[-2], x.shape[-1])
        (r0, r1), (c0, c1) = part.rows, part.cols
        piece = tagged(x[..., r0:r1, c0:c1].contiguous(), part)
        if self.grid.size == 1:
            return piece
        # The group compares the ranks' images through it (fingerprint.py).
        whole = fingerprint.of(x)
        self._scattered.append(whole)
        return fingerprint.attach(piece, whole)

    def mark(self, x_part: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Mark ``x_part`` as this rank's part of a ``height`` x ``width`` image (the rows and
        columns :meth:`part` names), as :meth:`scatter` marks what it returns: for a part loaded
        by hand (a band of a slide read from disk), or copied outside the model (``.to(device)``
        of a scattered part). Returns ``x_part``."""
        part = self.part(int(height), int(width))
        if not isinstance(x_part, torch.Tensor) or x_part.dim() < 2 or tuple(x_part.shape[-2:]) != part.local_size:
            raise SpatialError(f"mark: rank {self._rank} of the group holds {split_check.rows_and_cols(part)}: "
                               f"{part.local_size[0]} x {part.local_size[1]}, not {_value_text(x_part)}")
        return tagged(x_part, part)

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """The whole of a map whose parts the ranks hold, on every rank (for results: no gradient).
        A replicated output of the model (after global pooling) is whole already: it comes back
        as it is."""
        if part_of(y) is None and is_replicated(y):
            return y.detach().clone()
        marked = part_of(y)
        self._agree_on_call("gather", _numel(tuple(y.shape[:-2])) * marked.height * marked.width if marked else 0)
        part = self._part_of(y)
        lead = tuple(y.shape[:-2])
        pieces = [Part(self.grid, r, part.height, part.width) for r in range(self.grid.size)]
        counts = [_numel(lead) * p.local_size[0] * p.local_size[1] for p in pieces]
        flat = self._group().allgather(y.detach().reshape(-1), counts, "gather")
        whole = y.new_empty(lead + (part.height, part.width))
        for piece, chunk in zip(pieces, torch.split(flat, counts)):
            (r0, r1), (c0, c1) = piece.rows, piece.cols
            whole[..., r0:r1, c0:c1] = chunk.view(lead + piece.local_size)
        return whole

    def whole_mean(self, value: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """The whole map's value of a mean taken over this rank's ``part`` of it (a loss such as
        ``F.l1_loss(y_part, t_part)``), the same on every rank of the group; no gradient."""
        self._agree_on_call("whole_mean")
        share = self._part_of(part).numel_share
        total = (value.detach().to(torch.float64) * share).reshape(1).clone()
        return self._group().allreduce_sum(total, "whole_mean")[0].to(value.dtype)

    def _agree_on_call(self, call: str, values: int = 0) -> None:
        """agreement.on_call, where the group communicates."""
        comm = self._group()
        if self.grid.size > 1 and comm.communicating:
            agreement.on_call(comm, call, values)

    def _part_of(self, x: torch.Tensor) -> Part:
        """The part ``x`` holds: its mark, or else found from every rank's size (collective)."""
        part = part_of(x)
        if part is not None:
            return part
        _refuse_channels_last(x, "this tensor")
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise SpatialError(f"expected a part of a map (..., h, w), got {_value_text(x)}")
        mine = torch.tensor([x.shape[-2], x.shape[-1], _numel(tuple(x.shape[:-2]))], dtype=torch.int64)
        sizes = self._group().allgather(mine.unsqueeze(0), [1] * self.grid.size, "sizes").tolist()
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
        comm = self._group()
        part = self._input_part(x)
        further = agreement.further_inputs(args, kwargs)
        taken = [fingerprint.carried(t) for t in [x] + [t for _, t in further]]
        later = [f for f in self._scattered if not any(f is t for t in taken if t is not None)]
        self._scattered = []
        base = self._agree(comm, x, part, further, later)
        key = (tuple(x.shape[:-2]), x.dtype, x.device.type, part.height, part.width, self.module.training)
        if key not in self._checked:
            split_check.check(self.module, self._names, part, x, args, kwargs,
                              comm if comm.communicating else None)
            self._checked.add(key)
        ctx = Context(self.grid, self._rank, comm, self._names, grad_scale=float(self.grid.size), random_base=base,
                      builds_graph=torch.is_grad_enabled())
        with dispatch.running(ctx):
            out = self.module(x, *args, **kwargs)
        out = map_tensors(out, self._weigh)
        if torch.is_grad_enabled() and self.grid.size > 1 and comm.communicating:
            agreement.first_gradient_of(out, self._agree_on_later_scatters)
        return out

    def _input_part(self, x: Any) -> Part:
        """The part ``x`` is: made by scatter (or mark) for this rank of this grid, and still its size."""
        part = part_of(x)
        if part is None:
            raise SpatialError(f"SpatialParallel's input must be this rank's part of the image: net.scatter(x) "
                               f"makes it (this is {_value_text(x)} that scatter did not make; a copy made outside "
                               "the model, such as .to(device), is not one: scatter after the copy, or "
                               "net.mark(x_part, height, width))")
        if part.grid != self.grid or part.rank != self._rank:
            raise SpatialError(f"SpatialParallel's input is a part for group rank {part.rank} of a {part.grid} grid; "
                               f"this is rank {self._rank} of {self.grid}: scatter with this wrapper")
        if x.dim() < 2 or tuple(x.shape[-2:]) != part.local_size:
            raise SpatialError(f"SpatialParallel's input is {_value_text(x)}, but the part it is marked as "
                               f"({split_check.rows_and_cols(part)}) is {part.local_size[0]} x {part.local_size[1]}")
        return part

    def _agree_on_later_scatters(self) -> None:
        """At the start of a backward: agreement.on_later_scatters of what this rank scattered
        since the forward. Each rank runs it once per forward whose output the backward reaches."""
        comm = self._comm
        if comm is None or not comm.communicating:  # closed, or measuring alone (no_communication)
            return
        later, self._scattered = self._scattered, []
        self._agree_on_call("backward")
        agreement.on_later_scatters(comm, later)

    def _agree(self, comm: GroupComm, x: torch.Tensor, part: Part, further: Sequence[Tuple[str, torch.Tensor]],
               later: Sequence[Optional[torch.Tensor]]) -> int:
        """agreement.on_inputs of this forward; returns the forward's base for the random
        streams (randomness.py), rank 0's, which rides on the same gather."""
        base = randomness.draw_base()
        if self.grid.size == 1 or not comm.communicating:
            return base
        self._agree_on_call("forward")
        return agreement.on_inputs(comm, x, part, self.module.training, further, later, base,
                                   list(self.module.named_parameters()))

    def _weigh(self, out: torch.Tensor) -> torch.Tensor:
        _refuse_channels_last(out, "the model's output")
        part = part_of(out)
        if part is None:  # replicated: the same loss on every rank counts once
            return mark_replicated(gradient_scale.scale_gradient(out, 1.0 / self.grid.size))
        share = part.numel_share if self.loss_reduction == "mean" else 1.0
        return tagged(gradient_scale.scale_gradient(out, share), part)


def _refuse_channels_last(value: Any, what: str) -> None:
    """Refuse a part whose image dimensions are not its last two (channels_last.py, flattened.py)
    where a part with them last, or a whole tensor, is expected."""
    part = channels_last_part_of(value)
    if part is not None:
        raise SpatialError(f"{what} is a part of a {part.height} x {part.width} map with its image dimensions "
                           f"before the last (shape {list(value.shape)}, channels last): permute them back to the "
                           "last two (x.permute(0, 3, 1, 2)) in the model's forward")
    part = flattened_part_of(value)
    if part is not None:
        raise SpatialError(f"{what} is a part of a {part.height} x {part.width} map with its rows and columns merged "
                           f"into its last dimension (shape {list(value.shape)}, x.flatten(2)): reduce it over that "
                           "dimension, or keep the rows and columns, in the model's forward")


def _close_open() -> None:
    """At hpdl's shutdown: close every wrapper still open (their communicators end with it)."""
    for net in list(_open):
        net.close()


class _Checkpoint:
    """Backward recomputes a block's activations instead of keeping them (GEMS's memory-aware
    training), through hooks on the block (as PyTorch's composable checkpoint does): the
    recomputation runs under the spatial mode again, exchanges the same halos in the same
    order on every rank, replays the same random streams, and leaves batch norm's running
    statistics as the forward left them."""

    def __init__(self, block: nn.Module):
        self._runs: List[Any] = []  # one per call of the block under way (a block may be called again inside)
        self.handles = [block.register_forward_pre_hook(self._before, with_kwargs=True),
                        block.register_forward_hook(self._after, always_call=True)]

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ctx = active()
        if ctx is not None and ctx.recomputing and ctx.input_parts is not None:
            for value, marks in zip(args, ctx.input_parts):  # saved inputs come back unmarked
                if isinstance(value, torch.Tensor):
                    marked(value, marks)
        if ctx is None or ctx.dry or ctx.recomputing or not torch.is_grad_enabled():
            self._runs.append(None)
            return
        stack = [m for m in ctx.modules if m is not module]
        again = dataclasses.replace(ctx, recomputing=True, modules=stack, random_calls=ctx.random_calls,
                                    trace=None, input_parts=[marks_of(a) for a in args])

        def contexts():
            return contextlib.nullcontext(), dispatch.running(dataclasses.replace(again, modules=list(stack)))

        run = torch.utils.checkpoint._checkpoint_without_reentrant_generator(
            module, True, contexts, "default", False, True, *args, **kwargs)
        next(run)
        dispatch.note_own_checkpoint()
        self._runs.append(run)

    def _after(self, module: nn.Module, args: tuple, output: Any) -> None:
        run = self._runs.pop() if self._runs else None
        if run is not None:
            try:
                next(run)
            except StopIteration:
                pass


def _checkpointed_blocks(module: nn.Module, which: Union[bool, Iterable[str]]) -> List[str]:
    modules = dict(module.named_modules())
    if which is True:
        blocks, inside = [], set()
        for name, child_of in modules.items():
            if isinstance(child_of, (nn.Sequential, nn.ModuleList)) and name not in inside:
                for child_name, child in child_of.named_children():
                    path = f"{name}.{child_name}" if name else child_name
                    if any(True for _ in child.children()):
                        blocks.append(path)
                        inside.update(n for n in modules if n.startswith(path + "."))
                        inside.add(path)
        return blocks
    blocks = list(which)
    missing = [b for b in blocks if b not in modules]
    if missing:
        raise SpatialError(f"checkpoint: the model has no module {missing[0]!r}")
    return blocks


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _value_text(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return type(value).__name__
