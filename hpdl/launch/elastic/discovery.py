"""Where an elastic job may run: the hosts and their slots, found again every second.

Two sources, one interface (:meth:`find` returns the hosts in order with their slots):

- ``--host-discovery-script S``, as horovodrun's: an executable that prints one ``host`` or
  ``host:slots`` line per available host (``--slots-per-host`` for the bare ones, else 1).
  A script that is missing or not executable, fails, hangs past its timeout, prints a line that
  does not parse, or prints no host at the start is refused in one line before anything starts;
  once the job runs, such a failure keeps the hosts last found and says so once.
- ``-H h1:2,h2:2`` (or a hostfile) with ``--min-np``: the same hosts for the whole job, which
  then has fault tolerance without scaling.
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Dict, Optional

from hpdl.launch.hosts import HostList, LaunchError

_LINE = re.compile(r"([A-Za-z0-9_.\-\[\]]+)(?::(-?\d+))?")


class DiscoveryError(LaunchError):
    """The discovery script could not tell the hosts; the message is one line naming it."""


class FixedHosts:
    """The hosts of ``-H`` or a hostfile, for the job's whole life."""

    def __init__(self, hosts: HostList):
        self._hosts = {h.name: h.slots for h in hosts.hosts}

    def find(self) -> Dict[str, int]:
        return dict(self._hosts)

    def describe(self) -> str:
        return "the hosts given"

    def hosts_phrase(self) -> str:
        return "the hosts given"


class DiscoveryScript:
    """``--host-discovery-script``: run it, read ``host[:slots]`` lines."""

    def __init__(self, path: str, slots_per_host: Optional[int] = None, timeout_s: float = 10.0):
        self.path = path
        self.slots_per_host = slots_per_host
        self.timeout_s = timeout_s

    def check(self) -> None:
        """Refuse a script that cannot be run at all (before anything starts)."""
        if not os.path.exists(self.path):
            raise DiscoveryError(f"--host-discovery-script {self.path}: no such file")
        if os.path.isdir(self.path) or not os.access(self.path, os.X_OK):
            raise DiscoveryError(f"--host-discovery-script {self.path}: not an executable file (chmod +x it)")

    def describe(self) -> str:
        return f"--host-discovery-script {self.path}"

    def hosts_phrase(self) -> str:
        return f"the hosts {self.describe()} lists"

    def find(self) -> Dict[str, int]:
        """The hosts the script lists now, in its order, with their slots.

        Raises:
            DiscoveryError: the script failed, hung or printed a line that does not parse.
        """
        where = f"--host-discovery-script {self.path}"
        try:
            done = subprocess.run([os.path.abspath(self.path)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, timeout=self.timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise DiscoveryError(f"{where} did not finish within {self.timeout_s:g} s "
                                 "(HPDL_ELASTIC_DISCOVERY_TIMEOUT)") from None
        except OSError as err:
            raise DiscoveryError(f"{where}: cannot run it: {err.strerror or err}") from None
        if done.returncode != 0:
            said = done.stderr.decode("utf-8", "replace").strip().splitlines()
            because = f": {said[-1]}" if said else ""
            raise DiscoveryError(f"{where} failed with exit code {done.returncode}{because}")
        hosts: Dict[str, int] = {}
        for number, line in enumerate(done.stdout.decode("utf-8", "replace").splitlines(), start=1):
            text = line.strip()
            if not text:
                continue
            match = _LINE.fullmatch(text)
            if match is None or (match.group(2) is not None and int(match.group(2)) < 1):
                raise DiscoveryError(f"{where}: output line {number} ({text!r}) is not 'host' or 'host:slots' "
                                     "with slots of at least 1")
            slots = int(match.group(2)) if match.group(2) else (self.slots_per_host or 1)
            hosts[match.group(1)] = slots
        return hosts
