"""A distributed sampler that shards indices by rank, reshuffles per epoch, and resumes mid-epoch.

Like ``torch.utils.data.DistributedSampler``, every rank draws the same seeded permutation of
the epoch, padded (by wrapping around) to a multiple of the number of replicas, and takes
every ``num_replicas``-th entry from ``rank``: all ranks get the same number of samples, so no
rank waits in an allreduce that the others never join. Rank and replica count are passed in,
not discovered, so this module does not depend on ``hpdl.torch``.

The resume position is global (samples of the epoch consumed by all ranks together), so a
checkpoint taken with N ranks can also be resumed with a different number of ranks.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sized, Union

import torch
from torch.utils.data import Sampler

__all__ = ["ShardSampler"]


class ShardSampler(Sampler[int]):
    """Yield this rank's share of a per-epoch permutation of ``range(len(data))``.

    Typical loop::

        sampler = ShardSampler(dataset, rank=hvd.rank(), num_replicas=hvd.size(), seed=0)
        sampler.load_state_dict(ckpt["sampler"])        # when resuming
        for epoch in range(sampler.epoch, epochs):
            sampler.set_epoch(epoch)
            for step, batch in enumerate(loader, 1):
                ...
                state = sampler.state_dict(consumed=step * batch_size)

    DataLoader workers prefetch: the sampler hands out indices before the loop uses them, so
    pass ``consumed`` (samples this rank has trained on this epoch) when saving a checkpoint.
    """

    def __init__(
        self,
        data: Union[Sized, int],
        *,
        rank: int,
        num_replicas: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        self.num_samples = data if isinstance(data, int) else len(data)
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"need 0 <= rank < num_replicas, got rank {rank} of {num_replicas}")
        if self.num_samples < 1:
            raise ValueError("cannot sample from an empty dataset")
        self.rank = rank
        self.num_replicas = num_replicas
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self._offset = 0  # global position where the next (or current) pass starts
        self._yielded = 0  # indices this rank has handed out in the current pass

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's permutation; a loaded resume position applies only to its own epoch."""
        if epoch != self.epoch:
            self._offset = 0
        self.epoch = int(epoch)
        self._yielded = 0

    def _order(self) -> List[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(self.num_samples, generator=g).tolist()
        return list(range(self.num_samples))

    def _remaining(self) -> int:
        # Global count of indices left in this epoch, after padding or dropping to a multiple.
        left = max(self.num_samples - self._offset, 0)
        r = self.num_replicas
        if self.drop_last:
            return left // r * r
        if left == 0:
            return 0
        return -(-left // r) * r

    def __len__(self) -> int:
        return self._remaining() // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        total = self._remaining()
        chunk = order[self._offset : self._offset + total]
        # Pad from the start of the epoch's permutation, exactly as an unresumed pass would.
        chunk += order[: total - len(chunk)]
        self._yielded = 0
        for index in chunk[self.rank :: self.num_replicas]:
            self._yielded += 1
            yield index

    def state_dict(self, consumed: Optional[int] = None) -> Dict[str, Any]:
        """Return the resume state; ``consumed`` = samples this rank used in this pass (default: yielded)."""
        used = self._yielded if consumed is None else int(consumed)
        if not 0 <= used <= len(self):
            raise ValueError(f"consumed={used} outside this pass of {len(self)} samples")
        if used == len(self):
            epoch, position = self.epoch + 1, 0  # the epoch is finished
        else:
            epoch, position = self.epoch, self._offset + used * self.num_replicas
        return {
            "epoch": epoch,
            "position": position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "num_replicas": self.num_replicas,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from ``state``: the next pass of ``state["epoch"]`` starts at its position."""
        for key in ("seed", "num_samples", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has {getattr(self, key)!r}"
                )
        position = int(state["position"])
        if not 0 <= position <= self.num_samples:
            raise ValueError(f"sampler position {position} outside 0..{self.num_samples}")
        self.epoch = int(state["epoch"])
        self._offset = position
        self._yielded = 0
