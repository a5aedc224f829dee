"""Measured allreduce curves: time by message size at the rank count measured, and at others.

A curve is read from ``hpdl bench allreduce --json`` (records per path and size, the ranks in
the file) or from OSU's ``osu_allreduce`` text (``# Size  Avg Latency(us)`` lines; OSU does
not print the rank count, so the reader is given it). Between measured sizes the time is
interpolated log-log (piecewise linear in log size, log time): a power law between each
two points, exact for both a latency-bound stretch (flat) and a bandwidth-bound one (slope 1),
where linear interpolation would bend the first. Outside the measured range a curve refuses
unless asked to extrapolate: above it, the largest size's bandwidth held (time grows in
proportion); below it, the smallest size's time (a latency floor).

To another rank count a curve is carried by nccl-tests' bus bandwidth (doc/PERFORMANCE.md):
``busbw = algbw x 2(p-1)/p`` is what each rank's link carries in a ring, the same at any p on
the same fabric, so the time at p is the time measured times ``ring_factor(p) /
ring_factor(measured p)``. It scales the bandwidth term exactly for a ring and leaves the
latency term, which grows as 2(p-1) steps, underestimated at larger p.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
import re
import statistics
from typing import List, Optional, Sequence, Tuple

from hpdl.profile.schema import ProfileError, read_file

__all__ = ["CurveError", "MeasuredCurve", "ring_factor", "bus_bandwidth", "algorithm_bandwidth",
           "scale_time_to_ranks", "read_curve", "read_bench_curve", "read_osu_curve"]


class CurveError(ValueError):
    """A measured curve that cannot be read or cannot answer; the message is one line."""


def ring_factor(ranks: int) -> float:
    """Return 2(p-1)/p: the bytes each rank's link carries in a ring allreduce, per byte reduced."""
    if ranks < 1:
        raise ValueError(f"a rank count is at least 1, got {ranks}")
    return 2 * (ranks - 1) / ranks


def bus_bandwidth(algbw: float, ranks: int) -> float:
    """Return nccl-tests' bus bandwidth for an algorithm bandwidth (bytes / time) at ``ranks``."""
    return algbw * ring_factor(ranks)


def algorithm_bandwidth(busbw: float, ranks: int) -> float:
    """Return the algorithm bandwidth (bytes / time) that a bus bandwidth gives at ``ranks`` (at least 2)."""
    if ranks < 2:
        raise ValueError("one rank moves nothing: no algorithm bandwidth follows from a bus bandwidth")
    return busbw / ring_factor(ranks)


def scale_time_to_ranks(seconds: float, measured_ranks: int, ranks: int) -> float:
    """Return the time at ``ranks`` of an allreduce that took ``seconds`` at ``measured_ranks``,
    the bus bandwidth held: 0 at one rank."""
    if measured_ranks < 2:
        raise ValueError("a time measured at one rank holds no communication to scale")
    return seconds * ring_factor(ranks) / ring_factor(measured_ranks)


@dataclasses.dataclass(frozen=True)
class MeasuredCurve:
    """Allreduce seconds by message bytes, measured at ``ranks`` ranks (sizes ascending, distinct)."""

    label: str  # the file's name, as outputs show it
    ranks: int
    sizes: Tuple[int, ...]
    seconds: Tuple[float, ...]
    source: str  # the file and what it holds, for the assumptions
    # What hpdl's engine adds to each allreduce at this placement (its negotiation, its thread's
    # wake-ups, the fusion copies, the completion), where the file timed the engine's path beside
    # the raw backend's in one run: the median over sizes of the difference. None: not measured.
    engine_overhead_s: Optional[float] = None

    def __post_init__(self) -> None:
        if self.ranks < 2:
            raise CurveError(f"{self.source}: measured at {self.ranks} rank(s), which moves nothing; "
                             "measure at 2 or more ranks")
        if not self.sizes or len(self.sizes) != len(self.seconds):
            raise CurveError(f"{self.source}: no measured sizes")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:])) or self.sizes[0] <= 0:
            raise CurveError(f"{self.source}: sizes must be positive, distinct and ascending")
        bad = [(n, t) for n, t in zip(self.sizes, self.seconds) if not (t > 0 and math.isfinite(t))]
        if bad:
            raise CurveError(f"{self.source}: size {bad[0][0]} B has a time of {bad[0][1]} s; times must be positive")

    def time(self, nbytes: float, extrapolate: bool = False) -> float:
        """Return the seconds of one allreduce of ``nbytes`` at the measured rank count.

        Raises:
            CurveError: ``nbytes`` lies outside the measured sizes and ``extrapolate`` is false.
        """
        if nbytes < 0:
            raise ValueError(f"a message of {nbytes} bytes")
        low, high = self.sizes[0], self.sizes[-1]
        if nbytes < low or nbytes > high:
            if not extrapolate:
                shown = f"{nbytes:.0f}" if nbytes == int(nbytes) else f"{nbytes:.1f}"
                raise CurveError(f"{self.label}: {shown} B lies outside the measured {low}-{high} B "
                                 f"(measure that range, or allow extrapolation)")
            # Above: the largest size's algorithm bandwidth held. Below: its smallest time, a floor.
            return self.seconds[-1] * nbytes / high if nbytes > high else self.seconds[0]
        i = bisect.bisect_left(self.sizes, nbytes)
        if self.sizes[i] == nbytes:
            return self.seconds[i]
        (n0, t0), (n1, t1) = (self.sizes[i - 1], self.seconds[i - 1]), (self.sizes[i], self.seconds[i])
        slope = math.log(t1 / t0) / math.log(n1 / n0)
        return t0 * (nbytes / n0) ** slope

    def time_at_ranks(self, nbytes: float, ranks: int, extrapolate: bool = False) -> float:
        """Return the seconds of one allreduce of ``nbytes`` at ``ranks``, scaled by bus bandwidth."""
        if ranks == 1:
            return 0.0
        return scale_time_to_ranks(self.time(nbytes, extrapolate), self.ranks, ranks)

    def outside(self, nbytes: float) -> bool:
        """Whether ``nbytes`` lies outside the measured sizes (so answering it extrapolates)."""
        return nbytes < self.sizes[0] or nbytes > self.sizes[-1]

    def describe(self) -> str:
        """One line: what was measured, over which sizes and ranks."""
        return f"{self.label}: measured at {self.ranks} ranks, {self.sizes[0]}-{self.sizes[-1]} B ({self.source})"


def read_curve(file: str, ranks: Optional[int] = None, bench_path: Optional[str] = None) -> MeasuredCurve:
    """Read a curve from either format, told apart by content: JSON is hpdl's, text is OSU's.

    Args:
        file: the file to read.
        ranks: the rank count, which OSU's text lacks (for hpdl's JSON, it must agree with the file's).
        bench_path: which of hpdl's paths to take (see :func:`read_bench_curve`).
    """
    text = _read_text(file)
    if text.lstrip().startswith("{"):
        curve = _bench_curve(text, file, bench_path)
        if ranks is not None and ranks != curve.ranks:
            raise CurveError(f"{file} was measured at {curve.ranks} ranks (its 'ranks'), not {ranks}; "
                             "drop the rank count for hpdl's JSON")
        return curve
    if ranks is None:
        raise CurveError(f"{file}: osu_allreduce output does not say how many ranks ran it; "
                         "give the rank count (FILE@RANKS)")
    return _osu_curve(text, file, ranks)


def read_bench_curve(file: str, bench_path: Optional[str] = None) -> MeasuredCurve:
    """Read ``hpdl bench allreduce --json`` output as a curve of one of its paths.

    Args:
        bench_path: the path (backend, hierarchical, engine, mpi4py) to take; by default the
            only one, else ``backend``, the raw collective: the engine's own overhead is what a
            prediction replays, so a curve through the engine would count it twice.
    """
    return _bench_curve(_read_text(file), file, bench_path)


def read_osu_curve(file: str, ranks: int) -> MeasuredCurve:
    """Read OSU ``osu_allreduce`` output (its Avg Latency(us) column) measured at ``ranks`` ranks."""
    return _osu_curve(_read_text(file), file, ranks)


def _read_text(file: str) -> str:
    try:
        return read_file(file, "measured curve").decode("utf-8")
    except ProfileError as err:
        raise CurveError(str(err)) from None
    except UnicodeDecodeError:
        raise CurveError(f"{file} is not text: give hpdl bench allreduce --json or osu_allreduce output") from None


def _bench_curve(text: str, file: str, bench_path: Optional[str]) -> MeasuredCurve:
    what = "not `hpdl bench allreduce --json` output"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise CurveError(f"{file} is {what}: {err.msg} at line {err.lineno}") from None
    records = data.get("records") if isinstance(data, dict) and data.get("benchmark") == "allreduce" else None
    ranks = data.get("ranks") if isinstance(data, dict) else None
    if not isinstance(records, list) or not records or not isinstance(ranks, int):
        raise CurveError(f"{file} is {what} (no 'benchmark': 'allreduce' with 'ranks' and 'records')")
    try:
        paths = list(dict.fromkeys(str(r["path"]) for r in records))
        chosen = _choose_path(file, paths, bench_path)
        mine = [r for r in records if r["path"] == chosen]
        tensors = {int(r.get("tensors", 1)) for r in mine}
        points = sorted((int(r["size"]), float(r["avg_us"]) * 1e-6) for r in mine)
    except (KeyError, TypeError, ValueError) as err:
        raise CurveError(f"{file}: a record lacks a usable {err}") from None
    if tensors != {1}:
        # Several tensors per timed call are several allreduces (or one fused): not one message's time.
        raise CurveError(f"{file}: path {chosen} timed {max(tensors)} tensors per call; "
                         "a curve needs one allreduce per call (--tensors 1)")
    overhead = _engine_overhead(records, points) if chosen == "backend" and "engine" in paths else None
    return MeasuredCurve(os.path.basename(file), ranks, *_columns(file, points),
                         source=f"{file}: hpdl bench allreduce, path {chosen}, {data.get('backend', '?')}"
                                + (f", the engine's overhead {overhead * 1e3:.3g} ms" if overhead is not None else ""),
                         engine_overhead_s=overhead)


def _engine_overhead(records: List[dict], backend: List[Tuple[int, float]]) -> Optional[float]:
    """The median over the sizes both paths timed of the engine's time less the backend's (at
    least 0), or None where they share no size."""
    raw = dict(backend)
    differences = [float(r["avg_us"]) * 1e-6 - raw[int(r["size"])] for r in records
                   if r.get("path") == "engine" and int(r.get("tensors", 1)) == 1 and int(r["size"]) in raw]
    return max(0.0, statistics.median(differences)) if differences else None


def _choose_path(file: str, paths: List[str], wanted: Optional[str]) -> str:
    if wanted is not None:
        if wanted not in paths:
            raise CurveError(f"{file} has no path {wanted!r}; it has {', '.join(paths)}")
        return wanted
    if len(paths) == 1:
        return paths[0]
    if "backend" in paths:
        return "backend"
    raise CurveError(f"{file} holds the paths {', '.join(paths)}; name the one to use")


# The table's header, "# Size       Avg Latency(us)[   Min Latency(us) ...]" (the columns
# are separated by two or more spaces; -f adds Min, Max and Iterations).
_OSU_HEADER = re.compile(r"^\s*#?\s*Size\s{2,}.*Avg Latency\(us\)")
_OSU_TITLE = re.compile(r"^\s*#\s*OSU .*Latency Test")


def _osu_curve(text: str, file: str, ranks: int) -> MeasuredCurve:
    column = None
    points: List[Tuple[int, float]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if _OSU_TITLE.match(line) and "Allreduce" not in line:
            raise CurveError(f"{file}:{number}: {line.strip('# ').strip()!r} is not osu_allreduce's output")
        if _OSU_HEADER.match(line):
            if column is not None:
                raise CurveError(f"{file}:{number}: a second table; give one osu_allreduce run per file")
            column = re.split(r"\s{2,}", line.strip().lstrip("#").strip()).index("Avg Latency(us)")
            continue
        fields = line.split()
        # Data rows start with the size; anything else (titles, a launcher's messages) is passed over.
        if column is None or not fields or not fields[0].isdigit():
            continue
        try:
            size, seconds = int(fields[0]), float(fields[column]) * 1e-6
        except (IndexError, ValueError):
            raise CurveError(f"{file}:{number}: {line.strip()!r} is not a row of size and latency") from None
        if size > 0:  # a zero-byte row carries no bandwidth, and log-log has no place for it
            points.append((size, seconds))
    if column is None:
        raise CurveError(f"{file} has no '# Size  Avg Latency(us)' header: not osu_allreduce output")
    return MeasuredCurve(os.path.basename(file), ranks, *_columns(file, sorted(points)),
                         source=f"{file}: osu_allreduce at {ranks} ranks")


def _columns(file: str, points: Sequence[Tuple[int, float]]) -> Tuple[Tuple[int, ...], Tuple[float, ...]]:
    sizes = [n for n, _ in points]
    for a, b in zip(sizes, sizes[1:]):
        if a == b:
            raise CurveError(f"{file}: size {a} B appears twice; give one measurement per size")
    if not sizes:
        raise CurveError(f"{file}: no measured sizes")
    return tuple(sizes), tuple(t for _, t in points)
