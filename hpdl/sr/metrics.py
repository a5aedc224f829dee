"""PSNR and SSIM as super-resolution papers measure them, plus the bicubic baseline.

Conventions (EDSR-PyTorch ``utility.calc_psnr``, BasicSR ``psnr_ssim.py``): the output is
quantised to 8-bit levels first; benchmark sets are measured on the BT.601 luma
``Y = 16 + (65.738 R + 129.057 G + 25.064 B) / 256`` with a border of ``scale`` pixels shaved;
DIV2K validation is measured on RGB with ``scale + 6`` shaved. SSIM follows Wang et al.'s
MATLAB code: 11x11 Gaussian window, sigma 1.5, valid region only, C1 = (0.01 * 255)^2,
C2 = (0.03 * 255)^2; on RGB it is the mean over the three channels. All arithmetic is float64.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = [
    "SPACES",
    "bicubic_upscale",
    "default_shave",
    "min_measurable_side",
    "psnr",
    "quantize",
    "rgb_to_y",
    "ssim",
]

SPACES = ("y", "rgb")
_Y_WEIGHTS = (65.738 / 256, 129.057 / 256, 25.064 / 256)
SSIM_WINDOW = 11  # side of the Gaussian window
_C1 = (0.01 * 255) ** 2
_C2 = (0.03 * 255) ** 2


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest 8-bit level and clamp to [0, 255] (dtype is kept)."""
    return x.clamp(0, 255).round()


def rgb_to_y(x: torch.Tensor) -> torch.Tensor:
    """Convert ``(..., 3, H, W)`` RGB in [0, 255] to ``(..., 1, H, W)`` BT.601 luma (not rounded)."""
    w = torch.tensor(_Y_WEIGHTS, dtype=x.dtype, device=x.device).view(3, 1, 1)
    return 16.0 + (x * w).sum(dim=-3, keepdim=True)


def default_shave(scale: int, space: str) -> int:
    """Return the border the conventions shave: ``scale`` on Y, ``scale + 6`` on RGB (DIV2K)."""
    _check_space(space)
    return scale if space == "y" else scale + 6


def min_measurable_side(scale: int, space: str) -> int:
    """Return the smallest HR side (after cropping to a multiple of ``scale``) that PSNR and SSIM can
    measure in ``space``: the shaved borders, and the SSIM window inside them."""
    return 2 * default_shave(scale, space) + SSIM_WINDOW


def _check_space(space: str) -> None:
    if space not in SPACES:
        raise ValueError(f"metric space must be 'y' or 'rgb', got {space!r}")


def _prepare(
    sr: torch.Tensor, hr: torch.Tensor, scale: int, space: str, shave: Optional[int]
) -> Tuple[torch.Tensor, torch.Tensor]:
    _check_space(space)
    if sr.dim() == 4:
        sr, hr = sr.squeeze(0), hr.squeeze(0)
    if sr.shape != hr.shape or sr.dim() != 3 or sr.shape[0] != 3:
        raise ValueError(f"expected two (3, H, W) images of one size, got {tuple(sr.shape)} and {tuple(hr.shape)}")
    sr = quantize(sr.detach().to("cpu", torch.float64))
    hr = quantize(hr.detach().to("cpu", torch.float64))
    if space == "y":
        sr, hr = rgb_to_y(sr), rgb_to_y(hr)
    b = default_shave(scale, space) if shave is None else shave
    if b > 0:
        if 2 * b >= sr.shape[-1] or 2 * b >= sr.shape[-2]:
            raise ValueError(f"image {tuple(sr.shape[-2:])} too small to shave {b} pixels")
        sr, hr = sr[..., b:-b, b:-b], hr[..., b:-b, b:-b]
    return sr, hr


def psnr(
    sr: torch.Tensor, hr: torch.Tensor, scale: int, space: str = "y", shave: Optional[int] = None
) -> float:
    """Return the PSNR in dB of ``sr`` against ``hr`` (``(3, H, W)`` in [0, 255]); inf if equal."""
    sr, hr = _prepare(sr, hr, scale, space, shave)
    mse = torch.mean((sr - hr) ** 2).item()
    return math.inf if mse == 0 else 10.0 * math.log10(255.0**2 / mse)


def _gaussian_window(size: int = SSIM_WINDOW, sigma: float = 1.5) -> torch.Tensor:
    r = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(r**2) / (2 * sigma**2))
    g = g / g.sum()
    return torch.outer(g, g).view(1, 1, size, size)


def ssim(
    sr: torch.Tensor, hr: torch.Tensor, scale: int, space: str = "y", shave: Optional[int] = None
) -> float:
    """Return the SSIM of ``sr`` against ``hr`` (Wang et al.; mean over channels on RGB)."""
    sr, hr = _prepare(sr, hr, scale, space, shave)
    if min(sr.shape[-2:]) < SSIM_WINDOW:
        raise ValueError(f"image {tuple(sr.shape[-2:])} is smaller than the {SSIM_WINDOW}x{SSIM_WINDOW} SSIM window")
    # Each channel is an image of its own: (C, H, W) -> (C, 1, H, W); valid convolution.
    x, y = sr.unsqueeze(1), hr.unsqueeze(1)
    w = _gaussian_window()
    mu_x, mu_y = F.conv2d(x, w), F.conv2d(y, w)
    var_x = F.conv2d(x * x, w) - mu_x**2
    var_y = F.conv2d(y * y, w) - mu_y**2
    cov = F.conv2d(x * y, w) - mu_x * mu_y
    num = (2 * mu_x * mu_y + _C1) * (2 * cov + _C2)
    den = (mu_x**2 + mu_y**2 + _C1) * (var_x + var_y + _C2)
    return (num / den).mean(dim=(1, 2, 3)).mean().item()


def bicubic_upscale(lr: torch.Tensor, scale: int) -> torch.Tensor:
    """Upscale ``(3, h, w)`` or ``(N, 3, h, w)`` by bicubic interpolation to ``scale`` x the size.

    Published bicubic baselines use MATLAB ``imresize``, whose cubic kernel has a = -0.5.
    PyTorch's plain bicubic uses a = -0.75; its ``antialias=True`` path uses a = -0.5 (as PIL
    does), and when enlarging antialiasing changes nothing else, so that path is the one taken.
    """
    batch = lr.unsqueeze(0) if lr.dim() == 3 else lr
    out = F.interpolate(batch.float(), scale_factor=scale, mode="bicubic", align_corners=False, antialias=True)
    return out.squeeze(0) if lr.dim() == 3 else out
