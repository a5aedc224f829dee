"""The profiler's memory on a long run: one rank's recorder with both windows full.

Feeds a recorder made-up engine events (no job, no torch) until its window of raw collectives
and its window of steps are full, and measures with ``tracemalloc`` what the recorder holds,
how large this rank's part of the file is (pickled, as it is sent to rank 0), and the most
that building and pickling the part takes beside the recorder.

Usage (docs/profile.md quotes the figures):
    python scripts/profile_memory.py                 # 35 tensors per message, names repeat every step
    python scripts/profile_memory.py --tensors 1     # unfused messages
    python scripts/profile_memory.py --new-names     # a new name for every tensor of every call
"""

from __future__ import annotations

import argparse
import pickle
import tracemalloc

from hpdl.engine import events as ev
from hpdl.profile import recorder as rec


def fill(recorder: rec.Recorder, tensors: int, new_names: bool) -> None:
    """Record RAW_WINDOW collectives of ``tensors`` fused tensors (147 KiB each), then STEP_WINDOW steps."""
    names = tuple(f"allreduce.body.{i}.body.0.weight" for i in range(tensors))
    sizes = [147456] * tensors
    t = 0.0
    for call in range(rec.RAW_WINDOW):
        if new_names:
            names = tuple(f"user.tensor.{call}.{i}" for i in range(tensors))
        for name in names:
            recorder.observe(ev.Event(ev.QUEUED, "allreduce", (name,), t))
            recorder.observe(ev.Event(ev.NEGOTIATED, "allreduce", (name,), t + 5, drained_us=t + 2))
        # The engine builds new tuples for every collective's event.
        common = dict(kind="allreduce", names=tuple(names), nbytes=sum(sizes), fused=tensors)
        recorder.observe(ev.Event(ev.MEMCPY_IN, time_us=t + 6, duration_us=3.3, **common))
        recorder.observe(ev.Event(ev.COLLECTIVE, time_us=t + 10, duration_us=100.7, sizes=tuple(sizes),
                                  dtype="float32", backend="mpi", **common))
        recorder.observe(ev.Event(ev.MEMCPY_OUT, time_us=t + 111, duration_us=3.3, **common))
        for name in names:
            recorder.observe(ev.Event(ev.DONE, "allreduce", (name,), t + 115))
        t += 200.3
    for step in range(rec.STEP_WINDOW):
        recorder.observe(ev.Event(ev.STEP, "step", (), t + step * 1000.7, duration_us=12.3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=35, help="tensors fused per message (default 35)")
    parser.add_argument("--new-names", action="store_true", help="a new name for every tensor of every call")
    args = parser.parse_args()
    tracemalloc.start()
    recorder = rec.Recorder(rank=0, zero_us=0.0)
    fill(recorder, args.tensors, args.new_names)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    part = pickle.dumps(recorder.snapshot(), protocol=pickle.HIGHEST_PROTOCOL)
    extra = tracemalloc.get_traced_memory()[1] - held
    print(f"{args.tensors} tensors per message, {'new' if args.new_names else 'repeating'} names: "
          f"recorder {held / 1e6:.1f} MB; part {len(part) / 1e6:.1f} MB pickled; "
          f"building it took up to {extra / 1e6:.1f} MB more")


if __name__ == "__main__":
    main()
