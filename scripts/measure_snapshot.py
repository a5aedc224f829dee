"""What keeping a commit on disk costs under torchrun's elastic agent (docs/elastic.md, "Under
torchrun's elastic agent"): a commit of a TorchState with Adam's state, with the snapshot
(local rank 0 writes it) and with HPDL_ELASTIC_SNAPSHOT=0, median of 7 after one warm-up, for
a small model (an MLP, 0.1 M parameters) and EDSR-baseline x2 (1.37 M); one process, as a
job's local rank 0 (TORCHELASTIC_RUN_ID set here; the snapshot goes to the temp dir unless
HPDL_ELASTIC_SNAPSHOT_DIR says where).

    OMP_NUM_THREADS=1 python scripts/measure_snapshot.py
"""

import os
import statistics
import time

import torch

import hpdl.torch as hvd
from hpdl.sr.models import build_model

os.environ["TORCHELASTIC_RUN_ID"] = f"measure-{os.getpid()}"


def small():
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 10))


def measure(make, sample, snapshot: bool):
    os.environ["HPDL_ELASTIC_SNAPSHOT"] = "1" if snapshot else "0"
    hvd.init()
    model = make()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters())
    model(sample).mean().backward()
    opt.step()
    state = hvd.elastic.TorchState(model, opt, epoch=0)
    times, size = [], 0

    @hvd.elastic.run
    def commits(state):
        nonlocal size
        for _ in range(8):
            start = time.perf_counter()
            state.commit()
            times.append(time.perf_counter() - start)
        if snapshot:
            size = state._snapshots.path.stat().st_size

    commits(state)
    hvd.shutdown()
    return statistics.median(times[1:]) * 1000, size, sum(p.numel() for p in model.parameters())


for name, make, sample in (("mlp", small, torch.randn(4, 256)),
                           ("edsr-baseline x2", lambda: build_model("edsr-baseline", 2), torch.randn(1, 3, 16, 16))):
    with_ms, size, params = measure(make, sample, True)
    without_ms, _, _ = measure(make, sample, False)
    print(f"{name}: {params / 1e6:.2f} M parameters, snapshot {size / 2**20:.1f} MiB; commit {without_ms:.1f} ms "
          f"in memory, {with_ms:.1f} ms with the snapshot: {with_ms - without_ms:.1f} ms per commit for the snapshot")
