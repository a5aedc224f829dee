"""The arithmetic of batch normalization over data spread across ranks, shared by
``hvd.SyncBatchNorm`` (a batch split over ranks) and spatial parallelism (images split over ranks).

Each rank computes its share's per-channel count, mean and sum of squared deviations; gathered
from every rank they combine exactly (Chan et al.'s parallel variance) into the statistics of
the whole, whatever each rank's share. Backward needs two per-channel sums over the whole (of
the output gradient, and of it times the normalized input). Plain tensor operations, so the
same code runs on CPU and GPU.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The type statistics are kept in: 16-bit inputs keep theirs in float32, as cuDNN's batch norm does."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def channel_view(stat: torch.Tensor, dims: int) -> torch.Tensor:
    """Shape a per-channel vector to broadcast against an (N, C, ...) tensor."""
    return stat.view((1, -1) + (1,) * (dims - 2))


def reduce_dims(x: torch.Tensor) -> List[int]:
    """Every dimension but the channels'."""
    return [0] + list(range(2, x.dim()))


def local_moments(x: torch.Tensor) -> torch.Tensor:
    """This rank's ``[count, mean per channel, sum of squared deviations per channel]`` as one row."""
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    if count:
        mean = x.mean(reduce_dims(x))
        m2 = (x - channel_view(mean, x.dim())).square().sum(reduce_dims(x))
    else:  # an empty share contributes nothing
        mean = m2 = x.new_zeros(channels)
    return torch.cat([x.new_tensor([float(count)]), mean, m2]).unsqueeze(0)


def combine_moments(rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The count, per-channel mean and sum of squared deviations of the whole, from every rank's
    :func:`local_moments` row (stacked)."""
    channels = (rows.shape[1] - 1) // 2
    counts, means, m2s = rows[:, :1], rows[:, 1:channels + 1], rows[:, channels + 1:]
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    m2 = m2s.sum(0) + (counts * (means - mean).square()).sum(0)
    return total, mean, m2


def update_running(running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], mean: torch.Tensor,
                   m2: torch.Tensor, total: torch.Tensor, momentum: float) -> None:
    """Running statistics as ``nn.BatchNorm`` keeps them: the mean, and the unbiased variance."""
    if running_mean is None:
        return
    running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
    running_var.mul_(1 - momentum).add_((m2 / (total - 1)).to(running_var.dtype), alpha=momentum)


def gradient_sums(dy: torch.Tensor, normalized: torch.Tensor) -> torch.Tensor:
    """This rank's per-channel sums of ``dy`` and of ``dy * normalized``, as one vector (to be summed over ranks)."""
    dims = reduce_dims(dy)
    return torch.cat([dy.sum(dims), (dy * normalized).sum(dims)])


def input_gradient(dy: torch.Tensor, normalized: torch.Tensor, sums: torch.Tensor, total: torch.Tensor,
                   invstd: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.Tensor:
    """The input's gradient from the whole's :func:`gradient_sums`."""
    channels, dims = invstd.numel(), dy.dim()
    mean_dy, mean_dy_xhat = sums[:channels] / total, sums[channels:] / total
    scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
    return (dy - channel_view(mean_dy, dims) - normalized * channel_view(mean_dy_xhat, dims)) * channel_view(scale, dims)
