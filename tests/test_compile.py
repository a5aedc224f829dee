"""torch.compile under hvd.DistributedOptimizer: a compiled model trains at 2 ranks exactly as the
eager one (float64), with backward_passes_per_step=2 and with overlap_forward (whose forward
pre-hooks are kept out of the compiled graph, else they would be traced once and skipped)."""

import pytest

from ranks import run_ranks


@pytest.mark.multirank
def test_a_compiled_model_trains_as_the_eager_one_at_two_ranks():
    out = run_ranks("compile_train.py", 2, "mpiexec", timeout=300).stdout
    assert [line for line in out.splitlines() if line.startswith("OK compile")] == [
        "OK compile plain", "OK compile passes2", "OK compile overlap"]
