"""The training function of the elastic Ray tests (test_ray.py, test_ray_cluster.py): an
unchanged Horovod elastic loop (``hvd.elastic.run``, a commit every step) whose rank 0 writes
its step and world size to ``marks/progress`` as it goes, so that a test can act at a point of
the run (remove a node, add one) and end it (``marks/stop``)."""

import os
import time


def train(marks, stop_at_size=None, steps_after=5, fail_on_rank=None, fail_at_step=3, max_steps=3000):
    """Train until ``marks/stop`` exists, or ``steps_after`` steps at world size
    ``stop_at_size``; return (steps, the world sizes seen in order, the parameters)."""
    import torch

    import hpdl.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, step=0, sizes=[], at_size=0)

    @hvd.elastic.run
    def loop(state):
        while state.step < max_steps:
            asked = os.path.exists(os.path.join(marks, "stop"))
            if hvd.broadcast_object(asked, 0) or (stop_at_size == hvd.size() and state.at_size >= steps_after):
                break
            if hvd.rank() == fail_on_rank and state.step == fail_at_step:
                with open(os.path.join(marks, "failed"), "w") as f:  # when, for the test's bound
                    f.write(repr(time.time()))
                raise ValueError(f"rank {hvd.rank()} fails at step {state.step}")
            x = torch.full((8, 4), float(hvd.rank() + 1), dtype=torch.float64)
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
            state.step += 1
            if not state.sizes or state.sizes[-1] != hvd.size():
                state.sizes = state.sizes + [hvd.size()]
                state.at_size = 0
            state.at_size += 1
            if hvd.rank() == 0:
                with open(os.path.join(marks, "progress.tmp"), "w") as f:
                    f.write(f"{state.step} {hvd.size()}")
                os.replace(os.path.join(marks, "progress.tmp"), os.path.join(marks, "progress"))
            state.commit()
            time.sleep(0.02)
        return state.step, list(state.sizes), [p.detach().flatten().tolist() for p in model.parameters()]

    return loop(state)


def progress(marks):
    """Rank 0's last (step, world size), or None before its first step."""
    try:
        with open(os.path.join(marks, "progress")) as f:
            step, size = f.read().split()
        return int(step), int(size)
    except (OSError, ValueError):
        return None
