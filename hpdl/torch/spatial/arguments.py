"""A PyTorch call's arguments by name, as PyTorch itself reads them.

The spatial dispatch decides from an argument's meaning (the dimension ``narrow`` cuts, the
size ``interpolate`` makes), never from its position: ``y.narrow(3, 0, 2)`` has its dimension
second and ``F.softmax(x, 1)`` too, but ``torch.max(a, b)`` has a tensor there. Positions read
by hand got this wrong; so every call is bound to a signature PyTorch publishes:

- a Python function (``torch.nn.functional``'s, ``Tensor.__rsub__``): its own signature;
- a built-in (``torch.narrow``, ``Tensor.narrow``, ``Tensor.add_``): the schemas of the ATen
  operator of the same name (``aten::narrow``, its overloads), tried in turn, the first whose
  parameters take the arguments' kinds (a tensor where a tensor goes, a number where a number
  goes) winning, as PyTorch's own argument parser picks an overload. Sizes and dimension
  lists given one by one (``x.view(2, 3, 20)``, ``x.permute(0, 2, 3, 1)``) are packed, as
  PyTorch packs them.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import typing
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.fx.operator_schemas import _torchscript_schema_to_signature

# Functions whose published signature is a dispatcher's ``(*args, **kwargs)``: the function
# that really takes the arguments.
_SIGNATURE_OF: Dict[Callable, Callable] = {
    F.max_pool1d: F._max_pool1d, F.max_pool2d: F._max_pool2d, F.max_pool3d: F._max_pool3d,
    F.adaptive_max_pool1d: F._adaptive_max_pool1d, F.adaptive_max_pool2d: F._adaptive_max_pool2d,
    F.adaptive_max_pool3d: F._adaptive_max_pool3d,
    F.fractional_max_pool2d: F._fractional_max_pool2d, F.fractional_max_pool3d: F._fractional_max_pool3d,
}


class Unbound(TypeError):
    """No signature of the function takes these arguments."""


def bind(func: Callable, name: str, args: tuple, kwargs: dict) -> Dict[str, Any]:
    """``func(*args, **kwargs)``'s arguments by parameter name, defaults filled in.

    The tensor a method is called on is ``input`` (ATen's ``self``, Python's ``input``).
    Raises :class:`Unbound` when no signature takes them (PyTorch would raise too).

    A model calls the same functions the same way at every step: the way a call of these
    arguments' kinds was bound is kept, and the next such call is bound the same way at once.
    """
    key = (func, tuple(_kind(a) for a in args), tuple((k, _kind(v)) for k, v in kwargs.items()))
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _plan(func, name, args, kwargs)
    return plan.apply(args, kwargs)


def by_name(func: Callable, args: tuple, kwargs: dict) -> Dict[str, Any]:
    """:func:`bind` of a call as a user made it, the tensor it is on named ``input``: where no
    signature takes the arguments, PyTorch's own error for them (the call is made), else
    :class:`Unbound`."""
    try:
        bound = bind(func, getattr(func, "__name__", ""), args, kwargs)
    except Unbound:
        func(*args, **kwargs)
        raise
    if "self" in bound and "input" not in bound:
        bound["input"] = bound.pop("self")
    return bound


class _Plan:
    """How a call's positional arguments map to names: the first ``len(names)`` positions are
    these parameters; with ``packed``, the ones from ``packed`` on are one list (sizes given one
    by one); keyword arguments keep their names (``self`` read as ``input``); then the
    defaults of the parameters not given."""

    __slots__ = ("names", "packed", "defaults")

    def __init__(self, names: Tuple[str, ...], packed: Optional[int], defaults: Dict[str, Any]):
        self.names, self.packed, self.defaults = names, packed, defaults

    def apply(self, args: tuple, kwargs: dict) -> Dict[str, Any]:
        if self.packed is not None:
            args = tuple(args[:self.packed]) + (tuple(args[self.packed:]),)
        out = dict(zip(self.names, args))
        for k, v in kwargs.items():
            out["input" if k == "self" else k] = v
        for k, v in self.defaults.items():
            out.setdefault(k, v)
        return out


_plans: Dict[tuple, _Plan] = {}


def _kind(value: Any) -> Any:
    """What decides which overload takes ``value``: a tensor, or the type of anything else
    (a list by its first item's)."""
    if isinstance(value, torch.Tensor):
        return torch.Tensor
    if isinstance(value, (list, tuple)):
        return (list, _kind(value[0]) if len(value) else None)
    return type(value)


def _plan(func: Callable, name: str, args: tuple, kwargs: dict) -> _Plan:
    python = _SIGNATURE_OF.get(func, func)
    if inspect.isfunction(python):
        signature = _python_signature(python)
        try:
            signature.bind(*args, **kwargs)
        except TypeError as err:
            raise Unbound(str(err)) from None
        return _plan_of(signature, args, None)
    for signature in _aten_signatures(name):
        packed = _bind_schema(signature, args, kwargs)
        if packed is not None:
            return _plan_of(signature, args, packed if packed >= 0 else None)
    raise Unbound(f"no signature of {name} takes ({_kinds(args, kwargs)})")


def _plan_of(signature: inspect.Signature, args: tuple, packed: Optional[int]) -> _Plan:
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    given = len(args) if packed is None else packed + 1
    names = tuple("input" if p.name == "self" else p.name for p in positional[:given])
    defaults = {("input" if p.name == "self" else p.name): p.default for p in params
                if p.default is not p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return _Plan(names, packed, defaults)


@functools.lru_cache(maxsize=None)
def _python_signature(func: Callable) -> inspect.Signature:
    return inspect.signature(func)


@functools.lru_cache(maxsize=None)
def _aten_signatures(name: str) -> List[inspect.Signature]:
    """The overloads of ``aten::name`` without an ``out=`` tensor (the ones a model calls)."""
    schemas = torch._C._jit_get_schemas_for_operator(f"aten::{name}")
    signatures = []
    for schema in schemas:
        if any(a.name == "out" for a in schema.arguments):
            continue
        try:
            signatures.append(_torchscript_schema_to_signature(schema))
        except Exception:  # noqa: BLE001 - a schema Python cannot express is not one a model calls
            continue
    return signatures


def _bind_schema(signature: inspect.Signature, args: tuple, kwargs: dict) -> Optional[int]:
    """Whether ``signature`` takes the arguments: -1 as they are, the position from which they
    are packed into one list (``x.view(2, 3, 20)``), or None when it does not."""
    kwargs = {("input" if k == "self" else k): v for k, v in kwargs.items()}
    for attempt, packed in ((args, -1), (_packed(signature, args), _first_packed(signature))):
        if attempt is None:
            continue
        try:
            bound = signature.bind(*attempt, **kwargs)
        except TypeError:
            continue
        if all(_takes(signature.parameters[n].annotation, v) for n, v in bound.arguments.items()):
            return packed
    return None


def _first_packed(signature: inspect.Signature) -> int:
    params = list(signature.parameters.values())
    return 1 if params and params[0].annotation is torch.Tensor else 0


def _packed(signature: inspect.Signature, args: tuple) -> Optional[tuple]:
    """``args`` with the numbers after the tensor packed into one list where the first parameter
    after it is a list of ints (``x.view(2, 3, 20)``, ``torch.zeros(2, 3)``), else None."""
    params = list(signature.parameters.values())
    first = 1 if params and params[0].annotation is torch.Tensor else 0
    if len(params) <= first or len(args) <= first + 1 or not _is_int_list(params[first].annotation):
        return None
    rest = args[first:]
    if not all(isinstance(a, int) and not isinstance(a, bool) for a in rest):
        return None
    return tuple(args[:first]) + (tuple(rest),)


def _is_int_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (list, List) and typing.get_args(annotation) == (int,)


def _takes(annotation: Any, value: Any) -> bool:
    """Whether a parameter of ``annotation`` takes ``value``, as PyTorch's parser would."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        return any(_takes(a, value) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is torch.Tensor:
        return isinstance(value, torch.Tensor)
    if isinstance(value, torch.Tensor):
        # A number parameter takes a 0-d tensor only where no tensor overload comes first: the
        # overloads are tried in ATen's order, which puts the tensor ones first.
        return False
    if origin in (list, List):
        if isinstance(value, (list, tuple, torch.Size)):
            (item,) = typing.get_args(annotation) or (Any,)
            return all(_takes(item, v) for v in value)
        return _takes(typing.get_args(annotation)[0], value) if typing.get_args(annotation) else True
    if annotation is int:
        # ATen's ScalarType, Layout and MemoryFormat are ints in its schemas.
        return (isinstance(value, int) and not isinstance(value, bool)) or \
            isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is float or annotation is numbers.Number:
        return isinstance(value, (int, float, bool, complex))
    if annotation is str:
        return isinstance(value, str)
    if annotation is torch.device:
        return isinstance(value, (torch.device, str, int))
    return True


def _kinds(args: tuple, kwargs: dict) -> str:
    def kind(value: Any) -> str:
        return "Tensor" if isinstance(value, torch.Tensor) else type(value).__name__

    return ", ".join([kind(a) for a in args] + [f"{k}={kind(v)}" for k, v in kwargs.items()])
