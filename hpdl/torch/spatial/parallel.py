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
import random
import sys
import weakref
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from hpdl.torch import runtime
from hpdl.torch.process_sets import ProcessSet, global_process_set
from hpdl.torch.spatial import agreement, dispatch, fingerprint, randomness
from hpdl.torch.spatial.comm import GroupComm, group_communicator
from hpdl.torch.spatial.context import Context
from hpdl.torch.spatial.errors import report_in_one_line
from hpdl.torch.spatial.geometry import Grid, Part, SpatialError, ThinBand
from hpdl.torch.spatial.parts import is_replicated, mark_replicated, part_of, tagged

__all__ = ["SpatialParallel", "check_split"]

_LOSS_REDUCTIONS = ("mean", "sum")
_SEARCH_LIMIT = 4096  # image sizes tried when suggesting one that fits
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
        self._hooks = dispatch.track_modules(module)
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
            raise SpatialError(f"mark: rank {self._rank} of the group holds {_rows_and_cols(part)}: "
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
            _check(self.module, self._names, part, x, args, kwargs)
            self._checked.add(key)
        ctx = Context(self.grid, self._rank, comm, self._names, grad_scale=float(self.grid.size), random_base=base,
                      builds_graph=torch.is_grad_enabled())
        with dispatch.running(ctx):
            out = self.module(x, *args, **kwargs)
        out = _map_tensors(out, self._weigh)
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
                               f"({_rows_and_cols(part)}) is {part.local_size[0]} x {part.local_size[1]}")
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
        part = part_of(out)
        if part is None:  # replicated: the same loss on every rank counts once
            return mark_replicated(dispatch.scale_gradient(out, 1.0 / self.grid.size))
        share = part.numel_share if self.loss_reduction == "mean" else 1.0
        return tagged(dispatch.scale_gradient(out, share), part)


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
        ctx = dispatch.active()
        if ctx is not None and ctx.recomputing and ctx.input_parts is not None:
            for value, part in zip(args, ctx.input_parts):  # saved inputs come back unmarked
                if part is not None and isinstance(value, torch.Tensor):
                    tagged(value, part)
        if ctx is None or ctx.dry or ctx.recomputing or not torch.is_grad_enabled():
            self._runs.append(None)
            return
        stack = [m for m in ctx.modules if m is not module]
        again = dataclasses.replace(ctx, recomputing=True, modules=stack, random_calls=ctx.random_calls,
                                    trace=None, input_parts=[part_of(a) for a in args])

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


def check_split(module: nn.Module, shape: Sequence[int], grid: Sequence[int] = (1, 1),
                dtype: torch.dtype = torch.float32) -> None:
    """Refuse, in this process, what SpatialParallel's first forward would refuse on every rank:
    raise :class:`SpatialError` when ``module`` cannot run on inputs of ``shape`` (..., H, W)
    split into ``grid`` (rows, cols) bands (a layer it does not support, a band thinner than a
    layer's halo, a model that decides on a part's own size), naming the layer and what would
    fit. Shapes only (the meta device): no communication, no ``hvd.init()``, no memory for
    activations. Every rank's part is tried, as the first forward tries them.
    """
    layout = tuple(grid)
    if len(layout) != 2 or any(not isinstance(n, int) or n < 1 for n in layout):
        raise SpatialError(f"grid={grid!r}: expected (rows, cols) of positive integers")
    height, width = int(shape[-2]), int(shape[-1])
    if height < layout[0] or width < layout[1]:
        raise SpatialError(f"a {height} x {width} image cannot be split into {layout[0]}x{layout[1]} bands")
    dispatch.refuse_unsplittable_modules(module)
    names = {id(m): name for name, m in module.named_modules()}
    x = torch.empty(tuple(shape), dtype=dtype, device="meta")
    handles = dispatch.track_modules(module)  # the running module's path, for the messages
    try:
        _check(module, names, Part(Grid(*layout), 0, height, width), x, (), {})
    finally:
        for handle in handles:
            handle.remove()


def _check(module: nn.Module, names, part: Part, x: torch.Tensor, args, kwargs) -> None:
    """Dry-run the model on every rank's part of the image (shapes only, no communication), in
    the same order on every rank, so that every rank refuses alike, before any work: a layer
    it does not support, a band too thin for a layer, a part PyTorch itself refuses, or a
    forward that runs differently on different parts."""
    records = []
    for rank in range(part.grid.size):
        mine = dataclasses.replace(part, rank=rank)
        try:
            records.append(_dry_run(module, names, mine, x, args, kwargs))
        except ThinBand as thin:
            raise SpatialError(f"{thin}; {_fits_instead(module, names, mine, x, thin.axis)}") from None
        except SpatialError:
            raise
        except Exception as err:  # noqa: BLE001 - PyTorch's refusal of one part, said for every rank alike
            where, first = getattr(err, "hpdl_where", "the model's forward"), _first_line(err)
            if not _fits(module, names, Part(Grid(1, 1), 0, part.height, part.width), x, args, kwargs):
                raise SpatialError(f"{where}: PyTorch refused in the first forward's check of the split, which runs "
                                   f"the model on shapes only (the meta device, no values): {first}; it refuses the "
                                   "whole image alike, so the split is not the cause: the forward needs values or a "
                                   "device there (a tensor read as an array, made on another device, or sized by "
                                   "its values)") from None
            raise SpatialError(f"{where}: on group rank {rank}'s part ({_rows_and_cols(mine)}) PyTorch refused: "
                               f"{first}; the image may be too small for {part.grid} bands") from None
    _compare_records(records)
    _compare_with_one_process(module, names, part, x, args, kwargs, records[0])


def _compare_with_one_process(module: nn.Module, names, part: Part, x: torch.Tensor, args, kwargs,
                              record: List[tuple]) -> None:
    """Refuse a forward that computes with a part's own lengths where the ranks' parts are
    alike, so that comparing them shows nothing (97 rows on 2 bands show it: 49 and 48; 96 do
    not). Python reads a length's own value, the part's, in arithmetic with a float first
    (``0.5 * h``, ``s.item() / x.numel()``), in ``int()`` of a length made a float
    (``int(h * 0.5)``), and in numpy or ``range``: one process computes with the whole image's.
    So the model runs once more on the whole image as one part, whose lengths are the whole's,
    and every call must have the same numbers as on a part."""
    if part.grid.size == 1:
        return
    one = Part(Grid(1, 1), 0, part.height, part.width)
    try:
        whole = _dry_run(module, names, one, x, args, kwargs)
    except Exception as err:  # noqa: BLE001 - the parts ran: the whole image must run alike
        whole = [("a refusal", getattr(err, "hpdl_where", "the model's forward"), (_first_line(err),), ())]
    differing = _first_difference(record, whole)
    if differing is not None:
        step, mine, theirs = differing
        raise SpatialError(
            f"the model's forward computes with a part's own lengths: at call {step}, one process on the whole "
            f"image {_call_text(theirs)} where a part {_call_text(mine)}; {_OWN_LENGTHS}: write h // 2, "
            "round(h * 0.5) or math.floor(h * 0.5), put the length first (h * 0.5), or compute on tensors")


# Where Python reads a part's own length (its int value) instead of the whole image's.
_OWN_LENGTHS = ("Python reads a part's own length, not the whole image's, in int() of it, in arithmetic with a float "
                "first (0.5 * h, s.item() / x.numel()), in int() of a length made a float (int(h * 0.5)), and in "
                "numpy or range()")


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _first_difference(first: List[tuple], other: List[tuple]) -> Optional[Tuple[int, Optional[tuple],
                                                                                 Optional[tuple]]]:
    """The first call (numbered from 1) where two dry runs' records differ, with both calls."""
    for step, (mine, theirs) in enumerate(itertools.zip_longest(first, other), start=1):
        if mine != theirs:
            return step, mine, theirs
    return None


def _compare_records(records: List[List[tuple]]) -> None:
    """Refuse a forward whose calls on the parts differ between ranks: it decided on a part's
    own numbers (``int(x.shape[-2])``), which one process would not."""
    for rank, record in enumerate(records[1:], start=1):
        differing = _first_difference(records[0], record)
        if differing is not None:
            step, mine, theirs = differing
            raise SpatialError(
                f"the model's forward runs differently on the ranks' parts: at call {step} on a part, group rank 0 "
                f"{_call_text(mine)} where group rank {rank} {_call_text(theirs)}; it decides on a part's own size: "
                f"{_OWN_LENGTHS}: decide on the lengths themselves (x.shape[-2] compares as the whole image's)")


def _call_text(call: Optional[tuple]) -> str:
    if call is None:
        return "has finished"
    what, where, args, kwargs = call
    shown = [a for a in args[1:] if a != "T"] + [f"{k}={v}" for k, v in kwargs]
    return f"calls {what}({', '.join(map(str, shown))}) in {where}"


def _dry_run(module: nn.Module, names, part: Part, x: torch.Tensor, args, kwargs) -> List[tuple]:
    state = {name: _for_the_dry_run(t)
             for name, t in itertools.chain(module.named_parameters(), module.named_buffers())}
    meta = tagged(torch.empty(x.shape[:-2] + part.local_size, dtype=x.dtype, device="meta"), part)

    def as_this_part(value: torch.Tensor) -> torch.Tensor:
        # Other inputs that are parts of a map (an image's mask, scattered too): the dry run's
        # rank's part of the same map, as the first input is; a whole tensor (a class label,
        # a per-channel scale) on the meta device with the parameters.
        other = part_of(value)
        if other is None:
            return value if value.is_meta else _for_the_dry_run(value)
        if part.grid.size == 1:  # the whole image as one part (_compare_with_one_process): each map whole
            theirs = Part(part.grid, 0, other.height, other.width)
        elif other.grid != part.grid:
            return value
        else:
            theirs = dataclasses.replace(other, rank=part.rank)
        return tagged(torch.empty(value.shape[:-2] + theirs.local_size, dtype=value.dtype, device="meta"), theirs)

    args, kwargs = _map_tensors(tuple(args), as_this_part), _map_tensors(dict(kwargs), as_this_part)
    ctx = Context(part.grid, part.rank, None, names, trace=[])
    with dispatch.running(ctx), torch.no_grad(), _random_states_kept(), _attributes_for_the_dry_run(module):
        torch.func.functional_call(module, state, (meta,) + tuple(args), kwargs)
    return ctx.trace


@contextlib.contextmanager
def _attributes_for_the_dry_run(model: nn.Module) -> Iterator[None]:
    """The model's modules as a dry run needs them, then as it found them. Tensors a forward
    keeps on them besides parameters and buffers (a cache made at the first call) are on the
    meta device during the dry run, as the parameters are (see _dry_run for the ones of no
    dimensions); and what the dry run leaves on them (such a cache, made from meta tensors, or
    a buffer registered) is undone, or the real forward would use it, and the next part's dry
    run would run differently.

    The forward hooks of the user's own (on its modules, and global ones) are left out: a hook
    that logs or keeps activations (feature maps, Grad-CAM) would see each part's dry run (on
    the meta device, where reading values fails), and run once per part more than the forward
    runs. PyTorch's own (weight norm's, spectral norm's and pruning's pre-hooks, which make the
    weight) and hpdl's run."""
    kept = []
    for module in model.modules():
        tables = {key: dict(module.__dict__[key]) for key in ("_parameters", "_buffers", "_modules")
                  if key in module.__dict__}
        kept.append((module, dict(module.__dict__), tables))
        for key, value in list(module.__dict__.items()):
            if isinstance(value, torch.Tensor) and not value.is_meta:
                module.__dict__[key] = _for_the_dry_run(value)
        for key in ("_forward_pre_hooks", "_forward_hooks"):  # restored with the rest of __dict__
            hooks = module.__dict__.get(key)
            if hooks:
                module.__dict__[key] = type(hooks)((k, h) for k, h in hooks.items() if not _users_hook(h))
    global_hooks = [nn.modules.module._global_forward_pre_hooks, nn.modules.module._global_forward_hooks]
    global_kept = [dict(hooks) for hooks in global_hooks]
    for hooks in global_hooks:  # read by name in torch's module: emptied in place, not replaced
        for k in [k for k, h in hooks.items() if _users_hook(h)]:
            del hooks[k]
    try:
        yield
    finally:
        for module, attributes, tables in kept:
            module.__dict__.clear()
            module.__dict__.update(attributes)
            for key, table in tables.items():
                module.__dict__[key].clear()
                module.__dict__[key].update(table)
        for hooks, was in zip(global_hooks, global_kept):
            hooks.clear()
            hooks.update(was)


def _users_hook(hook: Any) -> bool:
    """Whether a forward hook is the user's own: neither PyTorch's nor hpdl's."""
    fn = getattr(hook, "func", hook)  # a functools.partial's function
    fn = getattr(fn, "__func__", fn)  # a bound method's
    where = getattr(fn, "__module__", None) or ""  # an object's: its class's module
    return not (where == "torch" or where.startswith(("torch.", "hpdl.")))


def _for_the_dry_run(t: torch.Tensor) -> torch.Tensor:
    """A parameter, buffer or kept tensor as the dry run uses it: on the meta device (shapes
    only), but a number held as a tensor of no dimensions stays one, a copy on the CPU (batch
    norm with momentum=None reads 1 / its batch count as a float)."""
    return t.detach().to("cpu", copy=True) if t.dim() == 0 else t.detach().to("meta")


@contextlib.contextmanager
def _random_states_kept() -> Iterator[None]:
    """Every dry run starts from the random states the real forward will see, and leaves them
    so: a model drawing random numbers in Python (stochastic depth) decides alike on every part."""
    python, cpu = random.getstate(), torch.random.get_rng_state()
    numpy_state = None
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy_state = numpy.random.get_state()
    try:
        yield
    finally:
        random.setstate(python)
        torch.random.set_rng_state(cpu)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


def _fits(module: nn.Module, names, part: Part, x: torch.Tensor, args=(), kwargs=None) -> bool:
    try:
        for rank in range(part.grid.size):
            _dry_run(module, names, dataclasses.replace(part, rank=rank), x, args, kwargs or {})
    except ThinBand:
        return False
    except Exception:  # noqa: BLE001 - any refusal: this size does not fit either
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


def _rows_and_cols(part: Part) -> str:
    (r0, r1), (c0, c1) = part.rows, part.cols
    return f"rows {r0}-{r1 - 1} and columns {c0}-{c1 - 1} of a {part.height} x {part.width} image"


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


def _value_text(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return type(value).__name__
