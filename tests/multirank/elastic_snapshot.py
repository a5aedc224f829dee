"""hvd.elastic's snapshot on disk (hpdl/torch/elastic/snapshot.py), which lets a job whose
workers torchrun's elastic agent restarted go on from its last commit.

Modes (argv[1]):
  train MARKER [--kill-at STEP]
          under torchrun's agent: a float64 linear model, SGD with momentum in a
          DistributedOptimizer, an ElasticSampler and plain counters in a TorchState; 2 epochs
          of 4 steps (16 samples, 2 per rank and step), a commit every 2 steps; the data depend
          on the sample index alone. With --kill-at, rank 1 kills itself (SIGKILL) right after
          step STEP, once (MARKER, a file, says it did already: torchrun starts the script
          again). Prints, per rank, "start rank=R restart=C step=S epoch=E" where the function
          starts; rank 0 at the end "final step=S params=[...]" (float64 reprs, exact); local
          rank 0 "snapshot kept" once the first commit's file is in the job's directory.
  holder DIR
          2 ranks started with torchrun's variables (tests/plain_ranks.py), each with a snapshot
          directory of its own under DIR, as if on a node of its own: rank 0's kept commit 3,
          rank 1's commit 5, written here before run() as a restarted job finds them. Every rank
          must start from commit 5 (sent by rank 1), and count its commits on from it; local
          rank 0 alone writes, and removes its directory when the function returns.
"""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import option_arg, run_main

import hpdl.torch as hvd
from hpdl.torch.elastic import snapshot

EPOCHS = 2
SAMPLES = 16
BATCH = 2  # per rank and step


def say(line: str) -> None:
    """One line in one write: the workers share torchrun's stdout."""
    os.write(1, (line + "\n").encode())


def train_mode(argv) -> None:
    kill_at = int(option_arg(argv, "--kill-at", "0"))
    marker = argv[0]
    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randn(SAMPLES, 3, generator=gen, dtype=torch.float64)
    targets = torch.randn(SAMPLES, 2, generator=gen, dtype=torch.float64)
    sampler = hvd.elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=3)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, step=0)
    directory = snapshot.job_directory(os.environ["TORCHELASTIC_RUN_ID"], os.environ["HPDL_ELASTIC_SNAPSHOT_DIR"])

    @hvd.elastic.run
    def train(state):
        say(f"start rank={rank} restart={os.environ['TORCHELASTIC_RESTART_COUNT']} step={state.step} "
            f"epoch={state.epoch}")
        for state.epoch in range(state.epoch, EPOCHS):
            indices = list(state.sampler)
            for at in range(0, len(indices), BATCH):
                batch = indices[at:at + BATCH]
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(inputs[batch]), targets[batch]).backward()
                opt.step()
                state.sampler.record_batch(at // BATCH, len(batch))
                state.step += 1
                if state.step % 2 == 0:
                    state.commit()
                    if state.step == 2 and hvd.local_rank() == 0 and os.listdir(directory):
                        say("snapshot kept")
                if rank == 1 and state.step == kill_at and not os.path.exists(marker):
                    open(marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
            state.sampler.set_epoch(state.epoch + 1)

    train(state)
    if rank == 0:
        params = [p.detach().flatten().tolist() for p in model.parameters()]
        say(f"final step={state.step} params={params!r}")
    hvd.shutdown()


def holder_mode(argv) -> None:
    rank = int(os.environ["RANK"])
    # Read at init: each rank has a snapshot directory of its own, as if on a node of its own.
    os.environ.update(TORCHELASTIC_RUN_ID="holder-job", HPDL_ELASTIC_SNAPSHOT_DIR=os.path.join(argv[0], f"node{rank}"))
    hvd.init()
    assert hvd.size() == 2, hvd.size()
    torch.manual_seed(rank)  # every rank starts from other weights, as a restarted job's script might not
    model = torch.nn.Linear(2, 2).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
    opt.step()
    state = hvd.elastic.TorchState(model, opt, epoch=rank, log=[rank])

    def kept(commits):
        """What a node whose workers committed ``commits`` times kept: weights filled with it."""
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(commits))
        for group in opt.state.values():
            group["momentum_buffer"].fill_(-float(commits))
        state.epoch, state.log = commits, list(range(commits))
        state.save()
        return state._snapshot_payload()

    function = f"__main__.{holder_mode.__qualname__}.<locals>.train"
    directory = snapshot.job_directory("holder-job", os.environ["HPDL_ELASTIC_SNAPSHOT_DIR"])
    files = snapshot.JobSnapshots(directory, "holder-job", snapshot.agent_identity(), writer=True, function=function)
    files.write(3 if rank == 0 else 5, kept(3 if rank == 0 else 5))
    # What the script itself made, which the snapshot replaces.
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(100.0 + rank)
    state.epoch, state.log = 100 + rank, [rank]
    state.save()

    @hvd.elastic.run
    def train(state):
        assert state.epoch == 5 and state.log == [0, 1, 2, 3, 4], (state.epoch, state.log)
        for p in model.parameters():
            assert torch.equal(p, torch.full_like(p, 5.0)), p
        for group in opt.state.values():
            assert torch.equal(group["momentum_buffer"], torch.full_like(group["momentum_buffer"], -5.0))
        state.epoch += 1
        state.commit()  # commit 6, kept by each node's local rank 0
        # Local rank 0 alone writes (rank 1 is local rank 1 here): commit 6 on rank 0's node.
        assert files.read().commits == (6 if hvd.local_rank() == 0 else 5), files.read().commits
        return "done"

    assert train(state) == "done"
    # The function returned: the writer removed its file and the directory.
    assert directory.exists() != (hvd.local_rank() == 0), directory
    hvd.shutdown()
    print(f"OK elastic snapshot holder: rank={rank}", flush=True)


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    run_main(lambda: train_mode(rest) if mode == "train" else holder_mode(rest))
