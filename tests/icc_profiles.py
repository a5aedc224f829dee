"""A small CMYK ICC profile made in the test, for images whose colours need their profile."""

from __future__ import annotations

import itertools
import struct


def _s15(x: float) -> bytes:
    return struct.pack(">i", round(x * 65536))


def _pad(b: bytes) -> bytes:
    return b + b"\0" * (-len(b) % 4)


def cmyk_profile(corners) -> bytes:
    """An ICC v2 input profile for CMYK whose A2B0 table (lut8, two grid points per ink) maps
    each corner (c, m, y, k in {0, 1}) to ``corners[(c, m, y, k)]``, a CIELAB (L, a, b), and
    interpolates between them."""
    d50 = (0.9642, 1.0, 0.8249)
    clut = b""
    for c, m, y, k in itertools.product((0, 1), repeat=4):  # the first input varies slowest
        lab_l, lab_a, lab_b = corners[(c, m, y, k)]
        clut += bytes([round(lab_l * 255 / 100), round(lab_a + 128), round(lab_b + 128)])
    identity = bytes(range(256))
    a2b0 = (b"mft1" + b"\0" * 4 + bytes([4, 3, 2, 0]) + b"".join(_s15(v) for v in (1, 0, 0, 0, 1, 0, 0, 0, 1))
            + identity * 4 + clut + identity * 3)
    text = b"hpdl test CMYK\0"
    desc = b"desc" + b"\0" * 4 + struct.pack(">I", len(text)) + text + b"\0" * 8 + b"\0" * 3 + b"\0" * 67
    tags = [(b"desc", desc), (b"cprt", b"text" + b"\0" * 4 + b"none\0"),
            (b"wtpt", b"XYZ " + b"\0" * 4 + b"".join(_s15(v) for v in d50)), (b"A2B0", a2b0)]
    offset = 128 + 4 + 12 * len(tags)
    table, body = struct.pack(">I", len(tags)), b""
    for sig, data in tags:
        table += sig + struct.pack(">II", offset + len(body), len(data))
        body += _pad(data)
    size = offset + len(body)
    header = (struct.pack(">I", size) + b"\0" * 4 + bytes([2, 0x10, 0, 0]) + b"scnr" + b"CMYK" + b"Lab "
              + struct.pack(">6H", 2026, 1, 1, 0, 0, 0) + b"acsp" + b"\0" * 24 + struct.pack(">I", 0)
              + b"".join(_s15(v) for v in d50) + b"\0" * 48)
    assert len(header) == 128
    return header + table + body


def print_like_corners():
    """Corners of a press-like CMYK: inks darker and duller than the plain formula's."""
    corners = {}
    for c, m, y, k in itertools.product((0, 1), repeat=4):
        lightness = 100 - 45 * c - 50 * m - 11 * y - 30 * (c * m + c * y + m * y)
        corners[(c, m, y, k)] = (max(5, lightness * (0.12 if k else 1)),
                                 -37 * c + 74 * m - 5 * y, -50 * c - 3 * m + 93 * y)
    return corners
