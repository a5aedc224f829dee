"""Checkpoints: atomic save, weights_only load, and one-line errors."""

import os
import pickle
import random

import numpy as np
import pytest
import torch

from hpdl.sr.checkpoint import (
    capture_rng_state,
    load_checkpoint,
    load_model,
    make_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from hpdl.sr.errors import CheckpointError
from hpdl.sr.models import EDSRConfig, build_model, build_model_from_config


def tiny(scale=2, feats=8):
    torch.manual_seed(0)
    return build_model_from_config(EDSRConfig("tiny", scale, 1, feats, 1.0))


def test_round_trip_with_trainer_state(tmp_path):
    model = tiny()
    opt = torch.optim.Adam(model.parameters())
    model(torch.rand(1, 3, 8, 8)).mean().backward()
    opt.step()
    extra = {"optimizer": opt.state_dict(), "sampler": {"epoch": 3, "position": 96},
             "rng": capture_rng_state(), "config": {"lr": 1e-4, "betas": (0.9, 0.999)}, "step": 12}
    path = save_checkpoint(tmp_path / "run" / "last.pt", make_checkpoint(model, **extra))
    assert os.listdir(tmp_path / "run") == ["last.pt"]  # no temp file left
    ckpt = load_checkpoint(path, model_name="tiny", scale=2)
    assert ckpt["meta"]["model_name"] == "tiny" and ckpt["meta"]["scale"] == 2
    assert ckpt["sampler"] == {"epoch": 3, "position": 96} and ckpt["step"] == 12
    opt2 = torch.optim.Adam(tiny().parameters())
    opt2.load_state_dict(ckpt["optimizer"])
    loaded, _ = load_model(path)
    for a, b in zip(loaded.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    assert not loaded.training


def test_rng_state_round_trip(tmp_path):
    save_checkpoint(tmp_path / "c.pt", make_checkpoint(tiny(), rng=capture_rng_state()))
    expected = (random.random(), np.random.rand(), torch.rand(2))
    restore_rng_state(load_checkpoint(tmp_path / "c.pt")["rng"])
    got = (random.random(), np.random.rand(), torch.rand(2))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_truncated_and_corrupt_files(tmp_path):
    path = save_checkpoint(tmp_path / "c.pt", make_checkpoint(tiny()))
    data = path.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cut\.pt: not a readable checkpoint \(truncated or corrupt\?\)") as err:
        load_checkpoint(tmp_path / "cut.pt")
    assert "\n" not in str(err.value)
    (tmp_path / "junk.pt").write_bytes(b"hello")
    with pytest.raises(CheckpointError, match=r"junk\.pt: not a readable checkpoint"):
        load_checkpoint(tmp_path / "junk.pt")
    with pytest.raises(CheckpointError, match=r"nope\.pt: no such checkpoint file"):
        load_checkpoint(tmp_path / "nope.pt")


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_pickled_code_is_refused(tmp_path):
    torch.save({"x": _Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match=r"evil\.pt: refused: holds Python objects \(\S*system\)"):
        load_checkpoint(tmp_path / "evil.pt")
    with open(tmp_path / "raw.pt", "wb") as f:
        pickle.dump({"x": 1}, f, protocol=2)
    with pytest.raises(CheckpointError, match=r"raw\.pt: not a readable checkpoint"):
        load_checkpoint(tmp_path / "raw.pt")


def test_model_and_scale_mismatch(tmp_path):
    path = save_checkpoint(tmp_path / "x2.pt", make_checkpoint(build_model("edsr_baseline", 2)))
    with pytest.raises(CheckpointError, match=r"x2\.pt: checkpoint is for edsr_baseline x2, not edsr_baseline x4"):
        load_checkpoint(path, scale=4)
    with pytest.raises(CheckpointError, match=r"checkpoint is for edsr_baseline x2, not edsr x2"):
        load_model(path, model_name="edsr")
    assert load_checkpoint(path, model_name="EDSR-baseline", scale=2)["meta"]["scale"] == 2
    # metadata says tiny, weights are from another width
    ckpt = make_checkpoint(tiny())
    ckpt["model"] = tiny(feats=4).state_dict()
    save_checkpoint(tmp_path / "bad.pt", ckpt)
    with pytest.raises(CheckpointError, match=r"bad\.pt: weights do not fit tiny x2"):
        load_model(tmp_path / "bad.pt")


def test_plain_state_dict_is_recognised(tmp_path):
    # EDSR-PyTorch publishes bare state dicts
    torch.save(build_model("edsr_baseline", 3).state_dict(), tmp_path / "edsr_baseline_x3.pt")
    model, ckpt = load_model(tmp_path / "edsr_baseline_x3.pt")
    assert (model.config.name, model.scale) == ("edsr_baseline", 3)
    torch.save({"w": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match=r"other\.pt: state dict is not an EDSR model"):
        load_model(tmp_path / "other.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match=r"list\.pt: not a checkpoint"):
        load_model(tmp_path / "list.pt")


def test_save_refuses_what_weights_only_cannot_load(tmp_path):
    with pytest.raises(TypeError, match=r"checkpoint\['rng'\]\['state'\] is a numpy.ndarray"):
        save_checkpoint(tmp_path / "c.pt", {"rng": {"state": np.zeros(3)}})
    assert not (tmp_path / "c.pt").exists()
    with pytest.raises(ValueError, match="reserved checkpoint keys: meta, model"):
        make_checkpoint(tiny(), model={}, meta={})
