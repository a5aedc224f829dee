"""`hpdl bench scaling`: placement, the jobs it starts, the summary, and one real small study."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hpdl.bench.scaling import ScalingOptions, job_argv, spread_over, summarize
from hpdl.launch.process_tree import alive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ranks_are_spread_evenly_over_the_hosts_within_their_slots():
    hosts = [("n1", 2), ("n2", 2)]
    assert spread_over(hosts, 1) == [("n1", 1)]
    assert spread_over(hosts, 2) == [("n1", 1), ("n2", 1)]
    assert spread_over(hosts, 3) == [("n1", 2), ("n2", 1)]
    assert spread_over([("n1", 1), ("n2", 3)], 3) == [("n1", 1), ("n2", 2)]


def test_each_system_runs_in_the_job_that_measures_it():
    opts = ScalingOptions(ranks=(1, 2), systems=("hpdl-hier", "ddp-fp16"), hosts=(("n1", 1), ("n2", 1)),
                          synthetic_args=("--model", "edsr"))
    assert opts.jobs() == ["default", "fp16", "hierarchical"]  # default always: it measures the ceiling
    default, fp16, hier = (job_argv(opts, job, 2) for job in opts.jobs())
    assert default[default.index("run"):default.index("--")] == ["run", "-np", "2", "-H", "n1:1,n2:1"]
    assert default[-2:] == ["--compare", "ceiling"]
    assert fp16[-3:] == ["--fp16-allreduce", "--compare", "ddp"]
    assert "--hierarchical-allreduce" in hier and "--compare" not in hier
    assert ["--model", "edsr", "--json", "--repeats", "1"] == default[default.index("--model"):default.index("--compare")]
    overlap = ScalingOptions(systems=("hpdl-overlap",))
    assert overlap.jobs() == ["default", "overlap"]
    assert job_argv(overlap, "overlap", 2)[-1] == "--overlap-forward"


def test_summary_takes_medians_and_both_efficiencies():
    opts = ScalingOptions(ranks=(1, 2), systems=("hpdl", "ddp"), repeats=3)
    runs = []
    for repeat, (one, two) in enumerate([(10, 9), (12, 8), (11, 10)]):
        runs.append({"repeat": repeat, "ranks": 1, "job": "default", "img_sec_per_rank": {"hpdl": one, "ddp": one, "ceiling": one}})
        runs.append({"repeat": repeat, "ranks": 2, "job": "default", "img_sec_per_rank": {"hpdl": two, "ddp": two / 2, "ceiling": 10}})
    rows = {(r["system"], r["ranks"]): r for r in summarize(opts, runs)}
    assert rows[("hpdl", 2)]["total_img_sec"] == 18  # median of 18, 16, 20
    assert rows[("hpdl", 2)]["efficiency_vs_1_rank"] == pytest.approx(18 / (2 * 11))
    assert rows[("hpdl", 2)]["efficiency_vs_ceiling"] == pytest.approx(18 / 20)
    assert rows[("ddp", 2)]["efficiency_vs_ceiling"] == pytest.approx(9 / 20)
    assert rows[("hpdl", 1)]["efficiency_vs_1_rank"] == 1


@pytest.mark.multirank
def test_a_small_study_writes_its_table_json_and_plot(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPDL_") or k == "HPDL_VENV"}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "hpdl", "bench", "scaling", "--model", "edsr-baseline", "--batch-size", "1", "--patch",
         "12", "--num-warmup", "1", "--num-iters", "1", "--num-batches-per-iter", "1", "--ranks", "1,2",
         "--systems", "hpdl,ddp-fp16", "--repeats", "1", "--json", str(tmp_path / "s.json"), "--plot",
         str(tmp_path / "s.png")], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "s.json").read_text())
    assert [(r["ranks"], r["job"]) for r in record["runs"]] == [(1, "default"), (1, "fp16"), (2, "default"), (2, "fp16")]
    assert {(s["system"], s["ranks"]) for s in record["summary"]} == {(s, n) for s in ("hpdl", "ddp-fp16") for n in (1, 2)}
    assert all(s["total_img_sec"] > 0 and s["efficiency_vs_ceiling"] > 0 for s in record["summary"])
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = done.stdout.splitlines()
    assert any(line.split()[:2] == ["ddp-fp16", "2"] for line in table), done.stdout


def test_repeats_alternate_the_order_of_the_rank_counts(monkeypatch):
    """So that a machine drifting during the study hits every rank count alike."""
    from hpdl.bench import scaling

    ran = []
    monkeypatch.setattr(scaling, "_run_job", lambda opts, job, ranks: ran.append((ranks, job)) or {"hpdl": 1.0})
    record = scaling.run_scaling(ScalingOptions(ranks=(1, 2, 4), systems=("hpdl-overlap",), repeats=3),
                                 log=lambda line: None)
    one_way = [(n, job) for n in (1, 2, 4) for job in ("default", "overlap")]
    other_way = [(n, job) for n in (4, 2, 1) for job in ("default", "overlap")]
    assert ran == one_way + other_way + one_way
    assert [r["repeat"] for r in record["runs"]] == [0] * 6 + [1] * 6 + [2] * 6


# --- the output files: checked before any job, never replacing a file without --overwrite ----

def _record():
    opts = ScalingOptions(ranks=(1, 2), systems=("hpdl",), repeats=1)
    runs = [{"repeat": 0, "ranks": n, "job": "default", "img_sec_per_rank": {"hpdl": 10.0, "ceiling": 11.0}}
            for n in (1, 2)]
    return {"benchmark": "scaling", "ranks": [1, 2], "systems": ["hpdl"], "repeats": 1, "hosts": None,
            "synthetic_args": [], "runs": runs, "summary": summarize(opts, runs)}


@pytest.fixture
def study(monkeypatch, tmp_path):
    """`hpdl bench scaling` in tmp_path, whose study returns a record at once (``ran`` counts them)."""
    from hpdl.bench import scaling

    ran = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HPDL_HOSTFILE", raising=False)
    monkeypatch.setattr(scaling, "run_scaling", lambda opts: ran.append(opts) or _record())
    return ran


def _scaling(*args):
    from hpdl.cli import main

    return main(["bench", "scaling", "--ranks", "1,2", "--systems", "hpdl", *args])


def _one_line_error(capsys, fragment):
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("hpdl: error: ") and fragment in err, err


@pytest.mark.parametrize("existing, args", [
    ("scaling.json", []), ("scaling.png", []), ("photo.png", ["--plot", "photo.png"]), ("r.json", ["--json", "r.json"]),
], ids=["default-json", "default-plot", "plot", "json"])
def test_existing_outputs_are_refused_before_any_job(study, tmp_path, capsys, existing, args):
    (tmp_path / existing).write_bytes(b"a user's photo")
    assert _scaling(*args) == 2
    _one_line_error(capsys, f"{existing}: already exists; pass --overwrite to replace it")
    assert study == [] and (tmp_path / existing).read_bytes() == b"a user's photo"
    assert sorted(p.name for p in tmp_path.iterdir()) == [existing]


@pytest.mark.parametrize("args, fragment", [
    (["--json", "{tmp}/d"], "--json {tmp}/d: is a directory; name a file"),
    (["--plot", "{tmp}/d"], "--plot {tmp}/d: is a directory; name a file"),
    (["--json", "{tmp}/f/s.json"], "--json {tmp}/f/s.json: {tmp}/f is a file, not a directory"),
    (["--plot", "{tmp}/f/sub/s.png"], "--plot {tmp}/f/sub/s.png: {tmp}/f is a file, not a directory"),
    (["--json", "same", "--plot", "same"], "--json and --plot name the same file, same"),
    (["--plot", "s.xyz"], "--plot s.xyz: matplotlib writes no .xyz files"),
], ids=["json-directory", "plot-directory", "json-under-a-file", "plot-under-a-file", "same-file", "unknown-format"])
def test_unusable_outputs_are_refused_before_any_job(study, tmp_path, capsys, args, fragment):
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    assert _scaling(*[a.format(tmp=tmp_path) for a in args]) == 2
    _one_line_error(capsys, fragment.format(tmp=tmp_path))
    assert study == [] and sorted(p.name for p in tmp_path.iterdir()) == ["d", "f"]


def test_overwrite_replaces_earlier_outputs_atomically(study, tmp_path, capsys):
    assert _scaling() == 0
    assert json.loads((tmp_path / "scaling.json").read_text())["summary"] == _record()["summary"]
    first = (tmp_path / "scaling.png").read_bytes()
    assert first[:8] == b"\x89PNG\r\n\x1a\n"
    assert _scaling() == 2  # a second run in the same directory
    assert capsys.readouterr().err.startswith("hpdl: error: --json scaling.json: already exists")
    assert _scaling("--overwrite", "--plot", "scaling.svg") == 0 and _scaling("--overwrite") == 0
    assert len(study) == 3
    assert (tmp_path / "scaling.svg").read_text().lstrip().startswith("<?xml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scaling.json", "scaling.png", "scaling.svg"]


# --- a study that ends early: its jobs end with it, and the runs done are kept ---------------

@pytest.mark.parametrize("timeout", ["nan", "inf", "0", "-1", "1e300"])
def test_a_timeout_no_job_can_have_is_refused_before_any_job(study, capsys, timeout):
    assert _scaling("--timeout", timeout) == 2
    _one_line_error(capsys, f"--timeout takes seconds above 0 and at most 31536000 (a year), got {float(timeout):g}")
    assert study == []


def _fake_jobs(monkeypatch, code):
    """Make every job of the study run ``python -c code`` instead of `hpdl run ...`."""
    from hpdl.bench import scaling

    monkeypatch.setattr(scaling, "job_argv", lambda opts, job, ranks: [sys.executable, "-c", code])


def test_a_timeout_beyond_what_one_wait_takes_is_honoured(monkeypatch):
    from hpdl.bench.scaling import _run_job

    _fake_jobs(monkeypatch, "print('{\"img_sec_per_rank\": 3.5}')")
    opts = ScalingOptions(ranks=(1,), systems=("hpdl",), timeout_s=30 * 24 * 3600.0)  # poll() takes ~24 days at most
    assert _run_job(opts, "default", 1) == {"hpdl": 3.5}


def test_a_job_whose_rank_was_killed_says_so(monkeypatch):
    """MPICH reports a rank killed without a word on stdout, in its banner; stderr is empty."""
    from hpdl.bench.scaling import ScalingError, _run_job

    banner = ("\n" + "=" * 20 + "\n=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n" + "=" * 20
              + "\nYOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)\n"
              "This typically refers to a problem with your application.\n")
    _fake_jobs(monkeypatch, f"import sys; print({banner!r}); sys.exit(9)")
    with pytest.raises(ScalingError, match=r"^the default job on 2 rank\(s\) failed \(exit 9\): a rank ended: "
                                           r"Killed \(signal 9\)$"):
        _run_job(ScalingOptions(), "default", 2)


def test_a_failed_job_keeps_the_runs_done_before_it(monkeypatch, tmp_path, capsys):
    from hpdl.bench import scaling

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HPDL_HOSTFILE", raising=False)

    def run_job(opts, job, ranks):
        if ranks == 2:
            raise scaling.ScalingError(f"the {job} job on 2 rank(s) failed (exit 1): RuntimeError: boom")
        return {"hpdl": 10.0, "ceiling": 11.0}

    monkeypatch.setattr(scaling, "_run_job", run_job)
    assert _scaling() == 2
    _one_line_error(capsys, "hpdl: error: repeat 1/3: the default job on 2 rank(s) failed (exit 1): RuntimeError: "
                            "boom; wrote the 1 run(s) done to scaling.json (no plot)")
    record = json.loads((tmp_path / "scaling.json").read_text())
    assert record["complete"] is False and record["failure"].endswith("RuntimeError: boom")
    assert [(r["ranks"], r["img_sec_per_rank"]["hpdl"]) for r in record["runs"]] == [(1, 10.0)]
    assert [(s["system"], s["ranks"], s["total_img_sec"]) for s in record["summary"]] == [("hpdl", 1, 10.0)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scaling.json"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_study_ends_its_running_job(tmp_path, signum):
    """SIGTERM (kill, a batch system's limit) ends the running job as Ctrl-C does, and neither
    leaves it running without its driver."""
    pid_file = tmp_path / "job.pid"
    job = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(300)"
    driver = ("import sys\nfrom hpdl.bench import scaling\nfrom hpdl.cli import main\n"
              f"scaling.job_argv = lambda opts, job, ranks: [sys.executable, '-c', {job!r}]\n"
              "sys.exit(main(['bench', 'scaling', '--ranks', '1', '--systems', 'hpdl']))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPDL_")}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=str(tmp_path), env=env, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    job_pid = None
    try:
        for _ in range(300):
            if pid_file.exists() and pid_file.read_text():
                job_pid = int(pid_file.read_text())
                break
            time.sleep(0.1)
        assert job_pid is not None, "the job did not start"
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signum, err
        assert err == f"hpdl: error: stopped by {signum.name}; no job had ended, nothing written\n"
        assert not alive(job_pid), "the job outlived its driver"
    finally:
        if proc.poll() is None:
            proc.kill()
        if job_pid is not None and alive(job_pid):
            os.kill(job_pid, signal.SIGKILL)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.pid"]
