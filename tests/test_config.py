"""Settings come from HPDL_* variables and arguments, once; unknown names are rejected."""

import os
import subprocess
import sys

import pytest

from hpdl.config import Settings, SettingsError


def test_defaults_match_horovod():
    s = Settings.from_env({})
    assert s.cycle_time_ms == 1.0 and s.fusion_threshold == 128 * 1024 * 1024 and s.cache_capacity == 1024
    assert s.stall_warning_s == 60 and s.stall_timeout_s == 1800


def test_environment_then_overrides():
    s = Settings.from_env({"HPDL_CYCLE_TIME": "5", "HPDL_CACHE_CAPACITY": "0", "HPDL_HIERARCHICAL_ALLREDUCE": "1"},
                          cache_capacity=7, backend=None)
    assert s.cycle_time_ms == 5.0 and s.cache_capacity == 7 and s.hierarchical_allreduce is True
    assert s.backend == "auto"


def test_unknown_variable_is_rejected_by_name():
    with pytest.raises(SettingsError, match="HPDL_FUSION_TRESHOLD"):
        Settings.from_env({"HPDL_FUSION_TRESHOLD": "1"})


@pytest.mark.parametrize("env,match", [
    ({"HPDL_CYCLE_TIME": "fast"}, "HPDL_CYCLE_TIME"),
    ({"HPDL_BACKEND": "carrier-pigeon"}, "HPDL_BACKEND must be one of auto, mpi, gloo, nccl, torch, got "),
    ({"HPDL_CACHE_CAPACITY": "-1"}, "HPDL_CACHE_CAPACITY"),
    ({"HPDL_INPLACE_THRESHOLD": "-1"}, "HPDL_INPLACE_THRESHOLD"),
    ({"HPDL_HIERARCHICAL_ALLREDUCE": "maybe"}, "HPDL_HIERARCHICAL_ALLREDUCE"),
    ({"HPDL_ENGINE_NICE": "20"}, "HPDL_ENGINE_NICE"),
    ({"HPDL_ENGINE_NICE": "low"}, "HPDL_ENGINE_NICE"),
    ({"HPDL_RANKS_PER_GPU": "0"}, "HPDL_RANKS_PER_GPU must be >= 1"),
    ({"HPDL_RANKS_PER_GPU": "two"}, "HPDL_RANKS_PER_GPU"),
])
def test_bad_values_name_the_variable(env, match):
    with pytest.raises(SettingsError, match=match):
        Settings.from_env(env)


def test_a_bad_argument_is_named_as_the_argument_and_a_bad_variable_as_the_variable():
    with pytest.raises(SettingsError, match="^backend must be one of auto, mpi, gloo, nccl, torch, got 'x'$"):
        Settings.from_env({}, backend="x")
    with pytest.raises(SettingsError, match="^HPDL_BACKEND must be one of auto, mpi, gloo, nccl, torch, got 'x'$"):
        Settings.from_env({"HPDL_BACKEND": "x"})
    with pytest.raises(SettingsError, match="^HPDL_MPI_CUDA_AWARE must be one of auto, 0, 1, got '2'$"):
        Settings.from_env({"HPDL_MPI_CUDA_AWARE": "2"})
    with pytest.raises(SettingsError, match="^HPDL_ENGINE_NICE must be auto or an integer from 0 to 19, got 'low'$"):
        Settings.from_env({"HPDL_ENGINE_NICE": "low"})
    with pytest.raises(SettingsError, match="^HPDL_ENGINE_NICE must be at most 19, got 20$"):
        Settings.from_env({"HPDL_ENGINE_NICE": "20"})
    assert Settings.from_env({"HPDL_ENGINE_NICE": "19"}).engine_nice == "19"


def test_unknown_override_is_rejected():
    with pytest.raises(SettingsError, match="fusion"):
        Settings.from_env({}, fusion=1)


def test_engine_nice_lowers_priority_only_where_cpu_ranks_fill_the_cores():
    auto = Settings.from_env({})
    assert auto.resolve_engine_nice(local_size=2, threads_per_rank=1, cpus=2, cuda=False) == 19
    assert auto.resolve_engine_nice(local_size=1, threads_per_rank=1, cpus=8, cuda=False) == 0
    assert auto.resolve_engine_nice(local_size=8, threads_per_rank=4, cpus=8, cuda=True) == 0
    fixed = Settings.from_env({"HPDL_ENGINE_NICE": "5"})
    assert fixed.resolve_engine_nice(local_size=1, threads_per_rank=1, cpus=8, cuda=True) == 5


def test_engine_thread_runs_at_the_configured_nice():
    script = (
        "import os, hpdl.torch as hvd\n"
        "from hpdl.torch import runtime\n"
        "hvd.init()\n"
        "tid = runtime.engine()._thread.native_id\n"
        "print(os.getpriority(os.PRIO_PROCESS, tid) - os.getpriority(os.PRIO_PROCESS, 0))\n"
        "hvd.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "HYDRA_", "MPI_"))}
    env["HPDL_ENGINE_NICE"] = "7"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "7"


def test_non_finite_numbers_are_rejected_from_variables_and_arguments():
    for text in ("inf", "-inf", "nan", "1e999"):
        with pytest.raises(SettingsError, match="finite"):
            Settings.from_env({"HPDL_CYCLE_TIME": text})
        with pytest.raises(SettingsError, match="finite"):
            Settings.from_env({"HPDL_CACHE_CAPACITY": text})
    with pytest.raises(SettingsError, match="HPDL_STALL_TIMEOUT must be a finite number"):
        Settings(stall_timeout_s=float("inf"))


@pytest.mark.parametrize("name,text", [
    ("HPDL_FUSION_THRESHOLD", "1e300"), ("HPDL_INPLACE_THRESHOLD", "2e12"), ("HPDL_PRIORITY_WINDOW", "1e15"),
    ("HPDL_GATHER_BYTES", "1e300"), ("HPDL_CACHE_CAPACITY", "3e9"), ("HPDL_CYCLE_TIME", "1e300"),
    ("HPDL_GATHER_TIME", "1e12"), ("HPDL_STALL_WARNING", "1e300"), ("HPDL_STALL_TIMEOUT", "1e10"),
    ("HPDL_START_TIMEOUT", "1e300"),
])
def test_values_no_job_can_mean_are_rejected_naming_the_variable(name, text):
    # Finite, so they parse; but 1e300 bytes of fusion buffer or a timeout past what Python's
    # timers take would fail later, inside the engine, instead of here.
    with pytest.raises(SettingsError, match=f"{name} must be at most"):
        Settings.from_env({name: text})
    Settings.from_env({"HPDL_FUSION_THRESHOLD": str(1 << 40), "HPDL_STALL_TIMEOUT": str(365 * 24 * 3600)})


def test_a_misspelt_variable_is_answered_with_the_name_it_resembles():
    with pytest.raises(SettingsError, match=r"HPDL_FUSION_TRESHOLD \(did you mean HPDL_FUSION_THRESHOLD\?\)"):
        Settings.from_env({"HPDL_FUSION_TRESHOLD": "1"})


# -- Horovod's variable names ------------------------------------------------------------------

@pytest.mark.parametrize("horovod,text,field,value", [
    ("HOROVOD_FUSION_THRESHOLD", "1048576", "fusion_threshold", 1048576),
    ("HOROVOD_CYCLE_TIME", "3.5", "cycle_time_ms", 3.5),
    ("HOROVOD_CACHE_CAPACITY", "0", "cache_capacity", 0),
    ("HOROVOD_TIMELINE", "/tmp/t.json", "timeline", "/tmp/t.json"),
    ("HOROVOD_TIMELINE_MARK_CYCLES", "1", "timeline_mark_cycles", True),
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1", "hierarchical_allreduce", True),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "30", "stall_warning_s", 30.0),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "90", "stall_timeout_s", 90.0),
    ("HOROVOD_START_TIMEOUT", "30", "start_timeout_s", 30.0),
])
def test_horovod_names_are_aliases_and_hpdl_names_win(horovod, text, field, value):
    from hpdl.config import HOROVOD_ALIASES

    assert getattr(Settings.from_env({horovod: text}), field) == value
    hpdl_text = "2" if isinstance(value, (int, float)) and not isinstance(value, bool) else "0"
    if field == "timeline":
        hpdl_text = "/tmp/hpdl.json"
    both = Settings.from_env({horovod: text, HOROVOD_ALIASES[horovod]: hpdl_text})
    assert getattr(both, field) == getattr(Settings.from_env({HOROVOD_ALIASES[horovod]: hpdl_text}), field) != value


def test_horovod_stall_switches():
    assert Settings.from_env({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0"}).stall_timeout_s == 1800  # Horovod: never
    off = Settings.from_env({"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120"})
    assert off.stall_warning_s == off.stall_timeout_s == 120  # no warning before the timeout ends the job
    assert Settings.from_env({"HOROVOD_STALL_CHECK_DISABLE": "0"}).stall_warning_s == 60
    kept = Settings.from_env({"HOROVOD_STALL_CHECK_DISABLE": "1", "HPDL_STALL_WARNING": "5"})
    assert kept.stall_warning_s == 5


def test_horovod_stall_check_disable_beats_horovods_warning_time():
    # As in Horovod: the check is off whatever HOROVOD_STALL_CHECK_TIME_SECONDS says.
    off = Settings.from_env({"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "20"})
    assert off.stall_warning_s == off.stall_timeout_s == 1800
    off = Settings.from_env({"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "20",
                             "HPDL_STALL_TIMEOUT": "300"})
    assert off.stall_warning_s == 300
    on = Settings.from_env({"HOROVOD_STALL_CHECK_DISABLE": "0", "HOROVOD_STALL_CHECK_TIME_SECONDS": "20"})
    assert on.stall_warning_s == 20


def test_horovod_dynamic_timeline_opens_no_file():
    # Horovod's HOROVOD_TIMELINE=DYNAMIC: no timeline until hvd.start_timeline().
    assert Settings.from_env({"HOROVOD_TIMELINE": "DYNAMIC"}).timeline == ""


def test_bad_horovod_value_names_the_horovod_variable():
    with pytest.raises(SettingsError, match="HOROVOD_CYCLE_TIME='fast'"):
        Settings.from_env({"HOROVOD_CYCLE_TIME": "fast"})
    with pytest.raises(SettingsError, match="HOROVOD_STALL_CHECK_DISABLE"):
        Settings.from_env({"HOROVOD_STALL_CHECK_DISABLE": "perhaps"})


def test_other_horovod_variables_are_listed_as_ignored():
    from hpdl.config import horovod_variables_ignored

    env = {"HOROVOD_HIERARCHICAL_ALLGATHER": "1", "HOROVOD_CYCLE_TIME": "2", "HOROVOD_STALL_CHECK_DISABLE": "1",
           "HOROVOD_X": ""}
    assert horovod_variables_ignored(env) == ["HOROVOD_HIERARCHICAL_ALLGATHER", "HOROVOD_X"]
