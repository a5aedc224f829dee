"""Weights of EDSR-PyTorch and BasicSR: read into hpdl's models with the same outputs, and written back."""

import numpy as np
import pytest
import torch

from hpdl.cli import main
from hpdl.sr.checkpoint import load_checkpoint, load_model, make_checkpoint, save_checkpoint
from hpdl.sr.models import build_model, config_from_state_dict
from hpdl.sr.weights import import_weights
from sr_reference import BasicsrEDSR, BasicsrMSRResNet, EdsrPytorchEDSR, randomise


def lr_batch(seed=0, size=(9, 11)):
    return torch.rand(2, 3, *size, generator=torch.Generator().manual_seed(seed)) * 255


def hpdl_output(path, x):
    model, _ = load_model(path)
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_edsr_pytorch_state_dict_gives_its_outputs(tmp_path, scale):
    ref = randomise(EdsrPytorchEDSR(n_resblocks=2, n_feats=8, scale=scale), seed=scale)
    torch.save(ref.state_dict(), tmp_path / "edsr.pt")
    x = lr_batch()
    with torch.no_grad():
        torch.testing.assert_close(hpdl_output(tmp_path / "edsr.pt", x), ref(x), atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_basicsr_edsr_gives_its_outputs(tmp_path, scale):
    ref = randomise(BasicsrEDSR(num_feat=8, num_block=3, upscale=scale), seed=scale)
    torch.save({"params": ref.state_dict()}, tmp_path / "basicsr.pth")
    x = lr_batch()
    with torch.no_grad():
        expected = ref(x / 255) * 255  # BasicSR works on [0, 1]
    torch.testing.assert_close(hpdl_output(tmp_path / "basicsr.pth", x), expected, atol=1e-3, rtol=1e-5)
    ckpt = load_checkpoint(tmp_path / "basicsr.pth")
    assert ckpt["meta"]["config"]["n_resblocks"] == 3 and ckpt["meta"]["scale"] == scale
    assert any("DIV2K mean" in note for note in ckpt["meta"]["notes"])


def test_basicsr_file_with_a_moving_average_loads_the_average(tmp_path):
    trained = randomise(BasicsrEDSR(num_feat=8, num_block=1, upscale=2), seed=1)
    average = randomise(BasicsrEDSR(num_feat=8, num_block=1, upscale=2), seed=2)
    torch.save({"params": trained.state_dict(), "params_ema": average.state_dict()}, tmp_path / "net_g.pth")
    x = lr_batch()
    with torch.no_grad():
        torch.testing.assert_close(hpdl_output(tmp_path / "net_g.pth", x), average(x / 255) * 255,
                                   atol=1e-3, rtol=1e-5)
    notes = load_checkpoint(tmp_path / "net_g.pth")["meta"]["notes"]
    assert any("using 'params_ema'" in note for note in notes)


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_basicsr_srresnet_gives_its_outputs(tmp_path, scale):
    ref = randomise(BasicsrMSRResNet(num_feat=8, num_block=2, upscale=scale), seed=scale)
    torch.save({"params": ref.state_dict()}, tmp_path / "msrresnet.pth")
    x = lr_batch()
    with torch.no_grad():
        expected = ref(x / 255) * 255
    torch.testing.assert_close(hpdl_output(tmp_path / "msrresnet.pth", x), expected, atol=1e-3, rtol=1e-5)
    assert load_checkpoint(tmp_path / "msrresnet.pth")["meta"]["config"]["arch"] == "srresnet"


def test_state_dict_without_means_loads_with_the_div2k_mean_and_a_note(tmp_path, capsys):
    ref = randomise(EdsrPytorchEDSR(n_resblocks=1, n_feats=8, scale=2), seed=0)
    state = {k: v for k, v in ref.state_dict().items() if "mean" not in k}
    torch.save(state, tmp_path / "no_mean.pt")
    x = lr_batch()
    with torch.no_grad():
        torch.testing.assert_close(hpdl_output(tmp_path / "no_mean.pt", x), ref(x), atol=1e-3, rtol=1e-5)
    image = tmp_path / "in.png"
    from PIL import Image

    Image.fromarray((lr_batch(size=(12, 12))[0].permute(1, 2, 0)).byte().numpy()).save(image)
    assert main(["sr", "upscale", str(image), str(tmp_path / "out.png"), "--ckpt", str(tmp_path / "no_mean.pt")]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hpdl: note:") and "mean" in line]
    assert len(notes) == 1 and "no sub_mean/add_mean" in notes[0] and "DIV2K mean" in notes[0]


@pytest.mark.parametrize("blocks,feats,name,res_scale", [(16, 64, "edsr_baseline", 1.0), (32, 256, "edsr", 0.1)])
def test_basicsr_published_sizes_are_recognised(blocks, feats, name, res_scale):
    with torch.device("meta"):
        ref = BasicsrEDSR(num_feat=feats, num_block=blocks, upscale=4, res_scale=res_scale)
    state, _ = import_weights({"params": ref.state_dict()})
    config = config_from_state_dict(state)
    assert (config.name, config.scale, config.res_scale) == (name, 4, res_scale)
    assert set(state) == set(build_model(name, 4, device="meta").state_dict())


@pytest.mark.parametrize("scale", [2, 4])
def test_export_to_basicsr_and_edsr_pytorch_loads_strictly_with_equal_outputs(tmp_path, scale):
    torch.manual_seed(scale)
    from hpdl.sr.models import build_model_from_config
    from hpdl.sr.registry import ModelConfig

    model = randomise(build_model_from_config(ModelConfig("tiny", scale, 2, 8, 1.0)), seed=scale)
    ckpt = save_checkpoint(tmp_path / "tiny.pt", make_checkpoint(model))
    x = lr_batch()
    with torch.no_grad():
        ours = model(x)

    assert main(["sr", "export", str(tmp_path / "b.pth"), "--ckpt", str(ckpt), "--to", "basicsr"]) == 0
    basicsr = BasicsrEDSR(num_feat=8, num_block=2, upscale=scale).eval()
    basicsr.load_state_dict(torch.load(tmp_path / "b.pth", weights_only=True)["params"], strict=True)
    with torch.no_grad():
        torch.testing.assert_close(basicsr(x / 255) * 255, ours, atol=1e-3, rtol=1e-5)

    assert main(["sr", "export", str(tmp_path / "e.pt"), "--ckpt", str(ckpt), "--to", "edsr-pytorch"]) == 0
    edsr = EdsrPytorchEDSR(n_resblocks=2, n_feats=8, scale=scale).eval()
    edsr.load_state_dict(torch.load(tmp_path / "e.pt", weights_only=True), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(edsr(x), ours, atol=1e-3, rtol=1e-5)

    # and back: the exported BasicSR file is the same model again
    torch.testing.assert_close(hpdl_output(tmp_path / "b.pth", x), ours, atol=1e-3, rtol=1e-5)


def test_srresnet_exports_to_basicsr(tmp_path):
    model = randomise(build_model("srresnet", 4), seed=3)
    ckpt = save_checkpoint(tmp_path / "srresnet.pt", make_checkpoint(model))
    assert main(["sr", "export", str(tmp_path / "s.pth"), "--ckpt", str(ckpt), "--to", "basicsr"]) == 0
    ref = BasicsrMSRResNet(upscale=4).eval()
    ref.load_state_dict(torch.load(tmp_path / "s.pth", weights_only=True)["params"], strict=True)
    x = lr_batch(size=(6, 7))
    with torch.no_grad():
        torch.testing.assert_close(ref(x / 255) * 255, model(x), atol=1e-3, rtol=1e-5)


def upscaled_png(tmp_path, ckpt, name, *options):
    """Run ``hpdl sr upscale`` of a fixed image with ``ckpt``; return the output image."""
    from PIL import Image

    image = tmp_path / "in.png"
    if not image.exists():
        Image.fromarray(lr_batch(size=(12, 10))[0].permute(1, 2, 0).byte().numpy()).save(image)
    assert main(["sr", "upscale", str(image), str(tmp_path / name), "--ckpt", str(ckpt), *options]) == 0
    return torch.from_numpy(np.asarray(Image.open(tmp_path / name)).copy())


def test_custom_edsr_round_trips_through_basicsr_and_edsr_pytorch_with_its_res_scale(tmp_path, capsys):
    from hpdl.sr.models import build_model_from_config
    from hpdl.sr.registry import ModelConfig

    model = randomise(build_model_from_config(ModelConfig("edsr_custom", 2, 2, 8, 0.1)), seed=5)
    ckpt = save_checkpoint(tmp_path / "custom.pt", make_checkpoint(model))
    x = lr_batch()
    with torch.no_grad():
        ours = model(x)

    # export says, in one line each, what the other side needs; with it the other side computes ours
    assert main(["sr", "export", str(tmp_path / "e.pt"), "--ckpt", str(ckpt), "--to", "edsr-pytorch"]) == 0
    assert main(["sr", "export", str(tmp_path / "b.pth"), "--ckpt", str(ckpt), "--to", "basicsr"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hpdl: note:")]
    assert len(notes) == 2
    assert "--res_scale 0.1 for EDSR-PyTorch" in notes[0] and "--res-scale 0.1" in notes[0]
    assert "res_scale: 0.1 under network_g" in notes[1]
    edsr = EdsrPytorchEDSR(n_resblocks=2, n_feats=8, scale=2, res_scale=0.1).eval()
    edsr.load_state_dict(torch.load(tmp_path / "e.pt", weights_only=True), strict=True)
    basicsr = BasicsrEDSR(num_feat=8, num_block=2, upscale=2, res_scale=0.1).eval()
    basicsr.load_state_dict(torch.load(tmp_path / "b.pth", weights_only=True)["params"], strict=True)
    with torch.no_grad():
        torch.testing.assert_close(edsr(x), ours, atol=1e-3, rtol=1e-5)
        torch.testing.assert_close(basicsr(x / 255) * 255, ours, atol=1e-3, rtol=1e-5)

    # read back, the files say res_scale 1.0 is assumed; given 0.1 they are the same model exactly
    for exported in ("e.pt", "b.pth"):
        assumed = load_checkpoint(tmp_path / exported)
        assert assumed["meta"]["config"]["res_scale"] == 1.0
        assert any("res_scale is not stored in the weights: assuming 1.0" in note for note in assumed["meta"]["notes"])
        with torch.no_grad():
            assert not torch.allclose(load_model(tmp_path / exported)[0](x), ours, atol=1e-2)
            back, told = load_model(tmp_path / exported, res_scale=0.1)
            assert torch.equal(back(x), ours) and not any("res_scale" in n for n in told["meta"]["notes"])
    original = upscaled_png(tmp_path, ckpt, "original.png")
    assert torch.equal(upscaled_png(tmp_path, tmp_path / "b.pth", "basicsr.png", "--res-scale", "0.1"), original)
    assert not torch.equal(upscaled_png(tmp_path, tmp_path / "b.pth", "assumed.png"), original)
    assumed_notes = [line for line in capsys.readouterr().err.splitlines() if "assuming 1.0" in line]
    assert len(assumed_notes) == 1 and assumed_notes[0].startswith("hpdl: note: res_scale is not stored")


@pytest.mark.parametrize("name,blocks,feats,res_scale,read_as", [
    ("edsr", 16, 64, 0.1, "edsr_baseline"), ("edsr_baseline", 32, 256, 1.0, "edsr"),
], ids=["edsr at the baseline's size", "baseline at edsr's size"])
def test_edsr_of_a_published_size_with_another_res_scale_is_exported_with_how_to_read_it_back(
        tmp_path, capsys, name, blocks, feats, res_scale, read_as):
    from hpdl.sr.models import build_model_from_config
    from hpdl.sr.registry import make_config

    # hpdl reads weights of a published size as that published model: here the other res_scale
    config = make_config(name, 2, blocks, feats)
    assert config.res_scale == res_scale and (config.n_resblocks, config.n_feats) == (blocks, feats)
    torch.manual_seed(0)
    model = build_model_from_config(config).eval()
    ckpt = save_checkpoint(tmp_path / "model.pt", make_checkpoint(model))
    x = lr_batch(size=(5, 6))
    with torch.no_grad():
        ours = model(x)
    for fmt, exported in (("edsr-pytorch", tmp_path / "e.pt"), ("basicsr", tmp_path / "b.pth")):
        assert main(["sr", "export", str(exported), "--ckpt", str(ckpt), "--to", fmt]) == 0
        notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hpdl: note:")]
        assert len(notes) == 1, notes
        assert f"--res-scale {res_scale} when hpdl reads the file back" in notes[0]
        assert f"otherwise it takes {read_as}'s" in notes[0]
        assert (f"--res_scale {res_scale} for EDSR-PyTorch" in notes[0]) == (fmt == "edsr-pytorch" and res_scale != 1.0)
        # without the option the file is read as the published model, with it as the model exported
        assumed, told = load_model(exported)
        assert told["meta"]["model_name"] == read_as and assumed.config.res_scale != res_scale
        back, _ = load_model(exported, res_scale=res_scale)
        with torch.no_grad():
            assert not torch.allclose(assumed(x), ours, atol=1e-2)
            assert torch.equal(back(x), ours)
        del assumed, back
        exported.unlink()


def test_foreign_edsr_of_a_custom_size_takes_the_res_scale_it_is_given(tmp_path):
    ref = randomise(BasicsrEDSR(num_feat=16, num_block=3, upscale=3, res_scale=0.1), seed=7)
    torch.save({"params": ref.state_dict()}, tmp_path / "net.pth")
    x = lr_batch()
    model, ckpt = load_model(tmp_path / "net.pth", res_scale=0.1)
    assert ckpt["meta"]["config"]["res_scale"] == 0.1 and ckpt["meta"]["model_name"] == "edsr_custom"
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x / 255) * 255, atol=1e-3, rtol=1e-5)


def test_res_scale_is_refused_where_the_weights_store_it_or_the_model_has_none(tmp_path, capsys):
    from hpdl.sr.errors import CheckpointError
    from hpdl.sr.registry import make_config, with_res_scale
    from hpdl.sr.weights import res_scale_note

    ckpt = save_checkpoint(tmp_path / "b.pt", make_checkpoint(build_model("edsr_baseline", 2)))
    assert load_model(ckpt, res_scale=1.0)[1]["meta"]["config"]["res_scale"] == 1.0
    with pytest.raises(CheckpointError, match=r"b\.pt: an hpdl checkpoint of res_scale 1\.0, not 0\.1"):
        load_model(ckpt, res_scale=0.1)
    # on the command line as docs/sr.md says: the stored value is accepted, another one refused in one line
    export = ["sr", "export", str(tmp_path / "out.pth"), "--ckpt", str(ckpt), "--to", "basicsr", "--res-scale"]
    assert main(export + ["0.1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hpdl: error: ")
    assert "an hpdl checkpoint of res_scale 1.0, not 0.1" in err
    assert not (tmp_path / "out.pth").exists()
    assert main(export + ["1"]) == 0 and (tmp_path / "out.pth").exists()
    torch.save({"params": randomise(BasicsrMSRResNet(num_feat=8, num_block=1, upscale=2), 0).state_dict()},
               tmp_path / "msr.pth")
    with pytest.raises(CheckpointError, match=r"msr\.pth: srresnet has no res_scale"):
        load_model(tmp_path / "msr.pth", res_scale=1.0)
    torch.save(randomise(EdsrPytorchEDSR(n_resblocks=1, n_feats=8, scale=2), 0).state_dict(), tmp_path / "e.pt")
    with pytest.raises(CheckpointError, match=r"e\.pt: res_scale must be > 0, got -1"):
        load_model(tmp_path / "e.pt", res_scale=-1)
    # published sizes: known res_scale, nothing to say unless it is not the default elsewhere
    assert with_res_scale(make_config("edsr_baseline", 2), None) == (make_config("edsr_baseline", 2), [])
    assert with_res_scale(make_config("edsr_baseline", 2), 0.1)[0].name == "edsr_custom"
    assert res_scale_note(make_config("edsr_baseline", 2), "basicsr") is None
    assert "--res_scale 0.1 for EDSR-PyTorch" in res_scale_note(make_config("edsr", 2), "edsr-pytorch")
    assert "reads the file back" not in res_scale_note(make_config("edsr", 2), "edsr-pytorch")
    assert res_scale_note(make_config("srresnet", 2), "basicsr") is None
