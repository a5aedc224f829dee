"""The model registry: every network hpdl.sr knows, its named sizes and the scales it supports.

Config checking, checkpoints, the trainer, the ``hpdl sr`` commands and ``hpdl bench`` read
model names, sizes and scales from here and nowhere else. A new architecture is one module that
defines ``build(config) -> nn.Module`` and ``config_from_state_dict(state_dict) -> ModelConfig
or None``, plus one ``register(...)`` call at the end of this file. This module imports no
torch: checking a config does not pay for it.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Any, Dict, Mapping, Tuple

__all__ = [
    "ARCHITECTURES",
    "SIZES",
    "Architecture",
    "ModelConfig",
    "ModelSize",
    "architecture",
    "make_config",
    "model_names",
    "normalise_name",
    "register",
    "scales_of",
    "spelling",
]


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A family of networks: the module that implements it and what does not carry across scales."""

    name: str  # stored in checkpoints as the config's ``arch``
    module: str  # defines build(config) and config_from_state_dict(state_dict)
    scales: Tuple[int, ...]
    # Key prefixes of the layers whose shapes depend on the scale: fresh when x2 weights start x3.
    scale_specific: Tuple[str, ...]

    def implementation(self) -> ModuleType:
        """Import and return the module that builds this architecture."""
        return importlib.import_module(self.module)


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """A published size of an architecture, selected by its name (``model=edsr_baseline``)."""

    name: str
    arch: str
    n_resblocks: int
    n_feats: int
    res_scale: float = 1.0


ARCHITECTURES: Dict[str, Architecture] = {}
SIZES: Dict[str, ModelSize] = {}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of one network; ``name`` is a label, ``arch`` and the numbers define it."""

    name: str
    scale: int
    n_resblocks: int
    n_feats: int
    res_scale: float
    rgb_range: float = 255.0
    arch: str = "edsr"  # checkpoints written before there was a choice hold EDSR

    def __post_init__(self) -> None:
        scales = architecture(self.arch).scales
        if self.scale not in scales:
            raise ValueError(f"scale must be one of {scales}, got {self.scale}")
        if self.n_resblocks < 0 or self.n_feats < 1:
            raise ValueError(f"bad {self.arch} size: {self.n_resblocks} blocks of {self.n_feats} features")

    def describe(self) -> str:
        """Return a short human description, e.g. ``edsr_baseline x2 (16 blocks, 64 features)``."""
        return f"{self.name} x{self.scale} ({self.n_resblocks} blocks, {self.n_feats} features)"

    def to_dict(self) -> Dict[str, Any]:
        """Return the config as a plain dict (safe for ``torch.load(weights_only=True)``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
        """Build a config from its dict form; unknown keys are an error."""
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown model config keys: {', '.join(unknown)}")
        return cls(**values)


def register(arch: Architecture, *sizes: ModelSize) -> None:
    """Make ``arch`` and its named ``sizes`` known to every part of hpdl.sr."""
    ARCHITECTURES[arch.name] = arch
    for size in sizes:
        if size.arch != arch.name:
            raise ValueError(f"size {size.name} belongs to {size.arch}, not {arch.name}")
        SIZES[size.name] = size


def model_names() -> Tuple[str, ...]:
    """Return the names ``model=`` accepts, in registration order."""
    return tuple(SIZES)


def spelling(name: str) -> str:
    """Return a model name as the registry spells names: lower case, ``_`` for ``-``."""
    return str(name).strip().lower().replace("-", "_")


def normalise_name(name: str) -> str:
    """Return the registered spelling of a model name (``EDSR-baseline`` -> ``edsr_baseline``)."""
    key = spelling(name)
    if key not in SIZES:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(SIZES)}")
    return key


def architecture(name: str) -> Architecture:
    """Return the registered architecture ``name``."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}") from None


def scales_of(name: str) -> Tuple[int, ...]:
    """Return the scales the model ``name`` can be built for."""
    return architecture(SIZES[normalise_name(name)].arch).scales


def make_config(name: str, scale: int, n_resblocks: int = 0, n_feats: int = 0) -> ModelConfig:
    """Return the config of model ``name`` at ``scale``; non-zero sizes replace the published ones.

    A model of another size than the published one is labelled ``<arch>_custom``, the name
    checkpoint loading gives it when it infers the architecture from the weights.
    """
    size = SIZES[normalise_name(name)]
    blocks, feats = n_resblocks or size.n_resblocks, n_feats or size.n_feats
    label = size.name if (blocks, feats) == (size.n_resblocks, size.n_feats) else f"{size.arch}_custom"
    return ModelConfig(label, int(scale), blocks, feats, size.res_scale, arch=size.arch)


register(
    Architecture("edsr", "hpdl.sr.edsr", scales=(2, 3, 4), scale_specific=("tail.",)),
    ModelSize("edsr_baseline", "edsr", 16, 64, 1.0),
    ModelSize("edsr", "edsr", 32, 256, 0.1),
)
register(
    Architecture("srresnet", "hpdl.sr.srresnet", scales=(2, 3, 4),
                 scale_specific=("upconv1.", "upconv2.", "conv_hr.", "conv_last.")),
    ModelSize("srresnet", "srresnet", 16, 64),
)
