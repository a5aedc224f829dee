"""EDSR-baseline training img/s on Ray (hpdl.ray.RayExecutor) beside the same job under `hpdl run`.

One benchmark run, alternating (the order rotated each repeat): `hpdl run -np N -- hpdl bench
synthetic ... --json` over MPI (hpdl run's default here) and over gloo (`--backend gloo`, the
backend the Ray ranks use), and the same benchmark (hpdl.bench.synthetic, the same options)
run by a RayExecutor of N one-CPU actors on a local Ray started once; --repeats times; medians
of the total img/s and the ratios. docs/ray.md quotes the figures.

Usage:
    python scripts/ray_vs_run.py [--ranks 2] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence

SYNTHETIC = dict(model="edsr-baseline", batch_size=2, patch=24, num_warmup=2, num_iters=5, num_batches_per_iter=4)


def _argv() -> List[str]:
    out = []
    for key, value in SYNTHETIC.items():
        out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def under_hpdl_run(ranks: int, backend: str) -> float:
    done = subprocess.run(["hpdl", "run", "-np", str(ranks), "--backend", backend, "--", "hpdl", "bench", "synthetic",
                           *_argv(), "--json"],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"hpdl run failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(done.stdout[done.stdout.find("{"):])["total_img_sec"]


def _synthetic_rank() -> Optional[Dict[str, Any]]:
    from hpdl.bench.synthetic import SyntheticOptions, run_synthetic

    return run_synthetic(SyntheticOptions(**SYNTHETIC), json_output=True)


def on_ray(executor) -> float:
    record = executor.run(_synthetic_rank)[0]
    return record["total_img_sec"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import ray
    from ray import cloudpickle  # Ray's own copy pickles the calls: the registration is its

    from hpdl.ray import RayExecutor

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=args.ranks, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    executor = RayExecutor(num_workers=args.ranks)
    executor.start()
    modes = ["hpdl run mpi", "hpdl run gloo", "ray"]
    runs: Dict[str, List[float]] = {mode: [] for mode in modes}
    try:
        for repeat in range(args.repeats):
            order = modes[repeat % len(modes):] + modes[:repeat % len(modes)]
            for mode in order:
                runs[mode].append(on_ray(executor) if mode == "ray" else under_hpdl_run(args.ranks, mode.split()[-1]))
                print(f"repeat {repeat + 1}: {mode} {runs[mode][-1]:.2f} img/s", file=sys.stderr, flush=True)
    finally:
        executor.shutdown()
        ray.shutdown()
    medians = {mode: statistics.median(values) for mode, values in runs.items()}
    print(f"EDSR-baseline, {args.ranks} ranks, {SYNTHETIC}: total img/s, median of {args.repeats}")
    for mode, value in medians.items():
        print(f"  {mode:13s} {value:7.2f}  (runs: {', '.join(f'{v:.2f}' for v in runs[mode])})")
    for mode in modes[:2]:
        print(f"  ray / {mode}: {medians['ray'] / medians[mode]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "synthetic": SYNTHETIC, "runs": runs, "medians": medians}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
