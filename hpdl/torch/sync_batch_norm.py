"""SyncBatchNorm: batch normalization over the whole batch of a process set, on CPU or GPU.

Each rank computes its batch's per-channel count, mean and sum of squared deviations; an
allgather gives every rank every rank's, which combine exactly (Chan et al.'s parallel
variance) into the statistics of the concatenated batch, whatever each rank's batch size.
Backward needs two per-channel sums over the whole batch (of the output gradient, and of it
times the normalized input): one allreduce. The weight and bias gradients stay local, as
Horovod's: DistributedOptimizer averages them with the other gradients. Plain tensor
operations throughout, so the same code runs on CPU (PyTorch's own ``nn.SyncBatchNorm``
needs CUDA kernels) and on GPU.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

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


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    # 16-bit inputs keep their statistics in float32, as cuDNN's batch norm does.
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _channel_view(stat: torch.Tensor, dims: int) -> torch.Tensor:
    """Shape a per-channel vector to broadcast against an (N, C, ...) tensor."""
    return stat.view((1, -1) + (1,) * (dims - 2))


def _global_moments(x: torch.Tensor, process_set: ProcessSet) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The count, per-channel mean and sum of squared deviations of every member's ``x`` together."""
    channels = x.shape[1]
    reduce_dims: List[int] = [0] + list(range(2, x.dim()))
    count = x.numel() // channels
    if count:
        mean = x.mean(reduce_dims)
        m2 = (x - _channel_view(mean, x.dim())).square().sum(reduce_dims)
    else:  # an empty batch on this rank contributes nothing
        mean = m2 = x.new_zeros(channels)
    local = torch.cat([x.new_tensor([float(count)]), mean, m2]).unsqueeze(0)
    gathered = synchronize(allgather_async(local, process_set=process_set))
    counts, means, m2s = gathered[:, :1], gathered[:, 1:channels + 1], gathered[:, channels + 1:]
    total = counts.sum()
    global_mean = (counts * means).sum(0) / total
    global_m2 = m2s.sum(0) + (counts * (means - global_mean).square()).sum(0)
    return total, global_mean, global_m2


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, process_set):
        x = input.to(_stat_dtype(input.dtype))
        total, mean, m2 = _global_moments(x, process_set)
        if total.item() <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {list(input.shape)} "
                             "on this rank and a batch of one value per channel over the process set")
        invstd = torch.rsqrt(m2 / total + eps)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            unbiased = m2 / (total - 1)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        normalized = (x - _channel_view(mean, x.dim())) * _channel_view(invstd, x.dim())
        out = normalized
        if weight is not None:
            out = normalized * _channel_view(weight.to(x.dtype), x.dim()) + _channel_view(bias.to(x.dtype), x.dim())
        ctx.save_for_backward(normalized, invstd, weight)
        ctx.total, ctx.process_set = total, process_set
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        normalized, invstd, weight = ctx.saved_tensors
        dims = normalized.dim()
        reduce_dims = [0] + list(range(2, dims))
        dy = grad_output.to(normalized.dtype)
        sum_dy = dy.sum(reduce_dims)
        sum_dy_xhat = (dy * normalized).sum(reduce_dims)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            channels = sum_dy.numel()
            sums = synchronize(allreduce_async(torch.cat([sum_dy, sum_dy_xhat]), op=Sum,
                                               process_set=ctx.process_set))
            mean_dy, mean_dy_xhat = sums[:channels] / ctx.total, sums[channels:] / ctx.total
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            grad_input = (dy - _channel_view(mean_dy, dims) - normalized * _channel_view(mean_dy_xhat, dims)) \
                * _channel_view(scale, dims)
            grad_input = grad_input.to(grad_output.dtype)
        if weight is not None:
            grad_weight = sum_dy_xhat.to(weight.dtype) if ctx.needs_input_grad[1] else None
            grad_bias = sum_dy.to(weight.dtype) if ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None
