"""Building, inspecting and loading the registered super-resolution networks.

The networks themselves live in their own modules (``edsr``, ``srresnet``) and are found through
``hpdl.sr.registry``; everything here works on any of them.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any, Dict, List, Mapping, Optional, Union

import torch
from torch import nn

from hpdl.sr.errors import ModelMismatchError
from hpdl.sr.registry import ARCHITECTURES, ModelConfig, architecture, make_config

__all__ = [
    "LoadReport",
    "build_model",
    "build_model_from_config",
    "config_from_state_dict",
    "count_parameters",
    "describe_weights",
    "load_pretrained",
    "receptive_field_radius",
    "strip_prefix",
]


def build_model(name: str, scale: int, *, device: Union[str, torch.device, None] = None) -> nn.Module:
    """Build a model of the registry (``registry.model_names()``) for ``scale`` (``device="meta"`` for no memory)."""
    return build_model_from_config(make_config(name, scale), device=device)


def build_model_from_config(
    config: Union[ModelConfig, Mapping[str, Any]], *, device: Union[str, torch.device, None] = None
) -> nn.Module:
    """Build a network from a config or its dict form (as stored in checkpoints)."""
    if not isinstance(config, ModelConfig):
        config = ModelConfig.from_dict(config)
    implementation = architecture(config.arch).implementation()
    if device is None:
        return implementation.build(config)
    with torch.device(device):
        return implementation.build(config)


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    """Count parameters; frozen ones (EDSR's MeanShift convs) are excluded when ``trainable_only``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def receptive_field_radius(model: nn.Module) -> int:
    """Return the receptive-field radius in LR pixels, derived from the model's conv chain.

    Every conv with kernel k reaches (k-1)//2 * dilation pixels of its own input grid; after
    PixelShuffle(r) that grid is r times finer, so later convs reach 1/r as far in LR pixels.
    The radius is the sum along the longest path, rounded up. This assumes (true for every
    registered network) that modules are registered in forward order and every conv lies on that
    path: skip connections, and SRResNet's bilinear path (one pixel), only give shorter paths.
    An overlap of this many LR pixels makes tiled inference exact (up to float rounding).
    """
    radius = Fraction(0)
    upscale = 1
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            if module.stride != (1, 1):
                raise ValueError("receptive_field_radius() handles stride-1 convs only")
            reach = max((k - 1) // 2 * d for k, d in zip(module.kernel_size, module.dilation))
            radius += Fraction(reach, upscale)
        elif isinstance(module, nn.PixelShuffle):
            upscale *= module.upscale_factor
    return math.ceil(radius)


def strip_prefix(state_dict: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Drop the ``module.`` prefix that weights saved from a DataParallel / DDP wrapper carry."""
    if state_dict and all(k.startswith("module.") for k in state_dict):
        return {k[len("module."):]: v for k, v in state_dict.items()}
    return dict(state_dict)


def config_from_state_dict(state_dict: Mapping[str, torch.Tensor]) -> Optional[ModelConfig]:
    """Infer which registered network a state dict is, and its size and scale (None if none)."""
    sd = strip_prefix(state_dict)
    for arch in ARCHITECTURES.values():
        config = arch.implementation().config_from_state_dict(sd)
        if config is not None:
            return config
    return None


def describe_weights(state_dict: Mapping[str, torch.Tensor]) -> str:
    """Return what a state dict holds, e.g. ``edsr_baseline x2 (16 blocks, 64 features)``."""
    config = config_from_state_dict(state_dict)
    return config.describe() if config else "not a known model's state dict"


@dataclasses.dataclass
class LoadReport:
    """What load_pretrained() copied and what it left as initialised."""

    loaded: List[str]
    skipped: List[str]


def load_pretrained(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict_tail: bool = False
) -> LoadReport:
    """Copy weights into ``model``; with ``strict_tail=False`` the scale-specific layers are left fresh.

    That is how EDSR starts x3 and x4 training from x2 weights: head and body are shared, the
    upsampler (the architecture's ``scale_specific`` layers) is fresh. Everything that is loaded
    must match name for name and shape for shape, otherwise ``ModelMismatchError`` says which
    models the two sides are.
    """
    source = strip_prefix(state_dict)
    target = model.state_dict()
    fresh = architecture(model.config.arch).scale_specific

    def kept(key: str) -> bool:
        return strict_tail or not key.startswith(fresh)

    wanted = [k for k in target if kept(k)]
    offered = {k for k in source if kept(k)}
    missing = [k for k in wanted if k not in source]
    unexpected = sorted(offered - set(target))
    wrong_shape = [k for k in wanted if k in source and tuple(source[k].shape) != tuple(target[k].shape)]
    if missing or unexpected or wrong_shape:
        first = (missing or unexpected or wrong_shape)[0]
        what = "missing" if missing else "unexpected" if unexpected else "has a different shape"
        raise ModelMismatchError(
            f"weights ({describe_weights(source)}) do not fit model ({model.config.describe()}): "
            f"{len(missing)} missing, {len(unexpected)} unexpected, {len(wrong_shape)} mis-shaped "
            f"tensors (first: {first!r} {what})"
        )
    with torch.no_grad():
        for key in wanted:
            target[key].copy_(source[key])
    skipped = [k for k in target if k not in wanted]
    return LoadReport(loaded=wanted, skipped=skipped)
