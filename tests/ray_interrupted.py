"""A driver interrupted by Ctrl-C (tests/test_ray.py): it starts a local Ray, runs a training
that never ends under a RayExecutor (fixed ranks, then an elastic job), prints a line once the
ranks train, and after each KeyboardInterrupt prints how many of the 4 logical CPUs Ray has free
again once the actors are gone (4: none left behind).

Usage: python ray_interrupted.py MARKS_DIR"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import ray  # noqa: E402

from hpdl.ray import RayExecutor  # noqa: E402
from ray_elastic_training import train  # noqa: E402


def main() -> None:
    marks = sys.argv[1]
    path = os.pathsep.join([os.path.dirname(__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))])
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": path}})
    for mode, executor in (("fixed", RayExecutor(num_workers=3)),
                           ("elastic", RayExecutor(min_workers=2, max_workers=3, num_workers=3))):
        executor.start()
        started = time.monotonic()
        try:
            executor.run(train, kwargs=dict(marks=os.path.join(marks, mode)))
        except KeyboardInterrupt:
            deadline = time.monotonic() + 30
            while ray.available_resources().get("CPU", 0) < 4 and time.monotonic() < deadline:
                time.sleep(0.2)
            print(f"INTERRUPTED {mode} after {time.monotonic() - started:.1f} s, CPUs free "
                  f"{ray.available_resources().get('CPU', 0):g}", flush=True)
        finally:
            executor.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
