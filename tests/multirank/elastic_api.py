"""hvd.elastic on a job of fixed ranks: a Horovod elastic script runs unchanged.

Modes (argv[1]):
  train   every rank starts from different weights, optimizer state, sampler position and
          counters; run() gives every rank rank 0's; commit/restore, the sampler's partition
          of what is left of an epoch, a HostsUpdatedInterrupt restarting the function.
  lost    rank 1 dies mid-training; the survivors' run() restores the last commit before
          the error reaches the script, which prints what it sees and exits 3.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import run_main

import hpdl.torch as hvd


def make_training(rank):
    torch.manual_seed(100 + rank)  # deliberately different on every rank
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # Momentum buffers that differ between ranks, so the optimizer state's sync is visible.
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    return model, opt


def gathered(tensor):
    return hvd.allgather(tensor.detach().reshape(1, -1), name=f"check.{gathered.calls}")


gathered.calls = 0


def same_on_every_rank(tensor, what):
    gathered.calls += 1
    rows = gathered(tensor)
    for r in range(1, rows.shape[0]):
        if not torch.equal(rows[r], rows[0]):
            raise AssertionError(f"{what} differs between rank 0 and rank {r}")


def train_mode():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model, opt = make_training(rank)
    dataset = list(range(23))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=5)
    # Rank 0 is further into epoch 2 than the others: sync must bring everyone there.
    sampler.set_epoch(2 if rank == 0 else 0)
    if rank == 0:
        sampler.record_batch(0, 2)
        sampler.reset()
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=10 + rank, history=[rank])
    calls = []

    @hvd.elastic.run
    def train(state, interrupt_once):
        calls.append(len(calls))
        # After sync: rank 0's state everywhere.
        assert state.epoch == 10, state.epoch
        assert state.history == [0], state.history
        for name, p in state.model.named_parameters():
            same_on_every_rank(p, f"parameter {name}")
        for group in state.optimizer.state_dict()["state"].values():
            same_on_every_rank(group["momentum_buffer"], "momentum buffer")
        assert state.sampler.epoch == 2 and state.sampler.processed_num == 2 * size, state.sampler.state_dict()

        # The sampler hands out what is left of the epoch, each index to one rank.
        mine = torch.tensor(list(iter(state.sampler)))
        everyone = hvd.allgather(mine, name="sampler.indices")
        order = list(range(23))
        import random
        random.Random(5 + 2).shuffle(order)
        remaining = order[2 * size:]
        assert sorted(set(everyone.tolist())) == sorted(remaining), (everyone.tolist(), remaining)
        assert len(mine) == len(state.sampler) == -(-len(remaining) // size)

        # Train a step, commit; train another, restore: back to the committed values.
        for batch_idx in range(2):
            state.optimizer.zero_grad()
            state.model(torch.randn(3, 4)).pow(2).sum().backward()
            state.optimizer.step()
            state.sampler.record_batch(batch_idx, 3)
            state.epoch += 1
            state.history.append(batch_idx)
            if batch_idx == 0:
                state.commit()
                committed = {k: v.clone() for k, v in state.model.state_dict().items()}
                committed_momentum = [g["momentum_buffer"].clone()
                                      for g in state.optimizer.state_dict()["state"].values()]
        state.restore()
        for k, v in state.model.state_dict().items():
            assert torch.equal(v, committed[k]), f"restore: {k} is not the committed value"
        for got, want in zip(state.optimizer.state_dict()["state"].values(), committed_momentum):
            assert torch.equal(got["momentum_buffer"], want), "restore: momentum is not the committed value"
        assert state.epoch == 11 and state.history == [0, 0], (state.epoch, state.history)
        assert state.sampler.processed_num == 2 * size + 3 * size, state.sampler.state_dict()

        if interrupt_once and len(calls) == 1:
            # Horovod's run() starts the function again after the reset callbacks, and
            # syncs first unless the interrupt says skip_sync; here it syncs, so every
            # rank must again see rank 0's state as it was committed.
            state.epoch, state.history = 10, [0]  # what the assertions above expect
            state.sampler.set_epoch(2)
            state.sampler.record_batch(0, 2)
            state.commit()
            raise hvd.elastic.HostsUpdatedInterrupt(skip_sync=False)
        return "done"

    resets = []
    state.register_reset_callbacks([lambda: resets.append(1)])
    assert train(state, True) == "done"
    assert calls == [0, 1] and resets == [1], (calls, resets)
    hvd.shutdown()
    print(f"OK elastic train: rank={rank} size={size}")


def lost_mode():
    hvd.init()
    rank = hvd.rank()
    model, opt = make_training(rank)
    state = hvd.elastic.TorchState(model, opt, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.batch in range(1, 1000):
            opt.zero_grad()
            model(torch.randn(3, 4)).pow(2).sum().backward()
            opt.step()
            if state.batch == 3:
                state.commit()
            if state.batch == 5 and rank == 1:
                os.kill(os.getpid(), 9)  # this rank is lost without a word

    try:
        train(state)
    except hvd.HorovodInternalError as error:
        # What a script's handler sees: the committed state, not the half-done batch.
        print(f"rank {rank} caught: batch={state.batch} error={str(error).splitlines()[0]}", flush=True)
        sys.exit(3)  # (the engine ends a failed job with its own exit code)
    raise AssertionError("training went on after rank 1 was lost")


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "train"
    if mode == "lost":
        lost_mode()  # its own exits: an error here is the point
    else:
        run_main(train_mode)
