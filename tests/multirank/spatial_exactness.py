"""SpatialParallel against one process on the whole input, in float64: the gathered output, the
input gradient, every parameter gradient (after DistributedOptimizer's average), BatchNorm's
running statistics, the eval-mode output, and the parameters after 3 optimizer steps. The one
process is rank 0's, whose results every rank receives bit for bit.

Relative errors (norms) at most 1e-10 for the forward and backward of the first step, the
parameters and buffers after every step, and the eval-mode output at the end. Later steps'
outputs and gradients are held to 1e-6 only: training a deep network with batch norm on
small maps amplifies any rounding difference from step to step (ResNet-50 on 64 x 48 images:
a relative 1e-15 change of its weights moves its input gradient by 1e-12 at the first step and
by 1e-7 at the third, in one process), so their distance measures the network's conditioning,
not the split; a wrong halo or statistic is off by far more.

Usage: spatial_exactness.py [--device cpu|cuda] GRID CASE [CASE ...]; GRID is RxC (its product:
the ranks), a CASE is MODEL:HxW[:checkpoint] with MODEL one of edsr-baseline, edsr, srresnet,
resnet50, resnet-small, unet, unet-crop, seghead, masked (further scattered inputs), unbatched
((C, H, W) convolutions), quirks (spatial_models.Quirks), borders (reflection,
replication and circular padding), unshuffle (pixel unshuffle and shuffle),
pooled (average pooling with ceil_mode),
multiscale (downscaling by interpolation), deeplab (DeepLabV3's ASPP head, sizes that are not
whole factors), pyramid (PSPNet's pyramid pooling, an FPN's top-down path), cbam (CBAM's
attention: global max pooling), nnunet (nnU-Net's blocks: instance and group norm), handnorm
(normalization written by hand: std and var_mean over the image), convnext (ConvNeXt's blocks:
channels last between two permutes), rowgate (attention from row means and maxima, broadcast
back along the columns: row bands only), minmax (rescaled by torch.aminmax over everything, gated by
x.prod()), customfn (activations as torch.autograd.Functions of the model's own, given parameters), focus
(YOLOv5's space-to-depth by slicing with a step, then every third row).
Prints "OK spatial MODEL HxW GRID" per case.
"""

from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch
import torch.nn.functional as F
from _common import device_arg, rank_device, run_main
from spatial_models import build, classifies, extra_inputs, output_shape

import hpdl.torch as hvd
from hpdl.torch import spatial

TOL = 1e-10
TOL_LATER = 1e-6  # outputs and gradients after the first update (see above)
STEPS = 3
BATCH = 2
DEVICE = torch.device("cpu")  # set by main()


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = TOL) -> None:
    """Relative error ||actual - expected|| / ||expected|| at most ``tol`` (absolute where expected is 0)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)}, one process has {tuple(expected.shape)}")
    diff = (actual - expected).norm().item()
    scale = expected.norm().item() or 1.0
    if tol == TOL:
        WORST[0] = max(WORST[0], diff / scale)
    if diff > tol * scale:
        raise AssertionError(f"{what}: differs from one process by {diff:.3g} (relative {diff / scale:.3g})")


WORST = [0.0]


def batch(step: int, model: str, height: int, width: int):
    gen = torch.Generator().manual_seed(100 + step)
    if classifies(model):
        x = torch.randn(BATCH, 3, height, width, generator=gen, dtype=torch.float64)
        return x.to(DEVICE), torch.randint(0, 10, (BATCH,), generator=gen).to(DEVICE)
    x = torch.rand(BATCH, 3, height, width, generator=gen, dtype=torch.float64) * 255
    shape = output_shape(model, BATCH, height, width)
    return x.to(DEVICE), (torch.rand(shape, generator=gen, dtype=torch.float64) * 255).to(DEVICE)


def loss_of(model: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target) if classifies(model) else F.l1_loss(out, target)


def reference_step(reference: torch.nn.Module, ref_opt, model_name: str, x: torch.Tensor, target: torch.Tensor):
    """Forward and backward of the one-process reference on rank 0 alone (on every rank it cost
    the job its CPU once per rank); every rank gets its output, its input gradient and its
    parameters' gradients (in ``reference``'s .grad). Returns (output, input gradient)."""
    root = hvd.rank() == 0
    x_ref = x.clone().requires_grad_()
    if root:
        args, kwargs = extra_inputs(model_name, x)
        out_ref = reference(x_ref, *args, **kwargs)
        ref_opt.zero_grad()
        loss_of(model_name, out_ref, target).backward()
    output = hvd.broadcast_object(out_ref.detach().cpu() if root else None, 0, name="reference.output").to(DEVICE)
    x_grad = hvd.broadcast(x_ref.grad if root else torch.zeros_like(x), 0, name="reference.input_grad")
    with_grad = hvd.broadcast_object([n for n, p in reference.named_parameters() if p.grad is not None] if root
                                     else None, 0, name="reference.with_grad")
    grads = dict(reference.named_parameters())
    grads = {n: grads[n].grad if root else torch.zeros_like(grads[n]) for n in with_grad}
    hvd.broadcast_parameters({f"grad.{n}": g for n, g in grads.items()}, root_rank=0)
    if not root:
        for n, p in reference.named_parameters():
            p.grad = grads.get(n)
    return output, x_grad


def reference_update(reference: torch.nn.Module, ref_opt) -> None:
    """The reference's optimizer step on rank 0; its parameters and buffers then on every rank."""
    if hvd.rank() == 0:
        ref_opt.step()
    hvd.broadcast_parameters(reference.state_dict(), root_rank=0)


def check(model_name: str, height: int, width: int, grid, checkpoint: bool) -> None:
    torch.manual_seed(0)
    reference = build(model_name).double().to(DEVICE)
    model = copy.deepcopy(reference)
    net = spatial.SpatialParallel(model, grid=grid, checkpoint=checkpoint)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9),
                                   named_parameters=net.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-4, momentum=0.9)
    what = f"{model_name} {height}x{width} grid {grid[0]}x{grid[1]}" + (" checkpointed" if checkpoint else "")
    for step in range(STEPS):
        x, target = batch(step, model_name, height, width)
        out_ref, x_ref_grad = reference_step(reference, ref_opt, model_name, x, target)

        x_whole = x.clone().requires_grad_()
        args, kwargs = extra_inputs(model_name, x)
        out = net(net.scatter(x_whole), *map(net.scatter, args), **{k: net.scatter(v) for k, v in kwargs.items()})
        opt.zero_grad()
        part_target = target if classifies(model_name) else net.scatter(target)
        loss_of(model_name, out, part_target).backward()
        opt.synchronize()
        at, tol = f"{what}, step {step}", TOL if step == 0 else TOL_LATER
        close(out if classifies(model_name) else net.gather(out), out_ref, f"{at}: output", tol)
        close(hvd.allreduce(x_whole.grad, op=hvd.Sum, name=f"xgrad.{step}"), x_ref_grad, f"{at}: input gradient", tol)
        for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
            if p_ref.grad is not None:
                close(p.grad, p_ref.grad, f"{at}: gradient of {name}", tol)
        with opt.skip_synchronize():
            opt.step()
        reference_update(reference, ref_opt)
        for (name, b), b_ref in zip(model.named_buffers(), reference.buffers()):
            close(b.double(), b_ref.double(), f"{at}: buffer {name}")
        for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
            close(p.detach(), p_ref.detach(), f"{at}: {name} after the update")
    net.eval()
    reference.eval()
    x, _ = batch(STEPS, model_name, height, width)
    args, kwargs = extra_inputs(model_name, x)
    with torch.no_grad():
        out = net(net.scatter(x), *map(net.scatter, args), **{k: net.scatter(v) for k, v in kwargs.items()})
        out_ref = reference(x, *args, **kwargs).cpu() if hvd.rank() == 0 else None
    out_ref = hvd.broadcast_object(out_ref, 0, name="reference.eval_output").to(DEVICE)
    close(out if classifies(model_name) else net.gather(out), out_ref, f"{what}: eval-mode output")
    if hvd.rank() == 0:
        print(f"OK spatial {model_name} {height}x{width} {grid[0]}x{grid[1]}" + (" checkpoint" if checkpoint else "")
              + f" on {DEVICE.type} (largest relative error {WORST[0]:.1e})", flush=True)
    WORST[0] = 0.0


def main() -> None:
    global DEVICE
    device = device_arg(sys.argv)
    hvd.init()
    DEVICE = rank_device(device)
    grid = tuple(int(v) for v in sys.argv[1].split("x"))
    for case in sys.argv[2:]:
        model_name, size, *flags = case.split(":")
        height, width = (int(v) for v in size.split("x"))
        check(model_name, height, width, grid, "checkpoint" in flags)
    hvd.shutdown()


if __name__ == "__main__":
    run_main(main)
