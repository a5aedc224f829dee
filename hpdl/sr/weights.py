"""Weights in the formats of EDSR-PyTorch and BasicSR, read into hpdl's models and written back.

EDSR-PyTorch saves a bare state dict; hpdl's EDSR uses its key names, so its files load as they
are. BasicSR saves ``{'params': state_dict}`` (plus ``'params_ema'``, the moving average of the
weights, when training kept one) with its own names (``conv_first``, ``body.{i}.conv1/conv2``,
``conv_after_body``, ``upsample.{j}``, ``conv_last``), and no mean: its EDSR subtracts a fixed
``rgb_mean`` (DIV2K's by default) that is not part of the state dict. Its SRResNet (MSRResNet)
uses the names hpdl's SRResNet has.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from hpdl.sr.edsr import DIV2K_RGB_MEAN
from hpdl.sr.registry import ModelConfig, architecture, assumed_res_scale, published_size

__all__ = ["EXPORT_FORMATS", "WeightsError", "export_weights", "import_weights", "mean_shift_tensors", "res_scale_note"]

EXPORT_FORMATS = ("basicsr", "edsr-pytorch")
_MEAN_KEYS = ("sub_mean.weight", "sub_mean.bias", "add_mean.weight", "add_mean.bias")


class WeightsError(ValueError):
    """Weights that cannot be read or written in the asked-for format; the message says why."""


def mean_shift_tensors(rgb_range: float = 255.0) -> Dict[str, torch.Tensor]:
    """Return EDSR's four MeanShift tensors for the DIV2K mean."""
    eye = torch.eye(3).view(3, 3, 1, 1)
    mean = rgb_range * torch.tensor(DIV2K_RGB_MEAN)
    return {"sub_mean.weight": eye.clone(), "sub_mean.bias": -mean, "add_mean.weight": eye.clone(), "add_mean.bias": mean}


def import_weights(obj: Mapping[str, Any]) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """Return hpdl's state dict for weights in EDSR-PyTorch's or BasicSR's form, and notes on what was assumed.

    ``obj`` is what ``torch.load`` returned: a bare state dict, or BasicSR's ``{'params': ...}``.
    """
    notes: List[str] = []
    state = _unwrap_basicsr(obj, notes)
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    if "conv_first.weight" in state and "conv_after_body.weight" in state:
        state = _edsr_from_basicsr(state)
    if "head.0.weight" in state and not any(k in state for k in _MEAN_KEYS):
        state.update(mean_shift_tensors())
        notes.append(f"the weights hold no sub_mean/add_mean: using the DIV2K mean {DIV2K_RGB_MEAN}, "
                     "as EDSR-PyTorch and BasicSR do")
    return state, notes


def _unwrap_basicsr(obj: Mapping[str, Any], notes: List[str]) -> Dict[str, torch.Tensor]:
    nets = {k: obj[k] for k in ("params_ema", "params") if isinstance(obj.get(k), Mapping)}
    if not nets:
        state = dict(obj)
    else:
        key = next(iter(nets))  # the moving average first: the weights BasicSR tests with
        if len(nets) > 1:
            notes.append(f"BasicSR file with {' and '.join(repr(k) for k in nets)}: using {key!r}")
        state = dict(nets[key])
    if not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError("neither an hpdl checkpoint nor a model state dict (EDSR-PyTorch's or BasicSR's)")
    return state


def _basicsr_name(key: str, blocks: int) -> str:
    """hpdl's (EDSR-PyTorch's) EDSR key -> BasicSR's."""
    layer, _, param = key.rpartition(".")
    block = re.fullmatch(r"body\.(\d+)\.body\.([02])", layer)
    if block:
        return f"body.{block[1]}.conv{1 if block[2] == '0' else 2}.{param}"
    upsample = re.fullmatch(r"tail\.0\.(\d+)", layer)
    if upsample:
        return f"upsample.{upsample[1]}.{param}"
    return {"head.0": "conv_first", f"body.{blocks}": "conv_after_body", "tail.1": "conv_last"}.get(layer, layer) \
        + f".{param}"


def _blocks_in(state: Mapping[str, torch.Tensor], pattern: str) -> int:
    return len({m[1] for k in state for m in [re.fullmatch(pattern, k)] if m})


def _edsr_from_basicsr(state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    blocks = _blocks_in(state, r"body\.(\d+)\.conv1\.weight")
    # Map hpdl's names of a network of this depth onto BasicSR's and invert.
    hpdl_names = [f"head.0.{p}" for p in ("weight", "bias")] + [
        f"body.{i}.body.{j}.{p}" for i in range(blocks) for j in (0, 2) for p in ("weight", "bias")
    ] + [f"body.{blocks}.{p}" for p in ("weight", "bias")] + [
        f"tail.0.{j}.{p}" for j in range(0, 6, 2) for p in ("weight", "bias")
    ] + [f"tail.1.{p}" for p in ("weight", "bias")]
    to_hpdl = {_basicsr_name(k, blocks): k for k in hpdl_names}
    unknown = sorted(k for k in state if k not in to_hpdl)
    if unknown:
        raise WeightsError(f"BasicSR EDSR weights with a key hpdl's EDSR does not have: {unknown[0]!r}")
    return {to_hpdl[k]: v for k, v in state.items()}


def export_weights(state: Mapping[str, torch.Tensor], config: ModelConfig, fmt: str) -> Dict[str, Any]:
    """Return what ``fmt``'s own loader reads (``basicsr`` or ``edsr-pytorch``) for hpdl weights."""
    state = {k: v.detach().cpu() for k, v in state.items()}
    if fmt == "edsr-pytorch":
        if config.arch != "edsr":
            raise WeightsError(f"EDSR-PyTorch has no {config.arch}: export it with --to basicsr")
        return state
    if fmt != "basicsr":
        raise WeightsError(f"unknown format {fmt!r}; choose from {', '.join(EXPORT_FORMATS)}")
    if config.arch == "edsr":
        expected = mean_shift_tensors(config.rgb_range)
        if any(not torch.allclose(state[k].float(), expected[k]) for k in _MEAN_KEYS):
            raise WeightsError("the model's mean is not DIV2K's, and BasicSR's EDSR takes its mean from its "
                               "options, not from the weights: it would not compute what this model does")
        blocks = config.n_resblocks
        state = {_basicsr_name(k, blocks): v for k, v in state.items() if k not in _MEAN_KEYS}
    return {"params": state}


def res_scale_note(config: ModelConfig, fmt: str) -> Optional[str]:
    """Return what the reader of exported weights must be told of their res_scale, which they do not hold.

    EDSR-PyTorch and BasicSR build EDSR with res_scale 1.0 unless told otherwise. hpdl reads
    weights of a published size as the published model (its res_scale) and any other size as
    1.0, so a model whose res_scale is not the one its size implies needs ``--res-scale`` to be
    read back. None when both readers' defaults are already right.
    """
    if not architecture(config.arch).res_scaled:
        return None
    res_scale = float(config.res_scale)
    published = published_size(config.arch, config.n_resblocks, config.n_feats)
    assumed_by_hpdl = assumed_res_scale(config.arch, config.n_resblocks, config.n_feats)
    needs = []
    if res_scale != 1.0:
        needs.append(f"--res_scale {res_scale} for EDSR-PyTorch" if fmt == "edsr-pytorch"
                     else f"res_scale: {res_scale} under network_g in BasicSR's options")
    if res_scale != assumed_by_hpdl:
        otherwise = (f"{published.name}'s {assumed_by_hpdl} for this size" if published is not None
                     else f"{assumed_by_hpdl}, as for any size that is not a published one")
        needs.append(f"--res-scale {res_scale} when hpdl reads the file back (otherwise it takes {otherwise})")
    if not needs:
        return None
    return f"res_scale is not stored in the weights: this {config.describe()} needs {', and '.join(needs)}"
