"""EDSR and EDSR-baseline (Lim et al., CVPRW 2017) for x2, x3 and x4.

Module and parameter names follow EDSR-PyTorch (``head.0``, ``body.{i}.body.{0,2}``,
``body.{B}``, ``tail.0.{0,2}``, ``tail.1``, ``sub_mean``, ``add_mean``), so its published
``.pt`` state dicts load directly. Inputs and outputs are RGB in [0, 255] (``rgb_range`` 255).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from hpdl.sr.errors import ModelMismatchError

__all__ = [
    "DIV2K_RGB_MEAN",
    "MODELS",
    "SCALES",
    "EDSR",
    "EDSRConfig",
    "LoadReport",
    "build_model",
    "build_model_from_config",
    "config_from_state_dict",
    "count_parameters",
    "load_pretrained",
    "receptive_field_radius",
]

DIV2K_RGB_MEAN = (0.4488, 0.4371, 0.4040)
SCALES = (2, 3, 4)


@dataclasses.dataclass(frozen=True)
class EDSRConfig:
    """Architecture of one EDSR network; ``name`` is a label, the numbers define it."""

    name: str
    scale: int
    n_resblocks: int
    n_feats: int
    res_scale: float
    rgb_range: float = 255.0

    def __post_init__(self) -> None:
        if self.scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}, got {self.scale}")
        if self.n_resblocks < 0 or self.n_feats < 1:
            raise ValueError(f"bad EDSR size: {self.n_resblocks} blocks of {self.n_feats} features")

    def describe(self) -> str:
        """Return a short human description, e.g. ``edsr_baseline x2 (16 blocks, 64 features)``."""
        return f"{self.name} x{self.scale} ({self.n_resblocks} blocks, {self.n_feats} features)"

    def to_dict(self) -> Dict[str, Any]:
        """Return the config as a plain dict (safe for ``torch.load(weights_only=True)``)."""
        return dataclasses.asdict(self)


# The two published sizes: (residual blocks, features, residual scaling).
MODELS: Dict[str, Tuple[int, int, float]] = {
    "edsr_baseline": (16, 64, 1.0),
    "edsr": (32, 256, 0.1),
}


def _conv(in_ch: int, out_ch: int) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=True)


class MeanShift(nn.Conv2d):
    """Subtract (sign -1) or add (sign +1) the DIV2K mean: a frozen 1x1 conv, std 1."""

    def __init__(self, rgb_range: float, sign: int) -> None:
        super().__init__(3, 3, kernel_size=1)
        with torch.no_grad():
            self.weight.copy_(torch.eye(3).view(3, 3, 1, 1))
            self.bias.copy_(sign * rgb_range * torch.tensor(DIV2K_RGB_MEAN))
        self.requires_grad_(False)


class ResBlock(nn.Module):
    """conv-ReLU-conv without batch norm; returns ``x + res_scale * body(x)``."""

    def __init__(self, n_feats: int, res_scale: float) -> None:
        super().__init__()
        self.body = nn.Sequential(_conv(n_feats, n_feats), nn.ReLU(inplace=True), _conv(n_feats, n_feats))
        self.res_scale = res_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) * self.res_scale


class Upsampler(nn.Sequential):
    """Sub-pixel upsampling: n x [conv F->4F, PixelShuffle(2)] for 2^n, conv F->9F + shuffle(3) for 3."""

    def __init__(self, scale: int, n_feats: int) -> None:
        layers: List[nn.Module] = []
        if scale == 3:
            layers += [_conv(n_feats, 9 * n_feats), nn.PixelShuffle(3)]
        elif scale & (scale - 1) == 0:
            for _ in range(int(math.log2(scale))):
                layers += [_conv(n_feats, 4 * n_feats), nn.PixelShuffle(2)]
        else:
            raise ValueError(f"unsupported scale {scale}")
        super().__init__(*layers)


class EDSR(nn.Module):
    """Enhanced Deep Residual network for single-image super-resolution."""

    def __init__(self, config: EDSRConfig) -> None:
        super().__init__()
        self.config = config
        self.scale = config.scale
        f = config.n_feats
        # Registration order is the forward order: receptive_field_radius() relies on it.
        self.sub_mean = MeanShift(config.rgb_range, sign=-1)
        self.head = nn.Sequential(_conv(3, f))
        self.body = nn.Sequential(
            *[ResBlock(f, config.res_scale) for _ in range(config.n_resblocks)], _conv(f, f)
        )
        self.tail = nn.Sequential(Upsampler(config.scale, f), _conv(f, 3))
        self.add_mean = MeanShift(config.rgb_range, sign=+1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Upscale a batch ``(N, 3, H, W)`` in [0, 255] to ``(N, 3, sH, sW)``."""
        x = self.head(self.sub_mean(x))
        x = x + self.body(x)  # the long skip from the head output
        return self.add_mean(self.tail(x))


def _normalise_name(name: str) -> str:
    key = name.strip().lower().replace("-", "_")
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return key


def build_model(name: str, scale: int, *, device: Union[str, torch.device, None] = None) -> EDSR:
    """Build ``edsr_baseline`` or ``edsr`` for ``scale`` 2, 3 or 4 (``device="meta"`` for no memory)."""
    key = _normalise_name(name)
    blocks, feats, res_scale = MODELS[key]
    return build_model_from_config(EDSRConfig(key, int(scale), blocks, feats, res_scale), device=device)


def build_model_from_config(
    config: Union[EDSRConfig, Mapping[str, Any]], *, device: Union[str, torch.device, None] = None
) -> EDSR:
    """Build an EDSR from a config or its dict form (as stored in checkpoints)."""
    if not isinstance(config, EDSRConfig):
        known = {f.name for f in dataclasses.fields(EDSRConfig)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown EDSR config keys: {', '.join(unknown)}")
        config = EDSRConfig(**config)
    if device is None:
        return EDSR(config)
    with torch.device(device):
        return EDSR(config)


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    """Count parameters; the frozen MeanShift convs are excluded when ``trainable_only``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def receptive_field_radius(model: nn.Module) -> int:
    """Return the receptive-field radius in LR pixels, derived from the model's conv chain.

    Every conv with kernel k reaches (k-1)//2 * dilation pixels of its own input grid; after
    PixelShuffle(r) that grid is r times finer, so later convs reach 1/r as far in LR pixels.
    The radius is the sum along the longest path, rounded up. This assumes (true for EDSR) that
    modules are registered in forward order and every conv lies on that path: skip connections
    only give shorter paths. An overlap of this many LR pixels makes tiled inference exact.
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


def _strip_prefix(state_dict: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    # Weights saved from a DataParallel / DDP wrapper carry a "module." prefix.
    if state_dict and all(k.startswith("module.") for k in state_dict):
        return {k[len("module."):]: v for k, v in state_dict.items()}
    return dict(state_dict)


def config_from_state_dict(state_dict: Mapping[str, torch.Tensor]) -> Optional[EDSRConfig]:
    """Infer the EDSR architecture of a state dict from its tensor shapes (None if not EDSR).

    ``res_scale`` cannot be seen in weights: it is taken from the published model of that size
    (1.0 for unknown sizes).
    """
    sd = _strip_prefix(state_dict)
    try:
        feats = int(sd["head.0.weight"].shape[0])
        blocks = 0
        while f"body.{blocks}.body.0.weight" in sd:
            blocks += 1
        first = int(sd["tail.0.0.weight"].shape[0])
    except (KeyError, AttributeError, IndexError):
        return None
    if first == 9 * feats:
        scale = 3
    else:
        scale = 2 ** sum(1 for k in sd if k.startswith("tail.0.") and k.endswith(".weight"))
    if scale not in SCALES:
        return None
    for name, (b, f, res_scale) in MODELS.items():
        if (b, f) == (blocks, feats):
            return EDSRConfig(name, scale, blocks, feats, res_scale)
    return EDSRConfig("edsr_custom", scale, blocks, feats, 1.0)


@dataclasses.dataclass
class LoadReport:
    """What load_pretrained() copied and what it left as initialised."""

    loaded: List[str]
    skipped: List[str]


def _describe(sd: Mapping[str, torch.Tensor]) -> str:
    config = config_from_state_dict(sd)
    return config.describe() if config else "not an EDSR state dict"


def load_pretrained(
    model: EDSR, state_dict: Mapping[str, torch.Tensor], *, strict_tail: bool = False
) -> LoadReport:
    """Copy weights into ``model``; with ``strict_tail=False`` the ``tail.*`` keys are ignored.

    That is how EDSR starts x3 and x4 training from x2 weights: head and body are shared, the
    upsampler is fresh. Everything that is loaded must match name for name and shape for shape,
    otherwise ``ModelMismatchError`` says which models the two sides are.
    """
    source = _strip_prefix(state_dict)
    target = model.state_dict()

    def is_tail(key: str) -> bool:
        return key.startswith("tail.")

    wanted = [k for k in target if strict_tail or not is_tail(k)]
    offered = {k for k in source if strict_tail or not is_tail(k)}
    missing = [k for k in wanted if k not in source]
    unexpected = sorted(offered - set(target))
    wrong_shape = [k for k in wanted if k in source and tuple(source[k].shape) != tuple(target[k].shape)]
    if missing or unexpected or wrong_shape:
        first = (missing or unexpected or wrong_shape)[0]
        what = "missing" if missing else "unexpected" if unexpected else "has a different shape"
        raise ModelMismatchError(
            f"weights ({_describe(source)}) do not fit model ({model.config.describe()}): "
            f"{len(missing)} missing, {len(unexpected)} unexpected, {len(wrong_shape)} mis-shaped "
            f"tensors (first: {first!r} {what})"
        )
    with torch.no_grad():
        for key in wanted:
            target[key].copy_(source[key])
    skipped = [k for k in target if k not in wanted]
    return LoadReport(loaded=wanted, skipped=skipped)
