"""Mixed precision around a DistributedOptimizer (hpdl/torch/mixed_precision.py), on the CPU:
bfloat16 autocast, and float16 with loss scaling through Horovod's recipe."""

import contextlib

import pytest
import torch

import hpdl.torch as hvd
from hpdl.sr.checkpoint import load_checkpoint, make_checkpoint, save_checkpoint
from hpdl.sr.config import AMP_MODES as SR_AMP_MODES
from hpdl.sr.models import build_model_from_config
from hpdl.sr.registry import make_config
from hpdl.torch.mixed_precision import AMP_MODES, MixedPrecision, amp_refusal

CPU = torch.device("cpu")


@pytest.fixture
def one_rank():
    hvd.init()
    yield
    hvd.shutdown()


def test_the_sr_config_offers_the_same_modes():
    assert SR_AMP_MODES == AMP_MODES == ("none", "bf16", "fp16")


def test_refusals_are_one_line_naming_what_to_use(monkeypatch):
    assert amp_refusal("half", CPU) == "amp must be none, bf16, fp16, got 'half'"
    assert all(amp_refusal(mode, CPU) is None for mode in AMP_MODES)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    assert amp_refusal("bf16", torch.device("cuda", 0)) == \
        "amp=bf16: this GPU (Tesla V100-SXM2-16GB) has no bfloat16; use amp=fp16"
    assert amp_refusal("fp16", torch.device("cuda", 0)) is None
    with pytest.raises(ValueError, match="amp must be"):
        MixedPrecision("fp32", CPU)


def test_none_changes_nothing():
    precision = MixedPrecision("none", CPU)
    assert not precision.enabled and precision.scaler is None and precision.state_dict() is None
    assert isinstance(precision.autocast(), contextlib.nullcontext)


@pytest.mark.parametrize("mode,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_the_forward_runs_in_16_bits_and_the_weights_stay_float32(mode, dtype):
    model = build_model_from_config(make_config("edsr_baseline", 2, 1, 8))
    precision = MixedPrecision(mode, CPU)
    with precision.autocast():
        out = model(torch.rand(1, 3, 8, 8) * 255)
    assert out.dtype == dtype
    precision.backward(out.float().mean())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad)


def _model_and_optimizer(distributed: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if distributed:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    return model, optimizer


def _train(distributed: bool, losses):
    """fp16 steps on the given loss multipliers (inf: a step whose gradients overflow)."""
    model, optimizer = _model_and_optimizer(distributed)
    precision = MixedPrecision("fp16", CPU)
    x = torch.linspace(-1, 1, 12).reshape(3, 4)
    weights, scales = [], []
    for factor in losses:
        optimizer.zero_grad()
        with precision.autocast():
            out = model(x)
        precision.backward(out.float().sum() * factor)
        precision.step(optimizer)
        weights.append([p.detach().clone() for p in model.parameters()])
        scales.append(precision.scale())
    return weights, scales


def test_fp16_through_a_distributed_optimizer_skips_an_overflow_as_the_plain_recipe(one_rank):
    # Horovod's recipe (synchronize, unscale_, step under skip_synchronize) against the scaler's
    # own on a plain optimizer: the same updates, the same skipped one, the same scales.
    steps = [1e-3, float("inf"), 1e-3, 1e-3]  # small: the scaled gradients fit float16
    distributed, distributed_scales = _train(True, steps)
    plain, plain_scales = _train(False, steps)
    assert distributed_scales == plain_scales == [65536.0, 32768.0, 32768.0, 32768.0]
    for mine, theirs in zip(distributed, plain):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    # the overflowing step changed nothing; the others did
    assert all(torch.equal(a, b) for a, b in zip(distributed[0], distributed[1]))
    assert not all(torch.equal(a, b) for a, b in zip(distributed[1], distributed[2]))


def test_the_loss_scale_survives_a_checkpoint(tmp_path):
    precision = MixedPrecision("fp16", CPU)
    precision.scaler.scale(torch.ones(()))
    precision.scaler.update(new_scale=1024.0)  # as after six halvings
    model = build_model_from_config(make_config("edsr_baseline", 2, 1, 8))
    save_checkpoint(tmp_path / "c.pt", make_checkpoint(model, scaler=precision.state_dict()))
    resumed = MixedPrecision("fp16", CPU)
    resumed.load_state_dict(load_checkpoint(tmp_path / "c.pt")["scaler"])  # weights_only=True loads it
    assert resumed.scale() == 1024.0
    resumed.load_state_dict(None)  # a checkpoint of a run without loss scaling: nothing to load
    assert resumed.scale() == 1024.0


@pytest.mark.multirank
@pytest.mark.parametrize("launcher,n", [("mpiexec", 2), ("torchrun", 3)])
def test_mixed_precision_on_ranks_equals_one_process_on_the_whole_batch(launcher, n):
    # an overflow on one rank only is seen by all (the scaler reads averaged gradients): every
    # rank skips that update and halves the scale, as one process does
    from ranks import run_ranks

    out = run_ranks("mixed_precision.py", n, launcher, timeout=180).stdout
    assert "OK amp bf16" in out and "OK amp fp16" in out, out
