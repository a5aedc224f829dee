"""Small statistics shared by the benchmarks (their sizes and tables: hpdl/formatting.py)."""

from __future__ import annotations

import statistics
from typing import List, Sequence


def median(values: Sequence[float]) -> float:
    """Return the median of a non-empty sequence."""
    return float(statistics.median(values))


def spread(values: Sequence[float]) -> float:
    """Return half the 95 % range of ``values`` as Horovod's benchmarks print it (1.96 sigma)."""
    return 1.96 * float(statistics.pstdev(values)) if len(values) > 1 else 0.0


def doubling_sizes(min_bytes: int, max_bytes: int) -> List[int]:
    """Return sizes doubling from ``min_bytes`` up to and including ``max_bytes``."""
    sizes, size = [], max(1, min_bytes)
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes
