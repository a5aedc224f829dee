"""Checkpoints: atomic save, weights_only load, and one-line errors."""

import os
import pickle
import random
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from hpdl.atomic_file import remove_stale_temp_files
from hpdl.sr.checkpoint import (
    capture_rng_state,
    load_checkpoint,
    load_model,
    make_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from hpdl.sr.errors import CheckpointError
from hpdl.sr.models import build_model, build_model_from_config
from hpdl.sr.registry import ModelConfig


def tiny(scale=2, feats=8):
    torch.manual_seed(0)
    return build_model_from_config(ModelConfig("tiny", scale, 1, feats, 1.0))


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


_WRITER = """
import sys, time, torch
from hpdl.sr.checkpoint import make_checkpoint, save_checkpoint
from hpdl.sr.models import build_model_from_config
from hpdl.sr.registry import ModelConfig

def hangs_halfway(obj, f):
    f.write(b"PK half a zip file")
    f.flush()
    print("writing", flush=True)
    time.sleep(600)

torch.save = hangs_halfway
save_checkpoint(sys.argv[1], make_checkpoint(build_model_from_config(ModelConfig("tiny", 2, 1, 8, 1.0))))
"""


def _temp_files(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_temp_file_of_a_killed_write_is_removed_by_the_next_save_but_not_while_its_writer_lives(tmp_path):
    path = save_checkpoint(tmp_path / "last.pt", make_checkpoint(tiny(), update=1))
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "writing\n"
        left = _temp_files(tmp_path)
        assert len(left) == 1 and left[0].startswith(".last.pt.")
        save_checkpoint(path, make_checkpoint(tiny(), update=2))  # the writer is alive: its file stays
        assert _temp_files(tmp_path) == left
    finally:
        writer.kill()  # killed mid-write: nothing can remove its temp file but the next writer
        writer.wait()
    assert _temp_files(tmp_path) == left
    save_checkpoint(path, make_checkpoint(tiny(), update=3))
    assert _temp_files(tmp_path) == [] and load_checkpoint(path)["update"] == 3


def test_only_temp_files_of_our_naming_and_this_host_are_removed(tmp_path):
    finished = subprocess.Popen(["true"])
    finished.wait()  # a pid no longer in use
    keep = [f".last.pt.{finished.pid}@another-host.0123abcd.tmp",  # its writer may live on that host
            f".last.pt.{finished.pid}.0123abcd.tmp",  # earlier naming, without host: kept until an hour old
            "notes.tmp", f"last.pt.{finished.pid}@{socket.gethostname()}.0123abcd.tmp"]
    stale = [f".last.pt.{finished.pid}@{socket.gethostname()}.0123abcd.tmp",
             f".other.npy.{finished.pid}@{socket.gethostname()}.89abcdef.tmp"]
    for name in keep + stale:
        (tmp_path / name).write_bytes(b"x")
    assert remove_stale_temp_files(tmp_path) == 2
    assert _temp_files(tmp_path) == sorted(keep)


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
    with pytest.raises(CheckpointError, match=r"cut\.pt: not a readable checkpoint: the zip archive is truncated or damaged$") as err:
        load_checkpoint(tmp_path / "cut.pt")
    assert "\n" not in str(err.value)
    (tmp_path / "junk.pt").write_bytes(b"hello")
    with pytest.raises(CheckpointError, match=r"junk\.pt: not a checkpoint \(neither a zip nor a pickle file\)"):
        load_checkpoint(tmp_path / "junk.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty\.pt: empty file, not a checkpoint"):
        load_checkpoint(tmp_path / "empty.pt")
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
    with pytest.raises(CheckpointError, match=r"raw\.pt: not a checkpoint hpdl can read \(a pickle, but not in torch"):
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
    with pytest.raises(CheckpointError, match=r"other\.pt: state dict is not a model hpdl knows"):
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
