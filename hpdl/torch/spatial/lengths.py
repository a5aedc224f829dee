"""Lengths read from a part: the part's own number, which remembers the whole image's.

Inside a spatial forward, ``x.shape`` of a part is the part's shape, since the tensor is the
part (``x.view(b, c, h, w)`` must get the part's own sizes). But a model's forward also uses
the lengths it reads as numbers: ``F.interpolate(y, size=x.shape[-2:])`` (a segmentation
head), ``diff = skip.size(2) - up.size(2)`` then ``F.pad`` (a U-Net with odd sizes),
``x.sum() / x.numel()``, ``if x.shape[-1] != skip.shape[-1]``. One process reads the whole
image's lengths there; a rank that read its part's would compute something else, and
differently on each rank.

So a part's image lengths (and its element count) are :class:`PartLength`: an ``int`` whose
value is the part's own, as PyTorch and Python's integer uses see it (``view``, ``range``,
indexing a list), carrying ``whole``, the same length in the whole image. Arithmetic keeps
both (``2 * h + 1`` is the part's ``2h + 1`` and the whole's ``2H + 1``), comparisons and
hashing use the whole (``h == 64`` asks what one process asks), and the spatial dispatch uses
the whole where a length is a number (an interpolation's size, a slice's bounds, a padding,
an operand of arithmetic on tensors) and the part's where it shapes a tensor
(dispatch.py). ``float(h)`` is a number, so the whole's (``x.sum() / float(h * w)``,
``math.sqrt(h)``: on equal bands nothing else would tell a part's own number there from the
whole's). ``int(h)`` gives the part's own number, leaving hpdl's sight, and so does Python's
arithmetic with a float first (``0.5 * h``: float's operator reads the int value before the
length's reflected one is asked), as do numpy and ``range``: the first forward then compares
what every rank computes, and what one process computes on the whole image as one part
(split_check.py), so a number taken from a part's own length is refused rather than run
silently wrong, even where the bands are alike.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

ROWS, COLS = 0, 1  # the axis a length measures; None: a product or mix of lengths


class PartLength(int):
    """The part's own length (the ``int`` value), with ``whole``: the whole image's."""

    whole: int
    axis: Optional[int]
    exact: bool  # read from a shape as it is (not computed): ``whole`` names a map's size

    def __new__(cls, local: int, whole: int, axis: Optional[int] = None, exact: bool = False) -> "PartLength":
        value = super().__new__(cls, local)
        value.whole = int(whole)
        value.axis = axis
        value.exact = exact
        return value

    def __repr__(self) -> str:
        return int.__repr__(self)

    def __hash__(self) -> int:
        return hash(self.whole)

    def __float__(self) -> float:
        # A length made a float is a number (``x.sum() / float(h * w)``, ``math.sqrt(h)``), never
        # a tensor's shape: one process's, the whole's.
        return float(self.whole)

    def __bool__(self) -> bool:
        # A truth value decides as a comparison does, on the whole (``if h % 8:`` pads where one
        # process pads; int's own read the part's number, and the first forward refused it).
        return self.whole != 0

    def __reduce__(self):
        return (PartLength, (int(self), self.whole, self.axis, self.exact))


def whole(value: Any) -> Any:
    """``value`` as one process sees it: a length's whole, anything else as it is."""
    return value.whole if isinstance(value, (PartLength, PartFloat)) else value


def local(value: Any) -> Any:
    """``value`` as the part sees it: a plain ``int`` (or ``float``) for a length."""
    if isinstance(value, PartLength):
        return int(value)
    return _own(value) if isinstance(value, PartFloat) else value


def holds_length(value: Any) -> bool:
    """Whether ``value`` is, or contains (in a tuple, list or dict), a length read from a part.

    Called on the arguments of every call in a spatial forward: types are compared first, the
    common case (tensors and plain numbers) costing one look at each argument."""
    kind = type(value)
    if kind is PartLength or kind is PartFloat:
        return True
    if kind is tuple or kind is list or isinstance(value, (tuple, list)):
        for item in value:
            item_kind = type(item)
            if item_kind is PartLength or item_kind is PartFloat:
                return True
            if (item_kind is tuple or item_kind is list or item_kind is dict or isinstance(item, (tuple, list))) \
                    and holds_length(item):
                return True
        return False
    if kind is dict:
        return holds_length(tuple(value.values()))
    return False


def to_whole(value: Any) -> Any:
    """``value`` with every length replaced by its whole (in tuples, lists and dicts too)."""
    if isinstance(value, (PartLength, PartFloat)):
        return value.whole
    if isinstance(value, (tuple, list)) and holds_length(value):
        items = [to_whole(v) for v in value]
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    if isinstance(value, dict) and holds_length(value):
        return {k: to_whole(v) for k, v in value.items()}
    return value


def to_local(value: Any) -> Any:
    """``value`` with every length replaced by the part's own plain ``int``."""
    if isinstance(value, (PartLength, PartFloat)):
        return local(value)
    if isinstance(value, (tuple, list)) and holds_length(value):
        items = [to_local(v) for v in value]
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    if isinstance(value, dict) and holds_length(value):
        return {k: to_local(v) for k, v in value.items()}
    return value


def _axis(a: Any, b: Any) -> Optional[int]:
    """The axis a length computed from ``a`` and ``b`` measures: theirs when they agree."""
    axes = {v.axis for v in (a, b) if isinstance(v, PartLength)}
    return axes.pop() if len(axes) == 1 else None


def _arithmetic(op):
    def forward(self, other):
        if not isinstance(other, (int, float)) or isinstance(other, bool):
            return NotImplemented
        return _combine(op, self, other)

    def reflected(self, other):
        if not isinstance(other, (int, float)) or isinstance(other, bool):
            return NotImplemented
        return _combine(op, other, self)

    return forward, reflected


def _combine(op, a: Any, b: Any) -> Any:
    mine = op(local(a), local(b))
    theirs = op(whole(a), whole(b))
    if isinstance(mine, int) and isinstance(theirs, int):
        return PartLength(mine, theirs, _axis(a, b))
    return PartFloat(mine, theirs)


def _unary(op):
    def apply(self):
        return PartLength(op(int(self)), op(self.whole), self.axis)

    return apply


def _comparison(op):
    def compare(self, other):
        if isinstance(other, (PartLength, PartFloat)):
            other = other.whole
        if not isinstance(other, (int, float)):
            return NotImplemented
        return op(self.whole, other)

    return compare


for _name, _op in (("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                   ("floordiv", operator.floordiv), ("mod", operator.mod), ("truediv", operator.truediv),
                   ("pow", operator.pow)):
    _forward, _reflected = _arithmetic(_op)
    setattr(PartLength, f"__{_name}__", _forward)
    setattr(PartLength, f"__r{_name}__", _reflected)
for _name, _op in (("neg", operator.neg), ("pos", operator.pos), ("abs", abs)):
    setattr(PartLength, f"__{_name}__", _unary(_op))
for _name, _op in (("eq", operator.eq), ("ne", operator.ne), ("lt", operator.lt), ("le", operator.le),
                   ("gt", operator.gt), ("ge", operator.ge)):
    setattr(PartLength, f"__{_name}__", _comparison(_op))


_own = float.__float__  # a PartFloat's own (the part's) value, past its __float__


class PartFloat(float):
    """A number computed from lengths that is no longer whole (``h / 2``): the part's value,
    with the whole's; ``math.floor``, ``math.ceil``, ``round`` and ``math.trunc`` of it keep
    both, and ``float()`` of it (``math.sqrt``, ``math.log``) is the whole's, as for a length."""

    whole: float

    def __new__(cls, local_value: float, whole_value: float) -> "PartFloat":
        value = super().__new__(cls, local_value)
        value.whole = float(whole_value)
        return value

    def __repr__(self) -> str:
        return float.__repr__(self)

    def __float__(self) -> float:
        return self.whole

    def __hash__(self) -> int:
        return hash(self.whole)

    def __bool__(self) -> bool:
        return self.whole != 0

    def __floor__(self) -> PartLength:
        import math

        return PartLength(math.floor(_own(self)), math.floor(self.whole))

    def __ceil__(self) -> PartLength:
        import math

        return PartLength(math.ceil(_own(self)), math.ceil(self.whole))

    def __round__(self, ndigits: Optional[int] = None) -> Any:
        if ndigits is not None:
            return PartFloat(round(_own(self), ndigits), round(self.whole, ndigits))
        return PartLength(round(_own(self)), round(self.whole))

    def __trunc__(self) -> PartLength:
        return PartLength(int(_own(self)), int(self.whole))


def _float_arithmetic(op):
    def forward(self, other):
        if not isinstance(other, (int, float)) or isinstance(other, bool):
            return NotImplemented
        return PartFloat(op(_own(self), local(other)), op(self.whole, whole(other)))

    def reflected(self, other):
        if not isinstance(other, (int, float)) or isinstance(other, bool):
            return NotImplemented
        return PartFloat(op(local(other), _own(self)), op(whole(other), self.whole))

    return forward, reflected


for _name, _op in (("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
                   ("truediv", operator.truediv), ("floordiv", operator.floordiv), ("mod", operator.mod),
                   ("pow", operator.pow)):
    _forward, _reflected = _float_arithmetic(_op)
    setattr(PartFloat, f"__{_name}__", _forward)
    setattr(PartFloat, f"__r{_name}__", _reflected)
for _name, _op in (("eq", operator.eq), ("ne", operator.ne), ("lt", operator.lt), ("le", operator.le),
                   ("gt", operator.gt), ("ge", operator.ge)):
    setattr(PartFloat, f"__{_name}__", _comparison(_op))
PartFloat.__neg__ = lambda self: PartFloat(-_own(self), -self.whole)
PartFloat.__abs__ = lambda self: PartFloat(abs(_own(self)), abs(self.whole))
