"""DistributedOptimizer with ``op=Adasum``: as Horovod, combine the ranks' updates, not their gradients.

When a parameter's gradient is ready, the wrapped optimizer steps that parameter alone, from
a saved copy of its value; the update (new value - old value) is what Adasum combines across
ranks (hpdl/engine/adasum.py), and ``step()`` sets every parameter to its old value plus the
combined update. Adasum so sees each rank's update as its optimizer shaped it (Adam's
normalised step, say), which is what its combination rule is made for.
"""

from __future__ import annotations

import torch

from hpdl.torch import mpi_ops, runtime
from hpdl.torch.mpi_ops import Adasum
from hpdl.torch.optimizer_base import DistributedOptimizerMixin, Submitted


class DistributedAdasumMixin(DistributedOptimizerMixin):
    """The distributed half of a DistributedOptimizer with op=Adasum; the wrapped optimizer's class follows it."""

    def _setup(self, *args, **kwargs) -> None:
        self._starting_models = {}  # parameter -> its value before this step's local update
        super()._setup(*args, **kwargs)

    def _track(self, p: torch.Tensor) -> None:
        super()._track(p)
        self._starting_models[p] = torch.zeros_like(p, requires_grad=False)

    def _submit(self, p: torch.Tensor) -> Submitted:
        self._grad_of(p)  # zeros where this rank did not use p: every rank must submit its update
        start = self._starting_models[p]
        start.copy_(p.data)
        self._step_only(p)
        # .data: autograd may still hold p for the rest of backward; this rewrite is not part of it.
        update = p.data.sub_(start)
        compressed, ctx = self._compression.compress(update)
        handle = mpi_ops.allreduce_async_(compressed, name=self._names[p], op=Adasum)
        return Submitted(handle, (p,), (ctx,))

    def _step_only(self, p: torch.Tensor) -> None:
        """Step the wrapped optimizer on ``p`` alone."""
        stashed = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [p] if any(q is p for q in group["params"]) else []
            self._local_step()
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params

    def _finish(self, submitted: Submitted) -> None:
        p = submitted.params[0]
        combined = self._compression.decompress(mpi_ops.synchronize(submitted.handle), submitted.ctxs[0])
        start = self._starting_models[p]
        start.add_(combined)
        p.data.copy_(start)

    def step(self, closure=None):
        """Step the parameters whose gradient never arrived, then apply the combined updates."""
        loss = closure() if closure is not None else None
        if self._fired or not self._synchronized:
            self.synchronize()
        self._synchronized = False
        runtime.profile_step()  # a step boundary, when profiled
        return loss

    step.hooked = True  # type: ignore[attr-defined]  # see DistributedOptimizerMixin.step
