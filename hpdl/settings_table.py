"""The README's table of settings, made from the settings' declarations (hpdl/config.py).

A test compares the README's table with :func:`table_lines`, so the table cannot drift from
the code; after changing a declaration, ``python -m hpdl.settings_table --write README.md``
rewrites the table in place (without ``--write`` it prints it).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence, Tuple

from hpdl.config import SPECS, SettingSpec, default, number_text, range_text

HEADER = ["| variable | default | range | `hpdl run` | meaning |", "|---|---|---|---|---|"]


def table_lines() -> List[str]:
    """The table's lines in Markdown: the header, then one row per setting in declaration order."""
    return HEADER + [_row(name, spec) for name, spec in SPECS.items()]


def _row(name: str, spec: SettingSpec) -> str:
    variables = ", ".join(f"`{variable}`" for variable in (spec.env, spec.horovod) if variable)
    cells = [variables, _code(_default_text(default(name))), _values(name, spec), _option(spec), spec.doc]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _default_text(value: object) -> str:
    if isinstance(value, bool):
        return str(int(value))
    return number_text(value) if isinstance(value, (int, float)) else str(value)


def _values(name: str, spec: SettingSpec) -> str:
    """The values a setting takes: its words, its range, or 0 or 1 for a switch."""
    words = ", ".join(f"`{word}`" for word in spec.choices)
    if spec.bound is not None:
        numbers = range_text(spec.bound)
        return f"{words} or {numbers}" if words else numbers
    if words:
        return words
    return "`0` or `1`" if isinstance(default(name), bool) else ""


def _option(spec: SettingSpec) -> str:
    if spec.run is None:
        return ""
    return f"`{spec.run.flags[0]}`" + (f" ({spec.run.unit})" if spec.run.unit else "")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def readme_table(text: str) -> List[str]:
    """The lines of the table of settings in ``text`` (the README), header included; [] if none."""
    lines = text.split("\n")
    span = _table_span(lines)
    return lines[span[0]:span[1]] if span else []


def replace_table(text: str) -> str:
    """``text`` (the README) with its table of settings replaced by :func:`table_lines`.

    Raises:
        ValueError: when ``text`` has no table that starts with :data:`HEADER`.
    """
    lines = text.split("\n")
    span = _table_span(lines)
    if span is None:
        raise ValueError(f"no table of settings (a line {HEADER[0]!r})")
    return "\n".join(lines[:span[0]] + table_lines() + lines[span[1]:])


def _table_span(lines: List[str]) -> Optional[Tuple[int, int]]:
    """Where the table of settings starts (its header) and ends (its first line after), or None."""
    if HEADER[0] not in lines:
        return None
    start = end = lines.index(HEADER[0])
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return start, end


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpdl.settings_table", description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="README", help="replace the table in this file instead of printing it")
    args = parser.parse_args(argv)
    if args.write is None:
        print("\n".join(table_lines()))
        return 0
    with open(args.write, encoding="utf-8") as f:
        text = f.read()
    try:
        new = replace_table(text)
    except ValueError as err:
        sys.stderr.write(f"{args.write}: {err}\n")
        return 2
    with open(args.write, "w", encoding="utf-8") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
