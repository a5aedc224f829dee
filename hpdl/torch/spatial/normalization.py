"""Normalization of a CNN's spatial part, with the statistics one process takes of the whole
image: batch norm over the batch and every part, group and instance norm over each sample's
groups of channels and every part (batch norm of the map seen as (1, samples x groups, the
rest)). Every part's count, mean and sum of squared deviations is gathered and combined exactly
(batch_norm_stats.py, shared with ``hvd.SyncBatchNorm``); backward sums two vectors over the
group. The affine parameters' gradients are each part's share, summed over the group by the
optimizer (parallel.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from hpdl.torch import batch_norm_stats as stats
from hpdl.torch.spatial.comm import refuse_graph_in_backward
from hpdl.torch.spatial.context import Context
from hpdl.torch.spatial.parts import part_of, tagged


class SpatialBatchNorm(torch.autograd.Function):
    """Batch normalization with the statistics of the whole image (all of the group's parts).

    Keeps its input, not the normalized result, for backward (as PyTorch's own batch norm),
    so that the activations are not held twice."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, comm, label):
        xs = x.to(stats.stat_dtype(x.dtype))
        rows = comm.allgather(stats.local_moments(xs), [1] * comm.size, label)
        total, mean, m2 = stats.combine_moments(rows)
        if total.item() <= 1:
            raise ValueError(f"{label}: expected more than 1 value per channel when training, got "
                             f"{int(total.item())} over the whole image")
        invstd = torch.rsqrt(m2 / total + eps)
        stats.update_running(running_mean, running_var, mean, m2, total, momentum)
        dims = xs.dim()
        out = (xs - stats.channel_view(mean, dims)) * stats.channel_view(invstd, dims)
        if weight is not None:
            out = out * stats.channel_view(weight.to(xs.dtype), dims) + stats.channel_view(bias.to(xs.dtype), dims)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total, ctx.comm, ctx.label = total, comm, label
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        refuse_graph_in_backward(ctx.label)
        x, weight, mean, invstd = ctx.saved_tensors
        xs = x.to(stats.stat_dtype(x.dtype))
        dims = xs.dim()
        normalized = (xs - stats.channel_view(mean, dims)) * stats.channel_view(invstd, dims)
        dy = grad_output.to(xs.dtype)
        local_sums = stats.gradient_sums(dy, normalized)
        channels = invstd.numel()
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            sums = ctx.comm.allreduce_sum(local_sums.clone(), ctx.label)
            grad_input = stats.input_gradient(dy, normalized, sums, ctx.total, invstd, weight).to(grad_output.dtype)
        if weight is not None:  # this part's share; summed over the group by the optimizer (see parallel.py)
            grad_weight = local_sums[channels:].to(weight.dtype) if ctx.needs_input_grad[1] else None
            grad_bias = local_sums[:channels].to(weight.dtype) if ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def batch_norm(ctx: Context, func, a: dict):
    x, running_mean, running_var = a["input"], a["running_mean"], a["running_var"]
    weight, bias = a.get("weight"), a.get("bias")
    training, momentum, eps = a.get("training", False), a.get("momentum", 0.1), a.get("eps", 1e-5)
    part = part_of(x)
    if not training:  # running statistics: the same affine map on every pixel
        return tagged(F.batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps), part)
    if ctx.dry:
        return tagged(torch.empty_like(x), part)
    if ctx.recomputing:  # the forward already moved them
        running_mean = running_var = None
    out = SpatialBatchNorm.apply(x, weight, bias, running_mean, running_var, momentum, eps, ctx.comm, ctx.label())
    return tagged(out, part)


def group_norm(ctx: Context, func, a: dict):
    """Group normalization: each sample's groups of channels over all of its pixels (every
    part), as one process computes them."""
    return _per_sample_norm(ctx, a["input"], int(a["num_groups"]), a.get("weight"), a.get("bias"), a.get("eps", 1e-5))


def instance_norm(ctx: Context, func, a: dict):
    """Instance normalization: each sample's channels over all of its pixels (every part); with
    running statistics, kept as one process keeps them (the mean over the batch of each
    sample's), and in eval mode the same affine map on every pixel."""
    x, running_mean, running_var = a["input"], a.get("running_mean"), a.get("running_var")
    weight, bias, momentum, eps = a.get("weight"), a.get("bias"), a.get("momentum", 0.1), a.get("eps", 1e-5)
    if not a.get("use_input_stats", True):
        return tagged(F.instance_norm(x, running_mean, running_var, weight, bias, False, momentum, eps), part_of(x))
    if running_mean is not None and not ctx.dry and not ctx.recomputing:
        _update_instance_running(ctx, x, running_mean, running_var, momentum)
    return _per_sample_norm(ctx, x, x.shape[1], weight, bias, eps)


def _per_sample_norm(ctx: Context, x: torch.Tensor, groups: int, weight: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """``x`` (N, C, ...) normalized over each sample's ``groups`` of channels and every pixel of
    the whole image, then the per-channel affine map. It is batch normalization of ``x`` seen as
    (1, N * groups, the rest), whose channels are the samples' groups: :class:`SpatialBatchNorm`
    without running statistics, exact over the group's parts in forward and backward."""
    part = part_of(x)
    n, c = x.shape[:2]
    if groups < 1 or c % groups:
        raise ValueError(f"{ctx.where()}: expected the number of channels, {c}, to be divisible by num_groups, "
                         f"{groups}")
    if ctx.dry:
        return tagged(torch.empty_like(x), part)
    out = SpatialBatchNorm.apply(x.reshape(1, n * groups, -1), None, None, None, None, 0.0, eps, ctx.comm,
                                 ctx.label()).reshape(x.shape)
    affine = (1, c) + (1,) * (x.dim() - 2)
    if weight is not None:
        out = out * weight.reshape(affine)
    if bias is not None:
        out = out + bias.reshape(affine)
    return tagged(out, part)


def _update_instance_running(ctx: Context, x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                             momentum: float) -> None:
    """Instance norm's running statistics as PyTorch keeps them: each sample's mean and unbiased
    variance over the whole image, averaged over the batch, into a moving average."""
    n, c = x.shape[:2]
    xs = x.detach().reshape(1, n * c, -1).to(stats.stat_dtype(x.dtype))
    total, mean, m2 = stats.combine_moments(ctx.comm.allgather(stats.local_moments(xs), [1] * ctx.comm.size,
                                                               ctx.label()))
    running_mean.mul_(1 - momentum).add_(mean.view(n, c).mean(0).to(running_mean.dtype), alpha=momentum)
    running_var.mul_(1 - momentum).add_((m2 / (total - 1)).view(n, c).mean(0).to(running_var.dtype), alpha=momentum)
