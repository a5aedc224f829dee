"""Evaluate a super-resolution model on whole images: PSNR/SSIM per image and means, vs bicubic."""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from hpdl.sr.errors import ImageTooSmallError, SRDataError
from hpdl.sr.metrics import SSIM_WINDOW, bicubic_upscale, default_shave, min_measurable_side, psnr, ssim
from hpdl.sr.inference import upscale

__all__ = ["EvalResult", "ImageRecord", "evaluate", "format_sets_table", "format_table", "keep_measurable"]


@dataclasses.dataclass(frozen=True)
class ImageRecord:
    """Scores of one image, for the model and for bicubic upscaling."""

    name: str
    height: int  # of the HR image
    width: int
    psnr: float
    ssim: float
    bicubic_psnr: float
    bicubic_ssim: float
    seconds: float  # model inference time


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Per-image records and the settings they were measured with."""

    scale: int
    space: str
    shave: int
    self_ensemble: bool
    tile: Optional[int]
    records: Tuple[ImageRecord, ...]

    def means(self) -> Dict[str, float]:
        """Return the mean of each score over the images (papers average per-image PSNR)."""
        keys = ("psnr", "ssim", "bicubic_psnr", "bicubic_ssim")
        n = len(self.records)
        return {k: (sum(getattr(r, k) for r in self.records) / n if n else math.nan) for k in keys}

    def to_dict(self) -> Dict[str, Any]:
        """Return a JSON-ready dict: settings, ``images`` (records) and ``mean``."""
        out = dataclasses.asdict(self)
        out["images"] = out.pop("records")
        out["mean"] = self.means()
        return out


def keep_measurable(pairs: Any, scale: int, metric_space: str, on_bad_image: str = "fail") -> Any:
    """Return ``pairs`` (``ImagePairs``) once every image is large enough to measure, before any is scored.

    PSNR and SSIM shave a border and then need the SSIM window inside it. An image that is
    smaller is refused (``ImageTooSmallError`` names the first, with the size of its file), or
    with ``on_bad_image="skip"`` skipped with a warning: the pairs without it are returned.
    """
    need, shave = min_measurable_side(scale, metric_space), default_shave(scale, metric_space)
    kept = []
    for i in range(len(pairs)):
        lh, lw = pairs.lr_size(i)
        if min(lh, lw) * scale >= need:
            kept.append(i)
            continue
        height, width = pairs.hr_size(i)
        err = ImageTooSmallError(
            f"{pairs.source(i)}: image of {width}x{height} is too small to measure at x{scale} on "
            f"{'Y' if metric_space == 'y' else 'RGB'}: {shave} px shaved from each border must leave the "
            f"{SSIM_WINDOW}x{SSIM_WINDOW} SSIM window, so each side needs at least {need} px")
        if on_bad_image != "skip":
            raise err
        warnings.warn(f"skipping {err}", RuntimeWarning, stacklevel=2)
    if not kept:
        raise SRDataError(f"{pairs.source(0).parent}: no usable images (every one is too small to measure)")
    return pairs if len(kept) == len(pairs) else pairs.subset(kept)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: Sequence[Tuple[torch.Tensor, torch.Tensor]],
    scale: int,
    metric_space: str = "y",
    self_ensemble: bool = False,
    tile: Optional[int] = None,
    progress: bool = False,
    on_output: Optional[Callable[[str, torch.Tensor], None]] = None,
) -> EvalResult:
    """Score ``model`` and bicubic on every ``(lr, hr)`` pair of ``dataset`` (e.g. ``ImagePairs``).

    Args:
        scale: upscaling factor; must match the model's and the dataset's when they have one.
        metric_space: ``"y"`` (benchmarks; shave ``scale``) or ``"rgb"`` (DIV2K; ``scale + 6``).
        self_ensemble: average over the 8 flips/transposes (EDSR+).
        tile: run the model in tiles of this many LR pixels (exact up to float rounding, as
            ``hpdl.sr.inference`` says; bounds memory).
        progress: show a progress bar over images (``hpdl.sr.progress``'s rule: rarely where
            stderr is not a terminal).
        on_output: called with each image's name and model output ``(3, H, W)`` (e.g. to save it).
    """
    shave = default_shave(scale, metric_space)  # also validates metric_space
    for owner in (model, dataset):
        theirs = getattr(owner, "scale", None)
        if theirs is not None and theirs != scale:
            raise ValueError(f"scale x{scale} does not match the {type(owner).__name__}'s x{theirs}")
    names: List[str] = list(getattr(dataset, "names", [str(i) for i in range(len(dataset))]))
    indices = range(len(dataset))
    if progress:
        from hpdl.sr.progress import progress_bar

        indices = progress_bar(indices, desc="eval", unit="img")
    was_training = model.training
    model.eval()
    records = []
    try:
        for i in indices:
            lr, hr = dataset[i]
            start = time.perf_counter()
            sr = upscale(model, lr, tile=tile, ensemble=self_ensemble)
            seconds = time.perf_counter() - start
            if on_output is not None:
                on_output(names[i], sr)
            bic = bicubic_upscale(lr, scale)
            try:
                record = ImageRecord(
                    name=names[i],
                    height=int(hr.shape[-2]),
                    width=int(hr.shape[-1]),
                    psnr=psnr(sr, hr, scale, metric_space),
                    ssim=ssim(sr, hr, scale, metric_space),
                    bicubic_psnr=psnr(bic, hr, scale, metric_space),
                    bicubic_ssim=ssim(bic, hr, scale, metric_space),
                    seconds=seconds,
                )
            except ValueError as err:  # e.g. an image too small for the shave and SSIM window
                where = dataset.source(i) if hasattr(dataset, "source") else names[i]
                raise SRDataError(f"{where}: {err}") from None
            records.append(record)
    finally:
        model.train(was_training)
    return EvalResult(scale, metric_space, shave, self_ensemble, tile, tuple(records))


def format_table(result: EvalResult) -> str:
    """Format the records and means as a plain-text table."""
    space = "Y (BT.601)" if result.space == "y" else "RGB"
    extras = (", self-ensemble x8" if result.self_ensemble else "") + (
        f", tiles of {result.tile} px" if result.tile else ""
    )
    width = max([len("image"), len("mean")] + [len(r.name) for r in result.records])
    header = f"{'image':<{width}}  {'PSNR':>7}  {'SSIM':>6}  {'bicubic':>7}  {'SSIM':>6}  {'size':>9}  {'s':>6}"
    lines = [
        f"x{result.scale}, {space}, {result.shave} px border shaved{extras}",
        header,
        "-" * len(header),
    ]
    for r in result.records:
        lines.append(
            f"{r.name:<{width}}  {r.psnr:7.2f}  {r.ssim:6.4f}  {r.bicubic_psnr:7.2f}  "
            f"{r.bicubic_ssim:6.4f}  {f'{r.width}x{r.height}':>9}  {r.seconds:6.2f}"
        )
    m = result.means()
    lines.append("-" * len(header))
    lines.append(
        f"{'mean':<{width}}  {m['psnr']:7.2f}  {m['ssim']:6.4f}  {m['bicubic_psnr']:7.2f}  {m['bicubic_ssim']:6.4f}"
    )
    return "\n".join(lines)


def format_sets_table(results: Sequence[Tuple[str, EvalResult]]) -> str:
    """Format one row per named set: images, mean PSNR/SSIM of the model and of bicubic, space."""
    width = max([len("set")] + [len(name) for name, _ in results])
    header = f"{'set':<{width}}  {'images':>6}  {'PSNR':>7}  {'SSIM':>6}  {'bicubic':>7}  {'SSIM':>6}  space"
    lines = [header, "-" * len(header)]
    for name, result in results:
        m = result.means()
        space = f"{'Y' if result.space == 'y' else 'RGB'}, shave {result.shave}"
        lines.append(f"{name:<{width}}  {len(result.records):>6}  {m['psnr']:7.2f}  {m['ssim']:6.4f}  "
                     f"{m['bicubic_psnr']:7.2f}  {m['bicubic_ssim']:6.4f}  {space}")
    return "\n".join(lines)
