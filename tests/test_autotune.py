"""Autotuning: the Bayesian optimisation, rank 0's tuner (samples, warm-up, the log, fixed
knobs), the word that carries its choice to every rank, the settings, and whole jobs that tune
while checking every result."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from hpdl.config import Settings, SettingsError, settings_given
from hpdl.engine import autotune
from hpdl.engine.autotune import MIB, START_POINTS, SUB_SAMPLES, Autotuner, decode, encode
from hpdl.engine.bayes_opt import BayesianOptimization
from hpdl.engine.negotiation import TUNING_NONE
from ranks import run_ranks


# --- the optimisation -------------------------------------------------------------------------

def test_bayesian_optimisation_finds_the_peak_of_a_noisy_score():
    peak = np.array([20.0, 30.0])

    def score(x):
        return 100.0 - 300.0 * (((np.asarray(x) - peak) / [64.0, 100.0]) ** 2).sum()

    rng = np.random.default_rng(0)
    bo = BayesianOptimization([(0, 64), (1, 100)], alpha=0.8, seed=1)
    for start in START_POINTS:
        bo.add_sample(start, score(start) + rng.normal())
    for _ in range(12):
        x = bo.next_sample()
        assert 0 <= x[0] <= 64 and 1 <= x[1] <= 100
        bo.add_sample(x, score(x) + rng.normal())
    best = bo.xs[int(np.argmax(bo.ys))]
    # The best start point is 8 MiB away and 20 ms away; the proposals close in on the peak.
    assert abs(best[0] - 20) < 6 and abs(best[1] - 30) < 12, best


# --- the word every round carries -------------------------------------------------------------

@pytest.mark.parametrize("fusion, cycle", [(0, 1.0), (4 * MIB, 5.0), (64 * MIB, 100.0), (None, 2.5), (MIB, None),
                                           (None, None)])
def test_the_round_word_carries_the_parameters(fusion, cycle):
    assert decode(encode(fusion, cycle)) == (fusion, cycle)


def test_a_round_without_a_tuner_on_rank_0_changes_nothing():
    assert decode(autotune.NO_PARAMETERS) is None
    assert decode(TUNING_NONE) is None  # what every other rank sends: AND leaves rank 0's word


# --- rank 0's tuner ---------------------------------------------------------------------------

class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _run_samples(tuner, clock, samples, steps, score_of, names=("a", "b")):
    """Feed ``samples`` samples of training steps; each step's bytes take the time ``score_of``
    says for the parameters in effect (bytes per microsecond)."""
    for _ in range(samples):
        for _ in range(SUB_SAMPLES * steps + 1):
            params = tuner.parameters()
            nbytes = 1_000_000
            clock.now += nbytes / score_of(params) / 1e6
            tuner.observe(list(names), nbytes)


def test_tuner_warms_up_tries_horovods_start_points_then_keeps_the_best(tmp_path):
    clock = _Clock()
    log = tmp_path / "sub" / "autotune.csv"
    tuner = Autotuner(128 * MIB, 1.0, warmup_samples=2, steps_per_sample=3, max_samples=6, log_path=str(log),
                      clock=clock)
    # The first parameters are Horovod's first start point, not the defaults.
    assert tuner.parameters() == {"fusion_threshold": 4.0, "cycle_time_ms": 5.0}
    assert decode(tuner.word()) == (4 * MIB, 5.0)

    def score_of(params):  # best near 20 MiB and 10 ms
        return 200.0 - abs(params["fusion_threshold"] - 20) - abs(params["cycle_time_ms"] - 10)

    _run_samples(tuner, clock, 2, 3, score_of)
    assert tuner.samples == [] and tuner.warmup_remaining == 0 and tuner.active  # warm-up discarded
    _run_samples(tuner, clock, 4, 3, score_of)
    tried = [(p["fusion_threshold"], p["cycle_time_ms"]) for p, _ in tuner.samples]
    assert tried == list(START_POINTS)
    for (params, score) in tuner.samples:  # each sample's score is its bytes over its time
        assert score == pytest.approx(score_of(params), rel=1e-6)
    _run_samples(tuner, clock, 3, 3, score_of)
    assert not tuner.active and len(tuner.samples) == 7  # max_samples + 1, the start points included
    best_params, best_score = max(tuner.samples, key=lambda s: s[1])
    assert tuner.parameters() == best_params and decode(tuner.word())[1] == best_params["cycle_time_ms"]
    _run_samples(tuner, clock, 1, 3, score_of)  # done: nothing changes any more
    assert len(tuner.samples) == 7

    rows = list(csv.DictReader(log.open()))
    assert list(rows[0]) == autotune.CSV_HEADER.split(",")
    assert len(rows) == 8  # each tuned sample, then the best
    assert [(float(r["tensor_fusion_threshold"]), float(r["cycle_time_ms"])) for r in rows[:4]] == list(START_POINTS)
    assert float(rows[-1]["score"]) == pytest.approx(best_score, rel=1e-5)
    assert float(rows[-1]["tensor_fusion_threshold"]) == best_params["fusion_threshold"]
    assert rows[0]["hierarchical_allreduce"] == "0" and rows[0]["cache_enabled"] == "1"


def test_a_sample_is_scored_by_the_median_of_its_sub_samples():
    clock = _Clock()
    tuner = Autotuner(128 * MIB, 1.0, warmup_samples=0, steps_per_sample=1, max_samples=5, clock=clock)
    # A step of 1 MB a second, one of them 100 times slower (a checkpoint, say); a sub-sample
    # per step, each from the end of the one before.
    for seconds in (0.5, 0.5, 1.0, 1.0, 100.0, 1.0):
        clock.now += seconds
        tuner.observe(["a"], 1_000_000)
    assert len(tuner.samples) == 1
    assert tuner.samples[0][1] == pytest.approx(1.0)  # 1 MB per second: 1 byte per microsecond


@pytest.mark.parametrize("max_samples, proposals", [(20, 17), (4, 1), (3, 0), (1, 0)])
def test_max_samples_counts_the_start_points_as_horovods(max_samples, proposals):
    # Horovod's IsDoneTuning: iteration > max_samples, the iteration counting every sample tuned.
    clock = _Clock()
    tuner = Autotuner(128 * MIB, 1.0, warmup_samples=0, steps_per_sample=1, max_samples=max_samples, clock=clock)
    _run_samples(tuner, clock, max_samples + 3, 1, lambda params: 200.0 - params["cycle_time_ms"])
    tried = [(p["fusion_threshold"], p["cycle_time_ms"]) for p, _ in tuner.samples]
    starts = min(len(START_POINTS), max_samples + 1)
    assert not tuner.active and len(tried) == max_samples + 1
    assert tried[:starts] == list(START_POINTS[:starts]) and len(tried) - starts == proposals


def test_the_docs_say_what_max_samples_counts(capsys):
    from pathlib import Path

    from hpdl.cli import main

    root = Path(__file__).resolve().parents[1]
    api = " ".join((root / "docs" / "api.md").read_text().split())
    assert "Tuning ends after `HPDL_AUTOTUNE_BAYES_OPT_MAX_SAMPLES` + 1 samples, the start points included" in api
    assert "the default 20 tries the 4 start points and 17 proposals, and 3 or fewer tries start points only" in api
    readme = (root / "README.md").read_text()
    assert "tuning ends after this many samples plus one, Horovod's 4 start points included (20: 4 start " \
           "points and 17 proposals)" in readme
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "tuning ends after N + 1 samples, Horovod's 4 start points included" in help_text, help_text


def test_knobs_the_user_set_stay_fixed(tmp_path):
    clock = _Clock()
    log = tmp_path / "at.csv"
    tuner = Autotuner(2 * MIB, 1.0, fixed=["fusion_threshold"], warmup_samples=0, steps_per_sample=2,
                      max_samples=5, log_path=str(log), clock=clock)
    assert decode(tuner.word()) == (None, 5.0)  # the fusion threshold is left as it is on every rank
    _run_samples(tuner, clock, 7, 2, lambda p: 100.0 / p["cycle_time_ms"])
    assert not tuner.active
    assert {p["fusion_threshold"] for p, _ in tuner.samples} == {2.0}
    assert len({p["cycle_time_ms"] for p, _ in tuner.samples}) > 3
    assert {r["tensor_fusion_threshold"] for r in csv.DictReader(log.open())} == {"2"}
    nothing = Autotuner(2 * MIB, 3.0, fixed=["fusion_threshold", "cycle_time_ms"])
    assert not nothing.active and nothing.word() == autotune.NO_PARAMETERS


def test_an_unwritable_log_is_one_error_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"cannot write the autotune log .*file/at.csv \(HPDL_AUTOTUNE_LOG\)"):
        Autotuner(MIB, 1.0, log_path=str(blocker / "at.csv"))


# --- settings ---------------------------------------------------------------------------------

def test_horovods_autotune_variables_are_read():
    env = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "/tmp/x.csv", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "0",
           "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "4", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "7",
           "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.3", "HOROVOD_CYCLE_TIME": "2"}
    s = Settings.from_env(env)
    assert (s.autotune, s.autotune_log, s.autotune_warmup_samples, s.autotune_steps_per_sample,
            s.autotune_bayes_opt_max_samples, s.autotune_gaussian_process_noise) == (True, "/tmp/x.csv", 0, 4, 7, 0.3)
    assert "cycle_time_ms" in settings_given(env) and "fusion_threshold" not in settings_given(env)


@pytest.mark.parametrize("var, value", [("HPDL_AUTOTUNE_STEPS_PER_SAMPLE", "0"),
                                        ("HPDL_AUTOTUNE_WARMUP_SAMPLES", "-1"),
                                        ("HPDL_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "1.5"),
                                        ("HPDL_AUTOTUNE", "maybe")])
def test_bad_autotune_settings_name_the_variable(var, value):
    with pytest.raises(SettingsError, match=var):
        Settings.from_env({var: value})


# --- whole jobs -------------------------------------------------------------------------------

def _job_env(log, **extra):
    env = {"HPDL_AUTOTUNE": "1", "HPDL_AUTOTUNE_LOG": str(log), "HPDL_AUTOTUNE_WARMUP_SAMPLES": "1",
           "HPDL_AUTOTUNE_STEPS_PER_SAMPLE": "1", "HPDL_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "4"}
    env.update(extra)
    return env


@pytest.mark.multirank
@pytest.mark.parametrize("launcher, fixed_fusion", [("mpiexec", None), ("torchrun", 3 * MIB)],
                         ids=["mpiexec", "torchrun-fusion-threshold-set"])
def test_a_job_tunes_while_every_result_stays_exact_and_every_rank_applies_the_same(launcher, fixed_fusion,
                                                                                      tmp_path):
    log = tmp_path / "autotune.csv"
    profile = tmp_path / "profile.json"
    extra = {"HPDL_PROFILE": str(profile)} if fixed_fusion is None else {"HOROVOD_FUSION_THRESHOLD": str(fixed_fusion)}
    result = run_ranks("autotune_job.py", 2, launcher, env=_job_env(log, **extra))
    assert "OK autotune rank 0" in result.stdout and "OK autotune rank 1" in result.stdout
    rows = list(csv.DictReader(log.open()))
    assert len(rows) == 5 + 1  # 1 + max_samples tuned samples, then the best
    tried = {(float(r["tensor_fusion_threshold"]), float(r["cycle_time_ms"])) for r in rows[:-1]}
    if fixed_fusion is None:
        assert set(START_POINTS) <= tried
    else:  # the knob its user set stays as set; the other is tuned
        assert {fusion for fusion, _ in tried} == {fixed_fusion / MIB}
        assert {cycle for _, cycle in START_POINTS} <= {cycle for _, cycle in tried}
    best = max(rows[:-1], key=lambda r: float(r["score"]))
    assert rows[-1] == best
    fusion = round(float(best["tensor_fusion_threshold"]) * MIB / 1024) * 1024
    assert (f"final fusion_threshold={fusion} cycle_time_ms={float(best['cycle_time_ms']):g} autotuning=False"
            in result.stdout), result.stdout
    # Both ranks ran with exactly the parameters of the log (the best is one of them).
    seen = json.loads(result.stdout.split("parameters seen: ")[1].splitlines()[0])
    logged = {(round(float(r["tensor_fusion_threshold"]) * 1024) * 1024, float(r["cycle_time_ms"])) for r in rows}
    assert {(f, c) for f, c in seen} == logged, result.stdout
    if fixed_fusion is None:  # a profile of the job records the parameters it ended with
        settings = json.loads(profile.read_text())["job"]["settings"]
        assert settings["autotune"] is True and settings["fusion_threshold"] == fusion
        assert settings["cycle_time_ms"] == pytest.approx(float(best["cycle_time_ms"]))
