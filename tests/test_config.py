"""Settings come from HPDL_* variables and arguments, once; unknown names are rejected."""

import pytest

from hpdl.config import Settings, SettingsError


def test_defaults_match_horovod():
    s = Settings.from_env({})
    assert s.cycle_time_ms == 1.0 and s.fusion_threshold == 64 * 1024 * 1024 and s.cache_capacity == 1024
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
    ({"HPDL_BACKEND": "carrier-pigeon"}, "backend"),
    ({"HPDL_CACHE_CAPACITY": "-1"}, "HPDL_CACHE_CAPACITY"),
    ({"HPDL_HIERARCHICAL_ALLREDUCE": "maybe"}, "HPDL_HIERARCHICAL_ALLREDUCE"),
])
def test_bad_values_name_the_variable(env, match):
    with pytest.raises(SettingsError, match=match):
        Settings.from_env(env)


def test_unknown_override_is_rejected():
    with pytest.raises(SettingsError, match="fusion"):
        Settings.from_env({}, fusion=1)
