"""Exceptions of ``hpdl.sr``: each message is one line that names the file or model at fault.

The command line turns these into ``hpdl.cli_error.CliError`` so users see one line, not a traceback.
"""

from __future__ import annotations

__all__ = ["SRDataError", "BadImageError", "CorruptImageError", "ImageTooSmallError", "CheckpointError",
           "ModelMismatchError", "TrainError"]


class SRDataError(ValueError):
    """An image or dataset cannot be used: unreadable, missing its pair, wrong size, or empty."""


class BadImageError(SRDataError):
    """One image of a set cannot be used; ``on_bad_image="skip"`` skips it with a warning."""


class CorruptImageError(BadImageError):
    """An image file exists but cannot be decoded (corrupt, truncated, not an image)."""


class ImageTooSmallError(BadImageError):
    """An image is smaller than the scale, or too small to be measured at it."""


class CheckpointError(ValueError):
    """A checkpoint file cannot be read, or it was written for another model or scale."""


class ModelMismatchError(ValueError):
    """Weights do not fit a model (different depth, width or scale)."""


class TrainError(ValueError):
    """A user error of a training run that every rank raises alike, so rank 0 alone needs to report it."""
