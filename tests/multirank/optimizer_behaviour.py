"""DistributedOptimizer's contract beyond equivalence: misuse errors, unused parameters,
skip_synchronize, broadcasting state, isinstance and state_dict, sparse gradients.

Usage: optimizer_behaviour.py [check ...]  (default: all); prints "OK <check>" on rank 0.
"""

from __future__ import annotations

import sys
import warnings
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from _common import adasum_reference, run_main
from optimizer_models import (
    assert_close, assert_ranks_equal, batch, flat_params, loss_fn, make_pair, shard,
)

import hpdl.torch as hvd
from hpdl.engine import HorovodInternalError


def _train_step(model, opt, step: int) -> None:
    x, y = batch(step)
    opt.zero_grad()
    loss_fn(model, shard(x, hvd.rank(), hvd.size()), shard(y, hvd.rank(), hvd.size())).backward()
    opt.step()


def check_isinstance_and_state_dict() -> None:
    model, _ = make_pair(seed=1)
    base = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.Adam) and isinstance(opt, torch.optim.Optimizer), type(opt).__mro__
    assert opt.param_groups is base.param_groups and opt.defaults == base.defaults
    assert type(hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()))) is type(opt), "class not cached"
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters())
    for step in range(2):
        _train_step(model, opt, step)
    saved = opt.state_dict()
    assert saved["state"] and saved["state"][0]["step"].item() == 2, saved["state"].keys()
    # A new DistributedOptimizer over the same model takes over the hooks and loads the state.
    again = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=5.0),
                                     named_parameters=model.named_parameters())
    again.load_state_dict(saved)
    assert again.param_groups[0]["lr"] == 1e-3
    restored = again.state_dict()
    for pid, entry in saved["state"].items():
        for key, value in entry.items():
            assert torch.equal(restored["state"][pid][key], value), (pid, key)
    _train_step(model, again, 2)  # hooks belong to `again` now: reduced once, no name clash
    assert again.state_dict()["state"][0]["step"].item() == 3
    assert_ranks_equal(model, "state_dict")


def check_zero_grad_pending_raises() -> None:
    model, _ = make_pair(seed=2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = batch(0)
    loss_fn(model, shard(x, hvd.rank(), hvd.size()), shard(y, hvd.rank(), hvd.size())).backward()
    try:
        opt.zero_grad()
    except AssertionError as err:
        assert "zero_grad" in str(err) and "step()" in str(err), err
    else:
        raise AssertionError("zero_grad() with pending allreduces did not raise")
    opt.step()
    opt.zero_grad()  # fine once step() has waited
    assert_ranks_equal(model, "zero_grad")

    # A second backward before step() (backward_passes_per_step=1) is refused too.
    loss_fn(model, x, y).backward()
    try:
        loss_fn(model, x, y).backward()
    except AssertionError as err:
        assert "backward_passes_per_step" in str(err), err
    else:
        raise AssertionError("two backward passes before step() did not raise")
    # The second backward added to gradients whose allreduces were running: refused as changed,
    # and the optimizer goes on.
    try:
        opt.synchronize()
    except RuntimeError as err:
        assert "was changed after backward() and before the optimizer averaged it" in str(err), err
    else:
        raise AssertionError("gradients added to in flight were averaged")
    opt.zero_grad()
    _train_step(model, opt, 1)
    assert_ranks_equal(model, "after the refusals")


def check_duplicate_names_raise() -> None:
    model, _ = make_pair(seed=3)
    named = [("same", p) for p in model.parameters()]
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named)
    except ValueError as err:
        assert "same" in str(err), err
    else:
        raise AssertionError("duplicate names did not raise")
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=list(model.named_parameters())[1:])
    except ValueError as err:
        assert "not named" in str(err), err
    else:
        raise AssertionError("a parameter missing from named_parameters did not raise")


class WithExtra(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.extra = nn.Linear(3, 2)

    def forward(self, x, use_extra: bool):
        out = self.body(x).sum()
        return out + self.extra(x).sum() if use_extra else out


def check_unused_parameter() -> None:
    """A parameter only some ranks use: the others submit zeros; nobody hangs."""
    torch.manual_seed(0)
    model = WithExtra()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    size = hvd.size()
    for step, user in enumerate([0, size - 1]):
        opt.zero_grad()
        x = torch.ones(4, 3)
        model(x, use_extra=hvd.rank() == user).backward()
        opt.synchronize()
        # d(sum(W x + b))/dW = 4 in every entry on the using rank, 0 elsewhere: average 4/size.
        expected = torch.full((2, 3), 4.0 / size)
        assert torch.allclose(model.extra.weight.grad, expected), (step, model.extra.weight.grad)
        assert torch.allclose(model.body.weight.grad, torch.full((4, 3), 4.0)), model.body.weight.grad
        with opt.skip_synchronize():
            opt.step()
    assert_ranks_equal(model, "unused")


def check_unfrozen_parameter() -> None:
    """A layer frozen when the optimizer is made and unfrozen later (fine-tuning): its
    gradients are averaged from then on, as one process on the whole batch (they used to be
    left to each rank's own, and the ranks' copies drifted apart)."""
    model, reference = make_pair(seed=3)
    for net in (model, reference):
        net.stem.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        if step == 2:
            for net in (model, reference):
                net.stem.requires_grad_(True)
        _train_step(model, opt, step)
        x, y = batch(step)
        ref_opt.zero_grad()
        loss_fn(reference, x, y).backward()
        ref_opt.step()
    assert_ranks_equal(model, "unfrozen")
    assert_close(model, reference, "unfrozen", rtol=1e-4, atol=1e-5)


def check_skip_synchronize() -> None:
    """synchronize(), clip, step() inside skip_synchronize: as one process clipping the average."""
    rank, size = hvd.rank(), hvd.size()
    model, reference = make_pair(seed=4)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        loss_fn(model, shard(x, rank, size), shard(y, rank, size)).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning inside skip_synchronize
            with opt.skip_synchronize():
                opt.step()
        ref_opt.zero_grad()
        loss_fn(reference, x, y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        ref_opt.step()
        assert_close(model, reference, f"skip_synchronize step {step}", 1e-5, 1e-6)
    assert_ranks_equal(model, "skip")

    # step() after synchronize() without the context warns, and does not reduce again.
    summed = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                      named_parameters=model.named_parameters(), op=hvd.Sum)
    summed.zero_grad()
    x, y = batch(9)
    loss_fn(model, shard(x, rank, size), shard(y, rank, size)).backward()
    summed.synchronize()
    after_sync = {n: p.grad.clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summed.step()
    assert any("skip_synchronize" in str(w.message) for w in caught), [str(w.message) for w in caught]
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, after_sync[n]), f"{n}: gradient reduced a second time"


def check_broadcast_state() -> None:
    """Ranks that start different end equal after broadcast_parameters + broadcast_optimizer_state."""
    rank = hvd.rank()
    model, _ = make_pair(seed=100 + rank)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3 * (rank + 1)),
                                   named_parameters=model.named_parameters())
    if rank % 2:  # some ranks already have state, different from the others'
        for p in model.parameters():
            p.grad = torch.full_like(p, float(rank))
        opt._local_step()
        opt.zero_grad()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 1e-3, opt.param_groups[0]["lr"]
    assert_ranks_equal(model, "broadcast.params")
    state = opt.state_dict()["state"]
    for pid in sorted(state):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            mine = state[pid][key].reshape(-1).double()
            root = hvd.broadcast(mine, 0, name=f"check.state.{pid}.{key}")
            assert torch.equal(mine, root), (pid, key)
    for step in range(2):
        _train_step(model, opt, step)
    assert_ranks_equal(model, "broadcast.trained")


def check_broadcast_state_with_weight_decay() -> None:
    """Resuming as Horovod's examples do: rank 0 loads a checkpoint into model and optimizer,
    then both are broadcast. The other ranks' fresh optimizers get state by a step on zero
    gradients, which with weight decay would still shrink their (already broadcast)
    parameters: they must end equal to rank 0's all the same."""
    rank = hvd.rank()
    for make in (lambda params: torch.optim.AdamW(params, lr=0.1, weight_decay=0.5),
                 lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.5)):
        model, _ = make_pair(seed=400 + rank)
        opt = hvd.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters())
        if rank == 0:  # "the checkpoint": a state of its own, made by real steps
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.25)
            opt._local_step()
            opt.zero_grad()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        before = flat_params(model).clone()
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        assert torch.equal(flat_params(model), before), f"{type(opt).__name__}: the parameters moved"
        assert_ranks_equal(model, f"{type(opt).__name__}: broadcast parameters and optimizer state")
        for p in model.parameters():  # a gradient where the state was made, as Horovod leaves it
            assert (p.grad is None) if rank == 0 else torch.equal(p.grad, torch.zeros_like(p)), (rank, p.grad)
        for step in range(2):
            _train_step(model, opt, step)
        assert_ranks_equal(model, f"{type(opt).__name__}: trained after the resume")


def check_load_state_dict_drops_the_step_in_progress() -> None:
    """Rolling back mid-step (a NaN loss, say): load_state_dict() after backward() forgets that
    step's gradients, so zero_grad() and the next backward passes work at once (as Horovod)."""
    for passes in (1, 2):
        model, _ = make_pair(seed=500)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), backward_passes_per_step=passes)
        if passes == 1:
            _train_step(model, opt, 0)  # a state worth rolling back to
        saved_model = {k: v.clone() for k, v in model.state_dict().items()}
        saved = opt.state_dict()
        x, y = batch(1)
        # One rank uses only part of the model: the others' allreduces of the unused
        # parameters must still complete (the same zeros as synchronize() sends).
        if hvd.rank() == hvd.size() - 1 and passes == 1:
            model.head(torch.randn(2, 96)).sum().backward()
        else:
            loss_fn(model, shard(x, hvd.rank(), hvd.size()), shard(y, hvd.rank(), hvd.size())).backward()
        model.load_state_dict(saved_model)
        opt.load_state_dict(saved)
        opt.zero_grad()  # refused before: "called after loss.backward() but before optimizer.step()"
        for step in range(2, 4):  # full steps: `passes` backward passes, then step()
            opt.zero_grad()
            for _ in range(passes):
                loss_fn(model, shard(x, hvd.rank(), hvd.size()), shard(y, hvd.rank(), hvd.size())).backward()
            opt.step()
        assert_ranks_equal(model, f"trained after load_state_dict (backward_passes_per_step={passes})")


def check_overlap_forward_rollback() -> None:
    """overlap_forward leaves step()'s updates to the next forward: a model.load_state_dict()
    in between must not have them applied on top of the loaded values."""
    model, _ = make_pair(seed=600)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), overlap_forward=model)
    _train_step(model, opt, 0)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved = opt.state_dict()
    _train_step(model, opt, 1)  # its updates wait for the next forward
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved)
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved_model[name]), f"{name}: the deferred update was applied after loading"
    x, y = batch(2)
    model(shard(x, hvd.rank(), hvd.size()))
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved_model[name]), f"{name}: the next forward applied a dropped update"
    _train_step(model, opt, 3)
    opt.apply_pending_updates()
    assert_ranks_equal(model, "overlap_forward after a rollback")


def check_overlap_forward_refuses_a_forward_without_its_hooks() -> None:
    """A forward that ran none of overlap_forward's hooks (a compiled graph that dropped them)
    used weights a step old: the next gradient is refused, on every rank, in one line, before
    it reaches the gradients the last step's allreduces still write into (without zero_grad()
    between, they are the same tensors): the parameters then hold exactly the last step's
    update, on every rank."""
    from hpdl.torch.overlap import SKIPPED_HOOKS

    model, reference = make_pair(seed=700)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), overlap_forward=model)
    _train_step(model, opt, 0)
    x, y = batch(0)
    loss_fn(reference, x, y).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    for hook in opt._overlap_hooks:  # as a torch.compile'd graph that kept none of them
        hook.remove()
    x, y = batch(1)
    loss = loss_fn(model, shard(x, hvd.rank(), hvd.size()), shard(y, hvd.rank(), hvd.size()))
    try:
        loss.backward()  # no zero_grad() since the step: its gradients would add to the reduced ones
    except RuntimeError as err:
        assert str(err) == SKIPPED_HOOKS, err
    else:
        raise AssertionError("a forward without overlap_forward's hooks was not refused")
    opt.apply_pending_updates()  # nothing was submitted: leave the job clean for the next check
    opt.zero_grad()
    assert_ranks_equal(model, "after the refusal")
    assert_close(model, reference, "after the refusal: the last step's update alone", 1e-5, 1e-6)


class SparseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 3)

    def forward(self, idx, use_embedding: bool = True):
        if not use_embedding:
            return self.head(torch.zeros(idx.shape[0], 4))
        return self.head(self.embed(idx).mean(1))


def check_broadcast_state_keeps_gradients() -> None:
    """A fresh optimizer's state is made by a step on zero gradients: the gradients the ranks
    already hold (different on each) are neither applied by it nor lost."""
    rank = hvd.rank()
    model, _ = make_pair(seed=300 + rank)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    held = {}
    for n, p in model.named_parameters():
        p.grad = torch.full_like(p, float(rank + 1))
        held[n] = p.grad
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert_ranks_equal(model, "broadcast_optimizer_state stepped on the ranks' own gradients")
    for n, p in model.named_parameters():
        assert p.grad is held[n], f"{n}: its gradient was replaced"
        assert torch.equal(p.grad, torch.full_like(p, float(rank + 1))), f"{n}: its gradient changed"
    opt.zero_grad()


def check_broadcast_state_leaves_zero_gradients() -> None:
    """As Horovod: after the step that makes a fresh optimizer's state, every parameter that
    requires a gradient has one (zeros), so a script may broadcast or read it at once; a
    frozen parameter keeps None."""
    model, _ = make_pair(seed=600)
    frozen = next(model.parameters())
    frozen.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert frozen.grad is None, "a frozen parameter got a gradient"
    for name, p in model.named_parameters():
        if p is not frozen:
            assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p)), f"{name}: {p.grad}"
            assert not p.grad.requires_grad, name
            hvd.broadcast_(p.grad, root_rank=0, name=f"check.zero_grad.{name}")
    frozen.requires_grad_(True)


def check_sparse() -> None:
    """Sparse embedding gradients: allgather-based, and as dense; both equal one process."""
    rank, size = hvd.rank(), hvd.size()
    for as_dense in (False, True):
        torch.manual_seed(5)
        model = SparseNet()
        reference = SparseNet()
        reference.load_state_dict(model.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters(), sparse_as_dense=as_dense)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            idx = torch.randint(0, 10, (12, 3), generator=gen)
            y = torch.randint(0, 3, (12,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(model(shard(idx, rank, size)), shard(y, rank, size)).backward()
            opt.step()
            ref_opt.zero_grad()
            F.cross_entropy(reference(idx), y).backward()
            ref_opt.step()
            assert_close(model, reference, f"sparse(as_dense={as_dense}) step {step}", 1e-5, 1e-6)
        # The last rank leaves the embedding out: it must still take part in its reduction.
        opt.zero_grad()
        F.cross_entropy(model(shard(idx, rank, size), use_embedding=rank != size - 1), shard(y, rank, size)).backward()
        opt.step()
        assert_ranks_equal(model, f"sparse.{as_dense}")


def check_sparse_unused_in_the_first_step() -> None:
    """A sparse-gradient parameter the last rank does not use in the first step: that rank
    cannot know the gradient would be sparse and reduces zeros densely, under the same name.
    Every rank raises at once, naming the tensor (it used to stall until the timeout), and
    nothing of it stays in flight: the next step, sparse everywhere, goes through (the other
    ranks' allgather of the values used to stay, and their next step raised)."""
    rank, size = hvd.rank(), hvd.size()
    if size == 1:
        return
    torch.manual_seed(0)
    model = SparseNet()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters())
    idx, y = torch.randint(0, 10, (4, 3)), torch.randint(0, 3, (4,))
    F.cross_entropy(model(idx, use_embedding=rank != size - 1), y).backward()
    try:
        opt.step()
    except HorovodInternalError as err:
        assert "Mismatched" in str(err) and "embed.weight" in str(err), err
        assert "pass sparse_as_dense=True" in str(err), err  # the optimizer's advice on the engine's error
    else:
        raise AssertionError("a parameter reduced sparse on some ranks and dense on others should raise")
    opt.zero_grad()
    F.cross_entropy(model(idx, use_embedding=True), y).backward()
    opt.step()
    assert_ranks_equal(model, "sparse-after-mismatch")


def check_unnamed_param_groups() -> None:
    """No named_parameters, several param groups: Horovod's names, unique and equal on every rank."""
    model, reference = make_pair(seed=8)

    def grouped(m):
        return [{"params": [m.stem.weight, m.stem.bias], "lr": 0.2},
                {"params": [m.left.weight, m.left.bias, m.right.weight]},
                {"params": [m.right.bias, m.head.weight, m.head.bias], "lr": 0.05}]

    opt = hvd.DistributedOptimizer(torch.optim.SGD(grouped(model), lr=0.1))
    expected = {p: f"allreduce.noname.{g}.{i}" for g, group in enumerate(opt.param_groups)
                for i, p in enumerate(group["params"])}
    assert opt._parameter_names == expected, opt._parameter_names
    names = [opt._parameter_names[p] for p in model.parameters()]
    assert len(set(names)) == len(names), names
    assert all(other == names for other in hvd.allgather_object(names)), "ranks disagree on the names"
    ref_opt = torch.optim.SGD(grouped(reference), lr=0.1)
    for step in range(2):
        x, y = batch(step)
        _train_step(model, opt, step)
        ref_opt.zero_grad()
        loss_fn(reference, x, y).backward()
        ref_opt.step()
        assert_close(model, reference, f"unnamed param groups step {step}", 1e-5, 1e-6)
    named = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    assert named._parameter_names == {p: n for n, p in model.named_parameters()}, named._parameter_names


def check_sparse_adam() -> None:
    """SparseAdam under DistributedOptimizer (sparse gradients stay sparse, also reduced as
    dense with sparse_as_dense, as Horovod): equal to one process."""
    for as_dense in (False, True):
        _check_sparse_adam(as_dense)


def _check_sparse_adam(as_dense: bool) -> None:
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(9 + rank)  # different starts: broadcast_parameters must even them out
    model = nn.Embedding(20, 4, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(model.parameters(), lr=0.1), sparse_as_dense=as_dense)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    reference = nn.Embedding(20, 4, sparse=True)
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SparseAdam(reference.parameters(), lr=0.1)
    # broadcast_optimizer_state made the state with a step on an empty sparse gradient (as Horovod).
    reference.weight.grad = torch.zeros_like(reference.weight).to_sparse()
    ref_opt.step()
    for step in range(3):
        gen = torch.Generator().manual_seed(50 + step)
        idx = torch.randint(0, 20, (12, 2), generator=gen)
        target = torch.randn(12, 2, 4, generator=gen)
        opt.zero_grad()
        F.mse_loss(model(shard(idx, rank, size)), shard(target, rank, size)).backward()
        assert model.weight.grad.is_sparse
        opt.step()
        assert model.weight.grad.is_sparse, "the reduced gradient must stay sparse"
        ref_opt.zero_grad()
        F.mse_loss(reference(idx), target).backward()
        ref_opt.step()
        assert_close(model, reference, f"SparseAdam(sparse_as_dense={as_dense}) step {step}", 1e-5, 1e-6)
    assert_ranks_equal(model, f"sparse.adam.{as_dense}")


def check_adasum_optimizer() -> None:
    """op=Adasum: each rank's own SGD update, combined by Adasum, as one process computes it."""
    size = hvd.size()
    if size & (size - 1):
        return  # refused at construction: torch_api.py checks the error
    model, reference = make_pair(seed=10)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum,
                                   named_parameters=model.named_parameters())
    for step in range(2):
        _train_step(model, opt, step)
        x, y = batch(step)
        updates = []  # every rank's update, computed here from its shard
        for r in range(size):
            reference.zero_grad()
            loss_fn(reference, shard(x, r, size), shard(y, r, size)).backward()
            updates.append({n: -0.1 * p.grad for n, p in reference.named_parameters()})
        with torch.no_grad():
            for n, p in reference.named_parameters():
                p += adasum_reference([u[n] for u in updates]).view_as(p).to(p.dtype)
        assert_close(model, reference, f"Adasum optimizer step {step}", 1e-5, 1e-6)
    assert_ranks_equal(model, "adasum")


def check_process_set() -> None:
    """Reducing among a subset: members agree; a rank outside steps on its own gradients."""
    rank, size = hvd.rank(), hvd.size()
    if size < 2:
        return
    subset = hvd.add_process_set([0, 1])
    model, _ = make_pair(seed=6)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=subset)
    x, y = batch(0)
    opt.zero_grad()
    loss_fn(model, shard(x, rank, size), shard(y, rank, size)).backward()
    opt.step()
    mine = flat_params(model)
    if subset.included():
        other = hvd.broadcast(mine, 0, name="check.subset", process_set=subset)
        assert torch.equal(mine, other), "process set members differ"
    hvd.remove_process_set(subset)


def check_changed_gradients_refused() -> None:
    """A gradient changed between backward() and step() (clipped, unscaled, replaced) was
    averaged in part or overwritten, differently from run to run: refused on every rank, naming
    it and the recipe, with groups and compression too (check_skip_synchronize runs the recipe)."""
    rank, size = hvd.rank(), hvd.size()
    x, y = batch(0)

    def clip(model, opt, loss):
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()

    def unscale(model, opt, loss):  # GradScaler's step unscales in place, then steps
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(loss).backward()
        scaler.step(opt)

    def replace(model, opt, loss):
        loss.backward()
        first = next(model.parameters())
        first.grad = first.grad.clamp(-0.01, 0.01)
        opt.step()

    for options in ({}, {"num_groups": 2}, {"compression": hvd.Compression.fp16}):
        for change in (clip, unscale, replace):
            model, _ = make_pair(seed=5)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), **options)
            try:
                change(model, opt, loss_fn(model, shard(x, rank, size), shard(y, rank, size)))
            except RuntimeError as err:
                text = str(err)
                if change is unscale:  # its kernel leaves the version counters alone: GradScaler's step is told
                    assert text.startswith("GradScaler.step(optimizer) unscaled the gradients in place while "
                                           "hvd.DistributedOptimizer was still averaging them"), text
                    assert "optimizer.synchronize(); scaler.unscale_(optimizer); with optimizer.skip_synchronize(): "\
                           "scaler.step(optimizer)" in text, text
                    continue
                assert "was changed after backward() and before the optimizer averaged it" in text, text
                assert "optimizer.synchronize(); torch.nn.utils.clip_grad_norm_(...)" in text, text
                if change is replace:
                    assert f"parameter {next(iter(dict(model.named_parameters())))!r}" in text, text
            else:
                raise AssertionError(f"{change.__name__} with {options}: not refused")
    # GradScaler by the recipe: averaged first, then unscaled and stepped.
    model, _ = make_pair(seed=5)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_fn(model, shard(x, rank, size), shard(y, rank, size))).backward()
    opt.synchronize()
    scaler.unscale_(opt)
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()
    assert_ranks_equal(model, "GradScaler by the recipe")


CHECKS = {
    "isinstance-state-dict": check_isinstance_and_state_dict,
    "zero-grad-pending": check_zero_grad_pending_raises,
    "duplicate-names": check_duplicate_names_raise,
    "unused-parameter": check_unused_parameter,
    "unfrozen-parameter": check_unfrozen_parameter,
    "skip-synchronize": check_skip_synchronize,
    "broadcast-state": check_broadcast_state,
    "broadcast-state-keeps-gradients": check_broadcast_state_keeps_gradients,
    "broadcast-state-weight-decay": check_broadcast_state_with_weight_decay,
    "broadcast-state-zero-gradients": check_broadcast_state_leaves_zero_gradients,
    "load-state-dict-mid-step": check_load_state_dict_drops_the_step_in_progress,
    "overlap-forward-rollback": check_overlap_forward_rollback,
    "sparse": check_sparse,
    "unnamed-param-groups": check_unnamed_param_groups,
    "sparse-adam": check_sparse_adam,
    "adasum-optimizer": check_adasum_optimizer,
    "process-set": check_process_set,
    "sparse-first-step-unused": check_sparse_unused_in_the_first_step,
    "overlap-forward-without-hooks": check_overlap_forward_refuses_a_forward_without_its_hooks,
    "changed-gradients": check_changed_gradients_refused,
}


def main(argv: Optional[List[str]] = None) -> None:
    hvd.init()
    for name in (sys.argv[1:] if argv is None else argv) or list(CHECKS):
        CHECKS[name]()
        if hvd.rank() == 0:
            print(f"OK {name}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    run_main(main)
