"""Hybrid parallelism: S=2 spatial x D=2 data-parallel ranks against D=2 plain data parallelism
on the whole images (float64): every replica's output, the parameters after 3 steps, and each
replica's BatchNorm running statistics (which plain data parallelism keeps per replica).

The plain data-parallel reference runs in one process, rank 0's, whose results every rank
receives bit for bit: one twin of the model per replica, each fed its replica's images; their
gradients are averaged, as DistributedOptimizer averages them over the replicas, and applied
to every twin.
"""

from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch
import torch.nn.functional as F
from _common import run_main
from spatial_exactness import close
from spatial_models import build, classifies

import hpdl.torch as hvd
from hpdl.torch import spatial

STEPS = 3


def images(step: int, replica: int, model: str, height: int, width: int):
    gen = torch.Generator().manual_seed(1000 * step + replica)
    if classifies(model):
        return torch.randn(2, 3, height, width, generator=gen, dtype=torch.float64), torch.randint(0, 10, (2,), generator=gen)
    return (torch.rand(1, 3, height, width, generator=gen, dtype=torch.float64) * 255,
            torch.rand(1, 3, 2 * height, 2 * width, generator=gen, dtype=torch.float64) * 255)


def loss_of(model: str, out, target):
    return F.cross_entropy(out, target) if classifies(model) else F.l1_loss(out, target)


def reference_step(twins, twin_opts, step: int, model_name: str, height: int, width: int):
    """A step of the plain data-parallel reference, on rank 0 alone (on every rank it cost the
    job four times its CPU); every rank gets the twins' parameters and buffers after it, and
    each replica's output. Returns the outputs by replica."""
    outputs = None
    if hvd.rank() == 0:
        grads, outputs = [], []
        for replica, twin in enumerate(twins):
            x, target = images(step, replica, model_name, height, width)
            twin.zero_grad()
            out_ref = twin(x)
            loss_of(model_name, out_ref, target).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in twin.parameters()])
            outputs.append(out_ref.detach())
        for twin, opt_twin in zip(twins, twin_opts):
            for p, *replica_grads in zip(twin.parameters(), *grads):
                if replica_grads[0] is not None:
                    p.grad = sum(replica_grads) / len(replica_grads)
            opt_twin.step()
    for twin in twins:
        hvd.broadcast_parameters(twin.state_dict(), root_rank=0)
    return hvd.broadcast_object(outputs, 0, name="reference.outputs")


def check(model_name: str, height: int, width: int) -> None:
    layout = spatial.layout(spatial=2, data=2)
    torch.manual_seed(0)
    twins = [build(model_name).double() for _ in range(1)]
    twins.append(copy.deepcopy(twins[0]))
    model = copy.deepcopy(twins[0])
    net = spatial.SpatialParallel(model, process_set=layout.spatial_set)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9),
                                   named_parameters=net.named_parameters())
    twin_opts = [torch.optim.SGD(t.parameters(), lr=1e-4, momentum=0.9) for t in twins]
    for step in range(STEPS):
        outputs = reference_step(twins, twin_opts, step, model_name, height, width)
        expected = outputs[layout.replica]

        x, target = images(step, layout.replica, model_name, height, width)
        opt.zero_grad()
        out = net(net.scatter(x))
        loss_of(model_name, out, target if classifies(model_name) else net.scatter(target)).backward()
        opt.step()
        at = f"hybrid 2x2 {model_name}, step {step}"
        close(out.detach() if classifies(model_name) else net.gather(out), expected, f"{at}: replica {layout.replica}'s output")
        mine = twins[layout.replica]
        for (name, p), p_ref in zip(model.named_parameters(), mine.parameters()):
            close(p.detach(), p_ref.detach(), f"{at}: {name} after the update")
        for (name, b), b_ref in zip(model.named_buffers(), mine.buffers()):
            close(b.double(), b_ref.double(), f"{at}: buffer {name} of replica {layout.replica}")
    if hvd.rank() == 0:
        print(f"OK spatial hybrid {model_name} {height}x{width}", flush=True)


def main() -> None:
    hvd.init()
    for case in sys.argv[1:]:
        model_name, size = case.split(":")
        height, width = (int(v) for v in size.split("x"))
        check(model_name, height, width)
    hvd.shutdown()


if __name__ == "__main__":
    run_main(main)
