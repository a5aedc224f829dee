"""`hpdl profile predict`: a profile's steps replayed at other rank counts (predictor.py), from
profiles written by the recorder itself, and its bad inputs, one line each."""

import json

import pytest

from hpdl.cli import main
from hpdl.engine import events as ev
from hpdl.profile import schema
from hpdl.profile.recorder import Recorder

MiB = 1 << 20


def _profile(path, steps=3, gradients=4, nbytes=4 * MiB, spacing_us=100_000.0, step_us=1_000_000.0, version=3):
    """A rank's recording of ``steps`` steps: ``gradients`` gradients of ``nbytes`` made every
    ``spacing_us`` from 0.5 s into each step (backward), each reduced alone at once."""
    recorder = Recorder(rank=0, zero_us=0.0)
    recorder._step_start = 0.0
    for k in range(steps):
        start = k * step_us
        for i in range(gradients):
            name = (f"layer{gradients - i}.weight",)
            t = start + 500_000 + i * spacing_us
            recorder.observe(ev.Event(ev.QUEUED, "allreduce", name, t))
            recorder.observe(ev.Event(ev.NEGOTIATED, "allreduce", name, t + 10, drained_us=t + 5))
            recorder.observe(ev.Event(ev.COLLECTIVE, time_us=t + 10, duration_us=1000, op="ALLREDUCE", sizes=(nbytes,),
                                      dtype="float32", backend="gloo", kind="allreduce", names=name, nbytes=nbytes,
                                      fused=1, process_set_id=0))
            recorder.observe(ev.Event(ev.DONE, "allreduce", name, t + 1010))
        recorder.observe(ev.Event(ev.STEP, "step", (), start + step_us, duration_us=0.0))
    part = recorder.snapshot()
    if version == 2:
        columns = part["collectives"]["columns"]
        part["collectives"] = schema.table(columns[:-1], [row[:-1] for row in part["collectives"]["rows"]])
    settings = {"fusion_threshold": 64 * MiB, "inplace_threshold": MiB, "cycle_time_ms": 1.0}
    path.write_text(json.dumps({"format": schema.FORMAT, "version": version,
                                "job": {"size": 2, "backend": "gloo", "settings": settings}, "ranks": [part]}))
    return str(path)


def _predict(capsys, *argv):
    code = main(["profile", "predict", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_prediction_says_what_it_assumed_and_scales_the_recorded_step(tmp_path, capsys):
    path = _profile(tmp_path / "p.json")
    code, out, _ = _predict(capsys, path, "--batch-size", "8", "--ranks", "1,2,8", "--gpus-per-node", "4",
                            "--network", "intra=pcie3,inter=10gbe", "--json", str(tmp_path / "p.pred.json"))
    assert code == 0, out
    assert "compute per step: 1000.0 ms as profiled (median of 3 step(s))" in out
    assert "gradients: 4 per step, 16.0 MiB" in out and "network: intra: pcie3" in out
    record = json.loads((tmp_path / "p.pred.json").read_text())
    points = {p["ranks"]: p for p in record["points"]}
    assert points[1]["step_s"] == pytest.approx(1.0) and points[1]["efficiency"] == pytest.approx(1.0)
    # The last gradient (made 0.8 s into the step, backward ends there) is exposed: at 8 ranks on
    # 2 nodes over 10 GbE, its 4 MiB take milliseconds; the step grows by them.
    assert points[8]["exposed_s"] > 0 and points[8]["step_s"] == pytest.approx(1.0 + points[8]["exposed_s"])
    assert points[8]["img_per_s"] == pytest.approx(8 * 8 / points[8]["step_s"])
    assert points[8]["efficiency"] < points[2]["efficiency"] <= 1.0
    assert set(points[8]["exposed_by_class"]) == {"128 KiB-16 MiB"}


def test_what_ifs_stand_beside_the_baseline_and_change_what_they_say(tmp_path, capsys):
    path = _profile(tmp_path / "p.json")
    code, out, _ = _predict(capsys, path, "--batch-size", "8", "--ranks", "16", "--gpus-per-node", "4",
                            "--network", "intra=pcie3,inter=10gbe", "--what-if", "fp16", "--what-if", "batch-size=2x",
                            "--what-if", "bandwidth>=1MB:x2", "--json", "-")
    assert code == 0
    points = {p["what_if"]: p for p in json.loads(out)["points"]}
    base = points["baseline"]
    assert points["fp16"]["exposed_s"] < base["exposed_s"]  # half the bytes
    assert points["bandwidth>=1MB:x2"]["exposed_s"] < base["exposed_s"]
    twice = points["batch-size=2x"]  # twice the compute and images, the same gradients
    assert twice["step_s"] == pytest.approx(2.0 + twice["exposed_s"]) and twice["efficiency"] > base["efficiency"]


def test_a_compute_rate_puts_another_devices_speed_in_place_of_the_profiles(tmp_path, capsys):
    path = _profile(tmp_path / "p.json")
    code, out, _ = _predict(capsys, path, "--batch-size", "8", "--ranks", "1", "--network", "intra=shm",
                            "--compute-rate", "80", "--json", "-")
    assert code == 0
    (point,) = json.loads(out)["points"]
    assert point["step_s"] == pytest.approx(0.1) and point["img_per_s"] == pytest.approx(80)


@pytest.mark.parametrize("argv, expected", [
    (["--network", "intra=warp-drive"], "warp-drive"),
    (["--network", "intra=x:fast:1us"], "fast"),
    (["--ranks", "0,2"], "--ranks '0,2': give positive whole numbers"),
    (["--what-if", "fp8"], "--what-if 'fp8': not one of"),
    (["--batch-size", "0"], "--batch-size 0: give at least 1"),
    (["--ranks", "8", "--gpus-per-node", "4", "--network", "intra=shm"], "no inter level"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, expected):
    path = _profile(tmp_path / "p.json")
    base = {"--network": "intra=shm", "--batch-size": "2", "--ranks": "1,2"}
    for option, value in zip(argv[::2], argv[1::2]):
        base[option] = value
    code, _, err = _predict(capsys, path, *[x for kv in base.items() for x in kv])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expected in lines[0], err


def test_a_profile_of_an_older_hpdl_or_without_steps_is_refused_saying_why(tmp_path, capsys):
    old = _profile(tmp_path / "old.json", version=2)
    code, _, err = _predict(capsys, old, "--batch-size", "2", "--network", "intra=shm")
    assert code == 2 and "older hpdl" in err and "record it again" in err
    empty = _profile(tmp_path / "empty.json", steps=0)
    code, _, err = _predict(capsys, empty, "--batch-size", "2", "--network", "intra=shm")
    assert code == 2 and "no training step with allreduces" in err


def test_the_plot_is_written_and_an_existing_file_is_kept_without_overwrite(tmp_path, capsys):
    path = _profile(tmp_path / "p.json")
    plot = tmp_path / "pred.png"
    argv = [path, "--batch-size", "2", "--ranks", "1,2,4", "--network", "intra=shm", "--gpus-per-node", "4",
            "--plot", str(plot)]
    assert _predict(capsys, *argv)[0] == 0 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = _predict(capsys, *argv)
    assert code == 2 and "--plot" in err and "--overwrite" in err


def test_the_backend_is_the_profiles_unless_given_and_says_whether_collectives_block(tmp_path, capsys):
    path = _profile(tmp_path / "p.json")  # recorded over gloo
    code, out, _ = _predict(capsys, path, "--batch-size", "8", "--ranks", "2", "--gpus-per-node", "2",
                            "--network", "intra=shm")
    assert code == 0 and "backend gloo: collectives in the background, rounds beside them" in out
    code, out, _ = _predict(capsys, path, "--batch-size", "8", "--ranks", "2", "--gpus-per-node", "2",
                            "--network", "intra=shm", "--backend", "mpi")
    assert code == 0 and "backend mpi: the engine's thread waits for each collective within a node" in out
