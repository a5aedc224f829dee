"""The trainer on 2 ranks: exact resume (mpiexec), and errors every rank agrees on (torchrun)."""

import csv
import json

import numpy as np
import pytest
import torch
from PIL import Image

from hpdl.sr.checkpoint import make_checkpoint, save_checkpoint
from hpdl.sr.models import build_model_from_config
from hpdl.sr.registry import ModelConfig
from ranks import run_ranks

pytestmark = pytest.mark.multirank


def photo(h, w, seed):
    """A smooth random picture, so that super-resolution has something to learn."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (h // 6 + 2, w // 6 + 2, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sr_data")
    for split, sizes in (("train", [(40, 36), (34, 44)]), ("val", [(32, 30)])):
        (root / split).mkdir()
        for i, (h, w) in enumerate(sizes):
            Image.fromarray(photo(h, w, 10 * len(split) + i)).save(root / split / f"{split}{i}.png")
    corrupt = root / "corrupt"
    corrupt.mkdir()
    for i, (h, w) in enumerate([(40, 36), (34, 44)]):
        Image.fromarray(photo(h, w, i)).save(corrupt / f"good{i}.png")
    (corrupt / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    return root


def rows(path):
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f)]


def test_resume_continues_exactly_as_an_uninterrupted_run(tmp_path, data):
    # One launch trains N updates straight through, then N/2 updates in another directory; a
    # second launch (new processes, nothing kept in memory) resumes the latter to N.
    run_ranks("sr_train.py", 2, args=["uninterrupted-and-half", str(tmp_path), str(data)], timeout=150)
    run_ranks("sr_train.py", 2, args=["resume", str(tmp_path), str(data)], timeout=150)

    full, resumed = rows(tmp_path / "full" / "train_log.csv"), rows(tmp_path / "resumed" / "train_log.csv")
    assert [int(r["update"]) for r in full] == list(range(1, 11))
    # The loss of every update, the ones after the resume included, is the same to the last bit.
    assert [(r["update"], r["loss"], r["lr"], r["epoch"]) for r in resumed] == \
           [(r["update"], r["loss"], r["lr"], r["epoch"]) for r in full]
    assert len({r["epoch"] for r in full}) > 2  # the run crossed epochs, and resumed mid-epoch (5 of 4/epoch)
    scores = [{k: v for k, v in r.items() if k != "seconds"} for r in rows(tmp_path / "full" / "val_log.csv")]
    assert [int(r["update"]) for r in scores] == [4, 8, 10]
    assert [{k: v for k, v in r.items() if k != "seconds"} for r in rows(tmp_path / "resumed" / "val_log.csv")] == scores
    a = torch.load(tmp_path / "full" / "last.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "last.pt", weights_only=True)
    for part in ("model", "ema"):
        for key in a[part]:
            assert torch.equal(a[part][key], b[part][key]), (part, key)
    assert a["sampler"] == b["sampler"] and a["update"] == b["update"] == 10
    assert len(a["rng"]) == 2  # every rank's RNG states


def test_errors_are_one_line_on_rank_0_and_silent_elsewhere(tmp_path, data):
    ckpt = make_checkpoint(build_model_from_config(ModelConfig("edsr_custom", 3, 1, 8, 1.0)))
    save_checkpoint(tmp_path / "x3.pt", ckpt)
    whole = (tmp_path / "x3.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(whole[: len(whole) // 2])

    # Under torchrun (gloo), while the resume test runs under mpiexec: the trainer is launcher-blind.
    run_ranks("sr_train.py", 2, "torchrun", args=["errors", str(tmp_path), str(data)], timeout=150)
    rank0 = json.loads((tmp_path / "errors.0.json").read_text())
    rank1 = json.loads((tmp_path / "errors.1.json").read_text())
    expected = {
        "unknown_key": "unknown key 'learning_rate'",
        "bad_value": "batch_size: expected an integer, got 'two'",
        "missing_config": "nope.yaml: no such config file",
        "missing_data": "absent: no such directory",
        "truncated_ckpt": "truncated.pt: not a readable checkpoint: the zip archive is truncated or damaged",
        "other_scale_ckpt": "checkpoint is for edsr_custom x3, not edsr_custom x2",
        "corrupt_image": "broken.png: cannot decode image",
    }
    for case, words in expected.items():
        lines = rank0[case]["stderr"].strip().splitlines()
        assert rank0[case]["code"] == 2 and len(lines) == 1, (case, rank0[case])
        assert lines[0].startswith("hpdl: error: ") and words in lines[0], (case, lines)
        assert rank1[case]["code"] == 2 and rank1[case]["stderr"] == "", (case, rank1[case])
    skipped = rank0["corrupt_image_skipped"]
    assert skipped["code"] == 0 and "broken.png" in skipped["stderr"], skipped
    assert "broken.png" not in rank1["corrupt_image_skipped"]["stderr"], rank1["corrupt_image_skipped"]  # rank 0 warns


def test_overlap_forward_trains_the_same_model(tmp_path, data):
    # Updates deferred to the next forward (and applied by validation and checkpoints) give the
    # weights, validation scores and losses of the ordinary step.
    run_ranks("sr_train.py", 2, args=["overlap", str(tmp_path), str(data)], timeout=200)
    plain = torch.load(tmp_path / "plain" / "model.pt", weights_only=True)["model"]
    overlap = torch.load(tmp_path / "overlap" / "model.pt", weights_only=True)["model"]
    assert plain.keys() == overlap.keys()
    for key in plain:
        torch.testing.assert_close(overlap[key], plain[key], rtol=1e-5, atol=1e-6, msg=key)
    for log in ("train_log.csv", "val_log.csv"):
        a, b = rows(tmp_path / "plain" / log), rows(tmp_path / "overlap" / log)
        assert len(a) == len(b) > 0
        for ra, rb in zip(a, b):
            for column in ("loss", "psnr"):
                if column in ra:
                    assert abs(float(ra[column]) - float(rb[column])) < 1e-4, (log, ra, rb)
