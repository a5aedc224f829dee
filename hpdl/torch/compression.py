"""Gradient compression for allreduce: a strategy pair ``compress(t) -> (t, ctx)`` and
``decompress(t, ctx) -> t``, as in Horovod. Subclass :class:`Compressor` to add your own."""

from __future__ import annotations

from typing import Any, Tuple

import torch


class Compressor:
    """Interface: reduce the bytes a tensor occupies on the wire, and restore it after."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Return the tensor to send and the context needed to restore it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return the tensor restored from its sent form."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class CastCompressor(Compressor):
    """Cast floating-point tensors to a 16-bit type for the wire and back after."""

    wire_dtype: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx) if ctx is not None else tensor


class FP16Compressor(CastCompressor):
    """Send floating-point tensors as float16 (half the bytes; range +-65504)."""

    wire_dtype = torch.float16


class BF16Compressor(CastCompressor):
    """Send floating-point tensors as bfloat16 (half the bytes, float32's range, 8-bit mantissa)."""

    wire_dtype = torch.bfloat16


class Compression:
    """The built-in compressors, by Horovod's names."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
