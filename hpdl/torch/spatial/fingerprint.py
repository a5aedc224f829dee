"""Whether the ranks of a spatial group scattered the same image, and hold the same parameters.

Every rank of a group must pass ``net.scatter(x)`` of the same ``x``. Two ranks whose data
loaders drew different crops, augmented differently, or stepped through the data set out of
step (one skipped a batch) would each compute on a part of a different image: the halo
exchanges pair up all the same, and the result is silently wrong. So ``scatter`` takes a
fingerprint of the whole image it splits, and the forward's agreement (parallel.py) compares
the ranks' fingerprints before any exchange.

The fingerprint is three float64 numbers: the sum of every pixel weighted by a fixed weight per
(leading index, row), the same by a weight per leading index times one per column, and the sum
of absolute values (the scale). Weighted, it tells apart images with the same pixels in another place or order (a flip,
a shifted crop, two samples of the batch swapped). It is compared to a relative 1e-6 of the
scale: the same image gives the same sums up to a float64 reduction order (1e-13 or so), and
copies that differ only by rounding (a resize run on two GPUs) are within it; two different
images differ by about 1/sqrt(pixels) of the scale at the least (two independent noise images),
above 1e-6 up to some 10^12 values.

Read in chunks of rows, so that its float64 copies stay small beside the image.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence

import torch

_ATTRIBUTE = "_hpdl_whole_fingerprint"
_CHUNK_VALUES = 1 << 22  # values converted to float64 at a time
RELATIVE_TOLERANCE = 1e-6
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # weights 1 + frac(k * golden): fixed, far from regular
SIZE = 3  # numbers in a fingerprint


def _weights(count: int, device: torch.device, offset: float = 0.0) -> torch.Tensor:
    k = torch.arange(count, dtype=torch.float64, device=device) + offset
    return 1.0 + torch.frac(k * _GOLDEN)


def of(whole: torch.Tensor) -> Optional[torch.Tensor]:
    """The fingerprint of ``whole`` (..., H, W), a float64 tensor of SIZE on its device; None on
    the meta device, where there are no values."""
    if whole.device.type == "meta" or whole.numel() == 0:
        return None
    if whole.is_complex():
        whole = torch.view_as_real(whole)
    if whole.dim() < 2:  # a further input that is no map (a class label, a time step): one row
        whole = whole.reshape(1, -1)
    height, width = whole.shape[-2], whole.shape[-1]
    rows = whole.detach().reshape(-1, width)  # every leading index's rows, one after another
    device = whole.device
    row_weights = _weights(rows.shape[0], device)
    # The column weights are a lead's weight times a column's: the sum over a row is one dot product.
    lead_weights = _weights(rows.shape[0] // height, device, offset=0.5).repeat_interleave(height)
    column_weights = _weights(width, device, offset=0.25)
    sums = torch.zeros(SIZE, dtype=torch.float64, device=device)
    step = max(1, _CHUNK_VALUES // max(1, width))
    for start in range(0, rows.shape[0], step):
        chunk = rows[start:start + step].to(torch.float64)
        end = start + chunk.shape[0]
        sums[0] += chunk.sum(dim=-1) @ row_weights[start:end]
        sums[1] += (chunk @ column_weights) @ lead_weights[start:end]
        sums[2] += chunk.abs().sum()
    return sums


def attach(part: torch.Tensor, fingerprint: Optional[torch.Tensor]) -> torch.Tensor:
    """Keep the whole image's ``fingerprint`` on the ``part`` scatter made of it."""
    setattr(part, _ATTRIBUTE, fingerprint)
    return part


def carried(part: Any) -> Optional[torch.Tensor]:
    """The fingerprint ``part`` carries (the very tensor :func:`attach` kept), or None."""
    return getattr(part, _ATTRIBUTE, None) if isinstance(part, torch.Tensor) else None


def numbers(part: Any) -> List[float]:
    """The fingerprint ``part`` carries as SIZE numbers; NaN where it carries none (a part made
    by ``mark``, or by an operation on a scattered part)."""
    return listed(carried(part))


def listed(fingerprint: Optional[torch.Tensor]) -> List[float]:
    """A fingerprint of :func:`of` as SIZE numbers (NaN for None: nothing to compare)."""
    if fingerprint is None:
        return [math.nan] * SIZE
    return [float(v) for v in fingerprint.cpu().tolist()]


FURTHER_SLOTS = 4  # further inputs compared one by one; the others' fingerprints are summed into one more


def of_further_inputs(tensors: Sequence[torch.Tensor], is_part) -> List[float]:
    """:func:`slots` of the model's inputs besides the image: a scattered part's fingerprint of
    its whole map (NaN for a marked part), a whole tensor's own (a class label, a mask passed
    whole)."""
    return slots([numbers(t) if is_part(t) else listed(of(t)) for t in tensors])


def slots(prints: Sequence[Sequence[float]]) -> List[float]:
    """(FURTHER_SLOTS + 1) * SIZE numbers for a list of fingerprints: the first FURTHER_SLOTS
    one by one, the sum of the others; a slot left empty is 0. Every rank lists as many (the
    caller compares the counts)."""
    out = [[0.0] * SIZE for _ in range(FURTHER_SLOTS + 1)]
    for index, numbers_ in enumerate(prints):
        slot = out[min(index, FURTHER_SLOTS)]
        for k, value in enumerate(numbers_):
            slot[k] += value
    return [v for slot in out for v in slot]


def differing(prints: Sequence[Sequence[float]]) -> List[int]:
    """The indices of the fingerprints (SIZE numbers each) that differ from the first (none
    where any is missing: a marked part's image is not known)."""
    if any(math.isnan(v) for p in prints for v in p):
        return []
    first = prints[0]
    tolerance = RELATIVE_TOLERANCE * max(abs(first[2]), 1e-300)
    return [i for i, p in enumerate(prints)
            if any(abs(a - b) > tolerance for a, b in zip(p[:2], first[:2])) or abs(p[2] - first[2]) > tolerance]


# -- the model's parameters ------------------------------------------------------------------
#
# Every rank of a group must hold the same parameters: a rank that made its model with another
# seed and was not broadcast to, or updated it with a plain optimizer (whose step does not sum
# the group's gradients), or loaded a checkpoint alone, would compute its band with other
# weights, silently wrong. A parameter's fingerprint is the sum of its values' bits read as
# integers of their width (int32 for float32, ...), wrapping around: exact and independent of the
# order of summation (unlike a float sum, which another thread count may round otherwise), any
# bit that differs changes it, and it reads as fast as memory allows (40 M float32 values in
# 16 ms on one core here, against 57 ms for their float sum).

_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_INT64 = 1 << 64


def of_parameters(parameters: Sequence[torch.Tensor]) -> List[int]:
    """Each parameter's fingerprint (an int64), in order; one synchronisation for them all."""
    if not parameters:
        return []
    sums = []
    for p in parameters:
        values = p.detach()
        if values.layout != torch.strided or values.is_quantized or values.device.type == "meta":
            sums.append(torch.zeros((), dtype=torch.int64))  # no bits to read as they are: not compared
            continue
        if values.is_complex():
            values = torch.view_as_real(values)
        values = values.reshape(-1) if values.is_contiguous() else values.contiguous().reshape(-1)
        bits = _BITS[values.element_size()]
        sums.append(values.view(bits).sum(dtype=bits).to(torch.int64))
    return [int(v) for v in torch.stack([s.to(sums[0].device) for s in sums]).cpu().tolist()]


def summary(prints: Sequence[int]) -> List[int]:
    """Two int64 numbers for a list of parameter fingerprints: their sum, and their sum weighted
    by place (parameters that swapped places change it)."""
    plain = sum(prints) % _INT64
    placed = sum((2 * i + 1) * v for i, v in enumerate(prints)) % _INT64
    return [v - _INT64 if v >= _INT64 // 2 else v for v in (plain, placed)]
