"""Where each rank's part of a feature map lies, and which rows it must get from its neighbours.

A spatial group of ``R x C`` ranks splits every feature map of height ``H`` and width ``W`` into
``R`` row bands and ``C`` column bands, each as even as possible with the earlier bands larger
(:func:`bands`): rank ``i * C + j`` holds row band ``i`` and column band ``j``. The rule is the
same for every map, whatever its size, so the part of any tensor (an input, a target, an
intermediate map, the output) follows from its size alone.

A window operation (convolution, pooling, interpolation) computes its own output band from
input rows that may lie outside the rank's input band: the *needed* range, from the global
offset of the output band (LBANN DistConv's rule, which keeps strided layers aligned on
uneven splits). :func:`plan_bands` turns every band's owned and needed ranges into what each
rank keeps, receives from its neighbours, sends them, and fills at the image border. Rows are
exchanged with the immediate neighbours only: a band thinner than the rows a neighbour needs
from it is refused (:class:`ThinBand`).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

from hpdl.comm.base import even_split

Range = Tuple[int, int]  # [start, stop) in global rows (or columns)


class SpatialError(ValueError):
    """A model, input or layout that spatial parallelism cannot run as one process would."""


def bands(length: int, parts: int) -> List[Range]:
    """``length`` rows split into ``parts`` bands, as even as possible, earlier bands larger."""
    out, start = [], 0
    for count in even_split(length, parts):
        out.append((start, start + count))
        start += count
    return out


@dataclasses.dataclass(frozen=True)
class Grid:
    """``rows`` x ``cols`` ranks of a spatial group; group rank ``i * cols + j`` is at (i, j)."""

    rows: int
    cols: int

    @property
    def size(self) -> int:
        return self.rows * self.cols

    def coords(self, rank: int) -> Tuple[int, int]:
        return divmod(rank, self.cols)

    def rank_at(self, row: int, col: int) -> int:
        return row * self.cols + col

    def neighbours(self, rank: int, dim: int) -> Tuple[Optional[int], Optional[int]]:
        """The group ranks before and after ``rank`` along rows (dim 0) or columns (dim 1), or None at the border."""
        i, j = self.coords(rank)
        if dim == 0:
            return (self.rank_at(i - 1, j) if i > 0 else None, self.rank_at(i + 1, j) if i + 1 < self.rows else None)
        return (self.rank_at(i, j - 1) if j > 0 else None, self.rank_at(i, j + 1) if j + 1 < self.cols else None)

    def far_border(self, rank: int, dim: int) -> Optional[int]:
        """The group rank at the other border along rows (dim 0) or columns (dim 1), for a rank
        at a border (a periodic pad's far rows); None for a rank inside, or alone along ``dim``."""
        i, j = self.coords(rank)
        count = self.bands_along(dim)
        at = i if dim == 0 else j
        if count == 1 or at not in (0, count - 1):
            return None
        other = count - 1 - at
        return self.rank_at(other, j) if dim == 0 else self.rank_at(i, other)

    def bands_along(self, dim: int) -> int:
        return self.rows if dim == 0 else self.cols

    def __str__(self) -> str:
        return f"{self.rows}x{self.cols}"


@dataclasses.dataclass(frozen=True)
class Part:
    """One rank's part of a feature map of global ``height`` x ``width`` split over ``grid``."""

    grid: Grid
    rank: int  # in the group
    height: int
    width: int

    @property
    def band(self) -> Tuple[int, int]:
        return self.grid.coords(self.rank)

    @property
    def rows(self) -> Range:
        return bands(self.height, self.grid.rows)[self.band[0]]

    @property
    def cols(self) -> Range:
        return bands(self.width, self.grid.cols)[self.band[1]]

    @property
    def local_size(self) -> Tuple[int, int]:
        (r0, r1), (c0, c1) = self.rows, self.cols
        return r1 - r0, c1 - c0

    @property
    def numel_share(self) -> float:
        """This part's share of the map's pixels."""
        h, w = self.local_size
        return (h * w) / (self.height * self.width)

    def length(self, dim: int) -> int:
        return self.height if dim == 0 else self.width

    def resized(self, height: int, width: int) -> "Part":
        """The same rank's part of a map of another size."""
        return dataclasses.replace(self, height=height, width=width)


# -- what a window operation needs ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Window:
    """A convolution or pooling window along one dimension (PyTorch's arguments)."""

    kernel: int
    stride: int = 1
    pad_before: int = 0
    pad_after: int = 0
    dilation: int = 1
    ceil_mode: bool = False

    def output_length(self, length: int) -> int:
        """Output rows, as PyTorch computes them."""
        span = length + self.pad_before + self.pad_after - self.dilation * (self.kernel - 1) - 1
        if not self.ceil_mode:
            return span // self.stride + 1
        out = -(-span // self.stride) + 1
        # PyTorch's rule: the last window must start inside the input or its leading padding.
        return out - 1 if (out - 1) * self.stride >= length + self.pad_before else out

    def needed(self, out_band: Range) -> Range:
        """The input rows (global; beyond the image: padding) that output rows ``out_band`` read."""
        o0, o1 = out_band
        return o0 * self.stride - self.pad_before, (o1 - 1) * self.stride - self.pad_before + self.dilation * (self.kernel - 1) + 1


@dataclasses.dataclass(frozen=True)
class BandPlan:
    """What one band does along one dimension so that it holds exactly its needed range.

    The assembled tensor is, in order: ``fill_before`` rows of fill (beyond the image),
    ``recv_before`` rows from the previous band, the band's own rows ``keep`` (local indices
    into its ``owned`` rows),
    ``recv_after`` rows from the next band, ``fill_after`` rows of fill. ``send_before`` and
    ``send_after`` are the local rows the previous and next bands need from this one.
    """

    fill_before: int
    recv_before: int
    keep: Range
    recv_after: int
    fill_after: int
    send_before: Range
    send_after: Range
    owned: int

    @property
    def moves_nothing(self) -> bool:
        """True when the band already holds exactly what it needs (no exchange, no copy)."""
        return not (self.fill_before or self.recv_before or self.recv_after or self.fill_after
                    or self.send_before[1] > self.send_before[0] or self.send_after[1] > self.send_after[0]
                    or self.keep != (0, self.owned))

    def assembled_length(self) -> int:
        return self.fill_before + self.recv_before + (self.keep[1] - self.keep[0]) + self.recv_after + self.fill_after


@dataclasses.dataclass
class ThinBand(SpatialError):
    """A band that cannot serve (or be served by) its immediate neighbours; the layer that
    found it fills in ``layer`` (its path and kind) and ``axis`` (0: rows, 1: columns)."""

    band: int
    bands: int
    owned: Range
    needed: Range
    length: int
    layer: str = ""
    axis: int = 0

    def __str__(self) -> str:
        (o0, o1), (n0, n1) = self.owned, self.needed
        what = "row" if self.axis == 0 else "column"
        at = f"{self.layer}: " if self.layer else ""
        band = f"{what} band {self.band + 1} of {self.bands}"
        if o1 <= o0:
            return f"{at}{band} would hold none of the layer's {self.length} input {what}s"
        if n1 <= n0:
            return (f"{at}{band} gets none of the layer's output {what}s "
                    f"({_range_text(what, o0, o1)} of {self.length} in)")
        return (f"{at}{band} ({_range_text(what, o0, o1)} of {self.length}) needs "
                f"{_range_text(what, max(n0, 0), min(n1, self.length))}, beyond its neighbours' bands")


def _range_text(what: str, start: int, stop: int) -> str:
    return f"{what} {start}" if stop - start == 1 else f"{what}s {start}-{stop - 1}"


def plan_bands(owned: Sequence[Range], needed: Sequence[Range], length: int) -> List[BandPlan]:
    """Every band's :class:`BandPlan` from its owned and needed ranges (global rows).

    Rows outside ``[0, length)`` are fill; the others come from the band itself or from its
    immediate neighbours. Raises :class:`ThinBand` when a band needs rows further away, or owns none.
    """
    count = len(owned)
    receives: List[Tuple[Range, Range, Range]] = []  # (from previous, own, from next), global
    for b, ((h0, h1), (a, z)) in enumerate(zip(owned, needed)):
        if h1 <= h0 or z <= a:
            raise ThinBand(b, count, (h0, h1), (a, z), length)
        lo, hi = max(a, 0), min(z, length)
        before = (lo, min(hi, h0)) if lo < h0 else (h0, h0)
        own = (max(lo, h0), min(hi, h1))
        if own[1] < own[0]:
            own = (h0, h0)
        after = (max(lo, h1), hi) if hi > h1 else (h1, h1)
        if (before[1] > before[0] and (b == 0 or before[0] < owned[b - 1][0])) or \
                (after[1] > after[0] and (b == count - 1 or after[1] > owned[b + 1][1])):
            raise ThinBand(b, count, (h0, h1), (a, z), length)
        receives.append((before, own, after))
    plans = []
    for b, ((h0, h1), (a, z)) in enumerate(zip(owned, needed)):
        before, own, after = receives[b]
        # What the neighbours take from this band: the previous band's "after", the next band's "before".
        to_prev = receives[b - 1][2] if b > 0 else (h0, h0)
        to_next = receives[b + 1][0] if b + 1 < count else (h0, h0)
        plans.append(BandPlan(
            fill_before=max(0, -a), recv_before=before[1] - before[0],
            keep=(own[0] - h0, own[1] - h0), recv_after=after[1] - after[0],
            fill_after=max(0, z - length),
            send_before=(to_prev[0] - h0, to_prev[1] - h0), send_after=(to_next[0] - h0, to_next[1] - h0),
            owned=h1 - h0))
    return plans
