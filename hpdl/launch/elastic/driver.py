"""The elastic driver: starts workers on the hosts found, forms each generation of the world,
and keeps the job going as workers fail and hosts come and go (horovodrun's elastic mode).

It owns the workers (started, polled and ended through a :class:`WorkerStarter`: processes
for `hpdl run`, Ray actors for hpdl.ray) and the assignment of ranks, nothing else: the store is torch's
``TCPStore`` (hosted here), the keys are :mod:`hpdl.comm.rendezvous`'s, and each generation's
process group meets through gloo's (or nccl's) own rendezvous on that store. One thread runs
the loop below every ``_TICK_S``:

1. reap workers that ended. A worker of the current generation that failed (an exit code other
   than 0, a signal, its remote shell gone with its host) blacklists its host, ends the
   generation (every survivor's next collective raises HorovodInternalError), and a new
   generation is published with the survivors, oldest first, plus new workers in free slots.
   A worker that ended with 0 finished the training: the job ends when the rest of its
   generation has, and no reset happens from then on.
2. a generation ended by a worker (a collective failed where no process died) is formed again
   with the same workers, once a moment has shown that none of them died.
3. every discovery interval: hosts found again, blacklisted hosts re-admitted after their
   cooldown; hosts removed take their workers out of the next generation (no rollback: the
   survivors raise HostsUpdatedInterrupt at their next commit), free slots get new workers
   (likewise, and the new workers receive the state by broadcast).

The job ends with one line and exit status 1 when the reset limit is passed, when fewer than
``--min-np`` workers can be had for ``--elastic-timeout`` seconds, when every host is
blacklisted, or when every worker of a generation failed (the state went with them).
"""

from __future__ import annotations

import dataclasses
import datetime
import random
import signal
import sys
import threading
import time
from typing import Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

from hpdl.comm.rendezvous import STORE_VARIABLE, WORKER_VARIABLE, Rendezvous, Slot, assign_slots
from hpdl.launch.elastic.discovery import DiscoveryError
from hpdl.launch.elastic.workers import WorkerHandle, WorkerStarter, WorkerStartError

_TICK_S = 0.05
_KILL_AFTER_S = 5.0  # from SIGTERM to SIGKILL when the driver ends workers
_QUIET_DEATHS_S = 0.5  # a generation a worker ended: how long to look for a death that explains it

# How `hpdl run` spells the options the driver's messages name (hpdl.ray gives its own).
RUN_SPELLING = {"min_np": "--min-np", "max_np": "--max-np", "elastic_timeout": "--elastic-timeout",
                "reset_limit": "--reset-limit"}


class HostSource(Protocol):
    """Where workers may run: hosts in order with their slots (discovery.py, hpdl.ray)."""

    def find(self) -> Dict[str, int]:
        """The hosts now, each with its slots.

        Raises:
            DiscoveryError: the hosts cannot be told now.
        """

    def describe(self) -> str:
        """What finds the hosts, for messages ("--host-discovery-script ./hosts.sh")."""

    def hosts_phrase(self) -> str:
        """The hosts themselves, for "N slot(s) usable on ..." ("the hosts given", "the hosts
        --host-discovery-script ./hosts.sh lists")."""


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
    """What the job was asked for, checked (options.py builds `hpdl run`'s, hpdl.ray its own)."""

    np: int  # the world's size at the start, where the hosts have the slots
    min_np: int
    max_np: int
    hosts: HostSource
    elastic_timeout_s: float = 600.0
    reset_limit: Optional[int] = None
    cooldown_range_s: Optional[Tuple[float, float]] = None
    discovery_interval_s: float = 1.0
    verbose: bool = False
    speaker: str = "hpdl run"  # what the driver's lines start with
    spelling: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(RUN_SPELLING))


class ElasticJobError(RuntimeError):
    """The job cannot go on; the message is the one line the driver prints."""


@dataclasses.dataclass
class _Worker:
    id: int
    host: str
    proc: WorkerHandle
    removed: bool = False  # left out of the newest generation: its end is no failure
    ended_by_driver: bool = False
    kill_at: Optional[float] = None  # ended by the driver: SIGKILL then, if still running


@dataclasses.dataclass
class _Blacklisted:
    times: int
    until: float  # monotonic time it is re-admitted (inf: never)


class ElasticDriver:
    def __init__(self, options: ElasticOptions, starter: WorkerStarter):
        self.options = options
        self.starter = starter
        self.workers: Dict[int, _Worker] = {}
        self._next_id = 0
        self.generation = -1
        self.members: List[Slot] = []
        self.resets = 0
        self.blacklist: Dict[str, _Blacklisted] = {}
        self.hosts: Dict[str, int] = {}
        self._host_updates = 0
        self._finishing: Optional[List[int]] = None  # the workers whose end ends the job
        self._status = 0
        self._short_since: Optional[float] = None  # since when fewer than min_np can be had
        self._quiet_end_since: Optional[float] = None
        self._discovery_warned = False
        self._store = None
        self.rendezvous: Optional[Rendezvous] = None
        self._ending_signal: Optional[int] = None
        self._formed = -1  # the newest generation seen formed (every member came)
        self.holders: set = set()  # workers that were in a formed generation: they hold the training state
        self.final_members: List[Slot] = []  # the generation the training returned in, once it has

    # -- the job ---------------------------------------------------------------------------

    def run(self) -> int:
        """Run the job to its end; return its exit status (an end that is no worker's: one
        line on stderr and status 1, or 130 after Ctrl-C)."""
        try:
            return self.run_job()
        except ElasticJobError as err:
            sys.stderr.write(f"{self.options.speaker}: error: {err}\n")
            sys.stderr.flush()
            return 130 if self._ending_signal == signal.SIGINT else 1

    @property
    def ending_signal(self) -> Optional[int]:
        """The signal (SIGINT, SIGTERM) that ended the job, if one did."""
        return self._ending_signal

    def run_job(self) -> int:
        """Run the job to its end; return the status of its workers' end (0, or the first
        failure's after the training returned).

        Raises:
            ElasticJobError: the job cannot go on (every worker has been ended).
        """
        from torch.distributed import TCPStore

        self.hosts = self._find_hosts(first=True)
        bind, address = self.starter.store_address(self.hosts)
        self._store = TCPStore(bind, 0, is_master=True, timeout=datetime.timedelta(seconds=30),
                               wait_for_workers=False)
        self.store_address = f"{address}:{self._store.port}"
        self.rendezvous = Rendezvous(self._store)
        handlers = {}
        if threading.current_thread() is threading.main_thread():  # only it may set handlers
            handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._start()
            next_discovery = time.monotonic() + self.options.discovery_interval_s
            while True:
                if self._ending_signal is not None:
                    raise ElasticJobError(f"ended by {signal.Signals(self._ending_signal).name}")
                self._note_formed()
                self._reap()
                self._kill_the_stopped()
                if self._finishing is not None:
                    if all(self.workers[w].proc.poll() is not None for w in self._finishing if w in self.workers):
                        self._end_all()
                        return self._status
                else:
                    self._look_at_quiet_ends()
                    if time.monotonic() >= next_discovery:
                        next_discovery = time.monotonic() + self.options.discovery_interval_s
                        self._rediscover()
                    if self._short_since is not None:
                        self._try_to_form()
                time.sleep(_TICK_S)
        except BaseException:
            self._end_all()
            raise
        finally:
            for s, handler in handlers.items():
                signal.signal(s, handler)

    def _on_signal(self, signum: int, _frame) -> None:
        self._ending_signal = signum

    def _start(self) -> None:
        deadline = time.monotonic() + self.options.elastic_timeout_s
        while self._available_slots() < self.options.min_np:
            if time.monotonic() > deadline:
                raise ElasticJobError(self._too_few())
            time.sleep(self.options.discovery_interval_s)
            self.hosts = self._find_hosts()
        self._new_generation([], reason=None, target=self.options.np)

    # -- generations -------------------------------------------------------------------------

    def _active(self) -> List[_Worker]:
        return [w for w in self.workers.values() if not w.removed and w.proc.poll() is None]

    def _usable(self, host: str) -> bool:
        return host in self.hosts and host not in self.blacklist

    def _available_slots(self) -> int:
        return sum(slots for host, slots in self.hosts.items() if self._usable(host))

    def _new_generation(self, survivors: List[_Worker], reason: Optional[str], target: Optional[int] = None) -> bool:
        """Publish the next generation: ``survivors`` plus new workers in free slots, up to
        ``target`` (default --max-np); False (and nothing published) when fewer than --min-np."""
        target = self.options.max_np if target is None else min(target, self.options.max_np)
        placed: Dict[str, int] = {}
        for worker in survivors:
            placed[worker.host] = placed.get(worker.host, 0) + 1
        new_places = []
        for host, slots in self.hosts.items():
            if not self._usable(host):
                continue
            for _ in range(slots - placed.get(host, 0)):
                if len(survivors) + len(new_places) >= target:
                    break
                new_places.append(host)
        if len(survivors) + len(new_places) < self.options.min_np:
            if self._short_since is None:
                self._short_since = time.monotonic()
            if time.monotonic() - self._short_since > self.options.elastic_timeout_s:
                raise ElasticJobError(self._too_few())
            return False
        self._short_since = None
        if self.generation >= 0:
            self.resets += 1
            limit = self.options.reset_limit
            if limit is not None and self.resets > limit:
                raise ElasticJobError(f"the job would reset a {self._ordinal(self.resets)} time, past "
                                      f"{self.options.spelling['reset_limit']} "
                                      f"{limit}{f' ({reason})' if reason else ''}")
        new_ids = list(range(self._next_id, self._next_id + len(new_places)))
        self.members = assign_slots([(w.id, w.host) for w in survivors] + list(zip(new_ids, new_places)))
        places = {slot.worker: slot for slot in self.members}
        for worker_id in new_ids:
            self._spawn(places[worker_id])
        self.generation += 1
        self.rendezvous.publish(self.generation, self.members)
        if self.generation == 0:  # every first worker builds the starting state itself
            self.holders.update(self._current_ids())
        if self.options.verbose or self.generation > 0:
            hosts = sorted({s.hostname for s in self.members})
            self._say(f"generation {self.generation}: {len(self.members)} worker(s) on {', '.join(hosts)}")
        return True

    @staticmethod
    def _ordinal(n: int) -> str:
        return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"

    def _try_to_form(self) -> None:
        """Fewer than --min-np could be had: try again with the hosts found since."""
        self._new_generation(sorted(self._active(), key=lambda w: w.id), reason="hosts came back")

    def _note_formed(self) -> None:
        """Mark the members of the current generation as holders of the state once it formed."""
        if self._formed < self.generation and self.rendezvous.arrived(self.generation) >= len(self.members):
            self._formed = self.generation
            self.holders.update(self._current_ids())

    def _current_ids(self) -> List[int]:
        return [s.worker for s in self.members]

    # -- workers -------------------------------------------------------------------------------

    def _spawn(self, slot: Slot) -> _Worker:
        """Start the worker of ``slot`` (a new id): it reads its place again at every hvd.init()."""
        worker_id, host = slot.worker, slot.hostname
        self._next_id = worker_id + 1
        variables = dict(slot.horovod_environment())  # for scripts that read them before hvd.init()
        variables.update({STORE_VARIABLE: self.store_address, WORKER_VARIABLE: str(worker_id),
                          "HPDL_ELASTIC_TIMEOUT": f"{self.options.elastic_timeout_s:g}"})
        try:
            handle = self.starter.start(worker_id, host, variables)
        except WorkerStartError as err:
            raise ElasticJobError(str(err)) from None
        worker = _Worker(worker_id, host, handle)
        self.workers[worker_id] = worker
        return worker

    def _reap(self) -> None:
        """Act on the workers that ended since the last look."""
        failed: List[Tuple[_Worker, int]] = []
        for worker in list(self.workers.values()):
            code = worker.proc.poll()
            if code is None:
                continue
            del self.workers[worker.id]
            if worker.removed or worker.ended_by_driver:
                continue
            if code == 0:
                if self._finishing is None:
                    self._finish(worker)
                continue
            if self._finishing is not None:  # after the training returned: the job's status
                self._status = self._status or (128 - code if code < 0 else code)
                self._say(f"worker {worker.id} (host {worker.host}) {worker.proc.ending(code)}")
                continue
            failed.append((worker, code))
        if failed and self._finishing is None:
            self._fail(failed)

    def _finish(self, worker: _Worker) -> None:
        """``worker`` ended with 0: the training returned. The job ends with the rest of the
        generation it returned in; workers started for a newer one, which will not form now,
        are ended."""
        generation = self.rendezvous.left_in(worker.id)
        if generation is None:  # a script without hvd.elastic.run: the newest world that formed
            generation = max(self._formed, 0)
        self.final_members = list(self.rendezvous.members(generation))
        members = {s.worker for s in self.final_members}
        self._finishing = sorted(members)
        for other in self._active():
            if other.id not in members:
                self._stop(other)

    def _fail(self, failed: List[Tuple[_Worker, int]]) -> None:
        """Workers of the current generation failed: blacklist their hosts, go on without them."""
        now = time.monotonic()
        words = []
        for worker, code in failed:
            rank = next((s.rank for s in self.members if s.worker == worker.id), None)
            at = f", rank {rank}" if rank is not None else ""
            words.append(f"worker {worker.id} (host {worker.host}{at}) {worker.proc.ending(code)}")
            self._blacklist(worker.host, now)
        reason = "; ".join(words)
        self.rendezvous.end(self.generation, reason)
        for worker in self._active():
            if worker.host in self.blacklist:  # its host is out: so are its other workers
                self._stop(worker)
        survivors = sorted(self._active(), key=lambda w: w.id)
        if not any(h for h in self.hosts if self._usable(h)) and not survivors:
            raise ElasticJobError(f"every host is blacklisted ({reason})")
        if not [w for w in survivors if w.id in self.holders]:
            raise ElasticJobError(f"every worker that held the training state failed ({reason})")
        self._say(f"{reason}; going on without it" if len(failed) == 1 else f"{reason}; going on without them")
        self._new_generation(survivors, reason=reason)

    def _blacklist(self, host: str, now: float) -> None:
        entry = self.blacklist.get(host)
        times = entry.times + 1 if entry else 1
        cooldown = self.options.cooldown_range_s
        if cooldown is None:
            until = float("inf")
        else:
            low, high = cooldown
            until = now + min(high, low * 2 ** (times - 1)) * random.uniform(1.0, 1.2) if low > 0 else now
        self.blacklist[host] = _Blacklisted(times, until)

    def _look_at_quiet_ends(self) -> None:
        """A worker ended the generation (its collective failed) with no worker dead: form it
        again with the same workers once a moment has shown that none of them died."""
        if self.generation < 0 or self._short_since is not None:
            return
        reason = self.rendezvous.ended(self.generation)
        if reason is None:
            self._quiet_end_since = None
            return
        if self._quiet_end_since is None:
            self._quiet_end_since = time.monotonic()
            return
        if time.monotonic() - self._quiet_end_since < _QUIET_DEATHS_S:
            return
        self._quiet_end_since = None
        self._say(f"generation {self.generation} ended: {reason}; forming it again")
        self._new_generation(sorted(self._active(), key=lambda w: w.id), reason=reason)

    # -- hosts -------------------------------------------------------------------------------

    def _find_hosts(self, first: bool = False) -> Dict[str, int]:
        try:
            hosts = self.options.hosts.find()
        except DiscoveryError as err:
            if first:
                raise
            if not self._discovery_warned:
                self._say(f"warning: {err}; keeping the hosts found before")
                self._discovery_warned = True
            return self.hosts
        if first and not hosts:
            raise DiscoveryError(f"{self.options.hosts.describe()} gave no host")
        self._discovery_warned = False
        return hosts

    def _rediscover(self) -> None:
        now = time.monotonic()
        for host, entry in list(self.blacklist.items()):
            if entry.until <= now:
                del self.blacklist[host]  # cooled down: admitted again (its count kept for the next time)
                self._say(f"host {host} is admitted again after its cooldown")
        self.hosts = self._find_hosts()
        if self._short_since is not None:
            return
        active = sorted(self._active(), key=lambda w: w.id)
        gone = [w for w in active if not self._usable(w.host) and w.host not in self.blacklist]
        staying = [w for w in active if w not in gone]
        free = sum(max(0, self.hosts[h] - sum(1 for w in staying if w.host == h)) for h in self.hosts if self._usable(h))
        grows = len(staying) < self.options.max_np and free > 0
        if not gone and not grows:
            return
        for worker in gone:
            worker.removed = True  # it leaves at its next commit (NotInWorld) or when its host goes
        if gone:
            self._say(f"host(s) {', '.join(sorted({w.host for w in gone}))} removed by {self.options.hosts.describe()}")
        before = len(self.members)
        if not self._new_generation(staying, reason="hosts changed"):
            return
        added = len(self.members) > len(staying)
        self._host_updates += 1
        self.rendezvous.hosts_updated(self._host_updates, added)
        if added:
            self._say(f"hosts added: {before} -> {len(self.members)} worker(s) at the next commit")

    def _too_few(self) -> str:
        usable = self._available_slots()
        names = self.options.spelling
        where = self.options.hosts.hosts_phrase()
        return (f"fewer than {names['min_np']} {self.options.min_np} workers for {names['elastic_timeout']} "
                f"{self.options.elastic_timeout_s:g} s ({usable} slot(s) usable on {where}"
                f"{', some blacklisted' if self.blacklist else ''})")

    # -- ending ------------------------------------------------------------------------------

    def _stop(self, worker: _Worker) -> None:
        """End ``worker`` (SIGTERM, SIGKILL ``_KILL_AFTER_S`` later: see :meth:`_kill_the_stopped`)."""
        worker.ended_by_driver = worker.removed = True
        worker.kill_at = time.monotonic() + _KILL_AFTER_S
        worker.proc.terminate()

    def _kill_the_stopped(self) -> None:
        now = time.monotonic()
        for worker in self.workers.values():
            if worker.kill_at is not None and now > worker.kill_at and worker.proc.poll() is None:
                worker.proc.kill()
                worker.kill_at = None

    def _end_all(self) -> None:
        """End every worker still running (SIGTERM, then SIGKILL) and wait for them."""
        running = [w for w in self.workers.values() if w.proc.poll() is None]
        for worker in running:
            self._stop(worker)
        deadline = time.monotonic() + _KILL_AFTER_S
        while any(w.proc.poll() is None for w in running) and time.monotonic() < deadline:
            time.sleep(_TICK_S)
        for worker in running:
            if worker.proc.poll() is None:
                worker.proc.kill()
        deadline = time.monotonic() + _KILL_AFTER_S
        while any(w.proc.poll() is None for w in running) and time.monotonic() < deadline:
            time.sleep(_TICK_S)

    def _say(self, line: str) -> None:
        sys.stderr.write(f"{self.options.speaker}: {line}\n")
        sys.stderr.flush()


def run_elastic(options: ElasticOptions, starter: WorkerStarter) -> int:
    """Run an elastic job (``hpdl run --min-np ...``) to its end; return its exit status."""
    return ElasticDriver(options, starter).run()


__all__: Sequence[str] = ("ElasticDriver", "ElasticJobError", "ElasticOptions", "run_elastic")
