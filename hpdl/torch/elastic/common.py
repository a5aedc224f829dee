"""State kept in step across the ranks of an elastic script: Horovod's ``State`` and
``ObjectState`` (``horovod.common.elastic``), on fixed ranks."""

from __future__ import annotations

import copy
from typing import Any, Callable, List

from hpdl.comm import objects
from hpdl.torch import membership
from hpdl.torch.object_ops import broadcast_object
from hpdl.torch.runtime import rank

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State"]


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

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Functions to call when ``run`` starts the function again (after a
        ``HostsUpdatedInterrupt``): in Horovod, after the ranks changed."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Keep the current state in memory as the one ``restore`` returns to."""
        self.save()
        self.check_host_updates()

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


def _copied(value: Any) -> Any:
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - locks, files, generators...: kept by reference, as Horovod keeps all
        return value
