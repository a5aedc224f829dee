"""Train EDSR-baseline x2 on Ray with hpdl.ray.RayExecutor, then score it against bicubic.

    python examples/ray_sr.py                                   # 2 ranks on a local Ray
    python examples/ray_sr.py --address auto --ranks 8 --out /shared/run --cache-dir /shared/cache

The same rank function as examples/spark_sr.py (each rank trains on its own shard of the
training photos with the recipe of `hpdl sr train --config demo`; rank 0 writes the checkpoint),
run by a RayExecutor instead of Spark: one Ray actor per rank in a placement group. The driver
then scores the checkpoint on the held-out photos against bicubic upscaling and writes
``OUT/summary.json``; the exit status is 1 when the model does not beat bicubic. On a cluster,
``--out`` and ``--cache-dir`` must be on a file system every node and the driver share.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spark_sr  # noqa: E402 - the rank function and the scoring, shared with the Spark example


def train_on_ray(checkpoint: Path, cfg: Any, cache: Path, ranks: int,
                 cpus_per_worker: float = 1) -> Tuple[List[str], List[Dict[str, Any]]]:
    """Train on ``ranks`` Ray actors; return the training paths and every rank's report."""
    from ray import cloudpickle  # Ray's own copy pickles the calls: the registration is its

    from hpdl.ray import RayExecutor
    from hpdl.sr import prepare_embedded

    # The actors get the rank function by value: they need not find this folder on their path.
    cloudpickle.register_pickle_by_value(spark_sr)
    paths = sorted(str(p) for p in prepare_embedded(cache)["train"].glob("*.png"))
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=ranks,
                           cpus_per_worker=cpus_per_worker)
    executor.start()
    try:
        reports = executor.run(spark_sr.train_rank, args=(paths, str(checkpoint), cfg, str(cache)))
    finally:
        executor.shutdown()
    return paths, reports


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="ray_sr.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=None, help="a Ray cluster's address (default: start a local Ray)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks, one Ray actor each (default 2)")
    spark_sr.add_run_arguments(parser, "runs/ray_sr")
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error(f"--ranks must be at least 1, got {args.ranks}")

    import ray

    from hpdl.ray import PlacementError, WorkerFailedError

    cfg, checkpoint, cache = spark_sr.prepare_run(parser, args)
    start = time.perf_counter()
    if args.address:
        ray.init(address=args.address, log_to_driver=True)
    else:  # logical CPUs: one per rank, whatever the machine has
        ray.init(num_cpus=args.ranks, include_dashboard=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        paths, ranks = train_on_ray(checkpoint, cfg, cache, args.ranks)
    except (PlacementError, WorkerFailedError) as err:
        print(f"ray_sr.py: error: {err}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    ray_seconds = time.perf_counter() - start
    return spark_sr.report(checkpoint, cfg, cache, {"address": args.address or "local", "paths": paths,
                                                    "ranks": ranks, "ray_seconds": ray_seconds}, "Ray", ray_seconds)


if __name__ == "__main__":
    sys.exit(main())
