"""The table of what a part of a split image may go through: one entry per PyTorch function
object (``torch.narrow``, ``Tensor.narrow``, ``F.softmax`` each their own), with what it does
to the split and the name of its dimension argument. Anything not in the table is refused
(dispatch.py), so nothing can compute on one band as if it were the whole image.

Kinds, and the rule each follows on a part (dispatch.py applies them; layers.py,
normalization.py, reductions.py and resampling.py hold the handlers):

- ``HANDLER``: a spatial version of its own (convolutions, pooling, crops and pads: layers.py;
  batch, group and instance norm: normalization.py; reductions over the image: reductions.py;
  resampling: resampling.py);
- ``ELEMENTWISE``: each output pixel from the same pixel of the inputs; the other tensors must
  be the same part of a map of the same size, or constant along the image (sizes 1 there), or
  a part of length 1 along an image dimension the grid does not split (it broadcasts there);
- ``RANDOM``: element-wise with random numbers, drawn from each band's own stream
  (randomness.py), never the same on every band;
- ``RANDOM_CHANNELS``: random numbers constant over the image (the channels ``Dropout2d``
  drops): one draw for the group, the same on every band, as one process draws them once for
  the whole image;
- ``CONVERT``: a copy in another type, device or layout (``.to``, ``.float()``, ``.clone()``);
- ``LIKE``: a new tensor of the part's shape (``zeros_like``): the same part of a new map;
- ``ALONG``: along one dimension named by the argument ``dim``: fine along the batch or
  channel dimensions, refused along an image dimension (``missing``: what no dimension means);
- ``CONCAT``: joins parts of maps of the same size along the batch or channel dimensions;
- ``RESHAPE``: keeps the image dimensions last and whole (``view``, ``flatten(0, 1)``), or merges
  them into the last one (``flatten(2)``: only reduced over it, flattened.py);
- ``EXPAND``: repeats the batch or channel dimensions (``expand``, ``repeat``);
- ``PERMUTE``: reorders the batch and channel dimensions only;
- ``INDEX``: ``x[...]`` on the batch or channel dimensions, or a crop of the image
  (handled as one);
- ``SHAPE``: the part's lengths, as :class:`~hpdl.torch.spatial.lengths.PartLength`;
- ``METADATA``: reads what is the same on every part (``dim()``, ``dtype``, ``device``);
- ``PART_ATTRIBUTE``: an attribute that is the same part (``.data``, ``.grad``);
- ``NEW``/``FACTORY``: a new tensor of a size given explicitly (``x.new_zeros(...)``,
  ``torch.zeros(...)``): a part where the size is the part's own lengths (read from it),
  else what one process makes;
- ``REFUSED``: refused with the reason given (the common calls a model may make).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from hpdl.torch.spatial import layers, normalization, reductions, resampling


class Kind(enum.Enum):
    HANDLER = "handler"
    ELEMENTWISE = "element-wise"
    RANDOM = "random"
    RANDOM_CHANNELS = "random channels"
    CONVERT = "convert"
    LIKE = "like"
    ALONG = "along"
    CONCAT = "concatenate"
    RESHAPE = "reshape"
    EXPAND = "expand"
    PERMUTE = "permute"
    INDEX = "index"
    SHAPE = "shape"
    METADATA = "metadata"
    PART_ATTRIBUTE = "part attribute"
    NEW = "new"
    FACTORY = "factory"
    REFUSED = "refused"


@dataclasses.dataclass(frozen=True)
class Op:
    kind: Kind
    dim: Optional[str] = None  # ALONG, CONCAT: the argument naming the dimension(s)
    missing: Any = "all"  # ALONG: no dimension given means "all", "implicit" (softmax's rule), or this dimension
    fixed: Optional[int] = None  # CONCAT: the dimension, where the function has no argument for it
    handler: Optional[Callable] = None  # HANDLER
    why: str = ""  # REFUSED: the reason; HANDLER, ALONG: what it does, for the docs
    # ALONG: arguments that must be the same part as the input where they are tensors (a
    # scatter's index and source name places in the whole map, pixel by pixel: index[b][c][0][0]
    # is the image's first pixel, which only one band holds).
    same_part: Tuple[str, ...] = ()
    # ELEMENTWISE, RANDOM_CHANNELS: works across dimension 1 (LocalResponseNorm's window, a
    # channel shuffle, Dropout2d's mask per channel): the channels of an (N, C, H, W) part, but
    # the rows of a (C, H, W) one, and of a channels-last (N, H, W, C) one.
    across_dim_1: bool = False

    def dims_named(self, bound: Dict[str, Any], ndim: int) -> set:
        """The dimensions (non-negative) an ALONG call of arguments ``bound`` works along."""
        value = bound.get(self.dim) if self.dim else None
        if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
            if self.missing == "all":
                return set(range(ndim))
            if self.missing == "implicit":  # softmax's rule for no dim (torch.nn.functional._get_softmax_dim)
                value = 0 if ndim in (0, 1, 3) else 1
            else:
                value = self.missing
        values = value if isinstance(value, (list, tuple)) else (value,)
        return {int(v) % ndim for v in values if isinstance(v, int)} if ndim else set()


TABLE: Dict[Any, Op] = {}
_SPELLING: Dict[int, str] = {}  # id(function) -> how a user writes it, for messages and the docs


def _put(func: Any, op: Op, spelling: str) -> None:
    if func is None:
        return
    TABLE[func] = op
    _SPELLING[id(func)] = spelling


def functions(names: Iterable[str], in_place: bool = True, functional: bool = True,
               methods: bool = True, torch_level: bool = True) -> List[Tuple[Any, str]]:
    """The function objects called ``name`` in torch, Tensor (and its in-place ``name_``) and F."""
    found = []
    for name in names:
        candidates = []
        if torch_level:
            candidates.append((getattr(torch, name, None), f"torch.{name}"))
        if methods:
            candidates.append((getattr(torch.Tensor, name, None), f"Tensor.{name}"))
            if in_place:
                candidates.append((getattr(torch.Tensor, name + "_", None), f"Tensor.{name}_"))
        if functional:
            candidates.append((getattr(F, name, None), f"F.{name}"))
            if in_place:
                candidates.append((getattr(F, name + "_", None), f"F.{name}_"))
        seen = set()
        for func, spelling in candidates:
            if func is not None and callable(func) and id(func) not in seen:
                seen.add(id(func))
                found.append((func, spelling))
    return found


def _add(names: Iterable[str], op: Op, **where: bool) -> None:
    for func, spelling in functions(names.split() if isinstance(names, str) else names, **where):
        if func not in TABLE:
            _put(func, op, spelling)


def _attribute(name: str, op: Op) -> None:
    _put(getattr(torch.Tensor, name), op, f"x.{name}")


# -- handlers (layers.py, normalization.py, reductions.py, resampling.py) ---------------------

for _func, _spelling, _handler, _what in (
        (torch.conv2d, "F.conv2d", layers.conv2d,
         "any kernel, padding (numbers, `\"same\"`, `\"valid\"`), stride, dilation, groups, bias; zero padding"),
        (torch.conv_transpose2d, "F.conv_transpose2d", layers.conv_transpose2d,
         "any kernel, stride, padding, output_padding, dilation, groups, bias"),
        (F.max_pool2d, "F.max_pool2d", layers.max_pool2d,
         "any kernel, stride, padding, dilation, `ceil_mode`; a window of the whole image (`x.shape[2:]`): global"),
        (torch.max_pool2d, "torch.max_pool2d", layers.max_pool2d, "as F.max_pool2d"),
        (F.avg_pool2d, "F.avg_pool2d", layers.avg_pool2d,
         "any kernel, stride, padding, `ceil_mode`; `count_include_pad`, `divisor_override`; a window of the whole "
         "image (`F.avg_pool2d(x, x.size()[2:])`): global"),
        (F.lp_pool2d, "F.lp_pool2d", layers.lp_pool2d,
         "as PyTorch computes it: average pooling of the p-th powers (max pooling of magnitudes for p = inf)"),
        (F.batch_norm, "F.batch_norm", normalization.batch_norm,
         "statistics of the whole image (every part) and the batch; running statistics as one process keeps them"),
        (F.group_norm, "F.group_norm", normalization.group_norm,
         "statistics of each sample's groups of channels over the whole image (every part)"),
        (F.instance_norm, "F.instance_norm", normalization.instance_norm,
         "statistics of each sample's channels over the whole image (every part); running statistics as one "
         "process keeps them"),
        (torch.var, "torch.var", reductions.moments, "over both image dimensions: the whole image's; over neither: as "
         "it is"),
        (torch.Tensor.var, "Tensor.var", reductions.moments, "as torch.var"),
        (torch.std, "torch.std", reductions.moments, "as torch.var"),
        (torch.Tensor.std, "Tensor.std", reductions.moments, "as torch.var"),
        (torch.var_mean, "torch.var_mean", reductions.moments, "as torch.var"),
        (torch.std_mean, "torch.std_mean", reductions.moments, "as torch.var"),
        (F.adaptive_max_pool2d, "F.adaptive_max_pool2d", reductions.adaptive_max_pool2d,
         "to 1 x 1 (global max pooling), without indices: the same result on every rank of the group; to "
         "`(None, k)` or `(k, None)` where the grid does not split the dimension pooled (row bands' `(None, 1)`): "
         "each rank its own rows"),
        (torch.amax, "torch.amax", reductions.amax, "over both image dimensions: global; over neither: as it is"),
        (torch.Tensor.amax, "Tensor.amax", reductions.amax, "as torch.amax"),
        (torch.amin, "torch.amin", reductions.amin, "as torch.amax"),
        (torch.Tensor.amin, "Tensor.amin", reductions.amin, "as torch.amax"),
        (F.adaptive_avg_pool2d, "F.adaptive_avg_pool2d", reductions.adaptive_avg_pool2d,
         "to any k x l (1 x 1: global; a pyramid pooling module's 1, 2, 3, 6): the same result on every rank of the "
         "group; to `(None, k)` or `(k, None)` where the grid does not split the dimension pooled (row means, "
         "`(None, 1)`, on row bands): each rank its own rows"),
        (torch.pixel_shuffle, "F.pixel_shuffle", resampling.pixel_shuffle, "any factor"),
        (torch.pixel_unshuffle, "F.pixel_unshuffle", resampling.pixel_unshuffle,
         "any factor dividing the image's height and width"),
        (F.interpolate, "F.interpolate", resampling.interpolate,
         "nearest, nearest-exact, bilinear, bicubic, `align_corners` either way, any `size` or `scale_factor` "
         "(as one process reads them); area by whole factors (average pooling over blocks, or each pixel repeated); "
         "a whole tensor (a pooled branch) to a size read from a part becomes a part"),
        (torch.linalg.vector_norm, "torch.linalg.vector_norm", reductions.vector_norm,
         "of an order p > 0 or -inf over both image dimensions: the whole image's (its gradient 0 where the norm is "
         "0; for inf and -inf shared evenly among the ties); over neither: as it is"),
        (torch.any, "torch.any", reductions.counted,
         "over both image dimensions (no dimension: all of them; `torch.isnan(x).any()`): the whole image's, the "
         "same on every rank; over neither: as it is"),
        (torch.Tensor.any, "Tensor.any", reductions.counted, "as torch.any"),
        (torch.all, "torch.all", reductions.counted, "as torch.any"),
        (torch.Tensor.all, "Tensor.all", reductions.counted, "as torch.any"),
        (torch.count_nonzero, "torch.count_nonzero", reductions.counted, "as torch.any"),
        (torch.Tensor.count_nonzero, "Tensor.count_nonzero", reductions.counted, "as torch.any"),
        (torch.nansum, "torch.nansum", reductions.counted, "as torch.sum, NaN as 0"),
        (torch.Tensor.nansum, "Tensor.nansum", reductions.counted, "as torch.nansum"),
        (torch.nanmean, "torch.nanmean", reductions.counted,
         "as torch.any: the whole image's nansum over its count of numbers"),
        (torch.Tensor.nanmean, "Tensor.nanmean", reductions.counted, "as torch.nanmean"),
        (torch.norm, "torch.norm", reductions.vector_norm, "as torch.linalg.vector_norm (`'fro'` is 2)"),
        (torch.logsumexp, "torch.logsumexp", reductions.logsumexp,
         "over both image dimensions: the whole image's (LSE pooling); over neither: as it is"),
        (torch.Tensor.logsumexp, "Tensor.logsumexp", reductions.logsumexp, "as torch.logsumexp"),
        (torch.Tensor.norm, "Tensor.norm", reductions.vector_norm, "as torch.linalg.vector_norm"),
        (torch.mean, "torch.mean", reductions.reduction,
         "over both image dimensions: global; over neither: as it is; over one, kept (`keepdim=True`), where the grid "
         "does not split it (the columns of row bands): a part of a map of length 1 there, whose mean over the other "
         "is global (IMDN's `x.sum(3, keepdim=True).sum(2, keepdim=True)`)"),
        (torch.Tensor.mean, "Tensor.mean", reductions.reduction, "as torch.mean"),
        (torch.sum, "torch.sum", reductions.reduction, "as torch.mean"),
        (torch.Tensor.sum, "Tensor.sum", reductions.reduction, "as torch.mean"),
        (F.l1_loss, "F.l1_loss", reductions.pixel_loss,
         "of a part and its target (the same part): `reduction=\"none\"` the terms, a part; `mean` and `sum` the "
         "whole image's"),
        (F.mse_loss, "F.mse_loss", reductions.pixel_loss, "as F.l1_loss"),
        (F.smooth_l1_loss, "F.smooth_l1_loss", reductions.pixel_loss, "as F.l1_loss"),
        (F.huber_loss, "F.huber_loss", reductions.pixel_loss, "as F.l1_loss"),
        (F.pad, "F.pad", layers.pad,
         "of the image: `constant` (negative amounts crop), `replicate`, `reflect` and `circular` (the pad layers, "
         "`Conv2d(padding_mode=...)`), as one process pads the whole image"),
        (torch.narrow, "torch.narrow", layers.narrow, "along the batch or channels, or a crop of the image"),
        (torch.Tensor.narrow, "Tensor.narrow", layers.narrow, "as torch.narrow"),
):
    _put(_func, Op(Kind.HANDLER, handler=_handler, why=_what), _spelling)

# -- element-wise ----------------------------------------------------------------------------

_add("""
    abs absolute acos arccos acosh arccosh asin arcsin asinh arcsinh atan arctan atanh arctanh atan2 arctan2
    ceil clamp clamp_min clamp_max clip cos cosh deg2rad rad2deg digamma erf erfc erfinv exp exp2 expm1 fix
    floor frac lgamma log log10 log1p log2 logit nan_to_num neg negative positive reciprocal relu round rsqrt
    sigmoid sign sgn signbit sin sinc sinh sqrt square tan tanh trunc isfinite isinf isnan isneginf isposinf
    isreal logical_not bitwise_not i0 conj
    add sub subtract mul multiply div divide true_divide floor_divide remainder fmod pow float_power hypot
    maximum minimum fmax fmin eq ne not_equal lt less le less_equal gt greater ge greater_equal logical_and
    logical_or logical_xor bitwise_and bitwise_or bitwise_xor copysign heaviside lerp xlogy logaddexp
    logaddexp2 nextafter ldexp addcmul addcdiv where masked_fill isclose copy
    relu6 elu selu celu leaky_relu prelu gelu logsigmoid hardshrink tanhshrink softsign softplus softshrink
    hardsigmoid silu mish hardswish hardtanh threshold
""", Op(Kind.ELEMENTWISE))
for _name in ("__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__ "
              "__rtruediv__ __itruediv__ __div__ __rdiv__ __idiv__ __floordiv__ __rfloordiv__ __ifloordiv__ "
              "__mod__ __rmod__ __imod__ __pow__ __rpow__ __ipow__ __neg__ __pos__ __abs__ __invert__ __and__ "
              "__rand__ __iand__ __or__ __ror__ __ior__ __xor__ __rxor__ __ixor__ __eq__ __ne__ __lt__ __le__ "
              "__gt__ __ge__ __lshift__ __rshift__ __ilshift__ __irshift__").split():
    _put(getattr(torch.Tensor, _name, None), Op(Kind.ELEMENTWISE), f"Tensor.{_name}")
_add("channel_shuffle native_channel_shuffle", Op(Kind.ELEMENTWISE, why="moves whole channels", across_dim_1=True))
_add("local_response_norm", Op(Kind.ELEMENTWISE, across_dim_1=True))

# -- random ----------------------------------------------------------------------------------

_add("dropout alpha_dropout rrelu bernoulli rand_like randn_like randint_like", Op(Kind.RANDOM))
_add("uniform normal exponential geometric log_normal cauchy random", Op(Kind.RANDOM), torch_level=False,
     functional=False)
# New random tensors in a forward (stochastic depth's draw): replicated, one stream for the group,
# so that every rank draws the same numbers whatever its own seed.
_add("rand randn randint randperm normal poisson multinomial", Op(Kind.RANDOM), methods=False, functional=False)
# Their masks have size 1 along the image (N x C x 1 x 1), and as many numbers as channels
# whatever a band's size: the group's stream draws the same channels on every band.
# (dropout1d is not among them: on a (C, H, W) part its mask would run along the rows.)
_add("dropout2d dropout3d feature_dropout feature_alpha_dropout", Op(Kind.RANDOM_CHANNELS, across_dim_1=True),
     methods=False)

# -- conversions, new tensors like the part ----------------------------------------------------

_add("""to cuda cpu float double half bfloat16 int long short char byte bool type type_as contiguous clone detach
        requires_grad pin_memory cfloat cdouble""", Op(Kind.CONVERT), functional=False)
_add("zeros_like ones_like empty_like full_like", Op(Kind.LIKE))
_add("zero fill", Op(Kind.LIKE), torch_level=False, functional=False)

# -- along one dimension -------------------------------------------------------------------

_ALONG = (
    ("softmax log_softmax softmin", "dim", "implicit"),
    ("cumsum cumprod cummax cummin logcumsumexp", "dim", "all"),
    ("nansum nanmean prod amax amin max min aminmax argmax argmin std var std_mean var_mean median nanmedian "
     "all any count_nonzero quantile nanquantile", "dim", "all"),
    ("mode kthvalue topk sort argsort diff glu", "dim", -1),
    ("unbind chunk split tensor_split split_with_sizes", "dim", 0),
    ("select index_select gather take_along_dim index_add index_copy index_fill cross", "dim", "all"),
    ("repeat_interleave", "dim", "all"),
    ("normalize cosine_similarity", "dim", 1),
    ("flip", "dims", "all"),
    ("roll", "dims", "all"),
    ("rot90", "dims", "all"),
    ("fliplr", None, 1),  # the left-right of a matrix: its columns, dimension 1
    ("flipud", None, 0),
)
for _names, _dim, _missing in _ALONG:
    _add(_names, Op(Kind.ALONG, dim=_dim, missing=_missing))
_add("scatter scatter_add scatter_reduce", Op(Kind.ALONG, dim="dim", same_part=("index", "src")))
_put(torch.Tensor.unfold, Op(Kind.ALONG, dim="dimension"), "Tensor.unfold")

_add("cat concat concatenate stack", Op(Kind.CONCAT, dim="dim"), methods=False, functional=False)
_put(torch.hstack, Op(Kind.CONCAT, fixed=1), "torch.hstack")
_put(torch.vstack, Op(Kind.CONCAT, fixed=0), "torch.vstack")
_put(torch.row_stack, Op(Kind.CONCAT, fixed=0), "torch.row_stack")

# -- shapes --------------------------------------------------------------------------------

_add("view reshape view_as reshape_as flatten unflatten squeeze unsqueeze", Op(Kind.RESHAPE), functional=False)
_add("expand expand_as broadcast_to repeat tile", Op(Kind.EXPAND), functional=False)
_add("permute transpose swapaxes swapdims movedim moveaxis", Op(Kind.PERMUTE), functional=False)
for _name in ("__getitem__", "__setitem__"):
    _put(getattr(torch.Tensor, _name), Op(Kind.INDEX), "x[...]" if _name == "__getitem__" else "x[...] = v")

_add("size numel nelement", Op(Kind.SHAPE), torch_level=False, functional=False)
_put(torch.numel, Op(Kind.SHAPE), "torch.numel")
_attribute("shape", Op(Kind.SHAPE))
_attribute("nbytes", Op(Kind.SHAPE))
for _name in ("dim ndimension element_size is_contiguous storage_offset is_floating_point is_complex "
              "get_device register_hook retain_grad is_signed has_names is_set_to data_ptr untyped_storage "
              "__len__ __repr__ __format__ __hash__ __reduce_ex__ __deepcopy__ __setstate__ _is_view backward "
              "is_pinned is_inference dim_order").split():
    _put(getattr(torch.Tensor, _name, None), Op(Kind.METADATA), f"Tensor.{_name}")
_put(torch.is_floating_point, Op(Kind.METADATA), "torch.is_floating_point")
_put(torch.is_complex, Op(Kind.METADATA), "torch.is_complex")
_put(torch.is_tensor, Op(Kind.METADATA), "torch.is_tensor")
for _name in ("device dtype layout requires_grad is_leaf grad_fn is_cuda is_cpu is_meta is_sparse is_quantized "
              "is_mkldnn is_nested ndim names output_nr _version _base retains_grad itemsize name "
              "_backward_hooks _post_accumulate_grad_hooks _grad_fn _has_symbolic_sizes_strides _cdata "
              "_python_dispatch is_xla is_xpu is_mps is_ipu is_vulkan is_maia is_mtia is_sparse_csr volatile "
              "grad_dtype").split():
    if hasattr(torch.Tensor, _name):
        _attribute(_name, Op(Kind.METADATA))
for _name in ("data", "grad", "_grad"):
    _attribute(_name, Op(Kind.PART_ATTRIBUTE))

_add("new_zeros new_ones new_empty new_full new_tensor", Op(Kind.NEW), torch_level=False, functional=False)
_add("zeros ones empty full", Op(Kind.FACTORY), methods=False, functional=False)

# -- refused, with the reason (the rest is refused without one) ----------------------------------

_REFUSED = (
    ("layer_norm rms_norm",
     "it normalizes over each sample's pixels, which this rank holds only part of; over the channels alone, "
     "after x.permute(0, 2, 3, 1), it runs"),
    ("dropout1d", "on a (C, H, W) part it would drop rows, which each rank would choose on its own"),
    ("linear matmul",
     "it may combine pixels along the image's dimensions, which the ranks hold in parts; on the channels, after "
     "x.permute(0, 2, 3, 1), it runs"),
    ("bilinear mm bmm einsum tensordot inner outer",
     "it may combine pixels along the image's dimensions, which the ranks hold in parts"),
    ("unfold fold grid_sample affine_grid fractional_max_pool2d",
     "it reads pixels the halo exchange does not bring"),
    ("max_pool2d_with_indices max_unpool2d", "its indices are places in the whole map, which no part holds"),
    ("item tolist numpy __array__ __bool__ __float__ __int__ __index__",
     "it reads the part's values as if they were the whole image's"),
    ("stride as_strided", "the part's memory layout is not the whole image's"),
)
for _names, _why in _REFUSED:
    for _func, _spelling in functions(_names.split()):
        if _func not in TABLE:
            _put(_func, Op(Kind.REFUSED, why=_why), _spelling)
for _name in ("T", "mT", "H", "mH", "real", "imag"):
    _attribute(_name, Op(Kind.REFUSED, why="it moves the image dimensions"))


def lookup(func: Callable) -> Optional[Op]:
    """The table's entry for ``func`` (an attribute's read or write: its descriptor's), or None."""
    op = TABLE.get(func)
    if op is None and getattr(func, "__name__", "") in ("__get__", "__set__"):
        op = TABLE.get(getattr(func, "__self__", None))
    return op


def spelled(func: Callable) -> str:
    """How a user writes ``func``: ``F.conv2d``, ``Tensor.narrow``, ``torch.cat``, ``x.shape``."""
    name = getattr(func, "__name__", "") or type(func).__name__
    if name in ("__get__", "__set__"):
        attribute = getattr(getattr(func, "__self__", None), "__name__", "?")
        return f"x.{attribute}" + (" = ..." if name == "__set__" else "")
    known = _SPELLING.get(id(func))
    if known is not None:
        return known
    for prefix, namespace in (("F", F), ("torch", torch), ("Tensor", torch.Tensor)):
        if getattr(namespace, name, None) is func:
            return f"{prefix}.{name}"
    # torch.linalg.vector_norm is the built-in linalg_vector_norm of torch._C._linalg (fft, special alike).
    for sub in ("linalg", "fft", "special"):
        short = name[len(sub) + 1:] if name.startswith(sub + "_") else name
        if getattr(getattr(torch, sub), short, None) is func:
            return f"torch.{sub}.{short}"
    module = getattr(func, "__module__", "") or ""
    return f"{module}.{name}" if module else name


def aten_name(func: Callable) -> str:
    """The name of the ATen operator a built-in ``func`` calls (``Tensor.add_``: ``add_``)."""
    return getattr(func, "__name__", "")
