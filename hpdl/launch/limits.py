"""`hpdl run`'s options that set settings, and the ranges of its numeric options.

The options that set settings are not written here: each is declared with its setting
(:class:`hpdl.config.RunOptionSpec` on the :class:`~hpdl.config.Settings` field), and this
module derives from the declarations what `hpdl run` needs: the options themselves, in the
groups of its help, with their variable, default and range added to their help
(:func:`add_setting_options`); the ``HPDL_*`` text each value becomes (:func:`setting_text`,
which :func:`hpdl.launch.builders.settings_env` uses); and their ranges, their setting's in the
option's unit, so that a value out of range is refused naming the option and the value typed
(``--fusion-threshold-mb must be >= 0 MB, got -1``), not the variable it would have become.
The numeric options that set no setting have their ranges in :data:`LIMITS`.

A value out of range is refused before anything starts, with one line naming the option (or
the config file's key) and the value. The upper bounds keep out values that parse but mean
nothing (``1e300`` MB would become a 300-digit HPDL_FUSION_THRESHOLD), and ``inf`` / ``nan``,
which the conversions to integers reject with a traceback.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional

from hpdl.config import (
    C_INT_MAX, SPECS, YEAR_S, Bound, RunOptionSpec, Settings, default, number_text, out_of_range, range_text,
    value_problem,
)
from hpdl.launch.hosts import LaunchError

# `hpdl run` option that sets a setting (its RunOptions.settings key and argparse dest) -> the
# Settings field it sets.
RUN_SETTINGS: Dict[str, str] = {spec.run.dest: name for name, spec in SPECS.items() if spec.run is not None}

# The numeric options that set no setting -> their ranges.
LIMITS: Dict[str, Bound] = {
    "np": Bound(1, C_INT_MAX, "ranks"),
    # horovodrun's spelling of --stall-timeout-s, where 0 (never) keeps hpdl's timeout.
    "stall_shutdown_s": Bound(0, YEAR_S, "seconds", "a year"),
    "ssh_port": Bound(1, 65535),
    "num_nccl_streams": Bound(1, C_INT_MAX, "streams"),
    # an elastic job's (hpdl/launch/elastic/options.py)
    "min_np": Bound(1, C_INT_MAX, "workers"),
    "max_np": Bound(1, C_INT_MAX, "workers"),
    "slots_per_host": Bound(1, C_INT_MAX, "slots"),
    "elastic_timeout": Bound(0, YEAR_S, "seconds", "a year", lowest_excluded=True),
    "reset_limit": Bound(0, C_INT_MAX, "resets"),
    "cooldown_range": Bound(0, YEAR_S, "seconds", "a year"),
}

# Options whose command-line name is not "--" and the field name with dashes.
_FLAGS = {"np": "-np", "stall_shutdown_s": "--stall-check-shutdown-time-seconds",
          "cooldown_range": "--blacklist-cooldown-range"}

# Settings field -> its type (the annotations are text: config.py has postponed evaluation).
_FIELD_TYPES: Dict[str, type] = {field.name: {"bool": bool, "int": int, "float": float, "str": str}[str(field.type)]
                                 for field in dataclasses.fields(Settings)}


def run_spec(option: str) -> RunOptionSpec:
    """The declaration of the option ``option`` that sets a setting."""
    return SPECS[RUN_SETTINGS[option]].run


def option_type(option: str) -> type:
    """The type of ``option``'s value: its setting's, or float for a setting in other units (MB)."""
    return float if run_spec(option).scale != 1 else _FIELD_TYPES[RUN_SETTINGS[option]]


def numeric_options() -> List[str]:
    """The `hpdl run` options whose values are numbers (checked by :func:`check_number`)."""
    return list(LIMITS) + [option for option in RUN_SETTINGS if option_type(option) in (int, float)]


def flag(option: str) -> str:
    """How the command line spells ``option``: ``--cycle-time-ms``."""
    if option in RUN_SETTINGS:
        return run_spec(option).flags[0]
    return _FLAGS.get(option, "--" + option.replace("_", "-"))


def setting_variable(option: str) -> str:
    """The ``HPDL_*`` variable that ``option`` sets."""
    return SPECS[RUN_SETTINGS[option]].env


def setting_text(option: str, value: Any) -> Optional[str]:
    """``value`` of ``option`` as its setting's variable holds it, or None when not given.

    A flag that is off, like an option not given, leaves the setting to the environment.
    """
    if value is None or value is False:
        return None
    if value is True:
        return "1"
    if isinstance(value, str):
        return value
    value = value * run_spec(option).scale
    if _FIELD_TYPES[RUN_SETTINGS[option]] is int or float(value).is_integer():
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
        spec = run_spec(option)
        problem = value_problem(SPECS[RUN_SETTINGS[option]], value, name, spec.scale, spec.unit)
    if problem is not None:
        raise LaunchError(problem)


def option_help(option: str) -> str:
    """``option``'s help: what it does, then its variable, its default and its range, from its declaration."""
    name = RUN_SETTINGS[option]
    setting, spec = SPECS[name], run_spec(option)
    kind = option_type(option)
    notes = [f"{setting.env}=1" if kind is bool else setting.env]
    value = default(name)
    if kind is not bool and value != "":
        notes.append(f"default {number_text(value / spec.scale) if kind in (int, float) else value}")
    if setting.bound is not None:
        notes.append(range_text(setting.bound, spec.scale, spec.unit))
    if spec.path:
        notes.append("made absolute")
    return f"{spec.help} ({'; '.join(notes)})".replace("%", "%%")  # argparse formats help with %


def add_setting_options(groups: Mapping[str, Any], placed: Optional[Mapping[str, Any]] = None) -> None:
    """Add to `hpdl run`'s parser every option that sets a setting, each in its declared group.

    Args:
        groups: the argument groups of `hpdl run`, by title.
        placed: the group to hold an option in place of its declared one, by option: a group of
            options that exclude one another (--backend and --gloo).
    """
    placed = placed or {}
    for option in RUN_SETTINGS:
        spec, kind = run_spec(option), option_type(option)
        group = placed.get(option, groups[spec.group])
        arguments: Dict[str, Any] = {"dest": option, "help": option_help(option), "default": None}
        if kind is bool:
            arguments["action"] = "store_true"
        else:
            arguments.update(metavar=spec.metavar, type=None if kind is str else kind)
            choices = SPECS[RUN_SETTINGS[option]].choices
            if choices:
                arguments.update(choices=choices, metavar=None)
        group.add_argument(*spec.flags, **arguments)

