"""`hpdl bench elastic`: one real job at its smallest (the tiny model, 2 workers, 1 round), its
record's structure and its table; bad input is one line, exit 2, before any job. Timings are
checked for being positive only, never for their values."""

import json
import os
import subprocess
import sys

import pytest

from hpdl.bench.elastic import NEW_WORKER_PHASES, PHASES, host_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_each_host_is_a_name_of_this_machine_never_used_twice():
    names = host_names(255)
    assert names[:3] == ["localhost", "127.0.0.1", "127.0.0.2"] and names[-1] == "127.0.0.254"
    assert len(set(names)) == 255


@pytest.mark.multirank
def test_a_death_and_a_new_host_are_timed_phase_by_phase(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPDL_", "HOROVOD_")) or k == "HPDL_VENV"}
    env.update(PYTHONPATH=ROOT)
    out = tmp_path / "e.json"
    done = subprocess.run([sys.executable, "-m", "hpdl", "bench", "elastic", "--model", "tiny", "--workers", "2",
                           "--rounds", "1", "--steps", "1", "--json", str(out), "--timeout", "240"],
                          env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["benchmark"] == "elastic" and record["complete"] is True
    assert record["models"] == ["tiny"] and record["workers"] == [2] and record["rounds"] == 1
    assert record["phases"] == {kind: list(names) for kind, names in PHASES.items()}
    (run,) = record["runs"]
    assert (run["model"], run["workers"], len(run["rounds"])) == ("tiny", 2, 1)
    assert run["parameters"] == 84 and run["step_s"] > 0
    for kind, names in PHASES.items():
        for timing in (run["rounds"][0][kind], run["median"][kind]):
            for name in names + ("total", "resumed"):
                assert timing[name] >= 0, (kind, name, timing)
            assert timing["total"] > 0 and timing["resumed"] > 0
            assert timing["total"] == pytest.approx(sum(timing[name] for name in names))
            assert set(timing["sync_parts"]) == {"parameters", "optimizer", "rest"}
            assert all(v >= 0 for v in timing["sync_parts"].values())
    new_worker = run["median"]["host"]["new_worker"]
    assert set(new_worker) == set(NEW_WORKER_PHASES) | {"ready"} and all(v > 0 for v in new_worker.values())
    assert run["median"]["failure"]["driver_saw_death"] > 0
    rows = [line.split()[:4] for line in done.stdout.splitlines()]
    assert ["tiny", "2", "->", "1"] in rows and ["tiny", "1", "->", "2"] in rows, done.stdout
    progress = [line for line in done.stderr.splitlines() if line.startswith("hpdl bench elastic: tiny, 2 workers")]
    assert len(progress) == 3, done.stderr  # starting, the round, the job


@pytest.mark.parametrize("args, fragment", [
    (["--workers", "1"], "--workers takes distinct worker counts of at least 2"),
    (["--workers", "2,x"], "--workers takes comma-separated integers, got '2,x'"),
    (["--model", "vgg"], "--model takes distinct models among edsr-baseline, edsr, srresnet, tiny, got vgg"),
    (["--model", "edsr", "--scale", "5"], "--scale 5 for edsr: "),
    (["--rounds", "0"], "--rounds must be at least 1, got 0"),
    (["--workers", "250", "--rounds", "10"], "need 260 host names of this machine"),
    (["--discovery-interval", "0"], "--discovery-interval takes seconds above 0"),
    (["--timeout", "0"], "--timeout takes seconds above 0"),
], ids=["one-worker", "not-a-number", "model", "scale", "rounds", "names", "interval", "timeout"])
def test_bad_input_is_one_line_before_any_job(capsys, monkeypatch, args, fragment):
    from hpdl.bench import elastic
    from hpdl.cli import main

    monkeypatch.setattr(elastic, "run_point", lambda *a, **k: pytest.fail("a job started"))
    assert main(["bench", "elastic", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("hpdl: error: ") and fragment in err, err


def test_an_existing_json_file_is_kept_without_overwrite(capsys, monkeypatch, tmp_path):
    from hpdl.bench import elastic
    from hpdl.cli import main

    monkeypatch.setattr(elastic, "run_point", lambda *a, **k: pytest.fail("a job started"))
    (tmp_path / "e.json").write_text("mine")
    assert main(["bench", "elastic", "--json", str(tmp_path / "e.json")]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "e.json").read_text() == "mine"
