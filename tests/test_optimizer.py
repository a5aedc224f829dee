"""DistributedOptimizer and compression in one process, without MPI or hvd.init()."""

import gc
import warnings

import pytest
import torch
from torch import nn

import hpdl.torch as hvd
from hpdl.torch.compression import Compression


@pytest.fixture(autouse=True)
def _hpdl_not_initialized():
    # The tests of this file run without hvd.init(); a test of another file run earlier in the same
    # worker process may have left hpdl initialised (an in-process `hpdl sr train` that failed).
    hvd.shutdown()
    yield


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


@pytest.mark.parametrize("compressor,wire,tol", [(Compression.fp16, torch.float16, 1e-3),
                                                 (Compression.bf16, torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compression_round_trip(compressor, wire, tol, dtype):
    t = torch.randn(100, dtype=dtype)
    sent, ctx = compressor.compress(t)
    assert sent.dtype == wire
    back = compressor.decompress(sent, ctx)
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.allclose(back, t, rtol=tol, atol=tol)


@pytest.mark.parametrize("compressor", [Compression.none, Compression.fp16, Compression.bf16])
def test_compression_leaves_integers_and_none_alone(compressor):
    ints = torch.arange(10)
    sent, ctx = compressor.compress(ints)
    assert sent is ints and compressor.decompress(sent, ctx) is ints
    t = torch.randn(5)
    sent, ctx = Compression.none.compress(t)
    assert sent is t and Compression.none.decompress(sent, ctx) is t


def test_isinstance_shared_state_and_cached_class():
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD)
    assert opt.param_groups is base.param_groups and opt.state is base.state and opt.defaults is base.defaults
    other = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert type(other) is type(opt)
    assert type(hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()))) is not type(opt)


def test_local_step_and_state_dict_round_trip():
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt._local_step()  # no allreduce, no hvd.init() needed
    saved = opt.state_dict()
    assert saved["state"][0]["step"].item() == 1
    fresh = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=5.0),
                                     named_parameters=model.named_parameters())
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["lr"] == 0.1
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], saved["state"][0]["exp_avg"])
    # load_state_dict re-runs torch's step patching: it must leave our step unwrapped.
    assert type(fresh).step.__qualname__ == "DistributedOptimizerMixin.step"


def test_a_rollback_over_a_step_the_failed_world_left_half_done_loads_the_state(monkeypatch):
    # hvd.elastic.run restores the last commit after a lost rank: the step in progress had
    # allreduces under way, whose waits now raise the world's failure. The rollback must load
    # the state and forget that step, not raise again from inside the recovery.
    from hpdl.engine import HorovodInternalError
    from hpdl.torch import optimizer_base

    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    saved = opt.state_dict()
    first = next(model.parameters())
    first.grad = torch.ones_like(first)
    opt._pending[first] = optimizer_base.Submitted("a handle of the failed world", (first,), (None,))

    def failed(*_args, **_kwargs):
        raise HorovodInternalError("the world of generation 0 ended: worker 1 died")

    monkeypatch.setattr(optimizer_base.mpi_ops, "synchronize", failed)
    monkeypatch.setattr(opt, "_submit", failed)  # the unfired gradients: the failed engine refuses them
    opt.load_state_dict(saved)
    assert not opt._pending and opt.param_groups[0]["lr"] == 0.1


def test_zero_grad_without_pending_work_is_fine():
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_discarded_optimizer_hooks_do_nothing():
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    del opt
    gc.collect()
    # Without hvd.init() a live hook would fail; a discarded optimizer's hook is inert.
    model(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_backward_without_init_explains():
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="init"):
        model(torch.randn(2, 4)).sum().backward()
    del opt


def test_scheduler_wrapper_on_the_original_is_not_copied():
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(base, step_size=1)  # patches base.step on the instance
    assert "step" in base.__dict__
    opt = hvd.DistributedOptimizer(base)
    assert "step" not in opt.__dict__
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    assert "step" in opt.__dict__ and scheduler.optimizer is opt


@pytest.mark.parametrize("kwargs,error,match", [
    ({"backward_passes_per_step": 0}, ValueError, "backward_passes_per_step"),
    ({"backward_passes_per_step": 1.5}, ValueError, "backward_passes_per_step"),
    ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, ValueError, "gradient_predivide_factor"),
    ({"gradient_predivide_factor": -1.0}, ValueError, "gradient_predivide_factor"),
    ({"op": "sum"}, ValueError, "op"),
    ({"groups": 0}, ValueError, "groups"),
    ({"groups": [[1, 2]]}, ValueError, "torch.Tensor"),
    ({"groups": [[torch.zeros(3)]]}, ValueError, "does not update"),
    ({"compression": object()}, ValueError, "compress"),
])
def test_argument_errors(kwargs, error, match):
    model = _model()
    with pytest.raises(error, match=match):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_name_errors():
    model = _model()
    params = list(model.parameters())
    opt = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    with pytest.raises(ValueError, match="Found duplicates: w"):
        hvd.DistributedOptimizer(opt(), named_parameters=[("w", p) for p in params])
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(opt(), named_parameters=list(model.named_parameters())[:-1])
    with pytest.raises(ValueError, match="sequence of tuples"):
        hvd.DistributedOptimizer(opt(), named_parameters=params)
    with pytest.raises(ValueError, match="only appear once"):
        hvd.DistributedOptimizer(opt(), groups=[[params[0]], [params[0]]])


def test_wrapping_twice_or_a_non_optimizer_fails():
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already"):
        hvd.DistributedOptimizer(opt)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        hvd.DistributedOptimizer(model)


def test_added_param_group_is_tracked():
    model = _model()
    extra = nn.Parameter(torch.zeros(3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.add_param_group({"params": [extra]})
    assert opt._parameter_names[extra] == "allreduce.noname.1.0" and extra in opt._delay


def test_synchronize_blocks_once_on_the_last_submitted_gradient(monkeypatch):
    """step() waits for the last-submitted allreduce first, so the caller wakes once per step."""
    import threading

    from hpdl.engine import Handle
    from hpdl.torch import mpi_ops
    from hpdl.torch import optimizer as optimizer_module

    submitted, blocked_on = [], []
    first_block = threading.Event()

    def on_wait(name):
        blocked_on.append(name)
        first_block.set()

    def fake_allreduce_async_(tensor, name, **kwargs):
        handle = Handle(name, on_wait=lambda _handle: on_wait(name))
        submitted.append((handle, tensor))
        return mpi_ops.AsyncHandle([handle], None, inplace=tensor)

    monkeypatch.setattr(optimizer_module.mpi_ops, "allreduce_async_", fake_allreduce_async_)
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.randn(2, 4)).sum().backward()
    assert len(submitted) == 4

    def complete_in_submission_order():
        first_block.wait(10)
        for handle, tensor in submitted:
            handle.set_result(tensor)

    completer = threading.Thread(target=complete_in_submission_order)
    completer.start()
    opt.step()
    completer.join()
    assert blocked_on == [submitted[-1][0].name]


def _record_submissions(monkeypatch):
    """Replace the optimizer's allreduces with ones that complete at once, recording each
    submission's name and ``bytes_to_come``."""
    from hpdl.engine import Handle
    from hpdl.torch import mpi_ops
    from hpdl.torch import optimizer as optimizer_module

    hints = []

    def done(name, tensors):
        handle = Handle(name)
        handle.set_result(tensors)
        return handle

    def fake_allreduce_async_(tensor, name, bytes_to_come=None, **kwargs):
        hints.append((name, bytes_to_come))
        return mpi_ops.AsyncHandle([done(name, tensor)], None, inplace=tensor)

    def fake_grouped_allreduce_async_(tensors, name, bytes_to_come=None, **kwargs):
        hints.append((name, bytes_to_come))
        return mpi_ops.AsyncHandle([done(f"{name}.{i}", t) for i, t in enumerate(tensors)], list)

    monkeypatch.setattr(optimizer_module.mpi_ops, "allreduce_async_", fake_allreduce_async_)
    monkeypatch.setattr(optimizer_module.mpi_ops, "grouped_allreduce_async_", fake_grouped_allreduce_async_)
    return hints


@pytest.mark.parametrize("compression,itemsize", [(Compression.none, 4), (Compression.fp16, 2)])
def test_each_gradient_tells_the_engine_the_bytes_still_to_come_in_the_step(monkeypatch, compression, itemsize):
    hints = _record_submissions(monkeypatch)
    model = _model()  # 12 + 3 + 6 + 2 parameters: 23 float32 elements per step
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compression,
                                   backward_passes_per_step=2)
    sizes = {f"allreduce.{name}": p.numel() for name, p in model.named_parameters()}
    for step in range(2):
        hints.clear()
        for _ in range(2):  # the first pass accumulates locally and submits nothing
            model(torch.randn(2, 4)).sum().backward()
        assert len(hints) == 4
        left = sum(sizes.values())
        for name, bytes_to_come in hints:  # in the order backward made them
            left -= sizes[name]
            assert bytes_to_come == left * itemsize
        assert hints[-1][1] == 0
        opt.step()
        opt.zero_grad()


def test_a_group_tells_the_engine_the_bytes_after_it(monkeypatch):
    hints = _record_submissions(monkeypatch)
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), groups=[list(model[0].parameters())])
    model(torch.randn(2, 4)).sum().backward()
    sizes = {f"allreduce.{name}": p.numel() for name, p in model.named_parameters()}
    (group_name,) = opt._group_names.values()
    sizes[group_name] = 12 + 3
    assert len(hints) == 3 and group_name in dict(hints)
    left = 23
    for name, bytes_to_come in hints:  # a group counts the bytes after all its members
        left -= sizes[name]
        assert bytes_to_come == left * 4
    assert left == 0
    opt.step()


@pytest.mark.parametrize("hint", [-1, 1.5, "many", True])
def test_a_bad_bytes_to_come_hint_fails_the_call_naming_the_collective(hint):
    # checked where it is given: the engine thread compares it, and must not be the one to fail
    from hpdl.torch import mpi_ops

    with pytest.raises(ValueError, match=r"grad\.w: bytes_to_come must be a whole number of bytes"):
        mpi_ops.allreduce_async_(torch.ones(4), name="grad.w", bytes_to_come=hint)
    with pytest.raises(ValueError, match=r"grads: bytes_to_come must be"):
        mpi_ops.grouped_allreduce_async_([torch.ones(4)], name="grads", bytes_to_come=hint)


def test_the_optimizer_advises_sparse_as_dense_on_the_engines_errors_about_sparse_gradients():
    # The engine names the operations the ranks disagree on; DistributedOptimizer, which gathers
    # sparse gradients, says what to change (optimizer_base.py).
    from hpdl.engine.errors import NegotiationError
    from hpdl.torch.optimizer_base import _sparse_advice

    mixed = NegotiationError("Mismatched allgather operations for tensor 'e'", frozenset({"allgather", "allreduce"}))
    advised = mixed.with_advice(_sparse_advice(mixed))
    assert str(advised).startswith("Mismatched allgather operations for tensor 'e' (for a DistributedOptimizer")
    assert str(advised).endswith("pass sparse_as_dense=True)") and advised.kinds == mixed.kinds
    after_join = NegotiationError("allgather of tensor 'e' cannot run after rank 1 called join(); only allreduce can",
                                  frozenset({"allgather"}), joined=(1,))
    assert "sparse_as_dense=True" in _sparse_advice(after_join)
    assert _sparse_advice(NegotiationError("Mismatched allreduce tensor shapes", frozenset({"allreduce"}))) is None
    assert _sparse_advice(NegotiationError("Mismatched allgather data types", frozenset({"allgather"}))) is None
