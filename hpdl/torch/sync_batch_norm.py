"""SyncBatchNorm: batch normalization over the whole batch of a process set, on CPU or GPU.

An allgather of every rank's per-channel moments gives the statistics of the concatenated
batch, whatever each rank's batch size; backward's two per-channel sums take one allreduce
(the arithmetic: batch_norm_stats.py). The weight and bias gradients stay local, as Horovod's:
DistributedOptimizer averages them with the other gradients. Plain tensor operations
throughout, so the same code runs on CPU (PyTorch's own ``nn.SyncBatchNorm`` needs CUDA
kernels) and on GPU.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from hpdl.torch import batch_norm_stats as stats
from hpdl.torch.mpi_ops import Sum, allgather_async, allreduce_async, synchronize
from hpdl.torch.process_sets import ProcessSet, global_process_set

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """A drop-in for ``nn.BatchNorm1d/2d/3d`` whose training statistics span every rank of ``process_set``.

    In training (and in eval without running statistics) every member must call forward and
    backward together; in eval with running statistics each rank normalizes on its own.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_set: ProcessSet = global_process_set,
                 device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input`` (N, C, ...) by the statistics of the process set's whole batch."""
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps)
        factor = 0.0
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            # momentum=None: a cumulative average, as nn.BatchNorm.
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        running = self.training and self.track_running_stats
        return _SyncBatchNorm.apply(input, self.weight, self.bias, self.running_mean if running else None,
                                    self.running_var if running else None, self.eps, factor, self.process_set)


def _global_moments(x: torch.Tensor, process_set: ProcessSet) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The count, per-channel mean and sum of squared deviations of every member's ``x`` together."""
    return stats.combine_moments(synchronize(allgather_async(stats.local_moments(x), process_set=process_set)))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, process_set):
        x = input.to(stats.stat_dtype(input.dtype))
        total, mean, m2 = _global_moments(x, process_set)
        if total.item() <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {list(input.shape)} "
                             "on this rank and a batch of one value per channel over the process set")
        invstd = torch.rsqrt(m2 / total + eps)
        stats.update_running(running_mean, running_var, mean, m2, total, momentum)
        normalized = (x - stats.channel_view(mean, x.dim())) * stats.channel_view(invstd, x.dim())
        out = normalized
        if weight is not None:
            out = normalized * stats.channel_view(weight.to(x.dtype), x.dim()) \
                + stats.channel_view(bias.to(x.dtype), x.dim())
        ctx.save_for_backward(normalized, invstd, weight)
        ctx.total, ctx.process_set = total, process_set
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        normalized, invstd, weight = ctx.saved_tensors
        dy = grad_output.to(normalized.dtype)
        local_sums = stats.gradient_sums(dy, normalized)
        channels = invstd.numel()
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            sums = synchronize(allreduce_async(local_sums, op=Sum, process_set=ctx.process_set))
            grad_input = stats.input_gradient(dy, normalized, sums, ctx.total, invstd, weight).to(grad_output.dtype)
        if weight is not None:
            grad_weight = local_sums[channels:].to(weight.dtype) if ctx.needs_input_grad[1] else None
            grad_bias = local_sums[:channels].to(weight.dtype) if ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None
