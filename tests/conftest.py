import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

# Test helpers (ranks.py) import as plain modules.
sys.path.insert(0, str(Path(__file__).resolve().parent))


def gpu_skip_reason():
    """Why the tests marked gpu cannot run here (no CUDA device), or None when they can."""
    from hpdl.comm.select import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    return None if reason is None else f"needs a CUDA device: {reason}"


# The files that take longest, longest first (their summed durations in a whole run of the
# suite, 2026-11-28). The xdist workers take files in the order they are collected: starting the
# long ones first leaves short ones to fill the end, instead of one long file running on alone
# while the other workers are idle.
LONGEST_FIRST = ["test_torch_multirank.py", "test_spatial.py", "test_optimizer_multirank.py", "test_multinode.py",
                 "test_spark.py", "test_bad_input.py", "test_sr_train_multirank.py", "test_lost_rank.py",
                 "test_slurm.py", "test_gpu_check.py", "test_comm_multirank.py", "test_bench_synthetic.py",
                 "test_elastic.py", "test_sr_train.py", "test_bench_spatial.py", "test_spatial_failures.py",
                 "test_spatial_op_layouts.py", "test_spatial_ops.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order
    # Every test marked gpu, in whatever file, skips with the reason on a machine without CUDA.
    gpu_tests = [item for item in items if item.get_closest_marker("gpu") is not None]
    reason = gpu_skip_reason() if gpu_tests else None
    if reason is not None:
        for item in gpu_tests:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_addoption(parser):
    parser.addoption("--cpu-times", metavar="FILE", default=None,
                     help="append each test's wall time and the CPU time of its worker and of the processes it "
                          "waited for (ranks, launchers, commands) to FILE, one JSON line per test: where the "
                          "suite's time goes (scripts/cpu_times.py sums them by file)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("--cpu-times")
    if path is None:
        yield
        return

    def cpu():
        return [sum(resource.getrusage(who)[:2]) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]

    start, (own, children) = time.monotonic(), cpu()
    yield
    own_after, children_after = cpu()
    # A process that is never waited for (a daemon another process started) is not counted.
    with open(path, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "wall_s": round(time.monotonic() - start, 2),
                            "cpu_s": round(own_after - own, 2),
                            "children_cpu_s": round(children_after - children, 2), "pid": os.getpid()}) + "\n")
