"""State kept in step across the ranks of an elastic script: Horovod's ``State`` and
``ObjectState`` (``horovod.common.elastic``), on fixed ranks; and, under torchrun's elastic
agent, the snapshot on disk that a restarted job resumes from (``resume_from_snapshot``)."""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional

from hpdl.comm import objects
from hpdl.torch import membership
from hpdl.torch.elastic import snapshot
from hpdl.torch.object_ops import allgather_object, broadcast_object
from hpdl.torch.runtime import rank

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "forget_snapshot", "resume_from_snapshot"]


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's signal that the set of hosts changed: ``commit()`` raises it on every rank
    alike in an elastic job whose driver added or removed hosts (``skip_sync``: only removed,
    so every rank's state is current and nothing is rolled back or sent); ``run`` then forms
    the new world and starts the function again. A script may raise it too."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the hosts of the job changed")
        self.skip_sync = skip_sync


class State:
    """Training state kept in step across the ranks: ``sync`` sends rank 0's to every rank,
    ``commit`` keeps a copy (and, in Horovod, checks for host changes), ``restore`` brings the
    last copy back."""

    def __init__(self, bcast_object: Callable[[Any], Any] = broadcast_object, get_rank: Callable[[], int] = rank):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: List[Callable[[], None]] = []
        self._commits = 0  # commits so far; after torchrun restarted the job, counted on from its snapshot
        # Where commits are kept on disk, under torchrun's elastic agent (set by run; else None).
        self._snapshots: Optional[snapshot.JobSnapshots] = None

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Functions to call when ``run`` starts the function again (after a
        ``HostsUpdatedInterrupt``): in Horovod, after the ranks changed."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Keep the current state in memory as the one ``restore`` returns to (under torchrun's
        elastic agent, on disk too: the one a restarted job resumes from)."""
        self.save()
        self._commits += 1
        self._write_snapshot()
        self.check_host_updates()

    def _write_snapshot(self) -> None:
        """Under torchrun's agent, local rank 0 keeps what ``save`` kept on disk; a state that
        cannot be written is said once, and the training goes on."""
        snapshots = self._snapshots
        if snapshots is None or not snapshots.writer:
            return
        try:
            payload = self._snapshot_payload()
            if payload is None:
                snapshot.warn_once(f"hpdl: a {type(self).__name__} cannot be kept in an elastic snapshot (only an "
                                   "ObjectState or TorchState can); after torchrun restarts the job, the training "
                                   "starts from the script's state")
                return
            snapshots.write(self._commits, payload)
        except Exception as err:  # noqa: BLE001 - pickling and the file system raise many types
            snapshot.warn_once(f"hpdl: the elastic snapshot {snapshots.path} cannot be written ({type(err).__name__}: "
                               f"{err}); after torchrun restarts the job, the training starts from an earlier commit "
                               "or the script's state")

    def _snapshot_payload(self) -> Optional[Dict[str, Any]]:
        """What ``save`` kept, for the snapshot on disk: a dict of sections (ObjectState's
        ``objects``, TorchState's ``handlers``), each a dict by name; None where this state
        cannot give it (a State of the script's own)."""
        return None

    def _load_snapshot(self, payload: Dict[str, Any]) -> None:
        """Make ``payload`` (as ``_snapshot_payload`` gave it) what ``restore`` brings back."""
        raise NotImplementedError()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank when the elastic driver has changed the
        hosts since this world formed (rank 0's reading, sent to every rank, decides, so that
        all raise at the same commit, as Horovod's). Outside an elastic job: nothing to check."""
        member = membership.current()
        if member is None or member.generation < 0:
            return
        seen = member.host_updates() if self._rank() == 0 else None
        count, added = self._bcast_object(seen)
        if count > member.updates_seen:
            member.updates_seen = count
            raise HostsUpdatedInterrupt(skip_sync=not added)

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def reset(self) -> None:
        """Reset objects after the ranks changed, before the next sync (a hook for subclasses)."""


class ObjectState(State):
    """State of plain Python objects, given as keyword arguments and kept as attributes.

    ``sync`` sends rank 0's committed values (those given, until the first commit), as
    Horovod's does. Unlike Horovod, which keeps references, a commit keeps copies: an object
    changed in place after it (a list appended to) is back as committed after ``restore``.
    """

    # What a script can do about an object that cannot be pickled (TorchState has a better way).
    unsendable_advice = "give the state what can be pickled instead (the object's state_dict(), say)"

    def __init__(self, bcast_object: Callable[[Any], Any] = broadcast_object, get_rank: Callable[[], int] = rank,
                 **kwargs: Any):
        self._saved_state = kwargs
        for attr, value in kwargs.items():  # the objects given, as Horovod's: a script may hold them too
            setattr(self, attr, value)
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {attr: _copied(getattr(self, attr)) for attr in self._saved_state}

    def _snapshot_payload(self) -> Optional[Dict[str, Any]]:
        return {"objects": dict(self._saved_state)}

    def _load_snapshot(self, payload: Dict[str, Any]) -> None:
        self._saved_state = dict(payload["objects"])

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            try:
                self._saved_state = self._bcast_object(self._saved_state)
            except ValueError as err:
                raise ValueError(self._unsendable(err)) from None
            self._set_attrs()

    def _unsendable(self, err: ValueError) -> str:
        """The broadcast's error, naming the objects that cannot be pickled and what to do.

        Only rank 0 pickles; the other ranks hold the same kinds of objects (the same script),
        so each looks at its own to name them.
        """
        failures = [why for why in (objects.pickled(value, attr, by_value=True)[1]
                                    for attr, value in self._saved_state.items()) if why]
        if not failures:
            return f"{err}; {self.unsendable_advice}"
        return (f"{type(self).__name__} cannot send its objects from rank 0 to the other ranks: "
                f"{'; '.join(failures)}; {self.unsendable_advice}")

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, _copied(value))


def resume_from_snapshot(state: State, function: str) -> None:
    """Under torchrun's elastic agent, before ``run``'s first sync: the newest commit any rank's
    node kept on disk becomes every rank's state (what ``restore`` brings back, restored), so a
    job whose workers torchrun restarted goes on from its last commit.

    Every rank says which commit its node's snapshot holds (-1: none); where some hold an older
    one or none, the lowest rank with the newest sends its file's bytes to every rank. Every
    rank then loads the same commit and counts its commits on from it; nothing is sent where no
    rank has one. Elsewhere (not under torchrun's agent, ``HPDL_ELASTIC_SNAPSHOT=0``) nothing
    happens and nothing is written.
    """
    snapshots = snapshot.this_job(function)
    state._snapshots = None
    if snapshots is None:
        return
    try:
        layout = _layout(state._snapshot_payload())
    except Exception:  # noqa: BLE001 - a handler that keeps no copy it can give (NotImplementedError, ...)
        layout = None
    if layout is None:
        # Every rank runs the same script, so all skip the exchange below alike.
        if snapshots.writer:
            snapshot.warn_once(f"hpdl: a {type(state).__name__} with these objects cannot be kept in an elastic "
                               "snapshot; after torchrun restarts the job, the training starts from the script's state")
        return
    state._snapshots = snapshots
    found = snapshots.read()
    if found is not None and _layout(found.payload) != layout:
        if snapshots.writer:
            snapshot.warn_once(f"hpdl: the elastic snapshot {snapshots.path} holds other objects than this "
                               f"{type(state).__name__} ({_layout(found.payload)}); the training starts from the "
                               "script's state")
        found = None
    mine = -1 if found is None else found.commits
    commits = allgather_object(mine, name="elastic.snapshot.commits")
    newest = max(commits)
    if newest < 0:
        return
    if min(commits) < newest:
        holder = commits.index(newest)
        data = broadcast_object(found.data if state._rank() == holder else None, root_rank=holder,
                                name="elastic.snapshot")
        if mine < newest:
            found = snapshot.JobSnapshots.parse(data)
    state._load_snapshot(found.payload)
    state.restore()
    state._commits = newest


def forget_snapshot(state: State) -> None:
    """``run``'s function returned: its snapshot is no longer needed (local rank 0 removes it,
    and the job's directory once empty)."""
    snapshots, state._snapshots = state._snapshots, None
    if snapshots is not None:
        snapshots.remove()


def _layout(payload: Optional[Dict[str, Any]]) -> Optional[Dict[str, List[str]]]:
    """The names a payload holds, section by section: two payloads fit the same state when equal."""
    if not isinstance(payload, dict):
        return None
    return {section: sorted(values) for section, values in sorted(payload.items())}


def _copied(value: Any) -> Any:
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - locks, files, generators...: kept by reference, as Horovod keeps all
        return value
