"""Super-resolution datasets: find LR/HR pairs on disk, serve whole pairs or random patches.

Layouts, chosen by ``open_pairs(data, ...)`` from what ``data`` contains:

- ``embedded``: scikit-image's photographs (see ``images.EMBEDDED_TRAIN`` / ``EMBEDDED_VAL``),
  served as a plain folder;
- DIV2K: ``DIV2K_train_HR/0001.png`` with ``DIV2K_train_LR_bicubic/X2/0001x2.png``; images
  1-800 train, 801-900 validate (``DIV2K_valid_*`` folders are searched too);
- benchmark (EDSR-PyTorch's): ``Set5/HR/baby.png`` with ``Set5/LR_bicubic/X2/babyx2.png``;
- basicsr (BasicSR's benchmark sets): ``Set5/GTmod12/baby.png`` with ``Set5/LRbicx2/baby.png``;
- hr_lr: an HR folder (``HR/`` or ``GT/``) beside an LR folder (``LR/`` or ``LQ/``), which holds
  one scale or one sub-folder per scale (``LR/X2/``), with ``baby.png`` or ``babyx2.png``;
- any other folder: its images are HR, and LR is made by bicubic downscaling (MATLAB's
  ``imresize`` by default, as the benchmark sets were made; see ``images.DOWNSCALERS``).

Folder names are compared regardless of case. HR and LR images are paired by name, and every
LR image needs its HR image. A folder that mixes layouts, or holds part of one (LR images
without their HR folder), is refused, naming what was found: read as a plain folder, its LR
images would be scored as HR images. So is a plain folder with LR-like sub-folders, or with two
images of one name (``babyx2`` counting as ``baby``) whose sizes are those of an HR image and its
LR image at a scale some model has.

Every pair is decoded (or found in the cache) and checked when the dataset is built, in the
main process, so bad files fail early with their name instead of inside a DataLoader worker.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from hpdl.sr.errors import BadImageError, ImageTooSmallError, SRDataError
from hpdl.sr.images import (
    IMAGE_EXTENSIONS,
    ImageCache,
    DOWNSCALERS,
    bicubic_downscale,
    check_pixels,
    default_cache_dir,
    header_size,
    list_images,
    prepare_embedded,
)
from hpdl.sr.registry import known_scales
from hpdl.sr.transforms import NUM_DIHEDRAL, dihedral_array

__all__ = [
    "DIV2K_TRAIN_RANGE",
    "DIV2K_VAL_RANGE",
    "ImagePairs",
    "PairSource",
    "TrainPatches",
    "basicsr_sources",
    "benchmark_sources",
    "build_train_dataset",
    "build_val_dataset",
    "detect_layout",
    "div2k_sources",
    "folder_sources",
    "hr_lr_sources",
    "open_pairs",
    "parse_range",
    "split_sets",
]

DIV2K_TRAIN_RANGE = (1, 800)
DIV2K_VAL_RANGE = (801, 900)
BAD_IMAGE_POLICIES = ("fail", "skip")

PathLike = Union[str, Path]


@dataclasses.dataclass(frozen=True)
class PairSource:
    """One HR image and its LR file (``lr=None``: make LR by bicubic downscaling)."""

    name: str
    hr: Path
    lr: Optional[Path] = None


def parse_range(text: str) -> Tuple[int, int]:
    """Parse an inclusive image index range such as ``"801-900"``."""
    try:
        first, last = (int(part) for part in text.split("-", 1))
    except ValueError:
        raise ValueError(f"expected an index range like 801-900, got {text!r}") from None
    if not 1 <= first <= last:
        raise ValueError(f"bad index range {text!r}")
    return first, last


def split_sets(data: str, root: Optional[PathLike] = None) -> List[Tuple[str, str]]:
    """Split ``Set5+Set14+B100`` (EDSR-PyTorch's spelling) into ``(name, path)`` per set.

    A part that is not a folder as given is looked up in ``root`` and ``root/benchmark`` (EDSR-
    PyTorch's ``--dir_data`` layout). A ``data`` that exists as a whole is one set, ``+`` or not.
    """
    parts = [data] if data == "embedded" or Path(data).exists() else data.split("+")
    sets: List[Tuple[str, str]] = []
    for part in parts:
        if not part:
            raise SRDataError(f"{data}: empty set name between '+' signs")
        path = part
        if part != "embedded" and not Path(part).exists() and root is not None:
            path = next((str(p) for p in (Path(root) / part, Path(root) / "benchmark" / part) if p.exists()),
                        str(Path(root) / part))
        name = "embedded" if part == "embedded" else Path(path).resolve().name
        clash = [p for n, p in sets if n == name]
        if clash:
            raise SRDataError(f"{data}: two sets named {name} ({clash[0]} and {path})")
        sets.append((name, path))
    return sets


def div2k_sources(root: PathLike, scale: int, index_range: Tuple[int, int]) -> List[PairSource]:
    """List DIV2K pairs ``first..last`` (inclusive) under ``root``."""
    root = Path(root)
    folders = [(_subfolder(root, f"DIV2K_{part}_HR"), _subfolder(root, f"DIV2K_{part}_LR_bicubic", f"X{scale}"))
               for part in ("train", "valid")]
    sources = []
    for i in range(index_range[0], index_range[1] + 1):
        stem = f"{i:04d}"
        for hr_dir, lr_dir in folders:
            hr = hr_dir / f"{stem}.png"
            if hr.exists():
                lr = lr_dir / f"{stem}x{scale}.png"
                break
        else:
            raise SRDataError(f"{folders[0][0] / (stem + '.png')}: missing DIV2K image {i}")
        _require_lr(hr, lr)
        sources.append(PairSource(stem, hr, lr))
    return sources


def benchmark_sources(root: PathLike, scale: int) -> List[PairSource]:
    """List the pairs of a benchmark set laid out as ``HR/x.png`` + ``LR_bicubic/X{s}/xx{s}.png``."""
    root = Path(root)
    return _paired_by_name(_subfolder(root, "HR"), _subfolder(root, "LR_bicubic", f"X{scale}"), scale)


def basicsr_sources(root: PathLike, scale: int) -> List[PairSource]:
    """List the pairs of a benchmark set laid out as BasicSR's: ``GTmod12/x.png`` + ``LRbicx{s}/x.png``."""
    root = Path(root)
    return _paired_by_name(_subfolder(root, "GTmod12"), _subfolder(root, f"LRbicx{scale}"), scale)


def hr_lr_sources(root: PathLike, scale: int) -> List[PairSource]:
    """List the pairs of a set laid out as ``HR/x.png`` (or ``GT/``) + ``LR/x.png`` (or ``LQ/``).

    An LR folder with sub-folders ``X2/``, ``X4/``... holds one scale in each; without them it
    holds one scale, which the image sizes must match (checked when the pairs are read).
    """
    root = Path(root)
    hr_dir = _subfolder(root, *_named(root, _PAIR_HR))
    lr_dir = _subfolder(root, *_named(root, _PAIR_LR))
    if _named(lr_dir, _SCALE_DIR):
        lr_dir = _subfolder(lr_dir, f"X{scale}")
    return _paired_by_name(hr_dir, lr_dir, scale)


def _named(folder: Path, pattern: "re.Pattern[str]") -> List[str]:
    """Names of the sub-folders of ``folder`` that ``pattern`` matches, sorted."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and pattern.fullmatch(p.name))


def _subfolder(root: Path, *names: str) -> Path:
    """Return ``root/names[0]/names[1]/...``, each part matched regardless of case, as layouts are detected."""
    path = root
    for name in names:
        same = [p for p in sorted(path.iterdir()) if p.is_dir() and p.name.lower() == name.lower()] \
            if path.is_dir() else []
        path = same[0] if len(same) == 1 else path / name
    return path


def _paired_by_name(hr_dir: Path, lr_dir: Path, scale: int) -> List[PairSource]:
    # The LR of ``baby.png`` is ``babyx2.png`` (EDSR-PyTorch) or ``baby.png`` (BasicSR), in any
    # image format (``baboon.bmp`` beside ``baboonx2.png``): the same one as the HR's first.
    if not lr_dir.is_dir():
        raise SRDataError(f"{lr_dir}: no LR images for scale {scale}")
    lr_images = {p.relative_to(lr_dir) for p in list_images(lr_dir)}
    by_stem: Dict[Path, List[Path]] = {}
    for rel in sorted(lr_images):
        by_stem.setdefault(rel.with_suffix(""), []).append(rel)
    sources = []
    for hr in _nonempty(list_images(hr_dir), hr_dir):
        rel = hr.relative_to(hr_dir)
        stems = [rel.with_name(f"{hr.stem}x{scale}"), rel.with_suffix("")]
        lr = lr_dir / stems[0].with_name(stems[0].name + hr.suffix)  # named in the error if missing
        for stem in stems:
            found = [n for n in by_stem.get(stem, []) if n in lr_images]
            same_format = [n for n in found if n.suffix.lower() == hr.suffix.lower()]
            if len(same_format) == 1 or len(found) == 1:
                lr = lr_dir / (same_format or found)[0]
                break
            if found:
                raise SRDataError(f"{hr}: its LR image could be any of {', '.join(str(lr_dir / n) for n in found)}; "
                                  "keep one")
        _require_lr(hr, lr)
        lr_images.discard(lr.relative_to(lr_dir))
        sources.append(PairSource(str(rel.with_suffix("")), hr, lr))
    if lr_images:
        orphan = lr_dir / sorted(lr_images)[0]
        raise SRDataError(f"{orphan}: LR image without an HR image of the same name in {hr_dir}")
    return sources


def folder_sources(folder: PathLike) -> List[PairSource]:
    """List every image under ``folder`` as an HR image whose LR is made on the fly."""
    folder = Path(folder)
    images = _nonempty(list_images(folder), folder)
    return [PairSource(str(p.relative_to(folder).with_suffix("")), p, None) for p in images]


def _require_lr(hr: Path, lr: Path) -> None:
    if not lr.exists():
        raise SRDataError(f"{hr}: HR image without its LR image {lr}")


def _nonempty(images: List[Path], folder: Path) -> List[Path]:
    if not images:
        raise SRDataError(f"{folder}: no images found (looked for {', '.join(IMAGE_EXTENSIONS)})")
    return images


# The HR and LR folders of an HR/LR pair, and the scale sub-folders an LR folder may hold.
_PAIR_HR = re.compile(r"HR|GT", re.IGNORECASE)
_PAIR_LR = re.compile(r"LR|LQ", re.IGNORECASE)
_SCALE_DIR = re.compile(r"X\d+", re.IGNORECASE)
# Folders that mark a layout: (name, HR or LR side, the layouts it may belong to), first match
# wins. EDSR-PyTorch's HR/ is also the HR side of an HR/LR pair; the LR folder tells which.
_MARKERS = (
    (re.compile(r"DIV2K_(train|valid)_HR", re.IGNORECASE), "hr", ("div2k",)),
    (re.compile(r"GTmod12", re.IGNORECASE), "hr", ("basicsr",)),
    (re.compile(r"LRbicx\d+", re.IGNORECASE), "lr", ("basicsr",)),
    (re.compile(r"LR_bicubic", re.IGNORECASE), "lr", ("benchmark",)),
    (re.compile(r"HR", re.IGNORECASE), "hr", ("benchmark", "hr_lr")),
    (_PAIR_HR, "hr", ("hr_lr",)),
    (_PAIR_LR, "lr", ("hr_lr",)),
)
# A directory of LR images somewhere inside a folder that is read as HR images.
_LR_DIR = re.compile(r"LR_bicubic|LRbicx\d+|DIV2K_(train|valid)_LR_.*|X\d+|LR|LQ", re.IGNORECASE)
# EDSR-PyTorch names the x2 LR image of baby.png babyx2.png (matched against a whole stem).
_SCALE_SUFFIX = re.compile(r"(.+)x([1-9][0-9]*)", re.IGNORECASE)


def detect_layout(data: PathLike) -> str:
    """Return ``embedded``, ``div2k``, ``benchmark``, ``basicsr``, ``hr_lr`` or ``folder`` for a ``--data`` value.

    ``SRDataError`` if the folder mixes layouts or holds an incomplete one, naming what it found.
    """
    if str(data) == "embedded":
        return "embedded"
    path = Path(data)
    if not path.exists():
        raise SRDataError(f"{path}: no such directory (give a dataset folder or 'embedded')")
    if not path.is_dir():
        raise SRDataError(f"{path}: not a directory (give a dataset folder or 'embedded')")
    found: Dict[str, Tuple[str, Tuple[str, ...]]] = {}  # folder name -> (side, layouts)
    for name in sorted(p.name for p in path.iterdir() if p.is_dir()):
        marker = next(((side, layouts) for pattern, side, layouts in _MARKERS if pattern.fullmatch(name)), None)
        if marker is not None:
            found[name] = marker
    if not found:
        _refuse_lr_inside(path)
        return "folder"
    listed = ", ".join(f"{name}/" for name in found)
    layouts = {candidates[0] for _, candidates in found.values() if len(candidates) == 1}
    layouts |= {candidates[0] for _, candidates in found.values() if not layouts & set(candidates)}
    if len(layouts) > 1:
        raise SRDataError(f"{path}: ambiguous layout: found {listed} ({' and '.join(sorted(layouts))} layouts); "
                          "keep one layout per dataset folder")
    layout = layouts.pop()
    hr_dirs = [f"{name}/" for name, (side, _) in found.items() if side == "hr"]
    lr_dirs = [f"{name}/" for name, (side, _) in found.items() if side == "lr"]
    if not lr_dirs and layout != "div2k":
        raise SRDataError(f"{path}: found {listed} but no LR folder beside it (LR_bicubic/, LR/ or LQ/); "
                          "for LR made from HR images, give the HR folder itself")
    if layout == "benchmark" and not hr_dirs:
        raise SRDataError(f"{path}: found {listed} but EDSR-PyTorch's layout needs both HR/ and LR_bicubic/")
    if layout == "basicsr" and not hr_dirs:
        raise SRDataError(f"{path}: found {listed} but no GTmod12/ (BasicSR's HR images)")
    if layout == "hr_lr" and not hr_dirs:
        raise SRDataError(f"{path}: found {listed} but no HR folder beside it (HR/ or GT/)")
    for side, dirs in (("HR", hr_dirs), ("LR", lr_dirs)):
        if len(dirs) > 1 and layout != "div2k" and (side == "HR" or layout != "basicsr"):
            raise SRDataError(f"{path}: found {listed}: two {side} folders ({dirs[0]} and {dirs[1]}); keep one")
    return layout


def _refuse_lr_inside(folder: Path) -> None:
    images = [image.relative_to(folder) for image in list_images(folder)]
    for relative in images:
        lr_dir = next((part for part in relative.parts[:-1] if _LR_DIR.fullmatch(part)), None)
        if lr_dir is not None:
            raise SRDataError(f"{folder}: not a dataset layout, and read as a folder of HR images it would take "
                              f"the LR images in {lr_dir}/ for HR ones; give one set (e.g. .../Set5) or its HR folder")
    _refuse_hr_lr_pairs(folder, images)


def _refuse_hr_lr_pairs(folder: Path, images: List[Path]) -> None:
    """Refuse two images of one name whose sizes are an HR image's and its LR image's at a known scale.

    Photos that merely share a name (``2023/IMG_0001.png`` and ``2024/IMG_0001.png``, ``cat/001.png``
    and ``dog/001.png``) pass; only the sizes tell an LR image from another photo, and only
    images whose names collide have their headers read.
    """
    scales = known_scales()
    by_name: Dict[str, List[Path]] = {}
    for relative in images:
        by_name.setdefault(_split_scale_suffix(relative.stem, scales)[0], []).append(relative)
    for group in by_name.values():
        if len(group) < 2:
            continue
        sizes = {relative: header_size(folder / relative) for relative in group}
        of_size: Dict[Tuple[int, int], List[Path]] = {}
        for relative, size in sizes.items():
            if size is not None:
                of_size.setdefault(size, []).append(relative)
        for hr in group:
            if sizes[hr] is None:
                continue
            width, height = sizes[hr]
            for scale in scales:
                for lr in of_size.get((width // scale, height // scale), ()):
                    if lr != hr and _named_as_lr(lr.stem, hr.stem, scale, scales):
                        raise SRDataError(
                            f"{folder}: not a dataset layout, and {hr} ({width}x{height}) and {lr} "
                            f"({width // scale}x{height // scale}) look like an HR image and its x{scale} LR image; "
                            "read as a folder of HR images both would be scored as HR: name their folders HR/ "
                            "and LR/, or give the HR images alone")


def _split_scale_suffix(stem: str, scales: Sequence[int]) -> Tuple[str, Optional[int]]:
    """Split ``babyx2`` into ``("baby", 2)`` if some model has scale 2, else return ``(stem, None)``.

    Only a known scale counts, so that ``box25`` stays a name of its own.
    """
    match = _SCALE_SUFFIX.fullmatch(stem)
    if match is not None and int(match[2]) in scales:
        return match[1], int(match[2])
    return stem, None


def _named_as_lr(lr_stem: str, hr_stem: str, scale: int, scales: Sequence[int]) -> bool:
    # BasicSR's LR image has its HR image's name, EDSR-PyTorch's adds x<scale>: the scale its size shows.
    return lr_stem == hr_stem or _split_scale_suffix(lr_stem, scales) == (hr_stem, scale)


@dataclasses.dataclass(frozen=True)
class _Pair:
    name: str
    hr_source: Path
    hr_file: str  # cache entries (.npy), memory-mapped on access
    lr_file: str
    lr_size: Tuple[int, int]  # (height, width)


class ImagePairs(Dataset):
    """Whole LR/HR pairs as float ``(3, H, W)`` tensors in [0, 255]: the validation samples."""

    def __init__(
        self,
        sources: Sequence[PairSource],
        scale: int,
        *,
        cache: Optional[ImageCache] = None,
        on_bad_image: str = "fail",
        layout: str = "folder",
        downscaler: str = "matlab",
    ) -> None:
        if on_bad_image not in BAD_IMAGE_POLICIES:
            raise ValueError(f"on_bad_image must be 'fail' or 'skip', got {on_bad_image!r}")
        if downscaler not in DOWNSCALERS:
            raise ValueError(f"downscaler must be one of {DOWNSCALERS}, got {downscaler!r}")
        self.scale = int(scale)
        self.layout = layout
        self.downscaler = downscaler
        cache = cache or ImageCache()
        self._pairs: List[_Pair] = []
        for source in sources:
            pair = self._load(source, cache, skip_bad=on_bad_image == "skip")
            if pair is not None:
                self._pairs.append(pair)
        if not self._pairs:
            where = sources[0].hr.parent if sources else "dataset"
            raise SRDataError(f"{where}: no usable images")

    def _load(self, source: PairSource, cache: ImageCache, skip_bad: bool) -> Optional[_Pair]:
        s = self.scale
        try:
            hr = cache.image(source.hr)
            if source.lr is None:
                if hr.shape[0] < s or hr.shape[1] < s:
                    raise ImageTooSmallError(
                        f"{source.hr}: image of {hr.shape[1]}x{hr.shape[0]} is smaller than scale {s}"
                    )
                lr = cache.derived(source.hr, f"bicubic-{self.downscaler}-x{s}",
                                   lambda: bicubic_downscale(hr, s, self.downscaler))
            else:
                lr = cache.image(source.lr)
        except BadImageError as err:
            if not skip_bad:
                raise
            warnings.warn(f"skipping {err}", RuntimeWarning, stacklevel=3)
            return None
        (hh, hw), (lh, lw) = hr.shape[:2], lr.shape[:2]
        if (lh, lw) != (hh // s, hw // s) or lh == 0 or lw == 0:
            raise SRDataError(
                f"{source.lr}: LR is {lw}x{lh} but HR {source.hr} is {hw}x{hh}, "
                f"so x{s} needs LR {hw // s}x{hh // s}"
            )
        return _Pair(source.name, source.hr, str(hr.filename), str(lr.filename), (lh, lw))

    def __len__(self) -> int:
        return len(self._pairs)

    def subset(self, indices: Sequence[int]) -> "ImagePairs":
        """Return the pairs at ``indices``, in that order, as a set of the same scale and layout."""
        kept = copy.copy(self)
        kept._pairs = [self._pairs[i] for i in indices]
        return kept

    @property
    def names(self) -> List[str]:
        """Return the image names (file stems) in dataset order."""
        return [p.name for p in self._pairs]

    def lr_size(self, index: int) -> Tuple[int, int]:
        """Return ``(height, width)`` of LR image ``index``."""
        return self._pairs[index].lr_size

    def hr_size(self, index: int) -> Tuple[int, int]:
        """Return ``(height, width)`` of HR image ``index`` as its file holds it (not cropped to the scale)."""
        return tuple(np.load(self._pairs[index].hr_file, mmap_mode="r").shape[:2])

    def source(self, index: int) -> Path:
        """Return the HR source file of pair ``index``."""
        return self._pairs[index].hr_source

    def arrays(self, index: int) -> Tuple[np.ndarray, np.ndarray]:
        """Return memory-mapped uint8 ``(H, W, 3)`` LR and HR, HR cropped to ``scale`` x LR."""
        pair = self._pairs[index]
        lh, lw = pair.lr_size
        lr = np.load(pair.lr_file, mmap_mode="r")
        hr = np.load(pair.hr_file, mmap_mode="r")[: lh * self.scale, : lw * self.scale]
        return lr, hr

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        lr, hr = self.arrays(index)
        return _to_tensor(lr), _to_tensor(hr)


def _to_tensor(image: np.ndarray) -> torch.Tensor:
    # HWC uint8 (possibly a flipped view) -> contiguous CHW float32 in [0, 255]. Always a copy:
    # the transpose of a one-pixel image is contiguous already, and torch warns of read-only memory maps.
    return torch.from_numpy(np.array(image.transpose(2, 0, 1), order="C")).to(torch.float32)


class TrainPatches(Dataset):
    """Random aligned LR/HR patches (LR ``P``, HR ``P * scale``) with the 8 dihedral transforms.

    Each epoch visits every image ``repeat`` times. A sample's crop and transform depend only on
    ``(seed, epoch, index)``, not on the worker that draws it or on earlier samples, so a
    resumed run draws the same patches. DataLoader workers hold copies of this object: call
    ``set_epoch`` before iterating, and keep ``persistent_workers=False`` (the default) so that
    each epoch's workers see the new epoch.
    """

    def __init__(
        self,
        pairs: ImagePairs,
        patch_size: int = 48,
        *,
        repeat: int = 1,
        augment: bool = True,
        seed: int = 0,
    ) -> None:
        if patch_size < 1 or repeat < 1:
            raise ValueError(f"patch_size and repeat must be >= 1, got {patch_size}, {repeat}")
        self.pairs = pairs
        self.scale = pairs.scale
        self.patch_size = int(patch_size)
        self.repeat = int(repeat)
        self.augment = augment
        self.seed = int(seed)
        self.epoch = 0
        for i in range(len(pairs)):
            lh, lw = pairs.lr_size(i)
            if lh < patch_size or lw < patch_size:
                raise SRDataError(
                    f"{pairs.source(i)}: LR image of {lw}x{lh} is smaller than the "
                    f"{patch_size}x{patch_size} training patch (x{self.scale})"
                )

    def set_epoch(self, epoch: int) -> None:
        """Draw this epoch's crops and transforms (call before creating the epoch's iterator)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.pairs) * self.repeat

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.epoch, int(index)])
        lr, hr = self.pairs.arrays(int(index) % len(self.pairs))
        p, s = self.patch_size, self.scale
        y = int(rng.integers(0, lr.shape[0] - p + 1))
        x = int(rng.integers(0, lr.shape[1] - p + 1))
        lr = lr[y : y + p, x : x + p]
        hr = hr[y * s : (y + p) * s, x * s : (x + p) * s]
        if self.augment:
            k = int(rng.integers(0, NUM_DIHEDRAL))
            lr, hr = dihedral_array(lr, k), dihedral_array(hr, k)
        return _to_tensor(lr), _to_tensor(hr)


def _sources(data: PathLike, layout: str, scale: int, split: str, index_range, cache_dir) -> List[PairSource]:
    return _unique_names(_found_sources(data, layout, scale, split, index_range, cache_dir))


def _unique_names(sources: List[PairSource]) -> List[PairSource]:
    """Keep the extension in the names of images that share a stem (``x.png`` and ``x.jpg``).

    A name is an image's only label in the table, the JSON and ``--grid-images``, and names the
    file ``--save-results`` writes: two images of one name would overwrite each other's result.
    """
    stems: Dict[str, int] = {}
    for source in sources:
        stems[source.name] = stems.get(source.name, 0) + 1
    return [dataclasses.replace(source, name=source.name + source.hr.suffix) if stems[source.name] > 1 else source
            for source in sources]


def _found_sources(data: PathLike, layout: str, scale: int, split: str, index_range,
                   cache_dir) -> List[PairSource]:
    if layout == "embedded":
        return folder_sources(prepare_embedded(cache_dir)[split])
    if layout == "div2k":
        default = DIV2K_TRAIN_RANGE if split == "train" else DIV2K_VAL_RANGE
        return div2k_sources(data, scale, index_range or default)
    if layout == "benchmark":
        return benchmark_sources(data, scale)
    if layout == "basicsr":
        return basicsr_sources(data, scale)
    if layout == "hr_lr":
        return hr_lr_sources(data, scale)
    return folder_sources(data)


def open_pairs(
    data: PathLike,
    scale: int,
    split: str = "val",
    *,
    cache_dir: Optional[PathLike] = None,
    index_range: Optional[Tuple[int, int]] = None,
    on_bad_image: str = "fail",
    max_pixels: Optional[int] = None,
    downscaler: str = "matlab",
    limit_name: str = "--max-pixels",
) -> ImagePairs:
    """Find, decode (once) and check the pairs of ``data`` (a folder or ``"embedded"``).

    Args:
        data: dataset folder in one of the layouts above, or ``"embedded"``.
        split: ``"train"`` or ``"val"``; picks the DIV2K range and the embedded split, and is
            ignored by benchmark sets and plain folders (which are used whole).
        cache_dir: root of the decode cache and of the embedded PNGs (default
            ``default_cache_dir()``).
        index_range: DIV2K image numbers, inclusive (default 1-800 train, 801-900 val).
        on_bad_image: ``"fail"`` on an undecodable file or an image smaller than the scale, or
            ``"skip"`` it with a warning.
        max_pixels: refuse image files of more pixels than this (None: Pillow's limit).
        downscaler: how LR is made where the dataset has none (plain folders, embedded):
            ``matlab`` (as the benchmark sets were made) or ``torch``.
        limit_name: the option or key that sets ``max_pixels``, for its error.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    layout = detect_layout(data)
    sources = _sources(data, layout, int(scale), split, index_range, root)
    return ImagePairs(
        sources, scale, cache=ImageCache(root / "decoded", max_pixels=max_pixels, limit_name=limit_name),
        on_bad_image=on_bad_image, layout=layout, downscaler=downscaler,
    )


def check_pairs(
    data: PathLike,
    scale: int,
    split: str = "val",
    *,
    cache_dir: Optional[PathLike] = None,
    index_range: Optional[Tuple[int, int]] = None,
    max_pixels: Optional[int] = None,
    limit_name: str = "--max-pixels",
) -> None:
    """Check what ``open_pairs`` would open without decoding any image: the layout, the files,
    and each file's size in its header against ``max_pixels``.

    For a second data set whose errors should not wait for the first one's decoding (training
    checks its validation set before decoding the training images).
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    for source in _sources(data, detect_layout(data), int(scale), split, index_range, root):
        for path in (source.hr, source.lr):
            size = header_size(path) if path is not None else None
            if size is not None:  # an unreadable header is reported when the file is decoded
                check_pixels(path, size, max_pixels, limit_name)


def build_train_dataset(
    data: PathLike,
    scale: int,
    *,
    patch_size: int = 48,
    repeat: int = 1,
    augment: bool = True,
    seed: int = 0,
    cache_dir: Optional[PathLike] = None,
    index_range: Optional[Tuple[int, int]] = None,
    on_bad_image: str = "fail",
    downscaler: str = "matlab",
    max_pixels: Optional[int] = None,
    limit_name: str = "--max-pixels",
) -> TrainPatches:
    """Build the training patches of ``data`` (see ``open_pairs`` for the arguments)."""
    pairs = open_pairs(
        data, scale, "train", cache_dir=cache_dir, index_range=index_range, on_bad_image=on_bad_image,
        max_pixels=max_pixels, downscaler=downscaler, limit_name=limit_name,
    )
    return TrainPatches(pairs, patch_size, repeat=repeat, augment=augment, seed=seed)


def build_val_dataset(
    data: PathLike,
    scale: int,
    *,
    cache_dir: Optional[PathLike] = None,
    index_range: Optional[Tuple[int, int]] = None,
    on_bad_image: str = "fail",
    max_pixels: Optional[int] = None,
    downscaler: str = "matlab",
    limit_name: str = "--max-pixels",
) -> ImagePairs:
    """Build the whole-image validation pairs of ``data`` (see ``open_pairs``)."""
    return open_pairs(
        data, scale, "val", cache_dir=cache_dir, index_range=index_range, on_bad_image=on_bad_image,
        max_pixels=max_pixels, downscaler=downscaler, limit_name=limit_name,
    )
