"""An elastic training script for the tests (tests/test_elastic_jobs.py): a float64 linear model on
deterministic data, read through an ElasticSampler, committed every --commit-every batches.

Each rank appends one JSON line per batch to --log (worker, rank, size, epoch, batch, the
parameters' sum), so a test can follow the worlds the job went through; rank 0 saves the final
parameters to --out. --fail WORKER:BATCH:HOW makes that worker fail once when it reaches that
batch of the whole run (HOW: raise, kill (SIGKILL), exit (os._exit(3))); --progress FILE gets
the number of batches done (a discovery script reads it); --slow-start S delays a worker that
is not worker 0 before hvd.init(); --hold BATCH:SIZE waits after that batch, committing, until
the world has SIZE workers (so a test's schedule of hosts does not depend on this machine's speed).
"""

import argparse
import json
import os
import signal
import time

import torch

import hpdl.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=48)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--commit-every", type=int, default=1)
parser.add_argument("--log", required=True)
parser.add_argument("--out", default=None)
parser.add_argument("--fail", action="append", default=[])
parser.add_argument("--progress", default=None)
parser.add_argument("--slow-start", type=float, default=0.0)
parser.add_argument("--batch-sleep", type=float, default=0.0)
parser.add_argument("--hold", action="append", default=[],
                    help="BATCH:SIZE: after that batch, commit until the world has SIZE workers (whatever the "
                         "machine's speed, the job waits there for the driver's change)")
args = parser.parse_args()

worker = int(os.environ.get("HPDL_ELASTIC_WORKER", "-1"))
if args.slow_start and worker > 0:
    time.sleep(args.slow_start)
hvd.init()
torch.manual_seed(0)
generator = torch.Generator().manual_seed(1)
inputs = torch.randn(args.samples, 5, generator=generator, dtype=torch.float64)
targets = inputs @ torch.arange(1.0, 6.0, dtype=torch.float64).unsqueeze(1) + 0.5
model = torch.nn.Linear(5, 1).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(list(range(args.samples)), shuffle=False)
failures = {}
for text in args.fail:
    who, at, how = text.split(":")
    failures[(int(who), int(at))] = how


def on_reset():
    for group in optimizer.param_groups:
        group["lr"] = 0.01 * hvd.size()


holds = {int(b): int(n) for b, n in (text.split(":") for text in args.hold)}


def _hold(state, size):
    """Commit until the world has ``size`` workers: a commit raises HostsUpdatedInterrupt when
    the driver has changed the hosts, and the world is formed again."""
    deadline = time.monotonic() + 240
    while hvd.size() != size:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the world did not become {size} workers within 240 s")
        state.commit()
        time.sleep(0.1)


state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, done=0)
state.register_reset_callbacks([on_reset])


def log(**fields):
    with open(args.log, "a") as f:
        layout = [os.environ.get(f"HOROVOD_{name}") for name in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE",
                                                                   "CROSS_RANK", "CROSS_SIZE", "HOSTNAME")]
        f.write(json.dumps(dict(worker=worker, rank=hvd.rank(), size=hvd.size(), t=round(time.time(), 3),
                                layout=layout, local=[hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
                                                      hvd.cross_size()], **fields)) + "\n")


@hvd.elastic.run
def train(state):
    while state.epoch < args.epochs:
        indices = list(iter(state.sampler))
        # This rank's indices still to do in the epoch, a batch at a time.
        for start in range(0, len(indices), args.batch):
            batch = indices[start:start + args.batch]
            how = failures.pop((worker, state.done), None)
            if how == "raise":
                raise RuntimeError(f"worker {worker} fails at batch {state.done}")
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "exit":
                os._exit(3)
            optimizer.zero_grad()
            x, y = inputs[batch], targets[batch]
            loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum") / args.batch
            loss.backward()
            optimizer.step()
            state.sampler.record_batch(start, args.batch)
            state.done += 1
            log(epoch=state.epoch, batch=state.done, params=float(sum(p.detach().sum() for p in model.parameters())))
            if args.progress and hvd.rank() == 0:
                with open(args.progress + ".tmp", "w") as f:
                    f.write(str(state.done))
                os.replace(args.progress + ".tmp", args.progress)
            if args.batch_sleep:
                time.sleep(args.batch_sleep)
            if state.done % args.commit_every == 0:
                state.commit()
            if state.done in holds:
                _hold(state, holds[state.done])
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()


train(state)
params = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = hvd.allgather(params.unsqueeze(0))
if hvd.rank() == 0:
    assert all(torch.equal(gathered[0], row) for row in gathered), "the ranks' parameters differ"
    if args.out:
        torch.save({"params": params, "size": hvd.size(), "done": state.done}, args.out)
    print(f"done: {state.done} batches, world of {hvd.size()}", flush=True)
hvd.shutdown()
