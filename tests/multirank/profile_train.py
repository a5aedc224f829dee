"""An EDSR-baseline training script written against the Horovod API, with no profiling code.

Profiled from outside: HPDL_PROFILE=p.json mpiexec -n 2 python profile_train.py [STEPS [PATCH]].
"""

import sys

import torch

import hpdl.torch as hvd
from hpdl.sr.models import build_model

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
patch = int(sys.argv[2]) if len(sys.argv) > 2 else 12

hvd.init()
torch.manual_seed(hvd.rank())
model = build_model("edsr-baseline", 2)
optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4),
                                     named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
lr = torch.rand(2, 3, patch, patch)
hr = torch.rand(2, 3, 2 * patch, 2 * patch)
for step in range(steps):
    optimizer.zero_grad()
    loss = torch.nn.functional.l1_loss(model(lr), hr)
    loss.backward()
    optimizer.step()
if hvd.rank() == 0:
    print(f"trained {steps} steps, loss {loss.item():.4f}")
