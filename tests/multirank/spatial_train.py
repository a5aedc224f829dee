"""A spatial-parallel training script with no profiling code: each image split into row bands
over every rank, trained with hvd.DistributedOptimizer. Profiled from outside:
HPDL_PROFILE=p.json mpiexec -n 2 python spatial_train.py MODEL HxW [STEPS].
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch
import torch.nn.functional as F
from spatial_models import build, classifies

import hpdl.torch as hvd
from hpdl.torch import spatial

name, size = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
height, width = (int(n) for n in size.split("x"))

hvd.init()
torch.manual_seed(0)
model = build(name)
net = spatial.SpatialParallel(model)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=1e-3), named_parameters=net.named_parameters())
hvd.broadcast_parameters(net.state_dict(), root_rank=0)
gen = torch.Generator().manual_seed(1)
x = torch.rand(2, 3, height, width, generator=gen)
for step in range(steps):
    optimizer.zero_grad()
    out = net(net.scatter(x))
    if classifies(name):  # the replicated logits
        loss = F.cross_entropy(out, torch.tensor([1, 3]))
    else:
        loss = F.l1_loss(out, net.scatter(torch.zeros(2, 3, 2 * height, 2 * width)))
    loss.backward()
    optimizer.step()
if hvd.rank() == 0:
    print(f"trained {steps} steps of {name} on {size} split in {hvd.size()} row bands")
