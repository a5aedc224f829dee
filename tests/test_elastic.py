"""hvd.elastic: Horovod's elastic scripts on a job whose ranks stay the same."""

import os

import pytest
import torch

import hpdl.torch as hvd
from hpdl.torch import elastic
from hpdl.torch.elastic import sampler as elastic_sampler, state as elastic_state
from ranks import run_plain_ranks, run_ranks, shared_job


@pytest.mark.multirank
@pytest.mark.parametrize("launcher,n", [("mpiexec", 2), ("mpiexec", 3), ("torchrun", 2)],
                         ids=["mpiexec-2", "mpiexec-3", "torchrun-2"])
def test_every_rank_starts_from_rank_0s_state_and_restores_its_commit(launcher, n):
    result = run_ranks("elastic_api.py", n, launcher, args=["train"], timeout=120)
    for rank in range(n):
        assert f"OK elastic train: rank={rank} size={n}" in result.stdout, result.stdout


@pytest.mark.multirank
def test_a_lost_rank_ends_the_function_with_the_committed_state_restored():
    results = run_plain_ranks("elastic_api.py", 3, args=["lost"], env={"HPDL_STALL_TIMEOUT": "30"}, timeout=90)
    assert results[1].returncode == -9
    for rank in (0, 2):
        out = results[rank].stdout + results[rank].stderr
        assert results[rank].returncode != 0, out  # the job ends as any failed job (docs/api.md)
        # Batch 3 was committed; the failure came in batch 5 or 6 (the one rank 1 never joined).
        assert f"rank {rank} caught: batch=3 " in out, out
        assert "rank 1" in out, out


def _handlers_job(n: int):
    """One job of ``n`` ranks for the scheduler and the unpicklable object, one after the other."""
    return shared_job(("elastic_handlers.py", n), lambda: run_ranks(
        "elastic_handlers.py", n, args=["scheduler", "unpicklable"], timeout=120))


@pytest.mark.multirank
@pytest.mark.parametrize("n", [1, 2])
def test_an_lr_scheduler_of_a_distributed_optimizer_is_kept_by_its_state_dict(n):
    result = _handlers_job(n)
    for rank in range(n):
        assert f"OK elastic scheduler: rank={rank}" in result.stdout, result.stdout


def test_an_lr_scheduler_has_a_handler_of_its_own():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    schedulers = torch.optim.lr_scheduler
    for scheduler in (schedulers.StepLR(opt, step_size=1), schedulers.ReduceLROnPlateau(opt),
                      schedulers.LambdaLR(opt, lambda epoch: 0.5 ** epoch)):
        state = elastic.TorchState(model, opt, scheduler=scheduler)
        assert isinstance(state._handlers["scheduler"], elastic_state.LRSchedulerStateHandler), type(scheduler)


@pytest.mark.multirank
@pytest.mark.parametrize("n", [1, 2])
def test_an_object_that_does_not_pickle_is_named_with_the_handler_registry_that_keeps_it(n):
    result = _handlers_job(n)
    for rank in range(n):
        assert f"OK elastic unpicklable: rank={rank}" in result.stdout, result.stdout


def test_a_refusal_names_the_objects_this_rank_cannot_pickle_either():
    # Rank 1's view: the broadcast only says rank 0 could not serialize; the rank names its own.
    import threading

    def bcast_from_failed_root(value):
        raise ValueError("broadcast_object 'dict': root rank 0 could not serialize its object (its own error says why)")

    state = elastic.ObjectState(bcast_object=bcast_from_failed_root, get_rank=lambda: 1, lock=threading.Lock(),
                                epoch=3)
    with pytest.raises(ValueError, match=r"^ObjectState cannot send its objects from rank 0 to the other ranks: "
                                         r"lock: cannot serialize lock object: TypeError: .*; give the state what "
                                         r"can be pickled instead"):
        state.sync()
    plain = elastic.ObjectState(bcast_object=bcast_from_failed_root, get_rank=lambda: 1, epoch=3)
    with pytest.raises(ValueError, match=r"root rank 0 could not serialize its object \(its own error says why\); "
                                         r"give the state"):
        plain.sync()


def _one_rank(monkeypatch, rank=0, size=1):
    monkeypatch.setattr(elastic_sampler, "rank", lambda: rank)
    monkeypatch.setattr(elastic_sampler, "size", lambda: size)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_sampler_gives_each_remaining_index_to_one_rank(monkeypatch, size):
    shards = []
    for rank in range(size):
        _one_rank(monkeypatch, rank, size)
        sampler = elastic.ElasticSampler(list(range(10)), shuffle=False)
        sampler.record_batch(0, 1)  # one sample on each rank: the first `size` indices are done
        sampler.reset()
        shards.append(list(sampler))
        assert len(sampler) == len(shards[-1]) == -(-(10 - size) // size)
    seen = [i for shard in shards for i in shard]
    assert set(seen) == set(range(size, 10))
    assert len(seen) == size * len(shards[0])  # padded to divide evenly, as Horovod's


def test_sampler_state_round_trip_and_a_new_epoch(monkeypatch):
    _one_rank(monkeypatch)
    sampler = elastic.ElasticSampler(list(range(8)), shuffle=True, seed=3)
    first = list(sampler)
    sampler.record_indices(first[:3])
    other = elastic.ElasticSampler(list(range(8)), shuffle=True, seed=3)
    other.load_state_dict(sampler.state_dict())
    assert list(other) == first[3:]
    other.set_epoch(1)
    assert sorted(other) == list(range(8)) and list(other) != first


def test_object_state_commit_restore_and_sync():
    received = []

    def bcast(value):
        received.append(value)
        return {"epoch": 7, "log": ["from rank 0"]}

    state = elastic.ObjectState(bcast_object=bcast, get_rank=lambda: 1, epoch=1, log=[])
    state.sync()
    assert (state.epoch, state.log) == (7, ["from rank 0"]) and received
    state.log.append("a")
    state.commit()
    state.log.append("b")  # changed in place after the commit
    state.epoch = 9
    state.restore()
    assert (state.epoch, state.log) == (7, ["from rank 0", "a"])


def test_run_restarts_after_hosts_updated_and_restores_on_a_failure():
    syncs, resets, calls = [], [], []

    class Counting(elastic.ObjectState):
        def sync(self):
            syncs.append(1)

    state = Counting(bcast_object=lambda v: v, get_rank=lambda: 0, value=1)
    state.register_reset_callbacks([lambda: resets.append(1)])

    @elastic.run
    def train(state, skip):
        calls.append(1)
        if len(calls) == 1:
            raise elastic.HostsUpdatedInterrupt(skip_sync=skip)
        return len(calls)

    assert train(state, False) == 2 and len(syncs) == 2 and len(resets) == 1
    calls.clear(), syncs.clear()
    assert train(state, True) == 2 and len(syncs) == 1  # skip_sync: no second sync

    @elastic.run
    def failing(state):
        state.value = 2
        raise hvd.HorovodInternalError("lost: rank 1 does not answer")

    with pytest.raises(hvd.HorovodInternalError, match="rank 1"):
        failing(state)
    assert state.value == 1  # the committed value, not the half-done one


# One rank that is sent SIGTERM in batch 5, after committing batch 3 (argv[1]: "own" sets a
# SIGTERM handler of its own first).
_SIGTERMED = """\
import os, signal, sys
import torch
import hpdl.torch as hvd

hvd.init()
got = []
own = sys.argv[1:] == ["own"]
if own:
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
state = hvd.elastic.ObjectState(batch=0)

@hvd.elastic.run
def train(state):
    for state.batch in range(1, 40 if own else 10**9):  # without a handler, only the failure ends it
        hvd.allreduce(torch.ones(1), name=f"batch.{state.batch}")
        if state.batch == 3:
            state.commit()
        if state.batch == 5:
            os.kill(os.getpid(), signal.SIGTERM)
    return "done"

try:
    print("returned", train(state), state.batch, got, flush=True)
except hvd.HorovodInternalError as error:
    print("caught", state.batch, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, error, flush=True)
"""


@pytest.mark.parametrize("own_handler", [False, True], ids=["default", "script-handler"])
def test_sigterm_during_run_fails_the_collectives_unless_the_script_handles_it(own_handler):
    # As torchrun, srun and Open MPI end the survivors of a lost rank: SIGTERM, SIGKILL later.
    import subprocess
    import sys

    from ranks import ROOT

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPDL_", "PMI_", "OMPI_", "SLURM_"))}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", _SIGTERMED, *(["own"] if own_handler else [])], env=env,
                          capture_output=True, text=True, timeout=120)
    if own_handler:  # the script's handler is the script's business: training goes on
        assert done.returncode == 0 and done.stdout == "returned done 39 [15]\n", done.stdout + done.stderr
        return
    assert done.stdout.startswith("caught 3 True hpdl engine failed on rank 0: the launcher is ending the job "
                                  "(SIGTERM)"), done.stdout + done.stderr
    # Then the job ends as a failed one does (the abort's exit code), nothing raised after the handler.
    assert done.returncode == 1 and "Exception ignored" not in done.stderr, done.stderr


def test_an_object_that_cannot_be_copied_is_kept_as_it_is():
    import threading

    lock = threading.Lock()
    state = elastic.ObjectState(bcast_object=lambda v: v, get_rank=lambda: 0, lock=lock)
    state.commit()
    state.restore()
    assert state.lock is lock


def test_a_handler_registered_as_in_horovod_keeps_a_scheduler(monkeypatch):
    # Horovod's way to keep other objects in a TorchState: a StateHandler in the registry.
    class SchedulerHandler(elastic_state.StateHandler):
        def __init__(self, value):
            super().__init__(value)
            self.save()

        def save(self):
            self._saved = dict(self.value.state_dict())

        def restore(self):
            self.value.load_state_dict(self._saved)

        def sync(self):
            self.value.load_state_dict(self._saved)  # one rank: nothing to send

    registry = list(elastic_state.get_handler_registry())
    monkeypatch.setattr(elastic_state, "_handler_registry", registry)
    # Ahead of the registry's own scheduler handler: the first match is used.
    elastic_state.set_handler_registry([(torch.optim.lr_scheduler.LRScheduler, SchedulerHandler)] + registry)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = elastic.TorchState(scheduler=scheduler, epoch=0)
    assert isinstance(state._handlers["scheduler"], SchedulerHandler)
    opt.step(), scheduler.step()
    state.commit()
    opt.step(), scheduler.step()
    state.restore()
    assert scheduler.last_epoch == 1


def test_a_model_assigned_to_the_state_is_tracked_from_then_on():
    state = elastic.TorchState(torch.nn.Linear(2, 1), batch=0)
    other = torch.nn.Linear(2, 1)
    state.model = other
    committed = {k: v.clone() for k, v in other.state_dict().items()}
    with torch.no_grad():
        other.weight.add_(1)
    state.restore()
    assert all(torch.equal(v, committed[k]) for k, v in other.state_dict().items())


def test_the_objects_given_are_the_states_own_until_a_restore():
    history = []
    state = elastic.ObjectState(bcast_object=lambda v: v, get_rank=lambda: 0, history=history)
    history.append(1)  # the script's own reference, as Horovod's state keeps it
    assert state.history is history
    state.commit()
    history.append(2)
    state.restore()
    assert state.history == [1]
