"""Mixed precision around a DistributedOptimizer, as Horovod documents it for PyTorch AMP.

``bf16``: the forward (and so the backward) runs under ``torch.autocast`` in bfloat16, which
has float32's range: nothing else changes. ``fp16``: autocast in float16, whose range is
small, so the loss is scaled up before backward (``GradScaler``) and the gradients scaled back
before the update; an update whose gradients overflowed is skipped and the scale lowered.
With a DistributedOptimizer the scaler must see the averaged gradients, so the step is
Horovod's recipe::

    scaler.scale(loss).backward()        # the allreduces start during backward
    optimizer.synchronize()              # every gradient averaged
    scaler.unscale_(optimizer)           # in place, and every rank finds the same infs
    with optimizer.skip_synchronize():
        scaler.step(optimizer)           # skipped on every rank alike after an overflow
    scaler.update()

Weights, optimizer state and gradients stay float32; only the activations are 16-bit. Both
run on the CPU too (PyTorch's CPU autocast and ``GradScaler("cpu")``), where bfloat16 is the
one CPUs compute natively; float16 there is for checking a GPU recipe on a machine without one.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, ContextManager, Dict, Optional

import torch

__all__ = ["AMP_MODES", "FP16_OVERLAP_REASON", "MixedPrecision", "amp_refusal"]

AMP_MODES = ("none", "bf16", "fp16")
# Why float16 does not go with DistributedOptimizer(overlap_forward=model).
FP16_OVERLAP_REASON = ("loss scaling checks the averaged gradients before each update; amp=bf16 needs no "
                       "scaling")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def amp_refusal(mode: str, device: torch.device) -> Optional[str]:
    """Why mixed precision ``mode`` cannot train on ``device``, or None when it can."""
    if mode not in AMP_MODES:
        return f"amp must be {', '.join(AMP_MODES)}, got {mode!r}"
    if mode == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return f"amp=bf16: this GPU ({torch.cuda.get_device_name(device)}) has no bfloat16; use amp=fp16"
    return None


class MixedPrecision:
    """Autocast, and for float16 loss scaling, around a training step on ``device``.

    ``mode`` "none" changes nothing, so a training loop can use this whatever the setting::

        with precision.autocast():
            loss = loss_fn(model(x), y)
        precision.backward(loss)
        precision.step(optimizer)      # a DistributedOptimizer, or a plain one
    """

    def __init__(self, mode: str, device: torch.device):
        refusal = amp_refusal(mode, device)
        if refusal is not None:
            raise ValueError(refusal)
        self.mode = mode
        self.device = device
        self.dtype = _DTYPES.get(mode)
        self.scaler = torch.amp.GradScaler(device.type) if mode == "fp16" else None

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    def autocast(self) -> ContextManager[Any]:
        """The context to run the forward and the loss in."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward from ``loss``, scaled up first under float16."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, optimizer: torch.optim.Optimizer, synchronized: bool = False) -> None:
        """Update the weights; under float16, unscale first and skip an update that overflowed.

        Args:
            synchronized: the caller has already waited for a DistributedOptimizer's gradients
                (``optimizer.synchronize()``, timed apart, say): a second synchronize would
                reduce every gradient again.
        """
        scaler = self.scaler
        if not hasattr(optimizer, "synchronize"):  # a plain optimizer (DDP, one process): the scaler's own recipe
            if scaler is None:
                optimizer.step()
            else:
                scaler.step(optimizer)
                scaler.update()
            return
        if scaler is not None:
            if not synchronized:
                optimizer.synchronize()  # the scaler must see the averaged gradients
                synchronized = True
            scaler.unscale_(optimizer)
        update = optimizer.step if scaler is None else functools.partial(scaler.step, optimizer)
        with optimizer.skip_synchronize() if synchronized else contextlib.nullcontext():
            update()
        if scaler is not None:
            scaler.update()

    def scale(self) -> Optional[float]:
        """The loss scale now (float16), else None."""
        return None if self.scaler is None else float(self.scaler.get_scale())

    def state_dict(self) -> Optional[Dict[str, Any]]:
        """The scaler's state (its scale and growth counter) for a checkpoint; None without one."""
        return None if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        """Continue with a checkpoint's scaler state (None, or none kept here: nothing to do)."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
