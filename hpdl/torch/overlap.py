"""DistributedOptimizer with ``overlap_forward=model``: each update waits for the forward that needs it.

With ``overlap_forward=model`` (hpdl's own), ``step()`` does not wait: each parameter's update
is applied just before the next forward reaches its module (a forward pre-hook), once that
parameter's allreduce is done, and the allreduces start in the order the forward needs them
(engine priorities). The exchange of the last gradients then overlaps the next forward and the
update, where a network slower than the compute makes the exchange the longer part of a step.
Pending updates are also applied by ``state_dict()`` and at ``hvd.shutdown()``; the model keeps
its optimizer alive for that, and shutdown waits for the allreduces of an optimizer that is
gone with its model, which the other ranks still take part in.

``OverlapForwardMixin`` is the distributed half of such an optimizer: the plain one
(optimizer_base.py) with its updates deferred; the hooks and the shutdown handler here are
module-level functions holding the optimizer weakly, so that neither the model nor the runtime
keeps it alive by them.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from hpdl.engine import Op
from hpdl.torch import mpi_ops, runtime
from hpdl.torch.mpi_ops import Adasum
from hpdl.torch.optimizer_base import DistributedOptimizerMixin, Submitted, check_backward_passes

__all__ = ["OverlapForwardMixin", "check_overlap_forward"]


def _before_forward(owner: "weakref.ReferenceType", params: Tuple[torch.Tensor, ...], module, args) -> None:
    # overlap_forward: a module's parameters get their pending update before it runs. Never
    # compiled (see _overlap): under torch.compile the hook would be traced once, when nothing
    # was pending, and the graph would then run without it (updates lagging a step, silently);
    # disabled, it runs eagerly at every call, between the compiled graph's pieces.
    optimizer = owner()
    if optimizer is not None and optimizer._deferred:
        optimizer._apply_deferred(params)


def _before_gradient(owner: "weakref.ReferenceType", param_ref: "weakref.ReferenceType", grad: torch.Tensor) -> None:
    # overlap_forward: a parameter's hook that runs before a new gradient accumulates into its
    # .grad, which, while the parameter's update is deferred, is the buffer its allreduce is
    # still writing into (the engine reduces in place). After the accumulation (the optimizer's
    # other hook) would be too late: the sum would race the allreduce, differently on each rank.
    optimizer, param = owner(), param_ref()
    if optimizer is not None and param is not None and optimizer._deferred and param in optimizer._deferred:
        optimizer._before_new_gradient(param)


def _remove_hooks(handles: List[Any]) -> None:
    for handle in handles:
        handle.remove()


def _before_state_dict(owner: "weakref.ReferenceType", *args) -> None:
    optimizer = owner()
    if optimizer is not None and optimizer._deferred:
        optimizer._apply_deferred()


# overlap_forward: a model keeps alive the optimizer whose updates its forward applies, so that
# a caller who lets the optimizer go and goes on with the model still gets the last step's
# updates (the model's hooks hold the optimizer weakly). The optimizer holds no reference to
# the model, so the entry goes when the model does.
_OVERLAP_OWNERS: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()

# overlap_forward: the allreduces of optimizers collected while their last step's gradients were
# still being reduced (model and optimizer both gone, e.g. a training function that returned).
# The peers still submit those gradients: shutdown waits for them first, or a rank that got
# there first would stop every engine while a slower peer still submits (its backward fails).
_ORPHANED: set = set()


def _adopt_orphans(deferred: Dict[torch.Tensor, Submitted]) -> None:
    # A finalizer of the optimizer (weakref.finalize): runs when it is collected.
    for submitted in deferred.values():
        if isinstance(submitted.handle, mpi_ops.AsyncHandle):
            for handle in submitted.handle.handles:
                if not handle.poll():
                    _ORPHANED.add(handle)
                    handle.add_done_callback(_ORPHANED.discard)  # from the engine thread
    deferred.clear()


def _wait_for_orphans() -> None:
    for handle in list(_ORPHANED):
        handle.wait_done()  # a failure is not raised here: nobody wants these results any more
    _ORPHANED.clear()


# overlap_forward: the optimizers whose last updates shutdown() applies, in the order they were
# made (weakly: neither this list nor the runtime keeps an optimizer alive).
_LIVE: List["weakref.ReferenceType"] = []


def _finish_at_shutdown() -> None:
    # overlap_forward, before the engines stop: the allreduces of optimizers gone with their
    # model, then the last step's updates of the others. A rank that finished its loop first
    # would otherwise stop every engine while a slower rank still submits its last gradients
    # (its step() does not wait for theirs).
    _wait_for_orphans()
    for owner in list(_LIVE):
        optimizer = owner()
        if optimizer is not None:
            optimizer.apply_pending_updates()


SKIPPED_HOOKS = ("overlap_forward: the model's forward ran without hpdl's forward hooks (a torch.compile'd graph "
                 "that skipped them?), on weights a step old; compile without overlap_forward, or call "
                 "optimizer.apply_pending_updates() before each forward")


def check_overlap_forward(model: Any, backward_passes_per_step: int, groups: Any, op: Op) -> None:
    """DistributedOptimizer's checks of ``overlap_forward`` and the options it excludes."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"overlap_forward takes the model (a torch.nn.Module), got {type(model).__name__}")
    if backward_passes_per_step != 1 or groups or op == Adasum:
        raise ValueError("overlap_forward works with backward_passes_per_step=1, no groups and op Average or Sum")


class OverlapForwardMixin(DistributedOptimizerMixin):
    """The distributed half of a DistributedOptimizer with overlap_forward: deferred updates and the model's hooks."""

    def _setup(self, *args: Any, overlap_forward: torch.nn.Module, **kwargs: Any) -> None:
        # The parameters whose update waits for the next forward.
        self._deferred: Dict[torch.Tensor, Submitted] = {}
        # The param groups' settings (lr, ...) when step() deferred: an lr scheduler stepped
        # right after step() must not change the update being deferred.
        self._deferred_settings: List[Dict[str, Any]] = []
        self._overlap_hooks: List[Any] = []
        self._warned_tied = False
        super()._setup(*args, **kwargs)
        if self._included:
            self._overlap(overlap_forward)

    def _overlap(self, model: torch.nn.Module) -> None:
        """Hook ``model`` so that updates wait for the forward that needs them, and give each
        allreduce the place its parameter has in the model (the order the forward needs them
        in, the same on every rank)."""
        tracked = set(self._params)
        self._priority = {p: i for i, p in enumerate(p for p in model.parameters() if p in tracked)}
        if not self._priority:
            raise ValueError("overlap_forward: the model has none of the optimizer's parameters")
        for module in model.modules():
            own = tuple(p for p in module.parameters(recurse=False) if p in tracked)
            if own:
                # torch.compiler.disable here, not at import: it imports torch._dynamo (slow,
                # and memory every rank would carry without overlap_forward).
                self._overlap_hooks.append(module.register_forward_pre_hook(
                    torch.compiler.disable(functools.partial(_before_forward, self._ref, own))))
        self._overlap_hooks.append(model.register_state_dict_pre_hook(functools.partial(_before_state_dict, self._ref)))
        # Loading the model (a rollback) comes after the last step: its updates first, then
        # the loaded values over them (never the updates over the loaded values).
        self._overlap_hooks.append(model.register_load_state_dict_pre_hook(
            functools.partial(_before_state_dict, self._ref)))
        # On the parameters themselves, apart from the model's hooks: compiling a model keeps them.
        gradient_hooks = [p.register_hook(functools.partial(_before_gradient, self._ref, weakref.ref(p)))
                          for p in self._priority]
        # Gone with the optimizer: no backward of the model pays for them after it.
        weakref.finalize(self, _remove_hooks, gradient_hooks).atexit = False
        _OVERLAP_OWNERS[model] = self
        # The same dict for the optimizer's whole life (_defer fills it in place), so that the
        # finalizer sees what is deferred when the optimizer goes.
        weakref.finalize(self, _adopt_orphans, self._deferred).atexit = False
        _LIVE[:] = [owner for owner in _LIVE if owner() is not None]  # drop those of optimizers gone since
        _LIVE.append(self._ref)
        runtime.add_shutdown_hook(_finish_at_shutdown, runtime.ShutdownStage.FINISH_WORK)

    def _before_new_gradient(self, p: torch.Tensor) -> None:
        """A new gradient of ``p`` is about to accumulate while ``p``'s update still waits."""
        if len(self._deferred) == len(self._priority):
            # Not one module's hook ran since the last step, yet a new gradient came: the
            # forward ran without the hooks (a torch.compile'd graph that kept none of them)
            # on weights a step old. Every rank sees the same, and refuses alike, before the
            # gradient touches what the allreduces still write.
            raise RuntimeError(SKIPPED_HOOKS)
        self._apply_before_new_gradient(p)

    def _apply_before_new_gradient(self, p: torch.Tensor) -> None:
        # p's module never ran its forward since the step that deferred p's update: p was
        # used elsewhere (a tied weight) with the previous values. Update it now, before its
        # new allreduce.
        if not self._warned_tied:
            self._warned_tied = True
            warnings.warn(f"overlap_forward: parameter {self._parameter_names.get(p, '?')!r} was used "
                          "outside its own module's forward, before its update; updates of such "
                          "parameters lag a step. Use overlap_forward only when every parameter is used "
                          "by the module that owns it.")
        self._apply_deferred((p,))

    def _defer(self) -> None:
        """overlap_forward's step(): leave the updates to the next forward."""
        if self._deferred:  # parameters the last forward did not use: update them now
            self._apply_deferred()
        try:
            self._start_unfired()
            self._deferred.update((submitted.params[0], submitted) for submitted in self._pending.values())
            self._deferred_settings = [{k: v for k, v in group.items() if k != "params"}
                                       for group in self.param_groups]
        finally:
            self._reset_pending()

    def _apply_deferred(self, params: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Wait for the allreduces of ``params`` (default: all deferred) and update them."""
        deferred = self._deferred
        chosen = [p for p in (params if params is not None else list(deferred)) if p in deferred]
        if not chosen:
            return
        try:
            self._refuse_changed_gradients([deferred[p] for p in chosen], unfinished=list(deferred.values()),
                                           replaced=False)
        except RuntimeError:
            deferred.clear()  # their allreduces completed, their results unused
            raise
        kept = []
        for p in chosen:
            submitted = deferred.pop(p)
            kept.append(p.grad)
            p.grad = submitted.grads[0]  # zero_grad() may have dropped it since
            self._finish(submitted)
        members = set(chosen)
        saved = [dict(group) for group in self.param_groups]
        try:
            for group, settings in zip(self.param_groups, self._deferred_settings):
                group.update(settings)
                group["params"] = [q for q in group["params"] if q in members]
            self._local_step()
        finally:
            for group, before in zip(self.param_groups, saved):
                group.clear()
                group.update(before)
            for p, grad in zip(chosen, kept):
                p.grad = grad

    def apply_pending_updates(self) -> None:
        """overlap_forward: apply every update still waiting for a forward (done for you by the
        model's forward and ``state_dict()``, and by this optimizer's ``state_dict()``)."""
        if self._deferred:
            self._apply_deferred()

    def state_dict(self):
        self.apply_pending_updates()
        return super().state_dict()

    def step(self, closure=None):
        """Leave each update to the next forward of its module (after synchronize(), or with a
        closure: wait and step now, as without overlap_forward)."""
        if self._priority and self._should_synchronize and not self._synchronized and closure is None:
            self._defer()
            runtime.profile_step()
            return None
        return super().step(closure)

    step.hooked = True  # type: ignore[attr-defined]  # see DistributedOptimizerMixin.step

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self._fired:  # else the base refuses, changing nothing
            for p in self._deferred:  # their gradients are still being reduced, or wait for the update
                p.grad = None
        return super().zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        check_backward_passes(passes)
        if self._priority and passes != 1:
            raise ValueError("overlap_forward works with backward_passes_per_step=1 only")
        super().set_backward_passes_per_step(passes)
