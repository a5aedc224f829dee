"""The ranges of `hpdl run`'s numeric options and of the numbers in horovodrun's config file.

A value out of range is refused before anything starts, with one line naming the option (or
the file's key) and the value. The lower bounds of the settings are :class:`hpdl.config.Settings`'
(it checks them, naming the variable); the upper bounds, the settings' own in the options'
units, keep values that parse but mean nothing (``1e300`` MB would become a 300-digit HPDL_FUSION_THRESHOLD) or that the
runtime's timers cannot wait for (Python's lock timeouts end near 292 years, ``timedelta``
near 2.7 million years), and ``inf`` / ``nan``, which the conversions to integers reject
with a traceback.
"""

from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional

from hpdl.config import C_INT_MAX, MAX_BYTES, YEAR_S
from hpdl.launch.hosts import LaunchError


class Limit(NamedTuple):
    """The range of one option: ``lowest`` (None: Settings checks it) up to ``highest``, in ``unit``."""

    lowest: Optional[float]
    highest: float
    unit: str
    highest_means: str = ""  # what the upper bound is in words, when its number says little


# `hpdl run` option (the namespace's name) -> its range.
LIMITS: Dict[str, Limit] = {
    "np": Limit(None, C_INT_MAX, "ranks"),  # at least 1: checked where the rank count is settled
    "fusion_threshold_mb": Limit(None, MAX_BYTES >> 20, "MB", "1 TiB"),
    "cycle_time_ms": Limit(None, YEAR_S * 1000, "ms", "a year"),
    "cache_capacity": Limit(None, C_INT_MAX, "entries"),
    "stall_warning_s": Limit(None, YEAR_S, "seconds", "a year"),
    "stall_timeout_s": Limit(None, YEAR_S, "seconds", "a year"),
    "stall_shutdown_s": Limit(None, YEAR_S, "seconds", "a year"),
    "start_timeout": Limit(0, YEAR_S, "seconds", "a year"),
    "ssh_port": Limit(1, 65535, ""),
    "ranks_per_gpu": Limit(1, C_INT_MAX, "ranks"),
    "autotune_warmup_samples": Limit(0, C_INT_MAX, "samples"),
    "autotune_steps_per_sample": Limit(1, C_INT_MAX, "steps"),
    "autotune_bayes_opt_max_samples": Limit(0, C_INT_MAX, "samples"),
    "autotune_gaussian_process_noise": Limit(0, 1, ""),
}


def check_number(name: str, option: str, value: Optional[float]) -> None:
    """Refuse ``value`` of ``option`` (a key of :data:`LIMITS`) out of its range; None is "not given".

    Args:
        name: how the error names the value: the flag (``--cycle-time-ms``) or the file and key.

    Raises:
        LaunchError: one line naming ``name`` and the value.
    """
    if value is None:
        return
    limit = LIMITS[option]
    unit = f" {limit.unit}" if limit.unit else ""
    if isinstance(value, float) and not math.isfinite(value):
        raise LaunchError(f"{name} must be a finite number, got {value}")
    if limit.lowest is not None and value < limit.lowest:
        raise LaunchError(f"{name} must be >= {_text(limit.lowest)}{unit}, got {_text(value)}")
    if value > limit.highest:
        means = f" ({limit.highest_means})" if limit.highest_means else ""
        raise LaunchError(f"{name} must be at most {_text(limit.highest)}{unit}{means}, got {_text(value)}")


def _text(value: float) -> str:
    """A number as written: 2147483647 and 0.5 in full, 1e+300 rather than its 301 digits."""
    if isinstance(value, int):  # may be too large for a float
        digits = str(abs(value))
        sign = "-" if value < 0 else ""
        return sign + digits if len(digits) <= 15 else f"{sign}{digits[0]}.{digits[1:4]}e+{len(digits) - 1}"
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:g}"
