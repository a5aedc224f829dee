"""Gradients scaled on their way back, the forward unchanged.

The optimizer averages gradients over all ranks, but a spatial group's parts together make one
sample: the dispatcher scales the gradient of each parameter a call on a part reads by the
group's size (Context.grad_scale), so that the average sums over the group; SpatialParallel
weighs an output's gradient by the part's share of the loss (parallel.py).
"""

from __future__ import annotations

import torch
from torch import nn


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, factor):
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_gradient(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor`` unchanged, with its gradient multiplied by ``factor`` on the way back."""
    return _ScaleGradient.apply(tensor, factor) if factor != 1.0 and tensor.requires_grad else tensor


def scale_parameters(args, kwargs, factor: float):
    """``args`` and ``kwargs`` with every parameter that requires a gradient scaled on its way
    back by ``factor``."""
    def scaled(value):
        if isinstance(value, nn.Parameter) and value.requires_grad:
            return _ScaleGradient.apply(value, factor)
        if isinstance(value, (list, tuple)) and any(isinstance(v, nn.Parameter) for v in value):
            return type(value)(scaled(v) for v in value)
        return value

    if not any(isinstance(a, (nn.Parameter, list, tuple)) for a in args) and \
            not any(isinstance(v, nn.Parameter) for v in kwargs.values()):
        return args, kwargs
    return tuple(scaled(a) for a in args), {k: scaled(v) for k, v in kwargs.items()}
