import sys
from pathlib import Path

import pytest

# Test helpers (ranks.py) import as plain modules.
sys.path.insert(0, str(Path(__file__).resolve().parent))


def gpu_skip_reason():
    """Why the tests marked gpu cannot run here (no CUDA device), or None when they can."""
    from hpdl.comm.select import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    return None if reason is None else f"needs a CUDA device: {reason}"


def pytest_collection_modifyitems(config, items):
    # Every test marked gpu, in whatever file, skips with the reason on a machine without CUDA.
    gpu_tests = [item for item in items if item.get_closest_marker("gpu") is not None]
    reason = gpu_skip_reason() if gpu_tests else None
    if reason is not None:
        for item in gpu_tests:
            item.add_marker(pytest.mark.skip(reason=reason))
