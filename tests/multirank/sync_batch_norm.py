"""hvd.SyncBatchNorm on several ranks with unequal batches, against one process's BatchNorm
on the concatenated batch: outputs, gradients, running statistics and eval mode (float64).

Usage: sync_batch_norm.py [--device cpu|cuda]; on cuda every rank works on its GPU. On the CPU,
torch_api.py runs the same checks (check_all) in its job.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import device_arg, rank_device, run_main
from torch import nn

import hpdl.torch as hvd

TOL = 1e-10
CASES = [  # (reference class, shape of one sample, options)
    (nn.BatchNorm2d, (3, 4, 5), {}),
    (nn.BatchNorm1d, (3,), {"momentum": None}),
    (nn.BatchNorm1d, (2, 6), {"affine": False}),
    (nn.BatchNorm3d, (2, 3, 2, 2), {"momentum": 0.3}),
    (nn.BatchNorm2d, (3, 2, 2), {"track_running_stats": False}),
]


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    diff = (actual - expected).abs().max().item() if actual.numel() else 0.0
    if actual.shape != expected.shape or diff >= TOL:
        raise AssertionError(f"{what}: differs from one process's BatchNorm by {diff:.3g} "
                             f"(shapes {tuple(actual.shape)} and {tuple(expected.shape)})")


DEVICE = torch.device("cpu")  # set by main()


def batches(step: int, size: int, sample_shape) -> list:
    """Every rank's batch of this step: rank r has r + 2 samples."""
    gen = torch.Generator().manual_seed(100 + step)
    return [(torch.randn((r + 2,) + sample_shape, generator=gen, dtype=torch.float64) * 3 + 1).to(DEVICE)
            for r in range(size)]


def check_case(reference_cls, sample_shape, options, rank: int, size: int) -> None:
    torch.manual_seed(0)
    reference = reference_cls(sample_shape[0], **options).double().to(DEVICE)
    sync = hvd.SyncBatchNorm(sample_shape[0], **options).double().to(DEVICE)
    if reference.affine:
        with torch.no_grad():
            reference.weight.copy_(torch.linspace(0.5, 2.0, sample_shape[0]))
            reference.bias.copy_(torch.linspace(-1.0, 1.0, sample_shape[0]))
        sync.load_state_dict(reference.state_dict())
    what = f"{reference_cls.__name__}{options}"
    for step in range(3):
        parts = batches(step, size, sample_shape)
        start = sum(p.shape[0] for p in parts[:rank])
        full = torch.cat(parts).requires_grad_()
        out_ref = reference(full)
        weights = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(step),
                              dtype=torch.float64).to(DEVICE)
        (out_ref * weights).sum().backward()

        mine = parts[rank].clone().requires_grad_()
        out = sync(mine)
        rows = slice(start, start + mine.shape[0])
        close(out, out_ref[rows].detach(), f"{what} step {step} output")
        (out * weights[rows]).sum().backward()
        close(mine.grad, full.grad[rows], f"{what} step {step} input gradient")
        if reference.affine:
            for name in ("weight", "bias"):
                # Local gradients, as Horovod's: their sum over ranks is the whole batch's.
                total = hvd.allreduce(getattr(sync, name).grad, op=hvd.Sum, name=f"sbn.{what}.{step}.{name}")
                close(total, getattr(reference, name).grad, f"{what} step {step} {name} gradient")
                getattr(sync, name).grad = None
                getattr(reference, name).grad = None
        if reference.track_running_stats:
            close(sync.running_mean, reference.running_mean, f"{what} step {step} running mean")
            close(sync.running_var, reference.running_var, f"{what} step {step} running variance")
            assert int(sync.num_batches_tracked) == int(reference.num_batches_tracked)
    sync.eval()
    reference.eval()
    parts = batches(9, size, sample_shape)
    start = sum(p.shape[0] for p in parts[:rank])
    expected = reference(torch.cat(parts))[start:start + parts[rank].shape[0]]
    close(sync(parts[rank]).detach(), expected.detach(), f"{what} eval")


def check_all(rank: int, size: int) -> None:
    """Every case, the refusal of a 1-D input, and a process set's members alone (torch_api.py
    runs this as one of its checks)."""
    for reference_cls, sample_shape, options in CASES:
        check_case(reference_cls, sample_shape, options, rank, size)
    try:
        hvd.SyncBatchNorm(3)(torch.ones(3))
        raise AssertionError("a 1-D input should be refused")
    except ValueError as err:
        assert "2D" in str(err), err
    if size > 1:  # among a process set: its members' batches only
        pair = hvd.add_process_set([0, 1])
        if pair.included():
            layer = hvd.SyncBatchNorm(2, process_set=pair).double().to(DEVICE)
            x = torch.full((2, 2), float(rank), dtype=torch.float64, device=DEVICE)
            assert torch.allclose(layer(x).cpu(), torch.full((2, 2), 2.0 * rank - 1.0, dtype=torch.float64),
                                  atol=1e-3)  # mean 0.5, var 0.25
        hvd.remove_process_set(pair)


def main() -> None:
    global DEVICE
    device_name = device_arg(sys.argv)
    hvd.init()
    DEVICE = rank_device(device_name)
    rank, size = hvd.rank(), hvd.size()
    check_all(rank, size)
    hvd.shutdown()
    if rank == 0:
        print(f"OK sync batch norm: size={size} device={DEVICE.type}")


if __name__ == "__main__":
    run_main(main)
