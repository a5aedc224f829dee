"""A network's levels, parsed from the ``--network`` spec.

Two levels: ``intra`` among the ranks of one node, ``inter`` between nodes. Each is either an
alpha-beta link (a latency per message and a bandwidth per direction, from figures or a preset
of presets.py) or a measured allreduce curve (curves.py). The spec, comma-separated::

    intra=nvlink:150GB/s:2us,inter=ib-edr:12.5GB/s:1.5us   LEVEL=LABEL:BANDWIDTH:LATENCY
    intra=nvlink2,inter=ib-edr                               LEVEL=PRESET
    nvlink2,ib-edr                                           a bare PRESET fills its own level
    intra=shm,inter=measured:bench.json                      LEVEL=measured:FILE (hpdl's JSON)
    inter=measured:osu.txt@16                                LEVEL=measured:FILE@RANKS (OSU's text)

No level is ever filled in by default: a network that lacks a level a job needs (intra with
several ranks on a node, inter with several nodes) is refused when costs are asked of it
(allreduce_cost.check_allreduce), naming the level, since a guessed fabric would decide the
prediction unseen.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from typing import Dict, Mapping, Optional, Tuple, Union

from hpdl.profile.predict.curves import CurveError, MeasuredCurve, read_curve
from hpdl.profile.predict.presets import INTER, INTRA, PRESETS

__all__ = ["NetworkSpecError", "AlphaBeta", "Level", "Network", "LEVELS", "parse_network", "preset_link",
           "parse_bandwidth", "parse_latency", "BANDWIDTH_UNITS", "LATENCY_UNITS"]

LEVELS = (INTRA, INTER)

# Bytes per second in each unit: decimal as vendors and nccl-tests' GB/s, binary where the name
# says so, bits where it says bit. Case matters: "Gb/s" is refused rather than guessed.
BANDWIDTH_UNITS: Mapping[str, float] = types.MappingProxyType({
    "B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9,
    "KiB/s": 2.0 ** 10, "MiB/s": 2.0 ** 20, "GiB/s": 2.0 ** 30,
    "Mbit/s": 1e6 / 8, "Gbit/s": 1e9 / 8,
})
LATENCY_UNITS: Mapping[str, float] = types.MappingProxyType({"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0})

_QUANTITY = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]([-+]?\d+))?\s*(\S+)\s*")
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")
_FORMS = "LEVEL=PRESET, LEVEL=LABEL:BANDWIDTH:LATENCY or LEVEL=measured:FILE[@RANKS], LEVEL being intra or inter"


class NetworkSpecError(ValueError):
    """A ``--network`` spec (or a network a job needs more of) that cannot be used; one line."""


@dataclasses.dataclass(frozen=True)
class AlphaBeta:
    """A link of the alpha-beta model: ``latency`` seconds per message, ``bandwidth`` bytes/s per direction."""

    label: str
    bandwidth: float
    latency: float
    source: str = "given in the spec"

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise NetworkSpecError(f"{self.label}: bandwidth must be positive, got {self.bandwidth}")
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise NetworkSpecError(f"{self.label}: latency must be 0 or more, got {self.latency}")

    @property
    def alpha(self) -> float:
        """Seconds per message."""
        return self.latency

    @property
    def beta(self) -> float:
        """Seconds per byte, the inverse of the bandwidth per direction."""
        return 1.0 / self.bandwidth

    def describe(self) -> str:
        """One line: the figures and where they come from."""
        return (f"{self.label}: {self.bandwidth / 1e9:.4g} GB/s per direction, {self.latency * 1e6:.3g} us "
                f"per message ({self.source})")


Level = Union[AlphaBeta, MeasuredCurve]


@dataclasses.dataclass(frozen=True)
class Network:
    """The levels of a network; a level the spec did not give is None."""

    intra: Optional[Level] = None
    inter: Optional[Level] = None

    def level(self, name: str) -> Optional[Level]:
        """The level called ``name`` (intra or inter), or None when not given."""
        if name not in LEVELS:
            raise ValueError(f"unknown level {name!r}; levels: {', '.join(LEVELS)}")
        return self.intra if name == INTRA else self.inter

    def describe(self) -> Tuple[str, ...]:
        """One line per level given, for a prediction's output."""
        return tuple(f"{name}: {level.describe()}" for name in LEVELS if (level := self.level(name)) is not None)


def preset_link(name: str) -> AlphaBeta:
    """The alpha-beta link of the preset ``name``."""
    if name not in PRESETS:
        raise NetworkSpecError(f"unknown network preset {name!r}; presets: {', '.join(PRESETS)}")
    preset = PRESETS[name]
    return AlphaBeta(name, preset.bandwidth, preset.latency, source=f"preset: {preset.source}")


def parse_network(spec: str) -> Network:
    """Parse a ``--network`` spec (the module's docstring has the forms) into its levels.

    Reads the files that ``measured:`` parts name, and nothing else.

    Raises:
        NetworkSpecError: one line naming the part at fault and what is accepted.
    """
    levels: Dict[str, Level] = {}
    given_by: Dict[str, str] = {}
    parts = [p.strip() for p in spec.split(",")]
    if not spec.strip():
        raise NetworkSpecError(f"the network spec is empty; give {_FORMS} (e.g. intra=nvlink2,inter=ib-edr)")
    for part in parts:
        if not part:
            raise NetworkSpecError(f"an empty part in the network spec {spec!r}; parts are separated by single commas")
        name, level = _parse_part(part)
        if name in levels:
            raise NetworkSpecError(f"level {name} given twice in the network spec: {given_by[name]!r} and {part!r}")
        levels[name], given_by[name] = level, part
    return Network(**levels)


def _parse_part(part: str) -> Tuple[str, Level]:
    if "=" not in part:
        if part not in PRESETS:
            raise NetworkSpecError(f"{part!r} is neither a preset nor LEVEL=...; presets: {', '.join(PRESETS)}; "
                                   f"forms: {_FORMS}")
        return PRESETS[part].level, preset_link(part)
    name, value = (s.strip() for s in part.split("=", 1))
    if name not in LEVELS:
        raise NetworkSpecError(f"unknown level {name!r} in {part!r}; levels: {', '.join(LEVELS)}")
    if value.startswith("measured:"):
        return name, _measured(value[len("measured:"):].strip(), part)
    fields = [f.strip() for f in value.split(":")]
    if len(fields) == 1:
        if fields[0] not in PRESETS:
            raise NetworkSpecError(f"unknown network preset {fields[0]!r} in {part!r}; presets: {', '.join(PRESETS)}")
        return name, preset_link(fields[0])
    if len(fields) != 3:
        raise NetworkSpecError(f"{part!r} needs LABEL:BANDWIDTH:LATENCY (e.g. {name}=nvlink:150GB/s:2us), "
                               f"a preset ({', '.join(PRESETS)}) or measured:FILE")
    label, bandwidth, latency = fields
    if not _LABEL.fullmatch(label):
        raise NetworkSpecError(f"bad label {label!r} in {part!r}; a label is letters, digits and _.+- "
                               "(starting with a letter or digit)")
    return name, AlphaBeta(label, _quantity(bandwidth, BANDWIDTH_UNITS, "bandwidth", True, part),
                           _quantity(latency, LATENCY_UNITS, "latency", False, part))


def _measured(target: str, part: str) -> MeasuredCurve:
    # FILE@RANKS: the rank count only when what follows the last @ is a number, so that a
    # file name may hold an @ of its own.
    file, ranks = target, None
    head, at, tail = target.rpartition("@")
    if at and tail.isdigit():
        file, ranks = head, int(tail)
    if not file:
        raise NetworkSpecError(f"{part!r} names no file; write measured:FILE or measured:FILE@RANKS")
    try:
        return read_curve(file, ranks)
    except CurveError as err:
        raise NetworkSpecError(f"{err} (in {part!r})") from None


def parse_bandwidth(text: str) -> float:
    """Parse a bandwidth such as ``12.5GB/s``, ``100Gbit/s``, ``800 MiB/s`` into bytes per second."""
    return _quantity(text, BANDWIDTH_UNITS, "bandwidth", positive=True)


def parse_latency(text: str) -> float:
    """Parse a latency such as ``1.5us``, ``500ns``, ``0.002ms`` into seconds."""
    return _quantity(text, LATENCY_UNITS, "latency", positive=False)


def _quantity(text: str, units: Mapping[str, float], what: str, positive: bool, part: Optional[str] = None) -> float:
    where = f" in {part!r}" if part is not None else ""
    match = _QUANTITY.fullmatch(text)
    if not match or match.group(3) not in units:
        raise NetworkSpecError(f"bad {what} {text!r}{where}: write a number and a unit among {', '.join(units)}")
    mantissa, exponent, unit = match.groups()
    value = float(mantissa + (f"e{exponent}" if exponent else "")) * units[unit]
    if not math.isfinite(value) or (positive and value <= 0):
        raise NetworkSpecError(f"bad {what} {text!r}{where}: it must be {'more than 0' if positive else 'finite'}")
    return value
