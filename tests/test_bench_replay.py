"""`hpdl bench replay`: a profile's communication through the real engine, its compute slept;
against `hpdl profile predict` on one node and across emulated nodes (loose bounds: a test
never asserts a timing, these check that the two agree on what dominates); bad input."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from hpdl.bench.replay import ReplayOptions, replay_step
from hpdl.cli import main
from hpdl.launch.emulate import ClusterSpec, EmulatedCluster
from hpdl.profile.predict.schedule import Gradient, StepShape
from ranks import ROOT
from test_predict import _profile

MiB = 1 << 20


class _Engine:
    """What replay_step uses of hpdl.torch, recording when each call came (completes at once)."""

    def __init__(self, clock):
        self.clock, self.calls = clock, []

    def allreduce_async_(self, tensor, name):
        self.calls.append(("submit", name, tensor.numel() * tensor.element_size(), self.clock()))
        return name

    def synchronize(self, handle):
        self.calls.append(("wait", handle, 0, self.clock()))

    def profile_step(self):
        self.calls.append(("step", None, 0, self.clock()))


def test_a_step_submits_each_gradient_at_its_moment_then_waits_for_all_after_backward():
    import time

    from hpdl.bench.replay import _tensors

    shape = StepShape((Gradient("b", 8, 0.02), Gradient("a", 4 * MiB, 0.01)), backward_end_s=0.03, update_s=0.01)
    engine = _Engine(time.perf_counter)
    start = time.perf_counter()
    step, _ = replay_step(shape, _tensors([shape], fp16=False), engine)
    kinds = [(kind, name) for kind, name, _, _ in engine.calls]
    assert kinds == [("submit", "a"), ("submit", "b"), ("wait", "a"), ("wait", "b"), ("step", None)]
    submitted = {name: (nbytes, at - start) for kind, name, nbytes, at in engine.calls if kind == "submit"}
    assert submitted["a"][0] == 4 * MiB and submitted["b"][0] == 8  # the gradients' own bytes
    assert submitted["a"][1] >= 0.01 and submitted["b"][1] >= 0.02  # never before backward made them
    assert engine.calls[2][3] - start >= 0.03  # the optimizer waits from backward's end
    assert step >= 0.04  # backward, then the update


def test_fp16_buffers_hold_the_same_elements_in_half_the_bytes():
    from hpdl.bench.replay import _tensors

    shape = StepShape((Gradient("w", 4 * MiB, 0.0),), backward_end_s=0.0)
    (buffer,) = _tensors([shape], fp16=True).values()
    assert buffer.numel() == MiB and buffer.element_size() * buffer.numel() == 2 * MiB


@pytest.mark.parametrize("options, message", [
    (dict(steps=0), "--steps must be at least 1"),
    (dict(warmup=-1), "--warmup must be at least 0"),
    (dict(compute_scale=0.0), "--compute-scale must be above 0"),
    (dict(batch_size=0), "--batch-size must be at least 1"),
])
def test_options_out_of_range_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        ReplayOptions(**options)


@pytest.mark.parametrize("case", ["missing", "schema-2", "steps"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case):
    path = str(tmp_path / "missing.json")
    argv = ["bench", "replay", path]
    if case == "schema-2":
        argv[2] = _profile(tmp_path / "old.json", version=2)
    if case == "steps":
        argv[2] = _profile(tmp_path / "p.json")
        argv += ["--steps", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    expected = {"missing": "missing.json", "schema-2": "record it again", "steps": "--steps must be at least 1"}
    assert expected[case] in err


def _env():
    return dict({k: v for k, v in os.environ.items() if not k.startswith("HPDL_")}, OMP_NUM_THREADS="1",
                PYTHONPATH=str(ROOT))


def _replayed_and_predicted(profile, launch_prefix, network, ranks_per_node, env, cwd):
    replay = subprocess.run(launch_prefix + [sys.executable, "-m", "hpdl", "bench", "replay", profile, "--json",
                                             "--steps", "3", "--warmup", "1"],
                            env=env, cwd=cwd, capture_output=True, text=True, timeout=240)
    assert replay.returncode == 0, replay.stderr[-3000:]
    replayed = json.loads(replay.stdout[replay.stdout.find("{"):])
    predict = subprocess.run([sys.executable, "-m", "hpdl", "profile", "predict", profile, "--json", "-",
                              "--ranks", "2", "--gpus-per-node", str(ranks_per_node), "--algorithm", "ring", "--batch-size", "1",
                              "--network", network], env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert predict.returncode == 0, predict.stderr
    return replayed, json.loads(predict.stdout)["points"][0]


@pytest.mark.multirank
def test_the_replay_on_one_node_agrees_with_its_prediction(tmp_path):
    # Two 2 MiB gradients at 0.5 and 0.55 s of a 1 s step: at memory's speed both hide behind
    # the rest of backward; the step is its compute.
    profile = _profile(tmp_path / "p.json", gradients=2, nbytes=2 * MiB, spacing_us=50_000)
    replayed, predicted = _replayed_and_predicted(
        profile, [sys.executable, "-m", "hpdl", "run", "-np", "2", "--"], "intra=shm", 2, _env(), str(ROOT))
    assert replayed["ranks"] == 2 and replayed["nodes"] == 1 and replayed["compute_s"] == pytest.approx(1.0)
    assert replayed["step_s"] == pytest.approx(predicted["step_s"], rel=0.15)


@pytest.mark.multirank
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                    reason="emulated nodes need root and iproute2 (ip, tc)")
def test_the_replay_across_two_emulated_nodes_agrees_with_the_links_alpha_beta_prediction(tmp_path):
    # At 100 Mbit/s each 2 MiB allreduce of 2 ranks takes about 0.17 s (the whole message through
    # the link), so the second one ends about 0.3 s after backward: exposed, and predicted from
    # the link's own figures (the tc rate) with the ring's formula.
    profile = _profile(tmp_path / "p.json", gradients=2, nbytes=2 * MiB, spacing_us=50_000)
    with EmulatedCluster(ClusterSpec(nodes=2, slots=1, rate="100mbit")) as cluster:
        env = cluster.env(_env())
        replayed, predicted = _replayed_and_predicted(
            profile, cluster.nodes[0].argv([sys.executable, "-m", "hpdl", "run", "-np", "2", "--"]),
            "inter=emulated:100Mbit/s:100us", 1, env, str(ROOT))
    assert replayed["nodes"] == 2
    assert predicted["exposed_s"] > 0.2 and replayed["wait_s"] > 0.2  # both see the link dominate
    assert replayed["step_s"] == pytest.approx(predicted["step_s"], rel=0.25)
