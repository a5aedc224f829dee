"""evaluate() and the `hpdl sr eval` / `hpdl sr upscale` commands on a tiny random model."""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from hpdl.cli import main
from hpdl.sr.checkpoint import make_checkpoint, save_checkpoint
from hpdl.sr.datasets import open_pairs
from hpdl.sr.evaluate import evaluate, format_table
from hpdl.sr.images import bicubic_downscale
from hpdl.sr.metrics import bicubic_upscale
from hpdl.sr.models import build_model_from_config
from hpdl.sr.registry import ModelConfig


def tiny(scale=2):
    torch.manual_seed(0)
    return build_model_from_config(ModelConfig("tiny", scale, 1, 8, 1.0))


def photo(h, w, seed=0):
    """A smooth random image (so bicubic scores are realistic, not noise)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (h // 8 + 2, w // 8 + 2, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC))


@pytest.fixture
def folder(tmp_path):
    for i, (h, w) in enumerate([(40, 52), (37, 45)]):
        Image.fromarray(photo(h, w, i)).save(tmp_path / f"img{i}.png")
    return tmp_path


@pytest.fixture
def ckpt(tmp_path):
    return save_checkpoint(tmp_path / "tiny_x2.pt", make_checkpoint(tiny(2)))


class Identity(torch.nn.Module):
    """Upscale by bicubic: its scores must equal the bicubic baseline's."""

    scale = 2

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return bicubic_upscale(x, 2)


def test_evaluate_records_means_and_table(folder):
    pairs = open_pairs(folder, 2, cache_dir=folder / "cache")
    model = Identity().train()
    result = evaluate(model, pairs, 2, "y")
    assert model.training  # mode restored
    assert [r.name for r in result.records] == ["img0", "img1"]
    for r in result.records:
        assert r.psnr == pytest.approx(r.bicubic_psnr) and r.ssim == pytest.approx(r.bicubic_ssim)
        assert 20 < r.psnr < 60 and 0 < r.ssim <= 1
    means = result.means()
    assert means["psnr"] == pytest.approx(sum(r.psnr for r in result.records) / 2)
    table = format_table(result)
    assert "x2, Y (BT.601), 2 px border shaved" in table and "mean" in table
    rgb = evaluate(model, pairs, 2, "rgb", self_ensemble=True, tile=8)
    assert rgb.shave == 8 and rgb.to_dict()["mean"]["psnr"] == pytest.approx(rgb.means()["psnr"])
    with pytest.raises(ValueError, match="scale x3 does not match"):
        evaluate(model, pairs, 3)


def test_cli_eval_json(folder, ckpt, capsys):
    code = main(["sr", "eval", "--ckpt", str(ckpt), "--data", str(folder), "--json", "--tile", "16",
                 "--cache-dir", str(folder / "cache")])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["scale"] == 2 and out["model"] == "tiny" and out["downscaler"] == "matlab"
    (only,) = out["sets"]
    assert only["space"] == "y" and only["layout"] == "folder" and only["name"] == folder.name
    assert [r["name"] for r in only["images"]] == ["img0", "img1"]
    assert math.isfinite(only["mean"]["psnr"]) and only["mean"]["bicubic_psnr"] > 20


def test_cli_eval_table_on_a_benchmark_layout(tmp_path, ckpt, capsys):
    hr = photo(48, 40)
    (tmp_path / "Set5" / "HR").mkdir(parents=True)
    (tmp_path / "Set5" / "LR_bicubic" / "X2").mkdir(parents=True)
    Image.fromarray(hr).save(tmp_path / "Set5" / "HR" / "baby.png")
    Image.fromarray(bicubic_downscale(hr, 2)).save(tmp_path / "Set5" / "LR_bicubic" / "X2" / "babyx2.png")
    assert main(["sr", "eval", "--ckpt", str(ckpt), "--data", str(tmp_path / "Set5"), "--space", "rgb",
                 "--self-ensemble", "--cache-dir", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "tiny x2 (1 blocks, 8 features)" in out and "RGB, 8 px border shaved, self-ensemble" in out
    assert "baby" in out


def error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1]


def test_cli_eval_bad_input(tmp_path, folder, ckpt, capsys):
    assert main(["sr", "eval", "--ckpt", str(tmp_path / "none.pt"), "--data", str(folder)]) == 2
    assert error_line(capsys) == f"hpdl: error: {tmp_path / 'none.pt'}: no such checkpoint file"
    assert main(["sr", "eval", "--ckpt", str(ckpt), "--scale", "4", "--data", str(folder)]) == 2
    assert error_line(capsys).endswith("tiny_x2.pt: checkpoint is for tiny x2, not tiny x4")
    (folder / "bad.png").write_bytes(b"garbage")
    assert main(["sr", "eval", "--ckpt", str(ckpt), "--data", str(folder), "--cache-dir", str(tmp_path / "c")]) == 2
    assert "bad.png: cannot decode image" in error_line(capsys)
    assert main(["sr", "eval", "--ckpt", str(ckpt), "--data", str(tmp_path / "missing")]) == 2
    assert "missing: no such directory" in error_line(capsys)
    assert main(["sr", "eval", "--ckpt", str(ckpt), "--data", str(folder), "--range", "x"]) == 2
    assert "--range: expected an index range" in error_line(capsys)
    if not torch.cuda.is_available():
        assert main(["sr", "eval", "--ckpt", str(ckpt), "--data", str(folder), "--device", "cuda"]) == 2
        assert "CUDA is not available" in error_line(capsys)
    (tmp_path / "small").mkdir()
    Image.fromarray(photo(24, 24)).save(tmp_path / "small" / "s.png")  # RGB shaves 8: 8x8 left
    assert main(["sr", "eval", "--ckpt", str(ckpt), "--data", str(tmp_path / "small"), "--space", "rgb",
                 "--cache-dir", str(tmp_path / "c")]) == 2
    assert error_line(capsys).endswith("s.png: image (8, 8) is smaller than the 11x11 SSIM window")


def test_cli_upscale(tmp_path, ckpt, capsys):
    Image.fromarray(photo(21, 30)).convert("L").save(tmp_path / "in.png")  # gray input works too
    assert main(["sr", "upscale", str(tmp_path / "in.png"), str(tmp_path / "out" / "x2.png"),
                 "--ckpt", str(ckpt), "--tile", "8", "--self-ensemble"]) == 0
    out = np.asarray(Image.open(tmp_path / "out" / "x2.png"))
    assert out.shape == (42, 60, 3)
    # tiled and whole-image give the same picture
    assert main(["sr", "upscale", str(tmp_path / "in.png"), str(tmp_path / "whole.png"), "--ckpt", str(ckpt),
                 "--tile", "0", "--self-ensemble"]) == 0
    whole = np.asarray(Image.open(tmp_path / "whole.png"))
    assert np.abs(whole.astype(int) - out.astype(int)).max() <= 1


def test_cli_upscale_overwrite_and_max_pixels(tmp_path, ckpt, capsys):
    Image.fromarray(photo(21, 30)).save(tmp_path / "in.png")
    (tmp_path / "out.png").write_bytes(b"an earlier result")
    argv = ["sr", "upscale", str(tmp_path / "in.png"), str(tmp_path / "out.png"), "--ckpt", str(ckpt)]
    assert main(argv) == 2
    assert error_line(capsys).endswith("out.png: already exists; pass --overwrite to replace it")
    assert main(argv + ["--overwrite", "--max-pixels", "629"]) == 2
    assert error_line(capsys).endswith("in.png: image of 30x21 (630 pixels) exceeds the limit of 629 pixels; "
                                       "raise it with --max-pixels")
    assert (tmp_path / "out.png").read_bytes() == b"an earlier result"
    assert main(argv + ["--overwrite", "--max-pixels", "630"]) == 0
    assert np.asarray(Image.open(tmp_path / "out.png")).shape == (42, 60, 3)


def test_cli_upscale_bad_input(tmp_path, ckpt, capsys):
    (tmp_path / "torn.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    assert main(["sr", "upscale", str(tmp_path / "torn.png"), str(tmp_path / "o.png"), "--ckpt", str(ckpt)]) == 2
    assert "torn.png: cannot decode image" in error_line(capsys)
    Image.fromarray(photo(8, 8)).save(tmp_path / "in.png")
    assert main(["sr", "upscale", str(tmp_path / "in.png"), str(tmp_path / "o.xyz"), "--ckpt", str(ckpt)]) == 2
    assert "o.xyz: unknown image extension '.xyz'" in error_line(capsys)
    cut = ckpt.read_bytes()[:300]
    (tmp_path / "cut.pt").write_bytes(cut)
    assert main(["sr", "upscale", str(tmp_path / "in.png"), str(tmp_path / "o.png"), "--ckpt",
                 str(tmp_path / "cut.pt")]) == 2
    assert "cut.pt: not a readable checkpoint: the zip archive is truncated or damaged" in error_line(capsys)


def test_cli_sr_without_subcommand_prints_help(capsys):
    assert main(["sr"]) == 2
    assert "eval" in capsys.readouterr().out
