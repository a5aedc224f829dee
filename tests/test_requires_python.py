"""pyproject.toml's requires-python is true: the code uses no syntax, and none of the library
calls a contributor is likely to reach for (the table below), newer than the minimum it
declares. At 3.9 this fails: the engine calls int.bit_count and the profiler reads
threading.__excepthook__, both 3.10's. The suite itself runs on one Python (3.11 here)."""

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("hpdl", "scripts", "tests", "examples") for p in sorted((ROOT / d).rglob("*.py"))]

# A feature, the Python that brought it, and how it shows in source text.
FEATURES = [
    ("int.bit_count", (3, 10), r"\.bit_count\("),
    ("threading.__excepthook__", (3, 10), r"threading\.__excepthook__"),
    ("zip(strict=...)", (3, 10), r"\bzip\([^)]*\bstrict="),
    ("itertools.pairwise", (3, 10), r"\bpairwise\("),
    ("dataclass(slots=... / kw_only=...)", (3, 10), r"dataclass\([^)]*\b(slots|kw_only)="),
    ("tomllib", (3, 11), r"\bimport tomllib\b|\bfrom tomllib\b"),
    ("ExceptionGroup / except*", (3, 11), r"\bExceptionGroup\b|\bexcept\s*\*"),
    ("BaseException.add_note", (3, 11), r"\.add_note\("),
    ("enum.StrEnum", (3, 11), r"\bStrEnum\b"),
    ("typing.Self", (3, 11), r"\bfrom typing import[^\n]*\bSelf\b|typing\.Self\b"),
    ("datetime.UTC", (3, 11), r"\bdatetime\.UTC\b"),
    ("asyncio.TaskGroup", (3, 11), r"\bTaskGroup\b"),
    ("itertools.batched", (3, 12), r"\bbatched\("),
    ("typing.override", (3, 12), r"\bfrom typing import[^\n]*\boverride\b|typing\.override\b"),
]


def _declared_minimum():
    text = (ROOT / "pyproject.toml").read_text()
    major, minor = re.search(r'^requires-python\s*=\s*">=\s*(\d+)\.(\d+)"', text, re.MULTILINE).groups()
    return int(major), int(minor)


def test_the_code_needs_no_newer_python_than_declared():
    minimum = _declared_minimum()
    assert sys.version_info[:2] >= minimum
    newer = []
    for path in SOURCES:
        if path.name == Path(__file__).name:
            continue
        text = path.read_text()
        ast.parse(text, str(path), feature_version=minimum)  # syntax of a later Python fails here
        newer += [f"{path.relative_to(ROOT)}: {name} needs Python {'.'.join(map(str, since))}"
                  for name, since, pattern in FEATURES if since > minimum and re.search(pattern, text)]
    assert not newer, "\n".join(newer)

