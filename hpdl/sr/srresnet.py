"""SRResNet without batch norm (MSRResNet; Ledig et al., CVPR 2017, as modified by Wang et al.'s
ESRGAN and trained in BasicSR) for x2, x3 and x4.

The network EDSR's paper compares against: a first conv, residual blocks (conv-ReLU-conv, no
batch norm, no residual scaling, no conv after the body), sub-pixel upsampling with leaky ReLUs,
two convs at the output resolution, and the bilinear upscaled input added at the end, so the
network learns the residual over bilinear. Parameter names are BasicSR's (``conv_first``,
``body.{i}.conv1/conv2``, ``upconv1``, ``upconv2``, ``conv_hr``, ``conv_last``); inputs and
outputs are RGB in [0, 255], as for EDSR (BasicSR's network works on [0, 1]). Weights start
from PyTorch's default initialisation, as EDSR's do: BasicSR's, scaled down by 10, leaves the
residual branch near zero for longer than a short run lasts.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hpdl.sr.registry import SIZES, ModelConfig

__all__ = ["SRResNet", "build", "config_from_state_dict"]


def _conv(in_ch: int, out_ch: int) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=True)


class ResidualBlockNoBN(nn.Module):
    """conv-ReLU-conv; returns ``x + body(x)``."""

    def __init__(self, n_feats: int) -> None:
        super().__init__()
        self.conv1 = _conv(n_feats, n_feats)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv(n_feats, n_feats)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.relu(self.conv1(x)))


class SRResNet(nn.Module):
    """SRResNet (MSRResNet) for single-image super-resolution."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.scale = s = config.scale
        f = config.n_feats
        self.rgb_range = config.rgb_range
        # Registration order is the forward order: receptive_field_radius() relies on it.
        self.conv_first = _conv(3, f)
        self.body = nn.Sequential(*[ResidualBlockNoBN(f) for _ in range(config.n_resblocks)])
        if s == 4:
            self.upconv1, self.shuffle1 = _conv(f, 4 * f), nn.PixelShuffle(2)
            self.upconv2, self.shuffle2 = _conv(f, 4 * f), nn.PixelShuffle(2)
        else:
            self.upconv1, self.shuffle1 = _conv(f, s * s * f), nn.PixelShuffle(s)
        self.conv_hr = _conv(f, f)
        self.conv_last = _conv(f, 3)
        self.lrelu = nn.LeakyReLU(0.1, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Upscale a batch ``(N, 3, H, W)`` in [0, 255] to ``(N, 3, sH, sW)``."""
        x = x / self.rgb_range
        out = self.body(self.lrelu(self.conv_first(x)))
        out = self.lrelu(self.shuffle1(self.upconv1(out)))
        if self.scale == 4:
            out = self.lrelu(self.shuffle2(self.upconv2(out)))
        out = self.conv_last(self.lrelu(self.conv_hr(out)))
        base = F.interpolate(x, scale_factor=self.scale, mode="bilinear", align_corners=False)
        return (out + base) * self.rgb_range


def build(config: ModelConfig) -> SRResNet:
    """Build the SRResNet ``config`` describes."""
    return SRResNet(config)


def config_from_state_dict(sd: Mapping[str, torch.Tensor]) -> Optional[ModelConfig]:
    """Infer the SRResNet of a state dict (BasicSR's MSRResNet keys) from its shapes; None if not one."""
    try:
        feats = int(sd["conv_first.weight"].shape[0])
        up = int(sd["upconv1.weight"].shape[0])
        if "conv_hr.weight" not in sd:
            return None
    except (KeyError, AttributeError, IndexError):
        return None
    blocks = 0
    while f"body.{blocks}.conv1.weight" in sd:
        blocks += 1
    scale = 4 if "upconv2.weight" in sd else {4 * feats: 2, 9 * feats: 3}.get(up)
    if scale is None:
        return None
    size = SIZES["srresnet"]
    name = size.name if (blocks, feats) == (size.n_resblocks, size.n_feats) else "srresnet_custom"
    return ModelConfig(name, scale, blocks, feats, 1.0, arch="srresnet")
