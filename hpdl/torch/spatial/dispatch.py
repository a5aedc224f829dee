"""Runs a model's own forward on parts of feature maps: a torch function mode that sends every
PyTorch call touching a part to its spatial version.

The model is not rewritten: its modules and its functional calls (``F.interpolate`` in
SRResNet's forward, ``x.mean((2, 3))``, residual adds) run as written, and the mode sees each
call. A call that touches a part (a tensor marked by parts.py) goes to:

- its handler in layers.py (convolution, pooling, batch norm, resampling, global reductions);
- the operation itself when it is element-wise, or works along the batch or channel
  dimensions only (the image dimensions stay the last two, unchanged); its results are marked;
- otherwise a :class:`SpatialError` naming the module and the call: nothing outside these
  lists is run on a part, so nothing can silently compute on one band as if it were the image.

The mode also gives every parameter's gradient its factor (``Context.grad_scale``, see
parallel.py). Per-module hooks keep the path of the running module for messages and labels.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from hpdl.torch.spatial import layers
from hpdl.torch.spatial.context import Context
from hpdl.torch.spatial.geometry import Part, SpatialError
from hpdl.torch.spatial.parts import part_of, tag_outputs, tagged

_HANDLERS: Dict[Callable, Callable] = {
    torch.conv2d: layers.conv2d,
    F.max_pool2d: layers.max_pool2d,
    torch.max_pool2d: layers.max_pool2d,
    F.avg_pool2d: layers.avg_pool2d,
    F.batch_norm: layers.batch_norm,
    F.adaptive_avg_pool2d: layers.adaptive_avg_pool2d,
    torch.pixel_shuffle: layers.pixel_shuffle,
    F.interpolate: layers.interpolate,
    torch.mean: layers.reduction,
    torch.Tensor.mean: layers.reduction,
    torch.sum: layers.reduction,
    torch.Tensor.sum: layers.reduction,
}

# Element-wise operations, by name (a function's, a method's, or an in-place method's without
# its trailing underscore): each output pixel depends on the same pixel of the inputs.
_ELEMENTWISE = frozenset("""
    abs absolute acos acosh add addcdiv addcmul angle asin asinh atan atan2 atanh bitwise_and bitwise_not
    bitwise_or bitwise_xor ceil celu clamp clamp_max clamp_min clip clone contiguous copy copysign cos cosh
    deg2rad detach div divide double dropout alpha_dropout elu eq erf erfc erfinv exp exp2 expm1 float
    float_power floor floor_divide fmax fmin fmod frac gelu ge greater greater_equal gt half hardshrink
    hardsigmoid hardswish hardtanh heaviside isfinite isinf isnan le leaky_relu lerp less less_equal lgamma
    log log10 log1p log2 logaddexp logical_and logical_not logical_or logical_xor logit logsigmoid lt
    masked_fill maximum minimum mish mul multiply nan_to_num ne neg negative not_equal pow prelu rad2deg
    reciprocal relu relu6 remainder requires_grad round rrelu rsqrt selu sgn sigmoid sign silu sin sinc sinh
    softplus softshrink softsign sqrt square sub subtract tan tanh tanhshrink threshold true_divide trunc
    where xlogy zero fill bfloat16 cpu cuda to type type_as zeros_like ones_like empty_like full_like
    rand_like randn_like float16 int long bool byte char short data_ptr
""".split())
_OPERATORS = frozenset("add sub mul truediv floordiv mod pow neg pos abs invert and or xor eq ne lt le gt ge".split())
# Calls that read a tensor's metadata, or make a tensor of a size given explicitly.
_PASS_THROUGH = frozenset("""
    size dim numel element_size is_contiguous stride storage_offset __len__ is_floating_point is_complex
    get_device register_hook retain_grad __repr__ __format__ __hash__ __reduce_ex__ __deepcopy__ nelement
    ndimension untyped_storage __set__ new_zeros new_ones new_empty new_full new_tensor __setstate__
    is_leaf has_names _is_view requires_grad_ backward
""".split())
# Operations along one dimension (``dim``): fine along the batch or channel dimensions.
_ALONG_DIM = frozenset("""
    softmax log_softmax softmin normalize cumsum cumprod logsumexp argmax argmin amax amin max min std var
    norm prod all any glu topk sort cummax cummin unbind chunk split narrow select flip roll
""".split())
_CONCATENATE = frozenset("cat concat concatenate stack".split())
_RESHAPE = frozenset("view reshape view_as reshape_as expand expand_as squeeze unsqueeze flatten unflatten".split())
_PERMUTE = frozenset("permute transpose swapaxes swapdims movedim moveaxis".split())

_local = threading.local()


def active() -> Optional[Context]:
    """The context of the spatial forward running on this thread, if any."""
    return getattr(_local, "context", None)


@contextlib.contextmanager
def running(ctx: Context) -> Iterator[None]:
    """Run the block as a spatial forward with ``ctx``: the mode on, ``ctx`` active on this thread."""
    previous = active()
    _local.context = ctx
    try:
        with SpatialMode(ctx):
            yield
    finally:
        _local.context = previous


class SpatialMode(TorchFunctionMode):
    def __init__(self, ctx: Context):
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ctx = self.ctx
        if ctx.grad_scale != 1.0 and torch.is_grad_enabled():
            args, kwargs = _scale_parameters(func, args, kwargs, ctx.grad_scale)
        part = _find_part(args, kwargs)
        if part is None:
            return func(*args, **kwargs)
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(ctx, func, args, kwargs)
        return _generic(ctx, func, part, args, kwargs)


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, factor):
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_gradient(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor`` unchanged, with its gradient multiplied by ``factor`` on the way back."""
    return _ScaleGradient.apply(tensor, factor) if factor != 1.0 and tensor.requires_grad else tensor


def _scale_parameters(func, args, kwargs, factor: float):
    """``args`` and ``kwargs`` with every parameter that requires a gradient scaled on its way
    back by ``factor``; reading a parameter's metadata (its shape) leaves it as it is."""
    def scaled(value):
        if isinstance(value, nn.Parameter) and value.requires_grad:
            return _ScaleGradient.apply(value, factor)
        if isinstance(value, (list, tuple)) and any(isinstance(v, nn.Parameter) for v in value):
            return type(value)(scaled(v) for v in value)
        return value

    if not any(isinstance(a, (nn.Parameter, list, tuple)) for a in args) and \
            not any(isinstance(v, nn.Parameter) for v in kwargs.values()):
        return args, kwargs
    name = _name(func)
    if name == "__get__" or name in _PASS_THROUGH:
        return args, kwargs
    return tuple(scaled(a) for a in args), {k: scaled(v) for k, v in kwargs.items()}


def _find_part(args, kwargs) -> Optional[Part]:
    for value in args:
        part = part_of(value)
        if part is not None:
            return part
        if isinstance(value, (list, tuple)):
            for item in value:
                part = part_of(item)
                if part is not None:
                    return part
    for value in kwargs.values():
        part = part_of(value)
        if part is not None:
            return part
    return None


def _name(func: Callable) -> str:
    return getattr(func, "__name__", "") or type(func).__name__


def _elementwise(name: str) -> bool:
    if name.startswith("__") and name.endswith("__"):
        core = name[2:-2]
        return core in _OPERATORS or (core[:1] in ("r", "i") and core[1:] in _OPERATORS)
    return name in _ELEMENTWISE or (name.endswith("_") and name[:-1] in _ELEMENTWISE)


def _image_dims(ndim: int, dims: Any) -> set:
    """Which of the last two (image) dimensions ``dims`` (an int, a sequence, or None: all) names."""
    if dims is None:
        return {ndim - 2, ndim - 1}
    names = dims if isinstance(dims, (tuple, list)) else (dims,)
    return {d % ndim for d in names if isinstance(d, int)} & {ndim - 2, ndim - 1}


def _refuse(ctx: Context, what: str, why: str = "") -> SpatialError:
    return SpatialError(f"{ctx.where()}: {what} is not supported in the spatial part" + (f" ({why})" if why else ""))


def _generic(ctx: Context, func, part: Part, args, kwargs):
    name = _name(func)
    if name == "__get__":  # an attribute: .shape, .dtype, .grad, .data, ...
        attribute = getattr(getattr(func, "__self__", None), "__name__", "")
        if attribute in ("T", "mT", "H", "mH"):
            raise _refuse(ctx, f"the transpose .{attribute} of a part")
        return tag_outputs(func(*args, **kwargs), part)
    if name in _PASS_THROUGH:
        return func(*args, **kwargs)
    if _elementwise(name):
        if name in ("dropout2d", "dropout3d", "feature_alpha_dropout"):
            raise _refuse(ctx, name, "it drops whole channels, which each rank would choose on its own")
        return tag_outputs(func(*args, **kwargs), part)
    x = args[0] if args else None
    ndim = x.dim() if isinstance(x, torch.Tensor) else 4
    if name in _ALONG_DIM:
        if len(args) > 1 and isinstance(args[1], torch.Tensor):  # torch.max(a, b): element-wise
            return tag_outputs(func(*args, **kwargs), part)
        dim = kwargs.get("dim", args[2] if name in ("split", "chunk", "narrow", "select") and len(args) > 2
                         else args[1] if len(args) > 1 else None)
        if name in ("split", "chunk") and "dim" not in kwargs and len(args) <= 2:
            dim = 0
        if name in ("flip", "roll"):
            dim = kwargs.get("dims", args[2] if name == "roll" and len(args) > 2 else
                             args[1] if name == "flip" and len(args) > 1 else None)
        if _image_dims(ndim, dim):
            raise _refuse(ctx, f"{name} along an image dimension")
        return tag_outputs(func(*args, **kwargs), part)
    if name in _CONCATENATE:
        tensors = args[0]
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        ndim = tensors[0].dim() + (1 if name == "stack" else 0)
        if _image_dims(ndim, dim):
            raise _refuse(ctx, f"{name} along an image dimension")
        if any(part_of(t) != part for t in tensors):
            raise _refuse(ctx, f"{name} of a part with a tensor that is not the same part of a map of the same size")
        return tag_outputs(func(*args, **kwargs), part)
    if name in _RESHAPE:
        out = func(*args, **kwargs)
        if out.dim() < 2 or tuple(out.shape[-2:]) != part.local_size or \
                (name in ("flatten", "unflatten", "squeeze") and _touches_image(name, args, kwargs, ndim)):
            raise _refuse(ctx, f"{name} that changes the image dimensions")
        return tagged(out, part)
    if name in _PERMUTE:
        if _moves_image_dims(name, args, kwargs, ndim):
            raise _refuse(ctx, f"{name} that moves the image dimensions")
        return tag_outputs(func(*args, **kwargs), part)
    if name in ("__getitem__", "__setitem__"):
        if not _keeps_image_dims(args[1], ndim):
            raise _refuse(ctx, "indexing that selects rows or columns of a part",
                          "index the batch or channel dimensions only")
        return tag_outputs(func(*args, **kwargs), part)
    if name == "pad":
        pad = args[1] if len(args) > 1 else kwargs.get("pad")
        if any(pad[:4]):
            raise _refuse(ctx, "F.pad of the image dimensions", "use the layer's own padding")
        return tag_outputs(func(*args, **kwargs), part)
    raise _refuse(ctx, _describe(func))


def _describe(func: Callable) -> str:
    """How a user would spell ``func``: ``F.linear``, ``Tensor.unfold``, ``torch.fft.fft2``."""
    name = _name(func)
    for prefix, namespace in (("F", F), ("torch", torch), ("Tensor", torch.Tensor)):
        if getattr(namespace, name, None) is func:
            return f"{prefix}.{name}"
    module = getattr(func, "__module__", "") or ""
    return f"{module}.{name}" if module else name


def _touches_image(name: str, args, kwargs, ndim: int) -> bool:
    if name == "squeeze":
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        return dims is not None and bool(_image_dims(ndim, dims))
    start = args[1] if len(args) > 1 else kwargs.get("start_dim", 0)
    end = args[2] if len(args) > 2 else kwargs.get("end_dim", -1)
    if name == "unflatten":
        return bool(_image_dims(ndim, start))
    return end % ndim >= ndim - 2 and start % ndim != end % ndim


def _moves_image_dims(name: str, args, kwargs, ndim: int) -> bool:
    if name == "permute":
        order = args[1:] if len(args) > 2 or not isinstance(args[1] if len(args) > 1 else None, (tuple, list)) \
            else args[1]
        order = kwargs.get("dims", order)
        return [d % ndim for d in order][-2:] != [ndim - 2, ndim - 1]
    if name in ("movedim", "moveaxis"):
        source, destination = (args[1], args[2]) if len(args) > 2 else (kwargs.get("source"), kwargs.get("destination"))
        return bool(_image_dims(ndim, source) | _image_dims(ndim, destination))
    first, second = (args[1], args[2]) if len(args) > 2 else (kwargs.get("dim0"), kwargs.get("dim1"))
    return bool(_image_dims(ndim, (first, second)))


def _keeps_image_dims(index: Any, ndim: int) -> bool:
    """Whether ``x[index]`` leaves the last two dimensions whole and last."""
    entries = index if isinstance(index, tuple) else (index,)
    whole = [isinstance(e, slice) and e == slice(None) for e in entries]
    ellipsis = [e is Ellipsis for e in entries]
    if any(ellipsis):
        at = ellipsis.index(True)
        if not all(whole[at + 1:]):
            return False
        entries = entries[:at]
    else:
        consumed = [i for i, e in enumerate(entries) if e is not None]
        if len(consumed) > ndim - 2:
            if not all(whole[i] for i in consumed[ndim - 2:]):
                return False
            entries = entries[:consumed[ndim - 2]]
    # Advanced indexing by one vector selects along one dimension; a mask of several would merge them.
    return not any(isinstance(e, torch.Tensor) and e.dim() > 1 for e in entries)


# -- the running module's path -------------------------------------------------------------

def track_modules(model: nn.Module) -> list:
    """Hooks on every module of ``model`` that keep the running module's path in the active
    context, and keep batch norm's batch count when backward recomputes a checkpointed block."""
    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(_entered))
        handles.append(module.register_forward_hook(_left, always_call=True))
    return handles


def _entered(module: nn.Module, inputs) -> None:
    ctx = active()
    if ctx is None:
        return
    ctx.modules.append(module)
    if ctx.recomputing and isinstance(module, _BatchNorm) and module.num_batches_tracked is not None:
        module._hpdl_batches = module.num_batches_tracked.clone()


def _left(module: nn.Module, inputs, output) -> None:
    ctx = active()
    if ctx is None or not ctx.modules:
        return
    if ctx.modules[-1] is module:
        ctx.modules.pop()
    saved = module.__dict__.pop("_hpdl_batches", None)
    if saved is not None:
        module.num_batches_tracked.copy_(saved)
