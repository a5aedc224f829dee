"""Exceptions of ``hpdl.sr``: each message is one line that names the file or model at fault.

The command line turns these into ``hpdl.cli.CliError`` so users see one line, not a traceback.
"""

from __future__ import annotations

__all__ = ["SRDataError", "CorruptImageError", "CheckpointError", "ModelMismatchError"]


class SRDataError(ValueError):
    """An image or dataset cannot be used: unreadable, missing its pair, wrong size, or empty."""


class CorruptImageError(SRDataError):
    """An image file exists but cannot be decoded (corrupt, truncated, not an image)."""


class CheckpointError(ValueError):
    """A checkpoint file cannot be read, or it was written for another model or scale."""


class ModelMismatchError(ValueError):
    """Weights do not fit a model (different depth, width or scale)."""
