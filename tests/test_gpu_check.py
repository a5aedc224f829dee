"""scripts/gpu-check.sh and scripts/gpu_check.py without a GPU: the one line and exit 0, the plan's
commands (read by hpdl's own command line), steps that fail or outlast their time recorded while
the next one runs, what a step leaves running ended, and the summary a run writes."""

import json
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpdl.cli import build_parser
from hpdl.launch import LauncherInfo, build_run
from hpdl.launch.cli import options_from_args
from hpdl.launch.process_tree import alive

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
gpu_check = runpy.run_path(str(SCRIPT))
plan, Check, Outcome = gpu_check["plan"], gpu_check["Check"], gpu_check["Outcome"]

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the check would run")


@NO_CUDA
def test_without_cuda_one_line_exit_zero_and_nothing_written(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh")], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0
    lines = (done.stdout + done.stderr).splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA device here (this PyTorch ") \
        and lines[0].endswith("); nothing run"), lines
    assert not (tmp_path / "out").exists() and not (ROOT / "gpu-check-out").exists()


def test_bad_arguments_are_one_line(capsys):
    for argv, message in ((["--steps", "nope"], "--steps: no step named 'nope'"),
                          (["--budget", "0"], "--budget must be in (0, 3600] seconds")):
        with pytest.raises(SystemExit) as exit_info:
            gpu_check["main"](argv, cuda_reason=lambda: None)
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"gpu-check: error: {message}" + (
            "; --list shows them" if "steps" in message else ", got 0")]


def _names(steps):
    return [s.name for s in steps]


def test_the_plan_covers_the_issue_in_budgeted_order():
    steps = plan("py", "/bin/torchrun", "/usr/bin/nvidia-cuda-mps-control", True, True, "/tmp/m", out_dir="/o")
    compares = [f"compare-{m}-{p}" for m in ("resnet50", "edsr-x2") for p in ("fp32", "bf16", "fp16")]
    assert _names(steps) == [
        "environment", "hpdl-check", *compares, "share-gpu-2", "share-gpu-4", "spatial-cuda",
        "compile-resnet50", "compile-edsr-x2",
        "mps-start", "share-gpu-2-mps", "share-gpu-4-mps", "mps-servers", "mps-stop", "gpu-tests"]
    by_name = {s.name: s for s in steps}
    assert by_name["gpu-tests"].argv[:8] == ["py", "-m", "pytest", "-v", "-rfEs", "-m", "gpu", "-p"]
    compare = by_name["compare-resnet50-bf16"].argv
    assert compare[:11] == ["py", "-m", "hpdl", "run", "-np", "1", "--ranks-per-gpu", "1", "--backend", "nccl",
                            "--launcher"]
    assert compare[compare.index("--compare") + 1] == "plain,ddp" and compare[compare.index("--amp") + 1] == "bf16"
    assert compare[compare.index("--batch-size") + 1] == "256"
    spatial = by_name["spatial-cuda"].argv
    assert spatial[spatial.index("--device") + 1] == "cuda" and spatial[-2:] == ["--json", "/o/spatial-cuda.json"]
    assert "--compile" in by_name["compile-edsr-x2"].argv
    mps = by_name["share-gpu-2-mps"]
    assert mps.env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/m/pipe" == by_name["mps-start"].env["CUDA_MPS_PIPE_DIRECTORY"]
    assert "CUDA_MPS_PIPE_DIRECTORY" not in by_name["share-gpu-2"].env  # the runs without MPS come first
    assert by_name["mps-stop"].stdin == "quit\n" and by_name["mps-start"].argv[1:] == ["-d"]
    # the caps of a full run fit the budget only as it is spent: the deadline cuts what is left
    assert sum(s.cap_s for s in steps) > gpu_check["BUDGET_S"] < 480


def test_what_this_machine_lacks_is_skipped_with_the_reason():
    steps = plan("py", None, None, False, False, "/tmp/m")
    by_name = {s.name: s for s in steps}
    assert by_name["gpu-tests"].cannot == "pytest is not installed here (pip install pytest)"
    assert by_name["mps"].cannot.startswith("nvidia-cuda-mps-control is not installed here")
    assert not any(name.endswith("-mps") for name in by_name)
    # no torchrun on PATH: torch's launcher module, told the ranks per GPU and backend through the environment
    ranks = by_name["share-gpu-4"]
    assert ranks.argv[:6] == ["py", "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone"]
    assert ranks.env == {"HPDL_RANKS_PER_GPU": "4"}
    assert by_name["compare-edsr-x2-fp16"].env == {"HPDL_RANKS_PER_GPU": "1", "HPDL_BACKEND": "nccl"}


def test_every_hpdl_command_of_the_plan_is_one_hpdl_accepts(monkeypatch):
    steps = plan(sys.executable, "/bin/torchrun", None, True, True, "/tmp/m")
    parser = build_parser()
    seen = set()
    for step in steps:
        if step.argv[1:3] != ["-m", "hpdl"]:
            continue
        args = parser.parse_args(step.argv[3:])  # a misspelt flag would exit here
        if step.argv[3] == "run":  # and hpdl run turns it into torchrun with the ranks per GPU
            commands, env = build_run(options_from_args(args), {}, LauncherInfo(torchrun="/bin/torchrun"))
            ranks = step.meta["ranks"]
            assert commands[0][:3] == ["/bin/torchrun", "--nproc-per-node", str(ranks)]
            assert env["HPDL_RANKS_PER_GPU"] == str(ranks)
            bench = parser.parse_args(args.command[4:] if args.command[0] == "--" else args.command[3:])
            assert bench.device == "cuda" and bench.repeats == 3
            seen.add((bench.model, bench.batch_size, bench.compare))
        elif hasattr(args, "model"):
            seen.add((args.model, getattr(args, "compile", None)))
    assert {("resnet50", 256, "plain,ddp"), ("edsr", 16, "plain,ddp"), ("edsr-baseline", 16, "ddp"),
            ("edsr-baseline", None), ("resnet50", True), ("edsr", True)} <= seen


def test_steps_are_chosen_by_name_with_the_mps_daemon_around_mps_runs():
    steps = plan("py", "/bin/torchrun", "/usr/bin/nvidia-cuda-mps-control", True, True, "/tmp/m")
    select = gpu_check["select_steps"]
    assert _names(select(steps, ["gpu-tests", "compare-resnet50"])) == [
        "compare-resnet50-fp32", "compare-resnet50-bf16", "compare-resnet50-fp16", "gpu-tests"]
    assert _names(select(steps, ["share-gpu-4-mps"])) == [
        "mps-start", "share-gpu-4-mps", "mps-servers", "mps-stop"]
    with pytest.raises(ValueError, match="no step named 'resnet'"):
        select(steps, ["resnet"])


# -- running steps ---------------------------------------------------------------------------------

def test_a_command_past_its_time_is_ended_with_what_it_started(tmp_path):
    pid_file = tmp_path / "child"
    script = f"sleep 300 & echo $! > {pid_file}; echo started; wait"
    outcome = gpu_check["run_command"](["bash", "-c", script], 2, dict(os.environ), lambda line: None)
    assert outcome.status == "timed out" and outcome.reason == "ended after 2 s" and "started" in outcome.output
    child = int(pid_file.read_text())
    time.sleep(0.2)
    assert not alive(child)


def test_a_failing_command_is_recorded_with_its_error_line():
    logged = []
    code = "import sys; print('working'); print('hpdl: error: --device: cuda requested', file=sys.stderr); sys.exit(2)"
    outcome = gpu_check["run_command"]([sys.executable, "-c", code], 60, dict(os.environ), logged.append)
    assert (outcome.status, outcome.returncode) == ("failed", 2)
    assert outcome.reason == "hpdl: error: --device: cuda requested" and "working\n" in logged
    missing = gpu_check["run_command"](["/nonexistent/tool"], 5, dict(os.environ), logged.append)
    assert missing.status == "failed" and missing.reason.startswith("cannot start /nonexistent/tool")


def test_what_a_step_leaves_running_in_a_session_of_its_own_is_ended():
    mark = f"GPU_CHECK_STEP={os.getpid()}.test"
    proc = subprocess.Popen(["sleep", "300"], env={**os.environ, "GPU_CHECK_STEP": mark.split("=", 1)[1]},
                            start_new_session=True)
    try:
        # Until the child has exec'd, /proc shows the parent's environment, without the mark.
        deadline = time.monotonic() + 30
        while mark.encode() not in _environ(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gpu_check["end_leftovers"](mark) == [proc.pid]
        assert proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()


def _environ(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


# -- reading outputs -------------------------------------------------------------------------------

def test_the_json_record_is_found_among_other_lines():
    output = 'Model: resnet50\nwarning: {not json}\n{\n "benchmark": "synthetic",\n "total_img_sec": 812.5\n}\nbye\n'
    assert gpu_check["json_record"](output) == {"benchmark": "synthetic", "total_img_sec": 812.5}
    assert gpu_check["json_record"]("no record\n") is None


PYTEST_OUTPUT = """\
tests/test_gpu.py::test_engine_collectives_on_cuda_tensors[nccl-1] PASSED      [  7%]
tests/test_gpu.py::test_engine_collectives_on_cuda_tensors[gloo-2-on-one-gpu] FAILED [ 15%]
tests/test_spatial.py::test_halo_on_cuda SKIPPED (no spatial layers yet)   [ 23%]
=========================== short test summary info ============================
SKIPPED [1] tests/test_spatial.py:12: no spatial layers yet
FAILED tests/test_gpu.py::test_engine_collectives_on_cuda_tensors[gloo-2-on-one-gpu] - Failed: gpu_engine.py exited 1
"""


def test_the_gpu_tests_run_side_by_side_where_xdist_and_the_cores_are():
    workers = gpu_check["gpu_test_workers"]
    assert [workers(True, cores) for cores in (2, 8, 16, 64)] == [1, 2, 4, 4] and workers(False, 16) == 1
    side_by_side = plan("py", None, None, True, True, "/tmp/m", test_workers=4)[-1]
    assert side_by_side.argv[-5:] == ["-n", "4", "--dist", "load", "tests"]
    assert "-n" not in plan("py", None, None, True, True, "/tmp/m", test_workers=1)[-1].argv


def test_pytest_xdist_results_are_read_per_test():
    output = ("[gw1] [ 50%] PASSED tests/test_gpu.py::test_sync_batch_norm_on_cuda[nccl-1] \n"
              "[gw0] [100%] FAILED tests/test_spatial.py::test_spatial_parallel_on_cuda_equals_one_process[nccl-1] \n")
    assert gpu_check["read_test_results"](output)["results"] == {
        "tests/test_gpu.py::test_sync_batch_norm_on_cuda[nccl-1]": "PASSED",
        "tests/test_spatial.py::test_spatial_parallel_on_cuda_equals_one_process[nccl-1]": "FAILED"}


def test_pytest_results_are_read_per_test_wherever_the_tests_are():
    results = gpu_check["read_test_results"](PYTEST_OUTPUT)
    assert results["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert results["results"]["tests/test_spatial.py::test_halo_on_cuda"] == "SKIPPED"
    assert results["failures"] == {"tests/test_gpu.py::test_engine_collectives_on_cuda_tensors[gloo-2-on-one-gpu]":
                                   "Failed: gpu_engine.py exited 1"}
    assert results["skip_reasons"] == ["no spatial layers yet"]


# -- a whole run, on this machine --------------------------------------------------------------------

def test_a_run_records_each_step_and_goes_on_after_a_failure(tmp_path, capsys):
    # Run here as if CUDA were present: the environment probe and `hpdl check` pass, the tests
    # run (and skip here), the benchmark on cuda fails and the run goes on to the next, which fails too.
    steps = "environment,hpdl-check,compare-resnet50-fp32,share-gpu-2,gpu-tests"
    code = gpu_check["main"](["--steps", steps, "--out", str(tmp_path), "--budget", "400"], cuda_reason=lambda: None)
    assert code == 1
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    assert summary["schema"] == "hpdl.gpu-check/2" and summary["finished"] and summary["ok"] is False
    status = {s["name"]: s["status"] for s in summary["steps"]}
    assert status == {"environment": "passed", "hpdl-check": "passed", "gpu-tests": status["gpu-tests"],
                      "compare-resnet50-fp32": "failed", "share-gpu-2": "failed"}
    assert summary["environment"]["torch"] == torch.__version__
    failed = next(s for s in summary["steps"] if s["name"] == "compare-resnet50-fp32")
    assert "--device" in failed["reason"] or "nccl" in failed["reason"], failed["reason"]
    if not torch.cuda.is_available():  # every test marked gpu skipped, saying why: none passed, a failure
        assert status["gpu-tests"] == "failed" and set(summary["tests"]["counts"]) == {"skipped"}
        tests = next(s for s in summary["steps"] if s["name"] == "gpu-tests")
        assert tests["reason"].startswith("no test marked gpu passed (needs a CUDA device: ")
    log = (tmp_path / "gpu-check.log").read_text()
    assert "=== hpdl-check: " in log and "Available backends:" in log and "--- gpu-tests: " in log
    out = capsys.readouterr().out
    assert "gpu-check: [3/5] compare-resnet50-fp32 failed" in out and "gpu-check: [4/5] share-gpu-2 failed" in out


def test_steps_past_the_budget_are_skipped_saying_so(tmp_path):
    environment, hpdl_check = plan(sys.executable, None, None, True, False, "/tmp/m")[:2]
    check = Check([environment, hpdl_check], tmp_path, budget_s=60, env=dict(os.environ), echo=lambda line: None)
    assert check._run_step(environment).status == "passed"
    check.deadline = time.monotonic() + 5  # as if the first step had taken all but 5 s
    skipped = check._run_step(hpdl_check)
    assert skipped.status == "skipped" and skipped.reason.startswith("out of time: ")
    assert skipped.reason.endswith("s of the 60 s budget left")


def test_benchmark_figures_reach_the_summary_with_the_ratios(tmp_path):
    # The plan's kinds of benchmark step, run here on the CPU: a compare at 1 rank, ranks side by
    # side against DDP, a compiled run (its ratio to the compare's eager hpdl) and a spatial study.
    Step = gpu_check["Step"]
    tiny = ["--model", "edsr-baseline", "--batch-size", "1", "--patch", "8", "--device", "cpu"]
    short = ["--num-warmup", "1", "--num-iters", "1", "--num-batches-per-iter", "1", "--json"]
    hpdl = [sys.executable, "-m", "hpdl"]
    compare = ["bench", "synthetic", *tiny, "--compare", "plain,ddp", "--repeats", "3", *short]
    shared = ["bench", "synthetic", *tiny, "--compare", "ddp", "--repeats", "3", *short]
    spatial_json = str(tmp_path / "spatial.json")
    steps = [Step("compare-edsr-baseline-fp32", hpdl + ["run", "-np", "1", "--launcher", "torchrun", "--", *hpdl,
                                                        *compare], 180, kind="compare",
                  meta={"figure": "edsr-baseline-fp32", "ranks": 1}),
             Step("share-gpu-2", hpdl + ["run", "-np", "2", "--launcher", "torchrun", "--", *hpdl, *shared], 180,
                  kind="compare", meta={"ranks": 2, "mps": False}),
             Step("compile-edsr-baseline", hpdl + ["bench", "synthetic", *tiny, *short], 120, kind="bench",
                  meta={"compiled": "edsr-baseline"}),
             Step("spatial-cuda", hpdl + ["bench", "spatial", "--image", "16", "--ranks", "1,2", "--rounds", "1",
                                          "--warmup", "0", "--json", spatial_json], 180, kind="spatial",
                  meta={"json": spatial_json})]
    lines = []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    assert Check(steps, tmp_path, budget_s=600, env=env, echo=lines.append).run() == 0
    figures = json.loads((tmp_path / "gpu-check.json").read_text())["figures"]
    one = figures["compare"]["edsr-baseline-fp32"]
    assert one["ranks"] == 1 and one["ddp_backend"] == "gloo" and sorted(one["median"]) == ["ddp", "hpdl", "plain"]
    assert one["ratio"]["plain"] == pytest.approx(one["median"]["hpdl"] / one["median"]["plain"])
    shared_two = figures["share_gpu"]["without MPS"]["2"]
    assert shared_two["ranks"] == 2 and len(shared_two["runs"]["ddp"]) == 3
    assert figures["compiled_vs_eager"]["edsr-baseline"] == round(
        figures["compile"]["edsr-baseline"]["img_sec_per_rank"] / one["median"]["hpdl"], 3)
    spatial = figures["spatial"]
    assert spatial["device"] == "cpu" and [p["ranks"] for p in spatial["points"]] == [1, 2]
    assert all(p["status"] == "ok" and p["memory"] > 0 for p in spatial["points"])
    assert any(line.startswith("gpu-check: edsr-baseline-fp32: hpdl ") and "hpdl/plain" in line for line in lines)
    assert any(line.startswith("gpu-check: EDSR-baseline ranks sharing the GPU without MPS: 2 ranks: hpdl ")
               for line in lines)
    assert any(line.startswith("gpu-check: spatial on the GPU: 1 ranks ") for line in lines)


def test_the_mps_daemon_is_started_before_the_mps_runs_and_stopped_after(tmp_path):
    # A stand-in for nvidia-cuda-mps-control that logs how it was called (the real one needs a GPU).
    calls = tmp_path / "calls"
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text("#!/bin/sh\n"
                       f'echo "$* stdin=$(cat) pipe=$CUDA_MPS_PIPE_DIRECTORY" >> {calls}\n'
                       'echo "[t] Starting new server 4321 for user 0" >> "$CUDA_MPS_LOG_DIRECTORY/control.log"\n'
                       "echo 4321\n")
    control.chmod(0o755)
    mps_dir = tmp_path / "mps"
    (mps_dir / "log").mkdir(parents=True)
    steps = gpu_check["select_steps"](plan(sys.executable, None, str(control), True, False, str(mps_dir)),
                                      ["share-gpu-2-mps"])
    assert [s.name for s in steps] == ["mps-start", "share-gpu-2-mps", "mps-servers", "mps-stop"]
    run = steps[1]
    run.argv, run.kind = [sys.executable, "-c", "import os; print(os.environ['CUDA_MPS_PIPE_DIRECTORY'])"], "command"
    check = Check(steps, tmp_path / "out", budget_s=120, env=dict(os.environ), echo=lambda line: None)
    assert check.run() == 0
    pipe = str(mps_dir / "pipe")
    assert calls.read_text().splitlines() == [f"-d stdin= pipe={pipe}", f" stdin=get_server_list pipe={pipe}",
                                              f" stdin=quit pipe={pipe}"]
    assert pipe in check.outcomes["share-gpu-2-mps"].output  # the ranks reach the daemon's folders
    mps = json.loads((tmp_path / "out" / "gpu-check.json").read_text())["figures"]["mps"]
    # read when the servers are listed, before the stop: the start and the listing logged a line each
    assert mps == {"servers": ["4321"], "control_log": ["[t] Starting new server 4321 for user 0"] * 2}
