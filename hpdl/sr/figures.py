"""What a person looks at rather than reads: sample grids (LR / bicubic / SR / HR) and training curves.

A sample is a centre crop of a validation image. The model runs on the LR crop extended by its
receptive-field radius and only the inner part is kept, so the SR crop is the crop of a
whole-image pass (up to float rounding, as ``hpdl.sr.inference`` says), at the cost of the crop alone.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from hpdl.atomic_file import atomic_write
from hpdl.sr.metrics import bicubic_upscale, quantize
from hpdl.sr.models import receptive_field_radius
from hpdl.sr.inference import upscale

__all__ = ["COLUMNS", "GAP", "LABEL_HEIGHT", "SHORT_COLUMNS", "Sample", "cell_origin", "column_labels", "fit_label",
           "grid_size", "label_width", "plot_curves", "sample_crops", "sample_grid"]

COLUMNS = ("LR (nearest)", "bicubic", "SR", "HR")
SHORT_COLUMNS = ("LR", "bic.", "SR", "HR")  # over cells too narrow for the full titles
GAP = 4  # white pixels between cells
LABEL_HEIGHT = 14  # the strip above each row (and the header) that carries its text
_BICUBIC_RADIUS = 2  # LR pixels a bicubic output pixel reads on each side


@dataclasses.dataclass(frozen=True)
class Sample:
    """One crop, every picture uint8 ``(c, c, 3)`` at HR size (LR enlarged by repeating pixels)."""

    name: str
    lr: np.ndarray
    bicubic: np.ndarray
    sr: np.ndarray
    hr: np.ndarray


def _to_uint8(x: torch.Tensor) -> np.ndarray:
    return quantize(x.float()).to(torch.uint8).permute(1, 2, 0).numpy()


@torch.no_grad()
def sample_crops(model: nn.Module, pairs, indices: Sequence[int], crop: int) -> List[Sample]:
    """Return the centre crop of ``crop`` HR pixels (rounded down to the scale, cut to the image) of each pair."""
    margin = max(receptive_field_radius(model), _BICUBIC_RADIUS)
    samples = []
    was_training = model.training
    model.eval()
    try:
        for i in indices:
            samples.append(_sample(model, pairs, i, crop, margin))
    finally:
        model.train(was_training)
    return samples


def _sample(model: nn.Module, pairs, i: int, crop: int, margin: int) -> Sample:
    s = pairs.scale
    lr, hr = pairs[i]
    (lh, lw), side = lr.shape[-2:], max(crop // s, 1)
    ch, cw = min(side, lh), min(side, lw)
    y0, x0 = (lh - ch) // 2, (lw - cw) // 2
    ya, xa = max(y0 - margin, 0), max(x0 - margin, 0)
    window = lr[:, ya : min(y0 + ch + margin, lh), xa : min(x0 + cw + margin, lw)]

    def inner(out: torch.Tensor) -> np.ndarray:
        return _to_uint8(out[:, (y0 - ya) * s : (y0 - ya + ch) * s, (x0 - xa) * s : (x0 - xa + cw) * s])

    lr_crop = lr[:, y0 : y0 + ch, x0 : x0 + cw].repeat_interleave(s, 1).repeat_interleave(s, 2)
    return Sample(name=pairs.names[i], lr=_to_uint8(lr_crop), bicubic=inner(bicubic_upscale(window, s)),
                  sr=inner(upscale(model, window)), hr=_to_uint8(hr[:, y0 * s : (y0 + ch) * s, x0 * s : (x0 + cw) * s]))


def grid_size(rows: int, cell: Tuple[int, int]) -> Tuple[int, int]:
    """Return ``(height, width)`` of a grid of ``rows`` samples whose cells are ``cell`` = (h, w)."""
    h, w = cell
    return LABEL_HEIGHT + rows * (LABEL_HEIGHT + h + GAP), len(COLUMNS) * w + (len(COLUMNS) + 1) * GAP


def cell_origin(row: int, column: int, cell: Tuple[int, int]) -> Tuple[int, int]:
    """Return the top-left ``(y, x)`` of a cell in the grid."""
    h, w = cell
    return LABEL_HEIGHT + row * (LABEL_HEIGHT + h + GAP) + LABEL_HEIGHT, GAP + column * (w + GAP)


@functools.lru_cache(maxsize=1)
def _label_font():
    from PIL import ImageFont

    return ImageFont.load_default()  # what ImageDraw.text draws with when given no font


def label_width(text: str) -> int:
    """Return the width in pixels of ``text`` drawn in the grid's font (its ink, not only its advance)."""
    return math.ceil(_label_font().getbbox(text)[2]) if text else 0


def fit_label(text: str, width: int, short: str = "") -> str:
    """Return ``text`` if it fits ``width`` pixels, else ``short`` if that does, else as much of either as fits."""
    for candidate in (text, short):
        if candidate and label_width(candidate) <= width:
            return candidate
    cut = short or text
    while cut and label_width(cut) > width:
        cut = cut[:-1]
    return cut


def column_labels(cell_width: int) -> List[str]:
    """Return the column titles over cells ``cell_width`` pixels wide, each within its cell, so none runs into the next."""
    return [fit_label(title, cell_width, short) for title, short in zip(COLUMNS, SHORT_COLUMNS)]


def sample_grid(samples: Sequence[Sample]) -> np.ndarray:
    """Lay out samples as rows of LR / bicubic / SR / HR on white, labelled; uint8 ``(H, W, 3)``.

    Cells are as large as the largest crop; a smaller crop sits in its cell's top-left corner.
    Titles too wide for a cell are shortened (``SHORT_COLUMNS``) or cut, names to the grid's width.
    """
    from PIL import Image, ImageDraw

    cell = (max(x.hr.shape[0] for x in samples), max(x.hr.shape[1] for x in samples))
    grid = np.full((*grid_size(len(samples), cell), 3), 255, np.uint8)
    for row, sample in enumerate(samples):
        for column, picture in enumerate((sample.lr, sample.bicubic, sample.sr, sample.hr)):
            y, x = cell_origin(row, column, cell)
            grid[y : y + picture.shape[0], x : x + picture.shape[1]] = picture
    image = Image.fromarray(grid)
    draw = ImageDraw.Draw(image)
    font = _label_font()
    for column, title in enumerate(column_labels(cell[1])):
        draw.text((cell_origin(0, column, cell)[1], 2), title, fill=(0, 0, 0), font=font)
    for row, sample in enumerate(samples):
        y = cell_origin(row, 0, cell)[0] - LABEL_HEIGHT
        draw.text((GAP, y + 2), fit_label(sample.name, grid.shape[1] - 2 * GAP), fill=(0, 0, 0), font=font)
    return np.asarray(image).copy()


def _read_log(path: Path, note: Optional[Callable[[str], None]] = None) -> Dict[str, List[float]]:
    """The columns of a CSV log as floats (empty cells NaN); malformed rows are skipped, and ``note`` told."""
    columns: Dict[str, List[float]] = {}
    if not path.is_file():
        return columns
    # A log is ours, but a crash or a run interleaved with another can leave torn rows, NUL bytes
    # or undecodable ones: the curves are drawn from the rows that read, never a traceback.
    with open(path, newline="", errors="replace") as f:
        lines = [line for line in f if "\0" not in line]
    reader = csv.reader(lines)
    header = next(reader, None) or []
    skipped = 0
    for row in reader:
        if not row:
            continue
        try:
            if len(row) != len(header):
                raise ValueError(row)
            values = [float(value) if value else math.nan for value in row]
        except ValueError:
            skipped += 1
            continue
        for key, value in zip(header, values):
            columns.setdefault(key, []).append(value)
    if skipped and note is not None:
        note(f"{path}: skipped {skipped} malformed row(s) drawing the curves")
    return columns


def plot_curves(out_dir: Path, note: Optional[Callable[[str], None]] = None) -> Path:
    """Draw ``out_dir/curves.png`` from its CSV logs: loss, learning rate, and validation PSNR against bicubic.

    ``note`` is told of log rows that could not be read (they are left out).
    """
    # A Figure of its own, not pyplot's: no global backend to choose (a notebook's stays as it
    # is), nothing to close, and half a second less of imports.
    from matplotlib.figure import Figure

    train, val = _read_log(out_dir / "train_log.csv", note), _read_log(out_dir / "val_log.csv", note)
    fig = Figure(figsize=(13, 3.6), layout="constrained")
    loss_ax, lr_ax, psnr_ax = fig.subplots(1, 3)
    loss_ax.plot(train.get("update", []), train.get("loss", []), color="tab:blue")
    loss_ax.set(title="training loss (L1)", xlabel="update")
    lr_ax.plot(train.get("update", []), train.get("lr", []), color="tab:orange")
    lr_ax.set(title="learning rate", xlabel="update")
    psnr_ax.plot(val.get("update", []), val.get("psnr", []), "o-", label="model", color="tab:green")
    psnr_ax.plot(val.get("update", []), val.get("bicubic_psnr", []), "--", label="bicubic", color="tab:gray")
    psnr_ax.set(title="validation PSNR (dB)", xlabel="update")
    psnr_ax.legend()
    return atomic_write(out_dir / "curves.png", lambda f: fig.savefig(f, format="png", dpi=80))
