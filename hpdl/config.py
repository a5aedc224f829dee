"""Runtime settings: one frozen dataclass built once, from arguments and ``HPDL_*`` variables.

Every knob of the runtime is a field of :class:`Settings`, and the field is the one place that
declares it (:class:`SettingSpec` in its metadata): its name, type and default, its variable
and Horovod's, its range or values, what it means, and the `hpdl run` option that sets it.
Everything else is derived from the declarations: parsing and range checks here, `hpdl run`'s
options, their help and the variables they become (hpdl/launch/limits.py), horovodrun's
config-file keys (hpdl/launch/horovodrun.py) and the README's table of settings
(hpdl/settings_table.py, which a test holds to the README).

Nothing deeper in the code reads the environment. Unknown ``HPDL_*`` variables are rejected,
so a typo (``HPDL_FUSION_TRESHOLD``) fails loudly instead of being silently ignored. Horovod's
names of the settings hpdl shares (``HOROVOD_FUSION_THRESHOLD``, ...) are read too, so that job
scripts written for Horovod keep their meaning; the ``HPDL_*`` name wins where both are set.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

BACKENDS = ("auto", "mpi", "gloo", "nccl", "torch")

# Variables read elsewhere on purpose (by launchers or tests), accepted without being settings.
_PASSTHROUGH = {"HPDL_VENV", "HPDL_TORCH_SPEC", "HPDL_TEST_TIMEOUT", "HPDL_TEST_LAUNCHERS",
                # where `hpdl run` finds the hosts and how it reaches them (set by `hpdl emulate`)
                "HPDL_HOSTFILE", "HPDL_RSH",
                # the pipe through which a rank notes its own exit to `hpdl run`'s wrapper (rank_exit.py)
                "HPDL_RANK_EXIT",
                # an elastic job's worker: the driver's store and the worker's id (hpdl/comm/rendezvous.py)
                "HPDL_ELASTIC_STORE", "HPDL_ELASTIC_WORKER",
                # and how long it waits for a generation that lists it (the driver's --elastic-timeout)
                "HPDL_ELASTIC_TIMEOUT",
                # the node a rank runs on, where its launcher knows it (hpdl.ray: Ray's node id;
                # hpdl/comm/topology.py's host_identity)
                "HPDL_NODE_ID"}

# Horovod's values that mean "not set": a shutdown time of 0 is Horovod's default (never), and
# hpdl keeps its own timeout then; a timeline of DYNAMIC is Horovod's "no file until
# hvd.start_timeline()" (Horovod 0.28's operations.cc), which hpdl allows without any setting.
_HOROVOD_UNSET = {("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "0"), ("HOROVOD_TIMELINE", "DYNAMIC")}
# Horovod's switch for stall warnings: hpdl then warns no earlier than its timeout ends the job,
# whatever HOROVOD_STALL_CHECK_TIME_SECONDS says (as in Horovod); HPDL_STALL_WARNING still wins.
_HOROVOD_STALL_CHECK_DISABLE = "HOROVOD_STALL_CHECK_DISABLE"


class SettingsError(ValueError):
    """A setting has an unknown name or a value that cannot be used."""


# The upper bounds of settings. A year is longer than any job and far inside what Python's
# timers take; MPI numbers ranks, and Horovod its cache entries, with a C int.
MAX_BYTES = 1 << 40  # 1 TiB
C_INT_MAX = 2**31 - 1
YEAR_S = 365 * 24 * 3600


class Bound(NamedTuple):
    """The range of a numeric setting, in its own unit."""

    lowest: float
    highest: float
    unit: str = ""  # "bytes", "ms", ...: how messages name the unit
    highest_means: str = ""  # what the upper bound is in words, when its number says little
    lowest_excluded: bool = False  # the setting must be above ``lowest``, not at it


_BYTES = Bound(0, MAX_BYTES, "bytes", "1 TiB")
_MS = Bound(0, YEAR_S * 1000, "ms", "a year")
_SECONDS = Bound(0, YEAR_S, "seconds", "a year")
_SECONDS_ABOVE_0 = _SECONDS._replace(lowest_excluded=True)


@dataclasses.dataclass(frozen=True)
class RunOptionSpec:
    """The `hpdl run` option that gives a setting to every rank, in the option's own unit."""

    flags: Tuple[str, ...]  # the first names the option in errors; the others are horovodrun's spellings
    help: str  # what the option does; `hpdl run --help` adds its variable, default and range
    group: str = "settings passed to every rank"  # the group of `hpdl run --help` that lists it
    metavar: Optional[str] = None
    scale: float = 1  # the setting's units per unit of the option (MB -> bytes)
    unit: Optional[str] = None  # the option's unit where it is not the setting's
    path: bool = False  # a file: made absolute, since the ranks may start elsewhere
    config_key: Optional[Tuple[str, str]] = None  # its (section, key) in horovodrun's config file

    @property
    def dest(self) -> str:
        """The option's name in the parsed arguments: ``fusion_threshold_mb``."""
        return self.flags[0].lstrip("-").replace("-", "_")


@dataclasses.dataclass(frozen=True)
class SettingSpec:
    """What a setting is, beside its field's name, type and default."""

    env: str  # its HPDL_* variable
    doc: str  # what it means, as the README's table of settings says it (Markdown)
    horovod: str = ""  # Horovod's variable for the same quantity in the same unit, read as an alias
    bound: Optional[Bound] = None  # the range of a number (of an integer given as text, with choices)
    choices: Tuple[str, ...] = ()  # the words a text setting takes
    run: Optional[RunOptionSpec] = None  # the `hpdl run` option that sets it, if any


def _setting(default: Any, env: str, doc: str, **spec: Any) -> Any:
    """A :class:`Settings` field declared by ``env``, ``doc`` and the rest of :class:`SettingSpec`."""
    return dataclasses.field(default=default, metadata={"spec": SettingSpec(env, doc, **spec)})


_AUTOTUNING = "autotuning"


@dataclasses.dataclass(frozen=True)
class Settings:
    """Settings of one hpdl runtime; each field's ``spec`` metadata declares the rest of it."""

    backend: str = _setting(
        "auto", "HPDL_BACKEND", choices=BACKENDS,
        doc="`mpi`, `gloo`, `nccl` or `torch` (gloo on CPU, nccl with CUDA); auto: MPI under mpiexec/srun, or in "
            "a single process without a GPU, when mpi4py is there, else as `torch` (so under torchrun, and in a "
            "single process with a GPU)",
        run=RunOptionSpec(("--backend",), "collective backend of the ranks; gloo, nccl and torch start through "
                                          "torchrun on one host", group="launcher"))
    timeline: str = _setting(
        "", "HPDL_TIMELINE", horovod="HOROVOD_TIMELINE",
        doc="write a Chrome-trace timeline of engine events to this file (Horovod's `DYNAMIC`: none until "
            "`hvd.start_timeline()`)",
        run=RunOptionSpec(("--timeline", "--timeline-filename"), "write a Chrome-trace timeline of collectives to "
                                                                 "FILE; DYNAMIC: none until hvd.start_timeline(), "
                                                                 "as Horovod",
                          metavar="FILE", path=True, config_key=("timeline", "filename")))
    timeline_mark_cycles: bool = _setting(
        False, "HPDL_TIMELINE_MARK_CYCLES", horovod="HOROVOD_TIMELINE_MARK_CYCLES",
        doc="mark the engine's cycles in the timeline",
        run=RunOptionSpec(("--timeline-mark-cycles",), "mark the engine's cycles in the timeline",
                          config_key=("timeline", "mark_cycles")))
    profile: str = _setting(
        "", "HPDL_PROFILE",
        doc="record every rank's collectives and steps; rank 0 writes them to this JSON file at shutdown "
            "([docs/profile.md](docs/profile.md))",
        run=RunOptionSpec(("--profile",), "record every rank's collectives and steps; rank 0 writes them to FILE "
                                          "at shutdown, read it with `hpdl profile report FILE`",
                          metavar="FILE", path=True))
    fusion_threshold: int = _setting(
        128 * 1024 * 1024, "HPDL_FUSION_THRESHOLD", horovod="HOROVOD_FUSION_THRESHOLD", bound=_BYTES,
        doc="fusion buffer size (Horovod's default since v0.21; 0: no fusion)",
        run=RunOptionSpec(("--fusion-threshold-mb",), "fuse tensors into buffers of up to MB mebibytes; "
                                                      "0 disables", metavar="MB", scale=1 << 20,
                          unit="MB", config_key=("params", "fusion_threshold_mb")))
    cycle_time_ms: float = _setting(
        1.0, "HPDL_CYCLE_TIME", horovod="HOROVOD_CYCLE_TIME", bound=_MS,
        doc="engine cycle (across nodes over gloo on CPU-bound nodes, 10 with `HPDL_INPLACE_THRESHOLD=0` spends "
            "less CPU on negotiation: [docs/perf.md](docs/perf.md))",
        run=RunOptionSpec(("--cycle-time-ms",), "engine cycle time in milliseconds", metavar="MS",
                          config_key=("params", "cycle_time_ms")))
    # Fusing an allreduce this large would save one call's overhead (tens of microseconds) and
    # cost two copies of it (see fusion.py).
    inplace_threshold: int = _setting(
        1024 * 1024, "HPDL_INPLACE_THRESHOLD", bound=_BYTES,
        doc="allreduces of at least this many bytes are reduced in place, never copied through the fusion buffer "
            "(0: all may be fused)")
    cache_capacity: int = _setting(
        1024, "HPDL_CACHE_CAPACITY", horovod="HOROVOD_CACHE_CAPACITY", bound=Bound(0, C_INT_MAX, "entries"),
        doc="response cache entries (0 disables)",
        run=RunOptionSpec(("--cache-capacity",), "entries of the negotiation response cache; 0 disables",
                          metavar="N", config_key=("params", "cache_capacity")))
    # A round waits for allreduces no caller waits for yet, so that a round agrees, and one call
    # moves, a fused message worth its cost (see engine/scheduling.py, Gathering).
    gather_bytes: int = _setting(
        1024 * 1024, "HPDL_GATHER_BYTES", bound=_BYTES,
        doc="while every pending request is an allreduce no caller waits for yet (gradients during backward), the "
            "engine holds its next round until this many bytes are pending, the oldest has waited "
            "`HPDL_GATHER_TIME`, or as many bytes are pending as DistributedOptimizer says are still to come in "
            "the step: fewer rounds and backend calls per step, less CPU taken from the compute (0: a round as "
            "soon as anything is pending; [docs/perf.md](docs/perf.md))")
    gather_time_ms: float = _setting(
        50.0, "HPDL_GATHER_TIME", bound=_MS,
        doc="the longest the oldest of those allreduces waits for its round while the engine gathers "
            "(`HPDL_GATHER_BYTES`)")
    # Over MPI, half of the window at most is in flight (see engine/scheduling.py, Priorities).
    priority_window: int = _setting(
        8 * 1024 * 1024, "HPDL_PRIORITY_WINDOW", bound=Bound(1, MAX_BYTES, "bytes", "1 TiB"),
        doc="bytes of prioritized allreduces (`DistributedOptimizer(overlap_forward=model)`) a rank keeps in "
            "flight or queued (over MPI half of it at most in flight); the others wait to start most-urgent first")
    background_collectives: bool = _setting(
        True, "HPDL_BACKGROUND_COLLECTIVES",
        doc="keep allreduces in flight while the engine negotiates the next ones: on the backend's threads under "
            "torch.distributed (gloo, nccl), polled between rounds under MPI (0: one blocking call at a time)")
    stall_warning_s: float = _setting(
        60.0, "HPDL_STALL_WARNING", horovod="HOROVOD_STALL_CHECK_TIME_SECONDS", bound=_SECONDS_ABOVE_0,
        doc="seconds before a stalled collective is reported on every rank, and before ranks that wait for each "
            "other end the job",
        run=RunOptionSpec(("--stall-warning-s", "--stall-check-warning-time-seconds"),
                          "warn when a collective waits for some ranks longer than S seconds", metavar="S",
                          config_key=("stall_check", "warning_time_seconds")))
    stall_timeout_s: float = _setting(
        1800.0, "HPDL_STALL_TIMEOUT", horovod="HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", bound=_SECONDS_ABOVE_0,
        doc="seconds before a stalled collective (or a spatial group's halo exchange) is raised on every rank; the "
            "whole job then ends within 3 s, even a rank stuck in C code (it prints its stack)",
        run=RunOptionSpec(("--stall-timeout-s",), "abort the job when a collective stalls longer than S seconds",
                          metavar="S"))
    elastic_discovery_interval_s: float = _setting(
        1.0, "HPDL_ELASTIC_DISCOVERY_INTERVAL", bound=_SECONDS_ABOVE_0,
        doc="seconds between two runs of an elastic job's --host-discovery-script (horovodrun runs it every second)")
    elastic_discovery_timeout_s: float = _setting(
        10.0, "HPDL_ELASTIC_DISCOVERY_TIMEOUT", bound=_SECONDS_ABOVE_0,
        doc="seconds an elastic job's --host-discovery-script may run before it counts as hung")
    elastic_snapshot: bool = _setting(
        True, "HPDL_ELASTIC_SNAPSHOT",
        doc="under torchrun's elastic agent, which restarts every worker on a failure or a change of nodes, "
            "`state.commit()` also keeps the state on disk (local rank 0 of each node), and `hvd.elastic.run` "
            "resumes from the newest commit after a restart (0: off, nothing written; "
            "[docs/elastic.md](docs/elastic.md))")
    elastic_snapshot_dir: str = _setting(
        "", "HPDL_ELASTIC_SNAPSHOT_DIR",
        doc="where those snapshots live: `<this>/hpdl-elastic-<torchrun's run id>/` (default: the temp dir, "
            "node-local); removed when the training function returns")
    # 0: the backend's rendezvous then waits up to the stall timeout.
    start_timeout_s: float = _setting(
        0.0, "HPDL_START_TIMEOUT", horovod="HOROVOD_START_TIMEOUT", bound=_SECONDS,
        doc="seconds `hvd.init()` waits for every rank to meet before this rank exits with an error (0: no bound "
            "of its own)",
        run=RunOptionSpec(("--start-timeout",), "a rank whose hvd.init() has not met every other rank within S "
                                                "seconds exits with an error; 0: no bound of hpdl's own",
                          group="launcher", metavar="S"))
    spark_start_timeout_s: float = _setting(
        600.0, "HPDL_SPARK_START_TIMEOUT", horovod="HOROVOD_SPARK_START_TIMEOUT", bound=_SECONDS_ABOVE_0,
        doc="seconds `hpdl.spark.run` waits for Spark to start every rank's task (free slots for the whole barrier "
            "stage, then each task reaching the driver) before it raises, naming the slots wanted and found "
            "(`start_timeout=` overrides; Horovod's default)")
    hierarchical_allreduce: bool = _setting(
        False, "HPDL_HIERARCHICAL_ALLREDUCE", horovod="HOROVOD_HIERARCHICAL_ALLREDUCE",
        doc="allreduce within nodes, then across nodes, then within nodes (measured across 2 emulated nodes: no "
            "gain over MPICH, whose allreduce is node-aware already; 5-17 % over gloo for 512 KiB-32 MiB, a loss "
            "outside; [docs/perf.md](docs/perf.md))",
        run=RunOptionSpec(("--hierarchical-allreduce",), "allreduce within each node, then across nodes",
                          config_key=("params", "hierarchical_allreduce")))
    mpi_cuda_aware: str = _setting(
        "auto", "HPDL_MPI_CUDA_AWARE", choices=("auto", "0", "1"),
        doc="force CUDA-aware MPI on (`1`) or off (`0`)")
    # hpdl/comm/devices.py places the ranks on the GPUs.
    ranks_per_gpu: int = _setting(
        1, "HPDL_RANKS_PER_GPU", bound=Bound(1, C_INT_MAX, "ranks"),
        doc="ranks sharing each GPU of a node: local ranks 0..K-1 use GPU 0, K..2K-1 GPU 1 (`hvd.local_gpu()`); "
            "above 1 the ranks talk over gloo or MPI, as NCCL refuses two ranks on one GPU "
            "([docs/gpu.md](docs/gpu.md))",
        run=RunOptionSpec(("--ranks-per-gpu",), "ranks sharing each GPU of a node: local ranks 0..K-1 use GPU 0, "
                                                "K..2K-1 GPU 1, ... (hvd.local_gpu() names a rank's GPU, "
                                                "hvd.local_rank() still the process); above 1 the ranks talk over "
                                                "gloo or MPI, as NCCL refuses two ranks on one GPU; run NVIDIA MPS "
                                                "so that their kernels share the GPU at once, see docs/gpu.md",
                          group="ranks and hosts", metavar="K"))
    # A nice increment (see engine/engine.py and resolve_engine_nice).
    engine_nice: str = _setting(
        "auto", "HPDL_ENGINE_NICE", choices=("auto",), bound=Bound(0, 19),
        doc="lower the engine thread's priority by this nice increment; auto: 19 when CPU ranks fill the node's "
            "cores, else 0")
    # hpdl/engine/autotune.py, with Horovod's defaults.
    autotune: bool = _setting(
        False, "HPDL_AUTOTUNE", horovod="HOROVOD_AUTOTUNE",
        doc="tune the fusion threshold and the cycle time while the job runs, as Horovod's autotuner does (a "
            "Bayesian optimisation of the allreduces' bytes per microsecond, decided on rank 0 and applied by "
            "every rank in the same round; a knob set explicitly stays fixed; [docs/api.md](docs/api.md))",
        run=RunOptionSpec(("--autotune",), "autotune", group=_AUTOTUNING, config_key=("autotune", "enabled")))
    autotune_log: str = _setting(
        "", "HPDL_AUTOTUNE_LOG", horovod="HOROVOD_AUTOTUNE_LOG",
        doc="rank 0 writes a CSV row per sample tried to this file, in Horovod's columns, the best as the last row",
        run=RunOptionSpec(("--autotune-log-file",), "rank 0 writes a CSV row per sample tried, the best as the "
                                                    "last row", group=_AUTOTUNING, metavar="FILE", path=True,
                          config_key=("autotune", "log_file")))
    autotune_warmup_samples: int = _setting(
        3, "HPDL_AUTOTUNE_WARMUP_SAMPLES", horovod="HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
        bound=Bound(0, C_INT_MAX, "samples"),
        doc="samples discarded before tuning starts",
        run=RunOptionSpec(("--autotune-warmup-samples",), "samples discarded before tuning starts",
                          group=_AUTOTUNING, metavar="N", config_key=("autotune", "warmup_samples")))
    autotune_steps_per_sample: int = _setting(
        10, "HPDL_AUTOTUNE_STEPS_PER_SAMPLE", horovod="HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",
        bound=Bound(1, C_INT_MAX, "steps"),
        doc="training steps per sub-sample; a sample is scored by the median of 5",
        run=RunOptionSpec(("--autotune-steps-per-sample",), "training steps per sub-sample; a sample is scored "
                                                            "by the median of 5",
                          group=_AUTOTUNING, metavar="N", config_key=("autotune", "steps_per_sample")))
    autotune_bayes_opt_max_samples: int = _setting(
        20, "HPDL_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", horovod="HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
        bound=Bound(0, C_INT_MAX, "samples"),
        doc="tuning ends after this many samples plus one, Horovod's 4 start points included (20: 4 start points "
            "and 17 proposals), and keeps the best",
        run=RunOptionSpec(("--autotune-bayes-opt-max-samples",), "tuning ends after N + 1 samples, Horovod's 4 "
                                                                 "start points included (20: 4 start points and 17 "
                                                                 "proposals of the Bayesian optimisation), and keeps "
                                                                 "the best",
                          group=_AUTOTUNING, metavar="N", config_key=("autotune", "bayes_opt_max_samples")))
    autotune_gaussian_process_noise: float = _setting(
        0.8, "HPDL_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", horovod="HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
        bound=Bound(0, 1),
        doc="the noise the Gaussian process assumes in the scores",
        run=RunOptionSpec(("--autotune-gaussian-process-noise",), "noise assumed in the scores", group=_AUTOTUNING,
                          metavar="X", config_key=("autotune", "gaussian_process_noise")))

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            spec = field.metadata["spec"]
            problem = value_problem(spec, getattr(self, field.name), spec.env)
            if problem is not None:
                raise SettingsError(problem)

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
        fields = {f.metadata["spec"].env: f for f in dataclasses.fields(cls)}
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
        for key, value in overrides.items():
            if key not in SPECS:
                raise SettingsError(f"unknown setting {key!r}")
            if value is not None:
                # An argument (init(backend=...)) is named as its caller gave it, not as a variable.
                problem = value_problem(SPECS[key], value, key)
                if problem is not None:
                    raise SettingsError(problem)
                values[key] = value
        return cls(**values)

    def replace(self, **changes: Any) -> "Settings":
        """Return a copy with some fields changed."""
        return dataclasses.replace(self, **changes)


# Each setting's declaration, by field name, in the order of the fields.
SPECS: Dict[str, SettingSpec] = {field.name: field.metadata["spec"] for field in dataclasses.fields(Settings)}
# Horovod's variable -> the hpdl variable it stands for; both name the same quantity in the
# same unit (bytes, milliseconds, seconds, a path, 0/1).
HOROVOD_ALIASES: Dict[str, str] = {spec.horovod: spec.env for spec in SPECS.values() if spec.horovod}


def default(name: str) -> Any:
    """The default of the setting ``name``."""
    return Settings.__dataclass_fields__[name].default


def value_problem(spec: SettingSpec, value: Any, name: str, scale: float = 1, unit: Optional[str] = None
                  ) -> Optional[str]:
    """Why ``value`` cannot be the setting ``spec``, in one line naming ``name``; None when it can.

    Args:
        name: what the value was given as: the variable, an argument, an option.
        scale, unit: for a value in other units than the setting's (see :func:`out_of_range`).
    """
    if isinstance(value, float) and not math.isfinite(value):
        return f"{name} must be a finite number, got {value}"
    if spec.choices:
        if value in spec.choices:
            return None
        if spec.bound is None:
            return f"{name} must be one of {', '.join(spec.choices)}, got {value!r}"
        if not (isinstance(value, str) and value.isdigit()):
            return (f"{name} must be {' or '.join(spec.choices)} or an integer from "
                    f"{number_text(spec.bound.lowest)} to {number_text(spec.bound.highest)}, got {value!r}")
        value = int(value)
    if spec.bound is not None:
        # The upper bounds keep out values that parse but no job can mean
        # (HPDL_FUSION_THRESHOLD=1e300), or that the engine's timers cannot wait for (Python's
        # lock timeouts end near 292 years).
        return out_of_range(name, value, spec.bound, scale, unit)
    return None


def out_of_range(name: str, value: float, bound: Bound, scale: float = 1, unit: Optional[str] = None) -> Optional[str]:
    """Why ``value`` is not a number ``bound`` allows, in one line naming ``name``; None when it is.

    Args:
        scale: the setting's units per unit of ``value``, for a value given in other units
            (an option in MB for a setting in bytes); the bound is divided by it.
        unit: the unit of ``value`` when it is not the setting's.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return f"{name} must be a finite number, got {value}"
    lowest, highest = (bound.lowest, bound.highest) if scale == 1 else (bound.lowest / scale, bound.highest / scale)
    unit = bound.unit if unit is None else unit
    if value < lowest or (bound.lowest_excluded and value == lowest):
        relation = ">" if bound.lowest_excluded else ">="
        return f"{name} must be {relation} {_with_unit(lowest, unit)}, got {number_text(value)}"
    if value > highest:
        means = f" ({bound.highest_means})" if bound.highest_means else ""
        return f"{name} must be at most {_with_unit(highest, unit)}{means}, got {number_text(value)}"
    return None


def range_text(bound: Bound, scale: float = 1, unit: Optional[str] = None) -> str:
    """``bound`` in words, for help and docs: "0 bytes to 1 TiB", "1 to 2147483647 ranks".

    Args:
        scale, unit: for a range in other units than the setting's (see :func:`out_of_range`).
    """
    unit = bound.unit if unit is None else unit
    lowest, highest = (bound.lowest, bound.highest) if scale == 1 else (bound.lowest / scale, bound.highest / scale)
    # The unit goes with the number that is written as one: "1 to 2147483647 ranks", "0 ms to a year".
    low = _with_unit(lowest, unit) if bound.highest_means else number_text(lowest)
    return f"{'above ' if bound.lowest_excluded else ''}{low} to {bound.highest_means or _with_unit(highest, unit)}"


def _with_unit(value: float, unit: str) -> str:
    text = number_text(value)
    if unit.endswith("s") and text == "1":
        unit = unit[:-1]  # 1 byte, 1 step
    return f"{text} {unit}" if unit else text


def number_text(value: float) -> str:
    """A number as written: 2147483647 and 0.5 in full, 1e+300 rather than its 301 digits."""
    if isinstance(value, int):  # may be too large for a float
        digits = str(abs(value))
        sign = "-" if value < 0 else ""
        return sign + digits if len(digits) <= 15 else f"{sign}{digits[0]}.{digits[1:4]}e+{len(digits) - 1}"
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:g}"


# The job's layout, which horovodrun gives every worker for its script to read, and `hpdl run`
# too (hpdl/launch/horovod_env.py): the launcher's description of the job, not settings, so no
# warning that hpdl ignores them (it reads the layout from the launcher's own variables).
HOROVOD_LAYOUT = ("HOROVOD_HOSTNAME", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                  "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")


def horovod_variables_ignored(env: Optional[Mapping[str, str]] = None) -> List[str]:
    """Return the ``HOROVOD_*`` variables set in ``env`` that hpdl does not honour, sorted (the
    job's layout, :data:`HOROVOD_LAYOUT`, is not among them)."""
    env = os.environ if env is None else env
    honoured = set(HOROVOD_ALIASES) | {_HOROVOD_STALL_CHECK_DISABLE} | set(HOROVOD_LAYOUT)
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
    by_var = {spec.env: name for name, spec in SPECS.items()}
    return sorted(by_var[var] for var in _setting_texts(env) if var in by_var)


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
