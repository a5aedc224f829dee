"""Images, decode cache, dataset layouts, training patches, and every bad-input error."""

import os
import re
import time
import warnings

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from hpdl.sr.datasets import (
    TrainPatches,
    build_train_dataset,
    build_val_dataset,
    detect_layout,
    open_pairs,
    parse_range,
)
from hpdl.sr.errors import CorruptImageError, SRDataError
from hpdl.sr.images import (
    EMBEDDED_TRAIN,
    EMBEDDED_VAL,
    ImageCache,
    bicubic_downscale,
    prepare_embedded,
    read_image,
)
from hpdl.sr.transforms import dihedral_array


def rand_image(h, w, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def save(path, array, mode=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array, mode).save(path) if mode else Image.fromarray(array).save(path)
    return path


def blocky_pair(h, w, scale, seed=0):
    """An LR image and an HR image made of scale x scale blocks of it: exactly aligned."""
    lr = rand_image(h, w, seed)
    return lr, np.repeat(np.repeat(lr, scale, 0), scale, 1)


# ---------------------------------------------------------------- decoding and cache


def test_read_image_modes(tmp_path):
    rgb = rand_image(5, 6)
    assert np.array_equal(read_image(save(tmp_path / "rgb.png", rgb)), rgb)
    gray = rgb[:, :, 0]
    out = read_image(save(tmp_path / "gray.png", gray))
    assert out.shape == (5, 6, 3) and all(np.array_equal(out[:, :, c], gray) for c in range(3))
    rgba = np.concatenate([rgb, np.full((5, 6, 1), 7, np.uint8)], axis=2)
    assert np.array_equal(read_image(save(tmp_path / "rgba.png", rgba)), rgb)
    Image.fromarray(rgb).convert("P").save(tmp_path / "pal.png")
    assert read_image(tmp_path / "pal.png").shape == (5, 6, 3)
    wide = (gray.astype(np.uint16) * 257)
    Image.fromarray(wide).save(tmp_path / "g16.png")
    assert np.array_equal(read_image(tmp_path / "g16.png")[:, :, 1], gray)


@pytest.mark.parametrize("top", [1.0, 255.0, 65535.0])
def test_float_images_are_read_in_the_range_their_values_show(tmp_path, top):
    # [0, 1] is how float images are stored; 8-bit and 16-bit levels stored as floats are read as such.
    gray = rand_image(5, 6)[:, :, 0]
    values = gray.astype(np.float32) * np.float32(top / 255.0)
    Image.fromarray(values, "F").save(tmp_path / "f.tif")
    with Image.open(tmp_path / "f.tif") as img:
        assert img.mode == "F"
    out = read_image(tmp_path / "f.tif")
    assert out.shape == (5, 6, 3) and all(np.array_equal(out[:, :, c], gray) for c in range(3))


@pytest.mark.parametrize("top", [255, 65535, 2 ** 31 - 1])
def test_32_bit_integer_images_are_read_in_the_range_their_values_show(tmp_path, top):
    # Mode I holds 8-, 16- or 32-bit levels: each is scaled by its own range, not all as 16-bit.
    gray = rand_image(5, 6)[:, :, 0].astype(np.int64)
    gray[0, 0] = 255  # the image reaches the top of its range
    scale = {255: 1.0, 65535: 257.0, 2 ** 31 - 1: (2.0 ** 31 - 1) / 255}[top]
    values = np.round(gray * scale).astype(np.int32)
    Image.fromarray(values, "I").save(tmp_path / "i.tif")
    with Image.open(tmp_path / "i.tif") as img:
        assert img.mode == "I"
    out = read_image(tmp_path / "i.tif")[:, :, 0]
    assert np.array_equal(out, gray)


def test_float_images_outside_every_range_are_refused_naming_the_file(tmp_path):
    below = np.array([[-0.5, 0.25], [0.5, 1.0]], np.float32)  # negative values clip to black
    Image.fromarray(below, "F").save(tmp_path / "below.tif")
    assert read_image(tmp_path / "below.tif")[:, :, 0].tolist() == [[0, 64], [128, 255]]
    for name, bad, message in (("nan.tif", np.nan, "float image holds NaN or infinite values"),
                               ("huge.tif", 1e6, "float image with values up to 1e+06, past 65535")):
        Image.fromarray(np.array([[0.5, bad]], np.float32), "F").save(tmp_path / name)
        with pytest.raises(SRDataError, match=rf"^{tmp_path / name}: {re.escape(message)}"):
            read_image(tmp_path / name)


def test_corrupt_and_truncated_images_name_the_file(tmp_path):
    (tmp_path / "junk.png").write_bytes(b"not a png at all")
    with pytest.raises(CorruptImageError, match=r"junk\.png: cannot decode image"):
        read_image(tmp_path / "junk.png")
    good = save(tmp_path / "good.png", rand_image(64, 64)).read_bytes()
    (tmp_path / "cut.png").write_bytes(good[: len(good) // 2])
    with pytest.raises(CorruptImageError, match=r"cut\.png: cannot decode image"):
        read_image(tmp_path / "cut.png")
    with pytest.raises(SRDataError, match=r"missing\.png: no such file"):
        read_image(tmp_path / "missing.png")


def test_cache_memory_maps_and_rebuilds_when_the_source_changes(tmp_path):
    cache = ImageCache(tmp_path / "cache")
    src = save(tmp_path / "a.png", rand_image(8, 8, seed=1))
    first = cache.image(src)
    assert isinstance(first, np.memmap) and not first.flags.writeable
    assert np.array_equal(cache.image(src), rand_image(8, 8, seed=1))
    entries = list((tmp_path / "cache").glob("*.npy"))
    assert len(entries) == 1
    assert not list((tmp_path / "cache").glob(".*tmp"))  # no temp file left behind

    os.utime(src, ns=(time.time_ns(), time.time_ns() + 10**9))  # same size, new mtime
    save(src, rand_image(8, 8, seed=2))
    os.utime(src, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    assert np.array_equal(cache.image(src), rand_image(8, 8, seed=2))
    # the stale entry is replaced, not kept beside the new one
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 1


def test_cache_rebuilds_a_damaged_entry(tmp_path):
    cache = ImageCache(tmp_path / "cache")
    src = save(tmp_path / "a.png", rand_image(8, 8))
    cache.image(src)
    (entry,) = (tmp_path / "cache").glob("*.npy")
    entry.write_bytes(b"garbage")
    assert np.array_equal(cache.image(src), rand_image(8, 8))


def test_pixel_limit_refuses_before_decoding_and_on_cache_hits(tmp_path, monkeypatch):
    Image.new("1", (9000, 9000)).save(tmp_path / "big.png")
    decoded = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self, _load=ImageFile.ImageFile.load:
                        decoded.append(self.size) or _load(self))
    with pytest.raises(SRDataError, match=r"big\.png: image of 9000x9000 \(81,000,000 pixels\) exceeds the limit "
                                          r"of 1,000,000 pixels; raise it with --max-pixels"):
        read_image(tmp_path / "big.png", max_pixels=1_000_000)
    assert decoded == []  # refused from the header alone
    small = save(tmp_path / "folder" / "small.png", rand_image(4, 5))
    assert read_image(small, max_pixels=20).shape == (4, 5, 3)
    assert (5, 4) in decoded  # the spy sees decoding
    with pytest.raises(SRDataError, match="small.png: image of 5x4"):
        read_image(small, max_pixels=19)
    # An entry decoded earlier without a limit is refused too.
    ImageCache(tmp_path / "cache").image(small)
    with pytest.raises(SRDataError, match="small.png: image of 5x4"):
        ImageCache(tmp_path / "cache", max_pixels=19).image(small)
    with pytest.raises(SRDataError, match="small.png: image of 5x4"):
        open_pairs(small.parent, 2, cache_dir=tmp_path / "c", max_pixels=19)


def test_pillow_bomb_limit_gives_way_to_ours(tmp_path):
    pillows = Image.MAX_IMAGE_PIXELS
    Image.new("1", (pillows // 9000 + 1, 9000)).save(tmp_path / "big.png")  # just past Pillow's warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_image(tmp_path / "big.png", max_pixels=2 * pillows).shape == (9000, pillows // 9000 + 1, 3)
    assert Image.MAX_IMAGE_PIXELS == pillows  # restored


def test_torch_bicubic_downscale_crops_to_a_multiple_and_matches_torch():
    hr = rand_image(13, 10)
    lr = bicubic_downscale(hr, 3, "torch")
    assert lr.shape == (4, 3, 3) and lr.dtype == np.uint8
    x = torch.from_numpy(hr[:12, :9].copy()).permute(2, 0, 1)[None].float()
    ref = torch.nn.functional.interpolate(x, size=(4, 3), mode="bicubic", antialias=True)
    assert np.array_equal(lr, ref[0].round().clamp(0, 255).byte().permute(1, 2, 0).numpy())
    flat = np.full((12, 12, 3), 77, np.uint8)
    assert (bicubic_downscale(flat, 4, "torch") == 77).all()


# ---------------------------------------------------------------- layouts


def make_div2k(root, indices, scale, drop_lr=()):
    for i in indices:
        lr, hr = blocky_pair(6, 8, scale, seed=i)
        save(root / "DIV2K_train_HR" / f"{i:04d}.png", hr)
        if i not in drop_lr:
            save(root / "DIV2K_train_LR_bicubic" / f"X{scale}" / f"{i:04d}x{scale}.png", lr)


def test_div2k_layout_and_ranges(tmp_path):
    make_div2k(tmp_path / "DIV2K", range(1, 6), 2)
    assert detect_layout(tmp_path / "DIV2K") == "div2k"
    pairs = open_pairs(tmp_path / "DIV2K", 2, "train", index_range=(2, 4), cache_dir=tmp_path / "c")
    assert pairs.names == ["0002", "0003", "0004"] and pairs.layout == "div2k"
    lr, hr = pairs[1]
    assert lr.shape == (3, 6, 8) and hr.shape == (3, 12, 16) and lr.dtype == torch.float32
    expected_lr, expected_hr = blocky_pair(6, 8, 2, seed=3)
    assert torch.equal(lr, torch.from_numpy(expected_lr).permute(2, 0, 1).float())
    assert torch.equal(hr, torch.from_numpy(expected_hr).permute(2, 0, 1).float())
    # default validation range 801-900 does not exist here
    with pytest.raises(SRDataError, match=r"DIV2K_train_HR/0801\.png: missing DIV2K image 801"):
        build_val_dataset(tmp_path / "DIV2K", 2, cache_dir=tmp_path / "c")
    assert parse_range("801-900") == (801, 900)
    with pytest.raises(ValueError, match="index range"):
        parse_range("801")


def test_benchmark_layout(tmp_path):
    root = tmp_path / "Set5"
    for name in ("baby", "bird"):
        lr, hr = blocky_pair(5, 7, 3)
        save(root / "HR" / f"{name}.png", hr[:, :-1] if name == "bird" else hr)  # bird: HR too narrow
        save(root / "LR_bicubic" / "X3" / f"{name}x3.png", lr)
    assert detect_layout(root) == "benchmark"
    with pytest.raises(SRDataError, match=r"birdx3\.png: LR is 7x5 but HR .*bird\.png is 20x15, so x3 needs LR 6x5"):
        open_pairs(root, 3, cache_dir=tmp_path / "c")
    lr, hr = blocky_pair(5, 7, 3)
    hr_big = np.pad(hr, ((0, 2), (0, 1), (0, 0)))  # HR not a multiple of the scale: cropped
    save(root / "HR" / "bird.png", hr_big)
    pairs = open_pairs(root, 3, cache_dir=tmp_path / "c")
    assert pairs.names == ["baby", "bird"]
    assert pairs[1][1].shape == (3, 15, 21)
    with pytest.raises(SRDataError, match=r"LR_bicubic/X2: no LR images for scale 2"):
        open_pairs(root, 2, cache_dir=tmp_path / "c")


def test_hr_without_its_lr(tmp_path):
    make_div2k(tmp_path / "D", range(1, 4), 2, drop_lr={2})
    with pytest.raises(SRDataError, match=r"0002\.png: HR image without its LR image .*X2/0002x2\.png"):
        open_pairs(tmp_path / "D", 2, "train", index_range=(1, 3), cache_dir=tmp_path / "c")
    root = tmp_path / "Set14"
    save(root / "HR" / "lenna.png", rand_image(8, 8))
    (root / "LR_bicubic" / "X2").mkdir(parents=True)
    with pytest.raises(SRDataError, match=r"lenna\.png: HR image without its LR image .*lennax2\.png"):
        open_pairs(root, 2, cache_dir=tmp_path / "c")


def test_folder_layout_makes_lr_by_bicubic_and_caches_it(tmp_path):
    hr = rand_image(21, 17)
    save(tmp_path / "imgs" / "sub" / "a.png", hr)
    save(tmp_path / "imgs" / "b.jpg", rand_image(16, 16))
    (tmp_path / "imgs" / "notes.txt").write_text("not an image")
    pairs = open_pairs(tmp_path / "imgs", 4, cache_dir=tmp_path / "c")
    assert pairs.layout == "folder" and pairs.names == ["b", "sub/a"]
    lr, hr_t = pairs.arrays(1)
    assert np.array_equal(lr, bicubic_downscale(hr, 4)) and np.array_equal(hr_t, hr[:20, :16])
    assert len(list((tmp_path / "c" / "decoded").glob("a.bicubic-matlab-x4.*.npy"))) == 1


def test_empty_and_missing_folders(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SRDataError, match=r"empty: no images found"):
        open_pairs(tmp_path / "empty", 2, cache_dir=tmp_path / "c")
    with pytest.raises(SRDataError, match=r"nowhere: no such directory"):
        open_pairs(tmp_path / "nowhere", 2, cache_dir=tmp_path / "c")
    save(tmp_path / "f.png", rand_image(4, 4))
    with pytest.raises(SRDataError, match=r"f\.png: not a directory"):
        open_pairs(tmp_path / "f.png", 2, cache_dir=tmp_path / "c")


def test_corrupt_image_fails_or_is_skipped_with_a_warning(tmp_path):
    save(tmp_path / "imgs" / "good.png", rand_image(16, 16))
    good = (tmp_path / "imgs" / "good.png").read_bytes()
    (tmp_path / "imgs" / "torn.png").write_bytes(good[:100])
    with pytest.raises(CorruptImageError, match=r"torn\.png: cannot decode image"):
        open_pairs(tmp_path / "imgs", 2, cache_dir=tmp_path / "c")
    with pytest.warns(RuntimeWarning, match=r"skipping .*torn\.png"):
        pairs = open_pairs(tmp_path / "imgs", 2, cache_dir=tmp_path / "c", on_bad_image="skip")
    assert pairs.names == ["good"]
    (tmp_path / "imgs" / "good.png").write_bytes(b"\x89PNG broken")
    with pytest.warns(RuntimeWarning), pytest.raises(SRDataError, match="no usable images"):
        open_pairs(tmp_path / "imgs", 2, cache_dir=tmp_path / "c", on_bad_image="skip")


def test_an_image_smaller_than_the_scale_is_skipped_with_a_warning(tmp_path):
    save(tmp_path / "imgs" / "good.png", rand_image(16, 16))
    save(tmp_path / "imgs" / "tiny.png", rand_image(1, 1))
    with pytest.warns(RuntimeWarning, match=r"skipping .*tiny\.png: image of 1x1 is smaller than scale 2"):
        pairs = open_pairs(tmp_path / "imgs", 2, cache_dir=tmp_path / "c", on_bad_image="skip")
    assert pairs.names == ["good"]


def test_image_smaller_than_patch(tmp_path):
    save(tmp_path / "imgs" / "big.png", rand_image(40, 40))
    save(tmp_path / "imgs" / "small.png", rand_image(30, 40))
    with pytest.raises(SRDataError, match=r"small\.png: LR image of 20x15 is smaller than the 16x16 training patch"):
        build_train_dataset(tmp_path / "imgs", 2, patch_size=16, cache_dir=tmp_path / "c")
    with pytest.raises(SRDataError, match=r"tiny\.png: image of 1x1 is smaller than scale 2"):
        save(tmp_path / "t" / "tiny.png", rand_image(1, 1))
        open_pairs(tmp_path / "t", 2, cache_dir=tmp_path / "c")


# ---------------------------------------------------------------- training patches


def blocky_benchmark(root, scale, sizes):
    for i, (h, w) in enumerate(sizes):
        lr, hr = blocky_pair(h, w, scale, seed=i)
        save(root / "HR" / f"im{i}.png", hr)
        save(root / "LR_bicubic" / f"X{scale}" / f"im{i}x{scale}.png", lr)
    return root


@pytest.mark.parametrize("scale", [2, 3, 4])
def test_patches_stay_aligned_under_all_8_transforms(tmp_path, scale):
    root = blocky_benchmark(tmp_path / "set", scale, [(20, 13), (11, 25)])
    data = build_train_dataset(root, scale, patch_size=6, repeat=40, seed=3, cache_dir=tmp_path / "c")
    assert len(data) == 80
    seen_origins = set()
    for i in range(len(data)):
        lr, hr = data[i]
        assert lr.shape == (3, 6, 6) and hr.shape == (3, 6 * scale, 6 * scale)
        assert lr.dtype == hr.dtype == torch.float32 and 0 <= lr.min() and lr.max() <= 255
        expand = lr.repeat_interleave(scale, 1).repeat_interleave(scale, 2)
        assert torch.equal(expand, hr)  # every HR block is its LR pixel: aligned
        seen_origins.add(tuple(lr[:, 0, 0].tolist()))
    assert len(seen_origins) > 20  # crops vary


def test_patch_transforms_cover_the_dihedral_group(tmp_path):
    root = blocky_benchmark(tmp_path / "set", 2, [(6, 6)])
    data = build_train_dataset(root, 2, patch_size=6, repeat=64, cache_dir=tmp_path / "c")
    lr_full = data.pairs.arrays(0)[0]
    variants = {tuple(data[i][0].flatten().tolist()) for i in range(64)}
    expected = {tuple(torch.from_numpy(np.ascontiguousarray(dihedral_array(lr_full, k).transpose(2, 0, 1)))
                      .float().flatten().tolist()) for k in range(8)}
    assert variants == expected and len(expected) == 8
    plain = TrainPatches(data.pairs, 6, augment=False)
    assert torch.equal(plain[0][0], torch.from_numpy(np.ascontiguousarray(lr_full.transpose(2, 0, 1))).float())


def test_patches_depend_on_seed_epoch_and_index_only(tmp_path):
    root = blocky_benchmark(tmp_path / "set", 2, [(30, 30)])
    a = build_train_dataset(root, 2, patch_size=8, repeat=4, seed=1, cache_dir=tmp_path / "c")
    b = build_train_dataset(root, 2, patch_size=8, repeat=4, seed=1, cache_dir=tmp_path / "c")
    assert all(torch.equal(a[i][1], b[i][1]) for i in (3, 1, 2))
    b.set_epoch(1)
    assert not all(torch.equal(a[i][1], b[i][1]) for i in range(4))
    # works through DataLoader workers (the dataset is pickled to them)
    loader = torch.utils.data.DataLoader(a, batch_size=2, num_workers=2)
    batches = list(loader)
    assert torch.equal(batches[1][0][1], a[3][0])


def test_embedded_dataset(tmp_path):
    dirs = prepare_embedded(tmp_path)
    assert sorted(p.stem for p in dirs["train"].glob("*.png")) == sorted(EMBEDDED_TRAIN)
    assert sorted(p.stem for p in dirs["val"].glob("*.png")) == sorted(EMBEDDED_VAL)
    stamp = (dirs["val"] / "astronaut.png").stat().st_mtime_ns
    prepare_embedded(tmp_path)  # written once
    assert (dirs["val"] / "astronaut.png").stat().st_mtime_ns == stamp
    val = build_val_dataset("embedded", 3, cache_dir=tmp_path)
    assert val.names == sorted(EMBEDDED_VAL) and val.layout == "embedded"
    lr, hr = val[0]  # astronaut 512x512 -> cropped to 510, LR 170
    assert lr.shape == (3, 170, 170) and hr.shape == (3, 510, 510)
    train = build_train_dataset("embedded", 3, repeat=2, cache_dir=tmp_path)
    assert len(train) == 2 * len(EMBEDDED_TRAIN)
    assert train[5][1].shape == (3, 144, 144)
