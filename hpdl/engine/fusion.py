"""Tensor fusion: pack many small allreduces into one buffer and reduce them with one call.

Fusion saves per-call overhead at the price of copying every member into the buffer and back.
For a large tensor the trade turns: the call it saves costs the same whatever the size, the
two copies grow with it, so a model of megabyte gradients is reduced faster with each one
reduced in place, one call each, than through the fusion buffer (measured:
docs/perf-notes/). So tensors of at least ``inplace_threshold`` bytes run alone, where they
lie; the smaller ones are fused.

The plan is a pure function of the agreed response list, so every rank fuses the same tensors
in the same order (ranks that fused differently would exchange mismatched messages). Buffers
are allocated once per (dtype, device) and reused; hits and misses are counted.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from hpdl.comm.dtypes import DTYPES
from hpdl.engine.request import Response


def dtype_of(response: Response) -> torch.dtype:
    return DTYPES[response.signature.dtype]


def plan_fusion(responses: List[Response], threshold: int, inplace_threshold: int = 0) -> List[List[Response]]:
    """Split allreduce responses into fused batches of at most ``threshold`` bytes.

    Compatible responses are packed in response order (a later compatible one may join an
    earlier batch, as Horovod looks ahead); a group's members always share one batch unless
    they alone exceed the threshold. A response larger than the threshold, or (outside a
    group) of at least ``inplace_threshold`` bytes when that is not 0, runs alone.
    """
    batches: List[List[Response]] = []
    open_batches: Dict[Tuple, List] = {}  # fusion key -> [batch, bytes]
    for unit in _units(responses):
        first = unit[0]
        alone = len(unit) == 1
        size = first.nbytes if alone else sum(r.nbytes for r in unit)
        if alone and inplace_threshold and size >= inplace_threshold:
            batches.append(unit)
            continue
        current = open_batches.get(first.fusion_key)
        if current is not None and current[1] + size <= threshold:
            current[0].extend(unit)
            current[1] += size
        else:
            batches.append(unit)
            open_batches[first.fusion_key] = [unit, size]
    return batches


def _units(responses: List[Response]) -> List[List[Response]]:
    """The responses as units that stay together in one batch: a response alone, or the
    members of a group (adjacent in the list) that share a fusion key.

    A group's members of different dtypes (or devices) are split by key, as Horovod fuses
    only tensors of one dtype: one buffer of the first member's dtype would reduce the others
    in the wrong type (an int64 or float32 gradient summed in float16, say)."""
    units: List[List[Response]] = []
    index, count = 0, len(responses)
    while index < count:
        first = responses[index]
        unit_end = index + 1
        if first.group is not None:  # a group's members are adjacent: take them as one unit
            while unit_end < count and responses[unit_end].group == first.group:
                unit_end += 1
        if unit_end == index + 1:
            units.append([first])
        else:
            by_key: Dict[Tuple, List[Response]] = {}
            for response in responses[index:unit_end]:
                by_key.setdefault(response.fusion_key, []).append(response)
            units.extend(by_key.values())
        index = unit_end
    return units


class FusionBuffers:
    """Growable flat buffers per (dtype, device) and slot, reused across cycles (the executor
    uses a second slot while a collective in flight holds the first)."""

    def __init__(self) -> None:
        self._buffers: Dict[Tuple[torch.dtype, str, int], torch.Tensor] = {}
        self.hits = 0
        self.misses = 0

    def get(self, dtype: torch.dtype, device: torch.device, numel: int, capacity_bytes: int = 0,
            slot: int = 0) -> torch.Tensor:
        """Return a flat tensor of exactly ``numel`` elements backed by the reusable buffer.

        The first buffer of a (dtype, device) is made ``capacity_bytes`` large (the fusion
        threshold), as Horovod does, so that later batches of any size reuse it; pages that
        are never written are never committed by the OS.
        """
        key = (dtype, str(device), slot)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            self.misses += 1
            buffer = torch.empty(max(numel, capacity_bytes // dtype.itemsize), dtype=dtype, device=device)
            self._buffers[key] = buffer
        else:
            self.hits += 1
        return buffer[:numel]

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
