"""Measure whether the data pipeline can feed training: patches/s delivered vs. images/s trained.

``hpdl bench pipeline`` runs both and prints them side by side. Both functions return records
(medians over ``repeats`` timed runs, with min and max), so a benchmark command can print or
collect them.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Optional

import torch
from torch.utils.data import DataLoader

from hpdl.sr.datasets import build_train_dataset
from hpdl.sr.models import build_model
from hpdl.sr.sampler import ShardSampler

__all__ = ["measure_model", "measure_pipeline"]


def _summary(rates: List[float]) -> Dict[str, float]:
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}


def measure_pipeline(
    data: str = "embedded",
    scale: int = 2,
    *,
    patch_size: int = 48,
    batch_size: int = 16,
    num_workers: int = 2,
    batches: int = 100,
    repeats: int = 3,
    cache_dir: Optional[str] = None,
) -> Dict[str, Any]:
    """Return the patches/s a DataLoader over ``TrainPatches`` delivers (after worker start-up)."""
    dataset = build_train_dataset(data, scale, patch_size=patch_size, repeat=10_000, cache_dir=cache_dir)
    sampler = ShardSampler(dataset, rank=0, num_replicas=1, seed=0)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers)
    rates = []
    for epoch in range(repeats):
        sampler.set_epoch(epoch)
        dataset.set_epoch(epoch)
        it = iter(loader)
        next(it)  # the first batch pays for starting the workers
        start = time.perf_counter()
        for _ in range(batches):
            next(it)
        rates.append(batches * batch_size / (time.perf_counter() - start))
        del it  # shut the workers down before the next repeat
    return {
        "what": "data pipeline",
        "unit": "patches/s",
        "patch_size": patch_size,
        "scale": scale,
        "batch_size": batch_size,
        "num_workers": num_workers,
        **_summary(rates),
    }


def measure_model(
    name: str = "edsr_baseline",
    scale: int = 2,
    *,
    patch_size: int = 48,
    batch_size: int = 4,
    steps: int = 5,
    repeats: int = 3,
    threads: int = 1,
) -> Dict[str, Any]:
    """Return the images/s of forward + L1 loss + backward on random patches with ``threads`` threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = build_model(name, scale).train()
        lr = torch.rand(batch_size, 3, patch_size, patch_size) * 255
        hr = torch.rand(batch_size, 3, patch_size * scale, patch_size * scale) * 255

        def step() -> None:
            model.zero_grad(set_to_none=True)
            torch.nn.functional.l1_loss(model(lr), hr).backward()

        step()  # warm-up: allocator and kernel selection
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(steps):
                step()
            rates.append(steps * batch_size / (time.perf_counter() - start))
    finally:
        torch.set_num_threads(previous)
    return {
        "what": f"{name} x{scale} forward+backward",
        "unit": "images/s",
        "patch_size": patch_size,
        "batch_size": batch_size,
        "threads": threads,
        **_summary(rates),
    }
