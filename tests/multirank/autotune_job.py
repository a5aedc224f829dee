"""A training-like loop under HPDL_AUTOTUNE: every step allreduces tensors of mixed sizes (some
fused, some alone) and checks every result exactly, while rank 0's autotuner changes the fusion
threshold and the cycle time under the job. At the end every rank reports the parameters it
runs with and the distinct ones it saw."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import assert_equal, run_main

import hpdl.torch as hvd
from hpdl.torch import runtime

SIZES = [1000, 300_000, 20_000, 70_000, 5, 400_000, 1500, 120_000, 60_000, 9000]  # elements, float32


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    steps = int(os.environ.get("AUTOTUNE_JOB_STEPS", "50"))
    engine = runtime.engine()
    seen = set()
    for step in range(steps):
        tensors = [torch.full((n,), float(rank + step + i)) for i, n in enumerate(SIZES)]
        handles = [hvd.allreduce_async_(t, name=f"grad.{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
        for i, handle in enumerate(handles):
            expected = torch.full((SIZES[i],), float(sum(range(size)) + size * (step + i)))
            assert_equal(hvd.synchronize(handle), expected, f"step {step} tensor {i}")
        params = engine.parameters()
        seen.add((params["fusion_threshold"], params["cycle_time_ms"]))
    final = engine.parameters()
    everyone = hvd.allgather_object((final["fusion_threshold"], final["cycle_time_ms"], sorted(seen)))
    if rank == 0:
        finals = {(f, c) for f, c, _ in everyone}
        assert len(finals) == 1, f"the ranks ended with different parameters: {everyone}"
        fusion, cycle = finals.pop()
        print(f"final fusion_threshold={fusion} cycle_time_ms={cycle:g} autotuning={final['autotuning']}")
        print(f"distinct parameters seen per rank: {[len(s) for _, _, s in everyone]}")
        tuned = [set(s) for _, _, s in everyone]
        # Every tuned value lasts a whole sample, so every rank ran with each of them (from
        # the first round on: step 0 already ran with the tuner's first parameters).
        assert all(s == tuned[0] for s in tuned), f"the ranks ran with different parameters: {tuned}"
        print("parameters seen: " + json.dumps(sorted(tuned[0])))
    hvd.shutdown()
    print(f"OK autotune rank {rank}")


if __name__ == "__main__":
    run_main(main)
