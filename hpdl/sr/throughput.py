"""Measure whether the data pipeline can feed training: patches/s delivered vs. images/s trained.

Run ``python -m hpdl.sr.throughput [--json]``. Both functions return records (medians over
``repeats`` timed runs, with min and max), so a benchmark command can print or collect them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Dict, List, Optional

import torch
from torch.utils.data import DataLoader

from hpdl.sr.datasets import build_train_dataset
from hpdl.sr.models import build_model
from hpdl.sr.sampler import ShardSampler

__all__ = ["measure_model", "measure_pipeline", "main"]


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


def main(argv: Optional[List[str]] = None) -> int:
    """Measure both and print a table (or JSON records)."""
    parser = argparse.ArgumentParser(prog="python -m hpdl.sr.throughput", description=__doc__)
    parser.add_argument("--data", default="embedded")
    parser.add_argument("--scale", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache-dir")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    records = [
        measure_pipeline(args.data, args.scale, num_workers=args.workers, cache_dir=args.cache_dir),
        measure_model("edsr_baseline", args.scale),
    ]
    if args.json:
        print(json.dumps(records, indent=2))
        return 0
    for r in records:
        print(f"{r['what']:<40} {r['median']:10.1f} {r['unit']:<10} (min {r['min']:.1f}, max {r['max']:.1f})")
    ratio = records[0]["median"] / records[1]["median"]
    print(f"the pipeline delivers {ratio:.0f}x what one training thread consumes")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
