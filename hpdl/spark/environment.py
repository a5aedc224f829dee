"""Whether this machine can start Spark from Python: pyspark installed, and a Java it runs on.

For `hpdl check` (and for the tests, which skip with the reason where Spark cannot start).
Nothing here imports pyspark or starts a JVM: the package's version and ``java -version`` tell.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from typing import List, Mapping, Optional, Tuple

from hpdl.launch.detect import detect_java, java_major


def pyspark_version() -> Optional[str]:
    """The installed pyspark's version, or None when it is not installed."""
    if importlib.util.find_spec("pyspark") is None:
        return None
    try:
        return importlib.metadata.version("pyspark")
    except importlib.metadata.PackageNotFoundError:  # importable from a Spark distribution's python/
        import pyspark

        return getattr(pyspark, "__version__", "unknown")


def java_needed(pyspark: str) -> int:
    """The oldest Java major version a pyspark release runs on: 17 from Spark 4, 8 before."""
    major = pyspark.split(".")[0]
    return 17 if major.isdigit() and int(major) >= 4 else 8


def spark_status(env: Optional[Mapping[str, str]] = None) -> List[Tuple[bool, str]]:
    """``(usable, description)`` of pyspark and of Java, in that order."""
    env = os.environ if env is None else env
    version = pyspark_version()
    if version is None:
        status = [(False, "pyspark (not installed: pip install 'hpdl[spark]')")]
    else:
        status = [(True, f"pyspark {version}")]
    path, java = detect_java(env)
    needed = java_needed(version) if version else 17
    where = "$JAVA_HOME/bin/java" if env.get("JAVA_HOME") else "java on PATH"
    if not path:
        status.append((False, f"Java (no {where}; Spark {version or '4'} needs Java {needed} or later)"))
    elif not java:
        status.append((False, f"Java ({path} printed no version)"))
    elif java_major(java) < needed:
        status.append((False, f"Java {java} ({path}; pyspark {version} needs Java {needed} or later)"))
    else:
        status.append((True, f"Java {java} ({path})"))
    return status


def spark_unusable_reason(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why Spark cannot start here (one line), or None when pyspark and Java are both usable."""
    missing = [text for ok, text in spark_status(env) if not ok]
    return "; ".join(missing) if missing else None
