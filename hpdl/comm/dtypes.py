"""The element types hpdl's collectives move and reduce, by name: the one table of them.

Every backend moves and reduces these (MPI the half types through hpdl's own reductions,
comm/mpi.py, which maps each to its MPI type); ``hpdl.torch`` refuses any other before it
reaches the engine, and the benchmarks take them by name. Names are torch's without
``torch.``, as the engine's negotiation and the profile write them.
"""

from __future__ import annotations

from typing import Dict

import torch

__all__ = ["DTYPES", "SUPPORTED", "dtype_name"]

DTYPES: Dict[str, torch.dtype] = {str(dtype).replace("torch.", ""): dtype for dtype in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.bool)}
SUPPORTED = frozenset(DTYPES.values())
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``'float32'`` for ``torch.float32``; any dtype, supported or not."""
    name = _NAMES.get(dtype)
    return name if name is not None else str(dtype).replace("torch.", "")
