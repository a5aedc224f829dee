"""Inference on images of any size: exact overlapping tiles, and the x8 self-ensemble (EDSR+).

EDSR-PyTorch's ``--chop`` splits into quadrants with a 10 px overlap, smaller than the
receptive field (36 LR px for EDSR-baseline), so its stitched output differs from a whole-image
pass near the seams. Here each tile is extended on every side by at least the receptive-field
radius (``models.receptive_field_radius``) and only its inner part is kept: every kept output
pixel then sees exactly the input it would see in a whole-image pass, zero padding included
(a tile's margin stops at the image border, where the whole image is padded too). That is what
"exact" means here, with memory bounded by the tile size; it is not bit-identical. The
convolution kernels (oneDNN on CPU, cuDNN on CUDA) choose their loop blocking by the extent of
their input, so a tile's sums are added in another order than the whole image's: float32
outputs differ by rounding (about 1e-4 of a level at most), and after rounding to 8 bits a
value that close to a rounding boundary comes out one level apart. PyTorch's own convolution
(im2col and a matrix product) gave bit-identical tiles at every extent tried, at about three
times the time (docs/perf-notes/upscale.md, "Tiled upscaling and float rounding"), so the fast
kernels stay.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from hpdl.sr.metrics import bicubic_upscale, quantize
from hpdl.sr.models import receptive_field_radius
from hpdl.sr.transforms import NUM_DIHEDRAL, dihedral_tensor, inverse_dihedral_tensor

__all__ = ["DEFAULT_TILE", "PROGRESS_DELAY", "Tile", "as_image", "forward_tiled", "image_forward", "run_tile",
           "self_ensemble", "tile_progress", "tile_rows", "upscale", "upscale_alpha", "upscale_image"]

DEFAULT_TILE = 256
# LR pixels on each side that the bicubic kernel (a = -0.5, 4 taps) reaches when enlarging, plus one.
BICUBIC_MARGIN = 3
PROGRESS_DELAY = 3.0  # seconds of upscaling before its bar appears on a terminal: short runs stay quiet

Forward = Callable[[torch.Tensor], torch.Tensor]
Box = Tuple[int, int, int, int]  # y0, y1, x0, x1


def _device_of(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _on_device(model: nn.Module) -> Forward:
    device = _device_of(model)
    return lambda x: model(x.to(device=device, dtype=torch.float32).contiguous()).to(x.device)


@dataclasses.dataclass(frozen=True)
class Tile:
    """One tile of an image, in LR pixels: ``box``, the part whose output it gives, and
    ``window``, what the model sees: the box extended by the margin on every side, up to the
    image border (where a whole-image pass pads with zeros too)."""

    box: Box
    window: Box


def tile_rows(h: int, w: int, tile: int, margin: int) -> List[List[Tile]]:
    """The tiles of an ``h`` x ``w`` image, row of tiles by row of tiles, each left to right:
    the order in which they are computed. Every path that upscales in tiles takes them from
    here, so the same options give the same boxes and windows, hence the same bytes."""
    rows = []
    for y0 in range(0, h, tile):
        row = []
        for x0 in range(0, w, tile):
            y1, x1 = min(y0 + tile, h), min(x0 + tile, w)
            row.append(Tile((y0, y1, x0, x1), (max(y0 - margin, 0), min(y1 + margin, h),
                                               max(x0 - margin, 0), min(x1 + margin, w))))
        rows.append(row)
    return rows


def run_tile(forward: Forward, lr: torch.Tensor, tile: Tile, first_row: int = 0) -> Tuple[int, torch.Tensor]:
    """Return ``(scale, output of the tile's box)``: ``forward`` on the tile's window of ``lr``
    (``(..., rows, W)``, image rows from ``first_row`` on: all of them, or the rows one rank holds)."""
    ya, yb, xa, xb = tile.window
    piece = forward(lr[..., ya - first_row : yb - first_row, xa:xb])
    s = piece.shape[-1] // (xb - xa)  # the model's scale, read off its output
    y0, y1, x0, x1 = tile.box
    return s, piece[..., (y0 - ya) * s : (y1 - ya) * s, (x0 - xa) * s : (x1 - xa) * s]


def _tiles(forward: Forward, lr: torch.Tensor, tile: int, margin: int) -> Iterator[Tuple[int, Box, torch.Tensor]]:
    """Yield ``(scale, tile box in LR pixels, output of the tile)`` for every tile of ``lr`` (``(..., H, W)``)."""
    for row in tile_rows(lr.shape[-2], lr.shape[-1], tile, margin):
        for t in row:
            s, piece = run_tile(forward, lr, t)
            yield s, t.box, piece


def forward_tiled(
    model: nn.Module, lr: torch.Tensor, tile: int = DEFAULT_TILE, overlap: Optional[int] = None
) -> torch.Tensor:
    """Run ``model`` on ``(N, 3, H, W)`` in ``tile`` x ``tile`` pieces and stitch the output.

    Args:
        tile: side of the part of each tile that is kept, in LR pixels; the model sees up to
            ``tile + 2 * overlap`` pixels a side, which bounds memory.
        overlap: margin around each tile; default (and minimum for an exact result, up to
            float rounding) is the model's receptive-field radius.
    """
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    margin = receptive_field_radius(model) if overlap is None else int(overlap)
    forward = _on_device(model)
    _, _, h, w = lr.shape
    if h <= tile and w <= tile:
        return forward(lr)
    out: Optional[torch.Tensor] = None
    for s, (y0, y1, x0, x1), piece in _tiles(forward, lr, tile, margin):
        if out is None:
            out = lr.new_empty(lr.shape[0], piece.shape[1], h * s, w * s, dtype=piece.dtype)
        out[:, :, y0 * s : y1 * s, x0 * s : x1 * s] = piece
    assert out is not None
    return out


def self_ensemble(forward: Forward, lr: torch.Tensor) -> torch.Tensor:
    """Average ``forward`` over the 8 flips/transposes of ``lr``, each mapped back (EDSR+)."""
    total: Optional[torch.Tensor] = None
    for k in range(NUM_DIHEDRAL):
        out = inverse_dihedral_tensor(forward(dihedral_tensor(lr, k).contiguous()), k)
        total = out if total is None else total + out
    assert total is not None
    return total / NUM_DIHEDRAL


@torch.no_grad()
def upscale(
    model: nn.Module,
    lr: torch.Tensor,
    *,
    tile: Optional[int] = None,
    overlap: Optional[int] = None,
    ensemble: bool = False,
) -> torch.Tensor:
    """Super-resolve ``(3, h, w)`` or ``(N, 3, h, w)`` in [0, 255]; float output, not quantised.

    ``tile=None`` runs the whole image at once; ``ensemble=True`` is the x8 self-ensemble.
    """
    batch = lr.unsqueeze(0) if lr.dim() == 3 else lr
    if tile is None:
        forward = _on_device(model)
    else:

        def forward(x: torch.Tensor) -> torch.Tensor:
            return forward_tiled(model, x, tile, overlap)

    out = self_ensemble(forward, batch) if ensemble else forward(batch)
    return out.squeeze(0) if lr.dim() == 3 else out


def image_forward(model: nn.Module, ensemble: bool = False) -> Forward:
    """The function a tile of an image goes through: the model on its device, or the x8 self-ensemble of it."""
    on_device = _on_device(model)
    return (lambda x: self_ensemble(on_device, x)) if ensemble else on_device


def as_image(lr: torch.Tensor) -> np.ndarray:
    """An image's output ``(1, 3, sh, sw)`` in float, quantised to a uint8 ``(sh, sw, 3)`` array."""
    return quantize(lr[0]).to(torch.uint8).permute(1, 2, 0).numpy()


@torch.no_grad()
def upscale_image(
    model: nn.Module,
    image: np.ndarray,
    *,
    tile: Optional[int] = DEFAULT_TILE,
    ensemble: bool = False,
    progress: bool = False,
) -> np.ndarray:
    """Super-resolve a uint8 ``(h, w, 3)`` image to a uint8 ``(sh, sw, 3)`` image.

    The output is assembled tile by tile in uint8, and only one tile at a time is in float, so
    memory is about the output's uint8 size whatever the image. The self-ensemble runs per
    tile, which is as exact as tiling itself (a flip or transpose maps the image border onto
    the border). ``progress`` shows a bar over the tiles once ``PROGRESS_DELAY`` has passed
    (``hpdl.sr.progress``'s rule: later and rarely where stderr is not a terminal).
    """
    h, w = image.shape[:2]
    lr = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).unsqueeze(0)  # a uint8 view
    tile = tile or max(h, w)
    out: Optional[np.ndarray] = None
    tiles = _tiles(image_forward(model, ensemble), lr, tile, receptive_field_radius(model))
    with tile_progress(-(-h // tile) * -(-w // tile), progress) as bar:
        for s, (y0, y1, x0, x1), piece in tiles:
            if out is None:
                out = np.empty((h * s, w * s, 3), dtype=np.uint8)
            out[y0 * s : y1 * s, x0 * s : x1 * s] = as_image(piece)
            bar.update(1)
    assert out is not None
    return out


@torch.no_grad()
def upscale_alpha(alpha: np.ndarray, scale: int, *, tile: Optional[int] = DEFAULT_TILE) -> np.ndarray:
    """Enlarge a uint8 ``(h, w)`` alpha channel ``scale`` times by bicubic interpolation, to uint8.

    The networks learnt colours, not transparency; bicubic keeps the mask's edges smooth, and
    away from them opaque stays opaque and transparent transparent. Run in tiles as ``upscale_image``, which is
    exact as the kernel reaches less than ``BICUBIC_MARGIN`` pixels beyond a tile.
    """
    h, w = alpha.shape
    plane = torch.from_numpy(np.ascontiguousarray(alpha))[None, None]
    tile = tile or max(h, w)
    out = np.empty((h * scale, w * scale), dtype=np.uint8)
    for s, (y0, y1, x0, x1), piece in _tiles(lambda x: bicubic_upscale(x, scale), plane, tile, BICUBIC_MARGIN):
        out[y0 * s : y1 * s, x0 * s : x1 * s] = quantize(piece[0, 0]).to(torch.uint8).numpy()
    return out


def tile_progress(total: int, enabled: bool) -> Any:
    """The bar over an upscale's tiles (``bar.update(n)``), drawn once ``PROGRESS_DELAY`` has passed;
    ``enabled=False`` draws none."""
    from hpdl.sr.progress import progress_bar

    return progress_bar(total=total, desc="upscale", unit="tile", delay=PROGRESS_DELAY, enabled=enabled)
