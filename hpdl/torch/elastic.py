"""``hvd.elastic``: Horovod's elastic training API, for a job whose ranks stay the same.

Horovod's elastic scripts keep their training state in a ``State`` (``TorchState(model,
optimizer, epoch=0, ...)``), wrap their training function in ``@hvd.elastic.run``, call
``state.commit()`` every few batches, and read their data through an ``ElasticSampler`` that
records what each batch consumed. Under Horovod's elastic driver (``horovodrun --min-np``),
ranks may then leave or join: the survivors restore the last committed state, the world is
formed again, and rank 0's state is sent to every rank.

hpdl runs these scripts unchanged, with the ranks its launcher started: ``run`` sends rank 0's
state to every rank before the function starts (so every rank begins from the same model,
optimizer, sampler position and counters), ``commit`` / ``restore`` keep and bring back a copy
in memory, and the sampler partitions the epoch's remaining indices over the ranks as Horovod's
does. What it does not do is change the set of ranks: no driver discovers hosts, so hpdl never
raises ``HostsUpdatedInterrupt`` (a script may), and a lost rank ends the whole job as without elastic
(docs/api.md, "A failed job ends"). ``run`` then restores the last committed state before the
error propagates, so a handler in the script (saving a checkpoint, say) sees the committed
state rather than a half-finished batch. The launcher's elastic options stay refused.
"""

from __future__ import annotations

import copy
import functools
import math
import random
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from hpdl.engine import HorovodInternalError
from hpdl.torch.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from hpdl.torch.runtime import rank, size

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's signal that the set of hosts changed. hpdl never raises it (the ranks are
    fixed); a script may, and ``run`` then starts the function again, as Horovod's does."""

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
        """Functions to call after the ranks change (never, here: kept for Horovod's scripts)."""
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
        """Horovod raises HostsUpdatedInterrupt here when hosts came or went; the ranks of an
        hpdl job never change, so there is nothing to check."""

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def reset(self) -> None:
        """Reset objects after the ranks changed, before the next sync (a hook for subclasses)."""


class ObjectState(State):
    """State of plain Python objects, given as keyword arguments and kept as attributes."""

    def __init__(self, bcast_object: Callable[[Any], Any] = broadcast_object, get_rank: Callable[[], int] = rank,
                 **kwargs: Any):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        # A copy: an object changed in place after the commit (a list appended to) must not
        # change what restore() brings back. An object that cannot be copied is kept as it is,
        # as Horovod keeps every one.
        self._saved_state = {attr: _copied(getattr(self, attr)) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, _copied(value))


def _copied(value: Any) -> Any:
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - locks, files, generators...: kept by reference
        return value


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions a data set over the ranks, like ``DistributedSampler``, and remembers how far
    the epoch got, so that restored state continues where it was committed.

    Call ``record_batch`` after each batch and ``set_epoch`` at the end of each epoch (not the
    start: a partly done epoch must not be repeated).
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: List[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: a new order (with shuffle) and nothing processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count a batch of ``batch_size`` samples on every rank as processed."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: List[int]) -> None:
        """Count these indices of this rank as processed (every rank records as many)."""
        self.processed_num += len(indices) * self.num_replicas

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: Dict[str, int]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Partition what is left of the epoch over the ranks of the job."""
        self.num_replicas = size()
        self.rank = rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:  # the same order on every rank: the seed and the epoch decide it
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = self.remaining_indices[:]
        indices += indices[:self.total_size - len(indices)]  # padded to divide evenly, as Horovod's
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


class _ModelHandler:
    def __init__(self, model: torch.nn.Module):
        self.value = model
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_ModelHandler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_ModelHandler):
    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


_HANDLERS: List[Tuple[type, type]] = [
    (torch.nn.Module, _ModelHandler), (torch.optim.Optimizer, _OptimizerHandler), (ElasticSampler, _SamplerHandler),
]


def _handler(value: Any) -> Optional[_ModelHandler]:
    for kind, handler in _HANDLERS:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """State of a PyTorch training: models, optimizers and ElasticSamplers (by their
    ``state_dict``), and any other keyword argument as a plain object (``epoch=0``, ``batch=0``).

    ``sync`` broadcasts rank 0's parameters, optimizer state, sampler position and objects;
    ``commit`` keeps copies of them in memory; ``restore`` loads the copies back.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 **kwargs: Any):
        kwargs.update(model=model, optimizer=optimizer)
        handlers: Dict[str, _ModelHandler] = {}
        plain: Dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = _handler(value)
            if handler is not None:
                handlers[name] = handler
            else:
                plain[name] = value
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        # A model, optimizer or sampler replaced by assignment is tracked from then on, and
        # its state at that moment is what restore() goes back to (as Horovod's).
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handler = type(handlers[name])(value)
            handlers[name] = handler
        super().__setattr__(name, value)


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func(state, ...)`` from rank 0's state, as Horovod's ``hvd.elastic.run``.

    Every rank first receives rank 0's state (``state.sync()``), so all start from the same
    point. A ``HostsUpdatedInterrupt`` raised by the function (Horovod's driver raises it from
    ``commit``; here only the script can) starts it again as in Horovod: the reset callbacks
    run, then the state is synced again unless the interrupt says ``skip_sync``. The ranks
    never change here: when a collective fails (a rank or node lost), the last committed state
    is restored and the error propagates, and the job ends as any failed hpdl job does.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        while True:
            if not skip_sync:
                state.sync()
            try:
                return func(state, *args, **kwargs)
            except HorovodInternalError:
                state.restore()
                raise
            except HostsUpdatedInterrupt as interrupt:
                skip_sync = interrupt.skip_sync
            state.on_reset()

    return wrapper
