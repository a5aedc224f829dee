"""What the `hpdl sr` commands say and where: without the sr extra."""

import subprocess
import sys

import pytest

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
