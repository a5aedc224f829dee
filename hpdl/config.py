"""Runtime settings: one frozen dataclass built once, from arguments and ``HPDL_*`` variables.

Every knob of the runtime is a field here with its environment variable beside it; nothing
deeper in the code reads the environment. Unknown ``HPDL_*`` variables are rejected, so a typo
(``HPDL_FUSION_TRESHOLD``) fails loudly instead of being silently ignored. Horovod's names of
the settings hpdl shares (``HOROVOD_FUSION_THRESHOLD``, ...) are read too, so that job scripts
written for Horovod keep their meaning; the ``HPDL_*`` name wins where both are set.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

BACKENDS = ("auto", "mpi", "gloo", "nccl", "torch")

# Variables read elsewhere on purpose (by launchers or tests), accepted without being settings.
_PASSTHROUGH = {"HPDL_VENV", "HPDL_TORCH_SPEC", "HPDL_TEST_TIMEOUT", "HPDL_TEST_LAUNCHERS",
                # where `hpdl run` finds the hosts and how it reaches them (set by `hpdl emulate`)
                "HPDL_HOSTFILE", "HPDL_RSH"}

# Horovod's variable -> the hpdl variable it stands for; both name the same quantity in the
# same unit (bytes, milliseconds, seconds, a path, 0/1).
HOROVOD_ALIASES = {
    "HOROVOD_FUSION_THRESHOLD": "HPDL_FUSION_THRESHOLD",
    "HOROVOD_CYCLE_TIME": "HPDL_CYCLE_TIME",
    "HOROVOD_CACHE_CAPACITY": "HPDL_CACHE_CAPACITY",
    "HOROVOD_TIMELINE": "HPDL_TIMELINE",
    "HOROVOD_TIMELINE_MARK_CYCLES": "HPDL_TIMELINE_MARK_CYCLES",
    "HOROVOD_HIERARCHICAL_ALLREDUCE": "HPDL_HIERARCHICAL_ALLREDUCE",
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "HPDL_STALL_WARNING",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "HPDL_STALL_TIMEOUT",
    "HOROVOD_START_TIMEOUT": "HPDL_START_TIMEOUT",
    "HOROVOD_SPARK_START_TIMEOUT": "HPDL_SPARK_START_TIMEOUT",
    "HOROVOD_AUTOTUNE": "HPDL_AUTOTUNE",
    "HOROVOD_AUTOTUNE_LOG": "HPDL_AUTOTUNE_LOG",
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "HPDL_AUTOTUNE_WARMUP_SAMPLES",
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "HPDL_AUTOTUNE_STEPS_PER_SAMPLE",
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "HPDL_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "HPDL_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
}
# Horovod's values that mean "not set": a shutdown time of 0 is Horovod's default (never), and
# hpdl keeps its own timeout then; a timeline of DYNAMIC is Horovod's "no file until
# hvd.start_timeline()" (Horovod 0.28's operations.cc), which hpdl allows without any setting.
_HOROVOD_UNSET = {("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "0"), ("HOROVOD_TIMELINE", "DYNAMIC")}
# Horovod's switch for stall warnings: hpdl then warns no earlier than its timeout ends the job,
# whatever HOROVOD_STALL_CHECK_TIME_SECONDS says (as in Horovod); HPDL_STALL_WARNING still wins.
_HOROVOD_STALL_CHECK_DISABLE = "HOROVOD_STALL_CHECK_DISABLE"


def horovod_variables_ignored(env: Optional[Mapping[str, str]] = None) -> List[str]:
    """Return the ``HOROVOD_*`` variables set in ``env`` that hpdl does not honour, sorted."""
    env = os.environ if env is None else env
    honoured = set(HOROVOD_ALIASES) | {_HOROVOD_STALL_CHECK_DISABLE}
    return sorted(k for k in env if k.startswith("HOROVOD_") and k not in honoured)


def _setting_texts(env: Mapping[str, str]) -> Dict[str, Tuple[str, str]]:
    """Each set hpdl variable's text and the variable it was read from (its Horovod alias, or itself)."""
    texts = {k: (k, v) for k, v in env.items() if k.startswith("HPDL_")}
    for horovod, hpdl in HOROVOD_ALIASES.items():
        if horovod in env and hpdl not in texts and (horovod, env[horovod].strip()) not in _HOROVOD_UNSET:
            texts[hpdl] = (horovod, env[horovod])
    return texts


def settings_given(env: Optional[Mapping[str, str]] = None) -> List[str]:
    """The names of the Settings fields ``env`` sets (by their ``HPDL_*`` or Horovod name), sorted:
    the autotuner leaves these alone, as Horovod leaves the knobs its user fixed."""
    env = os.environ if env is None else env
    by_var = {f.metadata["env"]: f.name for f in dataclasses.fields(Settings)}
    return sorted(by_var[var] for var in _setting_texts(env) if var in by_var)


class SettingsError(ValueError):
    """A setting has an unknown name or a value that cannot be used."""


# The upper bounds of settings (``hpdl run`` checks its options against the same ones before
# a job starts, hpdl/launch/limits.py). A year is longer than any job and far inside what
# Python's timers take; MPI numbers ranks, and Horovod its cache entries, with a C int.
MAX_BYTES = 1 << 40  # 1 TiB
C_INT_MAX = 2**31 - 1
YEAR_S = 365 * 24 * 3600


def _parse_finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # inf overflows timers and counters; nan compares false to every bound
        raise ValueError("expected a finite number")
    return value


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 0/1/true/false, got {text!r}")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Settings of one hpdl runtime; see each field's ``env`` metadata for its variable."""

    backend: str = dataclasses.field(default="auto", metadata={"env": "HPDL_BACKEND"})
    cycle_time_ms: float = dataclasses.field(default=1.0, metadata={"env": "HPDL_CYCLE_TIME"})
    fusion_threshold: int = dataclasses.field(
        default=128 * 1024 * 1024, metadata={"env": "HPDL_FUSION_THRESHOLD"}
    )
    # An allreduce at least this large is reduced where it lies, never copied through the
    # fusion buffer: fusing it would save one call's overhead (tens of microseconds) and cost
    # two copies of it (see fusion.py). 0: every tensor may be fused.
    inplace_threshold: int = dataclasses.field(default=1024 * 1024, metadata={"env": "HPDL_INPLACE_THRESHOLD"})
    cache_capacity: int = dataclasses.field(default=1024, metadata={"env": "HPDL_CACHE_CAPACITY"})
    # Keep allreduces in flight, negotiating the next ones meanwhile: on the backend's own
    # threads (torch.distributed), or polled by the engine (MPI); 0: one blocking call at a time.
    background_collectives: bool = dataclasses.field(
        default=True, metadata={"env": "HPDL_BACKGROUND_COLLECTIVES"}
    )
    # Bytes of prioritized allreduces (DistributedOptimizer(overlap_forward=...)) a rank keeps
    # in flight or queued to start (over MPI, half of it at most in flight); the rest wait,
    # agreed, to start in priority order (see engine/scheduling.py, Priorities).
    priority_window: int = dataclasses.field(default=8 * 1024 * 1024, metadata={"env": "HPDL_PRIORITY_WINDOW"})
    # A round for allreduces no caller waits for yet waits until this many bytes of them are
    # pending or the oldest has waited HPDL_GATHER_TIME ms, so that a round agrees, and one
    # call moves, a fused message worth its cost (see engine/scheduling.py, Gathering); 0: a round as
    # soon as anything is pending.
    gather_bytes: int = dataclasses.field(default=1024 * 1024, metadata={"env": "HPDL_GATHER_BYTES"})
    gather_time_ms: float = dataclasses.field(default=50.0, metadata={"env": "HPDL_GATHER_TIME"})
    stall_warning_s: float = dataclasses.field(
        default=60.0, metadata={"env": "HPDL_STALL_WARNING"}
    )
    stall_timeout_s: float = dataclasses.field(
        default=1800.0, metadata={"env": "HPDL_STALL_TIMEOUT"}
    )
    # How long init() waits for the ranks to meet before this rank gives up (0: no bound of
    # its own; the backend's rendezvous then waits up to the stall timeout).
    start_timeout_s: float = dataclasses.field(default=0.0, metadata={"env": "HPDL_START_TIMEOUT"})
    # How long hpdl.spark.run waits for Spark to start every rank's task (free slots for the
    # whole barrier stage, then each task reaching the driver) before it gives up; Horovod's 600 s.
    spark_start_timeout_s: float = dataclasses.field(default=600.0, metadata={"env": "HPDL_SPARK_START_TIMEOUT"})
    timeline: str = dataclasses.field(default="", metadata={"env": "HPDL_TIMELINE"})
    # Record every collective and step of every rank; rank 0 writes them to this JSON file at
    # shutdown (docs/profile.md).
    profile: str = dataclasses.field(default="", metadata={"env": "HPDL_PROFILE"})
    timeline_mark_cycles: bool = dataclasses.field(
        default=False, metadata={"env": "HPDL_TIMELINE_MARK_CYCLES"}
    )
    hierarchical_allreduce: bool = dataclasses.field(
        default=False, metadata={"env": "HPDL_HIERARCHICAL_ALLREDUCE"}
    )
    mpi_cuda_aware: str = dataclasses.field(
        default="auto", metadata={"env": "HPDL_MPI_CUDA_AWARE"}
    )
    # Ranks that share each GPU of a node: local ranks 0..K-1 use GPU 0, K..2K-1 GPU 1, ...
    # (hpdl/comm/devices.py; hpdl run --ranks-per-gpu). Above 1, nccl is out (it refuses two
    # ranks on one GPU): the ranks talk over gloo or MPI.
    ranks_per_gpu: int = dataclasses.field(default=1, metadata={"env": "HPDL_RANKS_PER_GPU"})
    # How much lower than the compute the engine thread runs (a nice increment, 0-19); auto:
    # 19 when this node's ranks compute on CPU cores they fill, else 0 (see engine/engine.py).
    engine_nice: str = dataclasses.field(default="auto", metadata={"env": "HPDL_ENGINE_NICE"})
    # Tune the fusion threshold and the cycle time while the job runs (hpdl/engine/autotune.py):
    # the samples to discard first, the training steps per sub-sample, the samples to tune
    # less one (Horovod's start points included), and the noise the Gaussian process assumes
    # in the scores (Horovod's defaults).
    autotune: bool = dataclasses.field(default=False, metadata={"env": "HPDL_AUTOTUNE"})
    autotune_log: str = dataclasses.field(default="", metadata={"env": "HPDL_AUTOTUNE_LOG"})
    autotune_warmup_samples: int = dataclasses.field(default=3, metadata={"env": "HPDL_AUTOTUNE_WARMUP_SAMPLES"})
    autotune_steps_per_sample: int = dataclasses.field(
        default=10, metadata={"env": "HPDL_AUTOTUNE_STEPS_PER_SAMPLE"})
    autotune_bayes_opt_max_samples: int = dataclasses.field(
        default=20, metadata={"env": "HPDL_AUTOTUNE_BAYES_OPT_MAX_SAMPLES"})
    autotune_gaussian_process_noise: float = dataclasses.field(
        default=0.8, metadata={"env": "HPDL_AUTOTUNE_GAUSSIAN_PROCESS_NOISE"})

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise SettingsError(f"{field.metadata['env']} must be a finite number, got {value}")
        # Upper bounds: values that parse but no job can mean (HPDL_FUSION_THRESHOLD=1e300), or
        # that the engine's timers cannot wait for (Python's lock timeouts end near 292 years).
        for env, value, highest, what in (
                ("HPDL_FUSION_THRESHOLD", self.fusion_threshold, MAX_BYTES, "1 TiB"),
                ("HPDL_INPLACE_THRESHOLD", self.inplace_threshold, MAX_BYTES, "1 TiB"),
                ("HPDL_PRIORITY_WINDOW", self.priority_window, MAX_BYTES, "1 TiB"),
                ("HPDL_GATHER_BYTES", self.gather_bytes, MAX_BYTES, "1 TiB"),
                ("HPDL_CACHE_CAPACITY", self.cache_capacity, C_INT_MAX, str(C_INT_MAX)),
                ("HPDL_RANKS_PER_GPU", self.ranks_per_gpu, C_INT_MAX, str(C_INT_MAX)),
                ("HPDL_AUTOTUNE_WARMUP_SAMPLES", self.autotune_warmup_samples, C_INT_MAX, str(C_INT_MAX)),
                ("HPDL_AUTOTUNE_STEPS_PER_SAMPLE", self.autotune_steps_per_sample, C_INT_MAX, str(C_INT_MAX)),
                ("HPDL_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", self.autotune_bayes_opt_max_samples, C_INT_MAX,
                 str(C_INT_MAX)),
                ("HPDL_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", self.autotune_gaussian_process_noise, 1, "1"),
                ("HPDL_CYCLE_TIME", self.cycle_time_ms, YEAR_S * 1000, "a year"),
                ("HPDL_GATHER_TIME", self.gather_time_ms, YEAR_S * 1000, "a year"),
                ("HPDL_STALL_WARNING", self.stall_warning_s, YEAR_S, "a year"),
                ("HPDL_STALL_TIMEOUT", self.stall_timeout_s, YEAR_S, "a year"),
                ("HPDL_START_TIMEOUT", self.start_timeout_s, YEAR_S, "a year"),
                ("HPDL_SPARK_START_TIMEOUT", self.spark_start_timeout_s, YEAR_S, "a year")):
            if value > highest:
                raise SettingsError(f"{env} must be at most {what}, got {value:g}")
        if self.backend not in BACKENDS:
            raise SettingsError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.cycle_time_ms < 0:
            raise SettingsError(f"HPDL_CYCLE_TIME must be >= 0 ms, got {self.cycle_time_ms}")
        if self.fusion_threshold < 0:
            raise SettingsError(f"HPDL_FUSION_THRESHOLD must be >= 0 bytes, got {self.fusion_threshold}")
        if self.inplace_threshold < 0:
            raise SettingsError(f"HPDL_INPLACE_THRESHOLD must be >= 0 bytes, got {self.inplace_threshold}")
        if self.priority_window < 1:
            raise SettingsError(f"HPDL_PRIORITY_WINDOW must be >= 1 byte, got {self.priority_window}")
        if self.gather_bytes < 0:
            raise SettingsError(f"HPDL_GATHER_BYTES must be >= 0 bytes, got {self.gather_bytes}")
        if self.gather_time_ms < 0:
            raise SettingsError(f"HPDL_GATHER_TIME must be >= 0 ms, got {self.gather_time_ms}")
        if self.ranks_per_gpu < 1:
            raise SettingsError(f"HPDL_RANKS_PER_GPU must be >= 1, got {self.ranks_per_gpu}")
        if self.cache_capacity < 0:
            raise SettingsError(f"HPDL_CACHE_CAPACITY must be >= 0, got {self.cache_capacity}")
        if self.stall_warning_s <= 0 or self.stall_timeout_s <= 0:
            raise SettingsError("HPDL_STALL_WARNING and HPDL_STALL_TIMEOUT must be > 0 seconds")
        if self.start_timeout_s < 0:
            raise SettingsError(f"HPDL_START_TIMEOUT must be >= 0 seconds, got {self.start_timeout_s}")
        if self.spark_start_timeout_s <= 0:
            raise SettingsError(f"HPDL_SPARK_START_TIMEOUT must be > 0 seconds, got {self.spark_start_timeout_s:g}")
        for env, value, lowest in (("HPDL_AUTOTUNE_WARMUP_SAMPLES", self.autotune_warmup_samples, 0),
                                   ("HPDL_AUTOTUNE_STEPS_PER_SAMPLE", self.autotune_steps_per_sample, 1),
                                   ("HPDL_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", self.autotune_bayes_opt_max_samples, 0),
                                   ("HPDL_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", self.autotune_gaussian_process_noise, 0)):
            if value < lowest:
                raise SettingsError(f"{env} must be >= {lowest}, got {value:g}")
        if self.mpi_cuda_aware not in ("auto", "0", "1"):
            raise SettingsError(f"HPDL_MPI_CUDA_AWARE must be auto, 0 or 1, got {self.mpi_cuda_aware!r}")
        if self.engine_nice != "auto" and not (self.engine_nice.isdigit() and 0 <= int(self.engine_nice) <= 19):
            raise SettingsError(f"HPDL_ENGINE_NICE must be auto or an integer from 0 to 19, got {self.engine_nice!r}")

    def resolve_engine_nice(self, local_size: int, threads_per_rank: int, cpus: int, cuda: bool) -> int:
        """The engine thread's nice increment: explicit, or 19 for CPU ranks that fill the cores.

        When every core runs a rank's compute, each moment the engine thread runs (polling for
        a late peer, copying, negotiating) is taken from the compute; at the lowest priority it
        runs in the gaps instead (measured: docs/perf.md). With GPUs the cores are not the
        bottleneck and the engine must react at once, so it keeps normal priority.
        """
        if self.engine_nice != "auto":
            return int(self.engine_nice)
        return 19 if not cuda and local_size * threads_per_rank >= cpus else 0

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None, **overrides: Any) -> "Settings":
        """Build settings from ``HPDL_*`` variables, then explicit (non-None) overrides."""
        env = os.environ if env is None else env
        fields = {f.metadata["env"]: f for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in env if k.startswith("HPDL_") and k not in fields and k not in _PASSTHROUGH)
        if unknown:
            close = difflib.get_close_matches(unknown[0], fields, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f"; known: {', '.join(sorted(fields))}"
            raise SettingsError(f"unknown setting {unknown[0]}{hint}")
        texts = _setting_texts(env)
        values: Dict[str, Any] = {}
        for var, field in fields.items():
            if var not in texts:
                continue
            source, text = texts[var]
            try:
                if field.type in ("bool", bool):
                    values[field.name] = _parse_bool(text)
                elif field.type in ("int", int):
                    values[field.name] = int(_parse_finite(text)) if text.strip() else field.default
                elif field.type in ("float", float):
                    values[field.name] = _parse_finite(text)
                else:
                    values[field.name] = text.strip()
            except ValueError as err:
                raise SettingsError(f"{source}={text!r}: {err}") from None
        # Only hpdl's own variable outranks the switch: texts also holds the Horovod warning time.
        if _HOROVOD_STALL_CHECK_DISABLE in env and "HPDL_STALL_WARNING" not in env:
            try:
                disabled = _parse_bool(env[_HOROVOD_STALL_CHECK_DISABLE])
            except ValueError as err:
                raise SettingsError(f"{_HOROVOD_STALL_CHECK_DISABLE}={env[_HOROVOD_STALL_CHECK_DISABLE]!r}: {err}") \
                    from None
            if disabled:
                values["stall_warning_s"] = values.get("stall_timeout_s", cls.stall_timeout_s)
        names = {f.name for f in dataclasses.fields(cls)}
        for key, value in overrides.items():
            if key not in names:
                raise SettingsError(f"unknown setting {key!r}")
            if value is not None:
                values[key] = value
        return cls(**values)

    def replace(self, **changes: Any) -> "Settings":
        """Return a copy with some fields changed."""
        return dataclasses.replace(self, **changes)
