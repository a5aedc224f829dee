"""What a commit of hvd.elastic.TorchState costs: EDSR-baseline and EDSR x2 with Adam, median of 5 (docs/elastic.md).

    OMP_NUM_THREADS=1 python scripts/measure_commit.py
"""
import time, statistics, torch
import hpdl.torch as hvd
from hpdl.sr.models import build_model
hvd.init()
for name in ("edsr-baseline", "edsr"):
    model = build_model(name, 2)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters())
    model(torch.randn(1, 3, 16, 16)).mean().backward(); opt.step()
    state = hvd.elastic.TorchState(model, opt, epoch=0)
    times = []
    for _ in range(5):
        t = time.perf_counter(); state.commit(); times.append(time.perf_counter() - t)
    print(name, sum(p.numel() for p in model.parameters()), "params; commit median", round(statistics.median(times) * 1000, 1), "ms")
hvd.shutdown()
