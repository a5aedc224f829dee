"""Pictures of a run: sample grids (LR / bicubic / SR / HR), curves.png, TensorBoard images, eval --grid."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from hpdl.cli import main
from hpdl.sr.checkpoint import load_model, make_checkpoint, save_checkpoint
from hpdl.sr.datasets import open_pairs
from hpdl.sr.figures import (COLUMNS, GAP, LABEL_HEIGHT, cell_origin, column_labels, grid_size, label_width,
                              sample_crops, sample_grid)
from hpdl.sr.metrics import bicubic_upscale, quantize
from hpdl.sr.models import build_model_from_config
from hpdl.sr.registry import ModelConfig
from test_sr_train import photo, tiny_data, tiny_run


def as_uint8(x):
    return quantize(x).byte().permute(1, 2, 0).numpy()


@pytest.fixture
def setup(tmp_path):
    for i, (h, w) in enumerate([(64, 50), (40, 70)]):
        Image.fromarray(photo(h, w, i)).save(tmp_path / f"img{i}.png")
    torch.manual_seed(0)
    model = build_model_from_config(ModelConfig("tiny", 2, 2, 8, 1.0)).eval()
    pairs = open_pairs(tmp_path, 2, cache_dir=tmp_path / "cache")
    return model, pairs


def test_sample_crops_are_crops_of_the_whole_image_pass(setup):
    model, pairs = setup
    samples = sample_crops(model, pairs, [0, 1], crop=24)
    for i, sample in enumerate(samples):
        lr, hr = pairs[i]
        with torch.no_grad():
            sr = as_uint8(model(lr[None])[0])
        bicubic = as_uint8(bicubic_upscale(lr, 2))
        (lh, lw) = lr.shape[-2:]
        y, x = (lh - 12) // 2 * 2, (lw - 12) // 2 * 2  # the centre LR crop of 12 px, in HR pixels
        assert sample.sr.shape == sample.hr.shape == sample.lr.shape == sample.bicubic.shape == (24, 24, 3)
        assert np.array_equal(sample.sr, sr[y : y + 24, x : x + 24])
        assert np.array_equal(sample.bicubic, bicubic[y : y + 24, x : x + 24])
        assert np.array_equal(sample.hr, as_uint8(hr)[y : y + 24, x : x + 24])
        assert np.array_equal(sample.lr[::2, ::2], as_uint8(lr)[y // 2 : y // 2 + 12, x // 2 : x // 2 + 12])


def test_grid_lays_out_lr_bicubic_sr_hr_per_row_with_labels(setup):
    model, pairs = setup
    samples = sample_crops(model, pairs, [0, 1], crop=30)
    grid = sample_grid(samples)
    assert grid.shape == (*grid_size(2, (30, 30)), 3) == (LABEL_HEIGHT + 2 * (LABEL_HEIGHT + 30 + 4), 4 * 30 + 5 * 4, 3)
    for row, sample in enumerate(samples):
        for column, picture in enumerate((sample.lr, sample.bicubic, sample.sr, sample.hr)):
            y, x = cell_origin(row, column, (30, 30))
            assert np.array_equal(grid[y : y + 30, x : x + 30], picture), (row, COLUMNS[column])
    assert (grid[:LABEL_HEIGHT] < 128).any()  # the column titles are drawn
    assert (grid[: LABEL_HEIGHT, :4] == 255).all()  # on white


@pytest.mark.parametrize("crop,expected", [(40, ["LR", "bicubic", "SR", "HR"]), (24, ["LR", "bic.", "SR", "HR"]),
                                           (8, ["L", "b", "S", "H"])])
def test_column_titles_never_run_into_each_other_on_small_crops(setup, crop, expected):
    model, pairs = setup
    grid = sample_grid(sample_crops(model, pairs, [0], crop))
    labels = column_labels(crop)
    assert all(label_width(label) <= crop for label in labels)  # each title within its cell
    for gap in range(len(COLUMNS) + 1):  # so nothing is drawn in the gaps of the title strip
        x = gap * (crop + GAP)
        assert (grid[:LABEL_HEIGHT, x : x + GAP] == 255).all(), (crop, gap)
    assert labels == expected  # shortened first, cut only where even the short titles do not fit
    assert column_labels(96) == list(COLUMNS)


def test_eval_grid_writes_the_chosen_images(tmp_path, setup, capsys):
    model, pairs = setup
    ckpt = save_checkpoint(tmp_path / "m.pt", make_checkpoint(model))
    out = tmp_path / "grid.png"
    assert main(["sr", "eval", "--ckpt", str(ckpt), "--data", str(tmp_path), "--cache-dir", str(tmp_path / "cache"),
                 "--grid", str(out), "--grid-images", "img1", "--grid-crop", "32"]) == 0
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size[::-1] == grid_size(1, (32, 32))
        grid = np.asarray(image.convert("RGB"))
    y, x = cell_origin(0, 2, (32, 32))
    assert np.array_equal(grid[y : y + 32, x : x + 32], sample_crops(load_model(ckpt)[0], pairs, [1], 32)[0].sr)
    assert main(["sr", "eval", "--ckpt", str(ckpt), "--data", str(tmp_path), "--cache-dir", str(tmp_path / "cache"),
                 "--grid", str(out)]) == 2  # refuses to replace it
    assert "already exists" in capsys.readouterr().err


def test_training_draws_curves_and_puts_validation_crops_in_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    proc = tiny_run(tiny_data(tmp_path), out, "total_updates=4", "val_every=2", "--json")
    assert proc.returncode == 0, proc.stderr
    with Image.open(out / "curves.png") as curves:
        curves.verify()
        assert curves.format == "PNG" and curves.size == (1040, 288)  # 13 x 3.6 inches at 80 dpi
    events = EventAccumulator(str(out / "tb"), size_guidance={"images": 0})
    events.Reload()
    assert "val/samples" in events.Tags()["images"]
    shots = events.Images("val/samples")
    assert [s.step for s in shots] == [2, 4]
    # the 2 validation photos (32x30, 30x34 HR) are smaller than the crop: whole, in cells of the largest
    assert (shots[0].height, shots[0].width) == grid_size(2, (32, 34))
    assert json.loads(proc.stdout)["updates"] == 4


def test_curves_are_drawn_from_the_rows_of_a_torn_log_that_read(tmp_path):
    # Two runs once wrote one log at once: rows of other lengths, NUL bytes, text in a number's place.
    from hpdl.sr.figures import _read_log, plot_curves

    (tmp_path / "train_log.csv").write_bytes(
        b"update,epoch,loss,lr,img_per_s,elapsed_s\n1,0,0.5,0.0001,10.0,0.1\n2,0,0.4,0.0001,10.0,0.2,3,0\n"
        b"\0\0\0\0,0.3\n4,0,oops,0.0001,10.0,0.4\n5,0,0.2,0.0001,,0.5\n\xff\xfe,1\n")
    notes = []
    columns = _read_log(tmp_path / "train_log.csv", notes.append)
    assert columns["update"] == [1.0, 5.0] and columns["loss"] == [0.5, 0.2] and np.isnan(columns["img_per_s"][1])
    assert notes == [f"{tmp_path / 'train_log.csv'}: skipped 3 malformed row(s) drawing the curves"]
    with Image.open(plot_curves(tmp_path)) as curves:  # val_log.csv missing: an empty panel
        assert curves.format == "PNG"
