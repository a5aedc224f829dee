"""Dataset layouts as EDSR-PyTorch and BasicSR ship them, refused mixtures, and several sets in one evaluation."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from hpdl.cli import main
from hpdl.sr.checkpoint import load_model, make_checkpoint, save_checkpoint
from hpdl.sr.datasets import detect_layout, open_pairs, split_sets
from hpdl.sr.errors import SRDataError
from hpdl.sr.imresize import matlab_downscale
from hpdl.sr.metrics import quantize
from hpdl.sr.models import build_model_from_config
from hpdl.sr.registry import ModelConfig
from hpdl.sr.inference import upscale


def photo(h, w, seed=0):
    """A smooth random image (so bicubic scores are realistic, not noise)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (h // 8 + 2, w // 8 + 2, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC))


def save(path, array):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


IMAGES = {"baby": (48, 36), "bird": (36, 60)}


def basicsr_set(root, scales=(2, 4), extra_original=True):
    """A set as BasicSR ships it: GTmod12/ (HR), LRbicx<s>/ with the same file names, original/."""
    for i, (name, (h, w)) in enumerate(IMAGES.items()):
        hr = photo(h, w, i)
        save(root / "GTmod12" / f"{name}.png", hr)
        for s in scales:
            save(root / f"LRbicx{s}" / f"{name}.png", matlab_downscale(hr, s))
        if extra_original:
            save(root / "original" / f"{name}.png", photo(h + 3, w + 5, i))
    return root


def edsr_set(root, scales=(2, 4)):
    """The same images as EDSR-PyTorch ships them: HR/ and LR_bicubic/X<s>/<name>x<s>.png."""
    for i, (name, (h, w)) in enumerate(IMAGES.items()):
        hr = photo(h, w, i)
        save(root / "HR" / f"{name}.png", hr)
        for s in scales:
            save(root / "LR_bicubic" / f"X{s}" / f"{name}x{s}.png", matlab_downscale(hr, s))
    return root


def pair_set(root, hr_name, lr_name, scales=(2,), by_scale=False):
    """A set as an HR folder beside an LR folder (one scale, or X<s>/ sub-folders with <name>x<s>.png)."""
    for i, (name, (h, w)) in enumerate(IMAGES.items()):
        hr = photo(h, w, i)
        save(root / hr_name / f"{name}.png", hr)
        for s in scales:
            lr_file = root / lr_name / f"X{s}" / f"{name}x{s}.png" if by_scale else root / lr_name / f"{name}.png"
            save(lr_file, matlab_downscale(hr, s))
    return root


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(0)
    return save_checkpoint(tmp_path / "tiny_x2.pt", make_checkpoint(build_model_from_config(ModelConfig("tiny", 2, 1, 8, 1.0))))


@pytest.mark.parametrize("scale", [2, 4])
def test_basicsr_layout_pairs_hr_with_lr_by_name(tmp_path, scale):
    root = basicsr_set(tmp_path / "Set5")
    assert detect_layout(root) == "basicsr"
    pairs = open_pairs(root, scale, cache_dir=tmp_path / "cache")
    assert pairs.layout == "basicsr" and pairs.names == ["baby", "bird"]
    for i, (name, (h, w)) in enumerate(IMAGES.items()):
        lr, hr = pairs.arrays(i)
        assert np.array_equal(hr, photo(h, w, i))
        assert np.array_equal(lr, np.asarray(Image.open(root / f"LRbicx{scale}" / f"{name}.png")))


def test_both_benchmark_layouts_give_the_same_scores(tmp_path, ckpt):
    model, _ = load_model(ckpt)
    from hpdl.sr.evaluation import evaluate

    a = evaluate(model, open_pairs(basicsr_set(tmp_path / "a" / "Set5"), 2, cache_dir=tmp_path / "c"), 2)
    b = evaluate(model, open_pairs(edsr_set(tmp_path / "b" / "Set5"), 2, cache_dir=tmp_path / "c"), 2)
    assert a.means()["psnr"] == pytest.approx(b.means()["psnr"]) and a.means()["ssim"] == pytest.approx(b.means()["ssim"])


def _assert_refused_in_one_line(tmp_path, make, fragments):
    """The folder ``make`` builds is refused in one line that names it and every fragment."""
    root = tmp_path / "data"
    root.mkdir()
    make(root)
    with pytest.raises(SRDataError) as err:
        open_pairs(root, 2, cache_dir=tmp_path / "cache")
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(root))
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize("make,fragments", [
    (lambda r: (basicsr_set(r), edsr_set(r)), ["ambiguous layout", "GTmod12/", "HR/", "LR_bicubic/", "LRbicx2/",
                                                "basicsr and benchmark"]),
    (lambda r: (edsr_set(r), save(r / "DIV2K_train_HR" / "0001.png", photo(24, 24))), ["ambiguous", "DIV2K_train_HR/"]),
    (lambda r: save(r / "LRbicx2" / "baby.png", photo(24, 24)), ["found LRbicx2/", "no GTmod12/"]),
    (lambda r: save(r / "LR_bicubic" / "X2" / "babyx2.png", photo(24, 24)), ["found LR_bicubic/", "needs both HR/"]),
    (lambda r: save(r / "HR" / "baby.png", photo(24, 24)), ["found HR/", "give the HR folder itself"]),
    (lambda r: edsr_set(r / "Set5"), ["LR_bicubic/", "would take the LR images"]),
    (lambda r: basicsr_set(r / "Set14"), ["LRbicx2/", "would take the LR images"]),
], ids=["basicsr and edsr", "div2k and edsr", "LRbicx alone", "LR_bicubic alone", "HR alone", "benchmark root",
        "basicsr root"])
def test_a_mixed_partial_or_parent_folder_is_refused_saying_what_was_found(tmp_path, make, fragments):
    _assert_refused_in_one_line(tmp_path, make, fragments)


@pytest.mark.parametrize("hr_name,lr_name,by_scale", [
    ("hr", "lr", False), ("GT", "LQ", False), ("GT", "LR", False), ("HR", "LR", False), ("gt", "lq", True),
    ("HR", "LR", True),
])
def test_an_hr_folder_beside_an_lr_folder_is_paired_by_name_in_any_case(tmp_path, hr_name, lr_name, by_scale):
    root = pair_set(tmp_path / "Set5", hr_name, lr_name, scales=(2, 4) if by_scale else (2,), by_scale=by_scale)
    assert detect_layout(root) == "hr_lr"
    for scale in (2, 4) if by_scale else (2,):
        pairs = open_pairs(root, scale, cache_dir=tmp_path / "cache")
        assert pairs.layout == "hr_lr" and pairs.names == ["baby", "bird"]  # two pairs, no LR image read as HR
        for i, (name, (h, w)) in enumerate(IMAGES.items()):
            lr, hr = pairs.arrays(i)
            assert np.array_equal(hr, photo(h, w, i)) and np.array_equal(lr, matlab_downscale(photo(h, w, i), scale))


def test_an_lr_folder_of_another_scale_is_refused_by_the_image_sizes(tmp_path):
    root = pair_set(tmp_path / "Set5", "GT", "LQ", scales=(4,))
    with pytest.raises(SRDataError, match=r"LQ/baby\.png: LR is 9x12 but HR .* so x2 needs LR 18x24"):
        open_pairs(root, 2, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("make,layout", [
    (lambda r: basicsr_set(r, extra_original=False), "basicsr"),
    (edsr_set, "benchmark"),
])
def test_layout_folders_are_recognised_in_any_case(tmp_path, make, layout):
    root = make(tmp_path / "upper")
    lower = tmp_path / "lower"
    for image in root.rglob("*.png"):
        relative = image.relative_to(root)
        save(lower / relative.parent.as_posix().lower() / relative.name, np.asarray(Image.open(image)))
    assert detect_layout(lower) == layout
    a, b = open_pairs(root, 4, cache_dir=tmp_path / "c"), open_pairs(lower, 4, cache_dir=tmp_path / "c")
    assert a.names == b.names and all(np.array_equal(a.arrays(i)[0], b.arrays(i)[0]) for i in range(len(a)))


@pytest.mark.parametrize("make,fragments", [
    (lambda r: save(r / "lr" / "baby.png", photo(24, 24)), ["found lr/", "no HR folder beside it (HR/ or GT/)"]),
    (lambda r: save(r / "GT" / "baby.png", photo(24, 24)), ["found GT/", "no LR folder beside it"]),
    (lambda r: (pair_set(r, "GT", "LQ"), save(r / "HR" / "baby.png", photo(48, 36))),
     ["found GT/, HR/, LQ/", "two HR folders (GT/ and HR/)"]),
    (lambda r: (pair_set(r, "HR", "LR"), save(r / "LQ" / "baby.png", photo(24, 18))), ["two LR folders (LQ/ and LR/)"]),
    (lambda r: pair_set(r, "GT", "LR_bicubic"), ["ambiguous layout", "GT/, LR_bicubic/", "benchmark and hr_lr"]),
    (lambda r: pair_set(r / "Set5", "hr", "lr"), ["would take the LR images in lr/"]),
    (lambda r: pair_set(r, "high", "low"),
     ["high/baby.png (36x48) and low/baby.png (18x24) look like an HR image and its x2 LR image", "HR/ and LR/"]),
    (lambda r: (save(r / "a" / "baby.png", photo(24, 24)), save(r / "b" / "babyx2.png", photo(12, 12))),
     ["a/baby.png (24x24) and b/babyx2.png (12x12) look like an HR image and its x2 LR image"]),
], ids=["lr alone", "GT alone", "two HR folders", "two LR folders", "GT with LR_bicubic", "parent of hr/lr sets",
        "same names in two plain folders", "babyx2 beside baby"])
def test_an_hr_lr_folder_that_is_incomplete_doubled_or_plain_is_refused(tmp_path, make, fragments):
    _assert_refused_in_one_line(tmp_path, make, fragments)


@pytest.mark.parametrize("images", [
    {"2023/IMG_0001.png": (96, 96), "2024/IMG_0001.png": (96, 96), "2024/IMG_0002.png": (96, 96)},
    {"cat/001.png": (40, 60), "dog/001.png": (33, 45), "dog/002.png": (40, 60)},
    # box2 is not bo's x2 LR image unless its size is: here it is a quarter of it
    {"a/bo.png": (96, 96), "b/box2.png": (24, 24), "b/box25.png": (48, 48), "c/bo.png": (90, 90)},
], ids=["date folders", "class folders", "names ending in x and digits"])
def test_photos_whose_sub_folders_reuse_names_are_a_plain_folder(tmp_path, images):
    root = tmp_path / "photos"
    for i, (name, (h, w)) in enumerate(images.items()):
        save(root / name, photo(h, w, i))
    assert detect_layout(root) == "folder"
    pairs = open_pairs(root, 2, cache_dir=tmp_path / "cache")
    assert pairs.names == sorted(name[: -len(".png")] for name in images)


@pytest.mark.parametrize("images,fragment", [
    ({"2023/baby.png": (36, 48), "misc/baby.png": (12, 16)},
     "2023/baby.png (48x36) and misc/baby.png (16x12) look like an HR image and its x3 LR image"),
    ({"shoot/day1/img.png": (50, 50), "other/img.png": (25, 25), "other/img2.png": (50, 50)},
     "shoot/day1/img.png (50x50) and other/img.png (25x25) look like an HR image and its x2 LR image"),
    ({"sets/baby.png": (96, 96), "small/babyX4.png": (24, 24)},
     "sets/baby.png (96x96) and small/babyX4.png (24x24) look like an HR image and its x4 LR image"),
    ({"baby.png": (48, 48), "babyx2.png": (24, 24)},
     "baby.png (48x48) and babyx2.png (24x24) look like an HR image and its x2 LR image"),
], ids=["same name at x3", "deeper folder, HR not a multiple", "x4 suffix", "one folder"])
def test_an_hr_lr_pair_hidden_in_a_plain_folder_is_refused(tmp_path, images, fragment):
    root = tmp_path / "photos"
    for i, (name, (h, w)) in enumerate(images.items()):
        save(root / name, photo(h, w, i))
    with pytest.raises(SRDataError) as err:
        detect_layout(root)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{root}: not a dataset layout") and fragment in message


def test_an_lr_image_without_its_hr_image_is_named(tmp_path):
    root = basicsr_set(tmp_path / "Set5")
    save(root / "LRbicx2" / "zebra.png", photo(12, 12))
    with pytest.raises(SRDataError, match=r"LRbicx2/zebra\.png: LR image without an HR image of the same name"):
        open_pairs(root, 2, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("make", [edsr_set, basicsr_set], ids=["benchmark", "basicsr"])
def test_an_hr_image_in_another_format_than_its_lr_image_is_paired(tmp_path, make):
    root = make(tmp_path / "Set14")
    hr_dir = root / ("HR" if make is edsr_set else "GTmod12")
    baby = np.asarray(Image.open(hr_dir / "baby.png"))
    (hr_dir / "baby.png").unlink()
    save(hr_dir / "baby.bmp", baby)  # as Set14's originals are: baboon.bmp beside baboonx2.png
    pairs = open_pairs(root, 2, cache_dir=tmp_path / "cache")
    assert pairs.names == ["baby", "bird"]
    lr, hr = pairs.arrays(0)
    assert np.array_equal(hr, baby) and np.array_equal(lr, matlab_downscale(baby, 2))


def test_two_lr_images_that_could_be_one_hr_images_are_named(tmp_path):
    root = edsr_set(tmp_path / "Set5", scales=(2,))
    baby = np.asarray(Image.open(root / "HR" / "baby.png"))
    (root / "HR" / "baby.png").unlink()
    save(root / "HR" / "baby.bmp", baby)
    save(root / "LR_bicubic" / "X2" / "babyx2.tif", matlab_downscale(baby, 2))
    with pytest.raises(SRDataError, match=r"HR/baby\.bmp: its LR image could be any of .*babyx2\.png, .*babyx2\.tif"):
        open_pairs(root, 2, cache_dir=tmp_path / "cache")


def test_split_sets_as_edsr_pytorch_spells_them(tmp_path):
    for name in ("Set5", "Set14"):
        edsr_set(tmp_path / "benchmark" / name)
    edsr_set(tmp_path / "B100")
    assert split_sets("Set5+Set14+B100", tmp_path) == [
        ("Set5", str(tmp_path / "benchmark" / "Set5")), ("Set14", str(tmp_path / "benchmark" / "Set14")),
        ("B100", str(tmp_path / "B100"))]
    assert split_sets(str(tmp_path / "B100")) == [("B100", str(tmp_path / "B100"))]
    assert split_sets("embedded") == [("embedded", "embedded")]
    with pytest.raises(SRDataError, match="two sets named Set5"):
        split_sets(f"Set5+{tmp_path / 'benchmark' / 'Set5'}", tmp_path)
    with pytest.raises(SRDataError, match="empty set name"):
        split_sets("Set5++Set14", tmp_path)


def test_eval_of_several_sets_prints_one_table_and_saves_results(tmp_path, ckpt, capsys):
    basicsr_set(tmp_path / "data" / "Set5")
    edsr_set(tmp_path / "data" / "benchmark" / "Set14")
    args = ["sr", "eval", "--ckpt", str(ckpt), "--data", "Set5+Set14", "--data-root", str(tmp_path / "data"),
            "--cache-dir", str(tmp_path / "cache")]
    assert main(args + ["--save-results", str(tmp_path / "results")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "tiny x2 (1 blocks, 8 features), x2"
    assert lines[1].split() == ["set", "images", "PSNR", "SSIM", "bicubic", "SSIM", "space"]
    rows = {line.split()[0]: line.split() for line in lines[3:]}
    assert set(rows) == {"Set5", "Set14"} and rows["Set5"][1] == "2" and rows["Set5"][6:] == ["Y,", "shave", "2"]

    assert main(args + ["--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    sets = {s["name"]: s for s in record["sets"]}
    assert sets["Set5"]["layout"] == "basicsr" and sets["Set14"]["layout"] == "benchmark"
    assert float(rows["Set14"][2]) == pytest.approx(sets["Set14"]["mean"]["psnr"], abs=0.006)
    assert float(rows["Set14"][4]) == pytest.approx(sets["Set14"]["mean"]["bicubic_psnr"], abs=0.006)

    # EDSR-PyTorch's naming of results, the model's output quantised
    saved = sorted(p.relative_to(tmp_path / "results").as_posix() for p in (tmp_path / "results").rglob("*.png"))
    assert saved == ["Set14/baby_x2_SR.png", "Set14/bird_x2_SR.png", "Set5/baby_x2_SR.png", "Set5/bird_x2_SR.png"]
    model, _ = load_model(ckpt)
    lr = torch.from_numpy(np.asarray(Image.open(tmp_path / "data" / "Set5" / "LRbicx2" / "bird.png")).copy())
    expected = quantize(upscale(model, lr.permute(2, 0, 1).float())).byte().permute(1, 2, 0).numpy()
    assert np.array_equal(np.asarray(Image.open(tmp_path / "results" / "Set5" / "bird_x2_SR.png")), expected)


def test_folder_eval_makes_lr_with_matlab_imresize_unless_told_otherwise(tmp_path, ckpt, capsys):
    save(tmp_path / "photos" / "a.png", photo(40, 44))
    base = ["sr", "eval", "--ckpt", str(ckpt), "--data", str(tmp_path / "photos"), "--json",
            "--cache-dir", str(tmp_path / "cache")]
    assert main(base) == 0
    matlab = json.loads(capsys.readouterr().out)
    assert main(base + ["--downscaler", "torch"]) == 0
    torch_made = json.loads(capsys.readouterr().out)
    assert (matlab["downscaler"], torch_made["downscaler"]) == ("matlab", "torch")
    m, t = matlab["sets"][0]["mean"], torch_made["sets"][0]["mean"]
    assert m["bicubic_psnr"] != t["bicubic_psnr"]
    pairs = open_pairs(tmp_path / "photos", 2, cache_dir=tmp_path / "cache")
    assert np.array_equal(pairs.arrays(0)[0], matlab_downscale(photo(40, 44), 2))


@pytest.mark.parametrize("make", ["folder", "benchmark"])
def test_images_of_one_name_and_two_extensions_keep_apart_their_scores_and_results(tmp_path, ckpt, capsys, make):
    # x.png and x.jpg are two photos: one name for both would mix their rows and let the second
    # SR image replace the first (or stop the run half-way as "already exists").
    data = tmp_path / "data"
    for i, suffix in enumerate((".png", ".jpg")):
        hr = photo(40, 44, i)
        if make == "folder":
            save(data / f"x{suffix}", hr)
        else:
            save(data / "HR" / f"x{suffix}", hr)
            save(data / "LR_bicubic" / "X2" / f"xx2{suffix}", matlab_downscale(hr, 2))
    assert main(["sr", "eval", "--ckpt", str(ckpt), "--data", str(data), "--json", "--cache-dir",
                 str(tmp_path / "cache"), "--save-results", str(tmp_path / "results")]) == 0
    record = json.loads(capsys.readouterr().out)
    assert [image["name"] for image in record["sets"][0]["images"]] == ["x.jpg", "x.png"]
    saved = sorted(p.name for p in (tmp_path / "results" / "data").iterdir())
    assert saved == ["x.jpg_x2_SR.png", "x.png_x2_SR.png"]
