"""hpdl.sr: super-resolution on top of hpdl (EDSR, SRResNet; data, metrics, tiled inference).

The public names below are imported lazily on first use, so ``import hpdl.sr`` (and hence
``hpdl --help``, which imports ``hpdl.sr.cli``) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict

# public name -> submodule that defines it
_EXPORTS: Dict[str, str] = {
    "SRDataError": "errors",
    "BadImageError": "errors",
    "CorruptImageError": "errors",
    "ImageTooSmallError": "errors",
    "CheckpointError": "errors",
    "ModelMismatchError": "errors",
    "EDSR": "edsr",
    "SRResNet": "srresnet",
    "ModelConfig": "registry",
    "model_names": "registry",
    "register": "registry",
    "build_model": "models",
    "build_model_from_config": "models",
    "count_parameters": "models",
    "load_pretrained": "models",
    "import_weights": "weights",
    "export_weights": "weights",
    "receptive_field_radius": "models",
    "ImageCache": "images",
    "read_image": "images",
    "write_image": "images",
    "bicubic_downscale": "images",
    "prepare_embedded": "images",
    "ImagePairs": "datasets",
    "TrainPatches": "datasets",
    "open_pairs": "datasets",
    "build_train_dataset": "datasets",
    "build_val_dataset": "datasets",
    "ShardSampler": "sampler",
    "psnr": "metrics",
    "ssim": "metrics",
    "bicubic_upscale": "metrics",
    "upscale": "inference",
    "upscale_image": "inference",
    "upscale_image_in_bands": "spatial_upscale",
    "forward_tiled": "inference",
    "self_ensemble": "inference",
    "evaluate": "evaluation",
    "format_table": "evaluation",
    "EvalResult": "evaluation",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "load_model": "checkpoint",
    "make_checkpoint": "checkpoint",
    "capture_rng_state": "checkpoint",
    "restore_rng_state": "checkpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hpdl.sr' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hpdl.sr.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_EXPORTS))
