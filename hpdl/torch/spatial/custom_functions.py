"""A model's own ``torch.autograd.Function`` in a spatial forward.

The torch function mode does not see ``Function.apply``. The Function's forward runs with
gradients off: its calls on a part run as the op table says, and those whose backward needs
the neighbours' rows (a layer with a halo, a reduction over the image) are refused there
(dispatch.py). Its own backward then computes the gradients, on the part alone and outside the
mode. So while a spatial forward runs, ``apply`` of a Function defined outside PyTorch and hpdl
is wrapped:

- the parameters passed to it are scaled as every other call's are (gradient_scale.py): its
  backward gave a parameter its part's share alone, which the optimizer's average then divided
  by the group's size (StyleGAN's FusedLeakyReLU's bias, a learned Swish's beta: half their
  gradient on 2 ranks, silently);
- given a part, its backward runs under a guard (:class:`_BackwardGuard`) that lets it compute
  each pixel's gradient from the same pixel's values (element-wise calls: a memory-efficient
  Swish, a gradient reversal, a straight-through estimator) and sum over the image for a
  gradient that is not a part's (a bias's: each rank's sum is its share, which the optimizer
  adds up), and refuses anything else on a part, naming the Function: a backward that smoothed
  or normalized the gradient over the image computed it from the part's pixels alone.

PyTorch's own Functions (a reentrant checkpoint's) and hpdl's, and every thread outside a
spatial forward, call ``apply`` unchanged; ``apply`` is PyTorch's again once the last spatial
forward on any thread ends.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from hpdl.torch.spatial import ops
from hpdl.torch.spatial.arguments import Unbound, by_name
from hpdl.torch.spatial.gradient_scale import scale_parameters
from hpdl.torch.spatial.geometry import SpatialError
from hpdl.torch.spatial.ops import Kind
from hpdl.torch.spatial.parts import channels_last_part_of, part_of, tensors_in

_Function = torch.autograd.function.Function
_original = _Function.__dict__["apply"]  # the classmethod itself, put back as it was
_plain_apply = _original.__func__
_installed = {"depth": 0}
_install_lock = threading.Lock()


@contextlib.contextmanager
def wrapped(active: Callable[[], Optional[Any]]) -> Iterator[None]:
    """``Function.apply`` wrapped while the block runs; ``active()`` is the context of the
    spatial forward running on the calling thread, or None."""
    with _install_lock:
        if _installed["depth"] == 0:
            _Function.apply = classmethod(_wrapped_apply(active))
        _installed["depth"] += 1
    try:
        yield
    finally:
        with _install_lock:
            _installed["depth"] -= 1
            if _installed["depth"] == 0:
                _Function.apply = _original


def _wrapped_apply(active: Callable[[], Optional[Any]]):
    def apply(cls, *args, **kwargs):
        ctx = active()
        if ctx is None or _library_function(cls):
            return _plain_apply(cls, *args, **kwargs)
        if ctx.grad_scale != 1.0 and torch.is_grad_enabled():
            args, kwargs = scale_parameters(args, kwargs, ctx.grad_scale)
        inputs = tensors_in(list(args) + list(kwargs.values()))
        sizes = _part_sizes(inputs)
        if sizes == ((), ()) or not torch.is_grad_enabled():
            return _plain_apply(cls, *args, **kwargs)
        return _plain_apply(_guarded(cls, sizes), *args, **kwargs)
    return apply


def _library_function(cls: type) -> bool:
    """PyTorch's own Functions and hpdl's (gradient_scale's, the reductions')."""
    where = getattr(cls, "__module__", "") or ""
    return where == "torch" or where.startswith(("torch.", "hpdl."))


Sizes = Tuple[Tuple[Tuple[int, int], ...], Tuple[Tuple[int, int], ...]]


def _part_sizes(tensors) -> Sizes:
    """The local (rows, columns) of the parts among ``tensors``: image dimensions last, and
    channels-last ones."""
    last = {tuple(p.local_size) for p in map(part_of, tensors) if p is not None}
    channels_last = {tuple(p.local_size) for p in map(channels_last_part_of, tensors) if p is not None}
    return tuple(sorted(last)), tuple(sorted(channels_last))


_guarded_classes: Dict[Tuple[type, Sizes], type] = {}


def _guarded(cls: type, sizes: Sizes) -> type:
    """``cls`` with its backward run under :class:`_BackwardGuard` for parts of ``sizes``."""
    key = (cls, sizes)
    guarded = _guarded_classes.get(key)
    if guarded is None:
        def backward(ctx, *grads):
            with _BackwardGuard(cls.__name__, sizes) as guard:
                out = cls.backward(ctx, *grads)
            for grad in out if isinstance(out, tuple) else (out,):
                if guard.local(grad) and guard.summed(grad):
                    raise guard.refused("a gradient of the part's pixels made from a sum over the part")
            return out
        guarded = type(cls.__name__, (cls,), {"backward": staticmethod(backward), "__module__": cls.__module__,
                                              "__qualname__": cls.__qualname__})
        _guarded_classes[key] = guarded
    return guarded


_SUMMED = "_hpdl_summed_over_a_part"
_SUMS = (torch.sum, torch.Tensor.sum, torch.nansum, torch.Tensor.nansum)
_FREE = (Kind.SHAPE, Kind.METADATA, Kind.PART_ATTRIBUTE, Kind.CONVERT, Kind.LIKE, Kind.NEW, Kind.FACTORY)


class _BackwardGuard(TorchFunctionMode):
    """The calls of a Function's own backward given a part: on a tensor of a part's local size,
    element-wise calls and sums over the whole image (marked summed: a parameter's share); a
    summed value meeting a part's pixels, and anything else on a part, refused."""

    def __init__(self, name: str, sizes: Sizes):
        super().__init__()
        self.name, (self.last, self.channels_last) = name, sizes

    def local(self, t: Any) -> bool:
        """Whether ``t`` is of a part's local size: the part's pixels."""
        return isinstance(t, torch.Tensor) and (
            (t.dim() >= 2 and tuple(t.shape[-2:]) in self.last)
            or (t.dim() >= 3 and tuple(t.shape[-3:-1]) in self.channels_last))

    @staticmethod
    def summed(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and getattr(t, _SUMMED, False)

    def refused(self, what: str) -> SpatialError:
        return SpatialError(
            f"{self.name}.backward (a torch.autograd.Function of the model's own, given a part): {what} is not "
            "supported: its backward runs on the part alone, without its neighbours' pixels; it may compute each "
            "pixel's gradient from the same pixel's values and sum over the image for a parameter's gradient, no "
            "more: write the forward with PyTorch's calls, which SpatialParallel differentiates split")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = tensors_in(list(args) + list(kwargs.values()))
        local = any(self.local(t) for t in tensors)
        summed = any(self.summed(t) for t in tensors)
        if not local:  # what a sum becomes (a bias's gradient reshaped) is summed too
            out = func(*args, **kwargs)
            return _mark_summed(out) if summed else out
        op = ops.lookup(func)
        kind = op.kind if op is not None else None
        if func in _SUMS:
            if not self._over_the_image(func, args, kwargs):
                raise self.refused(f"{ops.spelled(func)} of a part along some of its image dimensions only")
            return _mark_summed(func(*args, **kwargs))
        if summed:
            raise self.refused(f"{ops.spelled(func)} of the part's pixels with a sum over the part")
        if not (kind in _FREE or (kind is Kind.ELEMENTWISE and not op.across_dim_1)):
            raise self.refused(f"{ops.spelled(func)} of a part")
        return func(*args, **kwargs)

    def _over_the_image(self, func, args, kwargs) -> bool:
        try:
            bound = by_name(func, args, kwargs)
        except Unbound:
            return False
        x, dim = bound.get("input"), bound.get("dim")
        if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
            return True
        n = x.dim()
        dims = {int(d) % n for d in (dim if isinstance(dim, (list, tuple)) else (dim,))}
        image = {n - 2, n - 1} if tuple(x.shape[-2:]) in self.last else {n - 3, n - 2}
        return image <= dims


def _mark_summed(out: Any) -> Any:
    for t in tensors_in([out]):
        setattr(t, _SUMMED, True)
    return out
