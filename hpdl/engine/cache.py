"""The response cache: negotiated responses remembered by name, addressed by bit position.

Once a request has been negotiated in full, later identical requests (same name, same
signature on this rank) are agreed on with one bit each: every rank sets the bit of each cached
request it has pending, and a bitwise AND across ranks yields those ready everywhere. This works
because every rank updates its cache with the same responses in the same order, so positions
agree without ever being exchanged. Eviction is least-recently-used, also deterministic.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional

import numpy as np

from hpdl.engine.request import Response, Signature

BITS_PER_WORD = 32  # int64 words carrying 32 bits each: no sign-bit surprises in BAND


class ResponseCache:
    """Least-recently-used map name -> (position, response) with ``capacity`` positions."""

    def __init__(self, capacity: int, rank: int):
        self.capacity = capacity
        self.rank = rank
        self._by_name: "OrderedDict[str, int]" = OrderedDict()  # LRU order, oldest first
        self._responses: List[Optional[Response]] = [None] * capacity
        self.hits = 0
        self.misses = 0

    @property
    def words(self) -> int:
        return (self.capacity + BITS_PER_WORD - 1) // BITS_PER_WORD

    def __len__(self) -> int:
        return len(self._by_name)

    def lookup(self, name: str, signature: Signature) -> Optional[int]:
        """Return the bit position of ``name`` if cached with this rank's same signature."""
        position = self._by_name.get(name)
        if position is None:
            return None
        response = self._responses[position]
        if response.signatures[self.rank] != signature:
            return None
        return position

    def get(self, position: int) -> Response:
        return self._responses[position]

    def touch(self, position: int) -> None:
        """Mark a cached response used (call in the same order on every rank)."""
        self._by_name.move_to_end(self._responses[position].name)

    def put(self, response: Response) -> None:
        """Remember a successfully negotiated response (same order on every rank)."""
        if self.capacity == 0:
            return
        position = self._by_name.get(response.name)
        if position is None:
            if len(self._by_name) < self.capacity:
                position = len(self._by_name)
            else:
                _, position = self._by_name.popitem(last=False)
        self._by_name[response.name] = position
        self._by_name.move_to_end(response.name)
        self._responses[position] = response

    def encode(self, positions: List[int], out: np.ndarray) -> None:
        """Set the bits of ``positions`` in ``out`` (an int64 array of ``words`` entries)."""
        for position in positions:
            out[position // BITS_PER_WORD] |= 1 << (position % BITS_PER_WORD)

    @staticmethod
    def decode(words: np.ndarray) -> List[int]:
        """Return the set bit positions of ``words``, ascending."""
        positions: List[int] = []
        for index in np.flatnonzero(words):
            word = int(words[index])
            base = int(index) * BITS_PER_WORD
            while word:
                low = word & -word
                positions.append(base + low.bit_length() - 1)
                word ^= low
        return positions

    def names(self) -> Dict[str, int]:
        return dict(self._by_name)
