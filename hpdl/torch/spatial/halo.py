"""The halo exchange: each rank gets the rows and columns of its neighbours that its window
operations read, and in backward gives back the gradients of what it received.

One dimension at a time, rows first: the column exchange then carries the received rows too,
so the corners of a 2-D grid come for free; backward runs the columns first, then the rows
(DistDL's order). The exchange is split in three so that a layer may keep only its own input
and the small received strips for backward, and assemble its window input again there,
without communication (:class:`HaloConv2d` in layers.py does): :func:`receive` (the transfers),
:func:`assemble` (the concatenation, with fill beyond the image), :func:`adjoint` (backward:
the received strips' gradients go back to their owners, which add them into the rows they
sent). Image borders need no special case: the missing neighbour's rows are fill.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple, Union

import torch

from hpdl.torch.spatial.comm import GroupComm, refuse_graph_in_backward
from hpdl.torch.spatial.geometry import BandPlan

ZEROS = "zeros"  # convolution and average pooling padding
NEG_INF = "-inf"  # max pooling padding
REPLICATE = "replicate"  # interpolation, which clamps its source rows to the image
REFLECT = "reflect"  # F.pad's reflection (ReflectionPad2d, Conv2d(padding_mode="reflect")): the
# rows next to the border row, mirrored; the border band holds them (layers.py refuses one too thin)
# A float: that constant (F.pad's value); its gradient, like zeros', is dropped.

Strips = Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]  # received before, after


@dataclasses.dataclass(frozen=True)
class HaloSpec:
    """Everything a layer's exchange needs on this rank: the plan along rows and columns, the
    neighbours (group ranks, None at the border), the fill beyond the image, the communicator
    (None in a dry run) and the label reported to the profiler (the layer's path)."""

    rows: BandPlan
    cols: BandPlan
    row_peers: Tuple[Optional[int], Optional[int]]
    col_peers: Tuple[Optional[int], Optional[int]]
    fill: Union[str, float]
    comm: Optional[GroupComm]
    label: str

    @property
    def moves_nothing(self) -> bool:
        return self.rows.moves_nothing and self.cols.moves_nothing

    def along(self, axis: int) -> Tuple[BandPlan, Tuple[Optional[int], Optional[int]]]:
        return (self.rows, self.row_peers) if axis == 0 else (self.cols, self.col_peers)


def _rows(x: torch.Tensor, dim: int, span: Tuple[int, int]) -> torch.Tensor:
    return x.narrow(dim, span[0], span[1] - span[0])


def _strip_shape(x: torch.Tensor, dim: int, length: int) -> List[int]:
    shape = list(x.shape)
    shape[dim] = length
    return shape


def receive(x: torch.Tensor, dim: int, plan: BandPlan, peers, comm: Optional[GroupComm], label: str) -> Strips:
    """Send the neighbours the rows of ``x`` they need along ``dim``; return the strips received."""
    before = x.new_empty(_strip_shape(x, dim, plan.recv_before)) if plan.recv_before else None
    after = x.new_empty(_strip_shape(x, dim, plan.recv_after)) if plan.recv_after else None
    if comm is None:  # a dry run: shapes only
        return before, after
    sends = []
    if plan.send_before[1] > plan.send_before[0]:
        sends.append((peers[0], _rows(x, dim, plan.send_before).contiguous()))
    if plan.send_after[1] > plan.send_after[0]:
        sends.append((peers[1], _rows(x, dim, plan.send_after).contiguous()))
    receives = [(peer, strip) for peer, strip in ((peers[0], before), (peers[1], after)) if strip is not None]
    comm.exchange(sends, receives, label)
    return before, after


def _fill(x: torch.Tensor, dim: int, count: int, fill: str, at_start: bool) -> torch.Tensor:
    if fill == REPLICATE:  # the band at the border holds the image's first (last) row
        edge = x.narrow(dim, 0 if at_start else x.shape[dim] - 1, 1)
        return edge.expand(_strip_shape(x, dim, count))
    if fill == REFLECT:  # fill row i is the image's row count - i (at the start), length - 2 - i (at the end)
        return x.narrow(dim, 1 if at_start else x.shape[dim] - 1 - count, count).flip(dim)
    value = float("-inf") if fill == NEG_INF else fill if isinstance(fill, float) else 0.0
    return x.new_full(_strip_shape(x, dim, count), value)


def assemble(x: torch.Tensor, dim: int, plan: BandPlan, strips: Strips, fill: str) -> torch.Tensor:
    """The rows the band's window operation reads: fill, received, own, received, fill."""
    if plan.moves_nothing:
        return x
    before, after = strips
    pieces = []
    if plan.fill_before:
        pieces.append(_fill(x, dim, plan.fill_before, fill, at_start=True))
    if before is not None:
        pieces.append(before)
    if plan.keep[1] > plan.keep[0]:
        pieces.append(_rows(x, dim, plan.keep))
    if after is not None:
        pieces.append(after)
    if plan.fill_after:
        pieces.append(_fill(x, dim, plan.fill_after, fill, at_start=False))
    return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0].contiguous()


def adjoint(grad: torch.Tensor, dim: int, plan: BandPlan, peers, comm: GroupComm, fill: str, length: int,
            label: str) -> torch.Tensor:
    """Backward of :func:`receive` + :func:`assemble`: the gradient of the band's own ``length`` rows."""
    if plan.moves_nothing:
        return grad
    counts = [plan.fill_before, plan.recv_before, plan.keep[1] - plan.keep[0], plan.recv_after, plan.fill_after]
    g_fill_before, g_before, g_keep, g_after, g_fill_after = torch.split(grad, counts, dim)
    out = grad.new_zeros(_strip_shape(grad, dim, length))
    if counts[2]:
        _rows(out, dim, plan.keep).add_(g_keep)
    give_back(out, dim, plan, peers, comm, (g_before if counts[1] else None, g_after if counts[3] else None), label)
    if fill == REPLICATE:  # the fill rows were copies of the border row
        if plan.fill_before:
            out.narrow(dim, 0, 1).add_(g_fill_before.sum(dim, keepdim=True))
        if plan.fill_after:
            out.narrow(dim, length - 1, 1).add_(g_fill_after.sum(dim, keepdim=True))
    elif fill == REFLECT:  # each fill row was a copy of one row next to the border
        if plan.fill_before:
            out.narrow(dim, 1, plan.fill_before).add_(g_fill_before.flip(dim))
        if plan.fill_after:
            out.narrow(dim, length - 1 - plan.fill_after, plan.fill_after).add_(g_fill_after.flip(dim))
    return out


def give_back(out: torch.Tensor, dim: int, plan: BandPlan, peers, comm: GroupComm, strip_grads: Strips,
              label: str) -> None:
    """The exchange of backward: send the gradients of the strips received (before, after) to
    their owners, and add the ones that come back, the gradients of the rows this band sent,
    into ``out``, the gradient of the band's own rows (in place)."""
    back_before = out.new_empty(_strip_shape(out, dim, plan.send_before[1] - plan.send_before[0])) \
        if plan.send_before[1] > plan.send_before[0] else None
    back_after = out.new_empty(_strip_shape(out, dim, plan.send_after[1] - plan.send_after[0])) \
        if plan.send_after[1] > plan.send_after[0] else None
    sends = [(peer, g.contiguous()) for peer, g in zip(peers, strip_grads) if g is not None]
    receives = [(peer, b) for peer, b in ((peers[0], back_before), (peers[1], back_after)) if b is not None]
    comm.exchange(sends, receives, label)
    if back_before is not None:
        _rows(out, dim, plan.send_before).add_(back_before)
    if back_after is not None:
        _rows(out, dim, plan.send_after).add_(back_after)


def receive_both(x: torch.Tensor, spec: HaloSpec) -> Tuple[torch.Tensor, Strips, Strips]:
    """Rows, then columns (with the received rows: the corners): the assembled input and the strips."""
    row_dim, col_dim = x.dim() - 2, x.dim() - 1
    row_strips = receive(x, row_dim, spec.rows, spec.row_peers, spec.comm, spec.label)
    tall = assemble(x, row_dim, spec.rows, row_strips, spec.fill)
    col_strips = receive(tall, col_dim, spec.cols, spec.col_peers, spec.comm, spec.label)
    return assemble(tall, col_dim, spec.cols, col_strips, spec.fill), row_strips, col_strips


def assemble_both(x: torch.Tensor, spec: HaloSpec, row_strips: Strips, col_strips: Strips) -> torch.Tensor:
    """:func:`receive_both`'s result again from the kept strips, without communication."""
    tall = assemble(x, x.dim() - 2, spec.rows, row_strips, spec.fill)
    return assemble(tall, x.dim() - 1, spec.cols, col_strips, spec.fill)


def adjoint_both(grad: torch.Tensor, spec: HaloSpec, local_size: Tuple[int, int]) -> torch.Tensor:
    """Backward of :func:`receive_both`: columns first, then rows."""
    row_dim, col_dim = grad.dim() - 2, grad.dim() - 1
    # The column pass works on the rows as assembled (received ones included): their
    # gradients go back to their owners in the row pass after it.
    grad = adjoint(grad, col_dim, spec.cols, spec.col_peers, spec.comm, spec.fill, local_size[1], spec.label)
    return adjoint(grad, row_dim, spec.rows, spec.row_peers, spec.comm, spec.fill, local_size[0], spec.label)


class HaloExchange(torch.autograd.Function):
    """``x`` -> the window input of its band (received rows and columns, fill beyond the image)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, spec: HaloSpec) -> torch.Tensor:
        ctx.spec, ctx.local_size = spec, tuple(x.shape[-2:])
        assembled, _rows_received, _cols_received = receive_both(x, spec)
        return assembled

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_graph_in_backward(ctx.spec.label)
        return adjoint_both(grad.contiguous(), ctx.spec, ctx.local_size), None


def exchange(x: torch.Tensor, spec: HaloSpec) -> torch.Tensor:
    """Differentiable halo exchange of ``x`` (a no-op when the plan moves nothing)."""
    if spec.moves_nothing:
        return x
    if spec.comm is None:  # a dry run
        assembled, _, _ = receive_both(x, spec)
        return assembled
    return HaloExchange.apply(x, spec)


# -- the periodic border -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class WrapSpec:
    """A circular pad along ``dim`` on a band at a border of the image: the first band's
    ``before`` pad rows are the image's last rows, the last band's ``after`` pad rows its first
    ones. ``peer`` is the group rank at the other border, None where one band holds every row
    (the rows are its own); ``comm`` is None in a dry run."""

    dim: int
    before: int
    after: int
    first: bool
    last: bool
    peer: Optional[int]
    comm: Optional[GroupComm]
    label: str

    def counts(self, length: int) -> List[int]:
        """The band's ``length`` padded rows in three: from the image's far end, the band's (its
        own and its neighbours'), from the image's start."""
        head, tail = self.before if self.first else 0, self.after if self.last else 0
        return [head, length - head - tail, tail]

    def sent(self, x: torch.Tensor) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The rows of ``x`` (a band's own) another band's pad copies: the image's last
        ``before`` rows (held by the last band), its first ``after`` (the first band's)."""
        length = x.shape[self.dim]
        end = x.narrow(self.dim, length - self.before, self.before) if self.last and self.before else None
        start = x.narrow(self.dim, 0, self.after) if self.first and self.after else None
        return end, start


class CircularPad(torch.autograd.Function):
    """(``x``, ``padded``) -> ``padded`` with its rows beyond the image's border replaced by the
    far border's rows: received from the other border band (or, for one band, its own).
    ``x`` is the band's own rows, ``padded`` the pad as a zero pad makes it (the neighbours'
    rows inside). Backward gives the gradients of the copied rows back to their owner.

    One function for the exchange and the assembly, so that both border bands run its
    backward whenever the pad's output is used: each one's backward exchange meets the other's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, padded: torch.Tensor, spec: WrapSpec) -> torch.Tensor:
        ctx.spec, ctx.x_shape, ctx.padded_shape = spec, x.shape, padded.shape
        counts = spec.counts(padded.shape[spec.dim])
        end, start = spec.sent(x)
        if spec.peer is None:  # one band: its own rows
            head, tail = end, start
        else:
            head = x.new_empty(_strip_shape(x, spec.dim, counts[0])) if counts[0] else None
            tail = x.new_empty(_strip_shape(x, spec.dim, counts[2])) if counts[2] else None
            outgoing = [t for t in (end, start) if t is not None]  # a band at one border sends one of them
            incoming = [t for t in (head, tail) if t is not None]
            spec.comm.exchange([(spec.peer, t.contiguous()) for t in outgoing], [(spec.peer, t) for t in incoming],
                               spec.label)
        middle = padded.narrow(spec.dim, counts[0], counts[1])
        return torch.cat([t for t in (head, middle, tail) if t is not None], spec.dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_graph_in_backward(ctx.spec.label)
        spec = ctx.spec
        counts = spec.counts(ctx.padded_shape[spec.dim])
        g_head, g_middle, g_tail = torch.split(grad, counts, spec.dim)
        grad_padded = grad.new_zeros(ctx.padded_shape)
        grad_padded.narrow(spec.dim, counts[0], counts[1]).copy_(g_middle)
        grad_x = grad.new_zeros(ctx.x_shape)
        end, start = spec.sent(grad_x)  # views: the gradients of the rows this band's own pad or the far one copied
        if spec.peer is None:
            back_end, back_start = (g_head if end is not None else None), (g_tail if start is not None else None)
        else:
            back_end = torch.empty_like(end) if end is not None else None
            back_start = torch.empty_like(start) if start is not None else None
            outgoing = [g for g, n in ((g_head, counts[0]), (g_tail, counts[2])) if n]
            spec.comm.exchange([(spec.peer, g.contiguous()) for g in outgoing],
                               [(spec.peer, b) for b in (back_end, back_start) if b is not None], spec.label)
        if end is not None:
            end.add_(back_end)
        if start is not None:
            start.add_(back_start)
        return grad_x, grad_padded, None


def circular_pad(x: torch.Tensor, padded: torch.Tensor, spec: WrapSpec) -> torch.Tensor:
    """:class:`CircularPad` (shapes only in a dry run)."""
    if spec.comm is None and spec.peer is not None:
        return padded.view_as(padded)  # the same shape: shapes are all a dry run has
    return CircularPad.apply(x, padded, spec)
