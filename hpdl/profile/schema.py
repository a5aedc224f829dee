"""The profile file: its format name, schema version, table columns, and a validating loader.

A profile is one JSON object (docs/profile.md describes every field):

- ``format`` ("hpdl-profile") and ``version`` (an integer, :data:`VERSION`): readers refuse
  other formats and newer versions;
- ``job``: ranks, backend, hosts, the engine settings, when it was recorded, the windows;
- ``ranks``: one object per rank recorded, each with its clock offset, a ``tensors`` name
  table and four tables stored by columns (``{"columns": [...], "rows": [[...], ...]}``):
  ``messages`` (per distinct backend message, totals over the whole run), ``tensors_time``
  (per tensor, totals), ``steps`` (the last steps) and ``collectives`` (the last raw
  collectives).

Times in ``steps`` and ``collectives`` are microseconds since the job's origin (rank 0's clock
when recording started), corrected by each rank's clock offset.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, List, Sequence

FORMAT = "hpdl-profile"
VERSION = 1

MESSAGE_COLUMNS = ("kind", "backend", "dtype", "bytes", "tensors", "calls", "backend_us", "copy_in_us",
                   "copy_out_us", "queue_us", "negotiate_us", "min_us", "max_us")
TENSOR_COLUMNS = ("name", "kind", "bytes", "calls", "time_us")
STEP_COLUMNS = ("step", "start_us", "end_us", "blocked_us", "comm_us", "messages", "bytes")
COLLECTIVE_COLUMNS = ("seq", "step", "process_set", "kind", "backend", "dtype", "bytes", "tensors", "names",
                      "sizes", "ready_us", "queue_us", "negotiate_us", "start_us", "copy_in_us", "backend_us",
                      "copy_out_us")
TABLES = {"messages": MESSAGE_COLUMNS, "tensors_time": TENSOR_COLUMNS, "steps": STEP_COLUMNS,
          "collectives": COLLECTIVE_COLUMNS}


class ProfileError(ValueError):
    """A file that is not a readable hpdl profile."""


def table(columns: Sequence[str], rows: List[list]) -> Dict[str, Any]:
    """Store ``rows`` by columns, as the file does."""
    return {"columns": list(columns), "rows": rows}


def records(rank: Dict[str, Any], name: str) -> Iterator[Dict[str, Any]]:
    """Yield the rows of one rank's table ``name`` as dicts keyed by column."""
    stored = rank[name]
    columns = stored["columns"]
    for row in stored["rows"]:
        yield dict(zip(columns, row))


def load(path: str) -> Dict[str, Any]:
    """Read and check a profile file; raise :class:`ProfileError` naming the file and the fault."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise ProfileError(f"cannot read profile {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise ProfileError(f"{path} is not an hpdl profile (not text)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ProfileError(f"{path} is not complete JSON (truncated or damaged? {err.msg} at line {err.lineno}); "
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
    if version > VERSION:
        raise ProfileError(f"{path} has profile schema version {version}, newer than this hpdl reads "
                           f"(up to {VERSION}): upgrade hpdl")
    if not isinstance(data.get("job"), dict):
        raise ProfileError(f"{path}: key 'job' is missing or not an object")
    ranks = data.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        raise ProfileError(f"{path}: key 'ranks' must be a non-empty list")
    for i, rank in enumerate(ranks):
        if not isinstance(rank, dict) or not isinstance(rank.get("rank"), int):
            raise ProfileError(f"{path}: ranks[{i}] is not a rank object with an integer 'rank'")
        if not isinstance(rank.get("tensors"), list):
            raise ProfileError(f"{path}: ranks[{i}].tensors must be a list of names")
        for name, columns in TABLES.items():
            stored = rank.get(name)
            if not isinstance(stored, dict) or not isinstance(stored.get("rows"), list) \
                    or stored.get("columns") != list(columns):
                raise ProfileError(f"{path}: ranks[{i}].{name} must be a table with columns {', '.join(columns)}")
            if any(not isinstance(row, list) or len(row) != len(columns) for row in stored["rows"]):
                raise ProfileError(f"{path}: ranks[{i}].{name} has a row without {len(columns)} values")
