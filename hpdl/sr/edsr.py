"""EDSR and EDSR-baseline (Lim et al., CVPRW 2017) for x2, x3 and x4.

Module and parameter names follow EDSR-PyTorch (``head.0``, ``body.{i}.body.{0,2}``,
``body.{B}``, ``tail.0.{0,2}``, ``tail.1``, ``sub_mean``, ``add_mean``), so its published
``.pt`` state dicts load directly. Inputs and outputs are RGB in [0, 255] (``rgb_range`` 255).
"""

from __future__ import annotations

import math
from typing import List, Mapping, Optional

import torch
from torch import nn

from hpdl.sr.registry import ModelConfig, architecture, assumed_res_scale, published_size

__all__ = ["DIV2K_RGB_MEAN", "EDSR", "MeanShift", "build", "config_from_state_dict"]

DIV2K_RGB_MEAN = (0.4488, 0.4371, 0.4040)


def _conv(in_ch: int, out_ch: int) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=True)


class MeanShift(nn.Conv2d):
    """Subtract (sign -1) or add (sign +1) the DIV2K mean: a frozen 1x1 conv, std 1."""

    def __init__(self, rgb_range: float, sign: int) -> None:
        super().__init__(3, 3, kernel_size=1)
        with torch.no_grad():
            self.weight.copy_(torch.eye(3).view(3, 3, 1, 1))
            self.bias.copy_(sign * rgb_range * torch.tensor(DIV2K_RGB_MEAN))
        self.requires_grad_(False)


class ResBlock(nn.Module):
    """conv-ReLU-conv without batch norm; returns ``x + res_scale * body(x)``."""

    def __init__(self, n_feats: int, res_scale: float) -> None:
        super().__init__()
        self.body = nn.Sequential(_conv(n_feats, n_feats), nn.ReLU(inplace=True), _conv(n_feats, n_feats))
        self.res_scale = res_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) * self.res_scale


class Upsampler(nn.Sequential):
    """Sub-pixel upsampling: n x [conv F->4F, PixelShuffle(2)] for 2^n, conv F->9F + shuffle(3) for 3."""

    def __init__(self, scale: int, n_feats: int) -> None:
        layers: List[nn.Module] = []
        if scale == 3:
            layers += [_conv(n_feats, 9 * n_feats), nn.PixelShuffle(3)]
        elif scale & (scale - 1) == 0:
            for _ in range(int(math.log2(scale))):
                layers += [_conv(n_feats, 4 * n_feats), nn.PixelShuffle(2)]
        else:
            raise ValueError(f"unsupported scale {scale}")
        super().__init__(*layers)


class EDSR(nn.Module):
    """Enhanced Deep Residual network for single-image super-resolution."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.scale = config.scale
        f = config.n_feats
        # Registration order is the forward order: receptive_field_radius() relies on it.
        self.sub_mean = MeanShift(config.rgb_range, sign=-1)
        self.head = nn.Sequential(_conv(3, f))
        self.body = nn.Sequential(
            *[ResBlock(f, config.res_scale) for _ in range(config.n_resblocks)], _conv(f, f)
        )
        self.tail = nn.Sequential(Upsampler(config.scale, f), _conv(f, 3))
        self.add_mean = MeanShift(config.rgb_range, sign=+1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Upscale a batch ``(N, 3, H, W)`` in [0, 255] to ``(N, 3, sH, sW)``."""
        x = self.head(self.sub_mean(x))
        x = x + self.body(x)  # the long skip from the head output
        return self.add_mean(self.tail(x))


def build(config: ModelConfig) -> EDSR:
    """Build the EDSR network ``config`` describes."""
    return EDSR(config)


def config_from_state_dict(sd: Mapping[str, torch.Tensor]) -> Optional[ModelConfig]:
    """Infer the EDSR architecture of a state dict (EDSR-PyTorch's keys) from its tensor shapes.

    ``res_scale`` cannot be seen in weights: it is taken from the published model of that size
    (1.0 for other sizes; ``registry.with_res_scale`` says so or sets another). None if the keys
    are not EDSR's.
    """
    try:
        feats = int(sd["head.0.weight"].shape[0])
        blocks = 0
        while f"body.{blocks}.body.0.weight" in sd:
            blocks += 1
        first = int(sd["tail.0.0.weight"].shape[0])
    except (KeyError, AttributeError, IndexError):
        return None
    if first == 9 * feats:
        scale = 3
    else:
        scale = 2 ** sum(1 for k in sd if k.startswith("tail.0.") and k.endswith(".weight"))
    if scale not in architecture("edsr").scales:
        return None
    size = published_size("edsr", blocks, feats)
    return ModelConfig(size.name if size is not None else "edsr_custom", scale, blocks, feats,
                       assumed_res_scale("edsr", blocks, feats))
