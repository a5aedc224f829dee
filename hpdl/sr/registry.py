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
from typing import Any, Dict, List, Mapping, Optional, Tuple

__all__ = [
    "ARCHITECTURES",
    "SIZES",
    "Architecture",
    "ModelConfig",
    "ModelSize",
    "architecture",
    "assumed_res_scale",
    "describe_scales",
    "known_scales",
    "make_config",
    "model_names",
    "normalise_name",
    "published_size",
    "register",
    "scales_of",
    "spelling",
    "with_res_scale",
]


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A family of networks: the module that implements it and what does not carry across scales."""

    name: str  # stored in checkpoints as the config's ``arch``
    module: str  # defines build(config) and config_from_state_dict(state_dict)
    scales: Tuple[int, ...]
    # Key prefixes of the layers whose shapes depend on the scale: fresh when x2 weights start x3.
    scale_specific: Tuple[str, ...]
    # Whether ModelConfig.res_scale changes the network (EDSR's residual scaling): the weights
    # cannot show it, so weights from elsewhere need it said unless their size is a published one.
    res_scaled: bool = False

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


def known_scales() -> Tuple[int, ...]:
    """Return every scale some registered architecture is built for, ascending."""
    return tuple(sorted({scale for arch in ARCHITECTURES.values() for scale in arch.scales}))


def describe_scales(dash: bool = False) -> str:
    """Return the scales of the models for help texts: ``2, 3, 4``, or per model where they differ.

    ``dash`` spells the names with ``-`` for ``_``, as the benchmark command lines do.
    """
    groups: Dict[Tuple[int, ...], List[str]] = {}
    for name, size in SIZES.items():
        groups.setdefault(ARCHITECTURES[size.arch].scales, []).append(name.replace("_", "-") if dash else name)
    if len(groups) == 1:
        return ", ".join(map(str, next(iter(groups))))
    return "; ".join(f"{', '.join(names)}: {', '.join(map(str, scales))}" for scales, names in groups.items())


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


def published_size(arch: str, n_resblocks: int, n_feats: int) -> Optional[ModelSize]:
    """Return the published size of ``arch`` with these numbers, or None for another size."""
    return next((size for size in SIZES.values()
                 if size.arch == arch and (size.n_resblocks, size.n_feats) == (n_resblocks, n_feats)), None)


def assumed_res_scale(arch: str, n_resblocks: int, n_feats: int) -> float:
    """Return the res_scale hpdl takes for weights of this size that do not store it.

    The published model's for a published size (EDSR 32x256: 0.1), else 1.0, the default of
    EDSR-PyTorch and BasicSR.
    """
    published = published_size(arch, n_resblocks, n_feats)
    return float(published.res_scale) if published is not None else 1.0


def with_res_scale(config: ModelConfig, res_scale: Optional[float]) -> Tuple[ModelConfig, List[str]]:
    """Return the config of weights that do not store res_scale, set to ``res_scale`` if given, and notes.

    ``config`` is what the weights show: a published size has its published res_scale, another
    size 1.0, which a note then says is assumed. A ``res_scale`` that is not the published
    one labels the model ``<arch>_custom``. ``ValueError`` for a ``res_scale`` the
    architecture does not have, or one that is not positive.
    """
    published = published_size(config.arch, config.n_resblocks, config.n_feats)
    if res_scale is None:
        if not architecture(config.arch).res_scaled or published is not None:
            return config, []
        return config, [f"res_scale is not stored in the weights: assuming {float(config.res_scale)} for "
                        f"{config.describe()} (--res-scale gives another)"]
    if not architecture(config.arch).res_scaled:
        raise ValueError(f"{config.arch} has no res_scale")
    if not res_scale > 0:
        raise ValueError(f"res_scale must be > 0, got {res_scale}")
    name = published.name if published is not None and published.res_scale == res_scale else f"{config.arch}_custom"
    return dataclasses.replace(config, name=name, res_scale=float(res_scale)), []


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
    Architecture("edsr", "hpdl.sr.edsr", scales=(2, 3, 4), scale_specific=("tail.",), res_scaled=True),
    ModelSize("edsr_baseline", "edsr", 16, 64, 1.0),
    ModelSize("edsr", "edsr", 32, 256, 0.1),
)
register(
    Architecture("srresnet", "hpdl.sr.srresnet", scales=(2, 3, 4),
                 scale_specific=("upconv1.", "upconv2.", "conv_hr.", "conv_last.")),
    ModelSize("srresnet", "srresnet", 16, 64),
)
