"""One model registry: config, checkpoints, trainer, commands and benchmarks read it; SRResNet proves it."""

import json

import pytest
import torch
from cli_in_process import run_hpdl

from hpdl.bench.models import benchmark_models, build_workload
from hpdl.cli import main
from hpdl.sr import registry
from hpdl.sr.checkpoint import load_model, make_checkpoint, save_checkpoint
from hpdl.sr.config import ConfigError, load_config
from hpdl.sr.models import build_model, build_model_from_config, count_parameters, receptive_field_radius
from hpdl.sr.registry import Architecture, ModelSize, make_config
from hpdl.sr.srresnet import SRResNet
from hpdl.sr.inference import forward_tiled

TOY = '''
import torch
from torch import nn
from hpdl.sr.registry import ModelConfig


class Toy(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config, self.scale = config, config.scale
        self.conv = nn.Conv2d(3, 3 * config.scale ** 2, 3, padding=1)
        self.up = nn.PixelShuffle(config.scale)

    def forward(self, x):
        return self.up(self.conv(x))


def build(config):
    return Toy(config)


def config_from_state_dict(sd):
    if set(sd) != {"conv.weight", "conv.bias"}:
        return None
    return ModelConfig("toy", int(round((sd["conv.weight"].shape[0] / 3) ** 0.5)), 1, 4, 1.0, arch="toy")
'''


def test_every_registered_model_is_accepted_everywhere_and_nothing_else():
    assert registry.model_names() == ("edsr_baseline", "edsr", "srresnet")
    assert benchmark_models() == ("edsr-baseline", "edsr", "srresnet", "resnet50")
    for name in registry.model_names():
        assert load_config("demo", [f"model={name}"]).model == name
    with pytest.raises(ConfigError, match="model: must be edsr_baseline or edsr or srresnet, got 'rcan'"):
        load_config("demo", ["model=rcan"])


def test_a_new_architecture_is_one_module_and_one_registration(tmp_path, monkeypatch):
    (tmp_path / "toy_arch.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.ARCHITECTURES, "toy", None)  # undone after the test
    monkeypatch.setitem(registry.SIZES, "toy", None)
    registry.register(Architecture("toy", "toy_arch", scales=(2, 3), scale_specific=("conv.",)),
                      ModelSize("toy", "toy", 1, 4))

    cfg = load_config("demo", ["model=toy", "scale=3"])
    with pytest.raises(ConfigError, match="scale: must be 2 or 3, got 4"):
        load_config("demo", ["model=toy", "scale=4"])
    model = build_model(cfg.model, cfg.scale)
    assert model(torch.zeros(1, 3, 5, 6)).shape == (1, 3, 15, 18)
    path = save_checkpoint(tmp_path / "toy.pt", make_checkpoint(model))
    loaded, ckpt = load_model(path)
    assert type(loaded).__name__ == "Toy" and ckpt["meta"]["config"]["arch"] == "toy"
    torch.save(model.state_dict(), tmp_path / "bare.pt")  # recognised by its own module's inference
    assert load_model(tmp_path / "bare.pt")[1]["meta"]["model_name"] == "toy"


def help_text(capsys, argv):
    with pytest.raises(SystemExit):
        main(argv + ["--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines where it likes


def test_commands_and_benchmarks_take_models_and_scales_from_the_registry_alone(tmp_path, monkeypatch, capsys):
    from PIL import Image

    from hpdl.bench.synthetic import SyntheticOptions
    from test_sr_train import photo

    (tmp_path / "toy_arch.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.ARCHITECTURES, "toy", None)  # undone after the test
    monkeypatch.setitem(registry.SIZES, "toy", None)
    registry.register(Architecture("toy", "toy_arch", scales=(8,), scale_specific=("conv.",)),
                      ModelSize("toy", "toy", 1, 4))

    # the help lists it, with its scale
    assert "toy" in help_text(capsys, ["sr"]) and "toy" in help_text(capsys, ["sr", "train"])
    assert "--scale {2,3,4,8}" in help_text(capsys, ["sr", "eval"])
    bench_help = help_text(capsys, ["bench", "synthetic"])
    assert "toy" in bench_help and "edsr-baseline, edsr, srresnet: 2, 3, 4; toy: 8" in bench_help

    # eval takes --scale 8
    save_checkpoint(tmp_path / "toy.pt", make_checkpoint(build_model("toy", 8)))
    (tmp_path / "photos").mkdir()
    Image.fromarray(photo(64, 48, 0)).save(tmp_path / "photos" / "a.png")
    assert main(["sr", "eval", "--ckpt", str(tmp_path / "toy.pt"), "--scale", "8", "--data", str(tmp_path / "photos"),
                 "--cache-dir", str(tmp_path / "cache"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["scale"] == 8

    # and so does the benchmark, for this model only
    assert "toy" in benchmark_models()
    assert SyntheticOptions(model="toy", scale=8).scale == 8
    with pytest.raises(ValueError, match="scale of toy must be one of 8, got 2"):
        SyntheticOptions(model="toy", scale=2)
    with pytest.raises(ValueError, match="scale of edsr-baseline must be one of 2, 3, 4, got 8"):
        SyntheticOptions(model="edsr-baseline", scale=8)
    assert build_workload("toy", 1, scale=8, patch=4).targets.shape == (1, 3, 32, 32)


def test_srresnet_size_and_bench_workload():
    # conv_first 1,792 + 16 blocks x 2 x 36,928 + upconv1/2 2 x 147,712 + conv_hr 36,928 + conv_last 1,731
    assert count_parameters(build_model("srresnet", 4, device="meta")) == 1_517_571
    assert count_parameters(build_model("srresnet", 2, device="meta")) == 1_517_571 - 147_712
    workload = build_workload("srresnet", 2, scale=3, patch=8)
    assert isinstance(workload.model, SRResNet) and workload.describe() == "srresnet x3, input 2x3x8x8"


def small_srresnet(scale, std=0.2):
    """SRResNet of 2 blocks of 8 features with weights large enough that every pixel in reach shows."""
    model = build_model_from_config(make_config("srresnet", scale, 2, 8)).eval()
    gen = torch.Generator().manual_seed(scale)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def test_srresnet_receptive_field_radius():
    # conv_first 1 + 2 per block + upconv1 1 + conv_hr and conv_last on the finer grid, rounded up
    for scale in (2, 3, 4):
        assert receptive_field_radius(build_model("srresnet", scale, device="meta")) == 35
    assert receptive_field_radius(small_srresnet(2)) == 7


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_srresnet_tiles_exactly_with_its_receptive_field(scale):
    model = small_srresnet(scale)
    radius = receptive_field_radius(model)
    lr = torch.rand(1, 3, 45, 67, generator=torch.Generator().manual_seed(scale)) * 255
    with torch.no_grad():
        whole = model(lr)
        tiled = forward_tiled(model, lr, tile=16)
        too_little = forward_tiled(model, lr, tile=16, overlap=radius - 1)
    assert tiled.shape == whole.shape == (1, 3, 45 * scale, 67 * scale)
    scale_of_values = whole.abs().max().item()
    assert (tiled - whole).abs().max().item() < 1e-5 * scale_of_values  # float rounding only
    # one pixel less overlap than the receptive-field radius is no longer exact
    assert (too_little - whole).abs().max().item() > 1e-3 * scale_of_values


def test_srresnet_trains_evaluates_and_upscales_through_the_same_commands(tmp_path):
    from PIL import Image

    from test_sr_train import photo, tiny_data

    data, out = tiny_data(tmp_path), tmp_path / "run"
    argv = ["sr", "train", "--config", "demo", "model=srresnet", f"data={data / 'train'}", f"val_data={data / 'val'}",
            f"cache_dir={data / 'cache'}", f"out_dir={out}", "n_resblocks=1", "n_feats=8", "patch_size=8",
            "batch_size=2", "repeat=3", "workers=0", "log_every=2", "warmup_updates=0", "progress=false",
            "total_updates=4", "val_every=2", "--json"]
    proc = run_hpdl(argv)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["model"] == "srresnet_custom x2 (1 blocks, 8 features)" and summary["updates"] == 4
    model, ckpt = load_model(out / "model.pt")
    assert isinstance(model, SRResNet) and ckpt["meta"]["config"]["arch"] == "srresnet"

    assert main(["sr", "eval", "--ckpt", str(out / "model.pt"), "--data", str(data / "val"),
                 "--cache-dir", str(data / "cache"), "--tile", "7"]) == 0
    Image.fromarray(photo(20, 23, 0)).save(tmp_path / "in.png")
    assert main(["sr", "upscale", str(tmp_path / "in.png"), str(tmp_path / "out.png"), "--ckpt",
                 str(out / "model.pt"), "--tile", "8"]) == 0
    assert Image.open(tmp_path / "out.png").size == (46, 40)
