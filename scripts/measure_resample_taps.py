"""What resampling by taps (hpdl/torch/spatial/taps.py: the path for sizes that are not whole
factors, and align_corners=True) costs against PyTorch's own kernel, in one process on one
thread: the same output, timed in alternating rounds.

Usage: python scripts/measure_resample_taps.py [--channels 21] [--size 128] [--out 1021]
       [--mode bilinear] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hpdl.torch.spatial import resampling, taps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--channels", type=int, default=21)
    parser.add_argument("--size", type=int, default=128, help="the input's height and width")
    parser.add_argument("--out", type=int, default=1021, help="the output's height and width")
    parser.add_argument("--mode", default="bilinear", choices=["nearest", "nearest-exact", "bilinear", "bicubic"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(1, args.channels, args.size, args.size)
    call = {"size": (args.out, args.out), "mode": args.mode}
    if not args.mode.startswith("nearest"):
        call["align_corners"] = False
    rows, cols = resampling.taps_of(x, (args.size, args.size), call)

    def by_taps():
        return taps.resample(x, rows, cols, (0, args.out, 0), (0, args.out, 0))

    def by_kernel():
        return F.interpolate(x, **call)

    error = ((by_taps() - by_kernel()).abs().max() / by_kernel().abs().max()).item()
    times = {"taps": [], "kernel": []}
    for _ in range(args.rounds):
        for name, run in (("taps", by_taps), ("kernel", by_kernel)):
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    taps_s, kernel_s = statistics.median(times["taps"]), statistics.median(times["kernel"])
    print(f"{args.channels} channels, {args.size} x {args.size} to {args.out} x {args.out}, {args.mode}: "
          f"taps {taps_s:.3f} s, kernel {kernel_s:.3f} s ({taps_s / kernel_s:.1f}x), medians of {args.rounds}; "
          f"largest relative difference {error:.1e}")


if __name__ == "__main__":
    main()
