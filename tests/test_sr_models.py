"""EDSR models: parameter counts, x2 -> x3/x4 weight transfer, receptive field."""

import pytest
import torch

from hpdl.sr.errors import ModelMismatchError
from hpdl.sr.registry import ModelConfig
from hpdl.sr.models import (
    build_model,
    build_model_from_config,
    config_from_state_dict,
    count_parameters,
    load_pretrained,
    receptive_field_radius,
)

# The published models' trainable parameters (MeanShift's 24 frozen ones not counted).
PUBLISHED = {
    ("edsr_baseline", 2): 1_369_859,
    ("edsr_baseline", 3): 1_554_499,
    ("edsr_baseline", 4): 1_517_571,
    ("edsr", 2): 40_729_603,
    ("edsr", 3): 43_680_003,
    ("edsr", 4): 43_089_923,
}


def tiny(scale: int, blocks: int = 2, feats: int = 8) -> torch.nn.Module:
    return build_model_from_config(ModelConfig("tiny", scale, blocks, feats, 1.0)).eval()


@pytest.mark.parametrize("name,scale", sorted(PUBLISHED))
def test_parameter_counts_match_the_paper(name, scale):
    model = build_model(name, scale, device="meta")  # no memory for the 43M-parameter model
    assert count_parameters(model) == PUBLISHED[name, scale]
    assert count_parameters(model, trainable_only=False) == PUBLISHED[name, scale] + 24


def test_mean_shift_is_frozen_div2k_mean():
    model = build_model("edsr-baseline", 2)
    assert not model.sub_mean.weight.requires_grad and not model.add_mean.bias.requires_grad
    expected = 255 * torch.tensor([0.4488, 0.4371, 0.4040])
    assert torch.allclose(model.sub_mean.bias, -expected)
    assert torch.allclose(model.add_mean.bias, expected)
    assert torch.equal(model.sub_mean.weight.view(3, 3), torch.eye(3))


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_forward_shape_and_published_key_names(scale):
    model = tiny(scale)
    out = model(torch.rand(2, 3, 7, 5) * 255)
    assert out.shape == (2, 3, 7 * scale, 5 * scale)
    keys = set(model.state_dict())
    # EDSR-PyTorch's names, so its released weights load.
    assert {"sub_mean.weight", "head.0.weight", "body.0.body.2.weight", "body.2.weight", "tail.0.0.weight",
            "tail.1.weight", "add_mean.bias"} <= keys
    assert ("tail.0.2.weight" in keys) == (scale == 4)


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model 'edsr_large'"):
        build_model("edsr_large", 2)
    with pytest.raises(ValueError, match="scale must be one of"):
        build_model("edsr", 8)


@pytest.mark.parametrize("target_scale", [3, 4])
def test_x2_weights_start_x3_x4_with_fresh_tail(target_scale):
    torch.manual_seed(0)
    x2 = build_model("edsr_baseline", 2)
    target = build_model("edsr_baseline", target_scale)
    fresh_tail = {k: v.clone() for k, v in target.state_dict().items() if k.startswith("tail.")}
    # a DDP-wrapped state dict carries "module." prefixes
    report = load_pretrained(target, {f"module.{k}": v for k, v in x2.state_dict().items()})
    for key, value in target.state_dict().items():
        if key.startswith("tail."):
            assert torch.equal(value, fresh_tail[key]) and key in report.skipped
        else:
            assert torch.equal(value, x2.state_dict()[key]) and key in report.loaded


def test_load_pretrained_mismatches_are_clear():
    with pytest.raises(ModelMismatchError, match=r"weights \(edsr_baseline x2 \(16 blocks, 64 features\)\) "
                       r"do not fit model \(edsr x2 \(32 blocks, 256 features\)\)"):
        load_pretrained(build_model("edsr", 2, device="meta"), build_model("edsr_baseline", 2).state_dict())
    x2 = tiny(2).state_dict()
    with pytest.raises(ModelMismatchError, match="missing"):
        load_pretrained(tiny(4), x2, strict_tail=True)
    with pytest.raises(ModelMismatchError, match="mis-shaped"):
        load_pretrained(tiny(2, feats=4), x2)
    with pytest.raises(ModelMismatchError, match="not a known model.s state dict"):
        load_pretrained(tiny(2), {"fc.weight": torch.zeros(1)})
    report = load_pretrained(tiny(2), x2, strict_tail=True)
    assert report.skipped == []


def test_config_from_state_dict():
    for name, scale in PUBLISHED:
        config = config_from_state_dict(build_model(name, scale, device="meta").state_dict())
        assert (config.name, config.scale) == (name, scale)
    assert config_from_state_dict(tiny(3).state_dict()).describe() == "edsr_custom x3 (2 blocks, 8 features)"
    assert config_from_state_dict({"x": torch.zeros(1)}) is None


def test_receptive_field_radius_is_derived_from_the_layers():
    # head 1 + 2 per block + body end 1 + upsampler conv 1 + the rest at finer grids, rounded up
    assert receptive_field_radius(build_model("edsr_baseline", 2, device="meta")) == 36
    assert receptive_field_radius(build_model("edsr", 4, device="meta")) == 68
    assert receptive_field_radius(tiny(2, blocks=5)) == 2 * 5 + 4
    assert receptive_field_radius(torch.nn.Conv2d(3, 3, 5, padding=4, dilation=2)) == 4


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_receptive_field_radius_bounds_the_real_dependence(scale):
    torch.manual_seed(1)
    model = tiny(scale, blocks=1, feats=6).double()
    radius = receptive_field_radius(model)
    size = 2 * radius + 9
    lr = (torch.rand(1, 3, size, size, dtype=torch.float64) * 255).requires_grad_()
    centre = size // 2 * scale
    model(lr)[0, :, centre, centre].sum().backward()
    ys, xs = torch.nonzero(lr.grad.abs().sum(1)[0], as_tuple=True)
    reach = max((ys - size // 2).abs().max().item(), (xs - size // 2).abs().max().item())
    assert radius - 1 <= reach <= radius
