"""The upscale of one large photo on 2 ranks x 1 thread (``--spatial``) against one process with
1 and with 2 threads, in alternating rounds (issue 30's goal: at least as fast as 1 process x
2 threads, and at least 1.8x 1 process x 1 thread).

The photo is scikit-image's ``coffee`` (600 x 400) enlarged bicubically to ``--size``; the model
is EDSR-baseline x2 with PyTorch's initial weights (the time does not depend on the weights).
Each round runs the three commands one after the other, in a rotating order, and checks that
the three output files are the same bytes. Prints each run's seconds, then the medians and the
ratios of each round's times.

Usage (docs/spatial.md and docs/perf.md quote the figures):
    python scripts/measure_spatial_upscale.py --size 6000x4000 --rounds 3 [--dir /tmp/upscale]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def make_inputs(directory: Path, width: int, height: int) -> tuple:
    import numpy as np
    import skimage.data
    import torch
    from PIL import Image

    from hpdl.sr.checkpoint import make_checkpoint, save_checkpoint
    from hpdl.sr.models import build_model

    photo, ckpt = directory / f"coffee_{width}x{height}.png", directory / "edsr_baseline_x2.pt"
    if not photo.exists():
        Image.fromarray(np.asarray(skimage.data.coffee())).resize((width, height), Image.BICUBIC).save(photo)
    if not ckpt.exists():
        torch.manual_seed(0)
        save_checkpoint(str(ckpt), make_checkpoint(build_model("edsr_baseline", 2)))
    return photo, ckpt


def commands(photo: Path, ckpt: Path, directory: Path, photo_pixels: int) -> dict:
    hpdl = [sys.executable, "-m", "hpdl"]
    upscale = ["sr", "upscale", str(photo), "--ckpt", str(ckpt), "--overwrite", "--no-progress",
               "--max-pixels", str(max(20_000_000, photo_pixels))]
    return {  # name -> (argv, OMP_NUM_THREADS, output)
        "1 process x 1 thread": (hpdl + upscale[:3] + [str(directory / "out_1x1.png")] + upscale[3:], "1",
                                 directory / "out_1x1.png"),
        "1 process x 2 threads": (hpdl + upscale[:3] + [str(directory / "out_1x2.png")] + upscale[3:], "2",
                                  directory / "out_1x2.png"),
        "2 ranks x 1 thread": (hpdl + ["run", "-np", "2", "--"] + hpdl + upscale[:3]
                               + [str(directory / "out_2x1.png")] + upscale[3:] + ["--spatial"], "1",
                               directory / "out_2x1.png"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="6000x4000", help="WxH of the photo to upscale (default 6000x4000)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the three runs (default 3)")
    parser.add_argument("--dir", default="/tmp/hpdl-upscale-measure", help="where the inputs and outputs go")
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.lower().split("x"))
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    photo, ckpt = make_inputs(directory, width, height)
    runs = commands(photo, ckpt, directory, width * height)
    names = list(runs)
    times = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            argv, threads, _ = runs[name]
            env = dict(os.environ, OMP_NUM_THREADS=threads)
            start = time.perf_counter()
            proc = subprocess.run(argv, env=env, capture_output=True, text=True)
            seconds = time.perf_counter() - start
            if proc.returncode != 0:
                print(f"{name} failed ({proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
                return 1
            times[name].append(seconds)
            print(f"round {r + 1}: {name}: {seconds:.1f} s", flush=True)
        outputs = {runs[name][2].read_bytes() for name in names}
        print(f"round {r + 1}: the three outputs are {'the same bytes' if len(outputs) == 1 else 'DIFFERENT'}",
              flush=True)
    print(f"\n{width}x{height} -> x2, EDSR-baseline, tile 256, {args.rounds} rounds")
    for name in names:
        print(f"{name:24s} median {statistics.median(times[name]):8.1f} s  runs "
              + " ".join(f"{t:.1f}" for t in times[name]))
    spatial = times["2 ranks x 1 thread"]
    for other in names[:2]:
        ratios = [o / s for o, s in zip(times[other], spatial)]
        print(f"2 ranks x 1 thread against {other}: speed-up per round {' '.join(f'{x:.2f}' for x in ratios)}, "
              f"median {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
