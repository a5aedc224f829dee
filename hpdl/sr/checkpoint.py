"""Checkpoints: plain dicts saved atomically and loaded with ``torch.load(weights_only=True)``.

A checkpoint is a dict of tensors and primitives (dict, list, tuple, str, int, float, bool,
None). Nothing else is allowed in, so ``weights_only=True`` can load every checkpoint and
loading never runs pickled code. Layout::

    {"format": "hpdl.sr.checkpoint", "version": 1,
     "meta": {"model_name": "edsr_baseline", "scale": 2, "config": {...ModelConfig...}},
     "model": state_dict, ...whatever the trainer adds (optimizer, sampler, rng, config)}

Weights saved by EDSR-PyTorch (bare state dicts such as its published ``edsr_baseline_x2-*.pt``)
and by BasicSR (``{'params': ...}``) load too (``hpdl.sr.weights``): their model and scale are
inferred from the tensor shapes, and what had to be assumed is listed in ``meta["notes"]``.
"""

from __future__ import annotations

import mmap
import os
import pickletools
import random
import re
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import numpy as np
import torch

from hpdl.atomic_file import atomic_write
from hpdl.sr.errors import CheckpointError
from hpdl.sr.models import build_model_from_config, config_from_state_dict
from hpdl.sr.registry import ARCHITECTURES, spelling, with_res_scale
from hpdl.sr.weights import WeightsError, import_weights

__all__ = [
    "FORMAT",
    "capture_rng_state",
    "load_checkpoint",
    "load_model",
    "make_checkpoint",
    "refuse_nonfinite",
    "restore_rng_state",
    "save_checkpoint",
]

FORMAT = "hpdl.sr.checkpoint"
VERSION = 1

PathLike = Union[str, os.PathLike]
_PRIMITIVES = (str, int, float, bool, type(None), torch.Tensor)


def make_checkpoint(model: torch.nn.Module, /, **extra: Any) -> Dict[str, Any]:
    """Return a checkpoint dict of ``model`` (weights on CPU, its config as metadata) plus ``extra``."""
    config = model.config
    checkpoint: Dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "meta": {"model_name": config.name, "scale": config.scale, "config": config.to_dict()},
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
    }
    clash = set(extra) & set(checkpoint)
    if clash:
        raise ValueError(f"reserved checkpoint keys: {', '.join(sorted(clash))}")
    checkpoint.update(extra)
    return checkpoint


def _check_plain(obj: Any, where: str) -> None:
    # Fail at save time, with the offending key, rather than at resume time in weights_only load.
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}; use str or int keys")
            _check_plain(value, f"{where}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _check_plain(value, f"{where}[{i}]")
    elif not isinstance(obj, _PRIMITIVES):
        raise TypeError(
            f"{where} is a {type(obj).__module__}.{type(obj).__name__}; checkpoints hold only "
            "tensors and plain Python values (convert arrays to tensors or lists)"
        )


def save_checkpoint(path: PathLike, checkpoint: Dict[str, Any]) -> Path:
    """Write ``checkpoint`` atomically: temp file in the same dir, fsync, rename over ``path``."""
    _check_plain(checkpoint, "checkpoint")
    return atomic_write(path, lambda f: torch.save(checkpoint, f), fsync=True)


def load_checkpoint(
    path: PathLike,
    *,
    model_name: Optional[str] = None,
    scale: Optional[int] = None,
    map_location: Union[str, torch.device] = "cpu",
    res_scale: Optional[float] = None,
) -> Dict[str, Any]:
    """Load a checkpoint safely; check it is for ``model_name`` / ``scale`` when they are given.

    ``res_scale`` is EDSR's residual scaling of weights from elsewhere, which do not store it
    (None: the published size's, else 1.0 with a note); an hpdl checkpoint must agree with it.
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory, not a checkpoint file")
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    head = _check_file_type(path)
    try:
        with warnings.catch_warnings():
            # torch's safe loader warns of any pickle protocol but 2 before it tries; whether it
            # can read the file is what the error below, if any, says in one line.
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            obj = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # zip, pickle and EOF errors all mean the file is unusable
        raise CheckpointError(f"{path}: {_load_failure(err, path, head)}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a checkpoint (holds a {type(obj).__name__}, not a dict)")
    if obj.get("format") != FORMAT:
        obj = _wrap_state_dict(obj, path, res_scale)
    elif res_scale is not None:
        _check_stored_res_scale(obj, path, res_scale)
    meta = obj.get("meta")
    if not isinstance(meta, dict) or "model_name" not in meta or "scale" not in meta or "model" not in obj:
        raise CheckpointError(f"{path}: checkpoint lacks its model metadata or weights")
    have = f"{meta['model_name']} x{meta['scale']}"
    if (model_name is not None and spelling(meta["model_name"]) != spelling(model_name)) or (
        scale is not None and int(meta["scale"]) != int(scale)
    ):
        want = f"{model_name or meta['model_name']} x{scale or meta['scale']}"
        raise CheckpointError(f"{path}: checkpoint is for {have}, not {want}")
    return obj


def _check_file_type(path: Path) -> bytes:
    """Return the first bytes of ``path`` if it is a zip or a pickle file; ``CheckpointError`` if not."""
    # torch.save writes a zip file, or (before torch 1.6, and with the legacy format) a pickle of
    # protocol 2 or later. Anything else would reach the pickle reader and fail there with an
    # error that reads like a refused pickle, so an image passed by mistake is named as such.
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read: {err.strerror}") from None
    if not head:
        raise CheckpointError(f"{path}: empty file, not a checkpoint")
    if head != b"PK\x03\x04" and head[:1] != b"\x80":
        raise CheckpointError(f"{path}: not a checkpoint (neither a zip nor a pickle file)")
    return head


def _load_failure(err: BaseException, path: Path, head: bytes) -> str:
    text = str(err)
    # Only a global the safe loader refused (a function or class, which unpickling would import
    # and may call) means the file holds code; any other refusal is of a pickle it cannot read.
    refused = re.search(r"GLOBAL (\S+) (?:was not an allowed global|whose module)", text)
    # A zip's pickle was read whole (the zip would not open otherwise); a bare pickle may end anywhere.
    if refused and (head[:1] != b"\x80" or _holds_global(path, refused.group(1))):
        return (f"refused: holds Python objects ({refused.group(1)}) besides tensors and plain values, "
                "which could run code")
    if refused:  # the file ends inside the name of a global
        return "not a readable checkpoint (truncated or corrupt?): it ends inside a pickle instruction"
    # A bare pickle that torch refused unread (protocol 4 and later, or not torch.save's format)
    # may hold code all the same: its instructions tell, read without being run.
    code = _code_global(path) if head[:1] == b"\x80" else None
    if code is not None:
        return f"refused: holds Python objects ({code}) besides tensors and plain values, which could run code"
    if head[:1] == b"\x80" and "Invalid magic number" in text:  # torch.save's legacy format starts with one
        return "not a checkpoint hpdl can read (a pickle, but not in torch.save's format)"
    if head[:1] == b"\x80" and "Weights only load failed" in text:
        # What the safe loader does not read: the frames of protocol 4 and later, say.
        return (f"not a checkpoint hpdl can read (a pickle of protocol {head[1]} that torch's safe loader "
                f"cannot read: {_unpickler_reason(text)})")
    if head == b"PK\x03\x04" and (isinstance(err, OSError) and err.filename is None or "zip archive" in text):
        # torch's zip reader reports a cut archive as a bare errno ("Invalid argument") or as a
        # missing central directory: either way the file is no longer a whole zip archive.
        return "not a readable checkpoint: the zip archive is truncated or damaged"
    return f"not a readable checkpoint (truncated or corrupt?): {_reason(err)}"


# The pickle instructions that push a string, which STACK_GLOBAL takes as module and name.
_STRING_OPCODES = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE",
                   "BINUNICODE8"}
# Those that push nothing, so that the strings STACK_GLOBAL takes stay the last two pushed.
_NO_PUSH_OPCODES = {"PROTO", "FRAME", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"}


def _code_global(path: Path) -> Optional[str]:
    """The first global of the pickle in ``path`` that torch's safe loader does not allow (a
    function or class, which unpickling would import and may call), or None.

    ``pickletools.genops`` only decodes the instructions: nothing is imported or run. A file cut
    short is read as far as it goes.
    """
    allowed = _safe_globals()
    pushed: List[Optional[str]] = []  # what each instruction pushed: its string, or None
    memo: Dict[int, Optional[str]] = {}
    try:
        with open(path, "rb") as f:
            for opcode, arg, _ in pickletools.genops(f):
                name = opcode.name
                if name in ("GLOBAL", "INST"):
                    dotted = str(arg).replace(" ", ".")  # genops gives "module name"
                elif name == "STACK_GLOBAL":
                    module, attr = pushed[-2:] if len(pushed) >= 2 else (None, None)
                    dotted = f"{module}.{attr}" if module and attr else "a global of unknown name"
                    del pushed[-2:]
                else:
                    if name == "MEMOIZE":
                        memo[len(memo)] = pushed[-1] if pushed else None
                    elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                        memo[arg] = pushed[-1] if pushed else None
                    elif name in ("GET", "BINGET", "LONG_BINGET"):
                        pushed.append(memo.get(arg))
                    elif name not in _NO_PUSH_OPCODES:
                        pushed.append(str(arg) if name in _STRING_OPCODES else None)
                    continue
                if dotted not in allowed:
                    return dotted
                pushed.append(None)
    except Exception:  # truncated or not a pickle past some point: what was read is the answer
        pass
    return None


def _safe_globals() -> Set[str]:
    """The globals torch's safe loader allows, as "module.name"."""
    allowed = {"collections.OrderedDict", "_codecs.encode"}
    try:
        from torch import _weights_only_unpickler

        allowed |= set(_weights_only_unpickler._get_allowed_globals())
    except (ImportError, AttributeError):  # a torch without that table: its tensors and sizes
        pass
    for entry in torch.serialization.get_safe_globals():
        if isinstance(entry, tuple):
            allowed.add(entry[1])
        else:
            allowed.add(f"{entry.__module__}.{entry.__qualname__}")
    return allowed


def _unpickler_reason(text: str) -> str:
    # torch wraps the unpickler's own line in paragraphs of advice; it is the last but the link.
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip() and not p.strip().startswith("Check the")]
    return paragraphs[-1].splitlines()[0].rstrip(".") if paragraphs else "refused"


def _holds_global(path: Path, dotted: str) -> bool:
    """Whether ``path`` holds a whole GLOBAL instruction naming ``dotted`` (a file cut inside one
    makes the safe loader refuse the part it read)."""
    # "module\nname\n": the module and the name may both hold dots. torch names builtins
    # without their module, which protocols 0-2 spell __builtin__.
    spellings = [f"{module}.{dotted}" for module in ("builtins", "__builtin__")] if "." not in dotted else [dotted]
    instructions = [f"c{'.'.join(parts[:i])}\n{'.'.join(parts[i:])}\n".encode()
                    for parts in (spelling.split(".") for spelling in spellings) for i in range(1, len(parts))]
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return any(data.find(instruction) >= 0 for instruction in instructions)
    except (OSError, ValueError):
        return True  # cannot tell: keep the warning


def _reason(err: BaseException) -> str:
    # torch's messages run to paragraphs; the first sentence says what went wrong.
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return text.split(". ")[0].rstrip(".")


def _wrap_state_dict(obj: Dict[str, Any], path: Path, res_scale: Optional[float]) -> Dict[str, Any]:
    # Weights of EDSR-PyTorch or BasicSR: recognise the model by its keys and shapes.
    try:
        state, notes = import_weights(obj)
    except WeightsError as err:
        raise CheckpointError(f"{path}: {err}") from None
    config = config_from_state_dict(state)
    if config is None:
        raise CheckpointError(f"{path}: state dict is not a model hpdl knows ({', '.join(ARCHITECTURES)})")
    try:
        config, assumed = with_res_scale(config, res_scale)
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from None
    meta = {"model_name": config.name, "scale": config.scale, "config": config.to_dict(), "notes": notes + assumed}
    return {"format": FORMAT, "version": VERSION, "meta": meta, "model": state}


def _check_stored_res_scale(obj: Dict[str, Any], path: Path, res_scale: float) -> None:
    # An hpdl checkpoint stores its res_scale: another one would run a network it was not trained as.
    config = obj.get("meta", {}).get("config") if isinstance(obj.get("meta"), dict) else None
    stored = config.get("res_scale") if isinstance(config, dict) else None
    arch = ARCHITECTURES.get(config.get("arch", "edsr")) if isinstance(config, dict) else None
    if arch is not None and not arch.res_scaled:
        raise CheckpointError(f"{path}: {arch.name} has no res_scale")
    if stored is not None and float(stored) != float(res_scale):
        raise CheckpointError(f"{path}: an hpdl checkpoint of res_scale {float(stored)}, not {float(res_scale)} "
                              "(a res_scale is given only for weights that do not store it)")


def load_model(
    path: PathLike,
    *,
    model_name: Optional[str] = None,
    scale: Optional[int] = None,
    device: Union[str, torch.device] = "cpu",
    res_scale: Optional[float] = None,
) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    """Build the checkpoint's model, load its weights, and return ``(model in eval mode, checkpoint)``.

    ``res_scale``: for weights that do not store it, as in ``load_checkpoint``.
    """
    checkpoint = load_checkpoint(path, model_name=model_name, scale=scale, res_scale=res_scale)
    meta = checkpoint["meta"]
    try:
        model = build_model_from_config(meta["config"])
        state = {k.removeprefix("module."): v for k, v in checkpoint["model"].items()}
        model.load_state_dict(state)
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(
            f"{path}: weights do not fit {meta['model_name']} x{meta['scale']}: {_reason(err)}"
        ) from None
    refuse_nonfinite(path, checkpoint["model"])
    return model.to(device).eval(), checkpoint


def refuse_nonfinite(path: PathLike, state: Dict[str, Any]) -> None:
    """``CheckpointError`` naming ``path`` if a weight of ``state`` is NaN or infinite (a diverged run's)."""
    bad = next((k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point()
                and not bool(torch.isfinite(v).all())), None)
    if bad is not None:
        raise CheckpointError(f"{path}: weights hold NaN or infinite values ({bad}): written by a training run "
                              "that diverged?")


def capture_rng_state(cuda_device: Optional[torch.device] = None) -> Dict[str, Any]:
    """Return the Python, NumPy and torch RNG states in checkpoint-safe form, with the CUDA
    generator's of ``cuda_device`` (the rank's GPU) when it trains on one.

    One GPU's, not every GPU's: reading another device's generator creates a CUDA context on
    it, hundreds of MB of that GPU's memory for every rank of the node.
    """
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: Dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if cuda_device is not None and cuda_device.type == "cuda":
        state["cuda_device"] = torch.cuda.get_rng_state(cuda_device)
    return state


def restore_rng_state(state: Dict[str, Any], cuda_device: Optional[torch.device] = None) -> None:
    """Restore RNG states captured by ``capture_rng_state``; the CUDA generator's into ``cuda_device``."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if cuda_device is None or cuda_device.type != "cuda":
        return
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"], cuda_device)
    elif "cuda" in state:  # checkpoints of earlier versions: every GPU's generator, in device order
        index = cuda_device.index if cuda_device.index is not None else torch.cuda.current_device()
        if index < len(state["cuda"]):
            torch.cuda.set_rng_state(state["cuda"][index], cuda_device)
