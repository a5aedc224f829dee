"""Horovod's ``ElasticSampler``: the data set partitioned over the ranks, resumable mid-epoch."""

from __future__ import annotations

import math
import random
from typing import Any, Dict, List

import torch

from hpdl.torch.runtime import rank, size

__all__ = ["ElasticSampler"]


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
        self.processed_indices: set = set()  # Horovod's attribute; the position is processed_num
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
        self.indices = indices[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
