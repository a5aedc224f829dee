"""Random numbers in a spatial forward: each band its own stream, never the same mask everywhere.

Ranks that train together usually share a seed (so that their models start alike), and a
random operation run on every band with one generator state would give every band the same
numbers: ``nn.Dropout`` would drop the same pixels in each band, a pattern repeated down the
image. So every random operation on a part (dropout, ``rand_like``, ``bernoulli``, rrelu in
training) runs on a generator seeded for that call and that band alone, from three things:

- the forward's base, drawn from the group's first rank's default generator as the forward
  starts and agreed by the group (parallel.py), so that the numbers follow ``torch.manual_seed``
  on that rank (every rank draws one number, so their generators stay in step);
- the call's place in the forward (the first random call, the second, ...), which backward's
  recomputation of a checkpointed block replays;
- the band (the rank in the group); a replicated tensor (after global pooling) takes one
  stream on every rank of the group, as it must stay the same there.

A run is reproduced by the same seed on the group's first rank, the same grid and the same
model: the masks then are the same, call by call and band by band. They are not the masks one
process draws for the whole image (no generator can be split by rows), but every pixel is
dropped with the same probability, independently of the others.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, List

import torch

from hpdl.torch.spatial.lengths import to_local, to_whole

_MASK = (1 << 63) - 1
REPLICATED = -1  # the "band" of a replicated tensor: one stream for the group


def draw_base() -> int:
    """One number from this rank's default generator: the forward's base where this is the
    group's first rank (every rank draws, so that their generators stay in step)."""
    return int(torch.randint(0, 1 << 62, (1,)).item())


def seed(base: int, call: int, band: int) -> int:
    """The seed of random call number ``call`` of a forward, on ``band``: a mix of the three
    (SplitMix64's finaliser, so that nearby calls and bands get unrelated streams)."""
    z = (base + 0x9E3779B97F4A7C15 * (call + 1) + 0xBF58476D1CE4E5B9 * (band + 2)) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK


# The default generators are the process's: one thread at a time seeds them for its call (the
# random operations take no generator of their own). Another thread drawing from them at that
# moment without this lock would draw from the band's stream.
_seeding = threading.Lock()


@contextlib.contextmanager
def seeded(value: int, devices: List[torch.device]) -> Iterator[None]:
    """Run the block with the default generators (the CPU's, and each CUDA device's among
    ``devices``) seeded with ``value``; their states are restored afterwards."""
    cuda = sorted({d.index if d.index is not None else torch.cuda.current_device()
                   for d in devices if d.type == "cuda"})
    with _seeding, torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.random.default_generator.manual_seed(value)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(value)
        yield


def devices_of(values) -> List[torch.device]:
    out: List[torch.device] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value.device)
        elif isinstance(value, (list, tuple)):
            out.extend(devices_of(value))
    return out



def draw(ctx, func, band: int, args, kwargs, local: bool = False):
    """``func`` (a random call of the forward running with ``ctx``) drawn from ``band``'s
    stream, with the whole image's lengths (or the part's own: ``local``) where its arguments
    hold lengths read from a part. A dry run (shapes only) draws nothing."""
    if ctx.dry:
        return func(*args, **kwargs)
    call = ctx.random_calls
    ctx.random_calls += 1
    convert = to_local if local else to_whole
    with seeded(seed(ctx.random_base, call, band), devices_of(list(args) + list(kwargs.values()))):
        return func(*convert(args), **convert(kwargs))
