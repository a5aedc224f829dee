"""Autotuning (``HPDL_AUTOTUNE``): the engine's fusion threshold and cycle time, chosen by the
bytes per microsecond the job achieves with them, as Horovod's ``parameter_manager.cc`` does.

Rank 0 measures and decides; every rank applies its decision at the same round:
- **Samples.** The allreduces the global process set runs are counted by name. A sub-sample
  ends when some tensor has been reduced ``HPDL_AUTOTUNE_STEPS_PER_SAMPLE`` more times (so a
  sub-sample spans that many training steps); its score is the bytes reduced over its time in
  microseconds. A sample is five sub-samples, scored by their median, so that one slow step
  (a validation, a checkpoint) does not decide.
- **Tuning.** The first ``HPDL_AUTOTUNE_WARMUP_SAMPLES`` samples are discarded (start-up,
  caches warming). Then each sample's parameters and score go to a Bayesian optimisation
  (bayes_opt.py) over the fusion threshold in [0, 64] MiB and the cycle time in [1, 100] ms,
  which proposes the next parameters to try; Horovod's four starting points come first
  ((4 MiB, 5 ms), (32, 50), (16, 25), (8, 10)). Tuning ends after
  ``HPDL_AUTOTUNE_BAYES_OPT_MAX_SAMPLES`` + 1 samples, the start points included, as in
  Horovod (its ``IsDoneTuning``: iteration > max_samples): 20 tries the four start points and
  17 proposals; 3 or fewer tries only start points (max + 1 of them). The parameters of the
  best score are then kept for the rest of the job.
- **Fixed knobs.** A knob the user set (``HPDL_FUSION_THRESHOLD``, ``HPDL_CYCLE_TIME``, their
  Horovod names, or ``hpdl run``'s options) is not tuned. Horovod's other tunables are not
  tuned here: hierarchical allreduce needs its node-local groups built at ``init()``, and
  the response cache cannot be switched while names are cached on some ranks only.
- **Agreement.** The fusion threshold decides how the agreed allreduces are fused into backend
  calls, which must be the same on every rank. Rank 0's current parameters travel as one word
  of every round's negotiation vector (negotiation.py), so every rank applies a change in the
  same round; the engine first starts what was queued under the old threshold.
- **Log.** With ``HPDL_AUTOTUNE_LOG``, rank 0 writes a CSV row per tuned sample in Horovod's
  columns, then the best parameters as the last row.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Collection, Dict, Iterable, List, Optional, Tuple

import numpy as np

from hpdl.atomic_file import make_directories
from hpdl.config import default
from hpdl.engine.bayes_opt import BayesianOptimization

log = logging.getLogger("hpdl.autotune")

MIB = 1024 * 1024
FUSION_BOUNDS_MB = (0.0, 64.0)
CYCLE_BOUNDS_MS = (1.0, 100.0)
# Horovod's first points to try, (fusion threshold MiB, cycle time ms), before the Bayesian proposals.
START_POINTS = ((4.0, 5.0), (32.0, 50.0), (16.0, 25.0), (8.0, 10.0))
SUB_SAMPLES = 5  # a sample is scored by the median of this many sub-samples (Horovod's SAMPLES)
CSV_HEADER = ("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,"
              "cycle_time_ms,tensor_fusion_threshold,score")

# The word rank 0 sends in each round (bits): 0-16 the fusion threshold in KiB, 17-26 the cycle
# time in tenths of a millisecond, 27 "parameters present". A field of all ones keeps the value.
_FUSION_BITS, _CYCLE_BITS = 17, 10
_FUSION_KEEP, _CYCLE_KEEP = (1 << _FUSION_BITS) - 1, (1 << _CYCLE_BITS) - 1
_PRESENT = 1 << (_FUSION_BITS + _CYCLE_BITS)
NO_PARAMETERS = 0


def encode(fusion_bytes: Optional[int], cycle_ms: Optional[float]) -> int:
    """The round word for these parameters (None: leave that one as it is)."""
    fusion = _FUSION_KEEP if fusion_bytes is None else min(_FUSION_KEEP - 1, max(0, round(fusion_bytes / 1024)))
    cycle = _CYCLE_KEEP if cycle_ms is None else min(_CYCLE_KEEP - 1, max(0, round(cycle_ms * 10)))
    return _PRESENT | (cycle << _FUSION_BITS) | fusion


def decode(word: int) -> Optional[Tuple[Optional[int], Optional[float]]]:
    """(fusion threshold in bytes, cycle time in ms) from a round word; None when it carries none."""
    if not word & _PRESENT or word >> (_FUSION_BITS + _CYCLE_BITS + 1):
        return None  # no tuning on rank 0 (0), or no word at all (every bit set)
    fusion = word & _FUSION_KEEP
    cycle = (word >> _FUSION_BITS) & _CYCLE_KEEP
    return (None if fusion == _FUSION_KEEP else fusion * 1024,
            None if cycle == _CYCLE_KEEP else cycle / 10)


def _quantized(fusion_mb: float, cycle_ms: float) -> Tuple[float, float]:
    """What the round word can carry: whole KiB, tenths of a millisecond."""
    return round(fusion_mb * 1024) / 1024, round(cycle_ms * 10) / 10


class Autotuner:
    """Rank 0's tuning state: the sample being measured, the optimisation, the log."""

    def __init__(self, fusion_threshold: int, cycle_time_ms: float, fixed: Collection[str] = (),
                 warmup_samples: int = default("autotune_warmup_samples"),
                 steps_per_sample: int = default("autotune_steps_per_sample"),
                 max_samples: int = default("autotune_bayes_opt_max_samples"),
                 noise: float = default("autotune_gaussian_process_noise"), log_path: str = "",
                 hierarchical_allreduce: bool = False,
                 cache_enabled: bool = True, clock: Callable[[], float] = time.monotonic):
        """
        Args:
            fusion_threshold, cycle_time_ms: the values in effect (kept where fixed).
            fixed: which of ``"fusion_threshold"`` and ``"cycle_time_ms"`` the user set.
            log_path: the CSV file to write (made with its directories), or "".
        """
        self.steps_per_sample = steps_per_sample
        self.max_samples = max_samples
        self.warmup_remaining = warmup_samples
        self._clock = clock
        self._fixed = {"fusion_threshold": fusion_threshold / MIB, "cycle_time_ms": float(cycle_time_ms)}
        for name in ("fusion_threshold", "cycle_time_ms"):
            if name not in fixed:
                del self._fixed[name]
        self.tuned = [name for name in ("fusion_threshold", "cycle_time_ms") if name not in self._fixed]
        bounds = {"fusion_threshold": FUSION_BOUNDS_MB, "cycle_time_ms": CYCLE_BOUNDS_MS}
        self._bayes = BayesianOptimization([bounds[name] for name in self.tuned], alpha=noise)
        self._starts = [self._point(start) for start in START_POINTS]
        self.active = bool(self.tuned)
        self.iteration = 0
        self.current = self._starts[0]
        self.best = self.current
        self.best_score = 0.0
        self.samples: List[Tuple[Dict[str, float], float]] = []  # tuned samples: parameters, score
        self._extra = f"{int(hierarchical_allreduce)},0,0,{int(cache_enabled)}"
        self._log = _open_log(log_path) if log_path else None
        self._word = self._make_word()
        self._reset()

    def _point(self, start: Tuple[float, float]) -> np.ndarray:
        values = dict(zip(("fusion_threshold", "cycle_time_ms"), _quantized(*start)))
        return np.array([values[name] for name in self.tuned])

    def parameters(self, point: Optional[np.ndarray] = None) -> Dict[str, float]:
        """The parameters at ``point`` (default: those to run with now), fixed ones included:
        fusion threshold in MiB, cycle time in ms."""
        if point is None:
            point = self.current if self.active else self.best
        values = dict(self._fixed)
        values.update(zip(self.tuned, (float(v) for v in point)))
        return values

    def word(self) -> int:
        """The round word for the parameters to run with now (every round asks: kept ready)."""
        return self._word

    def _make_word(self) -> int:
        if not self.tuned:
            return NO_PARAMETERS
        values = self.parameters()
        fusion = None if "fusion_threshold" in self._fixed else int(round(values["fusion_threshold"] * MIB))
        cycle = None if "cycle_time_ms" in self._fixed else values["cycle_time_ms"]
        return encode(fusion, cycle)

    def _reset(self) -> None:
        self._counts: Dict[str, int] = {}
        self._sub = 0
        self._scores = [0.0] * SUB_SAMPLES
        self._bytes = 0
        self._start = self._clock()

    def observe(self, names: Iterable[str], nbytes: int) -> bool:
        """Count a round's collectives of the global set; return True when the parameters to
        run with changed."""
        if not self.active:
            return False
        counts = self._counts
        for name in names:
            step = counts.get(name, 0)
            counts[name] = step + 1
            if step >= (self._sub + 1) * self.steps_per_sample:
                now = self._clock()
                self._scores[self._sub] = self._bytes / max((now - self._start) * 1e6, 1.0)
                self._bytes = 0
                self._start = now
                self._sub += 1
                break
        self._bytes += nbytes
        if self._sub < SUB_SAMPLES:
            return False
        score = float(np.median(self._scores))
        before = self._word
        self._tune(score)
        self._word = self._make_word()
        self._reset()
        return self._word != before

    def _tune(self, score: float) -> None:
        if self.warmup_remaining > 0:
            self.warmup_remaining -= 1
            return
        tried = self.parameters(self.current)
        self.samples.append((tried, score))
        self._write(tried, score)
        if score > self.best_score:
            self.best_score, self.best = score, self.current
        self._bayes.add_sample(self.current, score)
        self.iteration += 1
        if self.iteration > self.max_samples:
            self.active = False
            best = self.parameters(self.best)
            self._write(best, self.best_score)
            log.info("hpdl autotune: done after %d samples: fusion threshold %g MiB, cycle time %g ms "
                     "(%.1f bytes/us)", self.iteration, best["fusion_threshold"], best["cycle_time_ms"],
                     self.best_score)
            self.close()
        elif self.iteration < len(self._starts):
            self.current = self._starts[self.iteration]
        else:
            proposal = self._bayes.next_sample()
            values = dict(zip(self.tuned, proposal))
            fusion, cycle = _quantized(values.get("fusion_threshold", 0.0), values.get("cycle_time_ms", 1.0))
            quantized = {"fusion_threshold": fusion, "cycle_time_ms": cycle}
            self.current = np.array([quantized[name] for name in self.tuned])

    def _write(self, values: Dict[str, float], score: float) -> None:
        if self._log is not None:
            self._log.write(f"{self._extra},{values['cycle_time_ms']:.12g},{values['fusion_threshold']:.12g},{score:.6g}\n")

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def _open_log(path: str):
    """Open the autotune log for writing, line by line (a killed job keeps its rows)."""
    try:
        make_directories(os.path.dirname(os.path.abspath(path)))
        out = open(path, "w", buffering=1, encoding="utf-8")
    except OSError as err:
        raise ValueError(f"cannot write the autotune log {path} (HPDL_AUTOTUNE_LOG): "
                         f"{err.strerror or err}") from None
    out.write(CSV_HEADER + "\n")
    return out
