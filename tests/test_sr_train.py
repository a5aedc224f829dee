"""The trainer's configuration, schedule, EMA, logs and checkpoints, and one tiny run in one process."""

import csv
import os
import socket
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import hpdl.torch as hvd
from cli_in_process import run_hpdl
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


def test_spatial_is_a_key_of_the_packaged_configs_and_of_files(tmp_path):
    import yaml

    from hpdl.sr.config import CONFIG_DIR

    for name in PAPER:  # the recipes say it: whole patches, on every rank
        assert yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())["spatial"] == 1
    assert load_config("edsr_baseline_x2", ["spatial=2"]).spatial == 2
    assert TrainConfig.from_dict({"spatial": "4"}).spatial == 4
    assert load_config("demo").to_dict()["spatial"] == 1  # so config.yaml holds it
    (tmp_path / "mine.yaml").write_text("model: edsr_baseline\nspatial: 2\n")
    assert load_config(str(tmp_path / "mine.yaml")).spatial == 2
    (tmp_path / "bad.yaml").write_text("spatial: 0\n")
    with pytest.raises(ConfigError, match=r"^.*bad\.yaml: spatial: must be >= 1, got 0$"):
        load_config(str(tmp_path / "bad.yaml"))
    with pytest.raises(ConfigError, match=r"unknown key 'spatail' \(did you mean 'spatial'\?\)"):
        load_config("demo", ["spatail=2"])


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
    ("global_batch_size=16 scale_lr_with_world=true", "scale_lr_with_world"),
    # Past float32's range Adam would fail at its first step, after out_dir is written.
    ("lr=1e39", "lr"), ("lr=1e300", "lr"), ("lr=inf", "lr"), ("lr=nan", "lr"), ("lr=2", "lr"),
    ("eps=inf", "eps"), ("eps=nan", "eps"), ("eps=0", "eps"),
    # NumPy seeds within 32 bits, and rank r seeds with seed + r.
    ("seed=-1", "seed"), ("seed=4294967296", "seed"), ("seed=4294967295", "seed"),
    ("data=", "data"),  # the current directory, else
    ("amp=half", "amp"), ("amp=fp16 overlap_forward=true", "overlap_forward"),
    ("spatial=0", "spatial"), ("spatial=two", "spatial"), ("spatial=1.5", "spatial"),
    ("compile=true spatial=2", "compile"),
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
    (["--config", "demo", "spatial=0"], "hpdl: error: command line: spatial: must be >= 1, got 0"),
])
def test_cli_config_errors_are_one_line(capsys, argv, message):
    assert main(["sr", "train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err


def test_spatial_beyond_the_jobs_ranks_is_one_line_before_out_dir_is_touched(tmp_path, capsys):
    out = tmp_path / "run"
    try:
        assert main(["sr", "train", "--config", "demo", "spatial=2", f"out_dir={out}"]) == 2
    finally:
        hvd.shutdown()  # the command joined a job of one rank in this process before it refused
    assert capsys.readouterr().err.strip().splitlines() == [
        "hpdl: error: spatial=2: the 1 rank of this job does not form groups of 2 (the ranks must be a multiple "
        "of spatial)"]
    assert not out.exists()


def test_the_seed_range_leaves_room_for_every_ranks_offset():
    from hpdl.sr.config import MAX_SEED, MAX_SEED_RANKS

    assert load_config("demo", [f"seed={MAX_SEED}"]).seed + MAX_SEED_RANKS - 1 == 2**32 - 1
    np.random.seed(MAX_SEED + MAX_SEED_RANKS - 1)  # the largest a rank can take: no error


def test_a_config_file_that_is_not_text_is_one_line(tmp_path, capsys):
    Image.new("RGB", (4, 4)).save(tmp_path / "some.png")
    assert main(["sr", "train", "--config", str(tmp_path / "some.png")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"hpdl: error: {tmp_path / 'some.png'}: not a YAML config (not UTF-8 text)"]


def test_summary_json_holds_null_for_numbers_json_cannot_spell(tmp_path):
    from hpdl.sr.train import _write_json

    _write_json(tmp_path / "summary.json", {"psnr": float("inf"), "bicubic_psnr": float("nan"), "updates": 3})
    assert json.loads((tmp_path / "summary.json").read_text(), parse_constant=pytest.fail) == {
        "psnr": None, "bicubic_psnr": None, "updates": 3}


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


def test_a_resume_killed_while_rewriting_the_logs_leaves_them_whole(tmp_path, monkeypatch):
    log = MetricsLog(tmp_path, None, note=lambda _: None)
    for u in (10, 20, 30):
        log.write("train", update=u, epoch=0, loss=1.0 / u, lr=0.1, img_per_s=2.0, elapsed_s=u)
    log.close()
    before = (tmp_path / "train_log.csv").read_bytes()

    class Dying:  # the process dies while the kept rows are written
        def __init__(self, f, *args, **kwargs):
            pass

        def writerow(self, row):
            pass

        def writerows(self, rows):
            raise KeyboardInterrupt

    monkeypatch.setattr(csv, "writer", Dying)
    with pytest.raises(KeyboardInterrupt):
        MetricsLog(tmp_path, 20, note=lambda _: None)
    assert (tmp_path / "train_log.csv").read_bytes() == before


def test_tensorboard_keeps_the_events_of_the_resumed_checkpoints_update(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    log = MetricsLog(tmp_path, None, note=lambda _: None)
    for u in (1, 2, 3):
        log.write("train", update=u, epoch=0, loss=float(u), lr=0.1, img_per_s=2.0, elapsed_s=u)
    log.write("val", update=2, psnr=30.5, bicubic_psnr=29.0, ssim=0.9, bicubic_ssim=0.8, images=3, seconds=1.0)
    log.close()
    log = MetricsLog(tmp_path, 2, note=lambda _: None)  # resumed from the checkpoint of update 2
    log.write("train", update=3, epoch=0, loss=13.0, lr=0.1, img_per_s=2.0, elapsed_s=3)
    log.close()
    events = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    # As in the CSV: update 2 and its validation kept, the interrupted run's update 3 replaced.
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 13.0)]
    assert [(e.step, e.value) for e in events.Scalars("val/psnr")] == [(2, 30.5)]


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


def tiny_run_argv(data, out, *extra):
    """The command line of a tiny training run (after ``hpdl``)."""
    return ["sr", "train", "--config", "demo", f"data={data / 'train'}", f"val_data={data / 'val'}",
            f"cache_dir={data / 'cache'}", f"out_dir={out}", "n_resblocks=1", "n_feats=8", "patch_size=8",
            "batch_size=2", "repeat=3", "workers=1", "log_every=2", "warmup_updates=0", "progress=false", *extra]


def tiny_run(data, out, *extra):
    """Run a tiny training through the command line, in this process (cli_in_process.py)."""
    return run_hpdl(tiny_run_argv(data, out, *extra))


def test_on_bad_image_skip_skips_validation_images_too_small_to_score(tmp_path):
    data = tiny_data(tmp_path)
    Image.fromarray(photo(30, 8, 1)).save(data / "val" / "strip.png")
    proc = tiny_run(data, tmp_path / "run", "total_updates=2", "on_bad_image=skip", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["val_images"] == 2
    warned = [line for line in proc.stderr.splitlines() if line.startswith("hpdl: warning:")]
    assert warned == [f"hpdl: warning: skipping {data / 'val' / 'strip.png'}: image of 8x30 is too small to measure "
                      "at x2 on Y: 2 px shaved from each border must leave the 11x11 SSIM window, so each side needs "
                      "at least 15 px"], proc.stderr


def test_compile_trains_through_torch_compile_and_saves_the_models_own_weights(tmp_path):
    out = tmp_path / "run"
    proc = tiny_run(tiny_data(tmp_path), out, "total_updates=2", "compile=true", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["updates"] == 2
    import torch

    weights = torch.load(out / "model.pt", map_location="cpu", weights_only=False)["model"]
    assert not any(name.startswith("_orig_mod.") for name in weights)  # the model's names, not the wrapper's


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


def test_the_thread_count_follows_one_rule_and_the_start_line_says_where_it_came_from(tmp_path, monkeypatch):
    from hpdl.sr.threads import cpu_set, thread_count

    cores = len(cpu_set())
    assert str(thread_count(3, 1, {"OMP_NUM_THREADS": "1"})) == "3 thread(s) per rank (threads=3)"  # threads= wins
    assert str(thread_count(0, 1, {"OMP_NUM_THREADS": "1"})) == "1 thread(s) per rank (OMP_NUM_THREADS=1)"
    assert thread_count(0, 1, {"OMP_NUM_THREADS": "4,2"}).count == 4  # a nested list's first level
    for unusable in ({}, {"OMP_NUM_THREADS": ""}, {"OMP_NUM_THREADS": "0"}, {"OMP_NUM_THREADS": "many"}):
        assert thread_count(0, 1, unusable).count == cores
    assert str(thread_count(0, 2 * cores, {})) == f"1 thread(s) per rank ({cores} core(s) for {2 * cores} rank(s) on this node)"
    # `hpdl sr train` took its share of the cores whatever OMP_NUM_THREADS said, while upscale followed it.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    proc = tiny_run(tiny_data(tmp_path), tmp_path / "run", "total_updates=1", "val_at_end=false")
    assert proc.returncode == 0, proc.stderr
    started = [line for line in proc.stdout.splitlines() if "thread(s) per rank" in line]
    assert len(started) == 1 and "; 1 thread(s) per rank (OMP_NUM_THREADS=1) on cpu" in started[0], proc.stdout


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


def test_val_every_validates_the_last_update_without_val_at_end_and_a_finished_run_resumes_to_nothing(tmp_path):
    from hpdl.sr.out_dir import LOCK_FILE

    data, out = tiny_data(tmp_path), tmp_path / "run"
    proc = tiny_run(data, out, "total_updates=4", "val_every=2", "val_at_end=false", "--json")
    assert proc.returncode == 0, proc.stderr
    with open(out / "val_log.csv", newline="") as f:
        scores = list(csv.DictReader(f))
    assert [r["update"] for r in scores] == ["2", "4"]  # 4 is a multiple of val_every like 2
    summary = json.loads(proc.stdout)
    assert summary["psnr"] == float(scores[-1]["psnr"]) and summary["val_images"] == 2

    # Resumed at its end: nothing to train, and nothing of the finished run is replaced (its
    # summary's img/s by those of no updates, its validation by a second row for the same weights).
    def run_files():
        return {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != LOCK_FILE}

    files = run_files()
    again = tiny_run(data, out, "total_updates=4", "val_every=2", "val_at_end=false", "resume=auto", "--json")
    assert again.returncode == 0, again.stderr
    assert f"note: the run in out_dir={out} ended at update 4 and total_updates=4: nothing to train" in again.stderr
    assert json.loads(again.stdout) == summary
    assert run_files() == files


def test_a_train_log_row_after_a_resume_averages_the_updates_since_the_previous_row(tmp_path):
    data = tiny_data(tmp_path)
    settings = ("total_updates=4", "ckpt_every=3", "log_every=4", "val_at_end=false", "workers=0")
    assert tiny_run(data, tmp_path / "straight", *settings).returncode == 0
    # Killed right after the checkpoint of update 3, between the rows of updates 0 and 4.
    killed = subprocess.run([sys.executable, "-c", (
        "import os, sys, hpdl.sr.train as t\n"
        "checkpoint = t._Run.checkpoint\n"
        "def and_die(run, step):\n"
        "    checkpoint(run, step)\n"
        "    if run.progress.update == 3: os._exit(9)\n"
        "t._Run.checkpoint = and_die\n"
        "from hpdl.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"), *tiny_run_argv(data, tmp_path / "resumed", *settings)],
        capture_output=True, text=True, timeout=120)
    assert killed.returncode == 9, killed.stderr
    assert tiny_run(data, tmp_path / "resumed", *settings, "resume=auto").returncode == 0

    def rows(run):
        with open(tmp_path / run / "train_log.csv", newline="") as f:
            return [(r["update"], r["epoch"], float(r["loss"]), r["lr"]) for r in csv.DictReader(f)]

    (update, epoch, loss, lr), = rows("straight")  # the mean over updates 1-4, not over 4 alone
    assert rows("resumed") == [(update, epoch, pytest.approx(loss, rel=1e-6), lr)]


def test_a_run_killed_between_its_final_validation_and_its_summary_validates_once_on_resume(tmp_path):
    data, out = tiny_data(tmp_path), tmp_path / "run"
    settings = ("total_updates=2", "val_every=1", "workers=0")
    killed = subprocess.run([sys.executable, "-c", (
        "import os, sys, hpdl.sr.train as t\n"
        "def die(*args, **kwargs): os._exit(9)\n"
        "t._write_json = die  # the summary is never written\n"
        "from hpdl.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"), *tiny_run_argv(data, out, *settings)],
        capture_output=True, text=True, timeout=120)
    assert killed.returncode == 9, killed.stderr
    assert not (out / "summary.json").exists()
    again = tiny_run(data, out, *settings, "resume=auto", "--json")
    assert again.returncode == 0, again.stderr
    with open(out / "val_log.csv", newline="") as f:
        assert [r["update"] for r in csv.DictReader(f)] == ["1", "2"]  # not 1, 2, 2
    assert json.loads(again.stdout)["psnr"] is not None


def test_a_resume_that_changes_settings_keeps_the_ones_before_beside_config_yaml(tmp_path):
    import yaml

    data, out = tiny_data(tmp_path), tmp_path / "run"
    assert tiny_run(data, out, "total_updates=2", "val_at_end=false").returncode == 0
    first = (out / "config.yaml").read_text()
    # Resumed as it was: config.yaml stays as it is, resume=auto is no change.
    (out / "summary.json").unlink()  # an interrupted run, so that it resumes
    same = tiny_run(data, out, "total_updates=2", "val_at_end=false", "resume=auto")
    assert same.returncode == 0, same.stderr
    assert (out / "config.yaml").read_text() == first and not list(out.glob("config.until-update-*"))
    # Extended: config.yaml says so, and the settings of updates 1-2 are kept.
    longer = tiny_run(data, out, "total_updates=4", "val_at_end=false", "resume=auto")
    assert longer.returncode == 0, longer.stderr
    assert "config.until-update-2.yaml those before" in longer.stdout + longer.stderr
    now = yaml.safe_load((out / "config.yaml").read_text())
    assert now["total_updates"] == 4 and now["resume"] is None  # the run's own way of starting
    assert (out / "config.until-update-2.yaml").read_text() == first
    # Starting over removes what the earlier run kept.
    assert tiny_run(data, out, "total_updates=1", "val_at_end=false", "overwrite=true").returncode == 0
    assert not list(out.glob("config.until-update-*"))


# -- one run at a time in an out_dir --------------------------------------------------------------


def test_a_run_in_an_out_dir_another_live_run_holds_is_refused_and_a_killed_one_blocks_nothing(tmp_path):
    from hpdl.sr.out_dir import LOCK_FILE

    data, out = tiny_data(tmp_path), tmp_path / "run"
    assert tiny_run(data, out, "total_updates=2", "val_at_end=false").returncode == 0
    # A live run: a process holding the lock, as rank 0 of a training run does for its whole life.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
         "f.truncate(0); f.write('pid 4242 on node7'); f.flush(); print('locked', flush=True); sys.stdin.read()",
         str(out / LOCK_FILE)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        for extra in (["resume=auto"], ["overwrite=true"]):
            second = tiny_run(data, out, "total_updates=4", "val_at_end=false", *extra)
            assert second.returncode == 2 and second.stderr.strip().splitlines() == [
                f"hpdl: error: out_dir={out} is in use by another training run (pid 4242 on node7); wait for it "
                "to end or choose another out_dir"], second.stderr
            assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
    finally:
        holder.kill()  # dies without releasing anything itself: the kernel drops its lock
        holder.wait()
    resumed = tiny_run(data, out, "total_updates=4", "val_at_end=false", "resume=auto", "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["updates_this_run"] == 2
    assert (out / LOCK_FILE).read_text().startswith("pid ")  # kept: who held it last


def test_the_out_dir_lock_is_taken_again_where_the_out_dir_is_made(tmp_path):
    # Two runs started at once in a missing out_dir both pass the first look; the one that makes
    # it second is refused when it locks it, before it removes or writes anything.
    from hpdl.sr.out_dir import OutDirLock, prepare_out_dir

    out = tmp_path / "missing" / "run"
    cfg = load_config("demo", [f"out_dir={out}", "overwrite=true"])
    with OutDirLock(out) as first, OutDirLock(out) as second:
        assert first.refusal(existing_only=True) is None and not out.exists()
        assert prepare_out_dir(out, cfg, first) is None
        (out / "last.pt").write_bytes(b"the first run's")
        assert prepare_out_dir(out, cfg, second) == (
            f"out_dir={out} is in use by another training run (pid {os.getpid()} on {socket.gethostname()}); "
            "wait for it to end or choose another out_dir")
        assert (out / "last.pt").read_bytes() == b"the first run's"
    with OutDirLock(out) as third:  # the first one's ended
        assert third.refusal(existing_only=True) is None


def test_a_diverging_run_stops_naming_the_update_and_keeps_the_last_good_checkpoint(tmp_path):
    data, out = tiny_data(tmp_path), tmp_path / "run"
    assert tiny_run(data, out, "total_updates=2", "val_at_end=false").returncode == 0
    # Weights so large (finite still) that the next forward overflows: the loss of update 3 is inf.
    ckpt = load_checkpoint(out / "last.pt")
    ckpt["model"] = {k: v * 1e20 if v.is_floating_point() else v for k, v in ckpt["model"].items()}
    save_checkpoint(out / "last.pt", ckpt)
    kept = {p: p.read_bytes() for p in out.iterdir() if p.suffix in (".pt", ".json", ".png")}
    # No checkpoint is due before the end: the end is where non-finite weights would replace the kept ones.
    proc = tiny_run(data, out, "total_updates=6", "ckpt_every=0", "log_every=100", "resume=auto")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "hpdl: error: training diverged: the loss or the weights became NaN or infinite at update 3 (lr=0.001 too "
        f"high?); stopped; out_dir={out} keeps last.pt of update 2"], proc.stderr
    assert {p: p.read_bytes() for p in out.iterdir() if p.suffix in (".pt", ".json", ".png")} == kept


@pytest.mark.parametrize("extra", [["resume=auto"], ["overwrite=true"]])
def test_a_directory_where_a_run_writes_a_file_is_refused_before_anything_is_touched(tmp_path, extra):
    data, out = tiny_data(tmp_path), tmp_path / "run"
    assert tiny_run(data, out, "total_updates=2", "val_at_end=false").returncode == 0
    (out / "last.pt").unlink()
    (out / "last.pt").mkdir()
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = tiny_run(data, out, "total_updates=4", *extra)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"hpdl: error: out_dir={out}: last.pt is a directory, where a run writes a file; move it away or choose "
        "another out_dir"], proc.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files


def test_a_run_without_a_validation_split_says_it_validates_on_the_training_images(tmp_path):
    data = tiny_data(tmp_path)
    proc = tiny_run(data, tmp_path / "run", "total_updates=2", "val_data=null")
    assert proc.returncode == 0, proc.stderr
    assert (f"note: data={data / 'train'} has no validation split and val_data is not another set: validation "
            "scores the training images (set val_data= for held-out scores)") in proc.stdout
    assert "update 2: Y-PSNR" in proc.stdout and "on 2 training images" in proc.stdout
    assert "held-out images" not in proc.stdout and "validation images  2 (the training images)" in proc.stdout
    held_out = tiny_run(data, tmp_path / "run2", "total_updates=2", "--json")
    assert held_out.returncode == 0 and json.loads(held_out.stdout)["val_held_out"] is True
    assert "on 2 held-out images" in held_out.stderr  # progress notes go to stderr with --json


def test_resuming_with_another_repeat_names_the_keys_the_data_order_follows(tmp_path):
    data, out = tiny_data(tmp_path), tmp_path / "run"
    assert tiny_run(data, out, "total_updates=2", "val_at_end=false").returncode == 0
    proc = tiny_run(data, out, "total_updates=4", "val_at_end=false", "resume=auto", "repeat=4")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"hpdl: error: {out / 'last.pt'}: cannot continue its data order: sampler state has num_samples=6 but this "
        "sampler has 8; the patches per epoch follow data, train_range, repeat, on_bad_image, seed and the images "
        "found (changed: repeat (3 -> 4))"], proc.stderr


def test_resuming_on_another_number_of_ranks_says_how_the_global_batch_changed(tmp_path):
    data, out = tiny_data(tmp_path), tmp_path / "run"
    assert tiny_run(data, out, "total_updates=2", "val_at_end=false").returncode == 0
    ckpt = load_checkpoint(out / "last.pt")
    ckpt["rng"] = ckpt["rng"] * 2  # as if written by 2 ranks
    save_checkpoint(out / "last.pt", ckpt)
    proc = tiny_run(data, out, "total_updates=4", "val_at_end=false", "resume=auto")
    assert proc.returncode == 0, proc.stderr
    assert ("note: the checkpoint was written by 2 ranks, this job has 1: the global batch is 2 patches per "
            "update, 4 before") in proc.stdout
