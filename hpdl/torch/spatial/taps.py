"""Resampling along one image axis as a list of taps: which input rows each output row reads,
and with which weights, exactly as PyTorch's own kernel weights them.

Interpolation (nearest, nearest-exact, bilinear, bicubic, either ``align_corners``) is
separable: output row ``o`` is a weighted sum of a few input rows, the same along every column.
Where the scale is not a whole factor (13 rows to 9, a segmentation head's ``size=x.shape[-2:]``
of a map at 1/8 of an odd size), or with ``align_corners=True``, the source coordinates are
not the global ones shifted by a band's offset, so running PyTorch's kernel on a band cannot
reproduce one process. The taps can: a band gets the input rows its output rows read (the
halo exchange), then sums them with the taps' weights.

The taps are read off PyTorch's kernel itself rather than re-derived from its formulas, which
differ by mode, device and version (nearest computes its source index in float32 whatever the
input's type; bilinear copies when the sizes are equal): the call is run on a comb, channel
``c`` holding 1 on the rows ``r = c (mod P)``, and on a ramp holding ``r`` on row ``r``. The
comb's channel ``c`` at output row ``o`` is the weight of the row read there with residue
``c``; the ramp's value (the weighted mean of the rows read) says which row that is. The cost
is one call on ``(P + 1) x length`` values per axis and per call's arguments, cached.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Tuple

import torch

from hpdl.torch.spatial.geometry import SpatialError

# Rows an output row reads: at most 1 (nearest), 2 (bilinear), 4 (bicubic). The period is wide
# enough that the rows read, and the ramp's weighted mean of them (which bicubic's negative
# weights can move a little beyond them), lie within half a period of each other.
_PERIOD = {"nearest": 8, "nearest-exact": 8, "bilinear": 12, "bicubic": 24}


@dataclasses.dataclass(frozen=True)
class Taps:
    """Along one axis of ``length`` input rows: output row ``o`` is the sum over ``k`` of
    ``weight[o, k]`` times input row ``index[o, k]`` (rows read fewer than ``K`` times carry
    weight 0 on a row they read)."""

    length: int
    index: torch.Tensor   # (outputs, K), int64
    weight: torch.Tensor  # (outputs, K), the probe's type

    @property
    def selects(self) -> bool:
        """Whether each output row is a copy of one input row (nearest)."""
        return self.index.shape[1] == 1 and bool((self.weight == 1).all())

    @property
    def outputs(self) -> int:
        return self.index.shape[0]

    def reads(self, o0: int, o1: int) -> Tuple[int, int]:
        """The input rows [first, stop) output rows [o0, o1) read."""
        if o1 <= o0:
            return o0, o0
        rows = self.index[o0:o1]
        return int(rows.min()), int(rows.max()) + 1

    def apply(self, x: torch.Tensor, dim: int, o0: int, o1: int, first: int) -> torch.Tensor:
        """Output rows [o0, o1) along ``dim`` of ``x``, whose row 0 is input row ``first``."""
        last = dim == x.dim() - 1
        if last:  # whole rows of a contiguous tensor copy faster than columns
            x, dim = x.transpose(-1, -2), x.dim() - 2
        index = (self.index[o0:o1] - first).to(x.device)
        weight = self.weight[o0:o1].to(device=x.device, dtype=x.dtype)
        shape = [1] * x.dim()
        shape[dim] = o1 - o0
        if self.selects:  # nearest: each output row a copy of one input row
            out = x.index_select(dim, index[:, 0])
            return out.transpose(-1, -2) if last else out
        # In the order of the rows read, as the kernel sums them.
        out = x.index_select(dim, index[:, 0]) * weight[:, 0].reshape(shape)
        for k in range(1, index.shape[1]):
            out = out.addcmul(x.index_select(dim, index[:, k]), weight[:, k].reshape(shape))
        return out.transpose(-1, -2) if last else out


def resample(x: torch.Tensor, rows: Taps, cols: Taps, keep_rows: Tuple[int, int, int],
             keep_cols: Tuple[int, int, int]) -> torch.Tensor:
    """Output rows and columns ``keep = (o0, o1, first input row of x)`` of the last two
    dimensions of ``x``: along the axis that makes the smaller map first."""
    if (keep_rows[1] - keep_rows[0]) * x.shape[-1] <= x.shape[-2] * (keep_cols[1] - keep_cols[0]):
        return cols.apply(rows.apply(x, x.dim() - 2, *keep_rows), x.dim() - 1, *keep_cols).contiguous()
    return rows.apply(cols.apply(x, x.dim() - 1, *keep_cols), x.dim() - 2, *keep_rows).contiguous()


def probe_dtype(dtype: torch.dtype) -> torch.dtype:
    """The type the taps are read in: float64 for float64, else float32 (the type half and
    bfloat16 kernels compute their weights in)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=64)
def read(resample: Callable[..., torch.Tensor], length: int, dtype: torch.dtype, device: str, mode: str,
         **options) -> Taps:
    """The taps of ``resample(probe, mode=mode, **options)``, which applies the model's call
    along the rows of a ``(1, C, length, 1)`` tensor (and leaves its one column as it is).
    Cached by the arguments, so ``resample`` is a module-level function and ``options``
    hashable."""
    period = _PERIOD[mode]
    rows = torch.arange(length, dtype=torch.int64)
    probe = torch.zeros(1, period + 1, length, 1, dtype=dtype, device=device)
    probe[0, rows % period, rows, 0] = 1
    probe[0, period, :, 0] = rows.to(dtype)
    with torch.no_grad():
        out = resample(probe, mode=mode, **options)[0, :, :, 0].to("cpu")
    comb, mean = out[:period].t(), out[period]  # (outputs, period), (outputs,)
    base = torch.floor(mean).to(torch.int64) - period // 2
    residues = torch.arange(period, dtype=torch.int64)
    index = base[:, None] + torch.remainder(residues[None, :] - base[:, None], period)
    read_here = comb != 0
    index = torch.where(read_here, index, index.new_full((), length))  # unread: sorted last
    order = torch.argsort(index, dim=1, stable=True)
    index, comb, read_here = (t.gather(1, order) for t in (index, comb, read_here))
    taps = max(int(read_here.sum(1).max()), 1) if comb.shape[0] else 1
    index, comb, read_here = index[:, :taps], comb[:, :taps], read_here[:, :taps]
    index = torch.where(read_here, index, index[:, :1])  # an unread slot: weight 0 on a row read
    weight = torch.where(read_here, comb, torch.zeros((), dtype=comb.dtype))
    _check(index, weight, mean, length, mode)
    return Taps(length, index, weight)


def _check(index: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, length: int, mode: str) -> None:
    """The rows found must be the image's and give back the ramp: a row misplaced by a period
    moves the weighted mean by the period times its weight."""
    if index.numel() == 0:
        return
    eps = torch.finfo(weight.dtype).eps
    again = (weight * index.to(weight.dtype)).sum(1)
    tolerance = 64 * eps * max(length, 1)
    if int(index.min()) < 0 or int(index.max()) >= length or bool(((again - mean).abs() > tolerance).any()):
        raise SpatialError(f"interpolation with mode={mode!r}: cannot tell which rows PyTorch's kernel reads for "
                           f"this size ({length} rows); it is not supported in the spatial part")
