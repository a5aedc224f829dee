"""Tensor fusion: pack many small allreduces into one buffer and reduce them with one call.

The plan is a pure function of the agreed response list, so every rank fuses the same tensors
in the same order (ranks that fused differently would exchange mismatched messages). Buffers
are allocated once per (dtype, device) and reused; hits and misses are counted.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from hpdl.engine.request import SIG_DEVICE, SIG_DTYPE, SIG_GROUP, SIG_OP, SIG_SCALES, Response

_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool)}


def dtype_of(response: Response) -> torch.dtype:
    return _DTYPES[response.signature[SIG_DTYPE]]


def numel_of(response: Response) -> int:
    return response.numel


def fusion_key(response: Response) -> Tuple:
    """Responses with equal keys may share one fused allreduce."""
    sig = response.signature
    return (sig[SIG_DTYPE], sig[SIG_DEVICE], sig[SIG_OP], sig[SIG_SCALES], response.joined)


def plan_fusion(responses: List[Response], threshold: int) -> List[List[Response]]:
    """Split allreduce responses into fused batches of at most ``threshold`` bytes.

    Compatible responses are packed in response order (a later compatible one may join an
    earlier batch, as Horovod looks ahead); a group's members always share one batch unless
    they alone exceed the threshold. A response larger than the threshold runs alone.
    """
    batches: List[List[Response]] = []
    open_batches: Dict[Tuple, Tuple[List[Response], int]] = {}
    units: List[List[Response]] = []
    for response in responses:
        group = response.signature[SIG_GROUP]
        if group is not None and units and units[-1][0].signature[SIG_GROUP] == group:
            units[-1].append(response)
        else:
            units.append([response])
    for unit in units:
        key = fusion_key(unit[0])
        size = sum(numel_of(r) * dtype_of(r).itemsize for r in unit)
        current = open_batches.get(key)
        if current is not None and current[1] + size <= threshold:
            current[0].extend(unit)
            open_batches[key] = (current[0], current[1] + size)
            continue
        batch = list(unit)
        batches.append(batch)
        open_batches[key] = (batch, size)
    return batches


class FusionBuffers:
    """One growable flat buffer per (dtype, device), reused across cycles."""

    def __init__(self) -> None:
        self._buffers: Dict[Tuple[torch.dtype, str], torch.Tensor] = {}
        self.hits = 0
        self.misses = 0

    def get(self, dtype: torch.dtype, device: torch.device, numel: int, capacity_bytes: int = 0) -> torch.Tensor:
        """Return a flat tensor of exactly ``numel`` elements backed by the reusable buffer.

        The first buffer of a (dtype, device) is made ``capacity_bytes`` large (the fusion
        threshold), as Horovod does, so that later batches of any size reuse it; pages that
        are never written are never committed by the OS.
        """
        key = (dtype, str(device))
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            self.misses += 1
            buffer = torch.empty(max(numel, capacity_bytes // dtype.itemsize), dtype=dtype, device=device)
            self._buffers[key] = buffer
        else:
            self.hits += 1
        return buffer[:numel]

    def clear(self) -> None:
        self._buffers.clear()

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
