"""CUDA streams between the caller and the engine: what a collective reads is ready, what it
returns is safe to use.

The engine thread issues its work (copies into and out of the fusion buffer, the backend's
collectives) on each device's default stream, the stream most training runs on: there, the
caller's work and the engine's are ordered by the stream itself, and nothing here does
anything. A caller on another stream (``with torch.cuda.stream(s):``, or autograd running a
backward op on the stream its forward used) gets two waits, both on the GPU, neither blocking
the host, as Horovod orders its own streams with events:

- when it submits a CUDA tensor, the default stream waits for the caller's stream, so the
  engine reads the tensor (and writes an output) only after the caller's work on it;
- when it synchronizes, its stream waits for the default stream, so it reads the results only
  after the engine wrote them, and each CUDA tensor handed over is marked as used on the
  caller's stream (``record_stream``), so that the caching allocator does not give its memory
  to the engine's next allocation while the caller's kernels still read it.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

__all__ = ["after_engine", "before_engine", "side_stream"]


def side_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    """The calling thread's current stream on CUDA ``device`` when it is not the default
    stream (the engine's), else None."""
    current = torch.cuda.current_stream(device)
    return None if current == torch.cuda.default_stream(device) else current


def before_engine(*tensors: Optional[torch.Tensor]) -> None:
    """Order the engine's use of ``tensors`` after the caller's work on them so far."""
    for tensor in tensors:
        if tensor is not None and tensor.is_cuda:
            stream = side_stream(tensor.device)
            if stream is not None:
                torch.cuda.default_stream(tensor.device).wait_stream(stream)


def after_engine(result: Any) -> Any:
    """Order the caller's use of ``result`` (a tensor, or tensors in lists and tuples) after the
    engine's writes to it; return ``result``."""
    for tensor in _cuda_tensors(result):
        stream = side_stream(tensor.device)
        if stream is not None:
            stream.wait_stream(torch.cuda.default_stream(tensor.device))
            tensor.record_stream(stream)
    return result


def _cuda_tensors(result: Any) -> Iterator[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        if result.is_cuda:
            yield result
    elif isinstance(result, (list, tuple)):
        for item in result:
            yield from _cuda_tensors(item)
