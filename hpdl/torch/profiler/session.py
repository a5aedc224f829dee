"""One profile recording: start it on every rank, gather the ranks' records, write the file.

Started by ``HPDL_PROFILE`` (at ``hvd.init()``, through the start-up hook this module adds to
the runtime, as it adds its shutdown hook) or ``hvd.start_profile(path)``; every rank records.
The recording survives ``hvd.shutdown()`` / ``hvd.init()``: at each shutdown, before the
engine stops, the ranks' records are gathered to rank 0 through the engine (a collective
of every rank: an alltoall in which every rank sends its part to rank 0 alone, so only rank 0
holds them all) and rank 0 writes the whole recording so far to the file, replacing it
atomically; ``hvd.stop_profile()`` does the same and ends the recording.

When the gather is impossible (the engine failed: a stall timeout, a lost peer), each rank
writes its own part to ``FILE.rank<N>`` instead, itself a valid profile of one rank, at once,
from the thread that saw the failure (a stalled rank may never get further, and the job is
aborted soon after: ``hpdl.engine.abort``). Rank 0 waits a moment for the other parts, merges
the ones it finds into ``FILE`` (naming the missing ranks in ``job.missing_ranks``), removes
them and ends the recording.

The gather is skipped, and each rank writes its part the same way, when this process is dying
from an uncaught exception (``sys.excepthook`` or ``threading.excepthook`` saw it): the other
ranks may be waiting in a collective this rank will never submit, and a gather would wait with
them until ``HPDL_STALL_TIMEOUT``. A SIGTERM (a launcher ending the job because a rank failed,
a batch system's time limit) is taken as such an exit while recording: by default it would end
the process at once, writing nothing. Once this rank's engine stops, their collectives fail, their
gathers fail too and rank 0 merges the parts. A gather that has not finished within
``GATHER_DEADLINE_S`` (a rank that died some other way, or one far behind) is given up for the
same path; a rank far behind fails its gather only once rank 0 has written the file without
it, and then adds its part to that file where it can see it.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

import torch

from hpdl import __version__
from hpdl.atomic_file import atomic_write, make_directories
from hpdl.comm import objects
from hpdl.engine import abort
from hpdl.engine import events as ev
from hpdl.engine.errors import HorovodInternalError
from hpdl.output_files import same_file
from hpdl.profile import schema
from hpdl.profile.recorder import RAW_WINDOW, STEP_WINDOW, Recorder
from hpdl.torch import runtime
from hpdl.torch.mpi_ops import alltoall_async, poll, synchronize
from hpdl.torch.object_ops import broadcast_object
from hpdl.torch.profiler.clock import JobClock, estimate

__all__ = ["GATHER_DEADLINE_S", "Session", "active", "start_profile", "stop_profile", "write"]

_PART_WAIT_S = 2.0  # within abort's allowance for failure hooks
# Longer than a healthy gather takes (a few MB per rank) and than ranks usually drift apart
# before shutdown, far shorter than HPDL_STALL_TIMEOUT (documented in docs/profile.md).
GATHER_DEADLINE_S = 10.0
_SETTINGS = ("fusion_threshold", "inplace_threshold", "cycle_time_ms", "cache_capacity", "hierarchical_allreduce",
             "engine_nice")
# Engine counters summed over the engines a recording spans (its fusion-buffer size is a maximum).
_SUMMED = ("cycles", "backend_calls", "fused_calls", "tensors_reduced", "bytes_reduced", "fusion_buffer_hits",
           "fusion_buffer_misses", "fast_negotiations", "full_negotiations", "cache_hits", "cache_misses")


class Session:
    """The recording of this process, its file and what is known of the job."""

    def __init__(self, path: str, clock: JobClock, rank: int, size: int, backend: str):
        self.path = os.path.abspath(path)
        self.clock = clock
        self.rank = rank
        self.size = size
        self.backend = backend
        self.started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.recorder = Recorder(rank, clock.origin_us + clock.applied_offset(rank))
        self.engine_counters: Dict[str, int] = {}
        # Under autotuning: the fusion threshold and cycle time the engine ran with last.
        self.tuned: Dict[str, Any] = {}

    def part(self, engine_counters: Dict[str, int]) -> Dict[str, Any]:
        """This rank's object of ``ranks`` in the file."""
        out = self.recorder.snapshot()
        out.update(host=self.clock.hosts[self.rank], clock_offset_us=round(self.clock.offsets_us[self.rank], 1),
                   clock_offset_applied=self.clock.hosts[self.rank] != self.clock.hosts[0], engine=engine_counters)
        return out

    def counters(self, engine) -> Dict[str, int]:
        """The engine counters of this recording: earlier engines' plus the running one's."""
        total = dict(self.engine_counters)
        parameters = engine.parameters()
        self.tuned = {name: parameters[name] for name in ("fusion_threshold", "cycle_time_ms")}
        for key, value in engine.stats().items():
            if key in _SUMMED:
                total[key] = total.get(key, 0) + value
            elif key == "fusion_buffer_bytes":
                total[key] = max(total.get(key, 0), value)
        return total

    def _settings(self, settings) -> Dict[str, Any]:
        """The engine settings the recording ran with; autotuned ones as they were at its end."""
        out = {name: getattr(settings, name) for name in _SETTINGS}
        if settings.autotune:
            out["autotune"] = True
            out.update(self.tuned)
        return out

    def document(self, parts: List[Dict[str, Any]], settings) -> Dict[str, Any]:
        """The whole file: job fields and the ranks' parts."""
        present = {p["rank"] for p in parts}
        return {
            "format": schema.FORMAT,
            "version": schema.VERSION,
            "job": {
                "size": self.size, "backend": self.backend, "hosts": self.clock.hosts,
                "command": sys.argv, "hpdl_version": __version__, "started": self.started,
                "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "origin_us": self.clock.origin_us,
                "settings": self._settings(settings),
                "windows": {"steps": STEP_WINDOW, "collectives": RAW_WINDOW},
                "missing_ranks": [r for r in range(self.size) if r not in present],
            },
            "ranks": sorted(parts, key=lambda p: p["rank"]),
        }


_session: Optional[Session] = None
# Set by the exception hooks below: the process is dying from an uncaught exception.
_dying_from: Optional[str] = None
# The hooks that were installed when start() wrapped them (restored by _end()).
_previous_hooks: Optional[tuple] = None
# Whether start() installed _on_sigterm (in place of the default action; restored by _end()).
_sigterm_taken = False


def _note_uncaught(exc_type) -> None:
    global _dying_from
    if _dying_from is None:
        _dying_from = getattr(exc_type, "__name__", str(exc_type))


def _sys_excepthook(exc_type, exc, tb) -> None:
    _note_uncaught(exc_type)
    previous = _previous_hooks[0] if _previous_hooks else sys.__excepthook__
    previous(exc_type, exc, tb)


def _threading_excepthook(args) -> None:
    # SystemExit ends a thread quietly; anything else is a thread that died, whose peers may
    # wait for what it would have submitted.
    if args.exc_type is not SystemExit:
        _note_uncaught(args.exc_type)
    previous = _previous_hooks[1] if _previous_hooks else threading.__excepthook__
    previous(args)


def _wrap_excepthooks() -> None:
    """Note an uncaught exception, then hand it to whatever hook was installed before."""
    global _previous_hooks
    if _previous_hooks is None:
        _previous_hooks = (sys.excepthook, threading.excepthook)
        sys.excepthook = _sys_excepthook
        threading.excepthook = _threading_excepthook


def _on_sigterm(signum, frame) -> None:
    """End the process as SIGTERM would, through the exit path that writes this rank's part.

    Raised as ``SystemExit`` in the main thread, which unwinds it (releasing whatever locks it
    holds) to the interpreter's exit, where ``hvd.shutdown()`` writes the parts as for an
    uncaught exception. A second SIGTERM ends the process at once, as the default action does.
    """
    global _dying_from
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _session is None:  # the recording ended where the handler could not be put back
        os.kill(os.getpid(), signum)
        return
    if _dying_from is None:
        _dying_from = "SIGTERM"
    raise SystemExit(128 + signum)


def _take_sigterm() -> None:
    """Install _on_sigterm where SIGTERM has its default action (a handler of the job's own stays)."""
    global _sigterm_taken
    if _sigterm_taken or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
            _sigterm_taken = True
    except (ValueError, OSError):  # not the main interpreter, or no such signal here
        pass


def _release_sigterm() -> None:
    global _sigterm_taken
    # Only the main thread can; from another (a failure hook), _on_sigterm takes the default
    # action itself once no recording runs.
    if not _sigterm_taken or threading.current_thread() is not threading.main_thread():
        return
    _sigterm_taken = False
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _restore_excepthooks() -> None:
    """Put back the earlier hooks, unless someone has wrapped ours since (theirs calls ours then)."""
    global _previous_hooks
    if _previous_hooks is None:
        return
    if sys.excepthook is _sys_excepthook:
        sys.excepthook = _previous_hooks[0]
    if threading.excepthook is _threading_excepthook:
        threading.excepthook = _previous_hooks[1]
    if sys.excepthook is not _sys_excepthook and threading.excepthook is not _threading_excepthook:
        _previous_hooks = None


def active() -> Optional[Session]:
    """The running recording of this process, if any."""
    return _session


def start_profile(file_path: str) -> None:
    """Record every collective and step on every rank until stop_profile() (call it on every rank).

    At stop_profile() and at each shutdown() the ranks' records are gathered and rank 0
    writes them to ``file_path``; read it with ``hpdl profile report``. HPDL_PROFILE starts
    the same recording at init().

    Args:
        file_path: The profile rank 0 writes (JSON); docs/profile.md describes it.

    Raises:
        ValueError: hpdl is not initialized; a profile is already recording to another file;
            or rank 0 could not write ``file_path``, or it is the timeline's file (raised on
            every rank, before recording).
    """
    global _session
    timeline = runtime.engine().timeline_path  # raises when hpdl is not initialized
    if _session is not None:
        if _session.path == os.path.abspath(file_path):
            return
        raise ValueError(f"a profile is already recording to {_session.path}; call hvd.stop_profile() first")
    # Rank 0 writes the file, but every rank must learn that it cannot: otherwise the others
    # would wait in the clock's collectives for a rank that has given up. Found now, not after
    # the whole job (when the recording would be lost).
    unwritable = _unwritable(file_path, timeline) if runtime.rank() == 0 else None
    unwritable = broadcast_object(unwritable, root_rank=0, name="hpdl.profile.path")
    if unwritable is not None:
        raise ValueError(unwritable)
    clock = estimate()
    _session = Session(file_path, clock, runtime.rank(), runtime.size(), runtime.backend_name())
    ev.WAITS.take()
    ev.WAITS.enabled = True
    ev.subscribe(_session.recorder.observe)
    runtime.add_shutdown_hook(_at_shutdown, runtime.ShutdownStage.WRITE_RECORDS)
    abort.add_failure_hook(_at_failure)
    _wrap_excepthooks()
    _take_sigterm()


def _unwritable(path: str, timeline: Optional[str] = None) -> Optional[str]:
    """Why rank 0 could not write the profile to ``path``, or None: tried as the write will do it.

    Makes the missing directories (the write would make them too) and a temp file beside the
    target, then removes the temp file. ``timeline`` is the file the timeline is written to:
    the profile, replacing it at shutdown, would leave nothing of the timeline.
    """
    target = os.path.abspath(path)
    timeline = None if timeline is None else os.path.abspath(timeline)
    if os.path.isdir(target):
        return f"cannot write the profile to {target}: it is a directory; name a file"
    if timeline is not None and same_file(timeline, target):
        return (f"cannot write the profile to {target}: the timeline (HPDL_TIMELINE) is written there; "
                "give them different files")
    try:
        make_directories(os.path.dirname(target))
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(target), prefix=".hpdl-profile-probe."):
            pass  # removed on closing
    except OSError as err:
        return f"cannot write the profile to {target}: {err.strerror or err}"
    return None


def stop_profile() -> None:
    """Write the profile started by start_profile() or HPDL_PROFILE and stop recording (every rank).

    The profile is gathered to rank 0, which writes it; a no-op when none is recording.
    """
    session = _session
    if session is None:
        return
    try:
        if runtime.is_initialized():
            write(session)
    finally:
        _end(session)


def _end(session: Session) -> None:
    global _session
    if _session is session:
        _session = None
    ev.unsubscribe(session.recorder.observe)
    ev.WAITS.enabled = False
    runtime.remove_shutdown_hook(_at_shutdown)
    abort.remove_failure_hook(_at_failure)
    _restore_excepthooks()
    _release_sigterm()


def _at_failure() -> None:
    """The engine failed: write the profile now, from the thread that saw the failure.

    Every rank writes its part; rank 0 then merges the parts it finds. The recording ends here
    (after a failure the job is over), before the job's abort, which no later exit may outrun.
    """
    session = _session
    if session is not None:
        _write_parts(session, session.part(session.counters(runtime.engine())), runtime.settings())


def _at_shutdown() -> None:
    """Write the recording so far before the engine stops; keep recording for a later init()."""
    session = _session
    if session is None:
        return
    if _dying_from is not None:
        # The other ranks may be waiting for a collective this rank will never submit.
        _write_parts(session, session.part(session.counters(runtime.engine())), runtime.settings())
        return
    try:
        write(session)  # may end the recording (the failure path)
    except OSError as err:
        # The job has run; the file it was to leave cannot be written (its directory was
        # removed, the disk is full). The shutdown goes on, and then fails the job naming it.
        _end(session)
        raise runtime.ShutdownError(f"the profile was not written: cannot write {err.filename}: "
                                    f"{err.strerror or err}") from None
    if _session is session:
        session.engine_counters = session.counters(runtime.engine())  # that engine is about to stop


def write(session: Session) -> None:
    """Gather every rank's part to rank 0 through the engine and write the file there."""
    part = session.part(session.counters(runtime.engine()))
    session.recorder.paused = True  # the gather is the profiler's, not the job's
    try:
        parts = _gather_to_rank_0(part)
    except (HorovodInternalError, TimeoutError):
        _write_parts(session, part, runtime.settings())
        return
    finally:
        session.recorder.paused = False
    if parts is not None:
        _write_json(session.path, session.document(parts, runtime.settings()))


def _gather_to_rank_0(part: Dict[str, Any]) -> Optional[List[Dict[str, Any]]]:
    """Every rank's ``part``, in rank order, on rank 0 (None on the others).

    Raises:
        TimeoutError: the gather had not finished within ``GATHER_DEADLINE_S``.

    The engine has no gather; an alltoall in which each rank sends all of its bytes to rank 0
    and none to the others is one, so no other rank holds every rank's part (an allgather
    would: tens of MB each on a long run).
    """
    payload = objects.to_tensor(part)
    splits = [payload.numel()] + [0] * (runtime.size() - 1)
    handle = alltoall_async(payload, splits=splits, name="hpdl.profile.gather")
    deadline = time.monotonic() + GATHER_DEADLINE_S
    while not poll(handle):
        if time.monotonic() > deadline:
            # Left pending: stopping this rank's engine next fails it here and on the peers.
            raise TimeoutError(f"the profile's gather did not finish within {GATHER_DEADLINE_S:g} s")
        time.sleep(0.005)
    received, counts = synchronize(handle)
    if runtime.rank() != 0:
        return None
    counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
    return objects.objects_in(received, counts)


def _write_parts(session: Session, part: Dict[str, Any], settings) -> None:
    """The failure path: every rank writes its part; rank 0 merges the parts it finds.

    The recording ends here: after a failure the job is over.
    """
    _end(session)
    own = f"{session.path}.rank{session.rank}"
    _write_json(own, session.document([part], settings))
    if session.rank != 0:
        if _join_written(session, part):
            os.remove(own)
        return
    wanted = [f"{session.path}.rank{r}" for r in range(1, session.size)]
    # The others write theirs at the same moment (their engines failed in the same round).
    deadline = time.monotonic() + _PART_WAIT_S
    while time.monotonic() < deadline and not all(os.path.exists(p) for p in wanted):
        time.sleep(0.1)
    parts = [part]
    merged = [own]
    for path in wanted:
        try:
            parts.extend(schema.load(path)["ranks"])
            merged.append(path)
        except schema.ProfileError:
            continue  # absent: that rank is reported missing
    _write_json(session.path, session.document(parts, settings))
    for path in merged:
        os.remove(path)


def _join_written(session: Session, part: Dict[str, Any]) -> bool:
    """Add this rank's part to the file rank 0 has already written without it; whether it did.

    A rank that reaches ``shutdown()`` more than ``GATHER_DEADLINE_S`` after rank 0 fails its
    gather only once rank 0 has given up, written the file naming this rank missing, and
    stopped its engine. Where the file is visible here (a shared file system), the part joins
    it, under a lock on the directory as other late ranks may do the same; elsewhere it stays
    in ``FILE.rank<N>``.
    """
    try:
        import fcntl
    except ImportError:  # not a POSIX system: no lock to take, so no merge
        return False
    try:
        fd = os.open(os.path.dirname(session.path), os.O_RDONLY)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: the part stays beside the file
            return False
        try:
            document = schema.load(session.path)
        except schema.ProfileError:
            return False  # not written (rank 0 died first), or not readable: the part stays
        job = document["job"]
        # The time origin is rank 0's clock reading at the recording's start, the same on every rank.
        same_recording = job.get("origin_us") == session.clock.origin_us and job.get("size") == session.size
        if not same_recording or session.rank not in job.get("missing_ranks", ()):
            return False
        document["ranks"] = sorted(document["ranks"] + [part], key=lambda p: p["rank"])
        job["missing_ranks"] = [r for r in job["missing_ranks"] if r != session.rank]
        _write_json(session.path, document)
        return True
    finally:
        os.close(fd)  # releases the lock


def _write_json(path: str, document: Dict[str, Any]) -> None:
    """Replace ``path`` atomically with ``document`` (no temp file left on failure).

    Raises:
        OSError: whose message names ``path`` (not the temp file) and says why.
    """
    atomic_write(path, lambda f: f.write(json.dumps(document, separators=(",", ":")).encode()))


def _at_init() -> None:
    """Start the recording ``HPDL_PROFILE`` names, at the end of each ``hvd.init()``."""
    path = runtime.settings().profile
    if path:
        start_profile(path)


runtime.add_startup_hook(_at_init)
