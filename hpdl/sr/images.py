"""Image files: decoding to uint8 RGB, a decode-once ``.npy`` cache, bicubic LR, embedded photos.

Decoding a 2K PNG costs tens of milliseconds, far more than cropping a patch, so every image is
decoded once into ``<cache>/decoded/*.npy`` and memory-mapped afterwards (EDSR-PyTorch's
``bin`` files play the same role). Cache entries are keyed by the source's path, size and
modification time, so editing or replacing a source image rebuilds its entry; they are written
to a temporary file and renamed, so concurrent ranks or a killed job never leave a half-file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import io
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np

from hpdl.atomic_file import atomic_write
from hpdl.sr.errors import CorruptImageError, SRDataError

__all__ = [
    "DOWNSCALERS",
    "IMAGE_EXTENSIONS",
    "EMBEDDED_TRAIN",
    "EMBEDDED_VAL",
    "ImageCache",
    "Picture",
    "bicubic_downscale",
    "check_pixels",
    "default_cache_dir",
    "header_size",
    "list_images",
    "output_format",
    "prepare_embedded",
    "read_image",
    "read_picture",
    "write_image",
    "writer_keeps",
]

PathLike = Union[str, os.PathLike]

# How LR images are made from HR ones where a dataset has none: MATLAB's imresize, as the
# benchmark sets were made (hpdl.sr.imresize), or PyTorch's antialiased bicubic.
DOWNSCALERS = ("matlab", "torch")

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp", ".ppm")

# Real photographs shipped inside scikit-image's wheel. The stereo pair stays together in
# training (its two views are nearly the same picture, so splitting them would leak). The
# held-out images cover a portrait with man-made detail (astronaut), animal fur (chelsea) and
# microscopy texture (immunohistochemistry).
EMBEDDED_TRAIN = (
    "coffee",
    "colorwheel",
    "motorcycle_left",
    "motorcycle_right",
    "rocket",
    "hubble_deep_field",
    "retina",
)
EMBEDDED_VAL = ("astronaut", "chelsea", "immunohistochemistry")

_CACHE_VERSION = "2"  # bump when the decoded content for the same source would change


def default_cache_dir() -> Path:
    """Return ``$XDG_CACHE_HOME/hpdl/sr`` (``~/.cache/hpdl/sr`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hpdl" / "sr"


def read_image(path: PathLike, *, max_pixels: Optional[int] = None, limit_name: str = "--max-pixels") -> np.ndarray:
    """Decode an image file to a uint8 ``(H, W, 3)`` RGB array (gray is repeated, alpha dropped).

    With ``max_pixels``, an image declaring more pixels is refused before it is decoded (a small
    file can declare a huge image); that limit then replaces Pillow's own. ``limit_name`` is the
    option or key that sets it, for the error.
    """
    with _decoding(path), _opened(path, max_pixels) as img:
        check_pixels(path, img.size, max_pixels, limit_name)
        img.load()  # decode now, so truncation fails here and not at first use
        return _to_rgb(img, path)


@contextlib.contextmanager
def _decoding(path: PathLike) -> Iterator[None]:
    """Turn what opening and decoding ``path`` raises into errors that name the file."""
    try:
        yield
    except SRDataError:
        raise
    except FileNotFoundError:
        raise SRDataError(f"{path}: no such file") from None
    except (IsADirectoryError, PermissionError) as err:
        raise SRDataError(f"{path}: cannot read: {err.strerror}") from None
    except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, zlib errors...
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CorruptImageError(f"{path}: cannot decode image (corrupt or truncated?): {reason}") from None


@dataclasses.dataclass(frozen=True)
class Picture:
    """An image as ``hpdl sr upscale`` reads it: what a viewer shows, not only its colour samples.

    The networks see RGB; what an output needs to look like its input is kept beside it.
    """

    rgb: np.ndarray  # uint8 (H, W, 3), turned upright by the EXIF orientation
    alpha: Optional[np.ndarray]  # uint8 (H, W) where the file holds transparency, else None
    gray: bool  # a one-channel image (1, L, LA, I;16, F...): the output is gray too
    icc_profile: Optional[bytes]  # the colour profile, when it describes the output's channels
    frames: int  # frames of an animated or multi-page file; only the first is read
    orientation: int  # the EXIF orientation tag turned upright (1: none)
    colour_note: str = ""  # how colours of another space (CMYK) became RGB, if they did

    @property
    def mode(self) -> str:
        """Pillow's mode of an output that keeps what the input shows: L, LA, RGB or RGBA."""
        return ("L" if self.gray else "RGB") + ("A" if self.alpha is not None else "")


# One-channel modes, and the modes that carry an alpha channel.
_GRAY_MODES = ("1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F")
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")


def read_picture(path: PathLike, *, max_pixels: Optional[int] = None,
                 limit_name: str = "--max-pixels") -> Picture:
    """Decode an image file as a viewer shows it: EXIF orientation applied, transparency and gray kept apart.

    Training and evaluation read the stored pixels (``read_image``), as MATLAB and EDSR-PyTorch
    do, so that an HR image stays aligned with the LR image made from it; an image to upscale
    is read the way it looks, so that the result looks like it, only larger.
    """
    from PIL import ImageOps

    with _decoding(path), _opened(path, max_pixels) as img:
        check_pixels(path, img.size, max_pixels, limit_name)
        frames = int(getattr(img, "n_frames", 1) or 1)
        img.load()
        orientation = int(img.getexif().get(_EXIF_ORIENTATION, 1) or 1)
        upright = ImageOps.exif_transpose(img) if orientation != 1 else img
        return _picture(upright, path, frames, orientation)


_EXIF_ORIENTATION = 0x0112


def _picture(img: Any, path: PathLike, frames: int, orientation: int) -> Picture:
    gray = img.mode in _GRAY_MODES
    alpha = None
    key = img.info.get("transparency")
    if img.mode.startswith("I") and isinstance(key, int):
        # A 16-bit gray colour key: Pillow's conversions to 8 bits do not carry it into an alpha channel.
        alpha = np.where(np.asarray(img) == key, 0, 255).astype(np.uint8)
        colour = img
    elif img.mode in _ALPHA_MODES or key is not None:
        # A palette or colour key marks transparent colours: as an alpha channel, it can be upscaled.
        with_alpha = img.convert("LA" if gray and img.mode in ("L", "LA", "La") else "RGBA")
        alpha = np.asarray(with_alpha.getchannel("A"), dtype=np.uint8).copy()
        colour = with_alpha.convert("L" if with_alpha.mode == "LA" else "RGB")
    else:
        colour = img
    profile = img.info.get("icc_profile") or None
    note = ""
    if colour.mode == "CMYK":
        colour, note = _cmyk_to_srgb(colour, profile)
    # A profile describes the channels it was made for: a CMYK file's does not fit its RGB output.
    if profile is not None and bytes(profile[16:20]) != (b"GRAY" if gray else b"RGB "):
        profile = None
    return Picture(_to_rgb(colour, path), alpha, gray, profile, frames, orientation, note)


def _cmyk_to_srgb(img: Any, profile: Optional[bytes]) -> Tuple[Any, str]:
    """A CMYK image as a viewer shows it: through its own ICC profile to sRGB where it has one
    (Pillow's own conversion ignores the profile: print-oriented CMYK comes out too bright and
    saturated); else Pillow's conversion, with a note saying so."""
    if profile is not None and bytes(profile[16:20]) == b"CMYK":
        from PIL import ImageCms

        try:
            converted = ImageCms.profileToProfile(img, ImageCms.ImageCmsProfile(io.BytesIO(profile)),
                                                  ImageCms.createProfile("sRGB"), outputMode="RGB")
        except (ImageCms.PyCMSError, OSError, ValueError) as err:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            return img, (f"CMYK whose colour profile cannot be used ({reason}): converted to RGB without it; "
                         "colours may differ from what a viewer shows")
        return converted, "CMYK converted to sRGB through its colour profile; the output is sRGB"
    return img, "CMYK without a colour profile: converted to RGB by a plain formula; colours may differ " \
                "from what a viewer shows"


def header_size(path: PathLike) -> Optional[Tuple[int, int]]:
    """Return ``(width, height)`` from an image file's header without decoding its pixels; None if unreadable.

    Decoding reports an unreadable file with its own error later; here it only cannot be compared.
    """
    from PIL import Image

    try:
        with warnings.catch_warnings():
            # Only the header is read, so a huge declared size costs nothing here.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                return img.size
    except Exception:  # PIL raises OSError, SyntaxError, DecompressionBombError...
        return None


def check_pixels(path: PathLike, size: Tuple[int, int], max_pixels: Optional[int],
                 limit_name: str = "--max-pixels") -> None:
    """Raise ``SRDataError`` naming ``path`` if an image of ``size`` (width, height) exceeds ``max_pixels``
    (set by the option or key ``limit_name``)."""
    width, height = size
    if max_pixels is not None and width * height > max_pixels:
        raise SRDataError(
            f"{path}: image of {width}x{height} ({width * height:,} pixels) exceeds the limit of "
            f"{max_pixels:,} pixels; raise it with {limit_name}"
        )


@contextlib.contextmanager
def _opened(path: PathLike, max_pixels: Optional[int]) -> Iterator[Any]:
    from PIL import Image

    if max_pixels is None:
        with Image.open(path) as img:
            yield img
        return
    # Pillow warns, or refuses at open, past its own decompression-bomb limit, before the
    # caller's limit could be checked; with a limit of our own its check is redundant.
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        img = Image.open(path)
    finally:
        Image.MAX_IMAGE_PIXELS = saved
    with img:
        yield img


def _to_rgb(img, path: PathLike = "") -> np.ndarray:
    if img.mode == "F":
        gray = _levels_to_uint8(np.asarray(img, dtype=np.float64), FLOAT_RANGES, "float", path)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if img.mode in ("I;16", "I;16B", "I;16L"):
        # 16-bit gray: map the 16-bit range to 8 bits instead of clipping at 255.
        wide = np.asarray(img, dtype=np.float64)
        gray = np.clip(np.round(wide / 257.0), 0, 255).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if img.mode == "I":  # 32-bit integers: 8-, 16- or 32-bit levels, as their largest value shows
        gray = _levels_to_uint8(np.asarray(img, dtype=np.float64), INTEGER_RANGES, "32-bit integer", path)
        return np.repeat(gray[:, :, None], 3, axis=2)
    # convert("RGB") repeats L, expands palettes, and drops alpha from LA / RGBA / PA.
    return np.asarray(img.convert("RGB"), dtype=np.uint8).copy()


# The largest value of each range an image is read in, and what maps it to 255. Float images:
# [0, 1] (their convention), else 8-bit and 16-bit levels stored as floats. 32-bit integer
# images (Pillow's mode I, e.g. a 32-bit TIFF, or a 16-bit PNG as Pillow before 10.1 opens it):
# 8-, 16- or 31-bit levels (the positive range of a signed 32-bit integer).
FLOAT_RANGES = ((1.0, 255.0), (255.0, 1.0), (65535.0, 1.0 / 257.0))
INTEGER_RANGES = ((255.0, 1.0), (65535.0, 1.0 / 257.0), (2.0 ** 31 - 1, 255.0 / (2.0 ** 31 - 1)))


def _levels_to_uint8(values: np.ndarray, ranges, kind: str, path: PathLike) -> np.ndarray:
    """Map an image to 8 bits by the smallest of ``ranges`` that holds its largest value.

    Values below 0 become 0. NaN, infinities and values past the widest range: ``SRDataError``.
    """
    if not np.isfinite(values).all():
        raise SRDataError(f"{path}: {kind} image holds NaN or infinite values")
    top = float(values.max()) if values.size else 0.0
    factor = next((factor for limit, factor in ranges if top <= limit), None)
    if factor is None:
        limits = ", ".join(f"[0, {limit:g}]" for limit, _ in ranges)
        raise SRDataError(f"{path}: {kind} image with values up to {top:g}, past {ranges[-1][0]:g}: hpdl reads "
                          f"{kind} images in {limits}")
    return np.clip(np.round(values * factor), 0, 255).astype(np.uint8)


def output_format(path: PathLike) -> str:
    """Return the Pillow format that writes ``path`` (by its extension); ``SRDataError`` if none does."""
    from PIL import Image

    suffix = Path(path).suffix.lower()
    fmt = Image.registered_extensions().get(suffix)
    if fmt is None:
        raise SRDataError(f"{path}: unknown image extension {suffix!r} (use .png)")
    if fmt not in Image.SAVE:
        raise SRDataError(f"{path}: Pillow reads {fmt} images but cannot write them (use .png)")
    problem = _writer_problem(fmt)
    if problem is not None:
        raise SRDataError(f"{path}: {problem}; use .png")
    return fmt


# Wider than ICO's largest icon (256 px) and of no icon's shape, so that a writer that resizes
# to icon sizes shows it; small enough to cost milliseconds.
_PROBE_SIZE = (300, 200)


@functools.lru_cache(maxsize=None)
def _writer_problem(fmt: str) -> Optional[str]:
    """Why Pillow's ``fmt`` writer cannot hold an RGB result, or None when it can.

    A probe image tells before minutes of work rather than after: some save handlers cannot
    write RGB (XBM, BLP) or are stubs waiting for a plugin (BUFR, HDF5), and some succeed by
    writing another size (ICO shrinks to at most 256 px, ICNS scales to fixed icon sizes).
    """
    from PIL import Image, UnidentifiedImageError

    written = io.BytesIO()
    try:
        Image.new("RGB", _PROBE_SIZE).save(written, format=fmt)
    except Exception as err:  # Pillow raises OSError, ValueError or KeyError, by format
        return f"Pillow cannot write RGB images as {fmt} ({_first_line(err)})"
    written.seek(0)
    try:
        with Image.open(written) as back:  # the header only: no pixels are decoded
            size = back.size
    except (UnidentifiedImageError, OSError):
        return None  # a format Pillow writes but does not read back (PDF): nothing to compare
    if size != _PROBE_SIZE:
        return (f"Pillow's {fmt} writer does not keep the image's size (a {_PROBE_SIZE[0]}x{_PROBE_SIZE[1]} "
                f"image comes back {size[0]}x{size[1]})")
    return None


@functools.lru_cache(maxsize=None)
def writer_keeps(fmt: str, mode: str) -> bool:
    """Whether Pillow's ``fmt`` writer stores an image of ``mode`` (L, LA, RGB, RGBA) with its channels.

    Some refuse a mode (JPEG and alpha), some drop a channel without a word (BMP writes RGBA as
    RGB, GIF makes a palette): a probe image, written and its header read back, tells which.
    """
    from PIL import Image, UnidentifiedImageError

    written = io.BytesIO()
    try:
        Image.new(mode, _PROBE_SIZE).save(written, format=fmt)
    except Exception:  # Pillow raises OSError, ValueError or KeyError, by format
        return False
    written.seek(0)
    try:
        with Image.open(written) as back:  # the header only: no pixels are decoded
            return back.mode == mode
    except (UnidentifiedImageError, OSError):
        return False  # written but not read back (PDF): what it keeps is unknown


# Lossy formats at the quality SR tools write by default (OpenCV's imwrite, which BasicSR and
# EDSR-PyTorch users know: JPEG at 95, WebP lossless), not Pillow's defaults (JPEG 75, WebP
# 80), which blur away the detail the network has just restored.
_SAVE_OPTIONS: Dict[str, Dict[str, Any]] = {"JPEG": {"quality": 95}, "WEBP": {"lossless": True}}


def write_image(path: PathLike, image: np.ndarray, *,
                check_target: Optional[Callable[[str], None]] = None,
                icc_profile: Optional[bytes] = None) -> None:
    """Write a uint8 ``(H, W, 3)`` RGB array as an image file, atomically (temp file + rename).

    ``(H, W)`` is written as gray (L), ``(H, W, 2)`` as gray and alpha (LA), ``(H, W, 4)`` as
    RGBA. ``icc_profile`` is stored where the format holds one. ``check_target`` is passed to
    ``atomic_write``: it may refuse the file about to be replaced.
    """
    from PIL import Image

    fmt = output_format(path)
    image = np.ascontiguousarray(image, dtype=np.uint8)
    if image.ndim == 3 and image.shape[2] == 2:  # fromarray has no LA of its own
        pixels = Image.merge("LA", [Image.fromarray(np.ascontiguousarray(image[:, :, c])) for c in (0, 1)])
    else:
        pixels = Image.fromarray(image)
    extra = dict(_SAVE_OPTIONS.get(fmt, {}), **({"icc_profile": icc_profile} if icc_profile else {}))

    def save(f: Any) -> None:
        try:
            pixels.save(f, format=fmt, **extra)
        except Exception as err:
            if isinstance(err, OSError) and err.errno is not None:
                raise  # the file system's (disk full): atomic_write names the output
            # The image's, not the file's: too large for the format, say.
            raise SRDataError(f"{path}: Pillow cannot write this image as {fmt}: {_first_line(err)}") from None

    atomic_write(path, save, check_target=check_target)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def list_images(folder: PathLike) -> List[Path]:
    """List image files under ``folder`` recursively, sorted, skipping hidden entries."""
    root = Path(folder)
    if not root.is_dir():
        raise SRDataError(f"{root}: not a directory")
    found = [
        p
        for p in root.rglob("*")
        if p.suffix.lower() in IMAGE_EXTENSIONS
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    ]
    return sorted(found)


def bicubic_downscale(hr: np.ndarray, scale: int, downscaler: str = "matlab") -> np.ndarray:
    """Make the LR image: crop HR to a multiple of ``scale``, antialiased bicubic, uint8.

    ``matlab`` is MATLAB's ``imresize``, as the benchmark sets were made; ``torch`` is PyTorch's
    antialiased bicubic, the same kernel (a = -0.5) but clamped instead of mirrored at the borders
    and rounded once instead of after each pass.
    """
    if downscaler == "matlab":
        from hpdl.sr.imresize import matlab_downscale

        return matlab_downscale(hr, scale)
    if downscaler != "torch":
        raise ValueError(f"downscaler must be one of {DOWNSCALERS}, got {downscaler!r}")
    import torch
    import torch.nn.functional as F

    h, w = hr.shape[0] // scale, hr.shape[1] // scale
    if h == 0 or w == 0:
        raise ValueError(f"image of {hr.shape[1]}x{hr.shape[0]} is smaller than scale {scale}")
    x = torch.from_numpy(np.array(hr[: h * scale, : w * scale]))  # a writable copy
    x = x.permute(2, 0, 1)[None].to(torch.float32)
    y = F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
    return y[0].round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).contiguous().numpy()


class ImageCache:
    """Decode-once cache of images (and arrays derived from them) as memory-mapped ``.npy``."""

    def __init__(self, root: Optional[PathLike] = None, *, max_pixels: Optional[int] = None,
                 limit_name: str = "--max-pixels") -> None:
        """Keep entries under ``root``; refuse images of more than ``max_pixels`` (None: Pillow's limit),
        set by the option or key ``limit_name``."""
        self.root = Path(root) if root is not None else default_cache_dir() / "decoded"
        self.max_pixels = max_pixels
        self.limit_name = limit_name

    def image(self, path: PathLike) -> np.ndarray:
        """Return the decoded uint8 RGB image of ``path``, read-only and memory-mapped."""
        image = self.derived(path, "rgb", lambda: read_image(path, max_pixels=self.max_pixels,
                                                             limit_name=self.limit_name))
        # Decoded earlier, perhaps under another limit or none.
        check_pixels(path, (image.shape[1], image.shape[0]), self.max_pixels, self.limit_name)
        return image

    def derived(self, source: PathLike, variant: str, compute: Callable[[], np.ndarray]) -> np.ndarray:
        """Return ``compute()`` for ``source``, cached under the name ``variant``."""
        source = Path(source)
        try:
            st = source.stat()
        except FileNotFoundError:
            raise SRDataError(f"{source}: no such file") from None
        ident = hashlib.sha1(f"{source.resolve()}|{variant}".encode()).hexdigest()[:16]
        state = hashlib.sha1(f"{st.st_size}|{st.st_mtime_ns}|{_CACHE_VERSION}".encode()).hexdigest()[:8]
        prefix = f"{source.stem}.{variant}.{ident}."
        entry = self.root / f"{prefix}{state}.npy"
        if entry.exists():
            try:
                return np.load(entry, mmap_mode="r")
            except (OSError, ValueError):
                pass  # damaged entry (e.g. disk full): rebuild it below
        array = np.ascontiguousarray(compute())
        try:
            atomic_write(entry, lambda f: np.save(f, array))
        except OSError as err:
            # The entry's name means nothing to the user; the cache directory they chose does.
            raise SRDataError(f"{self.root}: cannot write the decode cache there ({err.strerror or err}); "
                              "give a writable cache directory (cache_dir= / --cache-dir)") from None
        # The source changed: entries for its older versions are dead weight.
        for stale in self.root.glob(f"{glob.escape(prefix)}*.npy"):
            if stale != entry:
                try:
                    stale.unlink()
                except FileNotFoundError:
                    pass  # another rank removed it first
        return np.load(entry, mmap_mode="r")


def _embedded_arrays(name: str) -> np.ndarray:
    try:
        import skimage.data as skdata
    except ImportError:
        raise SRDataError(
            "the embedded dataset needs scikit-image (pip install 'hpdl[sr]')"
        ) from None
    if name in ("motorcycle_left", "motorcycle_right"):
        left, right, _disparity = skdata.stereo_motorcycle()
        return left if name == "motorcycle_left" else right
    return getattr(skdata, name)()


def prepare_embedded(cache_dir: Optional[PathLike] = None) -> Dict[str, Path]:
    """Write scikit-image's photos once as PNG; return ``{"train": dir, "val": dir}``."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dirs = {"train": root / "embedded" / "train", "val": root / "embedded" / "val"}
    for split, names in (("train", EMBEDDED_TRAIN), ("val", EMBEDDED_VAL)):
        for name in names:
            target = dirs[split] / f"{name}.png"
            if not target.exists():
                image = _embedded_arrays(name)
                if image.ndim == 2:
                    image = np.repeat(image[:, :, None], 3, axis=2)
                write_image(target, image[:, :, :3])
    return dirs
