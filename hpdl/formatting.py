"""Sizes and tables as hpdl prints them, and sizes as users type them.

Shared by the benchmarks' and the profiler's reports, so that both print a size and a table
the same way (one table style: OSU's, right-aligned numbers).
"""

from __future__ import annotations

import fractions
import re
from typing import Iterable, Sequence

__all__ = ["format_size", "format_table", "parse_size"]


# A plain decimal number (no sign, exponent, "inf" or "nan") and an optional unit.
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([A-Z]*)")
# The largest size parsed: far beyond any memory, and still a float (1 EiB).
_MAX_SIZE = 1 << 60


def parse_size(text: str) -> int:
    """Parse a byte count such as ``4``, ``64K``, ``1M``, ``64MiB``, ``1G``, ``1.5K``.

    Raises:
        ValueError: for text that is not a size, a fraction of a byte (``1.5``: rounding would
            measure another size than the one asked for), or more than 1 EiB.
    """
    units = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
             "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
    match = _SIZE.fullmatch(text.strip().upper())
    if not match or match.group(2) not in units:
        raise ValueError(f"not a size: {text!r} (examples: 4, 64K, 1M, 64MiB)")
    # Exact arithmetic: a float would overflow on hundreds of digits and round large sizes.
    size = fractions.Fraction(match.group(1)) * units[match.group(2)]
    if size > _MAX_SIZE:
        shown = text.strip() if len(text.strip()) <= 24 else text.strip()[:20] + "..."
        raise ValueError(f"{shown!r} is more than 1 EiB")
    if size.denominator != 1:
        raise ValueError(f"{text.strip()!r} is not a whole number of bytes")
    return int(size)


def format_size(nbytes: float) -> str:
    """``131072`` -> ``128 KiB``; whole units without decimals."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{int(nbytes)} B"


def format_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Right-aligned columns, first column left-aligned, like OSU's output.

    Control characters in a cell (a tensor name holding a newline) are shown escaped, so that
    every row stays one line.
    """
    rows = [[_printable(str(c)) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    for row in rows:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def _printable(text: str) -> str:
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)
