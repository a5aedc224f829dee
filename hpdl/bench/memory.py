"""This process's memory as the kernel counts it, for benchmarks that say how much a step needs
and whether it fits a budget (Linux; elsewhere the figures are unknown and no limit is set).

- The peak resident set since a moment of our choosing: writing ``5`` to
  ``/proc/self/clear_refs`` resets the kernel's high-water mark (``VmHWM``) to the memory
  resident now (Linux 4.0), and ``VmHWM`` then says the most that was resident since.
- A budget enforced for real: ``RLIMIT_DATA`` (private writable memory: the heap, and every
  anonymous mapping malloc and PyTorch's allocator make, since Linux 4.7) set to what the
  process holds now plus the budget, so that an allocation past it fails (PyTorch raises,
  naming the bytes it tried to allocate) instead of being measured afterwards.

On a GPU (:class:`CudaMemory`) the same three come from PyTorch's CUDA caching allocator: the
memory allocated now, its peak since a reset, and a budget set as the allocator's share of
the device (``set_per_process_memory_fraction``), past which an allocation raises CUDA's
out-of-memory error, naming the size it tried.
"""

from __future__ import annotations

import resource
from typing import Optional

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def status_bytes(field: str) -> Optional[int]:
    """A ``kB`` field of /proc/self/status (``VmRSS``, ``VmHWM``, ``VmData``) in bytes; None where
    there is no such file or field."""
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak() -> bool:
    """Make the peak resident set (``VmHWM``) the memory resident now; whether the kernel did."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_resident() -> Optional[int]:
    """The most memory resident since the last :func:`reset_peak` (since the start without one)."""
    return status_bytes("VmHWM")


def resident() -> Optional[int]:
    return status_bytes("VmRSS")


def limit_data(budget: int) -> Optional[int]:
    """Let this process allocate at most ``budget`` bytes more private memory than it holds now
    (``RLIMIT_DATA`` = ``VmData`` + ``budget``, within the hard limit); return the limit set, or
    None where the platform does not tell what it holds (no limit is set then)."""
    held = status_bytes("VmData")
    if held is None:
        return None
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = held + budget
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return limit


class CudaMemory:
    """This process's memory on one CUDA device, as PyTorch's caching allocator counts it."""

    def __init__(self, device):
        self.device = device

    def _cuda(self):
        import torch

        return torch.cuda

    def resident(self) -> int:
        """The bytes of tensors allocated on the device now."""
        return self._cuda().memory_allocated(self.device)

    def reset_peak(self) -> bool:
        self._cuda().reset_peak_memory_stats(self.device)
        return True

    def peak_resident(self) -> int:
        """The most bytes allocated since the last :meth:`reset_peak`."""
        return self._cuda().max_memory_allocated(self.device)

    def limit(self, budget: int) -> int:
        """Let the allocator hold at most what it reserves now plus ``budget`` bytes (its share of
        the device's memory); return that limit."""
        cuda = self._cuda()
        total = cuda.get_device_properties(self.device).total_memory
        limit = min(total, cuda.memory_reserved(self.device) + budget)
        cuda.set_per_process_memory_fraction(limit / total, self.device)
        return limit


class HostMemory:
    """This process's memory in the host's RAM (the functions above), with CudaMemory's methods."""

    resident = staticmethod(resident)
    reset_peak = staticmethod(reset_peak)
    peak_resident = staticmethod(peak_resident)
    limit = staticmethod(limit_data)


# oneDNN allocates a convolution's scratchpad and reordered weights when it creates the
# primitive, and says only this when that allocation fails (the status is not in the text).
_ONEDNN_CREATE_FAILED = "could not create a primitive"


def out_of_memory(err: BaseException, under_budget: bool = False) -> bool:
    """Whether ``err`` is an allocation that failed (torch raises RuntimeError for it, naming
    the bytes it tried to allocate; Python raises MemoryError). ``under_budget``: the process
    runs under :func:`limit_data`, where oneDNN failing to create a primitive is its
    allocation failing (elsewhere that message may have other causes, so it is not read so)."""
    if isinstance(err, MemoryError):
        return True
    if not isinstance(err, RuntimeError):
        return False
    text = str(err)
    return "allocate" in text or (under_budget and _ONEDNN_CREATE_FAILED in text)
