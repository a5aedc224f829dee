"""The HTML report in a real browser: headless Chromium loads it, logs no console error, and
its screenshot shows the plots. Skipped only where no Chromium is installed (.ci/run installs
Debian's `chromium` when it runs as root)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import List, Tuple

import pytest

from hpdl.profile.analysis import Analysis
from hpdl.profile.findings import findings
from hpdl.profile.html import render_html
from test_profile_units import MiB, make_profile

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium)")

_CONSOLE = re.compile(r":CONSOLE[:(].*")
_BAR_BLUE = (0x4C, 0x72, 0xB0)  # the size-class and compute bars


def render_in_chromium(page: Path, tmp_path: Path) -> Tuple[List[str], Path]:
    """Load ``page`` in headless Chromium; return its console lines and a screenshot."""
    shot = tmp_path / f"{page.stem}.png"
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp_path / (page.stem + '-chromium')}", "--enable-logging=stderr", "--v=0",
            "--hide-scrollbars", "--window-size=1200,2600", f"--screenshot={shot}", page.as_uri()]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert shot.exists(), result.stderr[-3000:]
    return [m.group(0) for m in map(_CONSOLE.search, result.stderr.splitlines()) if m], shot


def blue_share(png: Path) -> float:
    """Share of the screenshot's pixels in the bars' blue."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(png).convert("RGB"), dtype=np.int16)
    near = (np.abs(pixels - np.array(_BAR_BLUE, dtype=np.int16)) <= 12).all(axis=-1)
    return float(near.mean())


def test_console_errors_are_seen(tmp_path):
    # The check below must be able to fail: a page with a script error is caught.
    page = tmp_path / "broken.html"
    page.write_text("<html><body><p>x</p><script>undefined_function();</script></body></html>")
    console, _ = render_in_chromium(page, tmp_path)
    assert any("undefined_function is not defined" in line for line in console), console


def test_report_page_loads_cleanly_and_shows_its_plots(tmp_path):
    analysis = Analysis(make_profile(late_rank1=3000.0, blocked=12_000.0, sizes=(40 * MiB, 20 * MiB)))
    page = tmp_path / "report.html"
    page.write_text(render_html(analysis, "p.json", findings(analysis), {MiB: (900.0, 2.0), 64 * MiB: (13e3, 5.1)}))
    console, shot = render_in_chromium(page, tmp_path)
    assert console == []
    assert blue_share(shot) > 0.01  # the bars are drawn (an empty or failed page has none)
    blank = tmp_path / "blank.html"
    blank.write_text("<html><body><table><tr><td>only a table</td></tr></table></body></html>")
    _, blank_shot = render_in_chromium(blank, tmp_path)
    assert blue_share(blank_shot) == 0.0
