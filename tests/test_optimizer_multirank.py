"""DistributedOptimizer on several ranks, under mpiexec (MPI) and torchrun (gloo)."""

import re

import pytest

from ranks import LAYOUT_IDS, LAYOUTS, OPENMPI_LAYOUT_IDS, OPENMPI_LAYOUTS, run_ranks, shared_job

pytestmark = pytest.mark.multirank

EQUIVALENCE = [
    "sgd-average", "sgd-sum", "adam-average", "adam-sum", "sgd-accumulate2", "adam-accumulate2", "sgd-accumulate2-set", "sgd-fp16",
    "adam-bf16", "sgd-predivide", "sgd-groups-int", "adam-groups-list", "sgd-unnamed",
    "sgd-overlap", "adam-overlap", "adam-sum-overlap", "sgd-fp16-overlap", "adam-overlap-scheduler",
]
BEHAVIOUR = [
    "isinstance-state-dict", "zero-grad-pending", "duplicate-names", "unused-parameter", "unfrozen-parameter",
    "skip-synchronize",
    "broadcast-state", "broadcast-state-keeps-gradients", "broadcast-state-weight-decay",
    "broadcast-state-zero-gradients",
    "load-state-dict-mid-step", "overlap-forward-rollback", "sparse", "unnamed-param-groups", "sparse-adam", "adasum-optimizer", "process-set",
    "sparse-first-step-unused", "overlap-forward-without-hooks", "changed-gradients",
]


def _assert_all_ok(stdout: str, names) -> None:
    missing = [name for name in names if f"OK {name}\n" not in stdout]
    assert not missing, f"no OK line for {missing}:\n{stdout}"


OVERLAP = [name for name in EQUIVALENCE if "overlap" in name]


def _optimizer_job(launcher: str, n: int):
    """The layout's one job for the tests below: every equivalence scenario, then the overlap ones
    again under a priority window of 16 bytes, every behaviour check, and last the overlap_forward
    end with the model and optimizer kept (optimizer_job.py). Under Open MPI, the equivalence
    scenarios alone (optimizer_equivalence.py), at 3 ranks."""
    if launcher == "openmpi":
        return shared_job(("optimizer_equivalence.py", launcher, n), lambda: run_ranks(
            "optimizer_equivalence.py", n, launcher, args=["--priority-window", "16"], timeout=240))
    return shared_job(("optimizer_job.py", launcher, n), lambda: run_ranks("optimizer_job.py", n, launcher, timeout=400))


@pytest.mark.parametrize("launcher,n", LAYOUTS + OPENMPI_LAYOUTS, ids=LAYOUT_IDS + OPENMPI_LAYOUT_IDS)
def test_equivalence_with_one_process(launcher, n):
    # Average and Sum, SGD and Adam, accumulation, 16-bit compression, predivide, groups,
    # unnamed parameters; odd ranks produce gradients in another order.
    _assert_all_ok(_optimizer_job(launcher, n).stdout, EQUIVALENCE)


@pytest.mark.parametrize("launcher,n", [("mpiexec", 2), ("mpiexec", 3), ("torchrun", 2)],
                         ids=["mpiexec-2", "mpiexec-3", "torchrun-2"])
def test_overlap_forward_with_a_priority_window_smaller_than_any_gradient(launcher, n):
    # Every gradient then waits queued, in the agreed order, and starts alone as the one
    # before it finishes (between rounds, or while a round waits): the results must not change.
    _assert_all_ok(_optimizer_job(launcher, n).stdout, [f"{name} priority-window=16" for name in OVERLAP])


@pytest.mark.parametrize("launcher,n", LAYOUTS + [("openmpi", 2)], ids=LAYOUT_IDS + ["openmpi-2"])
def test_behaviour(launcher, n):
    # Open MPI at 2 ranks: its other jobs run 3.
    result = (run_ranks("optimizer_behaviour.py", n, launcher, timeout=240) if launcher == "openmpi"
              else _optimizer_job(launcher, n))
    _assert_all_ok(result.stdout, BEHAVIOUR)


@pytest.mark.parametrize("launcher,n,keep", [(launcher, n, "kept") for launcher, n in LAYOUTS]
                         + [("mpiexec", 2, "model"), ("mpiexec", 2, "none")],
                         ids=[f"{i}-kept" for i in LAYOUT_IDS] + ["mpiexec-2-model", "mpiexec-2-none"])
def test_overlap_forward_ends_cleanly_when_one_rank_finishes_first(launcher, n, keep):
    # keep: what the script holds at shutdown (optimizer_overlap_end.py): the last updates
    # must not be lost while the model lives, and the slower rank's last backward must not
    # fail even when nothing is left of the training. "kept" ends the layout's optimizer job.
    result = (_optimizer_job(launcher, n) if keep == "kept"
              else run_ranks("optimizer_overlap_end.py", n, launcher, args=[keep], timeout=240))
    # The ranks' lines may interleave in the launcher's output: match the records, not lines.
    if keep == "none":
        done = re.findall(r"DONE (\d+)", result.stdout)
        assert sorted(int(r) for r in done) == list(range(n)), result.stdout + result.stderr
        return
    found = re.findall(r"PARAMS (\d+) (-?[0-9.]+e[+-]\d+)", result.stdout)
    assert sorted(int(r) for r, _ in found) == list(range(n)), result.stdout + result.stderr
    assert len({checksum for _, checksum in found}) == 1, result.stdout
