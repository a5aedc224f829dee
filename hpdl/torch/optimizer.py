"""DistributedOptimizer: average gradients across ranks while backward is still running.

Each parameter gets a post-accumulate-grad hook. When autograd has finished a parameter's
gradient the hook starts its allreduce at once, so communication overlaps the rest of
backward; ``step()`` waits for the allreduces (``synchronize()``) and then runs the wrapped
optimizer's own ``step()``. Behaviour follows Horovod 0.28's ``horovod/torch/optimizer.py``.

With ``overlap_forward=model``, ``step()`` leaves each update to the next forward (overlap.py).

The returned object is an instance of a subclass of the wrapped optimizer's class (one class
per optimizer class, made once and cached), so ``isinstance(opt, torch.optim.SGD)`` holds; it
shares ``param_groups``, ``state`` and ``defaults`` with the optimizer it wraps.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from hpdl.engine import Op
from hpdl.torch import mpi_ops, runtime
from hpdl.torch.compression import Compression, _CastCompressor
from hpdl.torch.mpi_ops import Adasum, Average
from hpdl.torch.overlap import OverlapForwardMixin, _check_overlap_forward
from hpdl.torch.process_sets import ProcessSet, global_process_set

__all__ = ["DistributedOptimizer"]

# A parameter's gradient is reduced by at most one DistributedOptimizer: the newest one to
# wrap it. The hook handle lives on the parameter so that wrapping a model again (a new
# optimizer after a restart, say) replaces the old hook instead of reducing twice.
_HOOK_ATTR = "_hpdl_grad_hook"

_Key = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


class _Submitted:
    """One started allreduce: a parameter's (or a group's), with what is needed to finish it."""

    __slots__ = ("handle", "params", "ctxs", "sparse", "grads")

    def __init__(self, handle: Any, params: Tuple[torch.Tensor, ...], ctxs: Tuple[Any, ...], sparse: bool = False):
        self.handle = handle  # an AsyncHandle, or for sparse gradients a callable giving the result
        self.params = params
        self.ctxs = ctxs
        self.sparse = sparse
        self.grads = tuple(p.grad for p in params)  # where the results go, even after zero_grad()


def _grad_ready(owner: "weakref.ReferenceType", param: torch.Tensor) -> None:
    # A module-level function holding a weak reference: parameters must not keep a discarded
    # optimizer alive, and a discarded optimizer's hook must do nothing.
    optimizer = owner()
    if optimizer is not None:
        optimizer._grad_ready(param)


class _DistributedOptimizerMixin(OverlapForwardMixin):
    """The distributed half of a DistributedOptimizer; the wrapped optimizer's class follows it."""

    # -- set-up ----------------------------------------------------------------------------

    def _setup(self, names: Dict[torch.Tensor, str], compression, backward_passes_per_step: int, op: Op,
               gradient_predivide_factor: float, groups: Union[None, int, List[List[torch.Tensor]]],
               sparse_as_dense: bool, process_set: ProcessSet,
               overlap_forward: Optional[torch.nn.Module] = None) -> None:
        # Horovod's map, which scripts read: model names, or allreduce.noname.<group>.<index>.
        self._parameter_names = names
        self._names = {p: f"allreduce.{name}" for p, name in names.items()}  # the collectives' names
        self._compression = compression
        # The built-in 16-bit compressors: results are cast straight back into the gradient.
        self._cast_back = isinstance(compression, type) and issubclass(compression, _CastCompressor)
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        if op == Average:
            # Horovod's split of the average: 1/f before the sum, f/size after (the engine
            # divides by size for Average).
            self._prescale, self._postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
        else:
            self._prescale, self._postscale = 1.0, 1.0
        self._sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._params: List[torch.Tensor] = []
        self._delay: Dict[torch.Tensor, int] = {}
        self._pending: Dict[_Key, _Submitted] = {}
        self._fired = 0  # hook calls since the last synchronize()
        self._sparse_dims: Dict[torch.Tensor, int] = {}  # parameters seen with sparse gradients
        self._group_of: Dict[torch.Tensor, Tuple[torch.Tensor, ...]] = {}
        self._group_ready: Dict[Tuple[torch.Tensor, ...], int] = {}
        self._group_names: Dict[Tuple[torch.Tensor, ...], str] = {}
        self._synchronized = False
        self._should_synchronize = True
        # The global set always contains this rank; asking a sub-set needs a running hpdl.
        self._included = process_set is global_process_set or process_set.included()
        self._ref = weakref.ref(self)
        self._init_overlap_state()
        # The bytes of gradient one step reduces, and those not submitted yet this step: each
        # allreduce tells the engine how many are still to come (engine/scheduling.py, Gathering).
        self._step_bytes = self._bytes_left = 0
        if self._included:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.requires_grad:
                        self._track(p)
            if groups is not None:
                self._make_groups(groups)
            if overlap_forward is not None:
                self._overlap(overlap_forward)

    def _track(self, p: torch.Tensor) -> None:
        self._params.append(p)
        nbytes = p.numel() * p.element_size()
        self._step_bytes += nbytes
        self._bytes_left += nbytes
        self._delay[p] = self.backward_passes_per_step
        previous = getattr(p, _HOOK_ATTR, None)
        if previous is not None:
            previous.remove()
        setattr(p, _HOOK_ATTR, p.register_post_accumulate_grad_hook(functools.partial(_grad_ready, self._ref)))

    def _make_groups(self, groups: Union[int, List[List[torch.Tensor]]]) -> None:
        """Fix the fusion groups; every rank must end up with the same members in the same order."""
        tracked = set(self._params)
        if isinstance(groups, int):
            # Ranks may list parameters in different orders: use rank 0's (as Horovod does).
            from hpdl.torch.functions import broadcast_object

            order = broadcast_object([self._names[p] for p in self._params], root_rank=self._root(),
                                     name="DistributedOptimizer.groups", process_set=self.process_set)
            by_name = {self._names[p]: p for p in self._params}
            if sorted(order) != sorted(by_name):
                raise ValueError("groups: ranks disagree on the set of parameter names")
            ordered = [by_name[n] for n in order]
            d, r = divmod(len(ordered), groups)
            members = [ordered[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(groups)]
        else:
            # Explicit groups: order members by name so that member i is the same tensor everywhere.
            members = [sorted((p for p in group if p in tracked), key=self._names.__getitem__) for group in groups]
        for group in members:
            if len(group) < 2:
                continue  # a group of one is an ordinary allreduce
            key = tuple(group)
            for p in key:
                self._group_of[p] = key
            self._group_ready[key] = 0
            self._group_names[key] = f"allreduce.group.{self._names[key[0]]}"

    def _root(self) -> int:
        return 0 if self.process_set is global_process_set else self.process_set.ranks[0]

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a parameter group; its parameters are reduced under generated names."""
        super().add_param_group(param_group)
        if not hasattr(self, "_names"):  # called before _setup (not by DistributedOptimizer)
            return
        index = len(self.param_groups) - 1
        for j, p in enumerate(self.param_groups[-1]["params"]):
            if p not in self._names:
                self._parameter_names[p] = name = f"allreduce.noname.{index}.{j}"
                self._names[p] = f"allreduce.{name}"
            if self._included and p.requires_grad and p not in self._delay:
                self._track(p)

    # -- the hook path: once per parameter per backward, on the autograd thread -------------

    def _grad_ready(self, p: torch.Tensor) -> None:
        if self._deferred and p in self._deferred:  # overlap_forward: p's update still waits
            self._apply_before_new_gradient(p)
        delay = self._delay[p]
        if delay <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call to step(). "
                "Increase backward_passes_per_step to accumulate gradients locally.")
        self._fired += 1
        self._delay[p] = delay = delay - 1
        if delay:
            return  # accumulating locally: backward_passes_per_step > 1
        group = self._group_of.get(p)
        if group is None:
            self._pending[p] = self._submit(p)
            return
        ready = self._group_ready[group] + 1
        if ready == len(group):
            self._group_ready[group] = 0
            self._pending[group] = self._submit_group(group)
        else:
            self._group_ready[group] = ready

    def _grad_of(self, p: torch.Tensor) -> torch.Tensor:
        grad = p.grad
        if grad is None:
            # This rank did not use p, others may have: contribute zeros so every rank
            # submits the same names (a hang otherwise).
            sparse_dim = self._sparse_dims.get(p)
            if sparse_dim is not None and not self._sparse_as_dense:
                indices = torch.empty((sparse_dim, 0), dtype=torch.int64, device=p.device)
                values = p.new_empty((0,) + tuple(p.shape[sparse_dim:]))
                grad = torch.sparse_coo_tensor(indices, values, p.shape, check_invariants=True)
            else:
                grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            p.grad = grad
        elif grad.is_sparse:
            self._sparse_dims[p] = grad.sparse_dim()
        return grad

    def _submit(self, p: torch.Tensor) -> _Submitted:
        grad = self._grad_of(p)
        name = self._names[p]
        if grad.is_sparse:
            if not self._sparse_as_dense:
                self._submitted((p,), p.element_size())
                return _Submitted(mpi_ops.sparse_allreduce_async(grad, name=name, op=self.op,
                                                                 process_set=self.process_set), (p,), (None,), True)
            grad = grad.to_dense()
        compressed, ctx = self._compression.compress(grad)
        handle = mpi_ops.allreduce_async_(compressed, name=name, op=self.op, prescale_factor=self._prescale,
                                          postscale_factor=self._postscale, process_set=self.process_set,
                                          priority=self._priority.get(p),
                                          bytes_to_come=self._submitted((p,), compressed.element_size()))
        return _Submitted(handle, (p,), (ctx,))

    def _submitted(self, params: Tuple[torch.Tensor, ...], wire_itemsize: int) -> int:
        """Count ``params`` as submitted this step; return the bytes still to come after them,
        as sent (compressed to ``wire_itemsize`` bytes per element, as these were)."""
        left = self._bytes_left = max(0, self._bytes_left - sum(p.numel() * p.element_size() for p in params))
        return left * wire_itemsize // params[0].element_size()

    def _submit_group(self, group: Tuple[torch.Tensor, ...]) -> _Submitted:
        tensors, ctxs = [], []
        for p in group:
            grad = self._grad_of(p)
            if grad.is_sparse:
                if not self._sparse_as_dense:
                    raise ValueError(f"parameter {self._names[p]!r} has a sparse gradient and belongs to a group; "
                                     "groups reduce dense tensors: pass sparse_as_dense=True")
                grad = grad.to_dense()
            compressed, ctx = self._compression.compress(grad)
            tensors.append(compressed)
            ctxs.append(ctx)
        handle = mpi_ops.grouped_allreduce_async_(tensors, name=self._group_names[group], op=self.op,
                                                  prescale_factor=self._prescale, postscale_factor=self._postscale,
                                                  process_set=self.process_set,
                                                  bytes_to_come=self._submitted(group, tensors[0].element_size()))
        return _Submitted(handle, group, tuple(ctxs))

    # -- waiting ---------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce (starting those that never began) and store the results in ``.grad``."""
        if not self._included:
            self._synchronized = True
            return
        if self._deferred:  # the previous step's updates come first
            self._apply_deferred()
        try:
            self._start_unfired()
            # The last-submitted allreduce first: the caller then wakes once, not once per
            # gradient (each wake-up takes a core from transfers still running).
            last = next((s for s in reversed(self._pending.values()) if not s.sparse), None)
            if last is not None:
                mpi_ops.wait_done(last.handle)
            for submitted in self._pending.values():
                self._finish(submitted)
        finally:
            self._reset_pending()
        self._synchronized = True

    def _start_unfired(self) -> None:
        # Gradients whose hook did not fire (unused here, or fewer backward passes than
        # backward_passes_per_step): other ranks may be waiting for them.
        self._track_unfrozen()
        for p in self._params:
            if self._delay[p] > 0:
                group = self._group_of.get(p)
                if group is None:
                    self._pending[p] = self._submit(p)
                elif group not in self._pending:
                    self._pending[group] = self._submit_group(group)

    def _track_unfrozen(self) -> None:
        """Reduce from now on the gradients of parameters that did not require them when the
        optimizer was made and do now (a frozen layer unfrozen for fine-tuning): otherwise
        every rank would step them with its own gradient and the replicas would drift apart
        unnoticed. Every rank must unfreeze the same parameters before the same step."""
        tracked = self._delay
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and p not in tracked:
                    self._track(p)

    def _reset_pending(self) -> None:
        self._pending.clear()
        for p in self._params:
            self._delay[p] = self.backward_passes_per_step
        for group in self._group_ready:
            self._group_ready[group] = 0
        self._fired = 0
        self._bytes_left = self._step_bytes

    def load_state_dict(self, state_dict) -> None:
        """Load a state (a rollback, say) and forget the step in progress, as Horovod: zero_grad()
        and backward work at once. Allreduces already started complete first (with zeros for
        unproduced gradients, as in synchronize()), unused; overlap_forward's pending updates
        are applied first (that step is over; the loaded state replaces its result)."""
        self.apply_pending_updates()
        self._drop_step_in_progress()
        self._synchronized = False
        self._should_synchronize = True
        return super().load_state_dict(state_dict)

    def _drop_step_in_progress(self) -> None:
        if not self._pending:
            self._reset_pending()  # nothing under way: only local accumulation to forget
            return
        try:
            self._start_unfired()
            for submitted in self._pending.values():
                if submitted.sparse:
                    submitted.handle()
                else:
                    mpi_ops.synchronize(submitted.handle)
        finally:
            self._reset_pending()

    def _finish(self, submitted: _Submitted) -> None:
        if submitted.sparse:
            submitted.params[0].grad = submitted.handle()
            return
        outputs = mpi_ops.synchronize(submitted.handle)
        if not isinstance(outputs, list):
            outputs = [outputs]
        for p, output, ctx in zip(submitted.params, outputs, submitted.ctxs):
            grad = p.grad
            if self._cast_back and ctx is not None and not grad.is_sparse and grad.shape == output.shape:
                # The built-in 16-bit compressors: cast straight into the gradient (one pass
                # over it, no float32 copy made first; the same values as decompress()).
                grad.copy_(output)
                continue
            result = self._compression.decompress(output, ctx)
            if result is grad:
                continue  # reduced in place (no compression)
            if grad.is_sparse:
                # sparse_as_dense: as Horovod, the optimizer gets the average as a sparse
                # gradient again (SparseAdam takes no other); with the gradient's own sparse
                # dims, so that an embedding's stays a set of whole rows.
                p.grad = result.to_sparse(grad.sparse_dim())
            elif grad.shape != result.shape:
                p.grad = result
            else:
                grad.copy_(result)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate ``passes`` backward passes locally per allreduce from now on (as Horovod:
        the passes counted since the last allreduce start again from zero)."""
        _check_backward_passes(passes)
        if self._priority and passes != 1:
            raise ValueError("overlap_forward works with backward_passes_per_step=1 only")
        if self._pending:
            raise AssertionError(f"set_backward_passes_per_step({passes}) while {len(self._pending)} allreduces "
                                 "started by backward are pending; call it before backward or after step()")
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this context ``step()`` does not synchronize (call ``synchronize()`` before it)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    # -- the optimizer interface -----------------------------------------------------------

    def step(self, closure=None):
        """Wait for the gradients' allreduces, then step the wrapped optimizer (with
        ``overlap_forward``: leave each update to the next forward of its module)."""
        if self._priority and self._should_synchronize and not self._synchronized and closure is None:
            self._defer()
            runtime.profile_step()
            return None
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")
                # Horovod reduces every gradient again here; the reduced gradients need no
                # second pass (with op=Sum it would even be wrong), only new ones do.
                if self._fired:
                    self.synchronize()
            else:
                self.synchronize()
        self._synchronized = False
        result = super().step(closure)
        runtime.profile_step()  # a step boundary, when profiled
        return result

    # _patch_step_function() (run again by load_state_dict) must not wrap this step in the
    # profiling hooks: the wrapped optimizer's step already runs them, once.
    step.hooked = True  # type: ignore[attr-defined]

    def _local_step(self, closure=None):
        """Step the wrapped optimizer without any allreduce (used to create state before broadcasting it)."""
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients; refuse while allreduces started by backward are still pending."""
        if self._fired:
            in_flight = len(self._pending)
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                f"optimizer.synchronize() ({in_flight} gradient allreduce(s) in flight, {self._fired} gradient(s) "
                "produced since the last step). This is prohibited: the allreduces are reading and writing those "
                "gradients. Call optimizer.step() (or optimizer.synchronize()) first, or zero_grad() before "
                "backward().")
        for p in self._deferred:  # their gradients are still being reduced, or wait for the update
            p.grad = None
        return super().zero_grad(set_to_none)


def _check_backward_passes(passes: Any) -> None:
    if isinstance(passes, bool) or not isinstance(passes, int) or passes <= 0:
        raise ValueError(f"backward_passes_per_step must be an integer > 0, got {passes!r}")


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
    if isinstance(optimizer, _DistributedOptimizerMixin):
        raise ValueError("the optimizer is already a DistributedOptimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    op = mpi_ops.as_op(op)  # Horovod's op numbers too
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise ValueError(f"compression must provide compress() and decompress(), got {compression!r}")
    _check_backward_passes(backward_passes_per_step)
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
        _check_overlap_forward(overlap_forward, backward_passes_per_step, groups, op)
    _check_groups(optimizer, groups)
    names = _named(optimizer, named_parameters)

    mixin = _DistributedOptimizerMixin
    if op == Adasum and process_set.size() > 1:
        if process_set is not global_process_set:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        mpi_ops.check_adasum_ranks(process_set)
        from hpdl.torch.adasum import DistributedAdasumMixin  # it builds on this module

        mixin, groups, sparse_as_dense = DistributedAdasumMixin, None, False  # as Horovod: ignored with Adasum
    cls = _distributed_class(type(optimizer), mixin)
    distributed = cls.__new__(cls)
    # Share the wrapped optimizer's attributes (param_groups, state, defaults, hooks), but not
    # instance-level overrides of our methods, e.g. an LR scheduler's wrapper around step.
    own = set(dir(mixin))
    distributed.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in own})
    distributed._setup(names, compression, backward_passes_per_step, op, float(gradient_predivide_factor),
                       groups, bool(sparse_as_dense), process_set, overlap_forward)
    return distributed
