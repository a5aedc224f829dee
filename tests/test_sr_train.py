"""The trainer's configuration, schedule, EMA, logs and checkpoints, and one tiny run in one process."""

import csv
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from hpdl.cli import main
from hpdl.sr.checkpoint import load_checkpoint, load_model, make_checkpoint, save_checkpoint
from hpdl.sr.config import ConfigError, TrainConfig, config_names, load_config
from hpdl.sr.models import build_model_from_config
from hpdl.sr.registry import ModelConfig
from hpdl.sr.train_state import EMA, MetricsLog, lr_at

PAPER = [f"{m}_x{s}" for m in ("edsr_baseline", "edsr") for s in (2, 3, 4)]


# -- configuration ------------------------------------------------------------------------------


def test_packaged_configs_follow_the_paper():
    assert set(PAPER + ["demo"]) <= set(config_names())
    for name in PAPER:
        cfg = load_config(name)
        model, scale = name.rsplit("_x", 1)
        assert (cfg.model, cfg.scale) == (model, int(scale))
        assert (cfg.patch_size, cfg.global_batch_size, cfg.lr, cfg.betas, cfg.eps) == (48, 16, 1e-4, (0.9, 0.999), 1e-8)
        assert (cfg.lr_decay_steps, cfg.gamma, cfg.total_updates) == (200_000, 0.5, 300_000)
        assert cfg.augment and not cfg.scale_lr_with_world
        # x3 and x4 start from the x2 run's weights.
        assert (cfg.pretrained == f"runs/{model}_x2/model.pt") == (cfg.scale != 2)
    demo = load_config("demo")
    assert (demo.model, demo.scale, demo.data) == ("edsr_baseline", 2, "embedded")


def test_overrides_are_converted_to_the_fields_types():
    cfg = load_config("demo", ["lr=2e-4", "betas=0.8,0.99", "augment=no", "total_updates=3e3", "resume=auto",
                               "pretrained=null", "val_range=801-805"])
    assert (cfg.lr, cfg.betas, cfg.augment, cfg.total_updates) == (2e-4, (0.8, 0.99), False, 3000)
    assert (cfg.resume, cfg.pretrained, cfg.val_range) == ("auto", None, "801-805")
    assert load_config("demo", {"lr": 1}).lr == 1.0
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg  # the form stored in checkpoints round-trips


def test_unknown_key_in_a_file_names_the_key_and_the_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("model: edsr_baseline\nlearning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"mine\.yaml: unknown key 'learning_rate'"):
        load_config(str(path))
    with pytest.raises(ConfigError, match=r"command line: unknown key 'bach_size' \(did you mean 'batch_size'\?\)"):
        load_config("demo", ["bach_size=3"])


@pytest.mark.parametrize("override,key", [
    ("batch_size=0", "batch_size"), ("lr=fast", "lr"), ("lr=-1", "lr"), ("scale=5", "scale"),
    ("betas=0.9", "betas"), ("augment=maybe", "augment"), ("compression=int8", "compression"),
    ("model=vgg", "model"), ("ema_decay=1", "ema_decay"), ("val_range=900-801", "val_range"),
    ("total_updates=1.5", "total_updates"), ("patch_size=", "patch_size"), ("device=cpu:abc", "device"),
    ("device=meta", "device"), ("overwrite=true resume=auto", "overwrite"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"^command line: {key}: "):
        load_config("demo", override.split())


def test_bad_yaml_files(tmp_path):
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "broken.yaml").write_text("lr: [1,\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(str(tmp_path / "list.yaml"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(tmp_path / "broken.yaml"))


@pytest.mark.parametrize("argv,message", [
    (["--config", "demo", "lrr=1"], "hpdl: error: command line: unknown key 'lrr' (did you mean 'lr'?)"),
    (["--config", "demo", "workers=-1"], "hpdl: error: command line: workers: must be >= 0, got -1"),
    (["--config", "demo", "oops"], "hpdl: error: override 'oops': expected key=value"),
    (["--config", "no_such_config"], "hpdl: error: no_such_config: no such config file or packaged config"),
])
def test_cli_config_errors_are_one_line(capsys, argv, message):
    assert main(["sr", "train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err


# -- schedule, EMA, logs, checkpoints ---------------------------------------------------------


def test_lr_schedule_warms_up_linearly_then_decays_in_steps():
    lrs = [lr_at(u, 1.0, warmup=4, decay_steps=6, gamma=0.5) for u in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4:6] == [1.0, 1.0] and lrs[6:12] == [0.5] * 6 and lrs[12:] == [0.25, 0.25]
    assert lr_at(10**6, 1e-4, 0, 0, 0.5) == 1e-4  # decay_steps=0: constant


def test_ema_moves_towards_the_weights():
    model = torch.nn.Linear(2, 1)
    ema = EMA(torch.nn.Linear(2, 1), decay=0.75)
    ema.model.load_state_dict(model.state_dict())
    before = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(4.0)
    ema.update(model)
    assert torch.allclose(ema.model.weight, before + 1.0)  # 0.75 * w + 0.25 * (w + 4)
    assert not any(p.requires_grad for p in ema.model.parameters())


def test_metrics_log_drops_rows_after_the_resumed_checkpoint(tmp_path):
    log = MetricsLog(tmp_path, None, note=lambda _: None)
    for u in (10, 20, 30):
        log.write("train", update=u, epoch=0, loss=1.0 / u, lr=0.1, img_per_s=2.0, elapsed_s=u)
    log.write("val", update=20, psnr=30.5, bicubic_psnr=29.0, ssim=0.9, bicubic_ssim=0.8, images=3, seconds=1.0)
    log.close()
    log = MetricsLog(tmp_path, 20, note=lambda _: None)  # resumed from the checkpoint of update 20
    log.write("train", update=30, epoch=0, loss=0.5, lr=0.1, img_per_s=2.0, elapsed_s=31)
    log.close()
    with open(tmp_path / "train_log.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["update"], r["loss"]) for r in rows] == [("10", "0.1"), ("20", "0.05"), ("30", "0.5")]
    assert (tmp_path / "val_log.csv").read_text().count("\n") == 2


def test_a_crash_while_writing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = build_model_from_config(ModelConfig("edsr_custom", 2, 1, 8, 1.0))
    path = save_checkpoint(tmp_path / "last.pt", make_checkpoint(model, update=1))

    def dies_halfway(obj, f):
        f.write(b"PK\x03\x04 half a zip file")
        raise KeyboardInterrupt  # e.g. the job is killed mid-write

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, make_checkpoint(model, update=2))
    monkeypatch.undo()
    assert load_checkpoint(path)["update"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temporary file left behind


# -- one tiny run, in a process of its own (hvd.init() stays out of the test process) -------------


def photo(h, w, seed):
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (h // 6 + 2, w // 6 + 2, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC))


def tiny_data(root):
    for split, sizes in (("train", [(40, 36), (34, 44)]), ("val", [(32, 30), (30, 34)])):
        (root / split).mkdir()
        for i, (h, w) in enumerate(sizes):
            Image.fromarray(photo(h, w, i + 7 * len(split))).save(root / split / f"{i}.png")
    return root


def tiny_run(data, out, *extra):
    """Run a tiny training through the command line, in a process of its own."""
    argv = ["sr", "train", "--config", "demo", f"data={data / 'train'}", f"val_data={data / 'val'}",
            f"cache_dir={data / 'cache'}", f"out_dir={out}", "n_resblocks=1", "n_feats=8", "patch_size=8",
            "batch_size=2", "repeat=3", "workers=1", "log_every=2", "warmup_updates=0", "progress=false", *extra]
    return subprocess.run([sys.executable, "-m", "hpdl", *argv], capture_output=True, text=True, timeout=120)


def test_tiny_training_run_writes_checkpoints_logs_and_a_summary(tmp_path):
    out = tmp_path / "run"
    proc = tiny_run(tiny_data(tmp_path), out, "total_updates=6", "ckpt_every=3", "ema_decay=0.5", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)  # notes and progress went to stderr
    assert summary["updates"] == 6 and summary["world_size"] == 1 and summary["val_images"] == 2
    assert summary["bicubic_psnr"] > 20 and summary["img_per_s"] > 0
    assert json.loads((out / "summary.json").read_text()) == summary

    with open(out / "train_log.csv", newline="") as f:
        assert [r["update"] for r in csv.DictReader(f)] == ["2", "4", "6"]
    ckpt = load_checkpoint(out / "last.pt", model_name="edsr_custom", scale=2)
    assert ckpt["update"] == 6 and ckpt["config"]["total_updates"] == 6 and ckpt["ema"] is not None
    assert ckpt["sampler"]["epoch"] == 2  # 6 patches per epoch, 3 updates of 2
    model, _ = load_model(out / "model.pt")  # the EMA weights, ready for `hpdl sr eval`
    for key, value in model.state_dict().items():
        assert torch.equal(value, ckpt["ema"][key])
    assert (out / "config.yaml").is_file()


def test_an_earlier_run_is_kept_unless_continued_or_overwritten(tmp_path):
    data, out = tiny_data(tmp_path), tmp_path / "run"
    assert tiny_run(data, out, "total_updates=2", "val_at_end=false").returncode == 0
    (out / "tb" / "old-events").parent.mkdir(exist_ok=True)
    (out / "tb" / "old-events").write_text("curves of the earlier run")
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    again = tiny_run(data, out, "total_updates=4", "val_at_end=false")
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"hpdl: error: out_dir={out} holds an earlier run (last.pt, model.pt, train_log.csv, val_log.csv, "
        "summary.json, config.yaml, curves.png); continue it with resume=auto or start over with overwrite=true"]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files

    resumed = tiny_run(data, out, "total_updates=4", "val_at_end=false", "resume=auto", "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["updates_this_run"] == 2
    with open(out / "train_log.csv", newline="") as f:
        assert [r["update"] for r in csv.DictReader(f)] == ["2", "4"]  # the earlier run's row kept

    over = tiny_run(data, out, "total_updates=2", "val_at_end=false", "overwrite=true", "--json")
    assert over.returncode == 0, over.stderr
    assert json.loads(over.stdout)["updates_this_run"] == 2 and load_checkpoint(out / "last.pt")["update"] == 2
    with open(out / "train_log.csv", newline="") as f:
        assert [r["update"] for r in csv.DictReader(f)] == ["2"]
    assert not (out / "tb" / "old-events").exists()
