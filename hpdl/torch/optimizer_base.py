"""The distributed half of every DistributedOptimizer: gradient hooks, allreduces, waiting.

Each parameter gets a post-accumulate-grad hook. When autograd has finished a parameter's
gradient the hook starts its allreduce at once, so communication overlaps the rest of
backward; ``step()`` waits for the allreduces (``synchronize()``) and then runs the wrapped
optimizer's own ``step()``. Behaviour follows Horovod 0.28's ``horovod/torch/optimizer.py``.

:class:`DistributedOptimizerMixin` is the base its forms build on: overlap.py's
(``overlap_forward=model``) and adasum.py's (``op=Adasum``); optimizer.py's
``DistributedOptimizer`` puts the chosen one in front of the wrapped optimizer's class.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from hpdl.engine import HorovodInternalError, Op
from hpdl.engine.errors import NegotiationError
from hpdl.torch import mpi_ops, runtime
from hpdl.torch.compression import CastCompressor
from hpdl.torch.mpi_ops import Average
from hpdl.torch.object_ops import broadcast_object
from hpdl.torch.process_sets import ProcessSet, global_process_set

__all__ = ["DistributedOptimizerMixin", "Submitted", "check_backward_passes", "local_step"]

# A parameter's gradient is reduced by at most one DistributedOptimizer: the newest one to
# wrap it. The hook handle lives on the parameter so that wrapping a model again (a new
# optimizer after a restart, say) replaces the old hook instead of reducing twice.
_HOOK_ATTR = "_hpdl_grad_hook"

_Key = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


class Submitted:
    """One started allreduce: a parameter's (or a group's), with what is needed to finish it."""

    __slots__ = ("handle", "params", "ctxs", "sparse", "grads", "inplace", "versions")

    def __init__(self, handle: Any, params: Tuple[torch.Tensor, ...], ctxs: Tuple[Any, ...], sparse: bool = False,
                 inplace: Optional[Tuple[bool, ...]] = None):
        """``inplace``: for each gradient, whether its allreduce writes into its memory (through
        an alias, ``grad.data``, whose writes leave the gradient's version alone); given, the
        gradients' versions now are kept, and finishing refuses a gradient changed since."""
        self.handle = handle  # an AsyncHandle, or for sparse gradients a callable giving the result
        self.params = params
        self.ctxs = ctxs
        self.sparse = sparse
        self.grads = tuple(p.grad for p in params)  # where the results go, even after zero_grad()
        self.inplace = inplace
        self.versions = tuple(g._version for g in self.grads) if inplace is not None else None


def _grad_ready(owner: "weakref.ReferenceType", param: torch.Tensor) -> None:
    # A module-level function holding a weak reference: parameters must not keep a discarded
    # optimizer alive, and a discarded optimizer's hook must do nothing.
    optimizer = owner()
    if optimizer is not None:
        optimizer._grad_ready(param)


class DistributedOptimizerMixin:
    """The distributed half of a DistributedOptimizer; the wrapped optimizer's class follows it."""

    # -- set-up ----------------------------------------------------------------------------

    def _setup(self, names: Dict[torch.Tensor, str], compression, backward_passes_per_step: int, op: Op,
               gradient_predivide_factor: float, groups: Union[None, int, List[List[torch.Tensor]]],
               sparse_as_dense: bool, process_set: ProcessSet) -> None:
        # Horovod's map, which scripts read: model names, or allreduce.noname.<group>.<index>.
        self._parameter_names = names
        self._names = {p: f"allreduce.{name}" for p, name in names.items()}  # the collectives' names
        self._compression = compression
        # The built-in 16-bit compressors: results are cast straight back into the gradient.
        self._cast_back = isinstance(compression, type) and issubclass(compression, CastCompressor)
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
        self._pending: Dict[_Key, Submitted] = {}
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
        # The engine priority of each parameter's allreduce (none: in submission order);
        # overlap_forward gives them the model's order.
        self._priority: Dict[torch.Tensor, int] = {}
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

    def _submit(self, p: torch.Tensor) -> Submitted:
        grad = self._grad_of(p)
        name = self._names[p]
        if grad.is_sparse:
            if not self._sparse_as_dense:
                self._submitted((p,), p.element_size())
                return Submitted(mpi_ops.sparse_allreduce_async(grad, name=name, op=self.op,
                                                                 process_set=self.process_set), (p,), (None,), True)
            grad = grad.to_dense()
        compressed, ctx = self._compression.compress(grad)
        inplace = compressed is p.grad  # reduced in the gradient's own memory (not a dense or compressed copy)
        handle = mpi_ops.allreduce_async_(compressed.data if inplace else compressed, name=name, op=self.op,
                                          prescale_factor=self._prescale, postscale_factor=self._postscale,
                                          process_set=self.process_set, priority=self._priority.get(p),
                                          bytes_to_come=self._submitted((p,), compressed.element_size()))
        return Submitted(handle, (p,), (ctx,), inplace=(inplace,))

    def _submitted(self, params: Tuple[torch.Tensor, ...], wire_itemsize: int) -> int:
        """Count ``params`` as submitted this step; return the bytes still to come after them,
        as sent (compressed to ``wire_itemsize`` bytes per element, as these were)."""
        left = self._bytes_left = max(0, self._bytes_left - sum(p.numel() * p.element_size() for p in params))
        return left * wire_itemsize // params[0].element_size()

    def _submit_group(self, group: Tuple[torch.Tensor, ...]) -> Submitted:
        tensors, ctxs, inplace = [], [], []
        for p in group:
            grad = self._grad_of(p)
            if grad.is_sparse:
                if not self._sparse_as_dense:
                    raise ValueError(f"parameter {self._names[p]!r} has a sparse gradient and belongs to a group; "
                                     "groups reduce dense tensors: pass sparse_as_dense=True")
                grad = grad.to_dense()
            compressed, ctx = self._compression.compress(grad)
            inplace.append(compressed is p.grad)
            tensors.append(compressed.data if inplace[-1] else compressed)
            ctxs.append(ctx)
        handle = mpi_ops.grouped_allreduce_async_(tensors, name=self._group_names[group], op=self.op,
                                                  prescale_factor=self._prescale, postscale_factor=self._postscale,
                                                  process_set=self.process_set,
                                                  bytes_to_come=self._submitted(group, tensors[0].element_size()))
        return Submitted(handle, group, tuple(ctxs), inplace=tuple(inplace))

    # -- waiting ---------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce (starting those that never began) and store the results in ``.grad``."""
        if not self._included:
            self._synchronized = True
            return
        self.apply_pending_updates()  # the previous step's updates come first
        try:
            self._start_unfired()
            self._refuse_changed_gradients(list(self._pending.values()))
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
            # A failure of the world under the step being dropped (hvd.elastic.run's rollback
            # after a lost rank) is not raised: its results were to be discarded anyway, and
            # raised here, from inside the rollback, it would escape the recovery and end this
            # worker as well.
            for submitted in self._pending.values():
                _wait_quietly(submitted)
        except HorovodInternalError:
            pass  # from _start_unfired's submissions, for the same reason
        finally:
            self._reset_pending()

    def _finish(self, submitted: Submitted) -> None:
        try:
            if submitted.sparse:
                submitted.params[0].grad = submitted.handle()
                return
            outputs = mpi_ops.synchronize(submitted.handle)
        except NegotiationError as err:
            advice = _sparse_advice(err)
            if advice is None:
                raise
            raise err.with_advice(advice) from None
        if not isinstance(outputs, list):
            outputs = [outputs]
        for index, (p, output, ctx) in enumerate(zip(submitted.params, outputs, submitted.ctxs)):
            grad = p.grad
            if submitted.inplace is not None and submitted.inplace[index]:
                continue  # reduced in place, in the gradient's memory
            if self._cast_back and ctx is not None and not grad.is_sparse and grad.shape == output.shape:
                # The built-in 16-bit compressors: cast straight into the gradient (one pass
                # over it, no float32 copy made first; the same values as decompress()).
                grad.copy_(output)
                continue
            result = self._compression.decompress(output, ctx)
            if result is grad:
                continue  # reduced in place (a compressor returning the gradient itself)
            if grad.is_sparse:
                # sparse_as_dense: as Horovod, the optimizer gets the average as a sparse
                # gradient again (SparseAdam takes no other); with the gradient's own sparse
                # dims, so that an embedding's stays a set of whole rows.
                p.grad = result.to_sparse(grad.sparse_dim())
            elif grad.shape != result.shape:
                p.grad = result
            else:
                grad.copy_(result)

    def _refuse_changed_gradients(self, started: List[Submitted], unfinished: Optional[List[Submitted]] = None,
                                  replaced: bool = True) -> None:
        """Refuse gradients changed, or replaced, between backward() and their average (their
        allreduces ``started``): an allreduce reads and writes a gradient in place while the
        caller runs on, so a change made meanwhile (clipping, scaling) is averaged in part or
        overwritten, differently from run to run, and one process's training is not what comes
        out. The allreduces complete first (``unfinished``, default ``started``), their results
        unused: the optimizer can go on. ``replaced``: a ``.grad`` that is no longer the one
        reduced (set anew, or to None) is refused too (not where the optimizer's own zero_grad
        has let go of it: overlap_forward's deferred updates)."""
        changed = next((p for submitted in started if submitted.versions is not None
                        for p, grad, version in zip(submitted.params, submitted.grads, submitted.versions)
                        if grad._version != version or (replaced and p.grad is not grad)), None)
        if changed is None:
            return
        for submitted in unfinished if unfinished is not None else started:
            _wait_quietly(submitted)
        name = self._parameter_names.get(changed, "?")
        raise RuntimeError(
                    f"the gradient of parameter {name!r} was changed after backward() and before the optimizer averaged it "
                    "(gradient clipping, unscaling or scaling in place, or a new .grad): hvd.DistributedOptimizer "
                    "averages the gradients in step(), in place, and a change made before that is averaged in part "
                    "or lost, differently from run to run. Average them first, then change them: "
                    "optimizer.synchronize(); torch.nn.utils.clip_grad_norm_(...); "
                    "with optimizer.skip_synchronize(): optimizer.step()")

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate ``passes`` backward passes locally per allreduce from now on (as Horovod:
        the passes counted since the last allreduce start again from zero)."""
        check_backward_passes(passes)
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
        """Wait for the gradients' allreduces, then step the wrapped optimizer."""
        if self._should_synchronize and not self._synchronized and self._fired and _stepped_by_a_grad_scaler():
            self._drop_step_in_progress()  # completed, unused: the optimizer can go on
            raise RuntimeError(
                "GradScaler.step(optimizer) unscaled the gradients in place while hvd.DistributedOptimizer was still "
                "averaging them (a change made meanwhile is averaged in part or lost, differently from run to run): "
                "average them first: optimizer.synchronize(); scaler.unscale_(optimizer); "
                "with optimizer.skip_synchronize(): scaler.step(optimizer)")
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
        return super().zero_grad(set_to_none)

    def apply_pending_updates(self) -> None:
        """Apply every update still waiting for a forward: nothing here; with ``overlap_forward``,
        what ``step()`` left to the next forward (overlap.py)."""


def _wait_quietly(submitted: Submitted) -> None:
    """Wait for a started allreduce whose result goes unused; its failure is not the error."""
    try:
        if submitted.sparse:
            submitted.handle()
        else:
            mpi_ops.synchronize(submitted.handle)
    except HorovodInternalError:
        pass


def _stepped_by_a_grad_scaler() -> bool:
    """Whether the caller of step() is torch.amp.GradScaler's step, after it unscaled the
    gradients (or found them unscaled). Its unscaling kernel leaves the gradients' version
    counters alone, so the check of changed gradients (_refuse_changed_gradients) cannot see it."""
    caller = sys._getframe(2).f_code  # step() is called by GradScaler._maybe_opt_step
    return caller.co_name == "_maybe_opt_step" and caller.co_filename.replace("\\", "/").endswith("amp/grad_scaler.py")


def _sparse_advice(err: NegotiationError) -> Optional[str]:
    """What to change when the ranks disagree on a gradient that DistributedOptimizer gathers
    sparse on some of them (the engine's error names only the operations), or None."""
    if "allgather" not in err.kinds:
        return None
    if "allreduce" in err.kinds:
        # A rank that produced no gradient for the parameter cannot know it would be sparse:
        # it reduces zeros densely.
        return ("(for a DistributedOptimizer parameter: its gradient is sparse on some ranks and was not "
                "produced on the others, which reduce zeros densely; pass sparse_as_dense=True)")
    if err.joined:  # only allreduce runs after a join
        return "(DistributedOptimizer: pass sparse_as_dense=True for sparse gradients)"
    return None


def check_backward_passes(passes: Any) -> None:
    """Refuse a ``backward_passes_per_step`` that is not a whole number > 0."""
    if isinstance(passes, bool) or not isinstance(passes, int) or passes <= 0:
        raise ValueError(f"backward_passes_per_step must be an integer > 0, got {passes!r}")


def local_step(optimizer: torch.optim.Optimizer) -> Any:
    """Step ``optimizer`` on this rank alone: a DistributedOptimizer's wrapped optimizer, without
    any allreduce (to create its state before broadcasting it); any other optimizer, its own step()."""
    if isinstance(optimizer, DistributedOptimizerMixin):
        return optimizer._local_step()
    return optimizer.step()
