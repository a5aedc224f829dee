"""The 8 dihedral transforms of an image (flips and transpose), for augmentation and EDSR+.

Transform ``k`` in 0..7 applies, in order: a horizontal flip if bit 0 is set, a vertical flip
if bit 1 is set, a transpose if bit 2 is set. Training applies the same ``k`` to the LR and HR
patch, which keeps them aligned because each operation commutes with downscaling by an integer
factor. Self-ensemble applies ``k`` to the input and ``inverse`` to the output.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["NUM_DIHEDRAL", "dihedral_array", "dihedral_tensor", "inverse_dihedral_tensor"]

NUM_DIHEDRAL = 8


def _check(k: int) -> None:
    if not 0 <= k < NUM_DIHEDRAL:
        raise ValueError(f"dihedral transform index must be in 0..7, got {k}")


def dihedral_array(image: np.ndarray, k: int) -> np.ndarray:
    """Apply transform ``k`` to an ``(H, W, C)`` array (returns a view where possible)."""
    _check(k)
    if k & 1:
        image = image[:, ::-1]
    if k & 2:
        image = image[::-1]
    if k & 4:
        image = image.transpose(1, 0, *range(2, image.ndim))
    return image


def dihedral_tensor(x: torch.Tensor, k: int) -> torch.Tensor:
    """Apply transform ``k`` to the last two (H, W) dimensions of a tensor."""
    _check(k)
    if k & 1:
        x = x.flip(-1)
    if k & 2:
        x = x.flip(-2)
    if k & 4:
        x = x.transpose(-1, -2)
    return x


def inverse_dihedral_tensor(x: torch.Tensor, k: int) -> torch.Tensor:
    """Undo ``dihedral_tensor(., k)``: each step is its own inverse, so undo them in reverse."""
    _check(k)
    if k & 4:
        x = x.transpose(-1, -2)
    if k & 2:
        x = x.flip(-2)
    if k & 1:
        x = x.flip(-1)
    return x
