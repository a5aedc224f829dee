"""DistributedOptimizer: average gradients across ranks while backward is still running.

The distributed half of the returned optimizer is one of three mixins: the plain one
(optimizer_base.py: each gradient's allreduce starts from its hook, ``step()`` waits for them
and runs the wrapped optimizer's own ``step()``), ``overlap_forward=model``'s (overlap.py: each
update is left to the next forward) and ``op=Adasum``'s (adasum.py: the ranks' updates are
combined, not their gradients). Behaviour follows Horovod 0.28's ``horovod/torch/optimizer.py``.

The returned object is an instance of a subclass of the wrapped optimizer's class (one class
per optimizer class and mixin, made once and cached), so ``isinstance(opt, torch.optim.SGD)``
holds; it shares ``param_groups``, ``state`` and ``defaults`` with the optimizer it wraps.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple, Union

import torch

from hpdl.engine import Op
from hpdl.torch import mpi_ops
from hpdl.torch.adasum import DistributedAdasumMixin
from hpdl.torch.compression import Compression
from hpdl.torch.mpi_ops import Adasum, Average
from hpdl.torch.optimizer_base import DistributedOptimizerMixin, check_backward_passes
from hpdl.torch.overlap import OverlapForwardMixin, check_overlap_forward
from hpdl.torch.process_sets import ProcessSet, global_process_set

__all__ = ["DistributedOptimizer"]


@functools.lru_cache(maxsize=None)
def _distributed_class(base: type, mixin: type) -> type:
    """The DistributedOptimizer subclass of ``base`` with ``mixin``, made once per pair."""
    return type(f"Distributed{base.__name__}", (mixin, base),
                {"__module__": __name__, "__doc__": f"{base.__name__}, distributed across ranks."})


def _named(optimizer: torch.optim.Optimizer,
           named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]]) -> Dict[torch.Tensor, str]:
    """Map every parameter of ``optimizer`` to its name, as Horovod; raise ValueError on bad names."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}"
                for i, group in enumerate(optimizer.param_groups) for j, p in enumerate(group["params"])}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    seen, duplicates = set(), []
    for name, _ in named:
        if name in seen and name not in duplicates:
            duplicates.append(name)
        seen.add(name)
    if duplicates:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                         + ", ".join(map(str, duplicates)))
    names = {p: name for name, p in named}
    unnamed = [p for group in optimizer.param_groups for p in group["params"] if p not in names]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         f"Python object ids: {', '.join(str(id(p)) for p in unnamed)} "
                         f"(shapes {', '.join(str(list(p.shape)) for p in unnamed[:5])})")
    return names


def _check_groups(optimizer: torch.optim.Optimizer, groups) -> None:
    if groups is None:
        return
    if isinstance(groups, bool) or not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a positive integer or a list of lists of torch.Tensor.")
    if isinstance(groups, int):
        return
    params = {p for group in optimizer.param_groups for p in group["params"]}
    grouped = set()
    for group in groups:
        if not isinstance(group, (list, tuple)):
            raise ValueError("groups should be a positive integer or a list of lists of torch.Tensor.")
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise ValueError("groups must consist of torch.Tensor.")
            if p in grouped:
                raise ValueError("A parameter can only appear once in groups.")
            if p not in params:
                raise ValueError(f"groups contains a tensor of shape {list(p.shape)} that the optimizer does not update")
            grouped.add(p)


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                         compression=Compression.none, backward_passes_per_step: int = 1, op: Op = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Union[None, int, Sequence[Sequence[torch.Tensor]]] = None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set,
                         overlap_forward: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that its gradients are reduced across ranks before every step.

    Args:
        optimizer: the optimizer to wrap; the result is an instance of a subclass of its class
            and shares its parameter groups and state.
        named_parameters: ``model.named_parameters()``: names match gradients across ranks
            (default: names from the position in ``param_groups``, which must then agree).
        compression: ``Compression.none``, ``.fp16`` or ``.bf16`` for the allreduce.
        backward_passes_per_step: backward passes accumulated locally per allreduce.
        op: ``Average`` (default), ``Sum`` or ``Adasum`` (which, as Horovod, combines the
            updates of each rank's own optimizer step instead of the gradients).
        gradient_predivide_factor: with Average, scale by 1/f before the sum and f/size after.
        num_groups: deprecated spelling of an integer ``groups``.
        groups: an integer number of fusion groups, or lists of parameters reduced together.
        sparse_as_dense: reduce sparse gradients as dense tensors (else by allgather).
        process_set: the ranks among which gradients are reduced.
        overlap_forward: hpdl's own: the model, to let the exchange of the last gradients
            overlap the next forward. ``step()`` returns at once; each module's parameters
            get their update when the next forward reaches it (or at ``state_dict()``, or
            ``apply_pending_updates()``), the allreduces starting in the model's parameter
            order. Until then the parameters hold the previous values: read them through the
            model's forward or ``state_dict()``. Each parameter must be used only by the
            module that owns it, and the ``backward_passes_per_step``, ``groups``, sparse
            gradients and Adasum options are not available with it.
    """
    if isinstance(optimizer, DistributedOptimizerMixin):
        raise ValueError("the optimizer is already a DistributedOptimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    op = mpi_ops.as_op(op)  # Horovod's op numbers too
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise ValueError(f"compression must provide compress() and decompress(), got {compression!r}")
    check_backward_passes(backward_passes_per_step)
    if gradient_predivide_factor != 1.0:
        if op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor!r}")
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    if isinstance(groups, tuple):
        groups = list(groups)
    if overlap_forward is not None:
        check_overlap_forward(overlap_forward, backward_passes_per_step, groups, op)
    _check_groups(optimizer, groups)
    names = _named(optimizer, named_parameters)

    mixin: type = DistributedOptimizerMixin
    extra: Dict[str, Any] = {}
    if overlap_forward is not None:
        mixin, extra = OverlapForwardMixin, {"overlap_forward": overlap_forward}
    if op == Adasum and process_set.size() > 1:
        if process_set is not global_process_set:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        mpi_ops.check_adasum_ranks(process_set)
        mixin, groups, sparse_as_dense = DistributedAdasumMixin, None, False  # as Horovod: ignored with Adasum
    cls = _distributed_class(type(optimizer), mixin)
    distributed = cls.__new__(cls)
    # Share the wrapped optimizer's attributes (param_groups, state, defaults, hooks), but not
    # instance-level overrides of our methods, e.g. an LR scheduler's wrapper around step.
    own = set(dir(mixin))
    distributed.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in own})
    distributed._setup(names, compression, backward_passes_per_step, op, float(gradient_predivide_factor),
                       groups, bool(sparse_as_dense), process_set, **extra)
    return distributed
