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
from hpdl.sr.evaluation import evaluate, format_table
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
    assert out.shape == (42, 60)  # gray in, gray out
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


def upscaled(tmp_path, ckpt, name, image, out="out.png", **save):
    """Write ``image`` (a PIL image) as ``name``, upscale it to ``out``; return the output image."""
    image.save(tmp_path / name, **save)
    assert main(["sr", "upscale", str(tmp_path / name), str(tmp_path / out), "--ckpt", str(ckpt),
                 "--overwrite", "--tile", "8"]) == 0
    return Image.open(tmp_path / out)


def test_upscale_turns_an_exif_rotated_photo_upright_as_viewers_show_it(tmp_path, ckpt, capsys):
    from PIL import ImageOps

    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: "rotate 90 degrees clockwise to view"
    out = upscaled(tmp_path, ckpt, "phone.jpg", Image.fromarray(photo(21, 30)), exif=exif)
    assert "phone.jpg: turned upright by its EXIF orientation (6)" in capsys.readouterr().err
    assert out.size == (42, 60)
    upright = ImageOps.exif_transpose(Image.open(tmp_path / "phone.jpg"))
    expected = upscaled(tmp_path, ckpt, "upright.png", upright, out="expected.png")
    assert np.array_equal(np.asarray(out), np.asarray(expected))


def test_upscale_keeps_transparency(tmp_path, ckpt, capsys):
    from hpdl.sr.inference import upscale_alpha

    rgba = np.dstack([photo(24, 30), np.full((24, 30), 255, np.uint8)])
    rgba[:, :12, 3] = 0  # a transparent left part, black under it
    rgba[:, :12, :3] = 0
    out = upscaled(tmp_path, ckpt, "logo.png", Image.fromarray(rgba))
    assert out.mode == "RGBA" and out.size == (60, 48)
    alpha = np.asarray(out.getchannel("A"))
    assert np.array_equal(alpha, upscale_alpha(rgba[:, :, 3], 2, tile=None))
    assert (alpha[:, :20] == 0).all() and (alpha[:, 28:] == 255).all()
    opaque = upscaled(tmp_path, ckpt, "opaque.png", Image.fromarray(rgba[:, :, :3]), out="opaque_out.png")
    assert np.array_equal(np.asarray(out.convert("RGB")), np.asarray(opaque))
    # A palette with a transparent colour, as GIFs and small PNGs have it
    palette = Image.fromarray(rgba).convert("RGB").quantize(16)
    key = int(np.asarray(palette)[0, 0])
    assert upscaled(tmp_path, ckpt, "pal.png", palette, out="pal_out.png", transparency=key).mode == "RGBA"
    # A format without alpha is refused before any work rather than writing a picture that lost it;
    # an alpha channel that is opaque everywhere holds nothing to lose.
    assert main(["sr", "upscale", str(tmp_path / "logo.png"), str(tmp_path / "logo.jpg"), "--ckpt", str(ckpt)]) == 2
    assert error_line(capsys) == (f"hpdl: error: {tmp_path / 'logo.jpg'}: Pillow's JPEG writer cannot keep the "
                                  f"transparency of {tmp_path / 'logo.png'}; write .png, .webp or .tif")
    assert not (tmp_path / "logo.jpg").exists()
    assert upscaled(tmp_path, ckpt, "full.png", Image.fromarray(rgba[:, 12:]).convert("RGBA"),
                    out="full.jpg").mode == "RGB"


def test_upscale_keeps_gray_images_gray_and_the_colour_profile(tmp_path, ckpt):
    from PIL import ImageCms

    gray = Image.fromarray(photo(21, 30)).convert("L")
    out = upscaled(tmp_path, ckpt, "gray.png", gray)
    as_rgb = upscaled(tmp_path, ckpt, "rgb.png", gray.convert("RGB"), out="rgb_out.png")
    assert out.mode == "L" and np.array_equal(np.asarray(out), np.asarray(as_rgb.convert("L")))
    wide = Image.fromarray(np.asarray(gray).astype(np.uint16) * 257)  # 16-bit gray
    assert upscaled(tmp_path, ckpt, "wide.png", wide, out="wide_out.png").mode == "L"
    profile = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    out = upscaled(tmp_path, ckpt, "tagged.png", Image.fromarray(photo(21, 30)), out="tagged.jpg",
                   icc_profile=profile)
    assert out.info.get("icc_profile") == profile


def _cmyk_photo(h, w):
    return Image.fromarray(photo(h, w)).convert("CMYK")


def test_a_cmyk_picture_is_read_through_its_colour_profile(tmp_path):
    from PIL import ImageCms

    from hpdl.sr.images import read_picture
    from icc_profiles import cmyk_profile, print_like_corners

    profile = cmyk_profile(print_like_corners())
    image = _cmyk_photo(20, 24)
    image.save(tmp_path / "press.jpg", icc_profile=profile, quality=100)
    stored = Image.open(tmp_path / "press.jpg")
    expected = np.asarray(ImageCms.profileToProfile(stored, ImageCms.ImageCmsProfile(_bytes_io(profile)),
                                                    ImageCms.createProfile("sRGB"), outputMode="RGB"))
    picture = read_picture(tmp_path / "press.jpg")
    assert np.array_equal(picture.rgb, expected)
    assert np.abs(picture.rgb.astype(int) - np.asarray(stored.convert("RGB"), dtype=int)).max() > 40
    assert picture.icc_profile is None and "through its colour profile; the output is sRGB" in picture.colour_note

    image.save(tmp_path / "plain.jpg", quality=100)  # no profile: the plain formula, said so
    plain = read_picture(tmp_path / "plain.jpg")
    assert np.array_equal(plain.rgb, np.asarray(Image.open(tmp_path / "plain.jpg").convert("RGB")))
    assert "without a colour profile" in plain.colour_note

    broken = b"\0" * 16 + b"CMYK" + b"\0" * 200  # says CMYK, holds nothing: not the image's fault
    image.save(tmp_path / "broken.jpg", icc_profile=broken, quality=100)
    fallback = read_picture(tmp_path / "broken.jpg")
    assert np.array_equal(fallback.rgb, plain.rgb) and "cannot be used" in fallback.colour_note


def _bytes_io(data):
    import io

    return io.BytesIO(data)


def test_upscale_says_how_it_read_a_cmyk_picture(tmp_path, ckpt, capsys):
    from icc_profiles import cmyk_profile, print_like_corners

    out = upscaled(tmp_path, ckpt, "press.jpg", _cmyk_photo(20, 24), icc_profile=cmyk_profile(print_like_corners()))
    assert out.mode == "RGB" and out.size == (48, 40) and out.info.get("icc_profile") is None
    assert (f"hpdl: note: {tmp_path / 'press.jpg'}: CMYK converted to sRGB through its colour profile"
            in capsys.readouterr().err)


def test_upscale_says_that_it_upscales_the_first_frame_of_an_animation(tmp_path, ckpt, capsys):
    frames = [Image.fromarray(photo(20, 24, seed)) for seed in range(3)]
    frames[0].save(tmp_path / "anim.gif", save_all=True, append_images=frames[1:])
    assert main(["sr", "upscale", str(tmp_path / "anim.gif"), str(tmp_path / "o.png"), "--ckpt", str(ckpt)]) == 0
    assert f"hpdl: note: {tmp_path / 'anim.gif'}: holds 3 frames; only the first is upscaled" in capsys.readouterr().err


def test_upscale_writes_lossy_formats_at_the_quality_sr_tools_use(tmp_path, ckpt):
    """JPEG at quality 95 and WebP lossless (OpenCV's imwrite defaults), not Pillow's 75 and 80."""
    from PIL import features

    png = np.asarray(upscaled(tmp_path, ckpt, "in.png", Image.fromarray(photo(40, 48))))
    jpeg = upscaled(tmp_path, ckpt, "in.png", Image.fromarray(photo(40, 48)), out="out.jpg")
    Image.fromarray(png).save(tmp_path / "q95.jpg", quality=95)
    assert jpeg.quantization == Image.open(tmp_path / "q95.jpg").quantization
    if features.check("webp"):
        webp = np.asarray(upscaled(tmp_path, ckpt, "in.png", Image.fromarray(photo(40, 48)), out="out.webp"))
        assert np.array_equal(webp, png)


@pytest.mark.parametrize("tile", [1, 5, 8])
def test_alpha_upscaled_in_tiles_equals_the_whole_image(tile):
    from hpdl.sr.inference import upscale_alpha

    alpha = photo(13, 17)[:, :, 0]
    assert np.array_equal(upscale_alpha(alpha, 3, tile=tile), upscale_alpha(alpha, 3, tile=None))


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
    expected = {"a directory": f"{target}: is a directory; name a file",
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
                                  f"({tmp_path / 'file'} is a file, not a directory); give a writable cache directory "
                                  "(cache_dir= / --cache-dir)")


def test_eval_refuses_a_range_for_a_set_whose_images_are_not_numbered(tmp_path, folder, ckpt, capsys):
    # Ignored, --range would score every image of the folder under a mean taken for a few.
    assert main(["sr", "eval", "--ckpt", str(ckpt), "--data", str(folder), "--range", "1-1",
                 "--cache-dir", str(tmp_path / "c")]) == 2
    assert error_line(capsys) == (f"hpdl: error: --range: {folder} is not DIV2K (its layout is folder); only "
                                  "DIV2K's images are numbered: leave --range out to score the whole set")
    div2k = tmp_path / "DIV2K"
    for i in (801, 802):
        hr = photo(40, 44, i)
        (div2k / "DIV2K_valid_HR").mkdir(parents=True, exist_ok=True)
        (div2k / "DIV2K_valid_LR_bicubic" / "X2").mkdir(parents=True, exist_ok=True)
        Image.fromarray(hr).save(div2k / "DIV2K_valid_HR" / f"0{i}.png")
        Image.fromarray(bicubic_downscale(hr, 2)).save(div2k / "DIV2K_valid_LR_bicubic" / "X2" / f"0{i}x2.png")
    assert main(["sr", "eval", "--ckpt", str(ckpt), "--data", str(div2k), "--range", "802-802", "--json",
                 "--cache-dir", str(tmp_path / "c")]) == 0
    assert [image["name"] for image in json.loads(capsys.readouterr().out)["sets"][0]["images"]] == ["0802"]


def test_a_skipped_image_is_reported_in_one_line(tmp_path, folder, ckpt, capsys):
    (folder / "torn.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    assert main(["sr", "eval", "--ckpt", str(ckpt), "--data", str(folder), "--on-bad-image", "skip",
                 "--cache-dir", str(tmp_path / "c")]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "torn.png" in line or "warn" in line.lower()]
    assert err == [f"hpdl: warning: skipping {folder / 'torn.png'}: cannot decode image (corrupt or truncated?): "
                   f"cannot identify image file '{folder / 'torn.png'}'"]
