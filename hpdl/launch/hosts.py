"""Host lists for `hpdl run`: the ``-H host1:2,host2:2`` form and hostfiles.

Parsing is pure (text in, :class:`HostList` out) so every error can name the exact place it
came from; :func:`read_hostfile` is the only function here that touches the disk. A hostfile
may mix three line forms, one host per line, with ``#`` comments::

    node1 slots=4      # Open MPI's form
    node2:4            # MPICH / Hydra's form
    node3              # one slot

The forms used are remembered (:attr:`HostList.styles`) so a launcher that understands all of
them natively can be handed the file itself instead of a long command-line list.
"""

from __future__ import annotations

import dataclasses
import re
from typing import FrozenSet, List, Optional, Tuple


class LaunchError(ValueError):
    """A launch request that cannot be turned into a command; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Host:
    """One machine and the number of ranks it may run."""

    name: str
    slots: int = 1


@dataclasses.dataclass(frozen=True)
class HostList:
    """Hosts in order, with the file they came from (if any) and the line forms used there."""

    hosts: Tuple[Host, ...]
    path: Optional[str] = None
    # Subset of {"bare", "colon", "slots"}: which hostfile line forms appeared.
    styles: FrozenSet[str] = frozenset()

    @property
    def total_slots(self) -> int:
        return sum(h.slots for h in self.hosts)

    @property
    def names(self) -> List[str]:
        return [h.name for h in self.hosts]

    @property
    def uniform_slots(self) -> Optional[int]:
        """The slot count shared by every host, or None if they differ."""
        counts = {h.slots for h in self.hosts}
        return counts.pop() if len(counts) == 1 else None

    def colon_form(self) -> str:
        """Return ``host1:2,host2:2``, the list form of Hydra's -hosts and Open MPI's -H."""
        return ",".join(f"{h.name}:{h.slots}" for h in self.hosts)

    def fill(self, np: int) -> List[Tuple[str, int]]:
        """Return (host, ranks) pairs placing ``np`` ranks on the hosts in order, slot by slot."""
        placed: List[Tuple[str, int]] = []
        left = np
        for host in self.hosts:
            if left <= 0:
                break
            take = min(host.slots, left)
            placed.append((host.name, take))
            left -= take
        return placed


# A host name or address: letters, digits and the punctuation that DNS names, IPv4 addresses
# and Slurm-style names use. Anything else (spaces, '=', ':') is a syntax error worth reporting.
_NAME = r"[A-Za-z0-9_.\-\[\]]+"
_BARE = re.compile(rf"({_NAME})")
_COLON = re.compile(rf"({_NAME}):(\S+)")
_SLOTS = re.compile(rf"({_NAME})\s+slots\s*=\s*(\S+)(?:\s+max[-_]slots\s*=\s*\d+)?")


def _slots(text: str, where: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise LaunchError(f"{where}: slot count {text!r} is not an integer") from None
    if value < 1:
        raise LaunchError(f"{where}: slot count must be at least 1, got {value}")
    return value


def parse_hosts(text: str) -> HostList:
    """Parse ``-H host1:2,host2:2`` (slots default to 1 where ``:n`` is absent).

    Raises:
        LaunchError: on an empty entry, a bad name or a bad slot count.
    """
    hosts: List[Host] = []
    for index, item in enumerate(text.split(","), start=1):
        item = item.strip()
        where = f"-H entry {index} ({item!r})" if item else f"-H entry {index}"
        if not item:
            raise LaunchError(f"{where} is empty; expected host or host:slots, comma-separated")
        match = _COLON.fullmatch(item)
        if match:
            hosts.append(Host(match.group(1), _slots(match.group(2), where)))
        elif _BARE.fullmatch(item):
            hosts.append(Host(item))
        else:
            raise LaunchError(f"{where}: cannot parse; expected host or host:slots")
    return HostList(tuple(hosts))


def parse_hostfile(text: str, path: str = "<hostfile>") -> HostList:
    """Parse hostfile text whose lines are ``host slots=N``, ``host:N`` or ``host``.

    Args:
        text: the file's contents.
        path: the file name, used in error messages (``path:line: ...``).

    Raises:
        LaunchError: naming the file and line of the first line that does not parse,
            or when the file lists no host.
    """
    hosts: List[Host] = []
    styles = set()
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{lineno}"
        for style, pattern in (("slots", _SLOTS), ("colon", _COLON), ("bare", _BARE)):
            match = pattern.fullmatch(line)
            if match:
                slots = _slots(match.group(2), where) if style != "bare" else 1
                hosts.append(Host(match.group(1), slots))
                styles.add(style)
                break
        else:
            raise LaunchError(
                f"{where}: cannot parse {line!r}; expected 'host slots=N', 'host:N' or 'host'"
            )
    if not hosts:
        raise LaunchError(f"{path}: lists no hosts")
    return HostList(tuple(hosts), path=path, styles=frozenset(styles))


def read_hostfile(path: str) -> HostList:
    """Read and parse the hostfile at ``path``."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as err:
        raise LaunchError(f"cannot read hostfile {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise LaunchError(f"cannot read hostfile {path}: not a text file (UTF-8)") from None
    return parse_hostfile(text, path)
