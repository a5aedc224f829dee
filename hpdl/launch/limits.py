"""`hpdl run`'s options that set settings, and the ranges of its numeric options.

:data:`RUN_SETTINGS` is the one table of which setting each option gives every rank, and in
what unit: :func:`hpdl.launch.builders.settings_env` makes the ``HPDL_*`` variables from it,
and a numeric option's range is its setting's (declared on its field, :data:`hpdl.config.SPECS`)
in the option's unit, so that a value out of range is refused naming the option and the value typed
(``--fusion-threshold-mb must be >= 0 MB, got -1``), not the variable it would have become.
The numeric options that set no setting have their ranges in :data:`LIMITS`.

A value out of range is refused before anything starts, with one line naming the option (or
the config file's key) and the value. The upper bounds keep out values that parse but mean
nothing (``1e300`` MB would become a 300-digit HPDL_FUSION_THRESHOLD), and ``inf`` / ``nan``,
which the conversions to integers reject with a traceback.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, NamedTuple, Optional

from hpdl.config import C_INT_MAX, SPECS, YEAR_S, Bound, Settings, out_of_range, value_problem
from hpdl.launch.hosts import LaunchError


class RunSetting(NamedTuple):
    """The setting an `hpdl run` option gives every rank."""

    field: str  # the Settings field; its HPDL_* variable is the field's
    scale: float = 1  # the setting's units per unit of the option (MB -> bytes)
    unit: Optional[str] = None  # the option's unit where it is not the setting's
    path: bool = False  # a file: made absolute, since the ranks may start elsewhere


# `hpdl run` option (its RunOptions field and command-line name) -> the setting it sets.
RUN_SETTINGS: Dict[str, RunSetting] = {
    "backend": RunSetting("backend"),
    "timeline": RunSetting("timeline", path=True),
    "profile": RunSetting("profile", path=True),
    "fusion_threshold_mb": RunSetting("fusion_threshold", scale=1 << 20, unit="MB"),
    "cycle_time_ms": RunSetting("cycle_time_ms"),
    "cache_capacity": RunSetting("cache_capacity"),
    "stall_warning_s": RunSetting("stall_warning_s"),
    "stall_timeout_s": RunSetting("stall_timeout_s"),
    "start_timeout": RunSetting("start_timeout_s"),
    "hierarchical_allreduce": RunSetting("hierarchical_allreduce"),
    "autotune": RunSetting("autotune"),
    "autotune_log_file": RunSetting("autotune_log", path=True),
    "autotune_warmup_samples": RunSetting("autotune_warmup_samples"),
    "autotune_steps_per_sample": RunSetting("autotune_steps_per_sample"),
    "autotune_bayes_opt_max_samples": RunSetting("autotune_bayes_opt_max_samples"),
    "autotune_gaussian_process_noise": RunSetting("autotune_gaussian_process_noise"),
    "ranks_per_gpu": RunSetting("ranks_per_gpu"),
}

# The numeric options that set no setting -> their ranges.
LIMITS: Dict[str, Bound] = {
    "np": Bound(1, C_INT_MAX, "ranks"),
    # horovodrun's spelling of --stall-timeout-s, where 0 (never) keeps hpdl's timeout.
    "stall_shutdown_s": Bound(0, YEAR_S, "seconds", "a year"),
    "ssh_port": Bound(1, 65535),
    "num_nccl_streams": Bound(1, C_INT_MAX, "streams"),
}

# Options whose command-line name is not "--" and the field name with dashes.
_FLAGS = {"np": "-np", "stall_shutdown_s": "--stall-check-shutdown-time-seconds"}

_FIELDS = {field.name: field for field in dataclasses.fields(Settings)}


def numeric_options() -> List[str]:
    """The `hpdl run` options whose values are numbers (checked by :func:`check_number`)."""
    return list(LIMITS) + [option for option, setting in RUN_SETTINGS.items()
                           if SPECS[setting.field].bound is not None]


def flag(option: str) -> str:
    """How the command line spells ``option``: ``--cycle-time-ms``."""
    return _FLAGS.get(option, "--" + option.replace("_", "-"))


def setting_variable(option: str) -> str:
    """The ``HPDL_*`` variable that ``option`` sets."""
    return SPECS[RUN_SETTINGS[option].field].env


def setting_text(option: str, value) -> Optional[str]:
    """``value`` of ``option`` as its setting's variable holds it, or None when not given.

    A flag that is off, like an option not given, leaves the setting to the environment.
    """
    if value is None or value is False:
        return None
    setting = RUN_SETTINGS[option]
    if value is True:
        return "1"
    if isinstance(value, str):
        return value
    value = value * setting.scale
    if _FIELDS[setting.field].type in ("int", int) or float(value).is_integer():
        return str(int(round(value)))
    return repr(float(value))


def check_number(name: str, option: str, value: Optional[float]) -> None:
    """Refuse ``value`` of ``option`` out of its range; None is "not given".

    Args:
        name: how the error names the value: the flag (``--cycle-time-ms``) or the file and key.

    Raises:
        LaunchError: one line naming ``name`` and the value.
    """
    if value is None:
        return
    if option in LIMITS:
        problem = out_of_range(name, value, LIMITS[option])
    else:
        setting = RUN_SETTINGS[option]
        problem = value_problem(SPECS[setting.field], value, name, setting.scale, setting.unit)
    if problem is not None:
        raise LaunchError(problem)
