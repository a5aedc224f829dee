"""What the `hpdl sr` commands say and where: without the sr extra, progress bars, the grid's crops, skipped
images."""

import importlib
import io
import json
import subprocess
import sys

import numpy as np
import pytest
import tqdm
from PIL import Image

from hpdl.cli import main
from hpdl.sr.progress import LOG_INTERVAL, progress_bar
from ranks import ROOT
from test_sr_cli import ckpt, folder  # noqa: F401 - fixtures

# Run the CLI as if ``module`` were not installed: its import fails and find_spec finds nothing.
_WITHOUT = "import sys; sys.modules[sys.argv.pop(1)] = None; from hpdl.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.mark.parametrize("module, package, command", [
    ("tqdm", "tqdm", "train"), ("yaml", "pyyaml", "train"), ("PIL", "pillow", "train"),
    ("tqdm", "tqdm", "eval"), ("PIL", "pillow", "upscale"),
])
def test_without_the_sr_extra_a_command_ends_in_one_line_naming_it(tmp_path, folder, ckpt, module, package,
                                                                   command):
    out_dir = tmp_path / "run"
    argv = {"train": ["sr", "train", "--config", "demo", f"out_dir={out_dir}", "total_updates=1"],
            "eval": ["sr", "eval", "--ckpt", str(ckpt), "--data", str(folder), "--cache-dir", str(tmp_path / "c")],
            "upscale": ["sr", "upscale", str(folder / "img0.png"), str(tmp_path / "up.png"), "--ckpt", str(ckpt)]}
    done = subprocess.run([sys.executable, "-c", _WITHOUT, module, *argv[command]], capture_output=True, text=True,
                          cwd=str(ROOT), timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"hpdl: error: hpdl sr {command} needs {package} (module {module}), which "
                                        "the sr extra installs: pip install 'hpdl[sr]'"], done.stderr
    assert not out_dir.exists() and not (tmp_path / "up.png").exists()  # refused before any work


# -- progress bars: one rule for train, eval and upscale ----------------------------------------

class _Terminal(io.StringIO):
    def isatty(self):
        return True


class _Clock:
    """Stands in for tqdm's clock: each reading is ``step`` seconds after the previous one."""

    def __init__(self, step):
        self.start = self.now = 1000.0
        self.step = step

    def __call__(self):
        self.now += self.step
        return self.now

    @property
    def elapsed(self):
        return self.now - self.start


def _frames(text: str) -> int:
    return text.count("\r")


def test_a_bar_redraws_on_a_terminal_and_rarely_elsewhere(monkeypatch):
    for stream, step, shown in ((_Terminal(), 1.0, True), (io.StringIO(), 1.0, False), (io.StringIO(), 5.0, True)):
        clock = _Clock(step)
        monkeypatch.setattr(tqdm.std, "time", clock)
        monkeypatch.setattr(sys, "stderr", stream)
        for _ in progress_bar(range(20), desc="work", unit="it"):
            pass
        frames = _frames(stream.getvalue())
        assert (frames > 0) == shown, (step, stream.getvalue())
        if not stream.isatty():  # in a log: none before LOG_INTERVAL, then one per LOG_INTERVAL at most
            assert frames <= clock.elapsed / LOG_INTERVAL + 1, (frames, clock.elapsed)
    monkeypatch.setattr(sys, "stderr", _Terminal())
    for _ in progress_bar(range(20), desc="work", unit="it", enabled=False):
        pass
    assert sys.stderr.getvalue() == ""


def test_tqdms_monitor_does_not_redraw_a_bar_in_a_log_before_log_interval(monkeypatch):
    # tqdm's monitor thread redraws, on its own clock, a bar whose last frame is maxinterval old.
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with progress_bar(total=10, desc="work", unit="it") as bar:
        assert bar.maxinterval == bar.mininterval == LOG_INTERVAL
    monkeypatch.setattr(sys, "stderr", _Terminal())
    with progress_bar(total=10, desc="work", unit="it") as bar:
        assert bar.mininterval < bar.maxinterval == 10.0  # tqdm's default on a terminal


def _eval(tmp_path, folder, ckpt, *extra):
    return main(["sr", "eval", "--ckpt", str(ckpt), "--data", str(folder), "--cache-dir", str(tmp_path / "c"), *extra])


def _upscale(tmp_path, ckpt, *extra):
    Image.fromarray(np.zeros((24, 24, 3), np.uint8)).save(tmp_path / "in.png")
    return main(["sr", "upscale", str(tmp_path / "in.png"), str(tmp_path / "out.png"), "--ckpt", str(ckpt),
                 "--tile", "4", "--overwrite", *extra])


@pytest.mark.parametrize("command", ["eval", "upscale"])
def test_eval_and_upscale_draw_rarely_in_a_log_and_not_at_all_with_no_progress(monkeypatch, tmp_path, folder, ckpt,
                                                                               command):
    run = (lambda *extra: _eval(tmp_path, folder, ckpt, *extra)) if command == "eval" else \
        (lambda *extra: _upscale(tmp_path, ckpt, *extra))
    desc = f"{command}:"
    # On a terminal too, slow work: past upscale's delay before its bar appears.
    monkeypatch.setattr(importlib.import_module("hpdl.sr.inference"), "PROGRESS_DELAY", 0.0)
    # Slow work (seconds per reading of tqdm's clock): a bar appears even in a log.
    for stream, step, extra, shown in ((_Terminal(), 3.0, (), True), (_Terminal(), 3.0, ("--no-progress",), False),
                                       (io.StringIO(), 20.0, (), True),
                                       (io.StringIO(), 20.0, ("--no-progress",), False)):
        clock = _Clock(step)
        monkeypatch.setattr(tqdm.std, "time", clock)
        monkeypatch.setattr(sys, "stderr", stream)
        assert run(*extra) == 0
        err = stream.getvalue()
        assert (desc in err) == shown, (extra, err)
        if shown and not stream.isatty():
            assert _frames(err) <= clock.elapsed / LOG_INTERVAL + 1, (_frames(err), clock.elapsed, err)


def test_train_draws_its_bar_by_the_same_rule(monkeypatch):
    from hpdl.sr import train

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    bar = train._progress(True, 100, 0)
    assert (bar.mininterval, bar.delay) == (LOG_INTERVAL, LOG_INTERVAL)
    bar.close()
    monkeypatch.setattr(sys, "stderr", _Terminal())
    bar = train._progress(False, 100, 0)
    assert bar.disable


# -- the grid says the size of its crops --------------------------------------------------------

@pytest.mark.parametrize("crop, said, cell", [
    (500, "2 crops of 52x40, 44x36 px (--grid-crop 500 cut to whole LR pixels and to the images)", (40, 52)),
    (33, "2 crops of 32x32 px (--grid-crop 33 cut to whole LR pixels and to the images)", (32, 32)),
    (32, "2 crops of 32x32 px", (32, 32)),
])
def test_the_grid_reports_the_size_of_the_crops_it_drew(tmp_path, folder, ckpt, capsys, crop, said, cell):
    from hpdl.sr.figures import grid_size

    grid = tmp_path / f"grid{crop}.png"
    assert _eval(tmp_path, folder, ckpt, "--no-progress", "--grid", str(grid), "--grid-images", "img0,img1",
                 "--grid-crop", str(crop)) == 0
    assert f"wrote {grid}: {said}\n" in capsys.readouterr().err
    with Image.open(grid) as image:  # cells as large as the largest crop drawn
        assert image.size[::-1] == grid_size(2, cell)


# -- --on-bad-image skip skips images too small, as undecodable ones --------------------------------

def test_images_too_small_are_skipped_with_one_warning_line_each(tmp_path, folder, ckpt, capsys):
    Image.fromarray(np.zeros((1, 1, 3), np.uint8)).save(folder / "dot.png")  # smaller than the scale
    Image.fromarray(np.zeros((30, 8, 3), np.uint8)).save(folder / "strip.png")  # too narrow to measure
    assert _eval(tmp_path, folder, ckpt, "--no-progress", "--json", "--on-bad-image", "skip") == 0
    out, err = capsys.readouterr()
    assert [image["name"] for image in json.loads(out)["sets"][0]["images"]] == ["img0", "img1"]
    warned = [line for line in err.splitlines() if line.startswith("hpdl: warning:")]
    assert warned == [f"hpdl: warning: skipping {folder / 'dot.png'}: image of 1x1 is smaller than scale 2",
                      f"hpdl: warning: skipping {folder / 'strip.png'}: image of 8x30 is too small to measure at "
                      "x2 on Y: 2 px shaved from each border must leave the 11x11 SSIM window, so each side needs "
                      "at least 15 px"], err
    assert _eval(tmp_path, folder, ckpt, "--no-progress") == 2  # without skip: refused, naming the first
    assert capsys.readouterr().err.strip().endswith("dot.png: image of 1x1 is smaller than scale 2")


def test_a_set_of_images_all_too_small_to_measure_is_refused_in_one_line(tmp_path, ckpt, capsys):
    small = tmp_path / "small"
    small.mkdir()
    Image.fromarray(np.zeros((30, 8, 3), np.uint8)).save(small / "strip.png")
    assert _eval(tmp_path, small, ckpt, "--no-progress", "--on-bad-image", "skip") == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == f"hpdl: error: {small}: no usable images (every one is too small to measure)", err
