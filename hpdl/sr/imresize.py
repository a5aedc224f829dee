"""MATLAB's ``imresize`` with the bicubic kernel, in numpy: how the benchmark sets' LR images were made.

Published LR images (Set5, Set14, B100, Urban100, DIV2K's ``LR_bicubic``) come from MATLAB's
``imresize(hr, 1/s, 'bicubic')`` after cropping HR to a multiple of ``s``. Its cubic kernel has
a = -0.5; when shrinking, the kernel is stretched by 1/scale (antialiasing); every output pixel's
weights are normalised to sum to 1; the image is extended by mirroring (``[1..n, n..1]``); the two
dimensions are resized one after the other, rows first when the factors are equal, and an
integer image is rounded (half away from zero) and saturated after each pass, as MATLAB keeps
the input's class between passes. PyTorch's antialiased bicubic uses the same kernel but clamps
at the border instead of mirroring and rounds once, so its LR differs near the borders and by
one level here and there: enough to move a PSNR in the second decimal.
"""

from __future__ import annotations

import math
from typing import Tuple

import numpy as np

__all__ = ["contributions", "cubic", "imresize", "matlab_downscale", "resize_matrix"]


def cubic(x: np.ndarray) -> np.ndarray:
    """Return MATLAB's cubic kernel (Keys, a = -0.5) at ``x``."""
    ax = np.abs(x)
    ax2, ax3 = ax**2, ax**3
    return (1.5 * ax3 - 2.5 * ax2 + 1) * (ax <= 1) + (-0.5 * ax3 + 2.5 * ax2 - 4 * ax + 2) * ((ax > 1) & (ax <= 2))


def contributions(in_length: int, out_length: int, scale: float) -> Tuple[np.ndarray, np.ndarray]:
    """Return MATLAB's ``(weights, indices)`` for one dimension: row k lists output pixel k's inputs.

    Indices are 0-based and already mirrored into ``[0, in_length)``; columns whose weight is
    zero for every output pixel are dropped, as MATLAB drops them.
    """
    kernel_width = 4.0
    if scale < 1:  # antialiasing: a wider, lower kernel
        def kernel(x: np.ndarray) -> np.ndarray:
            return scale * cubic(scale * x)

        kernel_width /= scale
    else:
        kernel = cubic
    x = np.arange(1, out_length + 1, dtype=np.float64)
    u = x / scale + 0.5 * (1 - 1 / scale)  # where output pixel x falls in the input, 1-based
    left = np.floor(u - kernel_width / 2)
    taps = int(math.ceil(kernel_width)) + 2
    indices = left[:, None] + np.arange(taps)[None, :]  # 1-based, may fall outside the image
    weights = kernel(u[:, None] - indices)
    weights /= weights.sum(axis=1, keepdims=True)
    mirror = np.concatenate([np.arange(in_length), np.arange(in_length - 1, -1, -1)])
    indices = mirror[np.mod(indices.astype(np.int64) - 1, len(mirror))]
    used = np.any(weights != 0, axis=0)
    return weights[:, used], indices[:, used]


def resize_matrix(in_length: int, out_length: int, scale: float) -> np.ndarray:
    """Return the ``(out_length, in_length)`` matrix that resizes one dimension as MATLAB does."""
    weights, indices = contributions(in_length, out_length, scale)
    matrix = np.zeros((out_length, in_length))
    np.add.at(matrix, (np.repeat(np.arange(out_length), weights.shape[1]), indices.ravel()), weights.ravel())
    return matrix


def imresize(image: np.ndarray, scale: float) -> np.ndarray:
    """Resize an ``(H, W)`` or ``(H, W, C)`` image by ``scale`` as MATLAB's ``imresize(image, scale)``.

    The output is ``ceil(H * scale) x ceil(W * scale)``. uint8 in, uint8 out (rounded and
    saturated after each pass); any other dtype is computed and returned in float64.
    """
    integer = image.dtype == np.uint8
    out = np.asarray(image, dtype=np.float64)
    for axis in (0, 1):  # equal factors: MATLAB resizes rows first
        n = out.shape[axis]
        # rounded first, so that float error in 1/3 * 3k does not add a pixel
        matrix = resize_matrix(n, int(math.ceil(round(n * scale, 9))), scale)
        out = np.moveaxis(np.tensordot(matrix, np.moveaxis(out, axis, 0), axes=(1, 0)), 0, axis)
        if integer:
            out = np.clip(np.floor(out + 0.5), 0, 255)  # MATLAB's round: half away from zero
    return out.astype(np.uint8) if integer else out


def matlab_downscale(hr: np.ndarray, scale: int) -> np.ndarray:
    """Make the LR image of a uint8 HR image as the benchmarks did: crop to a multiple of ``scale``, then
    ``imresize(hr, 1/scale, 'bicubic')``."""
    h, w = hr.shape[0] // scale, hr.shape[1] // scale
    if h == 0 or w == 0:
        raise ValueError(f"image of {hr.shape[1]}x{hr.shape[0]} is smaller than scale {scale}")
    return imresize(np.ascontiguousarray(hr[: h * scale, : w * scale]), 1.0 / scale)
