"""Per-rank script for tests/test_sr_upscale_spatial.py: ``hpdl sr upscale --spatial`` on every rank.

    sr_upscale_spatial.py CASES.json OUT_DIR

CASES.json maps a case name to the command line after ``hpdl`` (and, optionally, what to
change first: "max_message_bytes" for hpdl.sr.spatial_upscale, "clock_step" for tqdm's clock).
Each case runs through hpdl.cli.main on every rank; OUT_DIR/result.<rank>.json records each
case's exit code, stdout and stderr on that rank, and "stall_check" the job's stall settings.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

from _common import run_main


class _Clock:
    """Stands in for tqdm's clock: each reading is ``step`` seconds after the previous one."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 1000.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def main() -> None:
    import tqdm.std

    import hpdl.sr.spatial_upscale as spatial_upscale
    import hpdl.torch as hvd
    from hpdl.cli import main as cli

    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    default_bytes, default_clock = spatial_upscale.MAX_MESSAGE_BYTES, tqdm.std.time
    results = {}
    for name, case in cases.items():
        spatial_upscale.MAX_MESSAGE_BYTES = case.get("max_message_bytes", default_bytes)
        tqdm.std.time = _Clock(case["clock_step"]) if "clock_step" in case else default_clock
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = cli(case["argv"])
            except SystemExit as exit_:
                code = exit_.code
        results[name] = {"code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
    hvd.init()  # a no-op unless every case was refused before the ranks met
    settings = hvd.runtime.settings()
    results["stall_check"] = {"warning_s": settings.stall_warning_s, "timeout_s": settings.stall_timeout_s}
    (out / f"result.{hvd.rank()}.json").write_text(json.dumps(results, indent=1))
    print(f"OK upscale spatial: rank {hvd.rank()} of {hvd.size()}, pid {os.getpid()}")


if __name__ == "__main__":
    run_main(main)
