"""The profile file: its format name, schema version, table columns, and a validating loader.

A profile is one JSON object (docs/profile.md describes every field):

- ``format`` ("hpdl-profile") and ``version`` (an integer, :data:`VERSION`): readers refuse
  other formats and newer versions;
- ``job``: ranks, backend, hosts, the engine settings, when it was recorded, the windows;
- ``ranks``: one object per rank recorded, each with its clock offset, a ``tensors`` name
  table and four tables stored by columns (``{"columns": [...], "rows": [[...], ...]}``):
  ``messages`` (per distinct backend message, totals over the whole run), ``tensors_time``
  (per tensor, totals), ``steps`` (the last steps) and ``collectives`` (the last raw
  collectives, with when each member tensor was submitted: a gradient's ready time); and, of a spatial-parallel job, three tables of the communication its
  spatial groups did outside the engine (halo exchanges and the groups' collectives):
  ``spatial_layers`` (per layer, totals), ``spatial_steps`` (per step and kind) and
  ``spatial_events`` (the last raw ones). Files without them (older, or of other jobs) read
  as having none.

Times in ``steps`` and ``collectives`` are microseconds since the job's origin (rank 0's clock
when recording started), corrected by each rank's clock offset.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any, Dict, Iterator, List, Sequence

FORMAT = "hpdl-profile"
VERSION = 3  # 2: steps.core_wait_us; 3: collectives.member_ready_us

MESSAGE_COLUMNS = ("kind", "backend", "dtype", "bytes", "tensors", "calls", "backend_us", "copy_in_us",
                   "copy_out_us", "queue_us", "negotiate_us", "min_us", "max_us")
TENSOR_COLUMNS = ("name", "kind", "bytes", "calls", "time_us")
STEP_COLUMNS = ("step", "start_us", "end_us", "blocked_us", "comm_us", "messages", "bytes", "core_wait_us")
# Version 1's steps, read as version 2's with core_wait_us unknown (null).
_STEP_COLUMNS_V1 = STEP_COLUMNS[:-1]
COLLECTIVE_COLUMNS = ("seq", "step", "process_set", "kind", "backend", "dtype", "bytes", "tensors", "names",
                      "sizes", "ready_us", "queue_us", "negotiate_us", "start_us", "copy_in_us", "backend_us",
                      "copy_out_us", "member_ready_us")
# Version 2's collectives, read as version 3's with each member's submission unknown ([]).
_COLLECTIVE_COLUMNS_V2 = COLLECTIVE_COLUMNS[:-1]
# A spatial group's communication outside the engine (events.GROUP_KINDS): per layer (the
# event's name, its path in the model) and kind, totals; per step and kind; raw events.
SPATIAL_LAYER_COLUMNS = ("kind", "name", "op", "bytes", "calls", "time_us")
SPATIAL_STEP_COLUMNS = ("step", "kind", "calls", "bytes", "time_us")
SPATIAL_EVENT_COLUMNS = ("step", "kind", "op", "name", "bytes", "start_us", "duration_us")
TABLES = {"messages": MESSAGE_COLUMNS, "tensors_time": TENSOR_COLUMNS, "steps": STEP_COLUMNS,
          "collectives": COLLECTIVE_COLUMNS, "spatial_layers": SPATIAL_LAYER_COLUMNS,
          "spatial_steps": SPATIAL_STEP_COLUMNS, "spatial_events": SPATIAL_EVENT_COLUMNS}
# Tables added within version 2: a file without them (written before, or by a reader that
# drops them) is read as having empty ones.
OPTIONAL_TABLES = ("spatial_layers", "spatial_steps", "spatial_events")
# The name of the per-kind rows of tensors_time (and spatial_layers) that hold the tensors
# (layers) beyond the ones kept.
OTHER_TENSORS = "(other tensors)"
OTHER_LAYERS = "(other layers)"
_RANK_COUNTS = ("steps_dropped", "collectives_dropped", "tensors_folded", "layers_folded", "spatial_events_dropped")


# What each cell holds, where it is not a number: readers compute with the cells, so a file
# of the right shape but the wrong types is refused here, with the cell named.
_TEXT_COLUMNS = {"kind", "backend", "dtype", "op"}
_INTEGER_COLUMNS = {"name"}  # an index into the rank's name table
_LIST_COLUMNS = {"names": "integers", "sizes": "numbers", "member_ready_us": "numbers"}
# Numbers that may be unknown (null): where the platform cannot tell.
_OPTIONAL_COLUMNS = {"core_wait_us"}
# job.settings that readers compute with; the others are only shown.
_NUMERIC_SETTINGS = ("fusion_threshold", "inplace_threshold")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _cell_check(column: str):
    """A predicate for the cells of ``column`` and what it wants, for the error message."""
    if column in _TEXT_COLUMNS:
        return (lambda v: isinstance(v, str)), "a string"
    if column in _INTEGER_COLUMNS:
        return _is_integer, "an integer"
    if column in _LIST_COLUMNS:
        inner = _is_integer if _LIST_COLUMNS[column] == "integers" else _is_number
        return (lambda v: isinstance(v, list) and all(inner(x) for x in v)), f"a list of {_LIST_COLUMNS[column]}"
    if column in _OPTIONAL_COLUMNS:
        return (lambda v: v is None or _is_number(v)), "a number or null"
    return _is_number, "a number"


class ProfileError(ValueError):
    """A file that is not a readable hpdl profile."""


# What reading a loaded profile raises where one of its values is not what its schema says
# (a hand-edited or truncated file): the commands that read one turn them into one line.
UNUSABLE = (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError, AttributeError, OverflowError)


def unusable(path: str, err: BaseException) -> str:
    """The one line for a profile ``path`` whose reading raised ``err`` (one of :data:`UNUSABLE`)."""
    return f"{path}: profile has an unusable value ({type(err).__name__}: {err})"


def table(columns: Sequence[str], rows: List[list]) -> Dict[str, Any]:
    """Store ``rows`` by columns, as the file does."""
    return {"columns": list(columns), "rows": rows}


def records(rank: Dict[str, Any], name: str) -> Iterator[Dict[str, Any]]:
    """Yield the rows of one rank's table ``name`` as dicts keyed by column."""
    stored = rank[name]
    columns = stored["columns"]
    for row in stored["rows"]:
        yield dict(zip(columns, row))


def read_file(path: str, what: str) -> bytes:
    """The bytes of the regular file ``path``; ``what`` names it in errors ("profile").

    Raises:
        ProfileError: it cannot be read, or is no regular file: a FIFO would block the read
            until some writer came (forever, if none does), a device could be endless.
    """
    try:
        # Non-blocking, so that opening a FIFO without a writer returns instead of waiting.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise ProfileError(f"cannot read {what} {path}: {err.strerror or err}") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ProfileError(f"cannot read {what} {path}: is a directory")
        if not stat.S_ISREG(mode):
            raise ProfileError(f"cannot read {what} {path}: not a regular file (a FIFO or a device); "
                               "give the file itself")
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 24)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    except OSError as err:
        raise ProfileError(f"cannot read {what} {path}: {err.strerror or err}") from None
    finally:
        os.close(fd)


def load(path: str) -> Dict[str, Any]:
    """Read and check a profile file; raise :class:`ProfileError` naming the file and the fault."""
    try:
        text = read_file(path, "profile").decode("utf-8")
    except UnicodeDecodeError:
        raise ProfileError(f"{path} is not an hpdl profile (not text)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ProfileError(f"{path} is not complete JSON (truncated or damaged? {err}); "
                           "profiles are written at hvd.shutdown()") from None
    check(data, path)
    return data


def check(data: Any, path: str) -> None:
    """Raise :class:`ProfileError` unless ``data`` is a profile this version can read."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f"{path} is not an hpdl profile (no \"format\": \"{FORMAT}\")")
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ProfileError(f"{path}: key 'version' must be an integer, got {version!r}")
    if version < 1:
        raise ProfileError(f"{path}: key 'version' must be a schema version from 1, got {version}")
    if version > VERSION:
        raise ProfileError(f"{path} has profile schema version {version}, newer than this hpdl reads "
                           f"(up to {VERSION}): upgrade hpdl")
    job = data.get("job")
    if not isinstance(job, dict):
        raise ProfileError(f"{path}: key 'job' is missing or not an object")
    _check_job(job, path)
    ranks = data.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        raise ProfileError(f"{path}: key 'ranks' must be a non-empty list")
    seen = set()
    size = job.get("size")
    for i, rank in enumerate(ranks):
        if not isinstance(rank, dict) or not _is_integer(rank.get("rank")):
            raise ProfileError(f"{path}: ranks[{i}] is not a rank object with an integer 'rank'")
        # Figures are means over the ranks and match collectives by rank: a rank twice, or one
        # the job did not have, would be counted as another rank.
        if rank["rank"] in seen:
            raise ProfileError(f"{path}: ranks[{i}] is rank {rank['rank']} again")
        if rank["rank"] < 0 or (size is not None and rank["rank"] >= size):
            raise ProfileError(f"{path}: ranks[{i}] is rank {rank['rank']}, not a rank of a job of {size} ranks")
        seen.add(rank["rank"])
        tensors = rank.get("tensors")
        if not isinstance(tensors, list) or not all(isinstance(t, str) for t in tensors):
            raise ProfileError(f"{path}: ranks[{i}].tensors must be a list of names")
        for key in _RANK_COUNTS:
            if key in rank and not _is_integer(rank[key]):
                raise ProfileError(f"{path}: ranks[{i}].{key} must be an integer, got {_shown(rank[key])}")
        engine = rank.get("engine", {})
        if not isinstance(engine, dict) or not all(_is_number(v) for v in engine.values()):
            raise ProfileError(f"{path}: ranks[{i}].engine must be an object of counters (numbers)")
        if version == 1:
            _upgrade_steps_v1(rank)
        if version <= 2:
            _upgrade_collectives_v2(rank)
        for name in OPTIONAL_TABLES:
            if name not in rank:
                rank[name] = table(TABLES[name], [])
        for name, columns in TABLES.items():
            stored = rank.get(name)
            if not isinstance(stored, dict) or not isinstance(stored.get("rows"), list) \
                    or stored.get("columns") != list(columns):
                raise ProfileError(f"{path}: ranks[{i}].{name} must be a table with columns {', '.join(columns)}")
            rows = stored["rows"]
            if any(not isinstance(row, list) or len(row) != len(columns) for row in rows):
                raise ProfileError(f"{path}: ranks[{i}].{name} has a row without {len(columns)} values")
            for c, column in enumerate(columns):
                valid, wanted = _cell_check(column)
                for r, row in enumerate(rows):
                    if not valid(row[c]):
                        raise ProfileError(f"{path}: ranks[{i}].{name} row {r}: '{column}' must be {wanted}, "
                                           f"got {_shown(row[c])}")


def _upgrade_steps_v1(rank: Dict[str, Any]) -> None:
    """Read a version 1 rank's steps as version 2's: core_wait_us was not recorded (null)."""
    stored = rank.get("steps")
    if isinstance(stored, dict) and stored.get("columns") == list(_STEP_COLUMNS_V1) \
            and isinstance(stored.get("rows"), list):
        stored["columns"] = list(STEP_COLUMNS)
        stored["rows"] = [row + [None] if isinstance(row, list) else row for row in stored["rows"]]


def _upgrade_collectives_v2(rank: Dict[str, Any]) -> None:
    """Read a version 2 rank's collectives as version 3's: when each member was submitted was
    not recorded (an empty list: readers that need it, as `hpdl profile predict`, refuse)."""
    stored = rank.get("collectives")
    if isinstance(stored, dict) and stored.get("columns") == list(_COLLECTIVE_COLUMNS_V2) \
            and isinstance(stored.get("rows"), list):
        stored["columns"] = list(COLLECTIVE_COLUMNS)
        stored["rows"] = [row + [[]] if isinstance(row, list) else row for row in stored["rows"]]


def _check_job(job: Dict[str, Any], path: str) -> None:
    """Check the types of the job fields that readers use (any of them may be absent)."""
    wanted = {"size": (lambda v: _is_integer(v) and v > 0, "a positive integer"),
              "backend": (lambda v: isinstance(v, str), "a string"),
              "hosts": (lambda v: isinstance(v, list) and all(isinstance(h, str) for h in v), "a list of host names"),
              "missing_ranks": (lambda v: isinstance(v, list) and all(_is_integer(r) for r in v),
                                "a list of integers"),
              "settings": (lambda v: isinstance(v, dict) and all(_is_number(v.get(k, 0)) for k in _NUMERIC_SETTINGS),
                           f"an object (with numbers for {', '.join(_NUMERIC_SETTINGS)})")}
    for key, (valid, what) in wanted.items():
        if key in job and not valid(job[key]):
            raise ProfileError(f"{path}: job.{key} must be {what}, got {_shown(job[key])}")


def _shown(value: Any) -> str:
    """A value for an error message: as JSON writes it, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
