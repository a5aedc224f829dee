"""evaluate() and the `hpdl sr eval` / `hpdl sr upscale` commands on a tiny random model."""

import json
import math
import warnings

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
    assert error_line(capsys).endswith("s.png: image of 24x24 is too small to measure at x2 on RGB: 8 px shaved "
                                       "from each border must leave the 11x11 SSIM window, so each side needs at "
                                       "least 27 px")


def test_cli_eval_checks_every_image_of_every_set_before_scoring_any(tmp_path, ckpt, capsys):
    for name, sizes in (("first", [(40, 52)]), ("second", [(40, 52), (30, 8), (2, 2)])):
        (tmp_path / name).mkdir()
        for i, (h, w) in enumerate(sizes):
            Image.fromarray(photo(h, w, i)).save(tmp_path / name / f"img{i}.png")
    argv = ["sr", "eval", "--ckpt", str(ckpt), "--data", f"{tmp_path / 'first'}+{tmp_path / 'second'}",
            "--save-results", str(tmp_path / "results"), "--cache-dir", str(tmp_path / "c")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor a warning of torch's about read-only arrays
        assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines()[-1] == (
        f"hpdl: error: {tmp_path / 'second' / 'img1.png'}: image of 8x30 is too small to measure at x2 on Y: "
        "2 px shaved from each border must leave the 11x11 SSIM window, so each side needs at least 15 px")
    assert "eval:" not in captured.err and not (tmp_path / "results").exists()  # nothing scored, nothing written
    for small in ("img1.png", "img2.png"):
        (tmp_path / "second" / small).unlink()
    assert main(argv) == 0  # and no half-written results block the re-run


@pytest.mark.parametrize("results", ["parent of the set", "the set itself", "inside the set", "through a link"])
def test_cli_eval_never_writes_results_into_a_set_it_evaluates(tmp_path, folder, ckpt, capsys, results):
    data = tmp_path / "ds" / "set"
    data.mkdir(parents=True)
    for image in folder.glob("*.png"):
        image.rename(data / image.name)
    given = {"parent of the set": data.parent, "the set itself": data, "inside the set": data / "results"}.get(
        results, tmp_path / "link")
    if results == "through a link":
        given.symlink_to(data.parent)
    before = sorted(p.name for p in data.rglob("*"))
    assert main(["sr", "eval", "--ckpt", str(ckpt), "--data", str(data), "--save-results", str(given),
                 "--overwrite", "--cache-dir", str(tmp_path / "c")]) == 2
    line = error_line(capsys)
    assert line.startswith(f"hpdl: error: --save-results {given}: would write the SR images into the input set "
                           f"{data} (") and line.endswith("); give a directory outside the sets"), line
    assert sorted(p.name for p in data.rglob("*")) == before


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


def test_a_checkpoint_of_non_finite_weights_is_refused_by_every_command(tmp_path, folder, capsys):
    model = tiny(2)
    with torch.no_grad():
        model.tail[-1].weight[0, 0, 0, 0] = float("nan")
    bad = save_checkpoint(tmp_path / "diverged.pt", make_checkpoint(model))
    Image.fromarray(photo(16, 16)).save(tmp_path / "in.png")
    for argv in (["upscale", str(tmp_path / "in.png"), str(tmp_path / "out.png")],
                 ["eval", "--data", str(folder), "--cache-dir", str(tmp_path / "c")],
                 ["export", "--to", "basicsr", str(tmp_path / "out.pth")]):
        assert main(["sr", *argv, "--ckpt", str(bad)]) == 2
        assert error_line(capsys) == (f"hpdl: error: {bad}: weights hold NaN or infinite values (tail.1.weight): "
                                      "written by a training run that diverged?")
    assert not (tmp_path / "out.png").exists() and not (tmp_path / "out.pth").exists()


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0"])
def test_res_scale_must_be_a_finite_positive_number(tmp_path, ckpt, capsys, value):
    for argv in (["upscale", "in.png", "out.png"], ["eval"], ["export", "--to", "basicsr", "out.pth"]):
        with pytest.raises(SystemExit) as exit:
            main(["sr", *argv, "--ckpt", str(ckpt), "--res-scale", value])
        assert exit.value.code == 2
        assert error_line(capsys).startswith(f"hpdl: error: argument --res-scale: must be a finite number > 0, "
                                             f"got '{value}'")


@pytest.mark.parametrize("command", ["upscale", "upscale --overwrite", "export", "eval"])
@pytest.mark.parametrize("output", ["a directory", "empty"])
def test_an_output_that_is_a_directory_or_empty_is_refused_before_any_work(tmp_path, ckpt, folder, capsys,
                                                                          command, output):
    target = tmp_path / "out.png" if output == "a directory" else ""
    if target:
        target.mkdir()
    Image.fromarray(photo(16, 16)).save(tmp_path / "in.png")
    name, *options = command.split()
    argv = {"upscale": [str(tmp_path / "in.png"), str(target)], "export": ["--to", "basicsr", str(target)],
            "eval": ["--data", str(folder), "--cache-dir", str(tmp_path / "c"), "--grid", str(target)]}[name]
    assert main(["sr", name, *argv, *options, "--ckpt", str(ckpt)]) == 2
    captured = capsys.readouterr()
    expected = {"a directory": f"{target}: is a directory; give a file name",
                "empty": "--grid: empty path" if name == "eval" else "empty output path: give a file name"}[output]
    assert captured.err.strip().splitlines() == [f"hpdl: error: {expected}"]  # no progress: refused up front
    assert not target or list(target.iterdir()) == []


@pytest.mark.parametrize("rank", [0, 1])
def test_under_several_ranks_rank_0_alone_runs_eval_and_upscale(tmp_path, folder, ckpt, capsys, monkeypatch, rank):
    # As torchrun (or hpdl run) describes rank `rank` of 2 to each process.
    for key, value in {"RANK": rank, "WORLD_SIZE": 2, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": 2}.items():
        monkeypatch.setenv(key, str(value))
    Image.fromarray(photo(16, 16)).save(tmp_path / "in.png")
    assert main(["sr", "upscale", str(tmp_path / "in.png"), str(tmp_path / "out.png"), "--ckpt", str(ckpt)]) == 0
    assert main(["sr", "eval", "--ckpt", str(ckpt), "--data", str(folder), "--cache-dir", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "out.png").exists() == (rank == 0)
    assert out.count("mean") == (rank == 0) and ("wrote" in out) == (rank == 0)


def test_eval_names_an_empty_data_value_and_an_unusable_cache_dir(tmp_path, folder, ckpt, capsys):
    assert main(["sr", "eval", "--ckpt", str(ckpt), "--data", ""]) == 2
    assert error_line(capsys) == ("hpdl: error: --data is empty: give a dataset folder, several joined by '+', "
                                  "or 'embedded'")
    (tmp_path / "file").write_text("not a directory")
    assert main(["sr", "eval", "--ckpt", str(ckpt), "--data", str(folder), "--cache-dir", str(tmp_path / "file")]) == 2
    assert error_line(capsys) == (f"hpdl: error: {tmp_path / 'file' / 'decoded'}: cannot write the decode cache there "
                                  f"({tmp_path / 'file'} is not a directory); give a writable cache directory "
                                  "(cache_dir= / --cache-dir)")
