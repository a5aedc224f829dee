"""Horovod's ``TorchState``: models, optimizers, LR schedulers and samplers kept in step by
handlers, and the registry a script extends to keep other objects the same way."""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Tuple

import torch

from hpdl.torch.elastic.common import ObjectState
from hpdl.torch.elastic.sampler import ElasticSampler
from hpdl.torch.functions import broadcast_optimizer_state, broadcast_parameters
from hpdl.torch.object_ops import broadcast_object
from hpdl.torch.runtime import rank

__all__ = ["LRSchedulerStateHandler", "ModelStateHandler", "OptimizerStateHandler", "SamplerStateHandler",
           "StateHandler", "TorchState", "get_handler_registry", "set_handler_registry"]


class StateHandler:
    """Keeps one object of a TorchState: ``save`` a copy, ``restore`` it, ``sync`` rank 0's."""

    def __init__(self, value: Any):
        self.value = value

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def reset(self) -> None:
        """The world changed (``hvd.elastic.run`` formed a new one): adapt to its ranks."""

    def set_value(self, value: Any) -> None:
        """Track ``value`` from now on; its state now is what ``restore`` goes back to."""
        self.value = value
        self.save()

    def snapshot(self) -> Any:
        """What ``save`` kept, for the snapshot on disk that a job restarted by torchrun's elastic
        agent resumes from (hpdl's handlers keep it in ``_saved``; a handler that keeps it
        elsewhere overrides this and ``load_snapshot``)."""
        try:
            return self._saved
        except AttributeError:
            raise NotImplementedError(f"{type(self).__name__} keeps no _saved copy") from None

    def load_snapshot(self, saved: Any) -> None:
        """Make ``saved`` (as ``snapshot`` gave it) what ``restore`` brings back."""
        self._saved = saved


class ModelStateHandler(StateHandler):
    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(ModelStateHandler):
    def restore(self) -> None:
        # A copy: an optimizer's load_state_dict keeps the tensors it is given (the momentum
        # buffers), which its steps then change in place, and the saved copy with them.
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _StateDictHandler(ModelStateHandler):
    """Keeps an object by its ``state_dict()``, sent from rank 0 as a pickled object."""

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


class LRSchedulerStateHandler(_StateDictHandler):
    """An LR scheduler, by its ``state_dict()``: that pickles where the scheduler itself may not
    (it holds its optimizer, and a DistributedOptimizer keeps weak references)."""


class SamplerStateHandler(_StateDictHandler):
    """An ElasticSampler, by its ``state_dict()`` (its position in the epoch); partitioned
    again over the new world's ranks at a reset, synced or not."""

    def reset(self) -> None:
        self.value.reset()


# Horovod registers its LRSchedulerStateHandler for torch's _LRScheduler, which the schedulers
# of PyTorch 2 no longer derive from; LRScheduler is their base (and _LRScheduler's).
_handler_registry: List[Tuple[type, type]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (torch.optim.lr_scheduler.LRScheduler, LRSchedulerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> List[Tuple[type, type]]:
    """The (type, handler class) pairs TorchState looks through, in order, for each keyword."""
    return _handler_registry


def set_handler_registry(registry: List[Tuple[type, type]]) -> None:
    global _handler_registry
    _handler_registry = registry


def _handler(value: Any) -> Optional[StateHandler]:
    for kind, handler in _handler_registry:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """State of a PyTorch training: models, optimizers, LR schedulers and ElasticSamplers (by
    their ``state_dict``), and any other keyword argument as a plain object (``epoch=0``).

    ``sync`` broadcasts rank 0's parameters, optimizer state, sampler position and objects;
    ``commit`` keeps copies of them in memory (and, under torchrun's elastic agent, on disk);
    ``restore`` loads the copies back.
    """

    unsendable_advice = ("keep such an object by its state_dict() through a StateHandler, added to "
                         "hvd.elastic.state.get_handler_registry() as (its type, the handler class) before the "
                         "TorchState is made (docs/api.md, hvd.elastic)")

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 **kwargs: Any):
        kwargs.update(model=model, optimizer=optimizer)
        handlers: Dict[str, StateHandler] = {}
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

    def _snapshot_payload(self) -> Optional[Dict[str, Any]]:
        payload = super()._snapshot_payload()
        payload["handlers"] = {name: handler.snapshot() for name, handler in self._handlers.items()}
        return payload

    def _load_snapshot(self, payload: Dict[str, Any]) -> None:
        for name, handler in self._handlers.items():
            handler.load_snapshot(payload["handlers"][name])
        super()._load_snapshot(payload)

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()
        super().reset()

    def __setattr__(self, name: str, value: Any) -> None:
        # A model, optimizer or sampler replaced by assignment is tracked from then on, and
        # its state at that moment is what restore() goes back to (as Horovod's).
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)
