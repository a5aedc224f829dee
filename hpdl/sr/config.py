"""Training configuration: one frozen dataclass, built once from a YAML file and ``key=value`` overrides.

``hpdl sr train --config demo lr=2e-4 resume=auto`` reads the packaged ``configs/demo.yaml``
(or any YAML path), applies the overrides, and checks every value against its field's type
and range. Unknown keys are errors that name the key and the file, so a typo (``lr_decay``)
fails at start-up instead of silently training with a default.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Mapping, Optional, Tuple, Union

if TYPE_CHECKING:
    import torch

__all__ = ["DEVICE_NAMES", "ConfigError", "TrainConfig", "config_names", "is_device_name", "load_config",
           "parse_overrides", "resolve_config_path", "resolve_device"]

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
COMPRESSIONS = ("none", "fp16", "bf16")
AMP_MODES = ("none", "bf16", "fp16")  # hpdl.torch.mixed_precision.AMP_MODES, without importing torch here
METRIC_SPACES = ("y", "rgb")
BAD_IMAGE_POLICIES = ("fail", "skip")
DOWNSCALERS = ("matlab", "torch")  # hpdl.sr.images.DOWNSCALERS, without importing numpy here
# A small file can declare a huge image. The default keeps the x4 output of the largest input
# allowed (3 bytes a pixel, 16x the input's pixels) under 1 GB, and an evaluated image's float
# copies (HR, output, bicubic) within a few GB; training and validation images are held likewise.
DEFAULT_MAX_PIXELS = 20_000_000
MAX_SEED_RANKS = 2**16
MAX_SEED = 2**32 - MAX_SEED_RANKS  # + the rank (below MAX_SEED_RANKS) stays below 2**32


class ConfigError(ValueError):
    """A configuration key is unknown or its value cannot be used; the message names the key."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything one training run depends on. Defaults are the EDSR paper's x2 recipe."""

    # -- model --
    model: str = "edsr_baseline"  # a model of hpdl/sr/registry.py (model_names())
    scale: int = 2
    n_resblocks: int = 0  # 0: the named model's depth (16 / 32 / 16); smaller for tests and sketches
    n_feats: int = 0  # 0: the named model's width (64 / 256 / 64)
    pretrained: Optional[str] = None  # weights to start from; the tail is skipped (x3/x4 from x2)

    # -- data --
    data: str = "embedded"  # DIV2K root, benchmark set, image folder or 'embedded'
    train_range: Optional[str] = None  # DIV2K image numbers, e.g. '1-800' (the default)
    # Default: the validation split of `data` (DIV2K 801-900, the embedded val photos); other
    # layouts have none and are used whole, so then validation scores the training images.
    val_data: Optional[str] = None
    val_range: Optional[str] = None  # DIV2K image numbers, e.g. '801-810' (default 801-900)
    patch_size: int = 48  # LR patch side; HR patches are patch_size * scale
    batch_size: int = 16  # per rank, or per group of `spatial` ranks (ignored when global_batch_size is set)
    global_batch_size: int = 0  # >0: split this over the ranks, or the groups (must divide evenly)
    repeat: int = 20  # passes over the training images per sampler epoch
    augment: bool = True  # random flips and transposes (the 8 dihedral transforms)
    workers: int = 2  # DataLoader worker processes per rank (0: load in the training process)
    cache_dir: Optional[str] = None  # decode cache (default ~/.cache/hpdl/sr)
    on_bad_image: str = "fail"  # fail, or skip with a warning images undecodable or too small
    downscaler: str = "matlab"  # LR made from HR (folders, embedded): matlab (imresize, as the benchmarks) or torch
    max_pixels: int = DEFAULT_MAX_PIXELS  # refuse training/validation image files of more pixels (checked in the header)

    # -- optimisation --
    lr: float = 1e-4
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    lr_decay_steps: int = 200_000  # multiply lr by gamma every this many updates (0: never)
    gamma: float = 0.5
    total_updates: int = 300_000
    warmup_updates: int = 0  # linear ramp of lr from 0 over this many updates
    scale_lr_with_world: bool = False  # lr *= number of ranks (with per-rank batches)
    compression: str = "none"  # gradient allreduce compression: none, fp16, bf16
    # Mixed precision: none, bf16 (autocast) or fp16 (autocast and loss scaling, CUDA only), as
    # EDSR-PyTorch's --precision half; weights and the optimizer stay float32 (hpdl/torch/mixed_precision.py).
    amp: str = "none"
    # Let the gradients' exchange overlap the next forward (DistributedOptimizer's
    # overlap_forward): for networks slower than the compute, e.g. across nodes over TCP.
    overlap_forward: bool = False
    # Run the training forward through torch.compile (whole patches only: spatial=1).
    compile: bool = False
    ema_decay: float = 0.0  # exponential moving average of the weights (0: off; BasicSR 0.999)
    # Ranks that share each patch, split into row bands (hpdl.torch.spatial, exact to one process);
    # the job's ranks / spatial data-parallel replicas take different patches. 1: data parallel only.
    spatial: int = 1

    # -- validation, logging, checkpoints --
    val_every: int = 0  # validate every this many updates (0: only at the end)
    val_at_end: bool = True  # validate the final weights for the summary (else only val_every's multiples)
    val_sharded: bool = True  # split the validation images over the ranks
    val_tile: int = 0  # run validation in exact tiles (up to float rounding) of this many LR pixels (0: whole images)
    val_space: str = "y"  # PSNR on Y (shave scale) or rgb (shave scale + 6, DIV2K in the paper)
    ckpt_every: int = 1000  # write out_dir/last.pt every this many updates (0: only at the end)
    log_every: int = 100  # log loss, lr and img/s every this many updates
    progress: bool = True  # progress bar on rank 0 (hpdl.sr.progress: rarely where stderr is not a terminal)
    out_dir: str = "runs/sr"
    resume: Optional[str] = None  # checkpoint to continue from, or 'auto' (out_dir/last.pt if any)
    overwrite: bool = False  # start over in an out_dir holding an earlier run (without it: refused)

    # -- machine --
    seed: int = 0
    threads: int = 0  # torch threads per rank (0: OMP_NUM_THREADS, else this node's cores / ranks on it)
    # auto (this rank's GPU if CUDA is available, else cpu), cpu, cuda (this rank's GPU) or cuda:N; this
    # rank's GPU is cuda:<local rank>, or cuda:<local rank // K> with K ranks per GPU (HPDL_RANKS_PER_GPU)
    device: str = "auto"

    def __post_init__(self) -> None:
        for key, expected in _field_types().items():
            value = getattr(self, key)
            if not _is_instance(value, expected):
                raise ConfigError(f"{key}: expected {_type_name(expected)}, got {value!r}")
        _check_ranges(self)

    def to_dict(self) -> Dict[str, Any]:
        """Return the config as plain values (lists for tuples), fit for YAML and checkpoints."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config") -> "TrainConfig":
        """Build a config from a mapping; values are converted to the fields' types."""
        return cls().replace(values, source=source)

    def replace(self, values: Mapping[str, Any], *, source: str = "overrides") -> "TrainConfig":
        """Return a copy with ``values`` (strings or typed values) applied; errors name ``source``."""
        types = _field_types()
        unknown = [k for k in values if k not in types]
        if unknown:
            hint = _close_match(unknown[0], types)
            raise ConfigError(f"{source}: unknown key {unknown[0]!r}{hint}")
        try:
            converted = {k: _convert(k, v, types[k]) for k, v in values.items()}
            return dataclasses.replace(self, **converted)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None


def _check_ranges(c: TrainConfig) -> None:
    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise ConfigError(f"{key}: must be {what}, got {getattr(c, key)!r}")

    from hpdl.sr import registry

    need(registry.spelling(c.model) in registry.model_names(), "model", " or ".join(registry.model_names()))
    if registry.spelling(c.model) in registry.model_names():
        scales = registry.scales_of(c.model)
        need(c.scale in scales, "scale", " or ".join(map(str, scales)))
    for key in ("n_resblocks", "n_feats", "global_batch_size", "workers", "warmup_updates", "lr_decay_steps",
                "val_every", "val_tile", "ckpt_every", "threads"):
        need(getattr(c, key) >= 0, key, ">= 0")
    for key in ("patch_size", "batch_size", "repeat", "total_updates", "log_every", "max_pixels", "spatial"):
        need(getattr(c, key) >= 1, key, ">= 1")
    # Adam keeps lr and eps as float32 numbers beside the weights: past 1 neither means anything
    # (and past float32's range Adam fails at its first step, after out_dir is written).
    need(math.isfinite(c.lr) and 0 < c.lr <= 1, "lr", "a number in (0, 1]")
    need(all(0 <= b < 1 for b in c.betas), "betas", "two numbers in [0, 1)")
    need(math.isfinite(c.eps) and 0 < c.eps <= 1, "eps", "a number in (0, 1]")
    # Rank r seeds its generators with seed + r, which NumPy takes only within 32 bits; the ranks
    # are not known yet, so the range leaves room for up to MAX_SEED_RANKS of them.
    need(0 <= c.seed <= MAX_SEED, "seed", f"in 0..{MAX_SEED} (seed + rank must fit 32 bits)")
    need(0 < c.gamma <= 1, "gamma", "in (0, 1]")
    need(0 <= c.ema_decay < 1, "ema_decay", "in [0, 1)")
    need(c.compression in COMPRESSIONS, "compression", " or ".join(COMPRESSIONS))
    need(c.amp in AMP_MODES, "amp", " or ".join(AMP_MODES))
    if c.compile and c.spatial > 1:  # SpatialParallel dispatches the model's eager calls one by one
        need(False, "compile", "false with spatial > 1 (spatial parallelism runs the model's calls eagerly)")
    if c.amp == "fp16" and c.overlap_forward:  # overlap_forward leaves each update to the next forward
        from hpdl.torch.mixed_precision import FP16_OVERLAP_REASON

        need(False, "overlap_forward", f"false with amp=fp16 ({FP16_OVERLAP_REASON})")
    need(c.val_space in METRIC_SPACES, "val_space", "y or rgb")
    need(c.on_bad_image in BAD_IMAGE_POLICIES, "on_bad_image", "fail or skip")
    need(c.downscaler in DOWNSCALERS, "downscaler", " or ".join(DOWNSCALERS))
    need(is_device_name(c.device), "device", DEVICE_NAMES)
    need(bool(c.out_dir), "out_dir", "a directory")
    need(bool(c.data), "data", "a dataset folder or 'embedded'")  # "" would be the current directory
    need(c.val_data != "", "val_data", "a dataset folder, 'embedded' or null")
    need(not (c.overwrite and c.resume), "overwrite", "false when resuming (resume= continues a run)")
    # The linear scaling rule follows the global batch; a global_batch_size keeps it whatever the ranks.
    need(not (c.scale_lr_with_world and c.global_batch_size), "scale_lr_with_world",
         "false with global_batch_size (the global batch does not grow with the ranks)")
    for key in ("train_range", "val_range"):
        if getattr(c, key) is not None:
            from hpdl.sr.datasets import parse_range

            try:
                parse_range(getattr(c, key))
            except ValueError:
                need(False, key, "a range like 801-900")


# -- devices ------------------------------------------------------------------------------------

DEVICE_NAMES = "auto, cpu, cuda or cuda:N"


def is_device_name(text: str) -> bool:
    """Return whether ``text`` names a device hpdl.sr runs on (see ``DEVICE_NAMES``)."""
    return re.fullmatch(r"auto|cpu|cuda(:\d+)?", text) is not None


def resolve_device(name: str, setting: str, local_gpu: Callable[[], int] = lambda: 0) -> "torch.device":
    """Return the torch device ``name`` stands for; ``ConfigError`` naming ``setting`` if unusable.

    ``auto`` is CUDA when available, else the CPU; ``cuda`` alone is this rank's GPU on its node,
    ``local_gpu()`` (``hvd.local_gpu``: the local rank's, hpdl/comm/devices.py).
    """
    if not is_device_name(name):
        raise ConfigError(f"{setting}: must be {DEVICE_NAMES}, got {name!r}")
    import torch

    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"{setting}: {name} requested but CUDA is not available")
    index_text = name.partition(":")[2]
    try:
        index = int(index_text) if index_text else local_gpu()
    except ValueError as err:  # this rank's GPU is not on this node (hpdl.comm.devices.DeviceError)
        raise ConfigError(f"{setting}={name}: {err}") from None
    if index >= torch.cuda.device_count():
        raise ConfigError(f"{setting}: {name} requested but this node has {torch.cuda.device_count()} GPU(s)")
    return torch.device("cuda", index)


# -- typed conversion of YAML values and command-line strings --------------------------------

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_NONE = ("", "none", "null", "~")


def _field_types() -> Dict[str, Any]:
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


def _optional_of(tp: Any) -> Any:
    # Optional[X] -> X; anything else -> None.
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return None


def _type_name(tp: Any) -> str:
    inner = _optional_of(tp)
    if inner is not None:
        return f"{_type_name(inner)} or null"
    if typing.get_origin(tp) is tuple:
        return f"{len(typing.get_args(tp))} numbers"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _is_instance(value: Any, tp: Any) -> bool:
    inner = _optional_of(tp)
    if inner is not None:
        return value is None or _is_instance(value, inner)
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        return isinstance(value, tuple) and len(value) == len(args) and all(map(_is_instance, value, args))
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, float)
    return isinstance(value, tp)


def _convert(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML value or a command-line string to ``tp``; ConfigError names ``key``."""
    try:
        return _convert_to(value, tp)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}") from None


def _convert_to(value: Any, tp: Any) -> Any:
    inner = _optional_of(tp)
    if inner is not None:
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE):
            return None
        return _convert_to(value, inner)
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if isinstance(value, str):  # "0.9,0.999" or "[0.9, 0.999]" or "(0.9, 0.999)"
            value = [v for v in value.strip().strip("[]()").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ValueError(value)
        return tuple(_convert_to(v, a) for v, a in zip(value, args))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(value)
    if tp is int:
        if isinstance(value, bool):
            raise TypeError(value)
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError(value)
            return int(value)
        if isinstance(value, str):
            text = value.strip().replace("_", "")
            try:
                return int(text)
            except ValueError:
                number = float(text)  # "3e5" is a fine way to write 300000
                if not number.is_integer():
                    raise
                return int(number)
        if isinstance(value, int):
            return value
        raise TypeError(value)
    if tp is float:
        if isinstance(value, bool):
            raise TypeError(value)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            return float(value.strip())  # PyYAML reads "1e-4" as a string: accept it here
        raise TypeError(value)
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise TypeError(value)
    raise TypeError(tp)


def _close_match(key: str, known: Iterable[str]) -> str:
    import difflib

    match = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


# -- files --------------------------------------------------------------------------------------


def config_names() -> list:
    """Return the names of the packaged configs (``demo``, ``edsr_baseline_x2``, ...)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_config_path(name_or_path: Union[str, os.PathLike]) -> Path:
    """Return the YAML file for a packaged config name (``demo``) or a path."""
    text = str(name_or_path)
    path = Path(text)
    if path.is_file():
        return path
    packaged = CONFIG_DIR / f"{text.removesuffix('.yaml')}.yaml"
    if os.sep not in text and packaged.is_file():
        return packaged
    raise ConfigError(
        f"{text}: no such config file or packaged config (packaged: {', '.join(config_names())})"
    )


def parse_overrides(items: Iterable[str]) -> Dict[str, str]:
    """Parse ``key=value`` strings into a dict (later ones win)."""
    out: Dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected key=value")
        out[key.strip()] = value
    return out


def load_config(
    name_or_path: Union[None, str, os.PathLike] = None, overrides: Union[Mapping[str, Any], Iterable[str]] = ()
) -> TrainConfig:
    """Load a YAML config (a packaged name or a path; None: the defaults) and apply overrides.

    Args:
        name_or_path: ``demo``, ``edsr_baseline_x2``, ... or a path to a YAML file.
        overrides: a mapping, or ``key=value`` strings as given on the command line.
    """
    cfg = TrainConfig()
    if name_or_path is not None:
        path = resolve_config_path(name_or_path)
        cfg = cfg.replace(_read_yaml(path), source=str(path))
    if not isinstance(overrides, Mapping):
        overrides = parse_overrides(overrides)
    if overrides:
        cfg = cfg.replace(overrides, source="command line")
    return cfg


def _read_yaml(path: Path) -> Dict[str, Any]:
    import yaml

    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a YAML config (not UTF-8 text)") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of key: value, got a {type(data).__name__}")
    return {str(k): v for k, v in data.items()}
